"""The phases of each stage, one function per phase in a registry (as verl's `register_adv_est`): a new stage is
its models (`register_models`) and its phases (`register_phase`), each a function of the `Context` that returns
a typed `Phase` (memory per pool, work per pool, FLOPs).

    ppo, grpo   rollout, reward, logprobs, advantages, update   (the trainer's five phases, one after another)
    dpo         logprobs (policy and reference over the pairs), update
    distill     rollout (--on-policy: the student samples), teacher (its forward), update (the student's)
    sft, rm     step

Colocated placement runs every phase on all GPUs; disaggregated placement gives generation, actor, critic,
reference and reward their own pools (OpenRLHF's Ray layout): within a phase the pools work in parallel and the
phase takes the slowest. Collectives are counted exposed: ZeRO-3 gathers the weights for every forward and
backward (DeepSpeed ZeRO-3 under HF generate: for every decode step, which is what makes DeepSpeed-Chat without
its hybrid engine slow; this trainer's FSDP2 gathers the whole policy once around generate), reduce-scatters
gradients per micro-batch; ZeRO-1/2 reduce-scatter gradients and gather weights per optimizer step; replicated
training all-reduces gradients; vLLM receives the actor's weights once per iteration; tensor parallelism
all-reduces the hidden states twice per layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import fastrlhf.estimate.timing as T
import fastrlhf.estimate.work as W
from fastrlhf.constants import PPO_PHASES
from fastrlhf.estimate.arch import Arch
from fastrlhf.estimate.hardware import Device
from fastrlhf.estimate.memory import (
    DTYPE_BYTES,
    LORA_TRAINED,
    ModelState,
    activation_bytes,
    forward_working_bytes,
    kv_cache_bytes,
    logit_bytes,
    shards_weights,
    state_bytes,
)
from fastrlhf.estimate.spec import Spec, resolved, student_arch
from fastrlhf.estimate.timing import Work

COMPONENTS = ("weights", "gradients", "optimizer", "buffers", "activations", "logits", "kv_cache")


@dataclass
class Memory:
    """Bytes per GPU of one pool in one phase, by component."""

    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    buffers: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    kv_cache: float = 0.0

    @property
    def peak(self) -> int:
        return sum(int(round(getattr(self, c))) for c in COMPONENTS)

    def largest(self) -> str:
        return max(COMPONENTS, key=lambda c: getattr(self, c))

    def at_least(self, **values: float) -> Memory:
        """Each component the larger of what it holds and `values` (models that run one after another)."""
        for name, value in values.items():
            setattr(self, name, max(getattr(self, name), value))
        return self

    def to_json(self) -> dict[str, int]:
        out = {c: int(round(getattr(self, c))) for c in COMPONENTS}
        return out | {"peak": sum(out.values())}


@dataclass
class Phase:
    """One phase: memory and work per pool, FLOPs over all GPUs; its seconds are its slowest pool's."""

    group: str  # rollout, forward, train or host: which cross-validated spread gives its range
    memory: dict[str, Memory]
    work: dict[str, Work]
    flops: float
    work_by_model: dict[str, Work] = field(default_factory=dict)
    engines: int | None = None
    optimizer_steps: int | None = None

    def seconds_by_pool(self) -> dict[str, float]:
        return {pool: float(T.seconds(w)) for pool, w in self.work.items()}

    def slowest(self) -> str | None:
        times = self.seconds_by_pool()
        return max(times, key=times.get) if times else None

    def slowest_work(self) -> Work | None:
        pool = self.slowest()
        return self.work[pool] if pool else None

    @property
    def seconds(self) -> float:
        return max(self.seconds_by_pool().values(), default=0.0)

    def seconds_range(self) -> list[float]:
        work = self.slowest_work()
        return T.time_range(self.seconds, work.kind, self.group) if work else [0.0, 0.0]

    def terms(self) -> dict[str, float]:
        work = self.slowest_work()
        return T.terms(work) if work else {}

    def peak_memory(self) -> Memory:
        return max(self.memory.values(), key=lambda m: m.peak)


