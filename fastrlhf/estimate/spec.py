"""What a planned run is: `Spec`, one field per planner input, each with its help under it.

The command line is built from these fields (`fastrlhf estimate --KEY VALUE`, dashes or underscores,
`--config FILE.yaml` for a file of them) by the stages' own docstring-driven parser
(fastrlhf.train.config.parse_args), so a new planner input is one field here. `resolved()` fills what a
field leaves to the device or gives as text (`zero`, `pools`, `lora_targets`), `check()` rejects bad
input with the argument's name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastrlhf.constants import OLD_LOGPROBS, SHARED_PROMPT_MIN_SAVING, SHARED_PROMPT_MODES
from fastrlhf.estimate.arch import LINEARS, Arch, parse_params, resolve_model, scaled
from fastrlhf.estimate.hardware import device
from fastrlhf.estimate.memory import DTYPE_BYTES, ENGINES, OFFLOADS

STAGES = ("sft", "rm", "ppo", "grpo", "dpo", "distill", "serve")
POOLS = ("gen", "actor", "critic", "reference", "reward")
ZERO_MODELS = ("actor", "critic", "reference", "reward", "ema", "student", "teacher", "all")
GEN_ENGINES = ("hf", "ds-he", "vllm", "graph")
ROLLOUT_CACHES = ("auto", "dynamic", "static")
LOGITS = ("linear", "fused", "materialised")
PLACEMENTS = ("colocated", "disaggregated")
SERVE_WEIGHTS = ("auto", "bf16", "fp8", "int8", "int4")


@dataclass
class Spec:
    """One planned run: memory per GPU, FLOPs, time (with a cross-validated range) and cost of each RLHF stage
    and PPO phase, fit per pool; or (--stage serve) the cost of serving the tuned policy. Batch sizes are global
    unless they say per GPU."""

    model: str | dict | Arch = "llama-2-7b"
    """Preset (llama-2-7b, llama-2-13b, llama-2-70b, codellama-34b, llama-3-8b, llama-3.1-8b, llama-3.1-70b,
    qwen2.5-0.5b, qwen2.5-7b, opt-350m
    ... opt-66b), a `fastrlhf ppo --model` built-in (tiny, qwen2-0.5b, llama-0.5b), a model directory or a
    config.json."""
    params: int | str | None = None
    """Actor parameter count (7.5e9, 7.5B, 770M): the model is widened or narrowed to it (layers kept;
    weights, FLOPs, activations and KV cache follow)."""
    stage: str = "ppo"
    """sft, rm, ppo, grpo, dpo, distill (--model the teacher, --student trained to mimic it), all (sft, rm, ppo) or
    serve (deploying the tuned policy; with --student, the student beside it)."""
    gpus: int = 1
    """GPUs of a colocated run (--gpu cpu: processes, torchrun --nproc-per-node)."""
    placement: str = "colocated"
    """colocated: every model on every GPU; disaggregated: a pool of GPUs per role (pools)."""
    pools: str | dict | None = None
    """Disaggregated: GPUs per pool, gen=4,actor=4,critic=4,reference=2,reward=2."""
    engine: str = "fsdp2"
    """fsdp2: this trainer's buffers; deepspeed: the ZeRO paper's accounting (bytes per parameter below)."""
    zero: int | str | dict = 0
    """ZeRO stage 0-3 for every model, or per model: actor=3,critic=2,reference=3,reward=0 (all=N sets the
    rest); fsdp2: 0 none, 2 reshard_after_forward=False, 3 full."""
    dtype: str | None = None
    """bf16 / fp16: mixed precision; fp32. None: the trainer's, fp32 with --gpu cpu, else bf16."""
    lora_rank: int = 0
    """0 = full fine-tuning."""
    lora_targets: str | tuple[str, ...] = LINEARS
    """Linears that get adapters: a comma list of q, k, v, o, gate, up, down."""
    qlora: bool = False
    """4-bit NF4 base weights under the adapters (needs lora_rank > 0)."""
    gradient_checkpointing: bool = False
    """Keep only each layer's input; recompute one layer in backward."""
    flash_attention: bool = True
    """false: eager attention saves the [heads, T, T] probabilities."""
    logits: str = "linear"
    """linear: fastrlhf's chunked log-probs from hidden states; fused: kernels on dtype logits; materialised:
    fp32 logits and log-softmax (plain PyTorch, DeepSpeed-Chat)."""
    micro_batch: int = 1
    """Sequences per forward/backward per GPU (DPO: pairs)."""
    seq_len: int = 512
    """Prompt tokens (SFT/RM/DPO: the sequence is seq_len + gen_len; serve: the context of a request)."""
    gen_len: int = 512
    """Longest generated response (serve: output tokens per request)."""
    mean_gen_len: int | None = None
    """Mean response length (vllm decodes and caches by it); None = gen_len."""
    rollout_batch: int = 64
    """Prompts per PPO / GRPO iteration (DPO: pairs per optimizer step), over all GPUs."""
    micro_rollout_batch: int | None = None
    """Sequences per generate call and per experience forward, per GPU; None = the GPU's whole share."""
    mini_batch: int | None = None
    """Sequences per optimizer step, over all GPUs; None = the whole rollout."""
    ppo_epochs: int = 1
    """Passes over each rollout."""
    num_generations: int = 1
    """Samples per prompt (GRPO's group size G)."""
    critic: str = "shared"
    """shared: value head on the actor trunk (this trainer); actor: a separate copy of the actor; or a model /
    parameter count (350M, opt-350m)."""
    reward: str = "actor"
    """actor: a reward model like the actor; rule: a Python function; or a model / parameter count."""
    gen_engine: str = "hf"
    """hf: Hugging Face generate; ds-he: DeepSpeed hybrid engine; vllm: vLLM (paged KV, continuous batching);
    graph: fastrlhf's decode engine (`fastrlhf ppo --rollout_engine graph`: a group's prompt prefilled once, only
    live rows decode, a pool of rollout_slots KV rows refilled as sequences end). --stage serve: vLLM."""
    rollout_slots: int = 0
    """gen_engine graph: the KV pool's rows, the sequences decoded at once per GPU (`fastrlhf ppo
    --rollout_slots`); 0 = the GPU's whole share of the rollout."""
    gen_tp: int = 1
    """Tensor-parallel GPUs per generation engine (serve: per serving replica)."""
    pin_parameters: bool = True
    """ds-he under ZeRO-3: gather the whole actor (its tensor-parallel share) once per generate call (DeepSpeed's
    hybrid_engine.pin_parameters, DeepSpeed-Chat's default); false (DeepSpeed-Chat --unpin_actor_parameters): gather
    each layer at every decode step, slower, one layer of memory."""
    rollout_cache: str = "dynamic"
    """hf generate's KV cache (`fastrlhf ppo --rollout_cache`): dynamic (eager decode step), static (the decode
    step compiled by transformers), auto = static on one CUDA process, else dynamic."""
    old_logprobs: str = "recompute"
    """PPO / GRPO's old log-probs (`fastrlhf ppo --old_logprobs`): recompute (phase 3's actor forward), or sampler
    (the sampler's own, verl's rollout_correction bypass mode: phase 3 runs the actor's trunk only where PPO's shared
    value head needs its values, and no actor forward otherwise)."""
    kl_in_loss: bool = False
    """--stage grpo: the KL to the reference in the loss, or no KL penalty (`fastrlhf ppo --kl_in_loss` or
    --kl_coef 0). The update's first minibatch then forms its own old log-probs, so phase 3's actor forward scores
    the other rows only (`fastrlhf.train.recipes.ppo.old_from_first_update`, with old_logprobs recompute)."""
    shared_prompt: str = "off"
    """PPO / GRPO's phases 3 and 5 forward each group's prompt once (`fastrlhf ppo --shared_prompt`): on, off, or
    auto (on with num_generations > 1 where it saves at least 10% of those phases' tokens): seq_len / G + gen_len
    tokens per sequence instead of seq_len + gen_len."""
    offload: str = "none"
    """none; optimizer: DeepSpeed ZeRO-Offload (optimizer states and fp32 gradient partitions on the host, stage
    1-3); params: the weights too (ZeRO-3 / FSDP2 CPUOffloadPolicy)."""
    offload_frozen: bool = False
    """Reference and reward weights on the host, streamed in for their forward."""
    ema: bool = False
    """An EMA copy of the actor (DeepSpeed-Chat --enable_ema)."""
    gpu: str = "a100-80g"
    """v100-32g, a6000, a100-40g, a100-80g, a800-80g, h100, h200, or cpu (the recorded CPU,
    data/devices.json)."""
    cpu_threads: int | None = None
    """--gpu cpu: threads the run uses; None = the trainer's rule (one below 20M parameters, else all cores)."""
    price: float = 0.0
    """Dollars per GPU-hour (the cost of a run; serve: dollars per 1M output tokens)."""
    steps: int = 1
    """Optimizer steps (SFT, RM, DPO) or iterations (PPO, GRPO) to cost."""
    serve_weights: str = "auto"
    """--stage serve: weight precision, bf16, fp8 (W8A8 on GPUs with fp8 tensor cores, else weight-only), int8 or
    int4 (weight-only, bf16 compute); auto = dtype."""
    concurrency: int | None = None
    """--stage serve: requests decoded at once per replica; None = as many as the KV cache holds (at most vLLM's
    max_num_seqs, 256)."""
    request_rate: float | None = None
    """--stage serve: requests per second to serve: the latency at that load and the GPUs it needs."""
    student: str | dict | Arch | None = None
    """--stage distill: the student trained to mimic --model (the frozen teacher), as `fastrlhf distill`; --stage
    serve: a student served beside --model, side by side. A preset, built-in, model directory, config.json, or a
    parameter count (--model narrowed to it). It shares the teacher's vocabulary."""
    on_policy: bool = False
    """--stage distill: the student samples its gen_len-token responses every step (hf generate), as `fastrlhf
    distill --mode on_policy`; false: offline (prompt, response) data. rollout_batch: sequences per optimizer step
    over all GPUs; micro_batch: per forward / backward per GPU."""


