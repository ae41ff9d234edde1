"""Bytes per GPU: model states under ZeRO / FSDP2 and offload, activations, log-prob buffers, KV cache.

Model states, bytes per parameter (P parameters, T trainable, N GPUs a model is sharded over):

engine deepspeed: the ZeRO paper's accounting is the contract (Rajbhandari et al. 2020, sec. 5 and
Figure 1; mixed-precision Adam, K = 12), whatever DeepSpeed allocates beside it is a buffer:
    bf16/fp16   weights 2   gradients 2   optimizer 12 (fp32 master 4 + momentum 4 + variance 4)
    fp32        weights 4   gradients 4   optimizer 8 (momentum + variance)
    stage 0 (baseline)  (2 + 2 + K) P           stage 1 (P_os)       2P + 2P + K P / N
    stage 2 (P_os+g)    2P + (2 + K) P / N      stage 3 (P_os+g+p)   (2 + 2 + K) P / N
    Buffers (`buffers`, never model states): stage 3's two gathered layers (the running one and the
    prefetched one) and, in backward, a gathered layer's whole gradient before its reduce-scatter; from
    stage 1 on the contiguous reduce bucket, `reduce_bucket_size` elements in the gradient dtype
    (DeepSpeed's default 5e8: 1 GB in bf16; deepspeed/runtime/zero/config.py, stage_1_and_2.py allocates
    it with torch.empty(reduce_bucket_size) in backward). DeepSpeed's own estimators count more than the
    paper: `estimate_zero2_model_states_mem_needs` 2P + 18P/N on the GPU (fp16 weights, fp16 and fp32
    gradients, fp32 master and Adam states), `estimate_zero3_model_states_mem_needs`
    4 x largest layer + 18P/N.
    ZeRO-Offload (`--offload optimizer`, DeepSpeed's offload_optimizer device cpu, stage >= 1): the
    optimizer states *and the fp32 gradient partitions* live in host memory; the GPU keeps the 16-bit
    weights (their stage-3 partition) and the reduce buckets, into which gradients are reduced before
    they are copied to the host (stage_1_and_2.py: `temp_grad_buffer_for_gpu_offload`, one largest
    parameter in the gradient dtype, beside the bucket). Host, per GPU: fp32 master + momentum + variance
    (12 P / N), the fp32 gradient partition (4 P / N) and a 16-bit copy of the weight partition
    (`param_buffer_of_bit16_for_cpu_offload_groups`, 2 P / N): 18 P / N.
    `--offload params` (ZeRO-Infinity, stage 3): the 16-bit weight partitions on the host too (+2 P / N);
    only the gathered layers stay on the GPU.

engine fsdp2, this trainer's real buffers (fastrlhf/train/models.py, fastrlhf/train/recipes/ppo.py; FSDP2
`fully_shard` per decoder layer with bf16 compute and fp32 reduction):
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
    states per rank as predicted, to the byte (tests/estimate/test_plan.py). FSDP2 pads each tensor's first
    dimension to a multiple of N: P / N is exact when every first dimension divides N (there: all do), else
    short by less than one row per tensor. `--zero 2` keeps parameters sharded between steps too (FSDP2
    frees the gathered layers after backward).
    LoRA: the frozen base in the run dtype (bf16 on CUDA), adapters in fp32 (peft upcasts them): 4 + 4 + 8.
    The reward model loads in fp32 (`RewardModel.from_pretrained` default dtype).
    `--zero 0` = not sharded, 2 = reshard_after_forward=False, 3 = fully sharded; FSDP2 has no stage 1.
    `--offload params` is FSDP2's CPUOffloadPolicy: weights, gradients and AdamW states on the host.

`--offload-frozen` keeps the reference and reward weights on the host and streams them in layer by
layer for their forward (DeepSpeed-Chat --offload_reference_model, OpenRLHF ref/RM offload).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastrlhf.constants import CHUNK_BUDGET_BYTES
from fastrlhf.estimate.arch import LINEARS, Arch

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
NF4_BYTES_PER_PARAM = 0.5 + 0.127 / 8  # 4 bits + double-quantised constants (QLoRA paper sec. 3)
# per NF4 tensor: its code books, bitsandbytes' quant_state.code (16 fp32) and the nested state2.code (256 fp32)
NF4_TENSOR_BYTES = (16 + 256) * 4
REDUCE_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's reduce_bucket_size default (deepspeed/runtime/zero/config.py)
ENGINES = ("fsdp2", "deepspeed")
OFFLOADS = ("none", "optimizer", "params")


@dataclass(frozen=True)
class PerParam:
    """Bytes per trainable parameter of one state, and whether the GPUs of a model share it (/ N)."""

    bytes: float
    sharded: bool = False

    def per_gpu(self, n: int) -> float:
        return self.bytes / n if self.sharded else self.bytes

    def text(self) -> str:
        return "0" if not self.bytes else f"{self.bytes:g}/N" if self.sharded else f"{self.bytes:g}"


def state_bytes(engine: str, precision: str, zero: int, offload: str = "none") -> dict[str, PerParam]:
    """GPU bytes per trainable parameter of `weights`, `gradients`, `optimizer` and `compute_copy`, and the
    `host` bytes (offload), for an engine (fsdp2, deepspeed), precision (mixed: bf16/fp16, fp32), ZeRO stage
    and offload (the module docstring; `--help` prints the table)."""
    mixed = precision == "mixed"
    if engine == "deepspeed":
        w, g, o = (2, 2, 12) if mixed else (4, 4, 8)
        out = {"weights": PerParam(w, zero == 3), "gradients": PerParam(g, zero >= 2),
               "optimizer": PerParam(o, zero >= 1), "compute_copy": PerParam(0)}
        if offload == "none":
            return out | {"host": PerParam(0)}
        # ZeRO-Offload: optimizer states, the fp32 gradient partition and a 16-bit copy of the weight
        # partition on the host; the GPU keeps the 16-bit weights (none with params offload) and buckets
        host = o + 4 + w + (w if offload == "params" else 0)
        return out | {"weights": PerParam(0 if offload == "params" else w, zero == 3), "gradients": PerParam(0),
                      "optimizer": PerParam(0), "host": PerParam(host, True)}
    shard = zero in (2, 3)  # FSDP2 shards parameters, gradients and optimizer states together
    out = {"weights": PerParam(4, shard), "gradients": PerParam(4, shard), "optimizer": PerParam(8, shard),
           "compute_copy": PerParam(2 if mixed else 0)}
    if offload == "params":  # CPUOffloadPolicy: the sharded parameters, their gradients and AdamW states
        return {k: PerParam(0) for k in ("weights", "gradients", "optimizer")} | {
            "compute_copy": out["compute_copy"], "host": PerParam(16, shard)}
    return out | {"host": PerParam(0)}


def state_table() -> str:
    """Bytes per trainable parameter per engine, precision, ZeRO stage and offload (what `--help` prints)."""
    lines = ["bytes per trainable parameter on each GPU (N: the GPUs a model is sharded over); host: what offload",
             "keeps in host memory per GPU. deepspeed follows the ZeRO paper (K = 12); fsdp2 is this trainer.",
             f"  {'engine':<10}{'precision':<10}{'zero':<6}{'offload':<11}{'weights':>8}{'grads':>8}{'optim':>8}"
             f"{'GPU total':>14}{'host':>8}  + compute copy"]
    for engine in ENGINES:
        for precision in ("mixed", "fp32"):
            for zero in ((0, 1, 2, 3) if engine == "deepspeed" else (0, 2, 3)):
                for offload in OFFLOADS:
                    if (engine == "deepspeed" and offload != "none" and zero == 0) or (
                            offload == "params" and zero != 3) or (engine == "fsdp2" and offload == "optimizer"):
                        continue
                    b = state_bytes(engine, precision, zero, offload)
                    parts = [b[k] for k in ("weights", "gradients", "optimizer")]
                    whole = sum(x.bytes for x in parts if not x.sharded)
                    split = sum(x.bytes for x in parts if x.sharded)
                    total = " + ".join(t for t in (f"{whole:g}" if whole else "", f"{split:g}/N" if split else "")
                                       if t) or "0"
                    copy = f"  + {b['compute_copy'].bytes:g} (bf16, whole or gathered layers)" \
                        if b["compute_copy"].bytes else ""
                    lines.append(f"  {engine:<10}{'bf16/fp16' if precision == 'mixed' else 'fp32':<10}{zero:<6}"
                                 f"{offload:<11}{parts[0].text():>8}{parts[1].text():>8}{parts[2].text():>8}"
                                 f"{total:>14}{b['host'].text():>8}{copy}")
    lines.append("  deepspeed buffers beside the paper's states: from stage 1 a reduce bucket of 5e8 elements "
                 "(1 GB in bf16);")
    lines.append("  stage 3: two gathered layers (+ one layer's gradient in backward). DeepSpeed's own estimators "
                 "count more:")
    lines.append("  estimate_zero2_model_states_mem_needs 2P + 18P/N, estimate_zero3_model_states_mem_needs "
                 "4 x largest layer + 18P/N.")
    return "\n".join(lines)


ADAPTER_BYTES = {"weights": 4, "gradients": 4, "optimizer": 8}  # fsdp2: peft's fp32 adapters under AdamW


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
    pool: str = "all"  # the GPU pool it lives on
    weights: float = 0.0
    compute_copy: float = 0.0  # bf16 copy alive from forward to backward (fsdp2)
    gathered: float = 0.0  # ZeRO-3 / FSDP2: gathered layer(s) alive while it runs
    grad_buffers: float = 0.0  # backward only: a gathered layer's gradient, DeepSpeed's reduce bucket(s)
    gradients: float = 0.0
    optimizer: float = 0.0
    host_bytes: float = 0.0  # what offload keeps in host memory (per GPU)
    trainable_params: int = 0

    def resident(self) -> float:
        """Bytes it holds on every GPU between phases."""
        return self.weights + self.optimizer

    def buffers(self) -> float:
        return self.compute_copy + self.gathered + self.grad_buffers


def lora_params(arch: Arch, rank: int, targets: tuple[str, ...]) -> int:
    shapes = arch.linear_shapes()
    return arch.layers * sum(rank * (a + b) for name, (a, b) in shapes.items() if name in targets)


def weight_bytes(arch: Arch, dtype_bytes: float, qlora: bool = False) -> float:
    """Every parameter at `dtype_bytes` (QLoRA: the block linears in NF4)."""
    total = arch.params()
    if not qlora:
        return total * dtype_bytes
    quantised = arch.layers * arch.layer_linear_params() * total / arch.formula_params()
    tensors = arch.layers * len(arch.linear_shapes())
    return quantised * NF4_BYTES_PER_PARAM + tensors * NF4_TENSOR_BYTES + (total - quantised) * dtype_bytes


def largest_layer_params(arch: Arch) -> int:
    return max(arch.layer_params(), arch.vocab * arch.embed)


def shards_weights(engine: str, zero: int) -> bool:
    """Are the weights sharded at rest? ZeRO-3; FSDP2 also under --zero 2 (reshard_after_forward=False
    keeps them gathered only from forward to backward)."""
    return zero == 3 or (engine == "fsdp2" and zero == 2)


LORA_TRAINED = ("actor", "critic", "student")  # the models --lora-rank gives adapters (the rest train every weight)


def _frozen_weight_bytes(m: ModelState, engine: str, db: int, lora: bool, qlora: bool, reward_fp32: bool) -> float:
    if m.shares_base:
        return 0.0
    frozen_db = db
    if engine == "fsdp2" and not lora and m.name in ("reference", "ema"):
        frozen_db = state_bytes("fsdp2", "fp32" if db == 4 else "mixed", 0)["weights"].bytes  # the policy's copy
    if engine == "fsdp2" and m.name == "reward" and reward_fp32:
        frozen_db = 4
    if engine == "fsdp2" and m.name == "teacher":  # fastrlhf distill loads the teacher as it loads the student: fp32
        frozen_db = state_bytes("fsdp2", "fp32" if db == 4 else "mixed", 0)["weights"].bytes
    return weight_bytes(m.arch, frozen_db, qlora and lora)


def fill_states(m: ModelState, *, engine: str, dtype: str, lora_rank: int, lora_targets: tuple[str, ...],
                qlora: bool, offload: str, reward_fp32: bool = False) -> ModelState:
    """Weights / gradients / optimizer / buffer / host bytes per GPU of one model (the module docstring)."""
    arch, n, z = m.arch, m.gpus, m.zero
    db = DTYPE_BYTES[dtype]
    precision = "fp32" if db == 4 else "mixed"
    lora = lora_rank > 0 and m.name in (*LORA_TRAINED, "ema")
    layer = largest_layer_params(arch)
    table = state_bytes(engine, precision, z, offload if m.trainable else "none")
    adapters = lora_params(arch, lora_rank, lora_targets) if lora else 0
    trainable = adapters if lora else (arch.params() if m.trainable else 0)
    per = dict(table)
    if lora and engine == "fsdp2":  # peft's fp32 adapters, sharded with the layers they belong to
        per.update({k: PerParam(b, table[k].sharded) for k, b in ADAPTER_BYTES.items()})
        if offload == "params":
            per.update({k: PerParam(0) for k in ADAPTER_BYTES} | {"host": PerParam(16, table["host"].sharded)})

    # weights: a trained model's (sharded) states; a frozen model or a LoRA base in its own dtype
    if m.trainable and not lora:
        weights = trainable * per["weights"].per_gpu(n)
    else:
        base = _frozen_weight_bytes(m, engine, db, lora, qlora, reward_fp32)
        base = base / n if shards_weights(engine, z) else base
        weights = base + adapters * (per["weights"].per_gpu(n) if lora and not m.shares_base else 0)
    if shards_weights(engine, z) or (offload == "params" and m.trainable):
        m.gathered = 2 * layer * db  # the running layer and the prefetched one
    host = 0.0
    if m.offloaded:  # --offload-frozen: streamed in layer by layer
        host, weights, m.gathered = weights, 0.0, 2 * layer * db
    if lora and offload == "params" and m.trainable:  # the frozen base goes to the host with the adapters
        host += weights
        weights = 0.0
    m.weights = weights
    if not m.trainable:
        m.host_bytes = host
        return m

    m.trainable_params = int(trainable)
    m.gradients = trainable * per["gradients"].per_gpu(n)
    m.optimizer = trainable * per["optimizer"].per_gpu(n)
    m.host_bytes = host + trainable * per["host"].per_gpu(n)
    if not lora and per["compute_copy"].bytes:
        full_copy = arch.params() * per["compute_copy"].bytes
        m.compute_copy = 2 * layer * per["compute_copy"].bytes if z == 3 else full_copy
    # backward-only buffers: a gathered layer's whole gradient before its reduce-scatter (FSDP2 keeps only the
    # reduce-scattered shard as `param.grad`: bench/results/dist_state_bytes_cpu.json, 36M Llama, 2 ranks,
    # --shard full, measured 4 B x P / 2 of gradients exactly), and DeepSpeed's reduce bucket(s)
    if z == 3 or offload == "params":
        m.grad_buffers += min(trainable, layer) * db
    if engine == "deepspeed" and z >= 1:
        m.grad_buffers += min(trainable, REDUCE_BUCKET_ELEMENTS) * db
        if offload != "none":  # temp_grad_buffer_for_gpu_offload: one largest parameter
            m.grad_buffers += min(trainable, layer) * db
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