@dataclass
class Context:
    """What every phase function reads: the resolved spec, the stage, the actor's shape, the device, the models."""

    spec: Spec
    stage: str
    arch: Arch
    dev: Device
    models: list[ModelState]
    pools: dict[str, int]

    @property
    def by(self) -> dict[str, ModelState]:
        return {m.name: m for m in self.models}

    @property
    def db(self) -> int:
        return DTYPE_BYTES[self.spec.dtype]

    @property
    def seq(self) -> int:
        return self.spec.seq_len + self.spec.gen_len

    @property
    def shared(self) -> bool:
        """Phases 3 and 5 forward each group's prompt once (--shared_prompt on, resolved)."""
        return self.spec.shared_prompt == "on" and self.spec.num_generations > 1 and self.stage in ("ppo", "grpo")

    @property
    def scored_seq(self) -> float:
        """Tokens per sequence that phases 3 and 5 forward: seq_len / G + gen_len with a shared prompt."""
        spec = self.spec
        return spec.seq_len / spec.num_generations + spec.gen_len if self.shared else self.seq

    @property
    def scored_context(self) -> float:
        """Keys a token of phases 3 and 5 attends to on average: seq / 2 (causal); with a shared prompt a
        group's P prompt tokens P / 2 each and its G R response tokens P + R / 2 each."""
        if not self.shared:
            return self.seq / 2
        P, R, G = self.spec.seq_len, self.spec.gen_len, self.spec.num_generations
        return (P * P / 2 + G * R * (P + R / 2)) / (P + G * R)

    @property
    def total_seqs(self) -> int:
        return self.spec.rollout_batch * self.spec.num_generations

    def pool_of(self, role: str) -> str:
        return "all" if self.spec.placement == "colocated" else role

    def share(self, m: ModelState) -> float:
        return self.total_seqs / m.gpus

    def micro_forward(self, m: ModelState) -> float:
        return min(self.share(m), self.spec.micro_rollout_batch or self.share(m))

    def base(self, pool: str) -> Memory:
        """What the pool's models hold between phases (weights and optimizer states)."""
        mem = Memory()
        for m in self.models:
            if m.pool == pool:
                mem.weights += m.weights
                mem.optimizer += m.optimizer
        return mem

    def work(self, arch: Arch) -> Work:
        return W.new_work(self.dev, arch, self.spec.cpu_threads)

    def adapters(self, m: ModelState) -> int:
        """LoRA adapters a trained model runs per layer (0 for full fine-tuning and frozen models)."""
        if not self.spec.lora_rank or m.name not in LORA_TRAINED:
            return 0
        return sum(1 for t in m.arch.linear_shapes() if t in self.spec.lora_targets)

    def head_tokens(self, sequences: float) -> float | None:
        """Tokens the lm_head runs on: the response tokens for fastrlhf's linear log-probs, all with logits."""
        return sequences * self.spec.gen_len if self.spec.logits == "linear" else None

    def gather_bytes(self, m: ModelState) -> float:
        """Bytes a ZeRO-3 gather of the model moves (its weights in the compute dtype)."""
        return m.arch.params() * self.db


PhaseFn = Callable[[Context], Phase | None]  # None: the phase does not run in this configuration
STAGE_PHASES: dict[str, dict[str, PhaseFn]] = {}


def register_phase(stages: str | tuple[str, ...], name: str) -> Callable[[PhaseFn], PhaseFn]:
    """Add `fn` as phase `name` of each stage, after the stage's phases registered before it."""
    def wrap(fn: PhaseFn) -> PhaseFn:
        for stage in (stages,) if isinstance(stages, str) else stages:
            phases = STAGE_PHASES.setdefault(stage, {})
            if name in phases:
                raise ValueError(f"phase {name!r} of stage {stage!r} is registered twice")
            phases[name] = fn
        return fn
    return wrap


@dataclass(frozen=True)
class Role:
    """A model a stage holds: its name, shape, whether it trains, whether it has an lm_head, and its pool role."""

    name: str
    arch: Arch
    trainable: bool
    lm_head: bool
    pool: str


ModelsFn = Callable[[Spec, Arch, Callable[[object, str], Arch]], list[Role]]
STAGE_MODELS: dict[str, ModelsFn] = {}


def register_models(*stages: str) -> Callable[[ModelsFn], ModelsFn]:
    def wrap(fn: ModelsFn) -> ModelsFn:
        for stage in stages:
            if stage in STAGE_MODELS:
                raise ValueError(f"the models of stage {stage!r} are registered twice")
            STAGE_MODELS[stage] = fn
        return fn
    return wrap


@register_models("sft")
def _sft_models(spec, arch, other):
    return [Role("actor", arch, True, True, "actor")]


@register_models("rm")
def _rm_models(spec, arch, other):
    return [Role("reward", arch, True, False, "reward")]


@register_models("dpo")
def _dpo_models(spec, arch, other):
    return [Role("actor", arch, True, True, "actor"),
            Role("reference", arch, False, True, "actor" if spec.lora_rank else "reference")]


@register_models("ppo", "grpo")
def _rl_models(spec, arch, other):
    roles = _dpo_models(spec, arch, other)
    if spec.stage == "ppo" and spec.critic != "shared":
        roles.append(Role("critic", other(spec.critic, "critic"), True, False, "critic"))
    if spec.reward != "rule":
        roles.append(Role("reward", other(spec.reward, "reward"), False, False, "reward"))
    if spec.ema:
        roles.append(Role("ema", arch, False, True, "actor"))
    return roles