# ---------------------------------------------------------------------------------------------
# Text forms (the command line gives strings)


def parse_mapping(text: str, what: str, keys: tuple[str, ...]) -> dict[str, int]:
    """`gen=4,actor=4` -> {"gen": 4, "actor": 4}."""
    out = {}
    for item in text.split(","):
        if "=" not in item:
            raise ValueError(f"{what}: expected NAME=N items separated by commas, got {text!r}")
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in keys:
            raise ValueError(f"{what}: unknown name {name!r}; expected {', '.join(keys)}")
        try:
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"{what}: {name}={value!r} is not an integer") from None
    return out


def parse_zero(text) -> int | dict[str, int]:
    """`3` or `actor=3,critic=2,all=0`."""
    text = str(text)
    if "=" in text:
        return parse_mapping(text, "zero", ZERO_MODELS)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"zero: expected a stage 0-3 or actor=3,critic=2,..., got {text!r}") from None


def actor_arch(spec: Spec) -> Arch:
    """The actor's shape: `model` resolved, widened or narrowed to `params` when given."""
    arch = resolve_model(spec.model)
    if spec.params is not None:
        arch = scaled(arch, parse_params(spec.params))
    return arch


def other_arch(value, actor: Arch, what: str) -> Arch:
    """A critic's, reward model's or student's shape: the actor's, a parameter count (the actor scaled to it) or a
    model."""
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


