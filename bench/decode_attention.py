"""Decode attention on a GPU (issue 41): fastrlhf.ops.decode_attention beside SDPA, flex attention and flash-attn,
its goals judged in the same run.

    python bench/decode_attention.py --out decode_attention.json         # CUDA: the decode_attention case set
    python bench/decode_attention.py --dry-run --out x.json              # CPU: the tiny set's decode cases

1. `fastrlhf bench --cases decode_attention --ops decode_attention` with fastrlhf, SDPA (the `torch` provider:
   enable_gqa over the written slots), flash-attn's flash_attn_with_kvcache (where installed) and compiled flex
   attention (compiled per shape, so measured last, within --budget-s): the read and copy probes, GPU time with
   the host hidden, host us and wall ms per call (fastrlhf/bench/measure.py).
2. At every case, the kernel's own count of the K / V tiles it loads (kernels.decode_attention_fwd with
   count_tiles=True), times the tile's bytes: what it reads, beside what the work needs (the written slots,
   a shared prompt once per group) and what a reader without the shared prompt needs (each row's t slots).
3. The goals, each a ratio of this run, judged on CUDA only: fastrlhf's GB/s on the bytes needed >= 0.8 of the
   copy probe at 2048 and 4096 written slots; its GPU time <= 1.0x the fastest peer's at every shape; with
   G > 1 the K / V bytes it reads <= the bytes needed in whole tiles (the prompt read once per group).
The dry run takes the tiny case set on CPU (the torch path, no peers), and counts tiles in the Triton
interpreter.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from pathlib import Path

if "--dry-run" in sys.argv:  # the tile counts run the kernels; on a CPU that is the interpreter, set before triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from fastrlhf.bench.cases import OPS, Case, cases, decode_prefix_slots  # noqa: E402
from fastrlhf.bench.cli import build_parser, run_bench  # noqa: E402
from fastrlhf.bench.report import write_json  # noqa: E402

OP = "decode_attention"
PROVIDERS = ("fastrlhf", "torch", "flash_attn", "flex")
PEERS = ("torch", "flash_attn", "flex", "torch.compile")  # "torch" is SDPA
BANDWIDTH_AT = (2048, 4096)  # written slots where the bandwidth goal applies
MET = {True: "MET", False: "missed", None: "-"}


def _kv_bytes(case: Case, slots: int) -> int:
    D, H_kv = case.dims["D"], case.dims["Hkv"]
    return 2 * slots * H_kv * D * torch.empty((), dtype=case.dtype).element_size()


def tile_counts(case: Case, device: torch.device) -> dict:
    """The K / V bytes the kernel loads at this case (its own tile count), and those the work needs."""
    from fastrlhf.kernels import decode_attention as kernels

    B, t, G = case.dims["B"], case.dims["t"], case.dims["G"]
    P = decode_prefix_slots(case)
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = OPS[OP].inputs(case, device, gen)
    prefix = None if G == 1 else (inputs["k_prefix"], inputs["v_prefix"], inputs["prefix_lengths"], G)
    _, tiles = kernels.decode_attention_fwd(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["lengths"],
                                            scale=case.dims["D"] ** -0.5, prefix=prefix, count_tiles=True)
    n_tiles = int(tiles.sum())
    del inputs, tiles
    block = kernels.BLOCK_N
    whole = B // G * math.ceil(P / block) * block + B * math.ceil((t - P) / block) * block
    element = torch.empty((), dtype=case.dtype).element_size()
    return {"tiles": n_tiles, "bytes_read": 2 * n_tiles * block * case.dims["D"] * element,  # a K and a V tile each
            "bytes_needed": _kv_bytes(case, B // G * P + B * (t - P)),
            "bytes_needed_whole_tiles": _kv_bytes(case, whole),
            "bytes_per_row_reader": _kv_bytes(case, B * t)}


def _goal(name, goal, value, met, on_gpu, detail=""):
    return {"name": name, "goal": goal, "value": value, "met": None if value is None or not on_gpu else met(value),
            "detail": detail}


def goals(entries: list[dict], probes: dict, on_gpu: bool) -> list[dict]:
    out = []
    for e in entries:
        ours = e["providers"].get("fastrlhf")
        where = f"{e['shape']}"
        if e["dims"]["t"] in BANDWIDTH_AT:
            value = None if ours is None else ours["gbps"] / probes["copy_gbps"]
            out.append(_goal(f"GB/s on bytes needed / copy probe, {where}", ">= 0.8", value, lambda v: v >= 0.8,
                             on_gpu, "" if ours is None else f"{ours['gbps']:.0f} / {probes['copy_gbps']:.0f} GB/s"))
        peers = {p: r for p, r in e["providers"].items() if p in PEERS}
        best = min(peers.items(), key=lambda pr: pr[1]["median_ms"], default=None)
        value = None if ours is None or best is None else ours["median_ms"] / best[1]["median_ms"]
        detail = "no peer measured" if best is None else f"fastest peer {best[0]} {best[1]['median_ms']:.4g} ms GPU"
        out.append(_goal(f"GPU time / fastest peer, {where}", "<= 1.0", value, lambda v: v <= 1.0, on_gpu, detail))
        if e["dims"]["G"] > 1:
            k = e["kernel_kv"]
            out.append(_goal(f"K/V bytes read / needed in whole tiles (prompt once per group), {where}", "<= 1.0",
                             k["bytes_read"] / k["bytes_needed_whole_tiles"], lambda v: v <= 1.0 + 1e-9, on_gpu,
                             f"read {k['bytes_read']} B; a reader of every row's t slots needs "
                             f"{k['bytes_per_row_reader']} B"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU, the tiny set's decode cases")
    p.add_argument("--budget-s", type=float, default=None, help="the bench's budget (default 300; dry run 40)")
    args = p.parse_args(argv)
    bench_argv = ["--cases", "tiny" if args.dry_run else OP, "--ops", OP, "--providers", ",".join(PROVIDERS),
                  "--budget-s", str(args.budget_s or (40 if args.dry_run else 300))]
    if args.dry_run:
        bench_argv += ["--device", "cpu", "--threads", "1", "--rep-ms", "1"]
    command = "python bench/decode_attention.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    result, run = run_bench(build_parser().parse_args(bench_argv), "fastrlhf bench " + shlex.join(bench_argv))
    device = torch.device("cpu" if args.dry_run else "cuda")
    on_gpu = result["kind"] == "cuda"
    entries = []
    for case in [c for c in cases("tiny" if args.dry_run else OP) if c.op == OP]:
        rows = {r["provider"]: {k: r[k] for k in ("median_ms", "p10_ms", "p90_ms", "gbps", "host_us", "wall_ms",
                                                  "bytes", "backend")}
                for r in result["results"] if r["op"] == OP and r["dims"] == case.dims}
        entries.append({"shape": case.shape, "dims": case.dims, "dtype": case.dtype_name, "providers": rows,
                        "kernel_kv": tile_counts(case, device)})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    record = {"experiment": OP, "command": command, "bench_command": result["command"], "dry_run": args.dry_run,
              **{k: result.get(k) for k in ("device", "kind", "torch", "triton", "driver", "commit", "kernels_tree",
                                            "kernels_tree_files", "dirty", "timer", "probes", "settings")},
              "bytes_counted": OPS[OP].doc, "cases": entries, "goals": goals(entries, result["probes"], on_gpu),
              "skipped": result["skipped"], "errors": result["errors"], "finished": result["finished"]}
    write_json(record, args.out)
    for e in entries:
        line = "  ".join(f"{prov} {r['median_ms']:.4g} ms {r['gbps']:.0f} GB/s" for prov, r in e["providers"].items())
        print(f"{e['shape']}: {line}; kernel reads {e['kernel_kv']['bytes_read']} of "
              f"{e['kernel_kv']['bytes_needed']} K/V bytes needed")
    for g in record["goals"]:
        value = "-" if g["value"] is None else f"{g['value']:.3g}"
        print(f"{g['name']:<95} {g['goal']:>7} {value:>8} {MET[g['met']]}")
    for e in result["errors"]:
        print(f"error: {e['provider']} {e['shape']}: {e['error']}")
    print(f"wrote {args.out}")
    return 1 if run.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
