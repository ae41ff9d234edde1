"""How it is reported: a terminal table, the JSON record, a plot and the README table.

The JSON record (schema 2) holds the environment (device, clocks, nominal bandwidth, versions,
commit, kernels tree), `probes`, `settings`, one row per (case, pass, provider) in `results`
(each with `autotune`: the config every autotuned Triton kernel of that row chose), `targets`,
`skipped`, `errors`, `notes`, and `finished` (false while a run is still writing it, or when it
was stopped before its end).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from fastrlhf.bench.providers import PEERS
from fastrlhf.bench.targets import same_case

SCHEMA = 2


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _met(met, rich=False) -> str:
    if rich:
        return {True: "[green]yes[/]", False: "[red]no[/]", None: "-"}[met]
    return {True: "yes", False: "no", None: "-"}[met]


def probe_line(result: dict) -> str:
    """One line: the probes beside the nominal bandwidth and the clocks seen after them."""
    p = result["probes"]
    line = f"read probe {p['read_gbps']:.0f} GB/s, copy probe {p['copy_gbps']:.0f} GB/s"
    nominal = p.get("nominal_gbps")
    if nominal:
        line += (f" (nominal {nominal:.0f} GB/s: read {p['read_gbps'] / nominal:.2f}, "
                 f"copy {p['copy_gbps'] / nominal:.2f} of it)")
    clocks = p.get("clocks_after") or {}
    if clocks.get("clocks.sm") is not None:
        line += (f"; clocks after the probes: SM {clocks['clocks.sm']:.0f}/{clocks.get('clocks.max.sm') or 0:.0f} MHz, "
                 f"memory {clocks.get('clocks.mem') or 0:.0f}/{clocks.get('clocks.max.mem') or 0:.0f} MHz")
    return line


def print_table(result: dict) -> None:
    """The rows, probes and targets as rich tables on the terminal."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)  # no wrapping in logs and pipes
    label = "CPU wall-clock" if result["kind"] == "cpu" else "ms: GPU time (CUDA events, host hidden, L2 flushed)"
    table = Table(title=f"fastrlhf bench — {result['device']} ({label}); {probe_line(result)}")
    numeric = ("ms", "p10-p90", "reps", "GB/s", "roofline", "host us", "wall ms", "x torch", "peak MiB", "extra MiB")
    for col in ("op", "pass", "shape", "dtype", "provider", *numeric):
        table.add_column(col, justify="right" if col in numeric else "left", no_wrap=True)
    rows = result["results"]
    for r in rows:
        base = same_case(rows, r, r["op"], r["pass"], "torch")
        speedup = f"{base['median_ms'] / r['median_ms']:.2f}" if base else "-"
        provider = r["provider"] if r["backend"] == r["provider"] else f"{r['provider']}/{r['backend']}"
        table.add_row(r["op"], r["pass"], r["shape"], r["dtype"], provider, f"{r['median_ms']:.3f}",
                      f"{r['p10_ms']:.3f}-{r['p90_ms']:.3f}", str(r["reps"]), f"{r['gbps']:.1f}",
                      f"{r['roofline']:.2f}", _fmt(r.get("host_us")), _ms(r.get("wall_ms")), speedup,
                      _mib(r["peak_mem_bytes"]), _mib(r["extra_peak_bytes"]))
    console.print(table)
    note = " (judged on CUDA at the target shapes only)" if result["kind"] == "cpu" else ""
    tt = Table(title="targets" + note)
    for col in ("target", "goal", "value", "met", "case", "detail"):
        tt.add_column(col)
    for t in result["targets"]:
        tt.add_row(t["name"], t["goal"], _fmt(t["value"]), _met(t["met"], rich=True), t["case"] or "-", t["detail"])
    console.print(tt)
    for r in rows:
        for t in r.get("autotune", []):
            config = ", ".join(f"{k}={v}" for k, v in t["config"].items())
            console.print(f"[dim]autotune {r['op']} {r['pass']} {r['shape']} {r['dtype']} {r['provider']}: "
                          f"{t['kernel']} {config}[/]")
    for note in result["notes"]:
        console.print(f"[dim]note: {note}[/]")
    for s in result["skipped"]:
        console.print(f"[dim]skipped {s['provider']} ({', '.join(s['ops'])}): {s['reason']}[/]")
    for e in result["errors"]:
        console.print(f"[red]fastrlhf failed: {e['op']} {e['shape']} {e['dtype']} {e['pass']}: {e['error']}[/]")


