"""`fastrlhf estimate`: the command line (built from `Spec`), the table, the plot."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import fastrlhf.estimate.timing as timing
from fastrlhf.estimate.arch import format_params
from fastrlhf.estimate.hardware import device
from fastrlhf.estimate.memory import state_table
from fastrlhf.estimate.phases import COMPONENTS, host_engine
from fastrlhf.estimate.plan import FRAGMENTATION, SERVE_STUDENT, estimate
from fastrlhf.estimate.spec import Spec, actor_arch, resolved, student_arch
from fastrlhf.train.config import help_text, parse_args

DESCRIPTION = """Memory per GPU, FLOPs, time (with a cross-validated range) and cost of each RLHF stage and PPO phase,
fit per pool; --stage distill: a student (--student) trained to mimic --model; --stage serve: the cost of serving the
tuned policy (with --student: the teacher's and the student's side by side).

Time is physics (FLOPs / peak, bytes / bandwidth, kernels and host ops x their measured cost) with a few efficiency
factors fitted to DeepSpeed-Chat's published runs, this trainer's recorded runs and published vLLM serving
measurements, each accepted by leave-one-source-out cross-validation (fastrlhf/estimate/data/efficiency.json;
`python -m fastrlhf.estimate.calibrate` shows every source). Every planner input is a key below: --KEY VALUE
(dashes or underscores), or --config FILE.yaml. --engine deepspeed follows the ZeRO paper's accounting, --engine
fsdp2 (default) this trainer's buffers (the bytes per parameter at the end).
"""


def parser() -> argparse.ArgumentParser:
    """The output options; every other key is a `Spec` field (fastrlhf.train.config.parse_args)."""
    p = argparse.ArgumentParser(prog="fastrlhf estimate", description=DESCRIPTION, allow_abbrev=False,
                                epilog=help_text(Spec) + "\n\n" + state_table(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the estimate (and its inputs) as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a stacked bar chart of memory per phase")
    p.add_argument("--measure", action="store_true",
                   help="run a tiny model for a few steps and print predicted vs measured bytes")
    p.add_argument("--compare-run", metavar="OUT",
                   help="a fastrlhf run directory: its measured PPO phases beside the prediction for its "
                        "configuration (keys given here override what is read from the run)")
    p.add_argument("--run-args", metavar="ARGS", default=None,
                   help="--compare-run of a stand-alone `fastrlhf ppo` run, which writes no config.json: its "
                        "arguments, quoted ('--model qwen2-0.5b --steps 10 ...')")
    return p


def spec_from_argv(argv: list[str]) -> Spec:
    """The Spec of `--KEY VALUE` arguments (and `--config FILE`), resolved."""
    return resolved(parse_args(Spec, list(argv), prog="fastrlhf estimate"))


def given_keys(argv: list[str]) -> set[str]:
    """The Spec keys given on the command line (they override what --compare-run reads from the run)."""
    fields = {f.name for f in dataclasses.fields(Spec)}
    names = {token[2:].split("=", 1)[0].replace("-", "_") for token in argv if token.startswith("--")}
    return names & fields


def spec_json(spec: Spec) -> dict:
    out = dataclasses.asdict(spec)
    if not isinstance(out["model"], str):
        out["model"] = str(actor_arch(spec).source or "config")
    out["lora_targets"] = list(spec.lora_targets)
    if spec.student is not None and not isinstance(spec.student, str):
        out["student"] = str(student_arch(spec).source or "config")
    return out


# ---------------------------------------------------------------------------------------------
# Output


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _secs(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 1:
        return f"{s:.2f}"
    return f"{s:.3g}"


def _title(spec: Spec) -> str:
    arch = actor_arch(spec)
    gpus = (f"{spec.gpus} x {spec.gpu}" if spec.placement == "colocated"
            else ", ".join(f"{k} {v}" for k, v in spec.pools.items()) + f" x {spec.gpu}")
    zero = spec.zero if isinstance(spec.zero, int) else ",".join(f"{k}={v}" for k, v in spec.zero.items())
    train = f"LoRA r={spec.lora_rank}" + (" (QLoRA)" if spec.qlora else "") if spec.lora_rank else "full"
    model = f"{arch.source or spec.model}: {format_params(arch.params())} params"
    if spec.stage == "distill":
        student = student_arch(spec)
        model = (f"teacher {model} -> student {student.source or spec.student}: {format_params(student.params())} "
                 f"params ({'on-policy' if spec.on_policy else 'offline'})")
    return (f"{model}, {gpus}, {spec.engine} "
            f"ZeRO-{zero}, {spec.dtype}, {train}, gen {host_engine(spec)}"
            + (f" tp{spec.gen_tp}" if spec.gen_tp > 1 else "") + " - memory per GPU in GB (1e9 B)")


def _row(name: str, mem: dict, fits: str, flops: float, seconds: float, rng: list, share: str) -> tuple:
    return (name, *(_gb(mem[c]) for c in COMPONENTS), _gb(mem["peak"]), fits, f"{flops / 1e12:.1f}", _secs(seconds),
            f"{_secs(rng[0])}-{_secs(rng[1])}", share)


def _render(table) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(table)
    return console.export_text().rstrip()


def _stage_lines(stage: str, r: dict, spec: Spec) -> list[str]:
    lines = []
    if r.get("dominant_phase"):
        lines.append(f"{stage}: {r['dominant_phase']} dominates ({r['phases'][r['dominant_phase']]['share']:.0%} "
                     f"of {_secs(r['seconds'])} s per {spec.steps} iteration(s)); * marks it")
    for pool, f in r["pools"].items():
        tight = f" (tight: under {FRAGMENTATION:.0%} of the GPU left for the allocator's cache)" if f["tight"] else ""
        verdict = "fits" + tight if f["fits"] else f"does NOT fit: {f['component']} is the largest part"
        lines.append(f"{stage}: pool {pool} ({f['gpus']} GPU): peak {_gb(f['peak'])} GB in {f['phase']}, {verdict}")
        held = [f"{name} {_gb(m['weights'] + m['gradients'] + m['optimizer'] + m['buffers'])}"
                f" (w {_gb(m['weights'])} g {_gb(m['gradients'])} opt {_gb(m['optimizer'])}"
                f" buf {_gb(m['buffers'])})" for name, m in r["models"].items() if m["pool"] == pool]
        lines.append(f"    states per GPU, GB: {'; '.join(held)}")
    if r["host_memory_per_gpu_bytes"]:
        lines.append(f"{stage}: host memory per GPU {_gb(r['host_memory_per_gpu_bytes'])} GB (offloaded optimizer "
                     "states, fp32 gradient partitions, weights)")
    if "advice" in r:
        lines.append("  one change at a time:")
        for a in r["advice"]["single"]:
            lines.append(f"    {a['change']:<32} -> peak {_gb(a['peak_bytes'])} GB per GPU"
                         + (" (fits)" if a["fits"] else " (still too big)"))
        if r["advice"]["path"]:
            lines.append("  changes in a row (each lowers the peak most):")
            for a in r["advice"]["path"]:
                lines.append(f"    + {a['change']:<30} -> peak {_gb(a['peak_bytes'])} GB per GPU"
                             + (" (fits)" if a["fits"] else ""))
    if spec.price:
        lines.append(f"{stage}: ${r['cost_usd']:.2f} for {spec.steps} step(s) at ${spec.price}/GPU-hour")
    return lines


def _factors_line(kind: str) -> str:
    f = timing.factors(kind)
    return (f"time ({kind}): GEMMs at {f['mm']:.2f} of peak, memory at {f['bw']:.2f} of bandwidth, "
            f"{f['op'] * 1e6:.1f} us of host per eager op" + (f", {f['gap'] * 1e6:.1f} us per kernel" if kind == "gpu"
                                                           else "")
            + " (fitted, data/efficiency.json); a range is the leave-one-source-out spread of predicted / measured "
            "for that kind of phase" + ("; fits = peak + 1 GiB CUDA context <= GPU memory" if kind == "gpu" else ""))


def format_table(result: dict, spec: Spec) -> str:
    from rich.table import Table

    if "serve" in result["stages"]:
        if SERVE_STUDENT in result["stages"]:
            return format_serve_pair(result["stages"]["serve"], result["stages"][SERVE_STUDENT], spec)
        return format_serve(result["stages"]["serve"], spec)
    table = Table(title=_title(spec))
    for col in ("stage / phase", *COMPONENTS, "peak", "fits", "TFLOP", "seconds", "range", "share"):
        table.add_column(col, justify="left" if col == "stage / phase" else "right")
    limit = device(spec.gpu).memory_bytes - device(spec.gpu).context_bytes
    for stage, r in result["stages"].items():
        table.add_row(*_row(stage, r["memory_per_gpu_bytes"], "yes" if r["fits"] else "NO", r["flops"], r["seconds"],
                            r["seconds_range"], ""))
        if len(r["phases"]) < 2:
            continue
        for phase, p in r["phases"].items():
            mark = " *" if phase == r["dominant_phase"] else ""
            mem = p["memory_per_gpu_bytes"]
            table.add_row(*_row(f"  {phase}{mark}", mem, "yes" if mem["peak"] <= limit else "NO", p["flops"],
                                p["seconds"], p["seconds_range"], f"{p['share']:.0%}"))
    lines = [_render(table)]
    for stage, r in result["stages"].items():
        lines += _stage_lines(stage, r, spec)
    lines.append(_factors_line(device(spec.gpu).kind))
    return "\n".join(lines)


def format_serve(r: dict, spec: Spec, arch=None) -> str:
    arch = arch or actor_arch(spec)
    lines = [f"{arch.source or spec.model}: {format_params(arch.params())} params, {r['weights_precision']} weights, "
             f"{r['gpus_per_replica']} x {spec.gpu} per replica, {spec.seq_len} prompt + {spec.gen_len} output tokens"]
    mem = r["memory_per_gpu_bytes"]
    lines.append(f"memory per GPU: weights {_gb(mem['weights'])} GB, KV cache {_gb(mem['kv_cache'])} GB "
                 f"({_gb(r['kv_bytes_per_sequence'])} GB per request at full length), prefill activations "
                 f"{_gb(mem['activations'])} GB")
    if not r["fits"]:
        lines.append("does NOT fit: no request's KV cache fits beside the weights (more --gen-tp, or smaller weights)")
        return "\n".join(lines)
    lo, hi = r["tpot_range_s"]
    lines.append(f"concurrency: {r['concurrency']:.1f} requests decoding (at most {r['max_concurrency']} fit)")
    lines.append(f"time to first token {r['ttft_s'] * 1e3:.1f} ms, time per output token {r['tpot_s'] * 1e3:.2f} ms "
                 f"(range {lo * 1e3:.2f}-{hi * 1e3:.2f}), {r['tokens_per_s_per_replica']:.0f} output tokens/s per "
                 f"replica; at most {r['max_requests_per_s_per_replica']:.2f} requests/s per replica")
    if r["request_rate"]:
        lines.append(f"for {r['request_rate']} requests/s: {r['replicas']} replica(s), {r['gpus']} GPU(s)")
    if spec.price:
        lines.append(f"${r['usd_per_1m_output_tokens']:.3f} per 1M output tokens at ${spec.price}/GPU-hour")
    terms = r["decode_terms"]
    lines.append("a decode step: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in terms.items()
                                               if k != "host_bound_share"))
    lines.append(_factors_line("gpu"))
    return "\n".join(lines)


def format_serve_pair(teacher: dict, student: dict, spec: Spec) -> str:
    """--stage serve --student: each model's serving as format_serve prints it, then the two side by side."""
    from rich.table import Table

    archs = {"teacher": actor_arch(spec), "student": student_arch(spec)}
    results = {"teacher": teacher, "student": student}
    table = Table(title=f"serving the teacher and its student, {spec.gpu}, {spec.seq_len} prompt + {spec.gen_len} "
                        "output tokens")
    for col in ("", "teacher", "student", "student / teacher"):
        table.add_column(col, justify="left" if not col else "right")
    rows = [("parameters", lambda r, a: a.params(), format_params),
            ("weights per GPU, GB", lambda r, a: r["memory_per_gpu_bytes"]["weights"], _gb),
            ("KV per request, GB", lambda r, a: r["kv_bytes_per_sequence"], _gb),
            ("requests that fit", lambda r, a: r["max_concurrency"], str),
            ("TTFT, ms", lambda r, a: r["ttft_s"] * 1e3, lambda v: f"{v:.1f}"),
            ("TPOT, ms", lambda r, a: r["tpot_s"] * 1e3, lambda v: f"{v:.2f}"),
            ("requests decoding", lambda r, a: r["concurrency"], lambda v: f"{v:.1f}"),
            ("output tokens/s per GPU", lambda r, a: r["tokens_per_s_per_replica"] / r["gpus_per_replica"],
             lambda v: f"{v:.0f}"),
            ("most requests/s per GPU", lambda r, a: r["max_requests_per_s_per_replica"] / r["gpus_per_replica"],
             lambda v: f"{v:.2f}")]
    if spec.request_rate:
        rows.append((f"GPUs for {spec.request_rate} requests/s", lambda r, a: r["gpus"], str))
    if spec.price:
        rows.append(("$ per 1M output tokens", lambda r, a: r["usd_per_1m_output_tokens"], lambda v: f"{v:.3f}"))
    for name, value, text in rows:
        t, s = (value(results[k], archs[k]) for k in ("teacher", "student"))
        fits = teacher["fits"] and student["fits"]
        table.add_row(name, text(t), text(s), f"{s / t:.2f}" if fits and t else "-")
    parts = [f"teacher: {format_serve(teacher, spec, archs['teacher'])}",
             f"student: {format_serve(student, spec, archs['student'])}", _render(table)]
    return "\n".join(parts)


