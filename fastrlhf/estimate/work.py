"""What each piece of a run does, in physical units: FLOPs, HBM bytes, kernels, host ops, collective and host-link
bytes (timing.Work). No efficiency factor enters here; timing.py turns work into seconds.

forward      a no-grad forward of `sequences` sequences, `micro` at a time (reads the weights once per call)
train        forward + backward (2 passes for a frozen LoRA base, 3 for full fine-tuning, +1 forward with
             gradient checkpointing) and its eager ops (PERF.md's trace: 357 per layer per micro-batch with LoRA)
optimizer    AdamW over the GPU's share of the trainable parameters (28 bytes each), or DeepSpeed's CPU Adam
             after the gradients crossed the host link (ZeRO-Offload)
decode       one engine's generation: hf (eager decode step, or the static cache's CUDA graph), ds-he
             (DeepSpeed-Inference kernels), vllm (continuous batching up to the KV capacity, CUDA graphs)
collective   a ring all-gather / reduce-scatter (or all-reduce: twice the bytes) over a model's GPUs
"""

from __future__ import annotations

import math

import fastrlhf.estimate.timing as T
from fastrlhf.constants import SMALL_MODEL_PARAMS
from fastrlhf.estimate.arch import Arch
from fastrlhf.estimate.hardware import Device
from fastrlhf.estimate.memory import DTYPE_BYTES, kv_cache_bytes
from fastrlhf.estimate.timing import Work

VLLM_MEMORY_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization
VLLM_PREFILL_TOKENS = 8192  # tokens per prefill step (vLLM's chunked prefill budget)


def forward_flops(arch: Arch, tokens: float, context: float, lm_head: bool = True,
                  head_tokens: float | None = None) -> float:
    """2 FLOPs per multiply-add: linears and attention (QK^T, AV) at mean context, and the lm_head over
    `head_tokens` (default: every token; fastrlhf's linear log-probs: the response tokens only)."""
    trunk = tokens * (2 * arch.matmul_params(False) + 4 * arch.layers * arch.hidden * context)
    head = 2 * arch.head_params() * (tokens if head_tokens is None else head_tokens) if lm_head else 0.0
    return trunk + head


def activation_traffic(arch: Arch, tokens: float, db: int) -> float:
    """HBM bytes a forward's elementwise ops move (norms, rotary, residuals, activation, casts)."""
    per_token = T.ACT_PASSES_HIDDEN * arch.hidden + T.ACT_PASSES_INTERMEDIATE * arch.intermediate
    return tokens * arch.layers * per_token * db


def cpu_threads(cpu_threads_: int | None, dev: Device, arch: Arch) -> int:
    if cpu_threads_:
        return min(cpu_threads_, max(1, dev.threads))
    return 1 if arch.params() < SMALL_MODEL_PARAMS else max(1, dev.threads)


def new_work(dev: Device, arch: Arch, cpu_threads_: int | None = None, peak: float | None = None) -> Work:
    """Empty work at the device's rates: a CPU run of a small model uses one thread (fastrlhf.train.models), and the
    probe's one-thread figures are used then."""
    if dev.kind == "cpu":
        threads = cpu_threads(cpu_threads_, dev, arch)
        rate = dev.peak_flops_1_thread if threads == 1 else dev.peak_flops * threads / max(1, dev.threads)
        return Work("cpu", rate, dev.bandwidth, bare_op=dev.bare_op_s)
    return Work("gpu", peak or dev.peak_flops, dev.bandwidth)


def layer_ops(kind: str, adapters: int, *, backward: bool = False, recompute: bool = False) -> float:
    """Eager ops of one decoder layer on a device class (its forward; with `backward` also its backward and, with
    gradient checkpointing, the recomputed forward)."""
    c = T.LAYER_OPS[kind]
    fwd = c.forward + c.forward_per_adapter * adapters
    if not backward:
        return fwd
    return fwd * (2 if recompute else 1) + c.backward + c.backward_per_adapter * adapters


def train_passes(lora: bool, checkpointing: bool) -> int:
    """Forward + backward: 3 passes (input and weight gradients), 2 for a frozen base (LoRA), one more forward
    with gradient checkpointing."""
    return (2 if lora else 3) + (1 if checkpointing else 0)


def forward_work(work: Work, arch: Arch, sequences: float, seq: float, *, micro: float, db: int, lm_head: bool,
                 adapters: int = 0, head_tokens: float | None = None, weight_bytes: float | None = None,
                 host_bytes: float = 0.0, pcie: float = 0.0, context: float | None = None) -> Work:
    """A no-grad forward of `sequences` sequences of `seq` tokens, `micro` at a time, each token attending to
    `context` keys on average (None: seq / 2, causal); an offloaded model streams its weights (`host_bytes`) over
    the host link for every call."""
    calls = math.ceil(sequences / micro) if sequences else 0
    if not calls:
        return work
    ops = arch.layers * layer_ops(work.kind, adapters) + T.EAGER_MODEL_OPS
    flops = forward_flops(arch, sequences * seq, seq / 2 if context is None else context, lm_head, head_tokens)
    weights = arch.params() * db if weight_bytes is None else weight_bytes
    work.step(count=calls, flops=flops / calls, weight_bytes=weights,
              bytes=activation_traffic(arch, sequences * seq / calls, db), kernels=ops, ops=ops, width=arch.hidden)
    if host_bytes:
        work.host_link += calls * host_bytes / pcie
    return work


