"""`fastrlhf bench`: cases, providers, measurement, targets, reporting and the CLI.

    cases.py        what is measured: cases, their inputs, the bytes and FLOPs each pass is credited with
    providers.py    who is measured: fastrlhf, PyTorch eager, torch.compile, the peers, the bare matmuls
    measure.py      how: timing (minimum repetitions, L2 flush, rotated inputs), peak memory, probes
    environment.py  where: device, clocks, nominal bandwidth, versions, commit and kernels tree
    run.py          the harness loop: every case, provider and pass on fresh inputs, within a budget
    targets.py      the speed and memory targets, as ratios measured in the same run
    report.py       terminal table, JSON record, plot, README table
    cli.py          argument parsing and `main`
"""

from fastrlhf.bench.cases import CASE_SETS, OPS, PASSES, Case, case_bytes, cases
from fastrlhf.bench.cli import build_parser, main, run_bench
from fastrlhf.bench.measure import GB, GIB, Settings, make_pool, make_runner, sync, time_fn, warmup_calls
from fastrlhf.bench.providers import PEERS, PROVIDERS, WEIGHT_ACCUM, Skip, load_provider, passes_of, providers_of
from fastrlhf.bench.report import markdown_table, plot, print_table, write_json
from fastrlhf.bench.targets import TARGETS, targets

__all__ = [
    "CASE_SETS", "GB", "GIB", "OPS", "PASSES", "PEERS", "PROVIDERS", "TARGETS", "WEIGHT_ACCUM", "Case", "Settings",
    "Skip", "build_parser", "case_bytes", "cases", "load_provider", "main", "make_pool", "make_runner",
    "markdown_table", "passes_of", "plot", "print_table", "providers_of", "run_bench", "sync", "targets",
    "time_fn", "warmup_calls", "write_json",
]