# ---------------------------------------------------------------------------------------------
# PPO / GRPO


def gen_weight_bytes(spec: Spec, m: ModelState) -> float:
    """Weights a decode step reads: stored bytes per parameter (this trainer's full fine-tuning keeps fp32)."""
    per = DTYPE_BYTES[spec.dtype]
    if spec.engine == "fsdp2" and spec.lora_rank == 0 and spec.gen_engine == "hf":
        per = state_bytes("fsdp2", "mixed" if per == 2 else "fp32", 0)["weights"].bytes
    return m.arch.params() * per


def host_engine(spec: Spec) -> str:
    """The generation's code path: hf-static for hf generate with the static cache (transformers compiles its
    decode step into a CUDA graph; `auto` resolved as the trainer does), else the engine's own name."""
    static = spec.gen_engine == "hf" and resolved(spec).rollout_cache == "static"
    return "hf-static" if static else spec.gen_engine


def _vllm_rollout(ctx: Context, actor: ModelState, sequences: float, work: Work, mem: Memory, resident: float) -> int:
    """vLLM decodes an engine's prompts with continuous batching up to its KV capacity: a finished sequence's slot
    goes to a waiting prompt, so the decode steps are the longest response or the tokens over the slots, whichever
    is more; its weights are a copy of its own."""
    spec, arch, dev, db = ctx.spec, actor.arch, ctx.dev, ctx.db
    tp = spec.gen_tp
    p, g, m = spec.seq_len, spec.gen_len, spec.mean_gen_len or spec.gen_len
    weights = arch.params() * db
    per_seq = kv_cache_bytes(arch, sequences=1, length=p + m, dtype=spec.dtype) / tp
    running = min(sequences, W.vllm_capacity(dev, arch, resident=resident, weight_bytes=weights, per_sequence=per_seq,
                                             prompt=p, tp=tp, db=db))
    steps = max(g, sequences * m / running)
    avg_running = sequences * m / steps
    chunks = math.ceil(sequences * p / W.VLLM_PREFILL_TOKENS)
    prefill_tokens = sequences * p / chunks
    work.step(count=chunks, flops=W.forward_flops(arch, prefill_tokens, p / 2, head_tokens=sequences / chunks) / tp,
              weight_bytes=weights / tp, bytes=W.activation_traffic(arch, prefill_tokens, db) / tp,
              kernels=arch.layers * T.VLLM_LAYER_KERNELS, ops=T.VLLM_STEP_OPS, width=arch.hidden / tp)
    work.step(count=steps, **W.vllm_decode_step(arch, running=avg_running, context=p + m / 2, weight_bytes=weights,
                                                kv_db=db, db=db, tp=tp))
    work.comm += steps * W.tp_allreduce(dev, arch, avg_running, db, tp) + chunks * W.tp_allreduce(
        dev, arch, prefill_tokens, db, tp)
    act = forward_working_bytes(arch, tokens=min(sequences * p, W.VLLM_PREFILL_TOKENS) / tp, seq=p, dtype=spec.dtype,
                                flash_attention=spec.flash_attention)
    mem.at_least(activations=act)
    mem.kv_cache += running * per_seq
    mem.logits += W.sample_bytes(arch, running, db) / tp
    mem.weights += weights / tp  # vLLM's own copy of the weights
    return math.ceil(sequences / running)


def _generate_rollout(ctx: Context, actor: ModelState, sequences: float, work: Work, mem: Memory) -> int:
    """hf / ds-he: one micro-rollout batch after another, each prefilled, then decoded to the longest response
    (DeepSpeed-Chat forces it; HF stops when the last sequence does)."""
    spec, arch, db = ctx.spec, actor.arch, ctx.db
    tp = spec.gen_tp
    p, g = spec.seq_len, spec.gen_len
    per_gpu = spec.micro_rollout_batch or math.ceil(sequences / tp)
    mb = per_gpu * tp  # ds-he gathers the micro-batches of its tensor-parallel group
    calls = math.ceil(sequences / mb)
    adapters = ctx.adapters(actor)
    weights = gen_weight_bytes(spec, actor)
    ds_he = spec.gen_engine == "ds-he"
    prefill_ops = arch.layers * (T.DS_HE_LAYER_OPS if ds_he else W.layer_ops(work.kind, adapters))
    prefill_kernels = arch.layers * T.DS_HE_LAYER_KERNELS if ds_he else prefill_ops
    work.step(count=calls, flops=W.forward_flops(arch, mb * p, p / 2, head_tokens=mb) / tp,
              weight_bytes=weights / tp, bytes=W.activation_traffic(arch, mb * p, db) / tp, kernels=prefill_kernels,
              ops=prefill_ops, width=arch.hidden / tp)
    if spec.gen_engine == "ds-he":
        step = W.ds_he_decode_step(arch, sequences=mb, context=p + g / 2, weight_bytes=weights, db=db, tp=tp)
        work.comm += calls * g * W.tp_allreduce(ctx.dev, arch, mb, db, tp)
    else:
        step = W.hf_decode_step(arch, sequences=mb, context=p + g / 2, weight_bytes=weights, db=db, adapters=adapters,
                                static=host_engine(spec) == "hf-static", prompt=p, gen=g, kind=work.kind)
    work.step(count=calls * g, **step)
    mem.kv_cache += kv_cache_bytes(arch, sequences=mb, length=p + g, dtype=spec.dtype) / tp
    mem.logits += W.sample_bytes(arch, mb, db) / tp
    mem.activations += forward_working_bytes(arch, tokens=mb * p / tp, seq=p, dtype=spec.dtype,
                                             flash_attention=spec.flash_attention)
    return calls