def student_arch(spec: Spec) -> Arch:
    """The student's shape (--student), which must share the teacher's (--model) vocabulary: the divergence
    compares their next-token distributions token by token."""
    teacher = actor_arch(spec)
    student = other_arch(spec.student, teacher, "student")
    if student.vocab != teacher.vocab:
        raise ValueError(f"student: {student.source or spec.student} has a vocabulary of {student.vocab} and the "
                         f"teacher {teacher.source or spec.model} {teacher.vocab}; a student shares its teacher's "
                         "vocabulary")
    return student


def shared_prompt_saving(spec: Spec) -> float:
    """The share of phases 3 and 5's tokens a shared prompt saves: G (P + R) -> P + G R per group (0 with one
    response per prompt, or outside PPO / GRPO)."""
    G, P, R = spec.num_generations, spec.seq_len, spec.gen_len
    if G < 2 or spec.stage not in ("ppo", "grpo"):
        return 0.0
    return (G - 1) * P / (G * (P + R))


def resolved(spec: Spec) -> Spec:
    """`spec` with its text fields parsed and what it leaves to the device filled in: dtype None = fp32 on cpu,
    else bf16; rollout_cache auto = static for hf generate on one GPU, else dynamic
    (fastrlhf.train.recipes.ppo.rollout_cache); shared_prompt auto = on where it saves enough
    (`shared_prompt_saving`)."""
    changes = {}
    if isinstance(spec.zero, str):
        changes["zero"] = parse_zero(spec.zero)
    if isinstance(spec.pools, str):
        changes["pools"] = parse_mapping(spec.pools, "pools", POOLS)
    if isinstance(spec.lora_targets, str):
        changes["lora_targets"] = tuple(t.strip() for t in spec.lora_targets.split(",") if t.strip())
    if spec.dtype is None:
        changes["dtype"] = "fp32" if spec.gpu == "cpu" else "bf16"
    if spec.shared_prompt == "auto":
        changes["shared_prompt"] = "on" if shared_prompt_saving(spec) >= SHARED_PROMPT_MIN_SAVING else "off"
    if spec.rollout_cache == "auto":
        one_gpu = spec.gpu != "cpu" and spec.placement == "colocated" and spec.gpus == 1 and spec.gen_engine == "hf"
        changes["rollout_cache"] = "static" if one_gpu else "dynamic"
    return dataclasses.replace(spec, **changes) if changes else spec


