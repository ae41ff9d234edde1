"""The speed and memory targets (issues 13, 23, 24 and 30), each a ratio of two figures measured in the same run.

Issue 24's: the gspo, cispo and clip_cov modes of ppo_actor_loss from logits at [16 x 1024 x 151936] bf16,
forward + backward, at most 1.1x the vanilla mode's time.

Issue 23's: every [B, T] op's forward at [1024 x 4096] at >= 0.7 of the roofline in GPU time (host hidden,
`median_ms`), and every op with a peer, at every shape of the `targets` set and every pass, no slower in
wall time (`wall_ms`: back to back, host and GPU together) than the fastest peer measured.

A target is judged (`met` true or false) only on CUDA at its own shape and dtype; elsewhere
its value is still computed from the closest case measured, for information, with `met` None.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from fastrlhf.bench.cases import GRID_TARGET, LINEAR_TARGET, LOGITS_TARGET, LOGITS_TARGET_50K, cases
from fastrlhf.bench.measure import GIB
from fastrlhf.bench.providers import MODE_PROVIDERS, PEERS, TABLE, WEIGHT_ACCUM

GRID_OPS = ("token_kl", "kl_shaped_rewards", "gae", "policy_loss", "value_loss")  # the [B, T] ops


@dataclass(frozen=True)
class Target:
    name: str
    goal: str  # ">= x" or "<= x"
    rule: Callable  # (row, rows, probes) -> (value or None, detail)
    op: str
    pass_: str
    dims: dict
    provider: str = "fastrlhf"
    dtype: str = "bfloat16"


def _find(rows, op, pass_, provider, dims, dtype) -> dict | None:
    """The row for (op, pass, provider) at `dims`/`dtype` if measured, else the largest case of
    that op (preferring the dtype)."""
    match = [r for r in rows if (r["op"], r["pass"], r["provider"]) == (op, pass_, provider)]
    exact = [r for r in match if r["dims"] == dims and r["dtype"] == dtype]
    if exact:
        return exact[0]
    return max(match, key=lambda r: (r["dtype"] == dtype, math.prod(r["dims"].values())), default=None)


def same_case(rows, row, op, pass_, provider) -> dict | None:
    """The row of (op, pass, provider) at `row`'s dims and dtype."""
    return next((r for r in rows if (r["op"], r["pass"], r["provider"]) == (op, pass_, provider)
                 and r["dims"] == row["dims"] and r["dtype"] == row["dtype"]), None)


def _time_over(op, pass_, provider, *, speedup=False):
    """Rule: the row's time over `provider`'s time at the same case, or with `speedup` the
    inverse (how many times faster the row is)."""

    def rule(row, rows, probes):
        other = same_case(rows, row, op, pass_, provider)
        if other is None:
            return None, f"no {provider} {op} {pass_} row at this case"
        num, den = (other, row) if speedup else (row, other)
        return num["median_ms"] / den["median_ms"], f"{num['median_ms']:.4g} ms / {den['median_ms']:.4g} ms"

    return rule


def _probe_fraction(probe):
    """Rule: the row's GB/s over the `probe` ("read" or "copy") GB/s of the same run."""

    def rule(row, rows, probes):
        return row["gbps"] / probes[f"{probe}_gbps"], f"{row['gbps']:.0f} / {probes[f'{probe}_gbps']:.0f} GB/s"

    return rule


def _roofline(row, rows, probes):
    """Rule: the row's roofline fraction (ideal time from the probes / GPU time, host hidden)."""
    if row.get("roofline") is None:
        return None, "no roofline in this row"
    return row["roofline"], f"{row['median_ms']:.4g} ms GPU time, {row.get('gbps', 0):.0f} GB/s"


def _wall(row) -> float:
    return row.get("wall_ms") or row["median_ms"]


def _vs_fastest_peer(row, rows, probes):
    """Rule: the row's wall time over the fastest peer's at the same case and pass."""
    measured = [r for r in (same_case(rows, row, row["op"], row["pass"], p) for p in PEERS) if r is not None]
    if not measured:
        return None, "no peer measured at this case"
    best = min(measured, key=_wall)
    return _wall(row) / _wall(best), f"{_wall(row):.4g} ms / {best['provider']} {_wall(best):.4g} ms (wall)"


def _extra_peak_gib(row, rows, probes):
    """Rule: peak memory beyond the inputs and the returned gradients, in GiB."""
    if row.get("extra_peak_bytes") is None:
        return None, "no peak memory on this device"
    return row["extra_peak_bytes"] / GIB, (f"peak {row['peak_mem_bytes'] / GIB:.3f} GiB - returned gradients "
                                           f"{row['grad_bytes'] / GIB:.3f} GiB")