def _graph_rollout(ctx: Context, actor: ModelState, sequences: float, work: Work, mem: Memory) -> None:
    """fastrlhf's decode engine on each GPU for its `sequences`: each distinct prompt (a group's G samples share
    one) prefilled once; a pool of rollout_slots rows (0: all) decoded at once, a finished row's slot refilled
    with a pending sequence, then the live rows compacted into smaller batches: the rows computed follow the tokens
    (sequences x mean length), over at least the longest response's steps. Its memory: the KV pool, its own merged
    copy of the layer weights (the embedding and lm_head read in place for LoRA on one process), the step's fp32
    logits; all freed before the update (the trainer's default, --rollout_keep_memory off)."""
    spec, arch, db = ctx.spec, actor.arch, ctx.db
    p, g, m = spec.seq_len, spec.gen_len, spec.mean_gen_len or spec.gen_len
    slots = min(sequences, spec.rollout_slots or sequences)
    prompts = sequences / max(1, spec.num_generations)
    weights = gen_weight_bytes(spec, actor)
    work.step(count=1, flops=W.forward_flops(arch, prompts * p, p / 2, head_tokens=prompts), weight_bytes=weights,
              bytes=W.activation_traffic(arch, prompts * p, db), kernels=arch.layers * W.layer_ops(work.kind, 0),
              ops=arch.layers * W.layer_ops(work.kind, 0), width=arch.hidden)
    steps = max(g, sequences * m / slots)
    work.step(count=steps, **W.graph_decode_step(arch, running=sequences * m / steps, context=p + m / 2,
                                                 weight_bytes=weights, db=db, kind=work.kind))
    shares_head = bool(spec.lora_rank) and spec.gpus == 1
    read_in_place = arch.vocab * arch.embed * (1 if arch.tied else 2) if shares_head else 0  # embedding, head
    copy = (arch.params() - read_in_place) * db
    mem.kv_cache += kv_cache_bytes(arch, sequences=slots, length=p + g, dtype=spec.dtype)
    mem.logits += slots * arch.vocab * 4
    mem.weights += copy
    mem.activations += forward_working_bytes(arch, tokens=prompts * p, seq=p, dtype=spec.dtype,
                                             flash_attention=True)


@register_phase(("ppo", "grpo"), "rollout")
def rollout(ctx: Context, sampler: str = "actor") -> Phase:
    """Generation on the gen pool (colocated: every GPU): vllm, or hf / ds-he with the weights of `sampler` (the
    actor; distillation's student); the collectives that bring the weights to it."""
    spec, dev, actor = ctx.spec, ctx.dev, ctx.by[sampler]
    gen_pool = ctx.pool_of("gen")
    if gen_pool not in ctx.pools:
        raise ValueError("pools: disaggregated placement needs a gen=N pool for generation")
    if ctx.pools[gen_pool] % spec.gen_tp:
        raise ValueError(f"gen_tp: {spec.gen_tp} does not divide the {ctx.pools[gen_pool]} generation GPUs")
    engines = ctx.pools[gen_pool] // spec.gen_tp
    sequences = ctx.total_seqs / engines  # per engine
    work, mem = ctx.work(actor.arch), ctx.base(gen_pool)
    gather = ctx.gather_bytes(actor)
    if spec.gen_engine == "vllm":
        _vllm_rollout(ctx, actor, sequences, work, mem, resident=ctx.base(gen_pool).peak)
        # the actor's new weights, to every engine, once per iteration
        work.comm += W.collective(dev, gather, ctx.pools[gen_pool] + (actor.gpus if spec.placement ==
                                                                         "disaggregated" else 0))
        mem.buffers += actor.gathered
    elif spec.gen_engine == "graph":
        _graph_rollout(ctx, actor, sequences, work, mem)
        mem.buffers += actor.gathered
    else:
        calls = _generate_rollout(ctx, actor, sequences, work, mem)
        fsdp2_gathers = spec.engine == "fsdp2" and spec.gen_engine == "hf" and shards_weights(spec.engine, actor.zero)
        if spec.gen_engine == "ds-he" and actor.zero == 3 and spec.pin_parameters:
            # the hybrid engine gathers the actor (its tensor-parallel share) once per generate call
            work.comm += W.collective(dev, gather, actor.gpus, calls)
            mem.buffers += actor.arch.params() * ctx.db / spec.gen_tp
        elif fsdp2_gathers:  # this trainer: the whole policy gathered once around generate, in the compute dtype
            work.comm += W.collective(dev, gather, actor.gpus, 1)
            mem.buffers += gather
        elif actor.zero == 3:  # ZeRO-3 under HF generate (or an unpinned hybrid engine): every step, every layer
            work.comm += W.collective(dev, gather, actor.gpus, calls * (spec.gen_len + 1))
        if not fsdp2_gathers:
            mem.buffers += actor.gathered
    mean = spec.mean_gen_len or spec.gen_len
    flops = W.forward_flops(actor.arch, ctx.total_seqs * (spec.seq_len + mean), ctx.seq / 2)
    return Phase("rollout", {gen_pool: mem}, {gen_pool: work}, flops, engines=engines)


