"""How it is measured: timing, peak memory, input pools and the read / copy probes.

Three figures per measurement, host and GPU apart:
    median_ms  GPU time, host hidden: CUDA events around each call, after warm-up, with the L2 flushed
               (a 256 MiB buffer zeroed) and then `torch.cuda._sleep` enqueued for longer than the host
               takes to issue the call, before the start event: the GPU has the whole call queued when it
               reaches it, so the events time the kernels alone (what the roofline compares)
    host_us    the host's time to issue one call (Python, checks, launches), timed on the CPU around the
               same calls while the GPU sleeps (never blocked by the GPU)
    wall_ms    back-to-back calls, synchronised once at the end: per call, max(host, GPU) and the gaps
               between them, what a training loop sees; the figure compared with the peers
The inputs rotate through copies totalling >= 4x the L2; the median of at least `min_reps` calls (10 by
default: a 0.2 s op gets 10 samples, not the 1-2 a fixed time budget gives it), more while `rep_ms`
lasts. On CPU: `time.perf_counter` around each call, the same rule for the number of calls; the three
figures are then one (all host).

Peak memory on CUDA, per pass, with every input already allocated and every `.grad` None:
    peak_mem_bytes   = torch.cuda.max_memory_allocated() during one call - memory_allocated() before it
    grad_bytes       = the bytes of the gradients the call returned (`.grad` of its inputs)
    extra_peak_bytes = peak_mem_bytes - grad_bytes: what an implementation holds beyond its inputs
                       and the gradients it must return (the figure the memory targets bound)
On CPU these are None (no allocator statistics; `bench/linear_memory.py` measures RSS).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from fastrlhf.bench.cases import OPS, Case
from fastrlhf.bench.providers import first

GB = 1e9
GIB = 2**30
DEFAULT_L2_BYTES = 50 * 2**20  # H100; used when the device does not report its L2
FLUSH_BYTES = 256 * 2**20  # zeroed before each timed CUDA call: larger than any GPU's L2 today
MAX_REPS = 1000


@dataclass
class Settings:
    device: torch.device
    rep_ms: float  # time budget per measurement; more calls than min_reps while it lasts
    rotate_bytes: int  # rotate inputs through copies totalling at least this
    min_reps: int = 10  # timed calls at least, however long one call takes
    seed: int = 0  # every provider's inputs come from this seed: the same values for all


@dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int
    host_us: float | None = None  # the host's time to issue one call (module docstring)
    wall_ms: float | None = None  # per call, back to back

    @classmethod
    def of(cls, times_ms: list[float]) -> Timing:
        if len(times_ms) >= 2:
            deciles = statistics.quantiles(times_ms, n=10, method="inclusive")
            lo, hi = deciles[0], deciles[-1]
        else:
            lo = hi = times_ms[0]
        return cls(statistics.median(times_ms), lo, hi, len(times_ms))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def n_reps(estimate_ms: float, settings: Settings) -> int:
    """Timed calls: enough to fill rep_ms, never fewer than min_reps, at most MAX_REPS."""
    by_budget = math.ceil(settings.rep_ms / estimate_ms) if estimate_ms > 0 else MAX_REPS
    return max(settings.min_reps, min(MAX_REPS, by_budget))


def _reset(grads) -> None:
    for t in grads:
        t.grad = None


def time_fn(fn: Callable[[], object], settings: Settings, grads=()) -> Timing:
    """Timing of fn() (the caller has warmed it up): one estimating call, then n_reps calls."""
    if settings.device.type == "cuda":
        return _time_cuda(fn, settings, grads)
    _reset(grads)
    start = time.perf_counter()
    fn()
    estimate_ms = (time.perf_counter() - start) * 1e3
    times = []
    for _ in range(n_reps(estimate_ms, settings)):
        _reset(grads)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    timing = Timing.of(times)
    timing.host_us, timing.wall_ms = timing.median_ms * 1e3, timing.median_ms
    return timing


def sleep_cycles(host_us: float, device: torch.device) -> int:
    """GPU clock cycles for `torch.cuda._sleep` to outlast `host_us` of host work: twice it plus 50 us, at
    the SM clock (capped at 100 ms)."""
    mhz = (getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 2_000_000) / 1e3
    return int(min(2 * host_us + 50.0, 1e5) * mhz)


def _time_cuda(fn, settings: Settings, grads) -> Timing:
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=settings.device)

    def timed_calls(n: int, cycles: int) -> tuple[list[float], list[float]]:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        host = []
        for start, end in events:
            _reset(grads)
            flush.zero_()
            if cycles:
                torch.cuda._sleep(cycles)  # the GPU waits while the host issues the call: events time kernels only
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e6)
            end.record()
        torch.cuda.synchronize(settings.device)
        return [start.elapsed_time(end) for start, end in events], host

    _, host = timed_calls(3, 0)
    cycles = sleep_cycles(max(host), settings.device)
    estimate_ms = timed_calls(1, cycles)[0][0]
    times, host = timed_calls(n_reps(estimate_ms, settings), cycles)
    timing = Timing.of(times)
    timing.host_us = statistics.median(host)
    timing.wall_ms = wall_ms(fn, settings, grads, timing.reps)
    return timing


def wall_ms(fn, settings: Settings, grads, reps: int) -> float:
    """Per call, `reps` calls back to back (at most 100), synchronised once at the end."""
    reps = min(reps, 100)
    sync(settings.device)
    start = time.perf_counter()
    for _ in range(reps):
        _reset(grads)
        fn()
    sync(settings.device)
    return (time.perf_counter() - start) * 1e3 / reps


def peak_memory(fn: Callable[[], object], device: torch.device, grads=()) -> tuple[int | None, int | None]:
    """(peak bytes above what was allocated before one fn(), bytes of the gradients it returned);
    (None, None) off CUDA."""
    if device.type != "cuda":
        return None, None
    _reset(grads)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    peak = int(torch.cuda.max_memory_allocated(device) - before)
    returned = sum(t.grad.nbytes for t in grads if t.grad is not None)
    _reset(grads)
    return peak, int(returned)


# ---------------------------------------------------------------- inputs and runners


def make_pool(case: Case, settings: Settings) -> list[dict]:
    """Fresh input copies for one measurement, from `settings.seed` (so every provider gets the
    same values, and nothing a previous provider wrote): enough copies that together they
    exceed `settings.rotate_bytes`."""
    op, device = OPS[case.op], settings.device
    gen = torch.Generator(device=device).manual_seed(settings.seed)
    first_copy = op.inputs(case, device, gen)
    size = sum(t.nbytes for t in first_copy.values())
    copies = max(1, min(32, math.ceil(settings.rotate_bytes / max(size, 1))))
    return [first_copy] + [op.inputs(case, device, gen) for _ in range(copies - 1)]


def make_runner(pass_: str, fn: Callable, autograd: bool, pool: list[dict],
                device: torch.device) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """A zero-argument callable running one pass over the next input copy, and the tensors
    whose .grad must be reset between calls."""
    grads = [t for inputs in pool for t in inputs.values() if t.requires_grad]
    copies = itertools.cycle(range(len(pool)))
    if not autograd:
        return lambda: fn(**pool[next(copies)]), []
    if pass_ == "fwd":

        def run_fwd():
            with torch.no_grad():
                fn(**pool[next(copies)])

        return run_fwd, []

    gen = torch.Generator(device=device).manual_seed(1)

    def upstream(out):  # a random upstream gradient for non-scalar outputs, never ones
        return None if out.dim() == 0 else torch.randn(out.shape, device=device, generator=gen)

    if pass_ == "fwd+bwd":
        shape_probe = first(fn(**pool[0]))  # with autograd, as timed: torch.compile compiles this graph once
        g = upstream(shape_probe)
        del shape_probe

        def run_fwd_bwd():
            first(fn(**pool[next(copies)])).backward(g)

        return run_fwd_bwd, grads
    graphs = []
    for inputs in pool:
        out = first(fn(**inputs))
        graphs.append((out, upstream(out)))
    cycle = itertools.cycle(graphs)

    def run_bwd():
        out, g = next(cycle)
        out.backward(g, retain_graph=True)

    return run_bwd, grads


@contextlib.contextmanager
def autotune_choices() -> Iterator[list[dict]]:
    """Within the block, each `triton.autotune` kernel that launches adds the config it chose (timing
    its configs on a key's first launch, or from its cache) to the yielded list, once per distinct
    (kernel, config): {"kernel": "module.function", "config": {constexprs, num_warps, num_stages}}.
    Wraps `Autotuner.run` for the block only: the bench uses it around the untimed warm-up calls."""
    from triton.runtime.autotuner import Autotuner

    chosen: list[dict] = []
    original = Autotuner.run

    def run(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        config = getattr(self, "best_config", None)
        if config is not None:
            entry = {"kernel": f"{self.base_fn.__module__}.{self.base_fn.__qualname__}",
                     "config": dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)}
            if entry not in chosen:
                chosen.append(entry)
        return out

    Autotuner.run = run
    try:
        yield chosen
    finally:
        Autotuner.run = original


@contextlib.contextmanager
def stubbed_launches() -> Iterator[list[str]]:
    """Within the block every Triton launch returns at once (compiled, interpreted or autotuned) and adds the
    kernel's name to the yielded list: what is left of an op's call is its host path, the same Python as on
    a GPU (outputs are not written). For counting and timing host work on a CPU (FASTRLHF_BACKEND=triton,
    TRITON_INTERPRET=1)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launched: list[str] = []

    def skip(self, *args, **kwargs):
        fn = getattr(self, "base_fn", None) or getattr(self, "fn", None)
        launched.append(getattr(fn, "__name__", "?"))

    saved = [(cls, cls.run) for cls in (JITFunction, InterpretedFunction, Autotuner)]
    for cls, _ in saved:
        cls.run = skip
    try:
        yield launched
    finally:
        for cls, run in saved:
            cls.run = run


def warmup_calls(provider: str) -> int:
    """Untimed calls before timing: torch.compile compiles the frames resumed after each graph
    break lazily, over its first few calls (measured: ~4 on the reference losses)."""
    return 6 if provider == "torch.compile" else 1


# ---------------------------------------------------------------- probes


def probes(settings: Settings, nbytes: int) -> dict:
    """Read and copy bandwidth of this device, measured with the same timer as the ops:
    a sum over, and a copy of, an fp32 buffer of `nbytes` (far larger than any cache)."""
    src = torch.rand(nbytes // 4, device=settings.device)
    dst = torch.empty_like(src)

    def read():
        src.sum()

    def copy():
        dst.copy_(src)

    read(), copy()  # warm-up
    sync(settings.device)
    t_read, t_copy = time_fn(read, settings), time_fn(copy, settings)
    return {"bytes": src.nbytes,
            "read_gbps": src.nbytes / GB / (t_read.median_ms / 1e3), "read_ms": t_read.median_ms,
            "copy_gbps": 2 * src.nbytes / GB / (t_copy.median_ms / 1e3), "copy_ms": t_copy.median_ms,
            "reps": min(t_read.reps, t_copy.reps)}


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()
