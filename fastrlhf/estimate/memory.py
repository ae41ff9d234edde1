"""Bytes per GPU: model states under ZeRO / FSDP2 and offload, activations, log-prob buffers, KV cache.

Model states, bytes per parameter (P parameters, T trainable, N GPUs a model is sharded over):

engine deepspeed, the ZeRO paper's stage definitions (Rajbhandari et al. 2020, sec. 5; mixed-precision
Adam, K = 12):
    bf16/fp16   weights 2   gradients 2   optimizer 12 (fp32 master 4 + momentum 4 + variance 4)
    fp32        weights 4   gradients 4   optimizer 8 (momentum + variance)
    stage 1 divides the optimizer by N, stage 2 also the gradients, stage 3 also the weights (plus one
    gathered layer, and its gradient, at a time). DeepSpeed's own estimators differ from the paper:
    `estimate_zero2_model_states_mem_needs` counts 4P + 16P/N (unpartitioned fp16 weights and gradients,
    and an fp32 gradient partition beside K = 12) and `estimate_zero3_model_states_mem_needs`
    4 x largest layer + 18P/N.

engine fsdp2, this trainer's real buffers (fastrlhf/models.py, fastrlhf/ppo.py on main; FSDP2
`fully_shard` per decoder layer with bf16 compute and fp32 reduction, issue 11):
    full fine-tuning, bf16: weights 4 (fp32: the sharded parameter is the master copy), gradients 4 (fp32),
    optimizer 8 (AdamW momentum + variance in fp32), plus a bf16 compute copy: autocast's cached casts
    (single process: 2P from forward to backward), or FSDP2's all-gathered layers (`--zero 3`: two layers,
    the current one and the prefetched one; `--zero 2` = reshard_after_forward=False: 2P from forward to
    backward). The frozen reference is a deep copy of the policy (fp32).
    Gradients are what FSDP2 keeps as `param.grad`, this GPU's reduce-scattered shard; under `--zero 3` the
    gathered layer's whole gradient exists only during that layer's backward and is counted as a buffer.
    fp32 (the trainer on CPU: no autocast, FSDP2 gathers fp32): weights 4, gradients 4, optimizer 8, no
    compute copy. Checked against the trainer (bench/results/dist_state_bytes_cpu.json, 36M Llama, fp32,
    AdamW, 1 process and 2 ranks under --shard full / grad_op / none): parameters, gradients and AdamW
    states per rank as predicted, to the byte (tests/test_estimate.py). FSDP2 pads each tensor's first
    dimension to a multiple of N: P / N is exact when every first dimension divides N (there: all do), else
    short by less than one row per tensor. `--zero 2` keeps parameters sharded between steps too (FSDP2
    frees the gathered layers after backward).
    LoRA: the frozen base in the run dtype (bf16 on CUDA), adapters in fp32 (peft upcasts them): 4 + 4 + 8.
    The reward model loads in fp32 (`RewardModel.from_pretrained` default dtype).
    `--zero 0` = not sharded, 2 = reshard_after_forward=False, 3 = fully sharded; FSDP2 has no stage 1.

Offload: `optimizer` moves the optimizer states (deepspeed: with the fp32 gradient partition) to the
host; `params` also the weights (ZeRO-3 / FSDP2 CPUOffloadPolicy: only the gathered layers stay on
the GPU); `--offload-frozen` keeps the reference and reward weights on the host and streams them in
layer by layer for their forward (DeepSpeed-Chat --offload_reference_model, OpenRLHF ref/RM offload).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastrlhf.constants import CHUNK_BUDGET_BYTES
from fastrlhf.estimate.arch import LINEARS, Arch

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
NF4_BYTES_PER_PARAM = 0.5 + 0.127 / 8  # 4 bits + double-quantised constants (QLoRA paper sec. 3)

# engine -> precision -> bytes per trainable parameter (the table `--help` prints)
STATE_BYTES = {
    "deepspeed": {"mixed": {"weights": 2, "compute_copy": 0, "gradients": 2, "optimizer": 12},
                  "fp32": {"weights": 4, "compute_copy": 0, "gradients": 4, "optimizer": 8}},
    "fsdp2": {"mixed": {"weights": 4, "compute_copy": 2, "gradients": 4, "optimizer": 8},
              "fp32": {"weights": 4, "compute_copy": 0, "gradients": 4, "optimizer": 8}},
}
ADAPTER_BYTES = {"weights": 4, "gradients": 4, "optimizer": 8}  # fsdp2: peft's fp32 adapters under AdamW


def state_table() -> str:
    lines = ["bytes per trainable parameter (weights + gradients + optimizer [+ compute copy]):"]
    for engine, rows in STATE_BYTES.items():
        for precision, b in rows.items():
            extra = f" + {b['compute_copy']} bf16 compute copy" if b["compute_copy"] else ""
            total = b["weights"] + b["gradients"] + b["optimizer"]
            lines.append(f"  {engine:<9} {precision:<5} {b['weights']} + {b['gradients']} + {b['optimizer']} "
                         f"= {total}{extra}")
    return "\n".join(lines)


@dataclass
class ModelState:
    """One model of a stage and its bytes per GPU outside activations."""

    name: str  # actor, critic, reference, reward, ema
    arch: Arch
    trainable: bool
    gpus: int  # GPUs it is sharded (or replicated) over
    zero: int
    lm_head: bool = True  # produces log-probs over the vocabulary (actor, reference)
    shares_base: bool = False  # LoRA reference = the actor with its adapters disabled: no bytes of its own
    offloaded: bool = False  # weights on the host, streamed in for its forward
    weights: float = 0.0
    compute_copy: float = 0.0  # bf16 copy alive from forward to backward (fsdp2)
    gathered: float = 0.0  # ZeRO-3 / FSDP2: gathered layer(s) alive while it runs
    gradients: float = 0.0
    optimizer: float = 0.0
    host_bytes: float = 0.0  # what offload keeps in host memory (per GPU)
    trainable_params: int = 0
    extra: dict = field(default_factory=dict)

    def resident(self) -> float:
        """Bytes it holds on every GPU between phases."""
        return self.weights + self.optimizer


def lora_params(arch: Arch, rank: int, targets: tuple[str, ...]) -> int:
    shapes = arch.linear_shapes()
    return arch.layers * sum(rank * (a + b) for name, (a, b) in shapes.items() if name in targets)


def weight_bytes(arch: Arch, dtype_bytes: float, qlora: bool = False) -> float:
    """Every parameter at `dtype_bytes` (QLoRA: the block linears in NF4)."""
    total = arch.params()
    if not qlora:
        return total * dtype_bytes
    quantised = arch.layers * arch.layer_linear_params() * total / arch.formula_params()
    return quantised * NF4_BYTES_PER_PARAM + (total - quantised) * dtype_bytes


def largest_layer_params(arch: Arch) -> int:
    return max(arch.layer_params(), arch.vocab * arch.embed)


def shards_weights(engine: str, zero: int) -> bool:
    """Are the weights sharded at rest? ZeRO-3; FSDP2 also under --zero 2 (reshard_after_forward=False
    keeps them gathered only from forward to backward)."""
    return zero == 3 or (engine == "fsdp2" and zero == 2)


def fill_states(m: ModelState, *, engine: str, dtype: str, lora_rank: int, lora_targets: tuple[str, ...],
                qlora: bool, offload: str, reward_fp32: bool = False) -> ModelState:
    """Weights / gradients / optimizer bytes per GPU of one model (see the module docstring)."""
    arch, n, z = m.arch, m.gpus, m.zero
    db = DTYPE_BYTES[dtype]
    precision = "fp32" if db == 4 else "mixed"
    table = STATE_BYTES[engine][precision]
    lora = lora_rank > 0 and m.name in ("actor", "critic", "ema")
    layer = largest_layer_params(arch)
    frozen_db = db
    if engine == "fsdp2" and not lora and m.name in ("reference", "ema"):
        frozen_db = table["weights"]  # a deep copy of the (fp32) policy
    if engine == "fsdp2" and m.name == "reward" and reward_fp32:
        frozen_db = 4

    if m.shares_base:
        weights = 0.0
    elif m.trainable and not lora:
        weights = arch.params() * table["weights"]
    else:
        weights = weight_bytes(arch, frozen_db, qlora and lora)
    adapters = lora_params(arch, lora_rank, lora_targets) if lora else 0
    if lora and not m.shares_base:
        weights += adapters * (ADAPTER_BYTES["weights"] if engine == "fsdp2" else db)
    host = 0.0
    if shards_weights(engine, z):
        weights /= n
        m.gathered = 2 * layer * db  # the running layer and the prefetched one
    if m.offloaded or (offload == "params" and m.trainable):
        host += weights
        weights = 0.0
        m.gathered = 2 * layer * db
    m.weights = weights

    if not m.trainable:
        m.host_bytes = host
        return m
    trainable = adapters if lora else arch.params()
    m.trainable_params = int(trainable)
    per = ADAPTER_BYTES if (lora and engine == "fsdp2") else table
    grads = trainable * per["gradients"]
    optim = trainable * per["optimizer"]
    if engine == "deepspeed" and lora:
        grads, optim = trainable * db, trainable * table["optimizer"]
    if z >= 2:
        grads /= n
    if z >= 1:
        optim /= n
    if not lora and table["compute_copy"]:
        full_copy = arch.params() * table["compute_copy"]
        m.compute_copy = 2 * layer * table["compute_copy"] if (engine == "fsdp2" and z == 3) else full_copy
    layer_grad = min(trainable, layer) * db  # a gathered layer's whole gradient, before its reduce-scatter
    if z == 3 and engine == "fsdp2":
        # FSDP2 keeps only the reduce-scattered shard as `param.grad`: the gathered layer's whole gradient
        # lives during that layer's backward only, so it is a buffer beside the gathered weights, not part
        # of the gradients a GPU holds. Measured (bench/results/dist_state_bytes_cpu.json: 36M Llama, fp32,
        # 2 ranks, --shard full, read after the optimizer step): 71,320,576 B of gradients per rank, 4 B x P / 2
        # exactly; counting the layer's gradient there predicted 88,097,792 B (+23.5%). The peak is unchanged.
        m.gathered += layer_grad
    elif z == 3:
        grads += layer_grad
    if offload in ("optimizer", "params"):
        host += optim + (trainable * 4 / (n if z >= 1 else 1) if engine == "deepspeed" else 0)
        optim = 0.0
        if offload == "params":
            host += grads
            grads = layer_grad
            if engine == "fsdp2":  # the transient layer gradient is a buffer (above)
                grads = 0.0
                m.gathered += layer_grad if z != 3 else 0.0
    m.gradients, m.optimizer, m.host_bytes = grads, optim, host
    return m


# ---------------------------------------------------------------------------------------------
# Activations, log-prob buffers, KV cache


def _trains(name: str, lora_rank: int, lora_targets: tuple[str, ...], qlora: bool, trainable: bool) -> bool:
    """Does autograd need the input of this linear (weight or adapter gradient)?"""
    if not trainable:
        return False
    # bitsandbytes' 4-bit matmul saves its input for backward whether or not it has an adapter
    return lora_rank == 0 or qlora or name in lora_targets


def layer_saved_bytes(arch: Arch, *, dtype: str, seq: int, trainable: bool, lora_rank: int = 0,
                      lora_targets: tuple[str, ...] = LINEARS, qlora: bool = False,
                      flash_attention: bool = True) -> float:
    """Bytes per token that autograd saves in one decoder layer (HF eager modules).

    RMSNorm upcasts to fp32 and saves that input (4 B/elem), LayerNorm saves its dtype input;
    a trainable norm weight also saves the normalised output. A linear saves its input only if
    its weight (or adapter) gets a gradient. Attention saves q, k, v and the output (+ the
    softmax probabilities, fp32 and dtype, without FlashAttention). The gated MLP saves gate,
    up and SiLU(gate); OPT's ReLU MLP saves the activation.
    """
    db, h, kv, i = DTYPE_BYTES[dtype], arch.hidden, arch.kv_dim, arch.intermediate
    full = trainable and lora_rank == 0
    t = lambda name: _trains(name, lora_rank, lora_targets, qlora, trainable)  # noqa: E731
    norm = (4 * h if arch.family == "llama" else db * h) + (db * h if full else 0)
    total = 2 * norm
    total += db * h if (t("q") or t("k") or t("v")) else 0  # shared q/k/v input
    total += db * (h + 2 * kv + h)  # q, k, v and attention output (o_proj input)
    if not flash_attention:
        total += (4 + db) * arch.heads * seq  # softmax probabilities in fp32 and dtype
    if arch.family == "llama":
        total += db * 3 * i  # gate, up, silu(gate)
        total += db * h if (t("gate") or t("up")) else 0
        total += db * i if t("down") else 0
    else:
        total += db * i  # relu output (= fc2 input)
        total += db * h if t("up") else 0
    return total


def activation_bytes(arch: Arch, *, tokens: int, seq: int, dtype: str, checkpointing: bool, **kw) -> float:
    """Saved activations of a forward that will be differentiated (all layers, or with gradient
    checkpointing the layer inputs plus one layer being recomputed)."""
    per_layer = layer_saved_bytes(arch, dtype=dtype, seq=seq, trainable=True, **kw)
    db = DTYPE_BYTES[dtype]
    head = tokens * (4 * arch.hidden + db * arch.hidden)  # final norm + lm_head / value-head input
    if checkpointing:
        return tokens * (arch.layers * db * arch.hidden + per_layer) + head
    return tokens * arch.layers * per_layer + head


def forward_working_bytes(arch: Arch, *, tokens: int, seq: int, dtype: str, flash_attention: bool = True) -> float:
    """No-grad forward: one layer's tensors alive at a time (a full-training layer as the bound)."""
    return tokens * layer_saved_bytes(arch, dtype=dtype, seq=seq, trainable=True, flash_attention=flash_attention)


def logit_bytes(arch: Arch, *, tokens: int, dtype: str, mode: str, backward: bool) -> float:
    """[N, V] buffers of the log-prob computation.

    linear        fastrlhf's linear_logprobs / linear_ppo_actor_loss: chunks of at most 64 MiB of
                  logits, plus (backward) the fp32 d(lm_head) accumulator V x H
    fused         log-prob kernels on materialised dtype logits: the logits (+ their gradient)
    materialised  dtype logits, an fp32 copy, its log-softmax (+ both fp32 gradients)
    """
    db, n_v = DTYPE_BYTES[dtype], tokens * arch.vocab
    if mode == "linear":
        return min(CHUNK_BUDGET_BYTES, n_v * 8) + (arch.vocab * arch.embed * 4 if backward else 0)
    if mode == "fused":
        return n_v * db * (2 if backward else 1)
    return n_v * (db + 4 + 4 + (8 if backward else 0))


def kv_cache_bytes(arch: Arch, *, sequences: float, length: float, dtype: str) -> float:
    return 2 * arch.layers * arch.kv_dim * length * sequences * DTYPE_BYTES[dtype]