def train_work(work: Work, arch: Arch, sequences: float, seq: float, *, micro: float, db: int, lm_head: bool,
               lora: bool, adapters: int, checkpointing: bool, head_tokens: float | None = None,
               context: float | None = None) -> Work:
    """Forward + backward of `sequences` sequences of `seq` tokens, `micro` at a time (`context`: as
    forward_work's)."""
    calls = math.ceil(sequences / micro) if sequences else 0
    if not calls:
        return work
    passes = train_passes(lora, checkpointing)
    ops = arch.layers * layer_ops(work.kind, adapters, backward=True, recompute=checkpointing) + 2 * T.EAGER_MODEL_OPS
    flops = passes * forward_flops(arch, sequences * seq, seq / 2 if context is None else context, lm_head,
                                   head_tokens)
    return work.step(count=calls, flops=flops / calls, weight_bytes=passes * arch.params() * db,
                     bytes=passes * activation_traffic(arch, sequences * seq / calls, db), kernels=ops, ops=ops,
                     train=True, width=arch.hidden)


def optimizer_work(work: Work, params_per_gpu: float, tensors: int, steps: int, *, offload: bool, engine: str,
                   pcie: float) -> Work:
    """AdamW over this GPU's share of the trainable parameters, `steps` times. ZeRO-Offload: the 16-bit gradients
    go to the host and the 16-bit weights come back over the host link, DeepSpeed's CPU Adam steps the fp32
    partition in between."""
    if offload and work.kind == "gpu":
        moved = 4 if engine == "deepspeed" else 8  # 16-bit gradients out, weights back (fsdp2: fp32)
        work.host_link += steps * params_per_gpu * moved / pcie
        work.adam_params += steps * params_per_gpu
        return work
    ops = T.OPT_FOREACH_OPS if work.kind == "gpu" else T.OPT_OPS_PER_TENSOR * tensors
    return work.step(count=steps, bytes=params_per_gpu * T.ADAMW_BYTES_PER_PARAM, kernels=ops, ops=ops)


def collective(dev: Device, size_bytes: float, gpus: int, times: float = 1.0) -> float:
    """Seconds at nominal bandwidth of `times` ring all-gathers (or reduce-scatters) of `size_bytes` over `gpus`
    GPUs (an all-reduce is two of them); inside a node NVLink, across nodes the network."""
    if gpus <= 1 or not size_bytes or not times:
        return 0.0
    bw = dev.link if gpus <= dev.node_gpus else dev.network
    if not bw:
        return 0.0
    return times * (size_bytes * (gpus - 1) / gpus / bw + T.NCCL_LATENCY_S)


def advantages_work(work: Work, gen_len: int, gae: bool) -> Work:
    """KL-shaped rewards, GAE (or outcome advantages) and whitening: a few fused kernels on a GPU; on a CPU the
    torch path: the ops around the recursion at an op's host time, and GAE's recursion, 19 bare tensor ops per
    token from Python (reference.gae), at the probed bare-op time."""
    if work.kind != "cpu":
        return work.step(kernels=T.ADV_OPS, ops=T.ADV_OPS)
    ops = T.ADV_CPU_OPS["gae" if gae else "outcome"]
    bare = T.GAE_TORCH_OPS_PER_TOKEN * gen_len if gae else 0
    return work.step(kernels=ops + bare, ops=ops, bare_ops=bare)


# ---------------------------------------------------------------------------------------------
# Decoding


def decode_flops(arch: Arch, sequences: float, context: float) -> float:
    """One decode step of `sequences` sequences at mean `context`: every weight (lm_head included) and attention."""
    return sequences * (2 * arch.matmul_params(True) + 4 * arch.layers * arch.hidden * context)


def sample_bytes(arch: Arch, sequences: float, db: int) -> float:
    """Last-position logits, their fp32 copy and the probabilities a sampling step reads and writes."""
    return sequences * arch.vocab * (db + 8)


def hf_decode_step(arch: Arch, *, sequences: float, context: float, weight_bytes: float, db: int, adapters: int,
                   static: bool, prompt: int, gen: int, kind: str) -> dict:
    """One step of HF generate on `sequences` sequences: eager (every op launched from Python), or the static
    cache's decode forward compiled into a CUDA graph (its kernels cost GPU time, not host time; under
    compilation repeat_kv expands K and V to every head over all static slots, PERF.md: 2.9 GB per step on
    qwen2-0.5b, three times the weights)."""
    kv = kv_cache_bytes(arch, sequences=sequences, length=context, dtype="bf16" if db == 2 else "fp32")
    step = {"flops": decode_flops(arch, sequences, context), "weight_bytes": weight_bytes,
            "bytes": kv + sample_bytes(arch, sequences, db), "width": arch.hidden}
    if static:
        layer = T.STATIC_LAYER_KERNELS + T.STATIC_KERNELS_PER_ADAPTER * adapters
        step["kernels"] = arch.layers * layer + T.HF_STEP_OPS + T.EAGER_MODEL_OPS
        step["ops"] = T.HF_STEP_OPS + 1  # outside the graph: sampling, stopping, the mask; one graph replay
        if arch.kv_heads < arch.heads:
            expanded = 2 * arch.layers * sequences * arch.heads * arch.head_dim * (prompt + gen) * db
            step["bytes"] += 2 * expanded  # written and read
    else:
        ops = arch.layers * layer_ops(kind, adapters) + T.HF_STEP_OPS + T.EAGER_MODEL_OPS
        step["kernels"] = step["ops"] = ops
    return step


