"""Chunk size of the linear ops on a GPU: fwd+bwd time over the 3 bare matmuls, and extra peak memory,
per rows per chunk. An experiment for issue 13, not part of `fastrlhf bench`.

    python bench/experiments/linear_chunks.py --out linear_chunks.json        # CUDA, the target shape
    python bench/experiments/linear_chunks.py --dry-run                       # CPU, a tiny shape

The ops cut the N tokens into chunks of `chunk_size` rows (by default as many as 640 MiB of logits
hold on CUDA: 2048 rows at V = 151936 in bf16, 8 chunks at N = 16384; fastrlhf/constants.py). A
larger chunk re-reads W in fewer, larger GEMMs; a smaller one holds fewer logits. The H100 record of
2026-11-23 measured, at the default: linear_logprobs 1.45x the 3 bare matmuls (1.42x accumulating
d(weight) in bf16; goal <= 1.40), linear_ppo_actor_loss 1.07x (1.03x), and an extra peak of 2.32 GiB
with the fp32 d(weight) buffer (V x H x 4 bytes by itself), 1.16 / 0.58 GiB in bf16 (goal <= 1 GiB).
The 1.16 held the previous chunk's logits by mistake (fixed, see tests/ops/test_linear_actor_fused.py's
one-chunk test): predicted 0.58 GiB now, not yet measured.

The bet (a prediction): d(W) += d(logits)^T h is one GEMM per chunk that reads and writes all of d(W)
(1.16 GiB in bf16, 2.3 GiB in fp32) on top of its 2.5 TFLOP, where the bare-matmul baseline writes it
once with K = N; with the Triton passes (~4.5 ms) that is the 1.42x - 1.33x (4 matmuls by design) gap.
Fewer chunks cut it: 6 chunks of 2736 rows (0.77 GiB of logits, still under the 1 GiB goal) instead of
8 of 2048 should save ~2 ms of d(W) traffic; 4 of 4096 more, at 1.16 GiB of logits.

Measured as `fastrlhf bench` measures (fastrlhf.bench.measure: inputs rotated through copies, L2
flushed before each call, the median of >= 10 CUDA-event timed calls; peak = max_memory_allocated
during one call net of the returned gradients), at N = 16384, H = 4096, V = 151936 bf16, the
bench's ACTOR_KW for the actor loss.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fastrlhf import ops
from fastrlhf.bench.cases import Case
from fastrlhf.bench.environment import environment
from fastrlhf.bench.measure import GIB, Settings, make_pool, make_runner, peak_memory, time_fn
from fastrlhf.bench.providers import ACTOR_KW, _matmuls

TARGET = {"N": 16384, "H": 4096, "V": 151936}
TINY = {"N": 96, "H": 16, "V": 500}


def _op(name: str, chunk_size: int, accum: str):
    """op(**bench inputs) with this chunk size and d(weight) accumulation ("fp32" or "weight")."""
    fn = getattr(ops, name)
    kw = ACTOR_KW if name == "linear_ppo_actor_loss" else {}

    def run(**inputs):
        accum_dtype = inputs["weight"].dtype if accum == "weight" else None
        return fn(**inputs, chunk_size=chunk_size, accum_dtype=accum_dtype, **kw)

    return run


def measure(name: str, fn, case: Case, settings: Settings, autograd: bool = True) -> dict:
    pool = make_pool(case, settings)
    run, grads = make_runner("fwd+bwd", fn, autograd, pool, settings.device)
    for _ in range(2):  # warm-up: compiles and autotunes
        run()
    timing = time_fn(run, settings, grads)
    peak, returned = peak_memory(run, settings.device, grads)
    out = {"median_ms": timing.median_ms, "p10_ms": timing.p10_ms, "p90_ms": timing.p90_ms, "reps": timing.reps}
    if peak is not None:
        out |= {"peak_gib": peak / GIB, "extra_peak_gib": (peak - returned) / GIB}
    print(f"{name:55s} {timing.median_ms:9.3f} ms" + (f"  extra peak {out['extra_peak_gib']:.3f} GiB"
                                                       if peak is not None else ""), flush=True)
    del pool
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="CPU, a tiny shape (the torch path)")
    parser.add_argument("--chunks", type=int, nargs="+", help="rows per chunk (default: 1024 2048 2736 3072 4096, "
                        "dry run: 16 48 96)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run on a CPU")
    dims = TINY if args.dry_run else TARGET
    chunks = args.chunks or ([16, 48, 96] if args.dry_run else [1024, 2048, 2736, 3072, 4096])
    if any(c <= 0 for c in chunks):
        parser.error(f"--chunks must be positive, got {chunks}")
    dtype = torch.bfloat16
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
    settings = Settings(device, rep_ms=1.0 if args.dry_run else 200.0,
                        rotate_bytes=4 * l2 if device.type == "cuda" else 1, min_reps=3 if args.dry_run else 10)

    rows = []
    base = measure("3 bare matmuls", _matmuls("fwd+bwd"), Case("linear_logprobs", dims, dtype, ("fwd+bwd",)),
                   settings, autograd=False)
    for name in ("linear_logprobs", "linear_ppo_actor_loss"):
        case = Case(name, dims, dtype, ("fwd+bwd",))
        for accum in ("fp32", "weight"):
            for chunk in chunks:
                m = measure(f"{name} accum={accum} chunk={chunk}", _op(name, chunk, accum), case, settings)
                rows.append({"op": name, "accum": accum, "chunk_size": chunk,
                             "over_matmuls": m["median_ms"] / base["median_ms"], **m})
                print(f"{'':55s} {rows[-1]['over_matmuls']:.3f}x the 3 matmuls", flush=True)

    record = {"experiment": "linear_chunks", "command": "python bench/experiments/linear_chunks.py "
              + " ".join(sys.argv[1:] if argv is None else argv), "environment": environment(device),
              "dims": dims, "dtype": str(dtype), "matmuls": base, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