# ---------------------------------------------------------------------------------------------
# Checks: a ValueError naming the argument and what was expected


def zero_items(zero) -> list[tuple[str, int]]:
    if isinstance(zero, dict):
        bad = set(zero) - set(ZERO_MODELS)
        if bad:
            raise ValueError(f"zero: unknown model(s) {sorted(bad)}; expected {', '.join(ZERO_MODELS)}")
        return list(zero.items())
    if isinstance(zero, bool) or not isinstance(zero, int):
        raise ValueError(f"zero: expected a ZeRO stage 0-3 or a mapping per model, got {zero!r}")
    return [("all", zero)]


def zero_of(spec: Spec, name: str) -> int:
    if isinstance(spec.zero, dict):
        return spec.zero.get(name, spec.zero.get("all", 0))
    return spec.zero


CHOICES = {"stage": (*STAGES, "all"), "engine": ENGINES, "dtype": tuple(DTYPE_BYTES), "placement": PLACEMENTS,
           "gen_engine": GEN_ENGINES, "rollout_cache": ROLLOUT_CACHES, "old_logprobs": OLD_LOGPROBS,
           "offload": OFFLOADS, "logits": LOGITS, "serve_weights": SERVE_WEIGHTS, "shared_prompt": SHARED_PROMPT_MODES}
POSITIVE = ("gpus", "micro_batch", "seq_len", "rollout_batch", "ppo_epochs", "steps", "num_generations", "gen_tp")
NON_NEGATIVE = ("gen_len", "lora_rank", "rollout_slots")
POSITIVE_OR_NONE = ("mean_gen_len", "micro_rollout_batch", "mini_batch", "cpu_threads", "concurrency")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_values(spec: Spec) -> None:
    for name, allowed in CHOICES.items():
        if getattr(spec, name) not in allowed:
            raise ValueError(f"{name}: expected one of {', '.join(allowed)}, got {getattr(spec, name)!r}")
    for name in POSITIVE:
        if not _is_int(getattr(spec, name)) or getattr(spec, name) <= 0:
            raise ValueError(f"{name}: expected a positive integer, got {getattr(spec, name)!r}")
    for name in NON_NEGATIVE:
        if not _is_int(getattr(spec, name)) or getattr(spec, name) < 0:
            raise ValueError(f"{name}: expected a non-negative integer, got {getattr(spec, name)!r}")
    for name in POSITIVE_OR_NONE:
        value = getattr(spec, name)
        if value is not None and (not _is_int(value) or value <= 0):
            raise ValueError(f"{name}: expected a positive integer or None, got {value!r}")
    if spec.mean_gen_len is not None and spec.mean_gen_len > spec.gen_len:
        raise ValueError(f"mean_gen_len: {spec.mean_gen_len} exceeds gen_len {spec.gen_len}")
    if spec.price < 0:
        raise ValueError(f"price: expected a non-negative price per GPU-hour, got {spec.price!r}")
    if spec.request_rate is not None and not spec.request_rate > 0:
        raise ValueError(f"request_rate: expected a positive number of requests per second, got {spec.request_rate!r}")
    device(spec.gpu)


