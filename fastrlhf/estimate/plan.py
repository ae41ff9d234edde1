"""The planner: memory per GPU, FLOPs and time of each RLHF stage and PPO phase, fit per pool.

`estimate(Spec(...))` or `estimate(model="llama-3-8b", stage="ppo", gpus=8, zero=3)` returns the
`--json` schema. A PPO / GRPO iteration has the trainer's five phases, timed one after another:

  rollout     generate responses (hf: one micro-rollout batch after another, each decoding to the
              longest response; ds-he: the same with DeepSpeed's inference kernels and tensor
              parallelism; vllm: every prompt of an engine at once, continuous batching)
  reward      reward-model forward (none for a rule reward)
  logprobs    actor forward (+ values: shared head, or the critic) and the reference forward
  advantages  KL-shaped rewards and GAE / group advantages (host work)
  update      ppo_epochs of forward + backward over the rollout, optimizer steps

Colocated placement runs every phase on all GPUs; disaggregated placement gives generation, actor,
critic, reference and reward their own pools (OpenRLHF's Ray layout): within a phase the pools
work in parallel and the phase takes the slowest. Collectives are ring all-gathers / reduce-scatters
at the node's link or the network's bandwidth (hardware.py), counted as exposed (not overlapped
with compute; the low end of a time range takes them as fully overlapped): ZeRO-3 gathers the
weights for every forward and backward (DeepSpeed ZeRO-3 under HF generate: for every decode step;
this trainer's FSDP2 gathers the whole policy once around generate) and
reduce-scatters gradients per micro-batch; ZeRO-1/2 reduce-scatter gradients and gather weights per
optimizer step; replicated training all-reduces gradients; vLLM receives the actor's weights once per
iteration. Tensor parallelism's own all-reduces are not counted.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import fastrlhf.estimate.timing as timing
from fastrlhf.constants import SMALL_MODEL_PARAMS
from fastrlhf.estimate.arch import LINEARS, Arch, format_params, parse_params, resolve_model, scaled
from fastrlhf.estimate.hardware import Device, device
from fastrlhf.estimate.memory import (
    DTYPE_BYTES,
    ENGINES,
    OFFLOADS,
    ModelState,
    activation_bytes,
    fill_states,
    forward_working_bytes,
    kv_cache_bytes,
    largest_layer_params,
    logit_bytes,
    shards_weights,
    state_bytes,
)

STAGES = ("sft", "rm", "ppo", "grpo", "dpo")
PPO_PHASES = ("rollout", "reward", "logprobs", "advantages", "update")
DPO_PHASES = ("logprobs", "update")
COMPONENTS = ("weights", "gradients", "optimizer", "buffers", "activations", "logits", "kv_cache")
POOLS = ("gen", "actor", "critic", "reference", "reward")
GEN_ENGINES = timing.GEN_ENGINES
ROLLOUT_CACHES = ("auto", "dynamic", "static")
LOGITS = ("linear", "fused", "materialised")


@dataclass
class Spec:
    """One planned run. Batch sizes are global unless they say per GPU."""

    model: str | dict | Arch = "llama-2-7b"
    """preset, `fastrlhf ppo --model` built-in, model directory, config.json path or parsed config"""
    params: int | str | None = None
    """parameter count of the actor (7.5e9, 7.5B, 770M): the model is widened or narrowed to it"""
    stage: str = "ppo"
    """sft, rm, ppo, grpo, dpo or all (sft, rm, ppo)"""
    gpus: int = 1
    """GPUs of a colocated run"""
    placement: str = "colocated"
    """colocated: every model on every GPU; disaggregated: a pool of GPUs per role (`pools`)"""
    pools: dict | None = None
    """disaggregated: GPUs per pool, e.g. {"gen": 4, "actor": 4, "critic": 4, "reference": 2, "reward": 2}"""
    engine: str = "fsdp2"
    """fsdp2: this trainer (FSDP2, its real buffers); deepspeed: the ZeRO paper's accounting"""
    zero: int | dict = 0
    """ZeRO stage 0-3 for every model, or per model {"actor": 3, "critic": 2, "all": 0}"""
    dtype: str | None = None
    """bf16 / fp16: mixed precision; fp32; None = the trainer's on `gpu`: fp32 on cpu (no autocast there,
    FSDP2 gathers fp32: fastrlhf/devices.py, distributed.shard_model), bf16 on a GPU"""
    lora_rank: int = 0
    """0 = full fine-tuning"""
    lora_targets: tuple[str, ...] = LINEARS
    """linears that get adapters (q, k, v, o, gate, up, down)"""
    qlora: bool = False
    """4-bit NF4 base weights under the adapters (needs lora_rank > 0)"""
    gradient_checkpointing: bool = False
    """keep only each layer's input; recompute one layer in backward"""
    flash_attention: bool = True
    """False: eager attention saves the [heads, T, T] probabilities"""
    logits: str = "linear"
    """linear: fastrlhf's chunked log-probs from hidden states; fused: kernels on dtype logits;
    materialised: fp32 logits and log-softmax (plain PyTorch, DeepSpeed-Chat)"""
    micro_batch: int = 1
    """sequences per forward/backward per GPU (DPO: pairs)"""
    seq_len: int = 512
    """prompt tokens (SFT/RM/DPO: the whole sequence is seq_len + gen_len)"""
    gen_len: int = 512
    """longest generated response (tokens)"""
    mean_gen_len: int | None = None
    """mean response length (vllm decodes and caches by it); None = gen_len"""
    rollout_batch: int = 64
    """prompts per PPO / GRPO iteration (DPO: pairs per optimizer step), over all GPUs"""
    micro_rollout_batch: int | None = None
    """sequences per generate call and per experience forward, per GPU; None = the GPU's whole share"""
    mini_batch: int | None = None
    """sequences per optimizer step, over all GPUs; None = the whole rollout"""
    ppo_epochs: int = 1
    """passes over each rollout"""
    num_generations: int = 1
    """samples per prompt (GRPO's group size G)"""
    critic: str = "shared"
    """shared: value head on the actor trunk (this trainer); actor: a separate copy of the actor;
    or a model / parameter count (350M, opt-350m)"""
    reward: str = "actor"
    """actor: a reward model like the actor; rule: a Python function; or a model / parameter count"""
    gen_engine: str = "hf"
    """hf: Hugging Face generate; ds-he: DeepSpeed hybrid engine; vllm: vLLM (paged KV, continuous batching)"""
    gen_tp: int = 1
    """tensor-parallel GPUs per generation engine"""
    rollout_cache: str = "dynamic"
    """hf generate's KV cache (`fastrlhf ppo --rollout_cache`): dynamic (eager decode step), static (the decode
    step compiled by transformers), auto = static on one CUDA process, else dynamic; default: the trainer's"""
    offload: str = "none"
    """none, optimizer (states on the host), params (weights too)"""
    offload_frozen: bool = False
    """reference and reward weights on the host, streamed in for their forward"""
    ema: bool = False
    """an EMA copy of the actor (DeepSpeed-Chat --enable_ema)"""
    gpu: str = "a100-80g"
    """v100-32g, a6000, a100-40g, a100-80g, a800-80g, h100, h200, cpu"""
    cpu_threads: int | None = None
    """--gpu cpu: threads the run uses; None = the trainer's rule (one below 20M parameters, else all cores)"""
    price: float = 0.0
    """dollars per GPU-hour"""
    steps: int = 1
    """optimizer steps (SFT, RM, DPO) or iterations (PPO, GRPO) to cost"""