def ds_he_decode_step(arch: Arch, *, sequences: float, context: float, weight_bytes: float, db: int, tp: int) -> dict:
    """One step of DeepSpeed-Chat's hybrid engine (HF generate's loop around DeepSpeed-Inference's fused layers),
    its tensor-parallel share."""
    kv = kv_cache_bytes(arch, sequences=sequences, length=context, dtype="bf16" if db == 2 else "fp32")
    outside = T.HF_STEP_OPS + T.EAGER_MODEL_OPS
    return {"flops": decode_flops(arch, sequences, context) / tp, "weight_bytes": weight_bytes / tp,
            "bytes": kv / tp + sample_bytes(arch, sequences, db), "width": arch.hidden / tp,
            "kernels": arch.layers * T.DS_HE_LAYER_KERNELS + outside, "ops": arch.layers * T.DS_HE_LAYER_OPS + outside}


def vllm_decode_step(arch: Arch, *, running: float, context: float, weight_bytes: float, kv_db: int, db: int,
                     tp: int) -> dict:
    """One step of vLLM decoding `running` sequences at mean `context`, its tensor-parallel share: the weights, the
    running sequences' KV blocks, sampling; ten kernels per layer in a CUDA graph, the scheduler and sampler on
    the host (overlapping the GPU)."""
    kv = kv_cache_bytes(arch, sequences=running, length=context, dtype="bf16" if kv_db == 2 else "fp32")
    return {"flops": decode_flops(arch, running, context) / tp, "weight_bytes": weight_bytes / tp,
            "bytes": kv / tp + sample_bytes(arch, running, db), "width": arch.hidden / tp,
            "kernels": arch.layers * T.VLLM_LAYER_KERNELS + T.EAGER_MODEL_OPS, "ops": T.VLLM_STEP_OPS}


def graph_decode_step(arch: Arch, *, running: float, context: float, weight_bytes: float, db: int, kind: str) -> dict:
    """One step of fastrlhf's decode engine over `running` live rows at mean `context` (their written slots only):
    the merged weights once, each row's K/V, sampling. On a GPU one CUDA-graph replay; on a CPU the same step
    eagerly, every op from Python (merged weights: no adapter ops)."""
    kv = kv_cache_bytes(arch, sequences=running, length=context, dtype="bf16" if db == 2 else "fp32")
    step = {"flops": decode_flops(arch, running, context), "weight_bytes": weight_bytes,
            "bytes": kv + sample_bytes(arch, running, db), "width": arch.hidden}
    if kind == "cpu":
        ops = arch.layers * layer_ops(kind, 0) + T.EAGER_MODEL_OPS
        rows = arch.layers * running * T.CPU_DECODE_ATTENTION_ROW_OPS  # bare aten calls: the device's probed latency
        step.update(kernels=ops + rows, ops=ops, bare_ops=rows)
    else:
        step["kernels"] = arch.layers * T.GRAPH_LAYER_KERNELS + T.GRAPH_STEP_KERNELS
        step["ops"] = T.GRAPH_STEP_OPS
    return step


def tp_allreduce(dev: Device, arch: Arch, tokens: float, db: int, tp: int) -> float:
    """Tensor parallelism's two all-reduces per layer of the hidden states of `tokens` tokens (seconds at nominal
    bandwidth)."""
    if tp <= 1:
        return 0.0
    return collective(dev, tokens * arch.hidden * db, tp, 2 * 2 * arch.layers)


def vllm_capacity(dev: Device, arch: Arch, *, resident: float, weight_bytes: float, per_sequence: float,
                  prompt: int, tp: int, db: int) -> int:
    """Sequences vLLM runs at once: what its KV cache holds (gpu_memory_utilization 0.9 of the GPU, less the other
    models' bytes, its weights and a prefill's activations), at most max_num_seqs."""
    from fastrlhf.estimate.memory import forward_working_bytes

    act = forward_working_bytes(arch, tokens=min(VLLM_PREFILL_TOKENS, prompt * T.VLLM_MAX_NUM_SEQS) / tp, seq=prompt,
                                dtype="bf16" if db == 2 else "fp32")
    budget = VLLM_MEMORY_UTILIZATION * dev.memory_bytes - resident - weight_bytes / tp - act
    return max(1, min(T.VLLM_MAX_NUM_SEQS, math.floor(budget / per_sequence))) if budget > 0 else 1


def db_of(dtype: str) -> int:
    return DTYPE_BYTES[dtype]