def plot(result: dict, path: str) -> None:
    """Stacked bars of memory per GPU by component, one bar per stage / PPO phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for stage, r in result["stages"].items():
        if "phases" in r:
            rows += [(f"{stage}:{ph}", p["memory_per_gpu_bytes"]) for ph, p in r["phases"].items()]
        else:
            rows.append((stage, r["memory_per_gpu_bytes"]))
    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(rows), 4.5))
    bottom = [0.0] * len(rows)
    for component in COMPONENTS:
        values = [mem[component] / 1e9 for _, mem in rows]
        ax.bar([name for name, _ in rows], values, bottom=bottom, label=component)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("memory per GPU (GB)")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _print_measure(lora_rank: int) -> None:
    from fastrlhf.estimate.measure import measure

    m = measure(lora_rank)
    print(f"--measure ({m['device']}, {m['dtype']}, {'LoRA r=' + str(lora_rank) if lora_rank else 'full'}):")
    for key, measured in m["measured"].items():
        predicted = m["predicted"][key]
        print(f"  {key:<10} predicted {predicted:>12,d} B  measured {measured:>12,d} B  "
              f"({(predicted - measured) / measured:+.1%})")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = parser().parse_known_args(argv)
    try:
        spec = spec_from_argv(rest)
        if args.compare_run:
            from fastrlhf.estimate.compare import compare_main

            return compare_main(args, given_keys(rest), spec)
        result = estimate(spec)
    except (ValueError, TypeError) as err:
        print(f"fastrlhf estimate: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"inputs": spec_json(spec), **result}, indent=2, default=float))
    else:
        print(format_table(result, spec))
    if args.plot and "serve" not in result["stages"]:
        plot(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.measure:
        for rank in sorted({0, spec.lora_rank or 8}):
            _print_measure(rank)
    return 0
