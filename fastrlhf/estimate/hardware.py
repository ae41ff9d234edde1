"""Devices the planner knows: memory, HBM bandwidth, dense bf16/fp16 peak, host link.

GPU figures are the vendors' data sheets (dense, no sparsity): NVIDIA V100 (SXM2/SXM3 32 GB:
900 GB/s, 125 TFLOP/s tensor), A100 SXM4 40/80 GB (1555 / 2039 GB/s, 312 TFLOP/s bf16), A800 SXM4
80 GB (the A100 80 GB's memory and compute, NVLink cut to 400 GB/s), H100 SXM5 (3.35 TB/s, 989
TFLOP/s; 1979 TFLOP/s dense fp8), H200 SXM (4.8 TB/s, 989 / 1979 TFLOP/s), RTX A6000 (768 GB/s,
154.8 TFLOP/s fp16 with fp32 accumulate). `pcie` is the host link each GPU offloads over (PCIe 3.0 x16 ~16 GB/s
for V100 hosts, PCIe 4.0 x16 ~32 GB/s for A100/A800/A6000, PCIe 5.0 x16 ~64 GB/s for H100/H200), per direction.
`link` is the GPU-to-GPU bandwidth inside a node per GPU and direction (NVLink: V100 SXM3 in a DGX-2
300 GB/s bidirectional, A100 600, A800 400, H100/H200 900; the A6000 has PCIe only), `network`
between nodes per GPU and direction (DGX-2: 8 x 100 Gb/s InfiniBand for 16 GPUs; DGX A100 / HGX A800:
one 200 Gb/s HDR port per GPU; DGX H100: one 400 Gb/s NDR port per GPU), `node_gpus` GPUs per node.

`cpu` is the CPU a `fastrlhf` run uses (`--gpu cpu`): its figures are the ones measured on the
machine that made the recorded CPU runs (bench/results/cpu_*.json; fastrlhf/estimate/data/
devices.json holds them with the probe command), since a CPU's peak depends on its cores and
on what else runs on it. `python -m fastrlhf.estimate.calibrate --probe-cpu` measures this one.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from functools import cache
from pathlib import Path

GIB = 1024**3
DATA = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    bandwidth: float  # bytes/s, device memory
    peak_flops: float  # dense bf16 / fp16 FLOP/s (fp32 on a CPU)
    pcie: float = 0.0  # bytes/s per direction to host memory (offload)
    link: float = 0.0  # bytes/s per GPU and direction to GPUs of its node
    network: float = 0.0  # bytes/s per GPU and direction to other nodes
    node_gpus: int = 8
    kind: str = "gpu"  # gpu or cpu
    context_bytes: int = 1 * GIB  # CUDA context + allocator slack, not in max_memory_allocated
    threads: int = 0  # CPU: threads the probe used
    peak_flops_1_thread: float = 0.0  # CPU: the probe on one thread
    bare_op_s: float = 0.0  # CPU: host seconds per bare tensor op from Python (probe_bare_op_latency); 0: unprobed
    fp8_flops: float = 0.0  # dense fp8 tensor-core FLOP/s (0: no fp8 tensor cores; fp8 weights run weight-only)


GPUS = {
    "v100-32g": Device("V100-SXM-32GB", 32 * GIB, 900e9, 125e12, pcie=16e9, link=150e9, network=6.25e9,
                       node_gpus=16),
    "a6000": Device("RTX-A6000-48GB", 48 * GIB, 768e9, 154.8e12, pcie=32e9, link=32e9, network=25e9),
    "a100-40g": Device("A100-SXM4-40GB", 40 * GIB, 1.555e12, 312e12, pcie=32e9, link=300e9, network=25e9),
    "a100-80g": Device("A100-SXM4-80GB", 80 * GIB, 2.039e12, 312e12, pcie=32e9, link=300e9, network=25e9),
    "a800-80g": Device("A800-SXM4-80GB", 80 * GIB, 2.039e12, 312e12, pcie=32e9, link=200e9, network=25e9),
    "h100": Device("H100-SXM5-80GB", 80 * GIB, 3.35e12, 989e12, pcie=64e9, link=450e9, network=50e9,
                   fp8_flops=1979e12),
    "h200": Device("H200-SXM-141GB", 141 * 10**9, 4.8e12, 989e12, pcie=64e9, link=450e9, network=50e9,
                   fp8_flops=1979e12),
}


@cache
def cpu_device() -> Device:
    """The recorded CPU (data/devices.json): measured matmul FLOP/s and copy bandwidth."""
    spec = json.loads((DATA / "devices.json").read_text())["cpu"]
    return Device(spec["name"], int(spec["memory_bytes"]), float(spec["bandwidth"]), float(spec["peak_flops"]),
                  kind="cpu", context_bytes=0, threads=int(spec["threads"]),
                  peak_flops_1_thread=float(spec["peak_flops_1_thread"]),
                  bare_op_s=float(spec.get("bare_op_latency_1_thread", 0.0)))


def device(name: str) -> Device:
    if name == "cpu":
        return cpu_device()
    if name not in GPUS:
        raise ValueError(f"gpu: expected one of {', '.join([*GPUS, 'cpu'])}, got {name!r}")
    return GPUS[name]


def device_names() -> tuple[str, ...]:
    return (*GPUS, "cpu")


PROBES = 5  # each probe runs this many times: the best rate (a peak: noise only lowers it), the median latency


def _rate(fn, seconds: float, clock) -> float:
    """Calls of `fn` per second of `clock`, over `seconds`."""
    n, start = 0, clock()
    while clock() - start < seconds:
        fn()
        n += 1
    return n / (clock() - start)


def probe_cpu(threads: int | None = None, seconds: float = 1.0) -> dict:
    """Measure this CPU: fp32 matmul FLOP/s (1024^3 GEMMs) and copy bandwidth (64 MiB tensors), each the best of
    PROBES one-second probes, and the op latencies, each their median (one-second probes on a shared 2-core VM
    ranged 71-93 GFLOP/s and 1.30-2.15 us per torch.add within an hour). On one thread the rates are per second
    of the process's CPU time (other jobs' load does not enter)."""
    import time

    import torch

    if threads:
        torch.set_num_threads(threads)
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    src = torch.empty(16 * 1024**2)  # 64 MiB
    dst = torch.empty_like(src)
    for _ in range(3):
        a @ b
        dst.copy_(src)
    flops = 2 * 1024**3 * max(_rate(lambda: a @ b, seconds, clock) for _ in range(PROBES))
    bandwidth = 2 * src.numel() * 4 * max(_rate(lambda: dst.copy_(src), seconds, clock) for _ in range(PROBES))
    return {"peak_flops": flops, "bandwidth": bandwidth, "threads": torch.get_num_threads(),  # read + write
            "op_latency": statistics.median(probe_op_latency(seconds, clock) for _ in range(PROBES)),
            "bare_op_latency": statistics.median(probe_bare_op_latency(seconds, clock) for _ in range(PROBES))}


def probe_op_latency(seconds: float = 1.0, clock=None) -> float:
    """Seconds per eager op of the smallest size (torch.add of two 64-element tensors): the dispatch cost every
    op of a model pays on this host, the physical scale of the CPU class's `op` factor."""
    import time

    import torch

    clock = clock or time.process_time
    a, b = torch.randn(64), torch.randn(64)
    for _ in range(100):
        torch.add(a, b)
    n, start = 0, clock()
    while clock() - start < seconds:
        for _ in range(100):
            torch.add(a, b)
        n += 100
    return (clock() - start) / n


