"""The harness loop: every case, provider and pass, each measured on fresh inputs.

Work is ordered so that a time budget (`budget_s`) cuts the least useful part: every case
with every provider but torch.compile first, then torch.compile for every case (compiling
costs more than measuring). A measurement (one case, provider and pass) not started before
the budget is spent is listed in `skipped` with that reason.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fastrlhf.bench.cases import OPS, Case, case_bytes, case_flops
from fastrlhf.bench.measure import (
    GB,
    Settings,
    autotune_choices,
    is_oom,
    make_pool,
    make_runner,
    peak_memory,
    sync,
    time_fn,
    warmup_calls,
)
from fastrlhf.bench.providers import SLOW_PROVIDERS, Skip, backend_name, load_provider, passes_of, providers_of


@dataclass
class Run:
    """What one bench run collected."""

    rows: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)

    def skip(self, provider: str, op: str, reason: str) -> None:
        """One note per provider and reason, listing the ops it covers."""
        entry = next((e for e in self.skipped if (e["provider"], e["reason"]) == (provider, reason)), None)
        if entry is None:
            self.skipped.append({"provider": provider, "reason": reason, "ops": [op]})
        elif op not in entry["ops"]:
            entry["ops"].append(op)


def measure(case: Case, provider: str, pass_: str, settings: Settings, probes: dict) -> dict:
    """One row: time and peak memory of one provider and pass on fresh inputs, and the configs its
    autotuned Triton kernels chose (`autotune`: [] where none ran, e.g. off CUDA). Raises Skip when
    the provider cannot run it. The inputs, the runner and any graphs it retains die with this
    frame, before the next measurement builds its own."""
    device = settings.device
    fn, autograd = load_provider(case.op, provider, pass_, device, no_compile=OPS[case.op].no_compile)
    if provider == "torch.compile":
        torch._dynamo.reset()  # fresh compile caches: no recompile limit reached across cases
    pool = make_pool(case, settings)
    runner, grads = make_runner(pass_, fn, autograd, pool, device)
    with autotune_choices() as tuned:  # the config each autotuned Triton kernel of this case picks
        for _ in range(warmup_calls(provider)):  # compiles torch.compile graphs and Triton kernels (and tunes)
            runner()
    sync(device)
    timing = time_fn(runner, settings, grads)
    peak, grad_bytes = peak_memory(runner, device, grads)
    counted = case_bytes(case)
    ideal_ms = 1e3 / GB * (counted["fwd"] / probes["read_gbps"] * (pass_ != "bwd")
                           + counted.get("bwd", 0) / probes["copy_gbps"] * (pass_ != "fwd"))
    row = {"op": case.op, "shape": case.shape, "dims": case.dims, "dtype": case.dtype_name, "pass": pass_,
           "provider": provider, "backend": backend_name(device) if provider.startswith("fastrlhf") else provider,
           "median_ms": timing.median_ms, "p10_ms": timing.p10_ms, "p90_ms": timing.p90_ms, "reps": timing.reps,
           "host_us": timing.host_us, "wall_ms": timing.wall_ms,
           "bytes": counted[pass_], "gbps": counted[pass_] / GB / (timing.median_ms / 1e3),
           "roofline": ideal_ms / timing.median_ms, "peak_mem_bytes": peak, "grad_bytes": grad_bytes,
           "extra_peak_bytes": None if peak is None else peak - grad_bytes, "autotune": tuned}
    flops = case_flops(case, pass_)
    if flops is not None:
        row["tflops"] = flops / 1e12 / (timing.median_ms / 1e3)
    return row


def _measure_provider(case: Case, provider: str, settings: Settings, probes: dict, out: Run,
                      deadline: float | None, budget_s: float | None) -> None:
    for pass_ in passes_of(case.op, provider, case.passes):
        if deadline is not None and time.monotonic() > deadline:
            out.skip(provider, case.op, f"{case.shape} {case.dtype_name}: time budget ({budget_s:g} s) spent")
            continue
        try:
            out.rows.append(measure(case, provider, pass_, settings, probes))
        except Skip as exc:
            out.skip(provider, case.op, str(exc))
        except Exception as exc:
            reason = "out of memory" if is_oom(exc) else f"{exc.__class__.__name__}: {exc}".splitlines()[0]
            if provider.startswith("fastrlhf") and not is_oom(exc) and not isinstance(exc, NotImplementedError):
                traceback.print_exc(file=sys.stderr)
                out.errors.append({"op": case.op, "shape": case.shape, "dtype": case.dtype_name, "pass": pass_,
                                   "provider": provider, "error": reason})
            out.skip(provider, case.op, f"{case.shape} {case.dtype_name} {pass_}: {reason}")
        finally:
            if settings.device.type == "cuda":
                torch.cuda.empty_cache()


def work_items(selected: list[Case], providers: list[str]) -> list[tuple[Case, str]]:
    """(case, provider) pairs: the fast providers for every case first, then the slow ones."""
    fast = [(c, p) for c in selected for p in providers_of(c.op) if p in providers and p not in SLOW_PROVIDERS]
    slow = [(c, p) for p in SLOW_PROVIDERS if p in providers for c in selected if p in providers_of(c.op)]
    return fast + slow


def bench(selected: list[Case], providers: list[str], settings: Settings, probes: dict, *,
          budget_s: float | None = None, after_each: Callable[[Run], None] | None = None) -> Run:
    """Measure every (case, provider, pass); `after_each(run)` after every (case, provider)."""
    from tqdm import tqdm

    out = Run()
    deadline = None if budget_s is None else time.monotonic() + budget_s
    for case, provider in tqdm(work_items(selected, providers), desc="bench", unit="item", file=sys.stderr):
        _measure_provider(case, provider, settings, probes, out, deadline, budget_s)
        if after_each is not None:
            after_each(out)
    return out
