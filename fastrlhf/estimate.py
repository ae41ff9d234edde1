"""`fastrlhf estimate`: memory, FLOPs, time and cost of each RLHF stage and PPO phase.

Answers "will 7B PPO fit on 4 x A100-40G, and what will it cost?" before renting GPUs.
Everything is a closed-form model of what PyTorch keeps alive; `--measure` checks it
against a real training step (exact state bytes on CPU, `max_memory_allocated` on CUDA).

Memory per GPU, per model (actor, critic, reference, reward):

- weights     dtype bytes per parameter (QLoRA: NF4 base linears, 0.5 B + double-quantised
              constants, QLoRA paper sec. 3); ZeRO-3 shards them over the GPUs and gathers
              one layer at a time (DeepSpeed: "largest layer" term).
- gradients   one dtype gradient per trainable parameter; ZeRO-3 reduce-scatters it
              layer by layer (the gathered layer's gradient only).
- optimizer   Adam. Mixed precision (bf16/fp16): fp32 master weights, m and v (the ZeRO
              paper's K = 12) plus the fp32 gradient partition the optimizer steps on
              (4), 16 B per trainable parameter, sharded from ZeRO-1 on. fp32: m and v, 8 B.
              This is DeepSpeed's accounting: ZeRO-2 = 4P + 16P/N, ZeRO-3 = 4L + 18P/N.
- activations what autograd saves for backward in a Hugging Face decoder layer
              (`_layer_saved_bytes`), all layers, or the layer inputs plus one layer with
              gradient checkpointing; FlashAttention saves no [T, T] scores.
- logits      fused: fastrlhf's log-prob kernels read dtype logits and write a dtype
              gradient, never an fp32 copy; materialised (`--no-fused`): an fp32 copy,
              its log-softmax and both their gradients, [N, V] each.
- kv_cache    K and V of every layer for the generated batch (generation phase).

Time: compute at `MFU_*` of the GPU's peak bf16 FLOP/s; decoding is bandwidth bound
(weights + KV cache read once per token at `DECODE_BANDWIDTH_EFFICIENCY`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1024**3

# Efficiency assumptions (stated, not measured here). MFU = achieved / peak FLOP/s.
MFU_TRAIN = 0.40  # dense bf16 training with FlashAttention, typical of well-tuned LLM training
MFU_FORWARD = 0.50  # no-grad forward (prefill, experience log-probs / values / rewards)
DECODE_BANDWIDTH_EFFICIENCY = 0.60  # HF generate reaches well under peak HBM bandwidth
CUDA_CONTEXT_BYTES = 1 * GIB  # CUDA context + allocator slack, not in max_memory_allocated

NF4_BYTES_PER_PARAM = 0.5 + 0.127 / 8  # 4 bits + double-quantised constants (QLoRA paper)
MIXED_ADAM_BYTES = 16  # fp32 master 4 + m 4 + v 4 + fp32 grad partition 4
FP32_ADAM_BYTES = 8  # m 4 + v 4 (the fp32 weights and grads are the model's own)

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
PHASES = ("generation", "experience", "training")
COMPONENTS = ("weights", "gradients", "optimizer", "activations", "logits", "kv_cache")


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bandwidth: float  # bytes/s, HBM
    peak_flops: float  # dense bf16 FLOP/s (no sparsity)


# Vendor data sheets: NVIDIA A100 (SXM, 40/80 GB), H100 SXM5, H200 SXM.
GPUS = {
    "a100-40g": GPU("A100-SXM4-40GB", 40 * GIB, 1.555e12, 312e12),
    "a100-80g": GPU("A100-SXM4-80GB", 80 * GIB, 2.039e12, 312e12),
    "h100": GPU("H100-SXM5-80GB", 80 * GIB, 3.35e12, 989e12),
    "h200": GPU("H200-SXM-141GB", 141 * 10**9, 4.8e12, 989e12),
}


@dataclass(frozen=True)
class Arch:
    """A decoder-only transformer, as the numbers in its Hugging Face config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    family: str = "llama"  # llama: RMSNorm + gated SiLU MLP + RoPE; opt: LayerNorm + ReLU MLP + biases
    qkv_bias: bool = False  # Qwen2
    max_positions: int = 2048  # OPT's learned position table
    source: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of every linear in one layer."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        shapes = {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h), "up": (h, i), "down": (i, h)}
        if self.family == "llama":
            shapes["gate"] = (h, i)
        return shapes

    def layer_params(self) -> int:
        shapes = self.linear_shapes()
        n = sum(a * b for a, b in shapes.values())
        if self.family == "opt":  # every linear has a bias; two LayerNorms with weight + bias
            n += sum(b for _, b in shapes.values()) + 4 * self.hidden
        else:
            n += 2 * self.hidden + (self.hidden + 2 * self.kv_dim if self.qkv_bias else 0)
        return n

    def params(self) -> int:
        n = self.layers * self.layer_params() + self.vocab * self.hidden  # embedding
        n += 0 if self.tied else self.vocab * self.hidden  # lm_head
        if self.family == "opt":
            n += (self.max_positions + 2) * self.hidden + 2 * self.hidden  # positions (+2 offset), final LN
        else:
            n += self.hidden  # final RMSNorm
        return n


