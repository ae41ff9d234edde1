"""Time of a phase: its work (FLOPs, bytes, calls) times calibrated per-device-class coefficients.

    seconds = sum_k feature_k * coefficient_k

feature                     what it counts                                  coefficient
fwd                         no-grad forward FLOPs / peak FLOP/s             1 / forward MFU
train                       forward + backward FLOPs / peak FLOP/s          1 / training MFU
decode:<engine>             bytes a decode step reads (weights, KV cache,   1 / fraction of memory bandwidth
                            sampling logits), summed over steps / bandwidth     the engine reaches
calls:<engine|fwd|train>    decoder-layer calls (launch + Python overhead)  seconds per layer call
steps:<engine>              generation steps (sampling, stopping checks)    seconds per step
                            (<engine> hf-static: hf generate with the static
                            KV cache, its decode step compiled)
adapters:train              LoRA adapter calls in training (layer calls x   seconds per adapter call
                            adapted linears)
opt                         optimizer bytes (AdamW reads 4, writes 3        1 / fraction of bandwidth
                            tensors) / bandwidth
host                        bytes over the host link (offload) / link       1 (physical, not fitted)
cpu_adam                    parameters the host optimizer updates           seconds per parameter
adv, steps:adv              the advantages phase, and its per-token steps   seconds
                            (KL-shaped rewards, GAE's recursion)
fixed                       a rule reward's call (small host work)          seconds

The coefficients of each device class ("gpu", "cpu") live in fastrlhf/estimate/data/efficiency.json,
each with its range and the calibration points it came from (`python -m fastrlhf.estimate.calibrate`
refits them); a phase's time range takes every coefficient at the ends of its range.
"""

from __future__ import annotations

import json
from collections import defaultdict
from functools import cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
GEN_ENGINES = ("hf", "ds-he", "vllm")


class Work(defaultdict):
    """feature -> amount; `w.add(other, times)` accumulates."""

    def __init__(self, items=None):
        super().__init__(float)
        for k, v in (items or {}).items():
            self[k] += v

    def add(self, other: dict, times: float = 1.0) -> Work:
        for k, v in other.items():
            self[k] += v * times
        return self

    def scaled(self, times: float) -> Work:
        return Work({k: v * times for k, v in self.items()})


@cache
def coefficients(kind: str) -> dict[str, dict]:
    """{feature: {"value", "range", "from", "note"}} for a device class, from data/efficiency.json."""
    data = json.loads((DATA / "efficiency.json").read_text())
    if kind not in data["classes"]:
        raise ValueError(f"no time coefficients for device class {kind!r}")
    return data["classes"][kind]


def seconds(work: dict, kind: str, end: str = "value", coef: dict | None = None) -> float:
    """Time of `work` with each coefficient's value, or its `low` / `high` end (fast / slow)."""
    table = coef or coefficients(kind)
    total = 0.0
    for feature, amount in work.items():
        if not amount:
            continue
        entry = table.get(feature)
        if entry is None:
            raise KeyError(f"no coefficient for feature {feature!r} ({kind})")
        if end == "value":
            c = entry["value"]
        else:
            lo, hi = entry.get("range", [entry["value"], entry["value"]])
            c = lo if end == "low" else hi
        total += amount * c
    return total


def breakdown(work: dict, kind: str) -> dict[str, float]:
    """Seconds per feature (which term dominates a phase)."""
    table = coefficients(kind)
    return {k: v * table[k]["value"] for k, v in work.items() if v}

