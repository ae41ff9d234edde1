"""Where the time of `logprobs` fwd+bwd goes at few rows: GPU kernel time vs host time. An experiment for
issue 13, not part of `fastrlhf bench`.

    python bench/experiments/few_rows_profile.py --out few_rows.json   # CUDA: B=1, T=128, V=151936 bf16
    python bench/experiments/few_rows_profile.py --dry-run             # CPU, a tiny shape (the torch path)

The H100 record of 2026-11-23 has, at B=1, T=128, V=151936 bf16 (39 MB of logits: ~13 us of DRAM
time), fwd+bwd 0.80 ms for fastrlhf against 0.48 ms for plain PyTorch and 0.23 ms for TRL. All three
are far above the DRAM time, so launches and host work dominate. On a CPU, with every kernel launch
stubbed out, the op's host side measured 223 us per fwd+bwd (64 us forward), of which the
torch.library custom-op dispatch is ~45 us (a bare custom op with registered autograd: 101 us per
fwd+bwd; the same as a torch.autograd.Function: 56 us). This run splits the 0.80 ms: torch.profiler
over a few calls of each provider (fastrlhf, torch, TRL's selective_log_softmax when installed)
gives each one's CUDA kernel time (sum over kernels) beside its wall time per call, and the names
and times of the fastrlhf kernels (split forward, combine, backward). With --cprofile, cProfile over
the fastrlhf calls adds the Python functions with the most own time per call ("host_functions").
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fastrlhf import ops, reference
from fastrlhf.bench.environment import environment

CALLS = 20


def _providers() -> dict:
    out = {"fastrlhf": ops.logprobs, "torch": reference.logprobs}
    try:
        from trl.trainer.utils import selective_log_softmax
    except ImportError:
        pass
    else:
        out["trl"] = lambda logits, labels: selective_log_softmax(logits, labels)
    return out


def _one(fn, logits, labels):
    x = logits.detach().requires_grad_()
    fn(x, labels).float().sum().backward()


def host_functions(fn, logits, labels, sync, top: int = 25) -> list[dict]:
    """The `top` functions by own (not cumulative) time per fwd+bwd under cProfile."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(CALLS):
        _one(fn, logits, labels)
    sync()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    rows = [{"function": f"{Path(file).name}:{line}:{name}", "calls_per_call": calls / CALLS,
             "own_us_per_call": own / CALLS * 1e6, "cumulative_us_per_call": cum / CALLS * 1e6}
            for (file, line, name), (_, calls, own, cum, _) in stats.items()]
    rows.sort(key=lambda r: -r["own_us_per_call"])
    print("cProfile, fastrlhf, per fwd+bwd (own / cumulative us):")
    for r in rows[:top]:
        print(f"  {r['own_us_per_call']:8.1f} {r['cumulative_us_per_call']:8.1f}  x{r['calls_per_call']:<5.0f} "
              f"{r['function']}")
    return rows[:top]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="CPU, a tiny shape")
    parser.add_argument("--cprofile", action="store_true", help="also cProfile the fastrlhf calls")
    args = parser.parse_args(argv)
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run on a CPU")
    device = torch.device("cuda" if cuda else "cpu")
    B, T, V = (1, 128, 151936) if cuda else (1, 16, 512)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(B, T, V, device=device, generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, V, (B, T), device=device, generator=gen)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    rows = {}
    for name, fn in _providers().items():
        for _ in range(5):  # warm-up: compiles and autotunes
            _one(fn, logits, labels)
        sync()
        start = time.perf_counter()
        for _ in range(CALLS):
            _one(fn, logits, labels)
        sync()
        wall_us = (time.perf_counter() - start) / CALLS * 1e6
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(CALLS):
                _one(fn, logits, labels)
            sync()
        kernels = {}
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            if us > 0:
                kernels[e.key] = {"us_per_call": us / CALLS, "launches_per_call": e.count / CALLS}
        device_us = sum(k["us_per_call"] for k in kernels.values())
        rows[name] = {"wall_us_per_call": wall_us, "device_us_per_call": device_us,
                      "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_call"])[:12])}
        print(f"{name:10s} wall {wall_us:8.1f} us per fwd+bwd, GPU kernels {device_us:8.1f} us, "
              f"{sum(k['launches_per_call'] for k in kernels.values()):.0f} launches", flush=True)
        for kname, k in list(rows[name]["kernels"].items())[:6]:
            print(f"{'':12s}{k['us_per_call']:8.1f} us x{k['launches_per_call']:.0f}  {kname[:90]}")

    if args.cprofile:
        rows["fastrlhf"]["host_functions"] = host_functions(ops.logprobs, logits, labels, sync)

    record = {"experiment": "few_rows_profile",
              "command": "python bench/experiments/few_rows_profile.py " + " ".join(sys.argv[1:] if argv is None
                                                                                    else argv),
              "environment": environment(device), "shape": {"B": B, "T": T, "V": V}, "dtype": "bfloat16",
              "calls": CALLS, "providers": rows}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