# Numbers from each model's config.json on the Hugging Face Hub (repo named in `source`).
PRESETS = {
    "llama-2-7b": Arch(4096, 32, 32, 32, 11008, 32000, False, max_positions=4096,
                       source="meta-llama/Llama-2-7b-hf"),
    "llama-3-8b": Arch(4096, 32, 32, 8, 14336, 128256, False, max_positions=8192,
                       source="meta-llama/Meta-Llama-3-8B"),
    "qwen2.5-0.5b": Arch(896, 24, 14, 2, 4864, 151936, True, qkv_bias=True, max_positions=32768,
                         source="Qwen/Qwen2.5-0.5B"),
    "qwen2.5-7b": Arch(3584, 28, 28, 4, 18944, 152064, False, qkv_bias=True, max_positions=131072,
                       source="Qwen/Qwen2.5-7B"),
    "opt-1.3b": Arch(2048, 24, 32, 32, 8192, 50272, True, family="opt", max_positions=2048,
                     source="facebook/opt-1.3b"),
    "opt-13b": Arch(5120, 40, 40, 40, 20480, 50272, True, family="opt", max_positions=2048,
                    source="facebook/opt-13b"),
}


def arch_from_config(config: dict, source: str = "config.json") -> Arch:
    """An `Arch` from a parsed Hugging Face config.json (llama/mistral/qwen2/opt style)."""
    family = "opt" if config.get("model_type") == "opt" else "llama"
    keys = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
            "intermediate": "ffn_dim" if family == "opt" else "intermediate_size", "vocab": "vocab_size"}
    missing = [key for key in keys.values() if key not in config]
    if missing:
        raise ValueError(f"model config {source} is missing {', '.join(missing)}")
    values = {name: config[key] for name, key in keys.items()}
    bad = [f"{keys[n]}={v!r}" for n, v in values.items() if not isinstance(v, int) or v <= 0]
    if bad:
        raise ValueError(f"model config {source}: expected positive integers, got {', '.join(bad)}")
    tied_default = family == "opt"
    return Arch(
        kv_heads=int(config.get("num_key_value_heads") or values["heads"]),
        tied=bool(config.get("tie_word_embeddings", tied_default)),
        family=family,
        qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
        max_positions=int(config.get("max_position_embeddings", 2048)),
        source=source,
        **values,
    )


def resolve_model(model: str | dict | Arch) -> Arch:
    """A preset name, a path to a config.json, a parsed config dict, or an Arch."""
    if isinstance(model, Arch):
        return model
    if isinstance(model, dict):
        return arch_from_config(model, "config dict")
    if not isinstance(model, str):
        raise TypeError("model: expected a preset name, a config.json path or a dict, "
                        f"got {type(model).__name__}")
    if model.lower() in PRESETS:
        return PRESETS[model.lower()]
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ValueError(f"model: config file {path} does not exist")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"model: {path} is not valid JSON ({err})") from err
        return arch_from_config(config, str(path))
    raise ValueError(f"model: unknown preset {model!r}; expected one of {', '.join(PRESETS)} "
                     "or a path to a Hugging Face config.json")