BARE_ROUND_OPS = 8  # aten ops one `bare_round` dispatches (asserted in tests/estimate/test_time.py)


def bare_round(m, x, y, j: int) -> None:
    """One round of bare tensor expressions from Python, as an elementwise recursion written in Python issues them
    (the torch path of GAE): a column read, a Python scalar times a tensor, `1 - d` (rsub), `e + y`, `f - x`,
    `g * y` and a column write (select + copy_)."""
    c = m[:, j]
    d = 0.95 * c
    e = 1 - d
    f = e + y
    g = f - x
    m[:, j] = g * y


def probe_bare_op_latency(seconds: float = 1.0, clock=None) -> float:
    """Seconds per dispatched op of `bare_round` on 64-element tensors, no nn.Module and no autograd around them.
    These cost more than the bare `torch.add` of `probe_op_latency` (Python's operator protocol, scalar wrapping,
    indexing) and less than an HF layer's op."""
    import time

    import torch

    clock = clock or time.process_time
    x, y, m = torch.randn(64), torch.randn(64), torch.randn(64, 48)

    def rounds(n: int) -> None:
        for j in range(n):
            bare_round(m, x, y, j % 48)

    rounds(100)
    n, start = 0, clock()
    while clock() - start < seconds:
        rounds(100)
        n += 100
    return (clock() - start) / (BARE_ROUND_OPS * n)
