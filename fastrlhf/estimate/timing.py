"""Time from physics: FLOPs / peak, bytes / bandwidth, kernels x GPU time per kernel, host ops x host time per
op, collectives over the link; a few efficiency factors, each with a physical meaning and a plausible range.

A phase's work is a list of `Step`s: `count` repetitions of one unit (a decode step, a forward, a micro-batch's
forward and backward, an optimizer step) whose host work and device work overlap on a GPU, because kernels
launch asynchronously and the host runs ahead until it syncs (HF generate syncs once per decode step on
`unfinished.max() == 0`, the trainer once per micro-batch when it reads the loss). On a CPU the host runs the
kernels itself, so the two add:

    GEMMs  = max(FLOPs / (peak x mm x w), weight bytes / (bandwidth x bw))   (a GEMM's roofline: compute-bound at
             many tokens, reading its weights at one token per sequence - a decode step), w = h / (h + h_half)
             for a model of hidden size h: narrow matrices fill fewer tiles and waves of the GPU
    device = GEMMs + other bytes / (bandwidth x bw) + kernels x gap     (KV cache, activations, optimizer states)
    host   = ops x op + bare ops x bare   (an HF layer's ops; bare tensor ops from Python, GAE's recursion, at
             the CPU's probed bare-op latency: no fitted factor)
    step   = max(host, device) on a GPU, host + device on a CPU
    phase  = sum of count x step + collectives / net + host-link bytes / (pcie x PCIE_EFFICIENCY)
             + parameters a host optimizer updates x adam

factor    physical meaning                                                         prior   plausible
mm        fraction of the dense bf16 peak FLOP/s inference GEMMs reach (forward,    0.6     0.3-0.85
          prefill, decode)
mm_train  the same for training's forward + backward under autograd (dgrad / wgrad  0.4     0.2-0.8
          GEMMs on transposed operands, mixed precision, smaller tiles)
h_half    the hidden size at which a layer's GEMMs reach half of mm                 512     128-2048
bw        fraction of HBM bandwidth a memory-bound kernel streams at                0.75    0.5-0.92
op      host seconds per eager PyTorch op (Python, dispatch, launch)        15 us  5-50 us
gap     GPU seconds per kernel beyond its roofline (launch gap, tail)       3 us   1-8 us
net     fraction of the link bandwidth a NCCL collective reaches           0.7    0.3-0.9
adam    host seconds per parameter of DeepSpeed's CPU Adam step             2 ns   0.5-10 ns

(the CPU class: `mm` and `bw` against the probed matmul and copy rates, `op` around the probed op latency,
data/devices.json). Where the priors come from: PERF.md (an H100 copies at about 3.0 of its 3.35 TB/s, 0.9;
null custom-op dispatch 10 us on this CPU and the H100 host 4-7x slower in Python), NVIDIA's 2-5 us kernel launch
latency, NCCL's bus bandwidth of 70-80% of NVLink, the ZeRO-Offload paper's CPU Adam (about 1-2 s for 1B
parameters... per process a few ns per parameter). `python -m fastrlhf.estimate.calibrate --write` fits them to
the calibration sources (log-space least squares with each prior as a Gaussian whose +-2 sigma is the plausible
range) and writes data/efficiency.json; every fitted value is accepted only by leave-one-source-out
cross-validation, whose errors give the ranges printed beside each time (`cv`).

Kernel and host-op counts per decoder layer come from the trainer's own traces (PERF.md, bench/results/2026-11-23-*):
eager HF decode 56 ops per layer + 6 per LoRA adapter (98 with 7 adapters), the static-cache step compiled by
transformers 45 kernels per layer in a CUDA graph (+ 4.6 per un-merged adapter), eager training 357 ops per layer per
micro-batch with LoRA (95 forward, 262 backward); the other engines' from their layer code (stated below).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
PCIE_EFFICIENCY = 0.8  # pinned host <-> GPU copies reach about 80% of the PCIe link (not fitted)
NCCL_LATENCY_S = 10e-6  # per collective inside a node (NCCL's ring latency; not fitted)

# --- counts from traces (one home each) --------------------------------------------------------------


@dataclass(frozen=True)
class LayerOps:
    """Eager ops of one HF decoder layer: forward, and the extra of each LoRA adapter; backward, and its extra."""

    forward: float
    forward_per_adapter: float
    backward: float
    backward_per_adapter: float


LAYER_OPS = {
    # CUDA (PERF.md's trace of qwen2-0.5b, bf16 autocast): decode 98 per layer with seven adapters (56 base, 42 LoRA
    # glue); training 357 per layer per micro-batch with seven adapters, 262 of them backward; without LoRA the
    # backward keeps the ratio the same layer shows under bf16 autocast on CPU (174 of 275 dispatched ops): 166
    "gpu": LayerOps(56, 6, 166, (262 - 166) / 7),
    # CPU, fp32 (no autocast): the aten ops a tiny Llama layer dispatches, counted with TorchDispatchMode
    # (measure.count_layer_ops, tests/estimate/test_time.py): no-grad forward 74, +10 per adapter; backward 142,
    # +13.9 per adapter, and the grad-mode forward's 3 more (77)
    "cpu": LayerOps(74, 10, 145, (239 - 142) / 7),
}
EAGER_MODEL_OPS = 25  # embedding, final norm, head, the loss or sampling glue around the layers (CPU trace: 23-31)
# HF generate per step outside the layers: logits processing, sampling, stopping criteria, the 4-D mask (PERF.md)
HF_STEP_OPS = 66
# transformers' static cache: the decode forward compiled with mode="reduce-overhead" (a CUDA graph): about 45
# kernels per layer, and un-merged LoRA adds 700-850 kernels per step on qwen2-0.5b's 24 layers with 7 adapters
# (PERF.md: 21 matmuls per layer instead of 7, and the casts of every adapter weight): 775 / 24 / 7 per adapter
STATIC_LAYER_KERNELS = 45
STATIC_KERNELS_PER_ADAPTER = 775 / 24 / 7
# DeepSpeed-Inference's fused layer (the hybrid engine): deepspeed/model_implementations/transformers/
# ds_transformer.py's forward makes 14 host calls per layer, 7 nn.Module calls (DeepSpeedSelfAttention,
# DeepSpeedMLP and their QKVGemmOp, SoftmaxContextOp, VectorMatMulOp, MLPGemmOp, ResidualAddOp) and 7 calls into
# C++ or torch (allocate_workspace, qkv_gemm, softmax_context, vector_matmul, mlp_gemm, residual_add, the output
# cast); the bindings (csrc/transformer/inference/csrc/pt_binding.cpp) launch for an OPT layer: fused LayerNorm,
# GEMM, bias add; bias-add-transform, QK^T batched GEMM, softmax, AV batched GEMM, transform; GEMM; fused residual
# LayerNorm, GEMM, bias-ReLU; GEMM; bias-residual: 14 kernels
DS_HE_LAYER_OPS = 14
DS_HE_LAYER_KERNELS = 14
# vLLM's Llama layer in its decode CUDA graph: fused qkv GEMM, rotary, cache write, paged attention, o GEMM,
# fused add-RMSNorm, gate_up GEMM, SiLU-and-mul, down GEMM, fused add-RMSNorm; per step outside the graph the
# scheduler, input preparation and the sampler
VLLM_LAYER_KERNELS = 10
VLLM_STEP_OPS = 40
VLLM_MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs
# fastrlhf's decode engine (fastrlhf/train/engine.py decode_step, compiled and captured per bucket): per layer
# the qkv, o, gate_up and down GEMMs, decode attention's split and merge launches, and the fused pointwise groups
# inductor makes of the two RMSNorms with their residuals, rotary with the KV store, SiLU-and-mul: 11, read from
# the step's code, not yet counted on a GPU (bench/rollout_bench.py counts launches there); outside the layers the
# embedding, final norm, lm_head, the sampler's hash and argmax and the state's updates. On the host one graph
# replay per step and, every CHECK_EVERY = 4 steps, the done flags' copy, its event and the refill bookkeeping.
GRAPH_LAYER_KERNELS = 11
GRAPH_STEP_KERNELS = 12
GRAPH_STEP_OPS = 1 + 4 / 4
# on a CPU the step runs eagerly and ops.decode_attention's torch path attends row by row: 24 aten ops per row
# and layer, 7 per call (TorchDispatchMode over one call at B = 1, 8, 32: 31, 199, 775 ops)
CPU_DECODE_ATTENTION_ROW_OPS = 24
# elementwise traffic of a layer per token and pass (norms, rotary, residuals, activation, casts): about 24 tensor
# passes of the hidden size and 5 of the intermediate size (the layer's op list), in the compute dtype
ACT_PASSES_HIDDEN = 24
ACT_PASSES_INTERMEDIATE = 5
ADV_OPS = 20  # GPU: KL-shaped rewards, GAE or outcome advantages, whitening: fused kernels and their torch glue
# CPU (the torch path), counted with TorchDispatchMode around ppo.with_advantages (measure.count_advantage_ops,
# asserted in tests/estimate/test_time.py): 48 ops around the recursion (kl_shaped_rewards, the whitening, the
# checks' reads) and, for GAE, reference.gae's recursion: 19 bare ops per token (4 column reads, 2 scalar products,
# 2 rsubs, 9 tensor adds / subs / products, a column write: select + copy_); GRPO's group advantages: 63 ops
ADV_CPU_OPS = {"gae": 48, "outcome": 63}
GAE_TORCH_OPS_PER_TOKEN = 19
ADAMW_BYTES_PER_PARAM = 28  # fp32 AdamW reads weights, gradients, momentum, variance and writes three back
OPT_OPS_PER_TENSOR = 12  # a for-loop AdamW step and its clip, per parameter tensor (the CPU default)
OPT_FOREACH_OPS = 30  # CUDA: foreach / fused AdamW and clip_grad_norm, a few multi-tensor kernels per step


@dataclass
class Step:
    """`count` repetitions of a unit whose host work and device work overlap."""

    count: float = 1.0
    flops: float = 0.0  # GEMM FLOPs
    weight_bytes: float = 0.0  # bytes the GEMMs read (their roofline takes the larger of the two)
    bytes: float = 0.0  # other memory-bound traffic: KV cache, activations, optimizer states
    kernels: float = 0.0
    ops: float = 0.0  # host ops of an HF layer's class (nn.Module and Python around each): priced at `op`
    bare_ops: float = 0.0  # bare tensor ops from Python (GAE's recursion): the device's probed bare-op latency
    train: bool = False  # training's forward + backward (mm_train)
    width: float = 0.0  # the model's hidden size (h_half); 0: no width effect


@dataclass
class Work:
    """What a phase does on one GPU (its pool's slowest): steps at the device's peak and bandwidth, plus
    collectives and host-link transfers in seconds at nominal bandwidth, and a host optimizer's parameters."""

    kind: str  # gpu or cpu
    peak: float  # FLOP/s this work runs at (a CPU run's threads)
    bandwidth: float  # bytes/s
    steps: list[Step] = field(default_factory=list)
    comm: float = 0.0  # seconds of exposed collectives at the link's nominal bandwidth
    host_link: float = 0.0  # seconds over the host link at nominal bandwidth (offload)
    adam_params: float = 0.0  # parameters DeepSpeed's CPU Adam updates
    bare_op: float = 0.0  # host seconds per bare op (a CPU's probe; 0: priced at the fitted `op`)

    def add(self, other: Work) -> Work:
        self.steps += other.steps
        self.comm += other.comm
        self.host_link += other.host_link
        self.adam_params += other.adam_params
        return self

    def step(self, **kw) -> Work:
        self.steps.append(Step(**kw))
        return self


@dataclass(frozen=True)
class Prior:
    value: float
    low: float
    high: float
    meaning: str

    @property
    def sigma(self) -> float:
        """Log-space standard deviation: the plausible range is +-2 sigma."""
        return math.log(self.high / self.low) / 4


FACTORS = ("mm", "mm_train", "h_half", "bw", "op", "gap", "net", "adam")
GPU_PRIORS = {
    "mm": Prior(0.6, 0.3, 0.85, "fraction of the dense bf16/fp16 peak FLOP/s inference GEMMs reach"),
    "mm_train": Prior(0.4, 0.2, 0.8, "fraction of the dense peak training's forward + backward GEMMs reach"),
    "h_half": Prior(512, 128, 2048, "hidden size at which a layer's GEMMs reach half of mm (tile and wave "
                    "quantization)"),
    "bw": Prior(0.75, 0.5, 0.92, "fraction of HBM bandwidth a memory-bound kernel streams at"),
    "op": Prior(15e-6, 5e-6, 50e-6, "host seconds per eager PyTorch op (Python, dispatch, launch)"),
    "gap": Prior(3e-6, 1e-6, 8e-6, "GPU seconds per kernel beyond its roofline (launch gap, tail)"),
    "net": Prior(0.7, 0.3, 0.9, "fraction of the link bandwidth a NCCL collective reaches"),
    "adam": Prior(2e-9, 5e-10, 1e-8, "host seconds per parameter of DeepSpeed's CPU Adam step"),
}


@cache
def cpu_priors() -> dict[str, Prior]:
    """The recorded CPU's priors: its own probes (data/devices.json) set the scale."""
    probe = json.loads((DATA / "devices.json").read_text())["cpu"]
    op = float(probe["op_latency_1_thread"])
    return {
        "mm": Prior(0.6, 0.2, 1.0, "fraction of the probed 1024^3 fp32 matmul rate the model's matmuls reach"),
        "mm_train": Prior(0.6, 0.2, 1.0, "the same in forward + backward"),
        "h_half": Prior(32, 6, 256, "hidden size at which the matmuls reach half of mm (a 64-wide fp32 matmul "
                        "reaches 20-90% of the probed 1024^3 one)"),
        "bw": Prior(0.5, 0.15, 1.0, "fraction of the probed copy bandwidth elementwise ops stream at"),
        "op": Prior(4 * op, op, 12 * op, "seconds per eager op of an HF layer: the probed bare op "
                    f"({op * 1e6:.2f} us) plus the nn.Module and Python around it (PERF.md, on a 2-core Xeon: a "
                    "Python call 1.8 us, a torch.library custom op 10 us)"),
        "gap": Prior(1e-12, 5e-13, 2e-12, "no launch gap on a CPU (the host runs the kernels)"),
        "net": Prior(0.7, 0.3, 0.9, "gloo collectives (not calibrated)"),
        "adam": Prior(2e-9, 5e-10, 1e-8, "(no host optimizer on a CPU run)"),
    }


def priors(kind: str) -> dict[str, Prior]:
    return GPU_PRIORS if kind == "gpu" else cpu_priors()


@cache
def calibration() -> dict:
    """data/efficiency.json: fitted factors per device class and the cross-validated ratio spreads."""
    return json.loads((DATA / "efficiency.json").read_text())


def factors(kind: str) -> dict[str, float]:
    """The fitted factors of a device class (the priors where nothing was fitted yet)."""
    fitted = calibration().get("classes", {}).get(kind, {})
    return {k: float(fitted[k]["value"]) if k in fitted else p.value for k, p in priors(kind).items()}


def _max(a, b):
    """max() that also takes torch tensors (the fit differentiates through it)."""
    if hasattr(a, "maximum") or hasattr(b, "maximum"):
        import torch

        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return max(a, b)


def gemm_seconds(s: Step, work: Work, f: dict):
    efficiency = f["mm_train" if s.train else "mm"]
    if s.width:
        efficiency = efficiency * s.width / (s.width + f["h_half"])
    compute = s.flops / (work.peak * efficiency)
    return _max(compute, s.weight_bytes / (work.bandwidth * f["bw"])) if s.weight_bytes else compute


def step_seconds(s: Step, work: Work, f: dict) -> tuple:
    """(host, device) seconds of one repetition of a step."""
    device = gemm_seconds(s, work, f) + s.bytes / (work.bandwidth * f["bw"]) + s.kernels * f["gap"]
    return s.ops * f["op"] + s.bare_ops * (work.bare_op or f["op"]), device


def seconds(work: Work, f: dict | None = None):
    """Seconds of `work` with factors `f` (default: the fitted ones of its class)."""
    f = f or factors(work.kind)
    total = work.comm / f["net"] + work.host_link / PCIE_EFFICIENCY + work.adam_params * f["adam"]
    for s in work.steps:
        if not s.count:
            continue
        host, device = step_seconds(s, work, f)
        total = total + s.count * (_max(host, device) if work.kind == "gpu" else host + device)
    return total


def terms(work: Work, f: dict | None = None) -> dict[str, float]:
    """Seconds of each physical term (gemm, memory, kernels, host, comm, host_link, cpu_adam), and `bound`:
    the share of step time where the host, not the device, is the slower (GPU; what a faster host would save)."""
    f = f or factors(work.kind)
    out = dict.fromkeys(("gemm", "memory", "kernels", "host"), 0.0)
    host_bound = step_total = 0.0
    for s in work.steps:
        out["gemm"] += s.count * gemm_seconds(s, work, f)
        out["memory"] += s.count * s.bytes / (work.bandwidth * f["bw"])
        out["kernels"] += s.count * s.kernels * f["gap"]
        host, device = step_seconds(s, work, f)
        out["host"] += s.count * host
        step_total += s.count * max(host, device)
        host_bound += s.count * max(0.0, host - device)
    out.update(comm=work.comm / f["net"], host_link=work.host_link / PCIE_EFFICIENCY,
               cpu_adam=work.adam_params * f["adam"])
    out = {k: v for k, v in out.items() if v}
    if work.kind == "gpu" and step_total:
        out["host_bound_share"] = host_bound / step_total
    return out


def cv_range(kind: str, group: str) -> tuple[float, float]:
    """(low, high) of predicted / measured under leave-one-source-out cross-validation for a phase group
    (rollout, forward, train, serve; `all` when the group has too few points)."""
    cv = calibration().get("cv", {}).get(kind, {})
    lo, hi = cv.get(group) or cv.get("all") or (1.0, 1.0)
    return float(lo), float(hi)


def time_range(seconds_: float, kind: str, group: str) -> list[float]:
    """The range a cross-validated ratio spread gives a prediction: a source the fit did not see came out
    between lo and hi times its measurement, so the measurement lies within seconds / hi .. seconds / lo."""
    lo, hi = cv_range(kind, group)
    return [seconds_ / max(hi, 1.0), seconds_ / min(lo, 1.0)]