@dataclass
class Spec:
    """One planned run. Sizes are per GPU unless they say otherwise."""

    model: str | dict | Arch = "llama-2-7b"
    """preset name, path to a Hugging Face config.json, or a parsed config"""
    params: int | None = None
    """override the parameter count (all per-parameter terms scale to it)"""
    stage: str = "ppo"
    """sft, rm, ppo or all"""
    gpus: int = 1
    """data-parallel GPUs"""
    zero: int = 0
    """ZeRO stage 0-3 (FSDP: NO_SHARD, -, SHARD_GRAD_OP, FULL_SHARD)"""
    dtype: str = "bf16"
    """weights and activations; bf16/fp16 train with mixed-precision Adam"""
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
    micro_batch: int = 1
    """sequences per forward/backward per GPU"""
    seq_len: int = 512
    """prompt tokens (SFT/RM: the whole sequence is seq_len + gen_len)"""
    gen_len: int = 512
    """generated (response) tokens"""
    rollout_batch: int = 64
    """prompts per PPO iteration, over all GPUs"""
    ppo_epochs: int = 1
    """passes over each rollout"""
    critic: str = "shared"
    """shared: value head on the actor trunk; separate: its own model"""
    fused: bool = True
    """fastrlhf fused log-probs; False: materialised fp32 [N, V] logits"""
    gpu: str = "a100-80g"
    """a100-40g, a100-80g, h100, h200"""
    price: float = 0.0
    """dollars per GPU-hour"""
    steps: int = 1
    """optimizer steps (SFT, RM) or PPO iterations to cost"""