def write_json(result: dict, path: str | Path) -> None:
    """Write the record atomically (a reader never sees half a file, even mid-run)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)


def plot(result: dict, path: str) -> None:
    """Horizontal bars of GB/s per case and provider, with the two probes as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    groups = list(dict.fromkeys((r["op"], r["pass"], r["shape"], r["dtype"]) for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    height = 0.8 / max(len(providers), 1)
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(groups) * max(1, len(providers) / 2) + 1.5))
    for i, provider in enumerate(providers):
        ys, xs = [], []
        for g, key in enumerate(groups):
            r = next((r for r in rows if (r["op"], r["pass"], r["shape"], r["dtype"]) == key
                      and r["provider"] == provider), None)
            if r:
                ys.append(g + i * height)
                xs.append(r["gbps"])
        ax.barh(ys, xs, height=height, label=provider)
    ax.axvline(result["probes"]["read_gbps"], color="k", linestyle="--", label="read probe")
    ax.axvline(result["probes"]["copy_gbps"], color="grey", linestyle=":", label="copy probe")
    ax.set_yticks([g + 0.4 - height / 2 for g in range(len(groups))])
    ax.set_yticklabels([f"{op} {p}  {s} {d}" for op, p, s, d in groups], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")  # the Python-loop GAE and the probes are orders of magnitude apart
    ax.set_xlabel("GB/s, log scale (bytes counted once per input and output)")
    ax.set_title(f"fastrlhf bench — {result['device']}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_table(result: dict) -> str:
    """A README table from a record: fastrlhf against torch, torch.compile and the best peer per
    case, then the targets, then the command and revision that made it."""
    rows = result["results"]
    keys = list(dict.fromkeys((r["op"], r["pass"], r["shape"], r["dtype"]) for r in rows))
    lines = [f"Measured on {result['device']} (torch {result['torch']}, triton {result['triton']}, "
             f"driver {result.get('driver') or '-'}); {probe_line(result)}.", "",
             "GPU ms: kernel time with the host hidden (the roofline's); host µs: the host's time to issue one call; "
             "wall ms: back-to-back calls (what a loop sees), fastrlhf's and the fastest peer's.", "",
             "| op | pass | shape | dtype | fastrlhf GPU ms | GB/s | roofline | host µs | wall ms | torch ms "
             "| torch.compile ms | fastest peer wall ms | peer host µs | extra peak MiB |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def ms(r):
        return "-" if r is None else f"{r['median_ms']:.3f}"

    def wall(r):
        return r.get("wall_ms") or r["median_ms"]

    for key in keys:
        by = {r["provider"]: r for r in rows if (r["op"], r["pass"], r["shape"], r["dtype"]) == key}
        ours = by.get("fastrlhf")
        best = min((r for p, r in by.items() if p in PEERS), key=wall, default=None)
        peer = "-" if best is None else f"{wall(best):.3f} ({best['provider']})"
        peer_host = "-" if best is None else _fmt(best.get("host_us"))
        gbps = "-" if ours is None else f"{ours['gbps']:.0f}"
        roofline = "-" if ours is None else f"{ours['roofline']:.2f}"
        extra = "-" if ours is None else _mib(ours["extra_peak_bytes"])
        host = "-" if ours is None else _fmt(ours.get("host_us"))
        ours_wall = "-" if ours is None else f"{wall(ours):.3f}"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {ms(ours)} | {gbps} | {roofline} | {host} | "
                     f"{ours_wall} | {ms(by.get('torch'))} | {ms(by.get('torch.compile'))} | {peer} | {peer_host} | "
                     f"{extra} |")
    lines += ["", "| target | goal | measured | met |", "| --- | --- | ---: | --- |"]
    for t in result["targets"]:
        lines.append(f"| {t['name']} | {t['goal']} | {_fmt(t['value'])} | {_met(t['met'])} |")
    # the tree hash of the fastrlhf/kernels/ files as they ran (git's HEAD may be stale in a copied checkout)
    kernels = (result.get("kernels_tree_files") or result.get("kernels_tree") or "-")[:12]
    lines += ["", f"Command: `{result['command']}` (kernels tree {kernels}, computed from the files that ran: "
                  f"`git rev-parse HEAD:fastrlhf/kernels` names the commits with these kernels)."]
    if not result.get("finished", True):
        lines.append("This run was stopped before its end: cases it did not reach are missing.")
    return "\n".join(lines)