def _targets() -> list[Target]:
    out = []
    for dims in (LOGITS_TARGET, LOGITS_TARGET_50K):
        v = f"V={dims['V']}"
        out += [Target(f"logprobs fwd / read probe, {v}", ">= 0.93", _probe_fraction("read"),
                       "logprobs", "fwd", dims),
                Target(f"logprobs bwd / copy probe, {v}", ">= 0.90", _probe_fraction("copy"),
                       "logprobs", "bwd", dims)]
    out.append(Target("ppo_actor_loss fwd+bwd / logprobs fwd+bwd", "<= 0.75",
                      _time_over("logprobs", "fwd+bwd", "fastrlhf"), "ppo_actor_loss", "fwd+bwd", LOGITS_TARGET))
    over_vanilla = _time_over("ppo_actor_loss", "fwd+bwd", "fastrlhf")
    out += [Target(f"ppo_actor_loss fwd+bwd {mode} / vanilla", "<= 1.1", over_vanilla, "ppo_actor_loss", "fwd+bwd",
                   LOGITS_TARGET, provider) for mode, provider in MODE_PROVIDERS.items()]
    for provider in ("fastrlhf", WEIGHT_ACCUM):
        suffix = "" if provider == "fastrlhf" else f", {provider}"
        for op, bound in (("linear_ppo_actor_loss", "<= 1.15"), ("linear_logprobs", "<= 1.40")):
            out += [Target(f"{op} fwd+bwd / 3 bare matmuls{suffix}", bound, _time_over(op, "fwd+bwd", "matmuls"),
                           op, "fwd+bwd", LINEAR_TARGET, provider),
                    Target(f"{op} fwd+bwd extra peak (GiB){suffix}", "<= 1.0", _extra_peak_gib,
                           op, "fwd+bwd", LINEAR_TARGET, provider)]
    out += [Target(f"linear_distill_loss fwd+bwd / 4 bare matmuls{'' if p == 'fastrlhf' else f', {p}'}", "<= 1.15",
                   _time_over("linear_distill_loss", "fwd+bwd", "matmuls"), "linear_distill_loss", "fwd+bwd",
                   LINEAR_TARGET, p) for p in ("fastrlhf", WEIGHT_ACCUM)]  # issue 30 (beta 0.5, every row valid)
    out += [Target("gae speed-up over the Python loop over T", ">= 1000",
                   _time_over("gae", "fwd", "torch", speedup=True), "gae", "fwd", GRID_TARGET, dtype="float32"),
            Target("gae speed-up over verl compute_gae_advantage_return", ">= 50",
                   _time_over("gae", "fwd", "verl", speedup=True), "gae", "fwd", GRID_TARGET, dtype="float32")]
    out += [Target(f"{op} fwd GPU time / roofline, B=1024 T=4096", ">= 0.7", _roofline, op, "fwd", GRID_TARGET,
                   dtype="float32") for op in GRID_OPS]
    for case in cases("targets"):
        if any(p in TABLE[case.op] for p in PEERS):
            out += [Target(f"{case.op} {p} {case.shape} {case.dtype_name}: wall time / fastest peer", "<= 1.0",
                           _vs_fastest_peer, case.op, p, case.dims, dtype=case.dtype_name) for p in case.passes]
    return out


TARGETS = _targets()


def targets(rows: list[dict], probes: dict, kind: str) -> list[dict]:
    """Every target's value from this run's rows and probes (`kind`: "cuda" or "cpu")."""
    out = []
    for t in TARGETS:
        row = _find(rows, t.op, t.pass_, t.provider, t.dims, t.dtype)
        value, detail = (None, "case not measured in this run") if row is None else t.rule(row, rows, probes)
        entry = {"name": t.name, "goal": t.goal, "value": value, "met": None, "detail": detail,
                 "case": None, "at_target": False}
        if row is not None:
            at_target = row["dims"] == t.dims and row["dtype"] == t.dtype
            entry |= {"case": f"{row['op']} {row['shape']} {row['dtype']}", "at_target": at_target}
            if value is not None and at_target and kind == "cuda":
                bound = float(t.goal.split()[1])
                entry["met"] = value >= bound if t.goal.startswith(">=") else value <= bound
            elif not at_target:
                entry["detail"] += " (not the target shape)"
        out.append(entry)
    return out