def _check(spec: Spec) -> None:
    if spec.stage not in ("sft", "rm", "ppo", "all"):
        raise ValueError(f"stage: expected sft, rm, ppo or all, got {spec.stage!r}")
    if spec.zero not in (0, 1, 2, 3):
        raise ValueError(f"zero: expected a ZeRO stage 0, 1, 2 or 3, got {spec.zero!r}")
    if spec.dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPE_BYTES)}, got {spec.dtype!r}")
    if spec.critic not in ("shared", "separate"):
        raise ValueError(f"critic: expected shared or separate, got {spec.critic!r}")
    if spec.gpu not in GPUS:
        raise ValueError(f"gpu: expected one of {', '.join(GPUS)}, got {spec.gpu!r}")
    for name in ("gpus", "micro_batch", "seq_len", "rollout_batch", "ppo_epochs", "steps"):
        value = getattr(spec, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    for name in ("gen_len", "lora_rank"):
        value = getattr(spec, name)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
    if spec.params is not None and (not isinstance(spec.params, int) or spec.params <= 0):
        raise ValueError(f"params: expected a positive integer, got {spec.params!r}")
    if spec.price < 0:
        raise ValueError(f"price: expected a non-negative price per GPU-hour, got {spec.price!r}")
    if spec.qlora and spec.lora_rank == 0:
        raise ValueError("qlora: needs lora_rank > 0 (QLoRA trains adapters on a 4-bit base)")
    unknown = set(spec.lora_targets) - set(LINEARS)
    if unknown:
        raise ValueError(f"lora_targets: unknown {sorted(unknown)}; expected a subset of {LINEARS}")


# ---------------------------------------------------------------------------------------------
# Parameters and model states


@dataclass
class Model:
    """One model in a stage and what it costs per GPU outside activations."""

    name: str
    arch: Arch
    trainable: bool
    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    trainable_params: int = 0
    lm_head: bool = True  # produces [N, V] logits (actor, reference); critic / reward: a scalar head
    extra: dict = field(default_factory=dict)


def _lora_params(arch: Arch, spec: Spec) -> int:
    shapes = arch.linear_shapes()
    per_layer = sum(spec.lora_rank * (a + b) for name, (a, b) in shapes.items() if name in spec.lora_targets)
    return arch.layers * per_layer


def _scale(arch: Arch, spec: Spec) -> float:
    """`--params` rescales every per-parameter term."""
    return spec.params / arch.params() if spec.params else 1.0


def _weight_bytes(arch: Arch, spec: Spec) -> float:
    db = DTYPE_BYTES[spec.dtype]
    total = arch.params() * _scale(arch, spec)
    if not spec.qlora:
        return total * db
    quantised = arch.layers * sum(a * b for a, b in arch.linear_shapes().values()) * _scale(arch, spec)
    return quantised * NF4_BYTES_PER_PARAM + (total - quantised) * db


def _largest_layer_params(arch: Arch) -> int:
    return max(arch.layer_params(), arch.vocab * arch.hidden)


def _model_states(model: Model, spec: Spec, shares_base: bool = False) -> Model:
    """Fill weights / gradients / optimizer bytes per GPU (DeepSpeed ZeRO accounting)."""
    arch, db, n = model.arch, DTYPE_BYTES[spec.dtype], spec.gpus
    lora = spec.lora_rank > 0
    adapters = _lora_params(arch, spec) if lora else 0
    base = 0.0 if shares_base else _weight_bytes(arch, spec)
    weights = base + adapters * db
    if spec.zero == 3:  # shard everything, gather one layer at a time
        weights = weights / n + _largest_layer_params(arch) * db
    model.weights = weights
    if not model.trainable:
        return model
    trainable = adapters if lora else arch.params() * _scale(arch, spec)
    model.trainable_params = int(trainable)
    adam = MIXED_ADAM_BYTES if db == 2 else FP32_ADAM_BYTES
    model.optimizer = trainable * adam / (n if spec.zero >= 1 else 1)
    if spec.zero == 3:
        model.gradients = min(trainable, _largest_layer_params(arch)) * db
    else:
        model.gradients = trainable * db
    return model


# ---------------------------------------------------------------------------------------------
# Activations, logits, KV cache


def _trains(name: str, spec: Spec, trainable: bool) -> bool:
    """Does autograd need the input of this linear (weight or adapter gradient)?"""
    if not trainable:
        return False
    # bitsandbytes' 4-bit matmul saves its input for backward whether or not it has an adapter
    return spec.lora_rank == 0 or spec.qlora or name in spec.lora_targets


def _layer_saved_bytes(arch: Arch, spec: Spec, seq: int, trainable: bool) -> float:
    """Bytes per token that autograd saves in one decoder layer (HF eager modules).

    RMSNorm upcasts to fp32 and saves that input (4 B/elem), LayerNorm saves its dtype input;
    a trainable norm weight also saves the normalised output. A linear saves its input only if
    its weight (or adapter) gets a gradient. Attention saves q, k, v and the output (+ the
    softmax probabilities, fp32 and dtype, without FlashAttention). The gated MLP saves gate,
    up and SiLU(gate); OPT's ReLU MLP saves the activation.
    """
    db, h, kv, i = DTYPE_BYTES[spec.dtype], arch.hidden, arch.kv_dim, arch.intermediate
    full = trainable and spec.lora_rank == 0
    t = lambda name: _trains(name, spec, trainable)  # noqa: E731
    norm = (4 * h if arch.family == "llama" else db * h) + (db * h if full else 0)
    total = 2 * norm
    total += db * h if (t("q") or t("k") or t("v")) else 0  # shared q/k/v input
    total += db * (h + 2 * kv + h)  # q, k, v and attention output (o_proj input)
    if not spec.flash_attention:
        total += (4 + db) * arch.heads * seq  # softmax probabilities in fp32 and dtype
    if arch.family == "llama":
        total += db * 3 * i  # gate, up, silu(gate)
        total += db * h if (t("gate") or t("up")) else 0
        total += db * i if t("down") else 0
    else:
        total += db * i  # relu output (= fc2 input)
        total += db * h if t("up") else 0
    return total


def _activation_bytes(arch: Arch, spec: Spec, tokens: int, seq: int, trainable: bool) -> float:
    per_layer = _layer_saved_bytes(arch, spec, seq, trainable)
    db = DTYPE_BYTES[spec.dtype]
    head = tokens * (4 * arch.hidden + db * arch.hidden)  # final norm + lm_head / value-head input
    if spec.gradient_checkpointing:
        return tokens * (arch.layers * db * arch.hidden + per_layer) + head
    return tokens * arch.layers * per_layer + head


def _forward_working_bytes(arch: Arch, spec: Spec, tokens: int, seq: int) -> float:
    """No-grad forward: one layer's tensors alive at a time (full-training layer as a bound)."""
    full = dataclasses.replace(spec, lora_rank=0)
    return tokens * _layer_saved_bytes(arch, full, seq, trainable=True)


def _logit_bytes(arch: Arch, spec: Spec, tokens: int, backward: bool) -> float:
    """[N, V] buffers of the log-prob computation."""
    db, n_v = DTYPE_BYTES[spec.dtype], tokens * arch.vocab
    if spec.fused:
        return n_v * db * (2 if backward else 1)  # logits (+ their gradient), in dtype
    # materialised: dtype logits + fp32 copy + fp32 log-softmax (+ both fp32 gradients)
    return n_v * (db + 4 + 4 + (8 if backward else 0))


def _kv_cache_bytes(arch: Arch, spec: Spec, sequences: int, length: int) -> float:
    return 2 * arch.layers * arch.kv_dim * length * sequences * DTYPE_BYTES[spec.dtype]


# ---------------------------------------------------------------------------------------------
# FLOPs and time


def _forward_flops(arch: Arch, spec: Spec, tokens: int, context: float, lm_head: bool = True) -> float:
    """2 FLOPs per multiply-add: linears (+ lm_head) and attention (QK^T, AV) at mean context."""
    linear = arch.layers * sum(a * b for a, b in arch.linear_shapes().values()) * _scale(arch, spec)
    if lm_head:
        linear += arch.vocab * arch.hidden
    return tokens * (2 * linear + 4 * arch.layers * arch.hidden * context)


def _train_flops(arch: Arch, spec: Spec, tokens: int, seq: int, lm_head: bool = True) -> float:
    """forward + backward: 2x forward for input and weight gradients (6N), input-only for a
    frozen base (LoRA, 4N), one more forward with gradient checkpointing."""
    passes = 1 + (2 if spec.lora_rank == 0 else 1) + (1 if spec.gradient_checkpointing else 0)
    return passes * _forward_flops(arch, spec, tokens, seq / 2, lm_head)


def _compute_seconds(flops: float, spec: Spec, mfu: float) -> float:
    return flops / (spec.gpus * GPUS[spec.gpu].peak_flops * mfu)


# ---------------------------------------------------------------------------------------------
# Stages


def _models(arch: Arch, spec: Spec, stage: str) -> list[Model]:
    lora = spec.lora_rank > 0
    if stage == "sft":
        return [_model_states(Model("actor", arch, True), spec)]
    if stage == "rm":
        return [_model_states(Model("reward", arch, True, lm_head=False), spec)]
    models = [_model_states(Model("actor", arch, True), spec),
              _model_states(Model("reference", arch, False), spec, shares_base=lora)]
    if lora:  # adapters disabled = the reference; no second copy, no adapter bytes either
        models[1].weights = 0.0
    if spec.critic == "separate":
        models.append(_model_states(Model("critic", arch, True, lm_head=False), spec))
    models.append(_model_states(Model("reward", arch, False, lm_head=False), spec))
    return models


def _memory(models: list[Model], *, gradients: bool, activations: float, logits: float, kv: float) -> dict:
    mem = {
        "weights": sum(m.weights for m in models),
        "gradients": sum(m.gradients for m in models) if gradients else 0.0,
        "optimizer": sum(m.optimizer for m in models),
        "activations": activations,
        "logits": logits,
        "kv_cache": kv,
    }
    mem = {k: int(round(v)) for k, v in mem.items()}
    mem["peak"] = sum(mem.values())
    return mem


def _phase(memory: dict, flops: float, seconds: float) -> dict:
    return {"memory_per_gpu_bytes": memory, "flops": flops, "seconds": seconds}


def _training_stage(arch: Arch, spec: Spec, stage: str) -> dict:
    models = _models(arch, spec, stage)
    seq = spec.seq_len + spec.gen_len
    sequences = spec.micro_batch * (2 if stage == "rm" else 1)  # chosen + rejected
    tokens = sequences * seq
    lm_head = stage == "sft"
    memory = _memory(
        models,
        gradients=True,
        activations=_activation_bytes(arch, spec, tokens, seq, trainable=True),
        logits=_logit_bytes(arch, spec, tokens, backward=True) if lm_head else 0.0,
        kv=0.0,
    )
    flops = _train_flops(arch, spec, tokens * spec.gpus, seq, lm_head) * spec.steps
    return {"memory_per_gpu_bytes": memory, "flops": flops,
            "seconds": _compute_seconds(flops, spec, MFU_TRAIN), "models": models}


def _ppo_stage(arch: Arch, spec: Spec) -> dict:
    models = _models(arch, spec, "ppo")
    gpu = GPUS[spec.gpu]
    prompts = math.ceil(spec.rollout_batch / spec.gpus)  # per GPU
    seq = spec.seq_len + spec.gen_len
    db = DTYPE_BYTES[spec.dtype]
    mb_tokens = spec.micro_batch * seq

    # 1. generation: prefill the prompts, then decode gen_len tokens (bandwidth bound)
    kv = _kv_cache_bytes(arch, spec, prompts, seq)
    sample_logits = prompts * arch.vocab * (db if spec.fused else db + 4 + 4)
    gen_mem = _memory(models, gradients=False,
                      activations=_forward_working_bytes(arch, spec, prompts * spec.seq_len, spec.seq_len),
                      logits=sample_logits, kv=kv)
    prefill = _forward_flops(arch, spec, prompts * spec.seq_len, spec.seq_len / 2)
    decode = _forward_flops(arch, spec, prompts * spec.gen_len, spec.seq_len + spec.gen_len / 2)
    weight_bytes = _weight_bytes(arch, spec) + _lora_params(arch, spec) * db
    mean_kv = _kv_cache_bytes(arch, spec, prompts, spec.seq_len + spec.gen_len // 2)
    decode_step = max((weight_bytes + mean_kv) / (gpu.bandwidth * DECODE_BANDWIDTH_EFFICIENCY),
                      _forward_flops(arch, spec, prompts, spec.seq_len + spec.gen_len / 2)
                      / (gpu.peak_flops * MFU_FORWARD))
    gen_seconds = prefill / (gpu.peak_flops * MFU_FORWARD) + spec.gen_len * decode_step
    gen_flops = (prefill + decode) * spec.gpus

    # 2. experience: no-grad forwards of actor, reference (log-probs), critic (values), reward
    #    (a shared critic's value head rides on the actor's pass)
    exp_flops = sum(_forward_flops(arch, spec, prompts * seq, seq / 2, m.lm_head) for m in models) * spec.gpus
    exp_mem = _memory(models, gradients=False,
                      activations=_forward_working_bytes(arch, spec, mb_tokens, seq),
                      logits=_logit_bytes(arch, spec, mb_tokens, backward=False), kv=0.0)

    # 3. training: ppo_epochs over the rollout; actor (+ separate critic) forward + backward
    trained = [m for m in models if m.trainable]
    act = _activation_bytes(arch, spec, mb_tokens, seq, trainable=True)
    train_mem = _memory(models, gradients=False, activations=act,
                        logits=_logit_bytes(arch, spec, mb_tokens, backward=True), kv=0.0)
    train_mem["gradients"] = int(round(max(m.gradients for m in trained)))  # one model steps at a time
    train_mem["peak"] = sum(train_mem[c] for c in COMPONENTS)
    train_flops = spec.ppo_epochs * spec.gpus * sum(
        _train_flops(arch, spec, prompts * seq, seq, m.lm_head) for m in trained)

    phases = {
        "generation": _phase(gen_mem, gen_flops * spec.steps, gen_seconds * spec.steps),
        "experience": _phase(exp_mem, exp_flops * spec.steps,
                             _compute_seconds(exp_flops, spec, MFU_FORWARD) * spec.steps),
        "training": _phase(train_mem, train_flops * spec.steps,
                           _compute_seconds(train_flops, spec, MFU_TRAIN) * spec.steps),
    }
    peak_phase = max(phases.values(), key=lambda p: p["memory_per_gpu_bytes"]["peak"])
    return {"memory_per_gpu_bytes": dict(peak_phase["memory_per_gpu_bytes"]),
            "flops": sum(p["flops"] for p in phases.values()),
            "seconds": sum(p["seconds"] for p in phases.values()),
            "phases": phases, "models": models}


def estimate(spec: Spec | None = None, **overrides) -> dict:
    """Memory per GPU, FLOPs, seconds and cost of each stage: the `--json` schema.

    `estimate(Spec(...))` or `estimate(model="llama-3-8b", stage="ppo", gpus=8, zero=3)`.
    """
    spec = dataclasses.replace(spec or Spec(), **overrides)
    _check(spec)
    arch = resolve_model(spec.model)
    gpu = GPUS[spec.gpu]
    stages = ("sft", "rm", "ppo") if spec.stage == "all" else (spec.stage,)
    out = {}
    for stage in stages:
        raw = _ppo_stage(arch, spec) if stage == "ppo" else _training_stage(arch, spec, stage)
        result = {
            "memory_per_gpu_bytes": raw["memory_per_gpu_bytes"],
            "fits": raw["memory_per_gpu_bytes"]["peak"] + CUDA_CONTEXT_BYTES <= gpu.memory_bytes,
            "flops": raw["flops"],
            "seconds": raw["seconds"],
            "cost_usd": raw["seconds"] * spec.gpus * spec.price / 3600,
            "models": {m.name: {"weights": int(m.weights), "gradients": int(m.gradients),
                                "optimizer": int(m.optimizer), "trainable_params": m.trainable_params}
                       for m in raw["models"]},
        }
        if "phases" in raw:
            result["phases"] = raw["phases"]
        out[stage] = result
    return {"stages": out}


# ---------------------------------------------------------------------------------------------
# --measure: predicted vs measured on a tiny model


TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
              "tie_word_embeddings": False, "max_position_embeddings": 128}


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def build_tiny_model(lora_rank: int = 0, config: dict | None = None):
    """A small transformers LlamaForCausalLM (+ peft LoRA on every linear when lora_rank > 0)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = {k: v for k, v in (config or TINY_LLAMA).items() if k != "model_type"}
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
                 "up": "up_proj", "down": "down_proj"}
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                                                 target_modules=list(names.values())))
    return model


def measure_states(model, steps: int = 2, batch: int = 2, seq: int = 16) -> dict:
    """Run AdamW steps on random tokens; exact bytes of parameters, gradients, optimizer states."""
    import torch

    device = next(model.parameters()).device
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    vocab = model.config.vocab_size
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep grads so they can be counted
    states = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    out = {
        "weights": _tensor_bytes(p for p in model.parameters()),
        "gradients": _tensor_bytes(p.grad for p in trainable),
        "optimizer": _tensor_bytes(states),
    }
    if device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated(device)
    return out


def measure(lora_rank: int = 0, device: str | None = None) -> dict:
    """Predicted vs measured bytes for one SFT step of the tiny model (fp32 on CPU, bf16 on CUDA)."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bf16" if device == "cuda" else "fp32"
    batch, seq = 2, 16
    model = build_tiny_model(lora_rank).to(device=device, dtype=getattr(torch, {"bf16": "bfloat16",
                                                                                 "fp32": "float32"}[dtype]))
    measured = measure_states(model, batch=batch, seq=seq)
    # torch AdamW in the model's dtype keeps m and v in that dtype: plain (not mixed) Adam
    predicted = estimate(model=TINY_LLAMA, stage="sft", dtype="fp32" if dtype == "fp32" else dtype,
                         lora_rank=lora_rank, micro_batch=batch, seq_len=seq, gen_len=0, fused=False,
                         flash_attention=False)["stages"]["sft"]["memory_per_gpu_bytes"]
    if dtype != "fp32":  # pure bf16 AdamW: 2 states of 2 B, not the 16 B mixed-precision recipe
        trainable = measured["gradients"] / 2
        predicted = dict(predicted, optimizer=int(trainable * 4))
        predicted["peak"] = sum(predicted[c] for c in COMPONENTS)
    return {"device": device, "dtype": dtype, "lora_rank": lora_rank, "predicted": predicted,
            "measured": measured}


# ---------------------------------------------------------------------------------------------
# Output


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _rows(result: dict) -> list[tuple[str, dict, float, float]]:
    rows = []
    for stage, r in result["stages"].items():
        rows.append((stage, r["memory_per_gpu_bytes"], r["flops"], r["seconds"]))
        for phase, p in r.get("phases", {}).items():
            rows.append((f"  {phase}", p["memory_per_gpu_bytes"], p["flops"], p["seconds"]))
    return rows


def format_table(result: dict, spec: Spec) -> str:
    from rich.console import Console
    from rich.table import Table

    arch = resolve_model(spec.model)
    title = (f"{arch.source or spec.model}: {arch.params() / 1e9:.2f}B params, {spec.gpus} x {spec.gpu}, "
             f"ZeRO-{spec.zero}, {spec.dtype}, " + (f"LoRA r={spec.lora_rank}" if spec.lora_rank else "full")
             + (" (QLoRA)" if spec.qlora else "") + " - memory per GPU in GB (1e9 B)")
    table = Table(title=title)
    for col in ("stage / phase", *COMPONENTS, "peak", "fits", "TFLOP", "seconds"):
        table.add_column(col, justify="left" if col == "stage / phase" else "right")
    limit = GPUS[spec.gpu].memory_bytes - CUDA_CONTEXT_BYTES
    for name, mem, flops, seconds in _rows(result):
        table.add_row(name, *(_gb(mem[c]) for c in COMPONENTS), _gb(mem["peak"]),
                      "yes" if mem["peak"] <= limit else "NO", f"{flops / 1e12:.1f}", f"{seconds:.2f}")
    console = Console(width=160, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(table)
    lines = [console.export_text()]
    for stage, r in result["stages"].items():
        if spec.price:
            lines.append(f"{stage}: ${r['cost_usd']:.2f} for {spec.steps} step(s) at ${spec.price}/GPU-hour")
    lines.append(f"assumptions: training MFU {MFU_TRAIN}, forward MFU {MFU_FORWARD}, decode at "
                 f"{DECODE_BANDWIDTH_EFFICIENCY} of HBM bandwidth; fits = peak + "
                 f"{CUDA_CONTEXT_BYTES / GIB:.0f} GiB CUDA context <= GPU memory")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Stacked bars of memory per GPU by component, one bar per stage / PPO phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(name.strip(), mem) for name, mem, _, _ in _rows(result)
            if name.startswith("  ") or "phases" not in result["stages"].get(name, {})]
    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(rows), 4.5))
    bottom = [0.0] * len(rows)
    for component in COMPONENTS:
        values = [mem[component] / 1e9 for _, mem in rows]
        ax.bar([name for name, _ in rows], values, bottom=bottom, label=component)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("memory per GPU (GB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastrlhf estimate", description=__doc__.splitlines()[0])
    d = Spec()
    p.add_argument("--model", default=d.model, help=f"preset ({', '.join(PRESETS)}) or path to a config.json")
    p.add_argument("--params", type=int, default=None, help="override the parameter count")
    p.add_argument("--stage", default=d.stage, choices=("sft", "rm", "ppo", "all"))
    p.add_argument("--gpus", type=int, default=d.gpus)
    p.add_argument("--zero", type=int, default=d.zero, help="ZeRO stage 0-3 (FSDP equivalents)")
    p.add_argument("--dtype", default=d.dtype, choices=tuple(DTYPE_BYTES))
    p.add_argument("--lora-rank", type=int, default=d.lora_rank, help="0 = full fine-tuning")
    p.add_argument("--lora-targets", default=",".join(d.lora_targets),
                   help="comma list of " + ",".join(LINEARS))
    p.add_argument("--qlora", action="store_true")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--no-flash", action="store_true", help="eager attention (saves [T, T] probabilities)")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch)
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="prompt tokens")
    p.add_argument("--gen-len", type=int, default=d.gen_len, help="generated tokens")
    p.add_argument("--rollout-batch", type=int, default=d.rollout_batch, help="prompts per PPO iteration")
    p.add_argument("--ppo-epochs", type=int, default=d.ppo_epochs)
    p.add_argument("--critic", default=d.critic, choices=("shared", "separate"))
    p.add_argument("--no-fused", action="store_true",
                   help="materialised fp32 logits instead of fused log-probs")
    p.add_argument("--gpu", default=d.gpu, choices=tuple(GPUS))
    p.add_argument("--price", type=float, default=d.price, help="dollars per GPU-hour")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps / PPO iterations to cost")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a stacked bar chart of memory per phase")
    p.add_argument("--measure", action="store_true",
                   help="run a tiny model for a few steps and print predicted vs measured bytes")
    return p