def _forward_of(ctx: Context, m: ModelState, rows: float | None = None, lm_head: bool | None = None,
                scored: bool = False) -> Work:
    """One model's no-grad forward over `rows` sequences per GPU (its share of the rollout), with its lm_head
    (`lm_head`: the model's own), with ZeRO-3's per-call gathers; `scored`: phase 3's (a shared prompt's
    tokens)."""
    rows = ctx.share(m) if rows is None else rows
    lm_head = m.lm_head if lm_head is None else lm_head
    mb = min(rows, ctx.micro_forward(m))
    seq, context = (ctx.scored_seq, ctx.scored_context) if scored else (ctx.seq, None)
    work = W.forward_work(ctx.work(m.arch), m.arch, rows, seq, micro=mb, db=ctx.db, lm_head=lm_head,
                          adapters=ctx.adapters(m), head_tokens=ctx.head_tokens(rows) if lm_head else None,
                          host_bytes=m.host_bytes if m.offloaded else 0.0, pcie=ctx.dev.pcie, context=context)
    if m.zero == 3:
        work.comm += W.collective(ctx.dev, ctx.gather_bytes(m), m.gpus, math.ceil(rows / mb))
    return work


@register_phase(("ppo", "grpo"), "reward")
def reward(ctx: Context) -> Phase:
    """The reward model's forward over the rollout, or a rule (a Python call per response)."""
    rm = ctx.by.get("reward")
    if rm is None:
        pool = ctx.pool_of("actor")
        work = ctx.work(ctx.arch).step(ops=ctx.total_seqs / ctx.pools[pool])  # one host call per response
        return Phase("host", {pool: ctx.base(pool)}, {pool: work}, 0.0)
    mem = ctx.base(rm.pool)
    mem.buffers += rm.gathered
    mem.activations += forward_working_bytes(rm.arch, tokens=ctx.micro_forward(rm) * ctx.seq, seq=ctx.seq,
                                             dtype=ctx.spec.dtype, flash_attention=ctx.spec.flash_attention)
    flops = W.forward_flops(rm.arch, ctx.total_seqs * ctx.seq, ctx.seq / 2, False)
    return Phase("forward", {rm.pool: mem}, {rm.pool: _forward_of(ctx, rm)}, flops)


def actor_scoring(ctx: Context, m: ModelState) -> tuple[float, bool]:
    """What phase 3's actor forward scores, as `fastrlhf.train.recipes.ppo.experience` does: (sequences per GPU,
    whether it runs the lm_head). With old_logprobs sampler the old log-probs are the sampler's: the actor runs its
    trunk only where PPO's shared value head needs the values. GRPO with kl_in_loss: the update's first minibatch
    forms its own old log-probs, and the forward scores the other rows
    (`fastrlhf.train.recipes.ppo.old_from_first_update`)."""
    spec, share = ctx.spec, ctx.share(m)
    if spec.old_logprobs == "sampler":
        return (share if ctx.stage == "ppo" and spec.critic == "shared" else 0.0), False
    if ctx.stage == "grpo" and spec.kl_in_loss:
        first = min(spec.mini_batch or ctx.total_seqs, ctx.total_seqs)
        return share * (1 - first / ctx.total_seqs), m.lm_head
    return share, m.lm_head