def resolved(spec: Spec) -> Spec:
    """`spec` with what it leaves to the device filled in (dtype None: fp32 on cpu, else bf16; rollout_cache
    auto: static for hf generate on one GPU, else dynamic, as fastrlhf.ppo.rollout_cache)."""
    if spec.dtype is None:
        spec = dataclasses.replace(spec, dtype="fp32" if spec.gpu == "cpu" else "bf16")
    if spec.rollout_cache == "auto":
        one_gpu = spec.gpu != "cpu" and spec.placement == "colocated" and spec.gpus == 1 and spec.gen_engine == "hf"
        spec = dataclasses.replace(spec, rollout_cache="static" if one_gpu else "dynamic")
    return spec


def _check(spec: Spec) -> None:
    if spec.stage not in (*STAGES, "all"):
        raise ValueError(f"stage: expected one of {', '.join(STAGES)} or all, got {spec.stage!r}")
    if spec.engine not in ENGINES:
        raise ValueError(f"engine: expected fsdp2 or deepspeed, got {spec.engine!r}")
    for name, stage in _zero_items(spec.zero):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"zero: expected a ZeRO stage 0, 1, 2 or 3, got {stage!r} for {name}")
        if stage == 1 and spec.engine == "fsdp2":
            raise ValueError("zero: fsdp2 has no stage 1 (FSDP2 shards gradients with the optimizer: "
                             "use 2 = reshard_after_forward=False, 3 = fully sharded, or --engine deepspeed)")
    if spec.dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPE_BYTES)}, got {spec.dtype!r}")
    if spec.placement not in ("colocated", "disaggregated"):
        raise ValueError(f"placement: expected colocated or disaggregated, got {spec.placement!r}")
    if spec.gen_engine not in GEN_ENGINES:
        raise ValueError(f"gen_engine: expected one of {', '.join(GEN_ENGINES)}, got {spec.gen_engine!r}")
    if spec.rollout_cache not in ROLLOUT_CACHES:
        raise ValueError(f"rollout_cache: expected one of {', '.join(ROLLOUT_CACHES)}, got {spec.rollout_cache!r}")
    if spec.rollout_cache == "static" and spec.gen_engine != "hf":
        raise ValueError(f"rollout_cache: static is hf generate's cache; gen_engine {spec.gen_engine!r} has its own")
    if spec.offload not in OFFLOADS:
        raise ValueError(f"offload: expected one of {', '.join(OFFLOADS)}, got {spec.offload!r}")
    if spec.offload == "optimizer" and spec.engine == "fsdp2":
        raise ValueError("offload: fsdp2 offloads parameters with their gradients and optimizer states "
                         "(CPUOffloadPolicy); use --offload params, or --engine deepspeed for optimizer only")
    if spec.offload != "none" and spec.engine == "deepspeed" and min(z for _, z in _zero_items(spec.zero)) < 1:
        raise ValueError("offload: DeepSpeed offloads the optimizer of a ZeRO optimizer (stage 1-3; --offload "
                         "params needs stage 3): pass --zero 1, 2 or 3 for every trained model")
    if spec.offload == "params" and any(z != 3 for _, z in _zero_items(spec.zero)) and spec.engine == "deepspeed":
        raise ValueError("offload: --offload params is ZeRO-Infinity's parameter offload, stage 3 only: pass --zero 3")
    if spec.logits not in LOGITS:
        raise ValueError(f"logits: expected one of {', '.join(LOGITS)}, got {spec.logits!r}")
    device(spec.gpu)
    for name in ("gpus", "micro_batch", "seq_len", "rollout_batch", "ppo_epochs", "steps", "num_generations",
                 "gen_tp"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    for name in ("gen_len", "lora_rank"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
    for name in ("mean_gen_len", "micro_rollout_batch", "mini_batch", "cpu_threads"):
        value = getattr(spec, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name}: expected a positive integer or None, got {value!r}")
    if spec.mean_gen_len is not None and spec.mean_gen_len > spec.gen_len:
        raise ValueError(f"mean_gen_len: {spec.mean_gen_len} exceeds gen_len {spec.gen_len}")
    if spec.price < 0:
        raise ValueError(f"price: expected a non-negative price per GPU-hour, got {spec.price!r}")
    if spec.qlora and spec.lora_rank == 0:
        raise ValueError("qlora: needs lora_rank > 0 (QLoRA trains adapters on a 4-bit base)")
    unknown = set(spec.lora_targets) - set(LINEARS)
    if unknown:
        raise ValueError(f"lora_targets: unknown {sorted(unknown)}; expected a subset of {LINEARS}")
    if spec.placement == "disaggregated":
        if not isinstance(spec.pools, dict) or not spec.pools:
            raise ValueError("pools: disaggregated placement needs GPUs per pool, e.g. "
                             "gen=4,actor=4,critic=4,reference=2,reward=2")
        bad = {k: v for k, v in spec.pools.items() if k not in POOLS or isinstance(v, bool)
               or not isinstance(v, int) or v <= 0}
        if bad:
            raise ValueError(f"pools: expected positive GPU counts for {', '.join(POOLS)}, got {bad}")
        if spec.gen_engine != "vllm":
            raise ValueError("gen_engine: disaggregated placement generates on its own pool, which needs an engine "
                             "with its own weights (vllm); hf and ds-he generate with the actor's weights")
    elif spec.pools:
        raise ValueError("pools: only with placement='disaggregated' (colocated runs use gpus)")


def _zero_items(zero) -> list[tuple[str, int]]:
    if isinstance(zero, dict):
        bad = set(zero) - {"actor", "critic", "reference", "reward", "ema", "all"}
        if bad:
            raise ValueError(f"zero: unknown model(s) {sorted(bad)}; expected actor, critic, reference, reward, "
                             "ema or all")
        return list(zero.items())
    if isinstance(zero, bool) or not isinstance(zero, int):
        raise ValueError(f"zero: expected a ZeRO stage 0-3 or a mapping per model, got {zero!r}")
    return [("all", zero)]


def zero_of(spec: Spec, name: str) -> int:
    if isinstance(spec.zero, dict):
        return spec.zero.get(name, spec.zero.get("all", 0))
    return spec.zero


# ---------------------------------------------------------------------------------------------
# Models and pools


def actor_arch(spec: Spec) -> Arch:
    arch = resolve_model(spec.model)
    if spec.params is not None:
        arch = scaled(arch, parse_params(spec.params))
    return arch


def _other_arch(value, actor: Arch, what: str) -> Arch:
    if isinstance(value, Arch | dict):
        return resolve_model(value)
    if value == "actor":
        return actor
    try:
        return scaled(actor, parse_params(value, what))
    except (ValueError, TypeError):
        pass
    try:
        return resolve_model(value)
    except ValueError as err:
        raise ValueError(f"{what}: expected actor, a parameter count (350M) or a model, got {value!r} "
                         f"({err})") from None


def _pool_of(spec: Spec, role: str) -> str:
    return "all" if spec.placement == "colocated" else role


def pool_gpus(spec: Spec) -> dict[str, int]:
    return {"all": spec.gpus} if spec.placement == "colocated" else dict(spec.pools)


def build_models(spec: Spec, arch: Arch, stage: str) -> list[ModelState]:
    """The models a stage keeps, with their bytes per GPU (weights / gradients / optimizer)."""
    gpus = pool_gpus(spec)
    lora = spec.lora_rank > 0
    names: list[tuple[str, Arch, bool, bool, str]] = []  # name, arch, trainable, lm_head, pool
    if stage == "sft":
        names.append(("actor", arch, True, True, "actor"))
    elif stage == "rm":
        names.append(("reward", arch, True, False, "reward"))
    else:
        names.append(("actor", arch, True, True, "actor"))
        names.append(("reference", arch, False, True, "actor" if lora else "reference"))
        if stage == "ppo" and spec.critic != "shared":
            names.append(("critic", _other_arch(spec.critic, arch, "critic"), True, False, "critic"))
        if stage in ("ppo", "grpo") and spec.reward != "rule":
            names.append(("reward", _other_arch(spec.reward, arch, "reward"), False, False, "reward"))
        if spec.ema and stage in ("ppo", "grpo"):
            names.append(("ema", arch, False, True, "actor"))
    models = []
    for name, a, trainable, head, role in names:
        pool = _pool_of(spec, role)
        if pool not in gpus:
            raise ValueError(f"pools: no pool for the {name} ({role}=N)")
        shares = name == "reference" and lora
        m = ModelState(name, a, trainable, gpus[pool], zero_of(spec, name), lm_head=head, shares_base=shares,
                       offloaded=spec.offload_frozen and name in ("reference", "reward"), pool=pool)
        models.append(fill_states(m, engine=spec.engine, dtype=spec.dtype, lora_rank=spec.lora_rank,
                                  lora_targets=spec.lora_targets, qlora=spec.qlora, offload=spec.offload,
                                  reward_fp32=spec.engine == "fsdp2"))
    return models


# ---------------------------------------------------------------------------------------------
# Work: FLOPs, bytes and calls of forwards, backwards and decoding


def forward_flops(arch: Arch, tokens: float, context: float, lm_head: bool = True,
                  head_tokens: float | None = None) -> float:
    """2 FLOPs per multiply-add: linears and attention (QK^T, AV) at mean context, and the lm_head
    over `head_tokens` (default: every token; fastrlhf's linear log-probs: the response tokens only)."""
    trunk = tokens * (2 * arch.matmul_params(False) + 4 * arch.layers * arch.hidden * context)
    head = 2 * arch.head_params() * (tokens if head_tokens is None else head_tokens) if lm_head else 0.0
    return trunk + head


def trainable_tensors(arch: Arch, lora_rank: int, lora_targets: tuple[str, ...]) -> int:
    """Parameter tensors the optimizer steps over (its per-tensor overhead)."""
    if lora_rank:
        return 2 * arch.layers * sum(1 for t in arch.linear_shapes() if t in lora_targets) + 2  # + value head
    per_layer = len(arch.linear_shapes()) + 2 + (len(arch.linear_shapes()) + 2 if arch.family == "opt" else 0)
    return arch.layers * per_layer + 3


def _cpu_threads(spec: Spec, dev: Device, arch: Arch) -> int:
    if spec.cpu_threads:
        return min(spec.cpu_threads, max(1, dev.threads))
    return 1 if arch.params() < SMALL_MODEL_PARAMS else max(1, dev.threads)


def _peak(spec: Spec, dev: Device, arch: Arch) -> float:
    """Peak FLOP/s the run gets: a CPU run of a small model uses one thread (fastrlhf.models), and the
    probe's one-thread figure is used then."""
    if dev.kind == "cpu":
        threads = _cpu_threads(spec, dev, arch)
        return dev.peak_flops_1_thread if threads == 1 else dev.peak_flops * threads / max(1, dev.threads)
    return dev.peak_flops


def compute(spec: Spec, kind: str, flops: float, arch: Arch, dev: Device) -> dict[str, float]:
    """Compute-bound work: FLOPs / peak, and the same scaled by 1024 / hidden. Fitted together,
    time = F / peak * (c + c_h * 1024 / hidden): small matrices (narrow models) reach a lower
    fraction of peak, MFU(hidden) = 1 / (c + c_h * 1024 / hidden)."""
    base = flops / _peak(spec, dev, arch)
    return {kind: base, f"{kind}/h": base * 1024 / arch.hidden}


def _head_tokens(spec: Spec, sequences: float, seq: int) -> float | None:
    """Tokens the lm_head runs on: the response tokens for fastrlhf's linear log-probs, all for logits."""
    return sequences * spec.gen_len if spec.logits == "linear" else None


def collective(dev: Device, size_bytes: float, gpus: int, times: float = 1.0) -> dict[str, float]:
    """Seconds of `times` ring all-gathers (or reduce-scatters) of `size_bytes` over `gpus` GPUs."""
    if gpus <= 1 or not size_bytes:
        return {}
    bw = dev.link if gpus <= dev.node_gpus else dev.network
    if not bw:
        return {}
    return {"comm": times * size_bytes * (gpus - 1) / gpus / bw}


def gather_bytes(m: ModelState, spec: Spec) -> float:
    """Bytes a ZeRO-3 gather of the model moves (its weights in the compute dtype)."""
    return m.arch.params() * DTYPE_BYTES[spec.dtype]


def forward_work(spec: Spec, arch: Arch, dev: Device, sequences: float, seq: int, *, lm_head: bool, micro: float,
                 host_bytes: float = 0.0) -> timing.Work:
    """No-grad forward of `sequences` sequences of `seq` tokens, `micro` at a time."""
    calls = math.ceil(sequences / micro) if sequences else 0
    flops = forward_flops(arch, sequences * seq, seq / 2, lm_head, _head_tokens(spec, sequences, seq))
    w = timing.Work(compute(spec, "fwd", flops, arch, dev))
    w.add({"calls:fwd": calls * arch.layers, "micro:fwd": calls})
    if host_bytes:
        w["host"] += calls * host_bytes / dev.pcie
    return w


def train_passes(spec: Spec, lora: bool) -> int:
    """Forward + backward: 3 passes (input and weight gradients), 2 for a frozen base (LoRA),
    one more forward with gradient checkpointing."""
    return (2 if lora else 3) + (1 if spec.gradient_checkpointing else 0)


def train_work(spec: Spec, arch: Arch, dev: Device, sequences: float, seq: int, *, lm_head: bool, lora: bool,
               micro: float) -> timing.Work:
    passes = train_passes(spec, lora)
    calls = math.ceil(sequences / micro) if sequences else 0
    flops = passes * forward_flops(arch, sequences * seq, seq / 2, lm_head, _head_tokens(spec, sequences, seq))
    adapters = sum(1 for t in arch.linear_shapes() if t in spec.lora_targets) if lora else 0
    # adapters:train: LoRA adapter calls (each a few small kernels and their backward: host overhead)
    return timing.Work(compute(spec, "train", flops, arch, dev)).add({"calls:train": calls * arch.layers * passes,
                                                               "adapters:train": calls * arch.layers * passes
                                                               * adapters, "micro:train": calls})


def optimizer_work(spec: Spec, m: ModelState, dev: Device, steps: int) -> timing.Work:
    """AdamW: reads weights, gradients, momentum, variance and writes three of them back (28 B per
    fp32 parameter), plus a per-tensor cost (the optimizer's and clip_grad_norm's Python loops)."""
    n = m.trainable_params / (m.gpus if m.zero >= 1 else 1)
    tensors = steps * trainable_tensors(m.arch, spec.lora_rank if m.name == "actor" else 0, spec.lora_targets)
    if spec.offload in ("optimizer", "params") and dev.kind == "gpu":
        grad_b, weight_b = (2, 2) if spec.engine == "deepspeed" else (4, 4)
        return timing.Work({"host": steps * n * (grad_b + weight_b) / dev.pcie, "cpu_adam": steps * n,
                            "opt_tensors": tensors})
    return timing.Work({"opt": steps * n * 28 / dev.bandwidth, "opt_tensors": tensors})


def training_comm(spec: Spec, m: ModelState, dev: Device, *, micro_batches: int, steps: int) -> dict[str, float]:
    """ZeRO-3 / FSDP full shard: gather the weights for forward and backward and reduce-scatter the
    gradients, every micro-batch; ZeRO-1/2: reduce-scatter gradients + gather weights per step;
    replicated: all-reduce (= reduce-scatter + all-gather) gradients per step."""
    grads = m.trainable_params * DTYPE_BYTES[spec.dtype]
    if m.zero == 3:
        out = collective(dev, gather_bytes(m, spec), m.gpus, 2 * micro_batches)
        comm = out.get("comm", 0.0) + collective(dev, grads, m.gpus, micro_batches).get("comm", 0.0)
        return {"comm": comm} if comm else {}
    return collective(dev, grads, m.gpus, 2 * steps)


def _gen_weight_bytes(spec: Spec, m: ModelState) -> float:
    """Weights a decode step reads: stored bytes per parameter (fsdp2 full fine-tuning keeps fp32)."""
    per = DTYPE_BYTES[spec.dtype]
    if spec.engine == "fsdp2" and spec.lora_rank == 0 and spec.gen_engine == "hf":
        per = state_bytes("fsdp2", "mixed" if per == 2 else "fp32", 0)["weights"].bytes
    return m.arch.params() * per


def host_engine(spec: Spec) -> str:
    """The name of the generation's host-overhead features (calls:<name>, steps:<name>): hf-static for hf
    generate with the static cache (transformers compiles its decode step), else the engine's own."""
    return "hf-static" if spec.gen_engine == "hf" and resolved(spec).rollout_cache == "static" else spec.gen_engine


VLLM_MEMORY_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization
VLLM_PREFILL_TOKENS = 8192  # tokens per prefill step (vLLM's chunked prefill), bounds its activations


def generation(spec: Spec, actor: ModelState, dev: Device, engine_gpus: int,
               resident: float = 0.0) -> tuple[timing.Work, dict, int]:
    """Work of one engine (gen_tp GPUs) generating its share, its memory per GPU, and its generate
    calls (hf / ds-he: micro-rollout batches one after another; vllm: waves).

    vllm: its KV cache gets what gpu_memory_utilization (0.9) of the GPU leaves after the other
    models in the pool (`resident`) and its own weights; as many sequences run at once as their
    blocks fit (at prompt + mean response length), the rest wait for a later wave."""
    arch, tp, db = actor.arch, spec.gen_tp, DTYPE_BYTES[spec.dtype]
    engines = max(1, engine_gpus // tp)
    sequences = spec.rollout_batch * spec.num_generations / engines  # per engine
    g = spec.gen_len
    m = spec.mean_gen_len or g
    p = spec.seq_len
    kv_tok = kv_cache_bytes(arch, sequences=1, length=1, dtype=spec.dtype)
    weights = _gen_weight_bytes(spec, actor)
    sample = arch.vocab * (db + 8)  # last-position logits, fp32 copy and probabilities
    w = timing.Work()
    flops_tok = 2 * arch.matmul_params(True)
    if spec.gen_engine == "vllm":
        batch = sequences
        act = forward_working_bytes(arch, tokens=min(batch * p, VLLM_PREFILL_TOKENS) / tp, seq=p, dtype=spec.dtype,
                                    flash_attention=spec.flash_attention)
        budget = VLLM_MEMORY_UTILIZATION * dev.memory_bytes - resident - arch.params() * db / tp - act
        per_seq = kv_tok * (p + m) / tp
        running = max(1, min(batch, math.floor(budget / per_seq))) if budget > 0 else 1
        waves = math.ceil(batch / running)
        w.add(compute(spec, "fwd", forward_flops(arch, batch * p, p / 2, head_tokens=batch) / tp, arch, dev))  # prefill
        w["calls:vllm"] += arch.layers * waves
        w[f"decode:{spec.gen_engine}"] += (waves * g * weights / tp + batch * kv_tok * (p * m + m * m / 2) / tp
                                           + batch * m * sample) / dev.bandwidth
        decode_flops = batch * m * (flops_tok + 4 * arch.layers * arch.hidden * (p + m / 2))
        w.add(compute(spec, "fwd", decode_flops / tp, arch, dev))
        w["calls:vllm"] += waves * g * arch.layers
        w["steps:vllm"] += waves * g
        kv = running * per_seq
        mb = running
    else:
        per_gpu = spec.micro_rollout_batch or math.ceil(sequences / tp)
        mb = per_gpu * tp  # ds-he gathers the micro-batches of its tensor-parallel group
        calls = math.ceil(sequences / mb)
        e = spec.gen_engine
        host = host_engine(spec)
        prefill = calls * forward_flops(arch, mb * p, p / 2, head_tokens=mb)
        w.add(compute(spec, "fwd", prefill / tp, arch, dev))
        w[f"calls:{host}"] += calls * arch.layers * (g + 1)
        w[f"steps:{host}"] += calls * g
        w[f"decode:{e}"] += calls * (g * weights / tp + mb * kv_tok * (p * g + g * g / 2) / tp
                                     + mb * g * sample) / dev.bandwidth
        w.add(compute(spec, "fwd", calls * mb * g * (flops_tok + 4 * arch.layers * arch.hidden * (p + g / 2)) / tp,
                      arch, dev))
        kv = kv_cache_bytes(arch, sequences=mb, length=p + g, dtype=spec.dtype) / tp
    if spec.gen_engine == "vllm":
        return w, {"kv_cache": kv, "logits": mb * sample / tp, "activations": act}, waves
    mem = {"kv_cache": kv, "logits": mb * sample / tp,
           "activations": forward_working_bytes(arch, tokens=mb * p / tp, seq=p, dtype=spec.dtype,
                                                flash_attention=spec.flash_attention)}
    return w, mem, calls


# ---------------------------------------------------------------------------------------------
# Stages


def _empty() -> dict:
    return {c: 0.0 for c in COMPONENTS}


def _resident(models: list[ModelState], pool: str) -> dict:
    mem = _empty()
    for m in models:
        if m.pool == pool:
            mem["weights"] += m.weights
            mem["optimizer"] += m.optimizer
    return mem


def _finish(mem: dict) -> dict:
    out = {k: int(round(mem[k])) for k in COMPONENTS}
    out["peak"] = sum(out.values())
    return out


def _phase(pool_mem: dict[str, dict], pool_work: dict[str, timing.Work], dev: Device, flops: float) -> dict:
    kind = dev.kind
    times = {p: timing.seconds(w, kind) for p, w in pool_work.items()}
    lo = {p: timing.seconds(w, kind, "low") for p, w in pool_work.items()}
    hi = {p: timing.seconds(w, kind, "high") for p, w in pool_work.items()}
    slowest = max(times, key=times.get) if times else None
    memory = {p: _finish(m) for p, m in pool_mem.items()}
    worst = max(memory, key=lambda p: memory[p]["peak"])
    return {
        "memory_per_gpu_bytes": memory[worst],
        "memory_by_pool": memory,
        "flops": flops,
        "seconds": times.get(slowest, 0.0),
        "seconds_range": [lo.get(slowest, 0.0), hi.get(slowest, 0.0)],
        "seconds_by_pool": times,
        "terms": {k: v for k, v in timing.breakdown(pool_work[slowest], kind).items()} if slowest else {},
        "_work": pool_work[slowest] if slowest else timing.Work(),
    }


def _ppo_like(spec: Spec, arch: Arch, stage: str) -> dict:
    dev = device(spec.gpu)
    models = build_models(spec, arch, stage)
    by = {m.name: m for m in models}
    pools = pool_gpus(spec)
    actor = by["actor"]
    seq = spec.seq_len + spec.gen_len
    total_seqs = spec.rollout_batch * spec.num_generations
    gen_pool = _pool_of(spec, "gen")
    if gen_pool not in pools:
        raise ValueError("pools: disaggregated placement needs a gen=N pool for generation")
    if pools[gen_pool] % spec.gen_tp:
        raise ValueError(f"gen_tp: {spec.gen_tp} does not divide the {pools[gen_pool]} generation GPUs")
    phases = {}
    flops_of = {}

    def share(model: ModelState) -> float:
        return total_seqs / model.gpus

    def base(pool: str) -> dict:
        return _resident(models, pool)

    def micro_exp(model: ModelState) -> float:
        return min(share(model), spec.micro_rollout_batch or share(model))

    # 1. rollout. This trainer (engine fsdp2) gathers the sharded policy once around HF generate
    # (ShardedModel.run(gathered=policy)) instead of every layer at every decode step.
    fsdp2_gathers = spec.engine == "fsdp2" and spec.gen_engine == "hf" and shards_weights(spec.engine, actor.zero)
    gen_work, gen_mem, calls = generation(spec, actor, dev, pools[gen_pool],
                                          resident=_finish(base(gen_pool))["peak"])
    if spec.gen_engine == "vllm":  # the actor's new weights, to every engine, once per iteration
        gen_work.add(collective(dev, gather_bytes(actor, spec), pools[gen_pool] + (
            actor.gpus if spec.placement == "disaggregated" else 0)))
    elif actor.zero == 3 and spec.gen_engine == "ds-he":  # gathers the actor once per generate call
        gen_work.add(collective(dev, gather_bytes(actor, spec), actor.gpus, calls))
    elif fsdp2_gathers:
        gen_work.add(collective(dev, gather_bytes(actor, spec), actor.gpus, 1))
    elif actor.zero == 3:  # ZeRO-3 under HF generate: every decode step gathers every layer
        gen_work.add(collective(dev, gather_bytes(actor, spec), actor.gpus, calls * (spec.gen_len + 1)))
    mem = base(gen_pool)
    for k, v in gen_mem.items():
        mem[k] += v
    # the whole policy in the compute dtype (not a frozen reference copy) while generate runs
    mem["buffers"] += gather_bytes(actor, spec) if fsdp2_gathers else actor.gathered
    if spec.gen_engine == "ds-he" and actor.zero == 3:  # gathers the whole actor (or its TP shard)
        mem["buffers"] += actor.arch.params() * DTYPE_BYTES[spec.dtype] / spec.gen_tp
    if spec.gen_engine == "vllm":  # vLLM holds its own copy of the weights
        mem["weights"] += actor.arch.params() * DTYPE_BYTES[spec.dtype] / spec.gen_tp
    engines = pools[gen_pool] // spec.gen_tp
    flops_of["rollout"] = forward_flops(arch, total_seqs * (spec.seq_len + (spec.mean_gen_len or spec.gen_len)),
                                        seq / 2)
    phases["rollout"] = _phase({gen_pool: mem}, {gen_pool: gen_work}, dev, flops_of["rollout"])
    phases["rollout"]["engines"] = engines

    # 2. reward
    pool_mem, pool_work = {}, {}
    rm = by.get("reward")
    if rm is not None:
        pool = rm.pool
        mb = micro_exp(rm)
        pool_work[pool] = forward_work(spec, rm.arch, dev, share(rm), seq, lm_head=False, micro=mb,
                                       host_bytes=rm.host_bytes if rm.offloaded else 0.0)
        if rm.zero == 3:
            pool_work[pool].add(collective(dev, gather_bytes(rm, spec), rm.gpus, math.ceil(share(rm) / mb)))
        mem = base(pool)
        mem["buffers"] += rm.gathered
        mem["activations"] += forward_working_bytes(rm.arch, tokens=mb * seq, seq=seq, dtype=spec.dtype,
                                                    flash_attention=spec.flash_attention)
        pool_mem[pool] = mem
        flops_of["reward"] = forward_flops(rm.arch, total_seqs * seq, seq / 2, False)
    else:
        pool = _pool_of(spec, "actor")
        pool_work[pool] = timing.Work({"fixed": 1.0})  # a Python rule over the decoded texts
        pool_mem[pool] = base(pool)
        flops_of["reward"] = 0.0
    phases["reward"] = _phase(pool_mem, pool_work, dev, flops_of["reward"])

    # 3. logprobs: actor (+ shared value head), critic values, reference
    pool_mem, pool_work = {}, {}
    flops = 0.0
    for name in ("actor", "critic", "reference"):
        m = by.get(name)
        if m is None:
            continue
        pool = m.pool
        mb = micro_exp(m)
        w = forward_work(spec, m.arch, dev, share(m), seq, lm_head=m.lm_head, micro=mb,
                         host_bytes=m.host_bytes if m.offloaded else 0.0)
        if m.zero == 3:
            w.add(collective(dev, gather_bytes(m, spec), m.gpus, math.ceil(share(m) / mb)))
        pool_work.setdefault(pool, timing.Work()).add(w)
        mem = pool_mem.setdefault(pool, base(pool))
        mem["buffers"] = max(mem["buffers"], m.gathered)
        mem["activations"] = max(mem["activations"], forward_working_bytes(
            m.arch, tokens=mb * seq, seq=seq, dtype=spec.dtype, flash_attention=spec.flash_attention))
        if m.lm_head:
            mem["logits"] = max(mem["logits"], logit_bytes(m.arch, tokens=mb * seq, dtype=spec.dtype,
                                                           mode=spec.logits, backward=False))
        flops += forward_flops(m.arch, total_seqs * seq, seq / 2, m.lm_head)
    phases["logprobs"] = _phase(pool_mem, pool_work, dev, flops)
    phases["logprobs"]["seconds_by_model"] = {
        name: timing.seconds(forward_work(spec, by[name].arch, dev, share(by[name]), seq, lm_head=by[name].lm_head,
                                          micro=micro_exp(by[name])), dev.kind)
        for name in ("actor", "critic", "reference") if name in by}

    # 4. advantages
    pool = _pool_of(spec, "actor")
    work = timing.Work({"adv": 1.0, "steps:adv": spec.gen_len})
    phases["advantages"] = _phase({pool: base(pool)}, {pool: work}, dev, 0.0)

    # 5. update: ppo_epochs over the rollout, actor (+ critic) forward + backward, optimizer steps
    pool_mem, pool_work = {}, {}
    flops = 0.0
    steps = spec.ppo_epochs * math.ceil(total_seqs / (spec.mini_batch or total_seqs))
    by_model, works = {}, {}
    for name in ("actor", "critic"):
        m = by.get(name)
        if m is None:
            continue
        pool = m.pool
        lora = spec.lora_rank > 0
        mb = min(spec.micro_batch, share(m))
        w = train_work(spec, m.arch, dev, share(m) * spec.ppo_epochs, seq, lm_head=m.lm_head, lora=lora, micro=mb)
        w.add(optimizer_work(spec, m, dev, steps))
        w.add(training_comm(spec, m, dev, micro_batches=math.ceil(share(m) * spec.ppo_epochs / mb), steps=steps))
        if spec.offload == "params" and dev.kind == "gpu":
            passes = 3 + (1 if spec.gradient_checkpointing else 0)
            w["host"] += math.ceil(share(m) * spec.ppo_epochs / mb) * passes * m.arch.params() * 2 / m.gpus / dev.pcie
        by_model[name] = timing.seconds(w, dev.kind)
        works[name] = w
        pool_work.setdefault(pool, timing.Work()).add(w)
        mem = pool_mem.setdefault(pool, base(pool))
        mem["gradients"] = max(mem["gradients"], m.gradients)  # one model steps at a time
        mem["buffers"] = max(mem["buffers"], m.buffers())
        mem["activations"] = max(mem["activations"], activation_bytes(
            m.arch, tokens=mb * seq, seq=seq, dtype=spec.dtype, checkpointing=spec.gradient_checkpointing,
            lora_rank=spec.lora_rank, lora_targets=spec.lora_targets, qlora=spec.qlora,
            flash_attention=spec.flash_attention))
        if m.lm_head:
            mem["logits"] = max(mem["logits"], logit_bytes(m.arch, tokens=mb * seq, dtype=spec.dtype,
                                                           mode=spec.logits, backward=True))
        passes = (2 if lora else 3) + (1 if spec.gradient_checkpointing else 0)
        flops += spec.ppo_epochs * passes * forward_flops(m.arch, total_seqs * seq, seq / 2, m.lm_head)
    phases["update"] = _phase(pool_mem, pool_work, dev, flops)
    phases["update"]["seconds_by_model"] = by_model
    phases["update"]["_work_by_model"] = works
    phases["update"]["optimizer_steps"] = steps
    return {"phases": phases, "models": models}


def _dpo(spec: Spec, arch: Arch) -> dict:
    dev = device(spec.gpu)
    models = build_models(spec, arch, "dpo")
    by = {m.name: m for m in models}
    actor, ref = by["actor"], by["reference"]
    pool = actor.pool
    seq = spec.seq_len + spec.gen_len
    pairs = spec.rollout_batch / actor.gpus  # per GPU per optimizer step
    mb = min(spec.micro_batch, pairs)
    lora = spec.lora_rank > 0
    phases = {}
    mem = _resident(models, pool)
    if ref.pool != pool:
        raise ValueError("dpo: the reference runs beside the policy (colocated, or reference in the actor pool)")
    mem["buffers"] = ref.gathered
    mem["activations"] = forward_working_bytes(arch, tokens=2 * mb * seq, seq=seq, dtype=spec.dtype,
                                               flash_attention=spec.flash_attention)
    mem["logits"] = logit_bytes(arch, tokens=2 * mb * seq, dtype=spec.dtype, mode=spec.logits, backward=False)
    w = forward_work(spec, arch, dev, 2 * pairs, seq, lm_head=True, micro=2 * mb,
                     host_bytes=ref.host_bytes if ref.offloaded else 0.0)
    phases["logprobs"] = _phase({pool: mem}, {pool: w}, dev, forward_flops(arch, 2 * spec.rollout_batch * seq, seq / 2))
    mem = _resident(models, pool)
    mem["gradients"] = actor.gradients
    mem["buffers"] = actor.buffers()
    mem["activations"] = activation_bytes(arch, tokens=2 * mb * seq, seq=seq, dtype=spec.dtype,
                                          checkpointing=spec.gradient_checkpointing, lora_rank=spec.lora_rank,
                                          lora_targets=spec.lora_targets, qlora=spec.qlora,
                                          flash_attention=spec.flash_attention)
    mem["logits"] = logit_bytes(arch, tokens=2 * mb * seq, dtype=spec.dtype, mode=spec.logits, backward=True)
    w = train_work(spec, arch, dev, 2 * pairs, seq, lm_head=True, lora=lora, micro=2 * mb)
    w.add(optimizer_work(spec, actor, dev, 1))
    passes = (2 if lora else 3) + (1 if spec.gradient_checkpointing else 0)
    phases["update"] = _phase({pool: mem}, {pool: w}, dev,
                              passes * forward_flops(arch, 2 * spec.rollout_batch * seq, seq / 2))
    return {"phases": phases, "models": models}


def _training_stage(spec: Spec, arch: Arch, stage: str) -> dict:
    """SFT or RM: one optimizer step of micro_batch sequences (RM: pairs) per GPU."""
    dev = device(spec.gpu)
    models = build_models(spec, arch, stage)
    m = models[0]
    pool = m.pool
    seq = spec.seq_len + spec.gen_len
    sequences = spec.micro_batch * (2 if stage == "rm" else 1)
    tokens = sequences * seq
    mem = _resident(models, pool)
    mem["gradients"] = m.gradients
    mem["buffers"] = m.buffers()
    mem["activations"] = activation_bytes(arch, tokens=tokens, seq=seq, dtype=spec.dtype,
                                          checkpointing=spec.gradient_checkpointing, lora_rank=spec.lora_rank,
                                          lora_targets=spec.lora_targets, qlora=spec.qlora,
                                          flash_attention=spec.flash_attention)
    mem["logits"] = logit_bytes(arch, tokens=tokens, dtype=spec.dtype, mode=spec.logits, backward=True) \
        if stage == "sft" else 0.0
    w = train_work(spec, arch, dev, sequences, seq, lm_head=stage == "sft", lora=spec.lora_rank > 0, micro=sequences)
    w.add(optimizer_work(spec, m, dev, 1))
    passes = (2 if spec.lora_rank else 3) + (1 if spec.gradient_checkpointing else 0)
    flops = passes * forward_flops(arch, tokens * m.gpus, seq / 2, stage == "sft")
    phase = _phase({pool: mem}, {pool: w}, dev, flops)
    return {"phase": phase, "models": models}


# ---------------------------------------------------------------------------------------------
# Fit: which component breaks the budget, and what to change


def _limit(dev: Device) -> float:
    return dev.memory_bytes - dev.context_bytes


def _pool_fit(result: dict, dev: Device) -> dict[str, dict]:
    """Per pool: the peak over phases, the phase and component that set it, fits or not."""
    pools: dict[str, dict] = {}
    phases = result.get("phases") or {"step": result["phase"]}
    for phase, p in phases.items():
        for pool, mem in p["memory_by_pool"].items():
            cur = pools.get(pool)
            if cur is None or mem["peak"] > cur["peak"]:
                biggest = max(COMPONENTS, key=lambda c: mem[c])
                pools[pool] = {"peak": mem["peak"], "phase": phase, "component": biggest,
                               "fits": mem["peak"] <= _limit(dev)}
    return pools


def _peak_of(spec: Spec, stage: str) -> float:
    try:
        r = _run_stage(spec, stage)
    except ValueError:
        return float("inf")
    return max(p["peak"] for p in _pool_fit(r, device(spec.gpu)).values())


def _candidates(spec: Spec, stage: str) -> list[tuple[str, dict]]:
    """Single changes that can lower the peak: (flag text, Spec changes)."""
    dev = device(spec.gpu)
    top = max(s for _, s in _zero_items(spec.zero))
    out = [(f"--zero {z}", {"zero": z}) for z in ((2, 3) if spec.engine == "fsdp2" else (1, 2, 3)) if z > top]
    if spec.lora_rank == 0 and stage != "rm":
        out.append(("--lora-rank 16", {"lora_rank": 16}))
    if spec.offload == "none" and dev.kind == "gpu":
        if spec.engine == "deepspeed":
            out.append(("--offload optimizer" + (" --zero 2" if top < 1 else ""),
                        {"offload": "optimizer", "zero": 2 if top < 1 else spec.zero}))
        out.append(("--offload params" + (" --zero 3" if top < 3 else ""),
                    {"offload": "params", "zero": 3 if top < 3 else spec.zero}))
    if not spec.offload_frozen and stage in ("ppo", "grpo", "dpo"):
        out.append(("--offload-frozen", {"offload_frozen": True}))
    if not spec.gradient_checkpointing:
        out.append(("--gradient-checkpointing", {"gradient_checkpointing": True}))
    if spec.micro_batch > 1:
        out.append(("--micro-batch 1", {"micro_batch": 1}))
    if stage in ("ppo", "grpo"):
        per_gpu = spec.rollout_batch * spec.num_generations / max(pool_gpus(spec).values())
        current = spec.micro_rollout_batch or per_gpu
        if current > 4:
            out.append(("--micro-rollout-batch 4", {"micro_rollout_batch": 4}))
    if spec.placement == "colocated":
        out.append((f"--gpus {2 * spec.gpus} --zero 3", {"gpus": 2 * spec.gpus, "zero": 3}))
    return out


def advice(spec: Spec, stage: str, result: dict, max_steps: int = 8) -> dict:
    """What to change so it fits: each single change with its predicted peak per GPU (the worst pool),
    and a greedy path that applies the change lowering the peak most, one after another, until it fits."""
    dev = device(spec.gpu)

    def peak(s: Spec) -> float:
        try:
            _check(s)
        except ValueError:
            return float("inf")
        return _peak_of(s, stage)

    def row(what: str, value: float) -> dict:
        return {"change": what, "peak_bytes": int(value), "fits": value <= _limit(dev)}

    singles = []
    current_peak = peak(spec)
    for what, changes in _candidates(spec, stage):
        value = peak(dataclasses.replace(spec, **changes))
        if value < current_peak:
            singles.append(row(what, value))
    path, current = [], spec
    for _ in range(max_steps):
        if current_peak <= _limit(dev):
            break
        options = [(peak(dataclasses.replace(current, **c)), what, c) for what, c in _candidates(current, stage)]
        options = [o for o in options if o[0] < current_peak]
        if not options:
            break
        current_peak, what, changes = min(options, key=lambda o: o[0])
        current = dataclasses.replace(current, **changes)
        path.append(row(what, current_peak))
    return {"single": singles, "path": path}


# ---------------------------------------------------------------------------------------------
# The estimate


def _run_stage(spec: Spec, stage: str) -> dict:
    arch = actor_arch(spec)
    if stage in ("ppo", "grpo"):
        return _ppo_like(spec, arch, stage)
    if stage == "dpo":
        return _dpo(spec, arch)
    return _training_stage(spec, arch, stage)


def estimate(spec: Spec | None = None, **overrides) -> dict:
    """Memory per GPU, FLOPs, seconds (with ranges) and cost of each stage: the `--json` schema."""
    spec = resolved(dataclasses.replace(spec or Spec(), **overrides))
    _check(spec)
    dev = device(spec.gpu)
    arch = actor_arch(spec)
    stages = ("sft", "rm", "ppo") if spec.stage == "all" else (spec.stage,)
    out = {}
    for stage in stages:
        raw = _run_stage(spec, stage)
        fit = _pool_fit(raw, dev)
        if "phases" in raw:
            phases = raw["phases"]
            seconds = sum(p["seconds"] for p in phases.values())
            lo = sum(p["seconds_range"][0] for p in phases.values())
            hi = sum(p["seconds_range"][1] for p in phases.values())
            for p in phases.values():
                p["share"] = p["seconds"] / seconds if seconds else 0.0
            flops = sum(p["flops"] for p in phases.values())
            worst = max(phases.values(), key=lambda p: p["memory_per_gpu_bytes"]["peak"])
            memory = dict(worst["memory_per_gpu_bytes"])
            dominant = max(phases, key=lambda k: phases[k]["seconds"])
        else:
            phases, phase = None, raw["phase"]
            seconds, (lo, hi) = phase["seconds"], phase["seconds_range"]
            flops, memory, dominant = phase["flops"], dict(phase["memory_per_gpu_bytes"]), None
        total_gpus = sum(pool_gpus(spec).values())
        result = {
            "memory_per_gpu_bytes": memory,
            "fits": all(f["fits"] for f in fit.values()),
            # offload: host memory per GPU (optimizer states, fp32 gradient partitions, offloaded weights)
            "host_memory_per_gpu_bytes": int(max(sum(m.host_bytes for m in raw["models"] if m.pool == pool)
                                                 for pool in pool_gpus(spec))),
            "pools": {p: dict(f, gpus=pool_gpus(spec)[p]) for p, f in fit.items()},
            "flops": flops * spec.steps,
            "seconds": seconds * spec.steps,
            "seconds_range": [lo * spec.steps, hi * spec.steps],
            "cost_usd": seconds * spec.steps * total_gpus * spec.price / 3600,
            "dominant_phase": dominant,
            "models": {m.name: {"params": m.arch.params(), "trainable_params": m.trainable_params,
                                "pool": m.pool, "gpus": m.gpus, "zero": m.zero,
                                "weights": int(m.weights), "gradients": int(m.gradients),
                                "optimizer": int(m.optimizer), "buffers": int(m.buffers()),
                                "host_bytes": int(m.host_bytes)}
                       for m in raw["models"]},
        }
        if phases is not None:
            result["phases"] = {k: _scale_phase(v, spec.steps) for k, v in phases.items()}
        if not result["fits"]:
            result["advice"] = advice(spec, stage, raw)
        out[stage] = result
    return {"params": arch.params(), "params_text": format_params(arch.params()), "device": dev.name,
            "stages": out}


def phase_works(spec: Spec) -> dict[str, timing.Work]:
    """The work of each PPO / GRPO phase on its slowest pool, and 'update:<model>' per trained model
    (what `python -m fastrlhf.estimate.calibrate` fits the coefficients to)."""
    spec = resolved(spec)
    _check(spec)
    stage = spec.stage if spec.stage in ("ppo", "grpo") else "ppo"
    phases = _ppo_like(spec, actor_arch(spec), stage)["phases"]
    out = {k: p["_work"] for k, p in phases.items()}
    out.update({f"update:{m}": w for m, w in phases["update"]["_work_by_model"].items()})
    return out


def _scale_phase(p: dict, steps: int) -> dict:
    q = {k: v for k, v in p.items() if not k.startswith("_")}
    q["flops"] = p["flops"] * steps
    q["seconds"] = p["seconds"] * steps
    q["seconds_range"] = [x * steps for x in p["seconds_range"]]
    q["seconds_by_pool"] = {k: v * steps for k, v in p["seconds_by_pool"].items()}
    if "seconds_by_model" in p:
        q["seconds_by_model"] = {k: v * steps for k, v in p["seconds_by_model"].items()}
    q["terms"] = {k: v * steps for k, v in p["terms"].items()}
    return q


def largest_layer(arch: Arch) -> int:
    return largest_layer_params(arch)