def _check_zero_and_offload(spec: Spec) -> None:
    stages = [z for _, z in zero_items(spec.zero)]
    for name, z in zero_items(spec.zero):
        if z not in (0, 1, 2, 3):
            raise ValueError(f"zero: expected a ZeRO stage 0, 1, 2 or 3, got {z!r} for {name}")
        if z == 1 and spec.engine == "fsdp2":
            raise ValueError("zero: fsdp2 has no stage 1 (FSDP2 shards gradients with the optimizer: "
                             "use 2 = reshard_after_forward=False, 3 = fully sharded, or --engine deepspeed)")
    if spec.offload == "optimizer" and spec.engine == "fsdp2":
        raise ValueError("offload: fsdp2 offloads parameters with their gradients and optimizer states "
                         "(CPUOffloadPolicy); use --offload params, or --engine deepspeed for optimizer only")
    if spec.offload != "none" and spec.engine == "deepspeed" and min(stages) < 1:
        raise ValueError("offload: DeepSpeed offloads the optimizer of a ZeRO optimizer (stage 1-3; --offload "
                         "params needs stage 3): pass --zero 1, 2 or 3 for every trained model")
    if spec.offload == "params" and spec.engine == "deepspeed" and any(z != 3 for z in stages):
        raise ValueError("offload: --offload params is ZeRO-Infinity's parameter offload, stage 3 only: pass --zero 3")


def _check_lora(spec: Spec) -> None:
    if spec.qlora and spec.lora_rank == 0:
        raise ValueError("qlora: needs lora_rank > 0 (QLoRA trains adapters on a 4-bit base)")
    unknown = set(spec.lora_targets) - set(LINEARS)
    if unknown:
        raise ValueError(f"lora_targets: unknown {sorted(unknown)}; expected a subset of {LINEARS}")


def _check_generation(spec: Spec) -> None:
    if spec.gen_engine == "graph" and spec.gen_tp != 1:
        raise ValueError(f"gen_tp: the graph engine runs on each GPU for its own rows (gen_tp 1), got {spec.gen_tp}")
    if spec.rollout_slots and spec.gen_engine != "graph":
        raise ValueError(f"rollout_slots: the graph engine's KV pool; gen_engine {spec.gen_engine!r} has its own")
    if spec.rollout_cache == "static" and spec.gen_engine != "hf":
        raise ValueError(f"rollout_cache: static is hf generate's cache; gen_engine {spec.gen_engine!r} has its own")
    if spec.placement == "disaggregated":
        if not isinstance(spec.pools, dict) or not spec.pools:
            raise ValueError("pools: disaggregated placement needs GPUs per pool, e.g. "
                             "gen=4,actor=4,critic=4,reference=2,reward=2")
        bad = {k: v for k, v in spec.pools.items() if k not in POOLS or not _is_int(v) or v <= 0}
        if bad:
            raise ValueError(f"pools: expected positive GPU counts for {', '.join(POOLS)}, got {bad}")
        if spec.gen_engine != "vllm":
            raise ValueError("gen_engine: disaggregated placement generates on its own pool, which needs an engine "
                             "with its own weights (vllm); hf and ds-he generate with the actor's weights")
    elif spec.pools:
        raise ValueError("pools: only with placement='disaggregated' (colocated runs use gpus)")


def _check_distill(spec: Spec) -> None:
    if spec.stage == "distill":
        if spec.student is None:
            raise ValueError("student: --stage distill needs --student (a model, or a parameter count such as 0.5B)")
        if spec.placement != "colocated":
            raise ValueError("placement: fastrlhf distill holds the student and the teacher under one FSDP root on "
                             "every GPU: colocated only")
        if spec.on_policy and spec.gen_engine != "hf":
            raise ValueError(f"gen_engine: fastrlhf distill samples with hf generate (the rollout path), got "
                             f"{spec.gen_engine!r}")
    elif spec.on_policy:
        raise ValueError(f"on_policy: a --stage distill option, got --stage {spec.stage}")
    elif spec.student is not None and spec.stage != "serve":
        raise ValueError(f"student: --stage distill or serve only, got --stage {spec.stage}")


def check(spec: Spec) -> None:
    """Reject what no run can be, naming the argument (`spec` resolved)."""
    _check_values(spec)
    _check_zero_and_offload(spec)
    _check_lora(spec)
    _check_generation(spec)
    _check_distill(spec)