@register_phase(("ppo", "grpo"), "logprobs")
def logprobs(ctx: Context) -> Phase:
    """Old log-probs and values (the actor, or the actor and a critic) and the reference's log-probs."""
    spec, memory, work, by_model, flops = ctx.spec, {}, {}, {}, 0.0
    for name in ("actor", "critic", "reference"):
        m = ctx.by.get(name)
        if m is None:
            continue
        rows, lm_head = actor_scoring(ctx, m) if name == "actor" else (ctx.share(m), m.lm_head)
        if rows <= 0:
            continue
        w = _forward_of(ctx, m, rows, lm_head, scored=True)
        by_model[name] = w
        work.setdefault(m.pool, ctx.work(m.arch)).add(w)
        tokens = min(rows, ctx.micro_forward(m)) * ctx.scored_seq
        mem = memory.setdefault(m.pool, ctx.base(m.pool)).at_least(buffers=m.gathered)
        mem.at_least(activations=forward_working_bytes(m.arch, tokens=tokens, seq=ctx.seq, dtype=spec.dtype,
                                                        flash_attention=spec.flash_attention))
        if lm_head:
            mem.at_least(logits=logit_bytes(m.arch, tokens=tokens, dtype=spec.dtype, mode=spec.logits,
                                            backward=False))
        sequences = rows * m.gpus
        flops += W.forward_flops(m.arch, sequences * ctx.scored_seq, ctx.scored_context, lm_head,
                                 head_tokens=ctx.head_tokens(sequences) if lm_head else None)
    return Phase("forward", memory, work, flops, work_by_model=by_model)


@register_phase(("ppo", "grpo"), "advantages")
def advantages(ctx: Context) -> Phase:
    """KL-shaped rewards and GAE (ppo) or group advantages (grpo): a few kernels."""
    pool = ctx.pool_of("actor")
    work = W.advantages_work(ctx.work(ctx.arch), ctx.spec.gen_len, gae=ctx.stage == "ppo")
    return Phase("host", {pool: ctx.base(pool)}, {pool: work}, 0.0)


def training_comm(ctx: Context, m: ModelState, *, micro_batches: int, steps: int) -> float:
    """ZeRO-3 / FSDP full shard: gather the weights for forward and backward and reduce-scatter the gradients
    every micro-batch; ZeRO-1/2: reduce-scatter gradients + gather weights per step; replicated: all-reduce."""
    grads = m.trainable_params * ctx.db
    if m.zero == 3:
        return (W.collective(ctx.dev, ctx.gather_bytes(m), m.gpus, 2 * micro_batches)
                + W.collective(ctx.dev, grads, m.gpus, micro_batches))
    return W.collective(ctx.dev, grads, m.gpus, 2 * steps)


def trainable_tensors(arch: Arch, lora_rank: int, lora_targets: tuple[str, ...]) -> int:
    """Parameter tensors the optimizer steps over (its per-tensor work on a CPU)."""
    if lora_rank:
        return 2 * arch.layers * sum(1 for t in arch.linear_shapes() if t in lora_targets) + 2  # + value head
    per_layer = len(arch.linear_shapes()) + 2 + (len(arch.linear_shapes()) + 2 if arch.family == "opt" else 0)
    return arch.layers * per_layer + 3


def train_model(ctx: Context, m: ModelState, sequences: float, seq: float, *, micro: float, steps: int,
                lm_head: bool, context: float | None = None) -> Work:
    """A trained model's forward + backward over `sequences` of `seq` tokens (`context`: keys per token, None
    causal), its optimizer `steps` and their collectives."""
    spec = ctx.spec
    lora = spec.lora_rank > 0 and m.name in LORA_TRAINED
    work = W.train_work(ctx.work(m.arch), m.arch, sequences, seq, micro=micro, db=ctx.db, lm_head=lm_head,
                        lora=lora, adapters=ctx.adapters(m), checkpointing=spec.gradient_checkpointing,
                        head_tokens=ctx.head_tokens(sequences) if lm_head else None, context=context)
    per_gpu = m.trainable_params / (m.gpus if m.zero >= 1 else 1)
    tensors = trainable_tensors(m.arch, spec.lora_rank if lora else 0, spec.lora_targets)
    W.optimizer_work(work, per_gpu, tensors, steps, offload=spec.offload != "none", engine=spec.engine,
                     pcie=ctx.dev.pcie)
    micro_batches = math.ceil(sequences / micro)
    work.comm += training_comm(ctx, m, micro_batches=micro_batches, steps=steps)
    if spec.offload == "params" and ctx.dev.kind == "gpu":  # the weights stream in for every pass
        passes = W.train_passes(lora, spec.gradient_checkpointing)
        work.host_link += micro_batches * passes * m.arch.params() * 2 / m.gpus / ctx.dev.pcie
    return work