def spec_from_args(args: argparse.Namespace) -> Spec:
    return Spec(model=args.model, params=args.params, stage=args.stage, gpus=args.gpus, zero=args.zero,
                dtype=args.dtype, lora_rank=args.lora_rank,
                lora_targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()),
                qlora=args.qlora, gradient_checkpointing=args.gradient_checkpointing,
                flash_attention=not args.no_flash, micro_batch=args.micro_batch, seq_len=args.seq_len,
                gen_len=args.gen_len, rollout_batch=args.rollout_batch, ppo_epochs=args.ppo_epochs,
                critic=args.critic, fused=not args.no_fused, gpu=args.gpu, price=args.price, steps=args.steps)


def _print_measure(lora_rank: int) -> None:
    m = measure(lora_rank)
    print(f"--measure ({m['device']}, {m['dtype']}, {'LoRA r=' + str(lora_rank) if lora_rank else 'full'}):")
    for key, measured in m["measured"].items():
        predicted = m["predicted"][key]
        print(f"  {key:<10} predicted {predicted:>12,d} B  measured {measured:>12,d} B  "
              f"({(predicted - measured) / measured:+.1%})")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
        result = estimate(spec)
    except (ValueError, TypeError) as err:
        print(f"fastrlhf estimate: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result, spec))
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.measure:
        for rank in sorted({0, args.lora_rank or 8}):
            _print_measure(rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
