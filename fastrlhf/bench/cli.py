"""`fastrlhf bench`: a roofline table of every op against PyTorch, torch.compile and the peers.

    fastrlhf bench --json out.json --plot out.png          # CUDA, the full case set
    fastrlhf bench --cases targets --budget-s 150           # the target shapes only, within 150 s
    fastrlhf bench --device cpu --cases quick               # every op on a CPU in about a minute
    fastrlhf bench --cases decode_attention                 # decode attention beside SDPA, flex, flash-attn

Each row: median time (and p10-p90, number of timed calls), GB/s for the bytes counted,
roofline = ideal / median with ideal = fwd bytes / read-probe GB/s + bwd bytes / copy-probe
GB/s, both probes measured in the same run; on CUDA, peak memory and the extra peak beyond
the inputs and the returned gradients. See cases.py (what), providers.py (who), measure.py
(how), targets.py (the targets) and report.py (the JSON record).
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys

import torch

from fastrlhf.bench.cases import CASE_SETS, OPS, cases
from fastrlhf.bench.environment import environment, gpu_state
from fastrlhf.bench.measure import DEFAULT_L2_BYTES, FLUSH_BYTES, GIB, Settings, probes
from fastrlhf.bench.providers import PROVIDERS
from fastrlhf.bench.report import SCHEMA, plot, print_table, write_json
from fastrlhf.bench.run import Run, bench
from fastrlhf.bench.targets import targets


def _csv(choices, what: str):
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad}; expected some of {', '.join(choices)}")
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastrlhf bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--cases", choices=tuple(CASE_SETS), default=None,
                   help="case set: targets (the target shapes), full (default on CUDA), quick (default on CPU), "
                        "tiny (seconds, for CI), decode_attention (that op at the Qwen2.5 head shapes)")
    p.add_argument("--quick", action="store_true", help="the same as --cases quick")
    p.add_argument("--ops", type=_csv(tuple(OPS), "op"), default=list(OPS), help="comma list of ops")
    p.add_argument("--providers", type=_csv(PROVIDERS, "provider"), default=None,
                   help=f"comma list of providers (default: all of {', '.join(PROVIDERS)}; "
                        "torch.compile is left out on CPU unless named here)")
    p.add_argument("--rep-ms", type=float, default=None,
                   help="time budget per measurement in ms, beyond --min-reps calls (default 200 on CUDA, 100 on CPU)")
    p.add_argument("--min-reps", type=int, default=None,
                   help="timed calls per measurement at least, however long a call (default 10 on CUDA, 3 on CPU)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting measurements after this many seconds (torch.compile runs last)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (torch.set_num_threads); 1 avoids thread-pool stalls on a busy box")
    p.add_argument("--seed", type=int, default=0, help="seed of every provider's inputs (the same for all)")
    p.add_argument("--json", metavar="PATH", help="write the result record here, rewritten after every case "
                                                  "(bench/results/ for GPU runs)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of GB/s per op and provider here")
    return p


def resolve_device(name: str | None) -> torch.device:
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda, cuda:N or cpu, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} asked for CUDA but torch.cuda.is_available() is False")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _positive(name: str, value, minimum=0.0):
    if value is not None and value <= minimum:
        raise ValueError(f"{name} must be > {minimum:g}, got {value}")


def run_bench(args: argparse.Namespace, command: str) -> tuple[dict, Run]:
    """Probe the device, time the selected cases, and assemble the result record (written to
    `args.json` after every case when given)."""
    device = resolve_device(args.device)
    for name in ("rep_ms", "min_reps", "budget_s", "threads"):
        _positive(f"--{name.replace('_', '-')}", getattr(args, name))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cuda = device.type == "cuda"
    case_set = "quick" if args.quick else (args.cases or ("full" if cuda else "quick"))
    notes = []
    providers = args.providers
    if providers is None:
        providers = [p for p in PROVIDERS if cuda or p != "torch.compile"]
        if not cuda:
            notes.append("torch.compile left out of this CPU run (compile time dominates); name it in --providers "
                         "to include it")
    env = environment(device)
    l2 = (env["gpu"] or {}).get("l2_bytes") or DEFAULT_L2_BYTES
    settings = Settings(device, rep_ms=args.rep_ms or (200.0 if cuda else 100.0),
                        rotate_bytes=4 * l2 if cuda else 64 * 2**20,
                        min_reps=args.min_reps or (10 if cuda else 3), seed=args.seed)
    probe = probes(settings, 2 * GIB if cuda else 128 * 2**20)
    if cuda:
        state = gpu_state(device.index or 0)
        probe["clocks_after"] = state
        probe["nominal_gbps"] = env["gpu"]["nominal_bandwidth"]["gbps"]
    selected = [c for c in cases(case_set) if c.op in args.ops]
    record = {
        "schema": SCHEMA, **env, "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cases": case_set, "finished": False,
        "timer": (f"median_ms: CUDA events around each call, L2 flushed ({FLUSH_BYTES} bytes zeroed) and "
                  f"torch.cuda._sleep longer than the host's issue time enqueued before each (GPU time, host hidden); "
                  f"host_us: the host's issue time per call; wall_ms: back-to-back calls, one sync; inputs "
                  f"rotated over copies >= {settings.rotate_bytes} bytes; median of >= {settings.min_reps} calls"
                  if cuda else f"time.perf_counter around each call (CPU); median of >= {settings.min_reps} calls"),
        "peak_mem_source": ("torch.cuda.max_memory_allocated() above memory_allocated() before the call; extra = "
                            "that minus the bytes of the returned gradients" if cuda else None),
        "settings": {"rep_ms": settings.rep_ms, "min_reps": settings.min_reps, "rotate_bytes": settings.rotate_bytes,
                     "budget_s": args.budget_s, "seed": settings.seed, "providers": providers},
        "probes": probe,
        "bytes_counted": {name: OPS[name].doc for name in args.ops},
        "notes": notes,
    }

    def fill(run: Run, finished: bool) -> dict:
        record.update(results=run.rows, targets=targets(run.rows, probe, device.type), skipped=run.skipped,
                      errors=run.errors, finished=finished)
        return record

    def checkpoint(run: Run) -> None:
        if args.json:
            write_json(fill(run, finished=False), args.json)

    run = bench(selected, providers, settings, probe, budget_s=args.budget_s, after_each=checkpoint)
    if cuda:
        record["gpu_state_at_end"] = gpu_state(device.index or 0)  # clocks and power after the last case
    return fill(run, finished=True), run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    result, run = run_bench(args, "fastrlhf bench " + shlex.join(argv))
    print_table(result)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 1 if run.errors else 0