def training_memory(ctx: Context, m: ModelState, mem: Memory, tokens: float, *, lm_head: bool) -> Memory:
    spec = ctx.spec
    mem.at_least(gradients=m.gradients, buffers=m.buffers())
    mem.at_least(activations=activation_bytes(
        m.arch, tokens=tokens, seq=ctx.seq, dtype=spec.dtype, checkpointing=spec.gradient_checkpointing,
        lora_rank=spec.lora_rank if m.name in LORA_TRAINED else 0, lora_targets=spec.lora_targets,
        qlora=spec.qlora, flash_attention=spec.flash_attention))
    if lm_head:
        mem.at_least(logits=logit_bytes(m.arch, tokens=tokens, dtype=spec.dtype, mode=spec.logits, backward=True))
    return mem


@register_phase(("ppo", "grpo"), "update")
def update(ctx: Context) -> Phase:
    """ppo_epochs over the rollout: the actor's (and a critic's) forward + backward, optimizer steps."""
    spec = ctx.spec
    steps = spec.ppo_epochs * math.ceil(ctx.total_seqs / (spec.mini_batch or ctx.total_seqs))
    memory, work, by_model, flops = {}, {}, {}, 0.0
    for name in ("actor", "critic"):
        m = ctx.by.get(name)
        if m is None:
            continue
        mb = min(spec.micro_batch, ctx.share(m))
        w = train_model(ctx, m, ctx.share(m) * spec.ppo_epochs, ctx.scored_seq, micro=mb, steps=steps,
                        lm_head=m.lm_head, context=ctx.scored_context)
        by_model[name] = w
        work.setdefault(m.pool, ctx.work(m.arch)).add(w)
        training_memory(ctx, m, memory.setdefault(m.pool, ctx.base(m.pool)), mb * ctx.scored_seq, lm_head=m.lm_head)
        lora = spec.lora_rank > 0
        flops += spec.ppo_epochs * W.train_passes(lora, spec.gradient_checkpointing) * W.forward_flops(
            m.arch, ctx.total_seqs * ctx.scored_seq, ctx.scored_context, m.lm_head)
    return Phase("train", memory, work, flops, work_by_model=by_model, optimizer_steps=steps)


# ---------------------------------------------------------------------------------------------
# Distillation (fastrlhf distill): a trained student and the frozen teacher under one root on every GPU. Each step
# (rollout_batch sequences over all GPUs, micro_batch per forward / backward): on-policy, the student samples its
# responses (hf generate, the policy gathered once); the teacher's forward to its final hidden states; the
# student's forward + backward with ops.linear_distill_loss over the response tokens, which projects one chunk of
# each model's logits at a time (the teacher's lm_head runs there: counted with the teacher's forward).


@register_models("distill")
def _distill_models(spec, arch, other):
    return [Role("student", student_arch(spec), True, True, "actor"), Role("teacher", arch, False, True, "actor")]


def _micro(ctx: Context, m: ModelState) -> float:
    """Sequences per forward / backward of a distillation step on one GPU."""
    return min(ctx.spec.micro_batch, ctx.share(m))


@register_phase("distill", "rollout")
def student_rollout(ctx: Context) -> Phase | None:
    """--on-policy: the student samples the step's responses (gen_len tokens each); offline: no phase."""
    return rollout(ctx, "student") if ctx.spec.on_policy else None


@register_phase("distill", "teacher")
def teacher_forward(ctx: Context) -> Phase:
    """The teacher's no-grad forward over the step's sequences, micro_batch at a time (ZeRO-3: gathered per
    call), and its lm_head on the response tokens."""
    spec, teacher = ctx.spec, ctx.by["teacher"]
    mb = _micro(ctx, teacher)
    work = W.forward_work(ctx.work(teacher.arch), teacher.arch, ctx.share(teacher), ctx.seq, micro=mb, db=ctx.db,
                          lm_head=True, head_tokens=ctx.head_tokens(ctx.share(teacher)))
    if teacher.zero == 3:
        work.comm += W.collective(ctx.dev, ctx.gather_bytes(teacher), teacher.gpus, math.ceil(ctx.share(teacher) / mb))
    mem = ctx.base(teacher.pool).at_least(buffers=teacher.gathered)
    mem.activations = forward_working_bytes(teacher.arch, tokens=mb * ctx.seq, seq=ctx.seq, dtype=spec.dtype,
                                            flash_attention=spec.flash_attention)
    flops = W.forward_flops(teacher.arch, ctx.total_seqs * ctx.seq, ctx.seq / 2,
                            head_tokens=ctx.head_tokens(ctx.total_seqs))
    return Phase("forward", {teacher.pool: mem}, {teacher.pool: work}, flops, work_by_model={"teacher": work})


@register_phase("distill", "update")
def student_update(ctx: Context) -> Phase:
    """The student's forward + backward and one optimizer step; beside its own activations and logits it holds the
    teacher's final hidden states of the micro-batch and one chunk of the teacher's logits (no gradient)."""
    spec, student, teacher = ctx.spec, ctx.by["student"], ctx.by["teacher"]
    mb = _micro(ctx, student)
    tokens = mb * ctx.seq
    mem = training_memory(ctx, student, ctx.base(student.pool), tokens, lm_head=True)
    head_tokens = ctx.head_tokens(mb) or tokens
    mem.activations += head_tokens * teacher.arch.hidden * ctx.db
    mem.logits += logit_bytes(teacher.arch, tokens=head_tokens, dtype=spec.dtype, mode=spec.logits, backward=False)
    work = train_model(ctx, student, ctx.share(student), ctx.seq, micro=mb, steps=1, lm_head=True)
    flops = W.train_passes(spec.lora_rank > 0, spec.gradient_checkpointing) * W.forward_flops(
        student.arch, ctx.total_seqs * ctx.seq, ctx.seq / 2, head_tokens=ctx.head_tokens(ctx.total_seqs))
    return Phase("train", {student.pool: mem}, {student.pool: work}, flops, work_by_model={"student": work},
                 optimizer_steps=1)


# ---------------------------------------------------------------------------------------------
# DPO, SFT, RM


def _pairs(ctx: Context) -> tuple[float, float]:
    """(pairs per GPU per optimizer step, pairs per micro-batch)."""
    pairs = ctx.spec.rollout_batch / ctx.by["actor"].gpus
    return pairs, min(ctx.spec.micro_batch, pairs)


@register_phase("dpo", "logprobs")
def pair_logprobs(ctx: Context) -> Phase:
    """The reference's log-probs of the chosen and rejected sequences (the policy's come with its update)."""
    spec, actor, ref = ctx.spec, ctx.by["actor"], ctx.by["reference"]
    if ref.pool != actor.pool:
        raise ValueError("dpo: the reference runs beside the policy (colocated, or reference in the actor pool)")
    pairs, mb = _pairs(ctx)
    tokens = 2 * mb * ctx.seq
    mem = ctx.base(actor.pool)
    mem.buffers = ref.gathered
    mem.activations = forward_working_bytes(ctx.arch, tokens=tokens, seq=ctx.seq, dtype=spec.dtype,
                                            flash_attention=spec.flash_attention)
    mem.logits = logit_bytes(ctx.arch, tokens=tokens, dtype=spec.dtype, mode=spec.logits, backward=False)
    work = W.forward_work(ctx.work(ctx.arch), ctx.arch, 2 * pairs, ctx.seq, micro=2 * mb, db=ctx.db, lm_head=True,
                          host_bytes=ref.host_bytes if ref.offloaded else 0.0, pcie=ctx.dev.pcie)
    flops = W.forward_flops(ctx.arch, 2 * spec.rollout_batch * ctx.seq, ctx.seq / 2)
    return Phase("forward", {actor.pool: mem}, {actor.pool: work}, flops)


@register_phase("dpo", "update")
def pair_update(ctx: Context) -> Phase:
    spec, actor = ctx.spec, ctx.by["actor"]
    pairs, mb = _pairs(ctx)
    mem = training_memory(ctx, actor, ctx.base(actor.pool), 2 * mb * ctx.seq, lm_head=True)
    work = train_model(ctx, actor, 2 * pairs, ctx.seq, micro=2 * mb, steps=1, lm_head=True)
    flops = W.train_passes(spec.lora_rank > 0, spec.gradient_checkpointing) * W.forward_flops(
        ctx.arch, 2 * spec.rollout_batch * ctx.seq, ctx.seq / 2)
    return Phase("train", {actor.pool: mem}, {actor.pool: work}, flops, work_by_model={"actor": work},
                 optimizer_steps=1)


@register_phase(("sft", "rm"), "step")
def train_step(ctx: Context) -> Phase:
    """One optimizer step of micro_batch sequences (RM: pairs) per GPU."""
    spec, m = ctx.spec, ctx.models[0]
    sequences = spec.micro_batch * (2 if ctx.stage == "rm" else 1)
    lm_head = ctx.stage == "sft"
    mem = training_memory(ctx, m, ctx.base(m.pool), sequences * ctx.seq, lm_head=lm_head)
    work = train_model(ctx, m, sequences, ctx.seq, micro=sequences, steps=1, lm_head=lm_head)
    flops = W.train_passes(spec.lora_rank > 0, spec.gradient_checkpointing) * W.forward_flops(
        ctx.arch, sequences * ctx.seq * m.gpus, ctx.seq / 2, lm_head)
    return Phase("train", {m.pool: mem}, {m.pool: work}, flops, work_by_model={m.name: work}, optimizer_steps=1)


assert tuple(STAGE_PHASES["ppo"]) == PPO_PHASES, "the planner's PPO phases are the trainer's, in order"
