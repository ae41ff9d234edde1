"""Rollout correction: importance weights pi_train / pi_rollout for tokens another engine (vLLM,
SGLang) sampled, and a rejection mask, `rollout_correction` (formulas and the peers' conventions:
reference.rollout_correction, docs/ops.md).

x = old_logp - rollout_logp per token; the level's log-ratio L is x (token), sum_t m x (sequence) or
mean_t m x (geometric); the weight is exp(clamp(L)) truncated to [low, high] ("truncate") or zeroed
where the unit's gate statistic leaves [low, high] ("mask"); verl's rejection criteria make `keep`.

No Triton kernel: the op is a handful of elementwise passes and row reductions over [B, T] plus
~60 scalar metrics, all memory-bound torch ops without a host sync (no boolean indexing, no
`.item()`, no data-dependent branch): a fused kernel would save launches but not bytes, and the
metrics would still be torch ops. Custom op: fastrlhf::rollout_correction -> (weights, keep,
metric values in `metric_names` order). No gradient: the weights are constants of the loss.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch
from torch import Tensor

from fastrlhf.constants import (
    BATCH_NORMALIZE_MIN,
    CORRECTION_GATES,
    CORRECTION_LEVELS,
    CORRECTION_MISSING,
    CORRECTION_MODES,
    CORRECTION_WEIGHTS,
    GATE_PROB_CLAMP,
    IS_ESS_EPS,
    LOG_RATIO_CLAMP,
    REJECTION_CRITERIA,
)
from fastrlhf.ops._common import check_choice, check_float, check_mask, check_number, check_same, out_dtype

OFFPOLICY_METRICS = ("training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl",
                     "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio",
                     "chi2_token", "chi2_seq", "sampling_logp_difference_mean", "sampling_logp_difference_max")
IS_METRICS = ("rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_ratio_fraction_high",
              "rollout_is_ratio_fraction_low", "rollout_is_std", "rollout_is_eff_sample_size", "rollout_is_seq_mean",
              "rollout_is_seq_std", "rollout_is_seq_max", "rollout_is_seq_min", "rollout_is_seq_max_deviation",
              "rollout_is_seq_fraction_high", "rollout_is_seq_fraction_low", "importance_sampling_ratio_min",
              "importance_sampling_ratio_mean", "importance_sampling_ratio_max", "is_filtered_fraction")
RS_METRICS = ("mean", "max", "min", "fraction_high", "fraction_low", "std", "seq_mean", "seq_std", "seq_max",
              "seq_min", "seq_max_deviation", "seq_fraction_high")


class Correction(NamedTuple):
    """The checked settings (the public function's docstring); reject: ((criterion, lower, upper), ...)
    with k1 bounds as log-ratio bounds and lower = None for the other criteria."""

    level: str | None
    mode: str
    low: float | None
    high: float | None
    gate: str
    weight: str
    log_ratio_min: float | None
    log_ratio_max: float | None
    ignore_missing: bool
    batch_normalize: bool
    reject: tuple


def metric_names(c: Correction) -> tuple[str, ...]:
    """The metrics' names in the order the op returns them."""
    names = list(OFFPOLICY_METRICS)
    for name, lower, _ in c.reject:
        prefix = f"rollout_rs_{name}"
        names += [f"{prefix}_{k}" for k in RS_METRICS]
        names += [f"{prefix}_seq_fraction_low"] if lower is not None else []
        names += [f"{prefix}_masked_fraction", f"{prefix}_seq_masked_fraction"]
    if c.reject:
        names += ["rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"]
    if c.level is not None:
        names += list(IS_METRICS)
        names += ["rollout_is_oob_ratio"] if c.mode == "mask" else []
        names += ["rollout_is_batch_norm_factor"] if c.batch_normalize else []
    return tuple(names)


# ---------------------------------------------------------------- sync-free masked reductions


class Mask(NamedTuple):
    """A [B, T] mask and what every reduction needs of it (m in the math dtype)."""

    m: Tensor
    selected: Tensor
    n: Tensor  # sum of m
    n_rows: Tensor  # [B] per-row sums
    nonempty: Tensor  # [B] bool
    n_nonempty: Tensor  # rows with a token


def _mask(mask: Tensor, dtype: torch.dtype) -> Mask:
    m = mask.to(dtype)
    n_rows = m.sum(-1)
    nonempty = n_rows > 0
    return Mask(m, mask != 0, n_rows.sum(), n_rows, nonempty, nonempty.to(dtype).sum())


def _zero(x: Tensor) -> Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def _masked(x: Tensor, k: Mask) -> Tensor:
    """x m, exactly 0 where mask = 0."""
    return torch.where(k.selected, x * k.m, _zero(x))


def _mean(x: Tensor, k: Mask) -> Tensor:
    """Masked mean over the tokens, 0 for an empty mask."""
    return _masked(x, k).sum() / k.n.clamp(min=1)


def _frac(flags: Tensor, k: Mask) -> Tensor:
    return _mean(flags.to(k.m.dtype), k)


def _row_means(x: Tensor, k: Mask) -> Tensor:
    """[B] per-row masked means, 0 for an empty row."""
    return _masked(x, k).sum(-1) / k.n_rows.clamp(min=1)


def _extreme(x: Tensor, where: Tensor, count: Tensor, largest: bool) -> Tensor:
    """max / min of x over `where` (any shape), 0 when count == 0."""
    fill = -math.inf if largest else math.inf
    filled = torch.where(where, x, torch.full((), fill, dtype=x.dtype, device=x.device))
    value = filled.amax() if largest else filled.amin()
    return torch.where(count > 0, value, _zero(x))


def _rows_mean(v: Tensor, k: Mask) -> Tensor:
    """Mean of the per-row values v [B] over the rows with a token (0 when none)."""
    return torch.where(k.nonempty, v, _zero(v)).sum() / k.n_nonempty.clamp(min=1)


def _rows_std(v: Tensor, k: Mask) -> Tensor:
    """Unbiased std of v [B] over the rows with a token; 0 for fewer than two."""
    dev = torch.where(k.nonempty, v - _rows_mean(v, k), _zero(v))
    var = (dev * dev).sum() / (k.n_nonempty - 1).clamp(min=1)
    return torch.where(k.n_nonempty > 1, var.sqrt(), _zero(v))


def _std_of_clipped(v: Tensor, k: Mask, lo: float, hi: float) -> Tensor:
    """verl's std: sqrt(max(mean(c^2) - mean(c)^2, 0)) of c = clamp(v, lo, hi), 0 for n <= 1."""
    c = torch.clamp(v, lo, hi)
    mean = _mean(c, k)
    std = torch.clamp(_mean(c * c, k) - mean * mean, min=0.0).sqrt()
    return torch.where(k.n > 1, std, _zero(v))


# ---------------------------------------------------------------- the metric groups


def _offpolicy(train: Tensor, rollout: Tensor, k: Mask) -> list[Tensor]:
    """OFFPOLICY_METRICS (reference.offpolicy_metrics, trl_sampling_metrics)."""
    x = train - rollout
    train_rows, rollout_rows = _row_means(train, k), _row_means(rollout, k)
    diff = rollout_rows - train_rows
    rho = torch.exp(torch.clamp(x, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    seq = torch.clamp(_masked(x, k).sum(-1), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    delta = torch.abs(x)
    counted = k.selected & ~torch.isnan(delta)
    n_counted = counted.sum()
    delta_sum = torch.where(counted, delta, _zero(delta)).sum()
    return [torch.exp(-train_rows).mean(), (-train_rows).mean(), _mean(-x, k), _mean(torch.exp(x) - x - 1, k),
            torch.exp(-rollout_rows).mean(), (-rollout_rows).mean(), diff.mean(), diff.abs().mean(), diff.amax(),
            diff.amin(), torch.exp(diff).mean(), _mean(rho * rho, k) - 1.0, torch.exp(2.0 * seq).mean() - 1.0,
            delta_sum / n_counted.clamp(min=1), _extreme(delta, counted, n_counted, True)]


def _clamp(x: Tensor, lo: float | None, hi: float | None) -> Tensor:
    return x if lo is None and hi is None else torch.clamp(x, lo, hi)


def _divergence(x: Tensor, k_name: str) -> Tensor:
    c = torch.clamp(x, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {"k1": -c, "k2": 0.5 * c * c, "k3": torch.exp(c) - 1.0 - c}[k_name]


def _rejection(x: Tensor, k: Mask, reject: tuple) -> tuple[Tensor, list[Tensor]]:
    """(keep, the rollout_rs_* metrics) of reference._rejection."""
    keep = torch.ones_like(k.selected)
    out = []
    for name, lower, upper in reject:
        level, k_name = name.rsplit("_", 1)
        token = _divergence(x, k_name)
        if level == "token":
            per_row = None
            value = token
        else:
            if level == "seq_sum":
                per_row = _masked(token, k).sum(-1)
            elif level == "seq_mean":
                per_row = _row_means(token, k)
            else:
                per_row = _extreme_rows(token, k)
            value = per_row.unsqueeze(-1).expand_as(token)
        passes = value <= upper if lower is None else (value >= lower) & (value <= upper)
        keep = keep & passes
        out += _rs_metrics(value, per_row, k, lower, upper)
        out.append(_frac(~passes, k))
        rejected_row = ((~passes) & k.selected).any(-1) & k.nonempty
        out.append(rejected_row.to(x.dtype).sum() / k.n_nonempty.clamp(min=1))
    out += [_frac(~keep, k), ((~keep) & k.selected).any(-1).to(x.dtype).mean()]
    return keep & k.selected, out


def _extreme_rows(token: Tensor, k: Mask) -> Tensor:
    """[B] per-row max over the row's tokens, 0 for an empty row."""
    filled = torch.where(k.selected, token, torch.full((), -math.inf, dtype=token.dtype, device=token.device))
    return torch.where(k.nonempty, filled.amax(-1), _zero(token))


def _rs_metrics(value: Tensor, per_row: Tensor | None, k: Mask, lower: float | None, upper: float) -> list[Tensor]:
    """RS_METRICS (+ seq_fraction_low for k1) of one criterion, as reference._rs_metrics."""
    dtype = value.dtype
    rows = _row_means(value, k) if per_row is None else per_row
    on = k.nonempty
    count = k.n_nonempty
    row_max, row_min = _extreme(rows, on, count, True), _extreme(rows, on, count, False)
    token_max = _extreme(value, k.selected, k.n, True)
    token_min = _extreme(value, k.selected, k.n, False)
    on_rows = count > 0 if per_row is not None else torch.zeros((), dtype=torch.bool, device=value.device)

    def row_frac(flags):
        return _rows_mean(flags.to(dtype), k)

    high = torch.where(on_rows, row_frac(rows > upper), _frac(value > upper, k))
    if lower is None:
        low = _zero(value)
    else:
        low = torch.where(on_rows, row_frac(rows < lower), _frac(value < lower, k))
    out = [_mean(value, k), torch.where(on_rows, row_max, token_max), torch.where(on_rows, row_min, token_min), high,
           low, _std_of_clipped(value, k, 0.0 if lower is None else lower, upper), _rows_mean(rows, k),
           _rows_std(rows, k), row_max, row_min, _extreme(rows.abs(), on, count, True), row_frac(rows > upper)]
    if lower is not None:
        out.append(row_frac(rows < lower))
    return out


def _gate(old: Tensor, rollout: Tensor, x: Tensor, k: Mask, c: Correction) -> Tensor:
    """The gate statistic per token or per row ([B, 1]), as reference._gate_statistic."""
    if c.gate == "ratio":
        stat = x
    else:
        p = torch.exp(rollout).clamp(GATE_PROB_CLAMP, 1 - GATE_PROB_CLAMP)
        q = torch.exp(old).clamp(GATE_PROB_CLAMP, 1 - GATE_PROB_CLAMP)
        stat = p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q)) if c.gate == "binary_kl" else (p - q).abs()
    if c.level == "sequence":
        stat = _masked(stat, k).sum(-1, keepdim=True)
    elif c.level == "geometric":
        stat = _row_means(stat, k).unsqueeze(-1)
    return torch.exp(stat) if c.gate == "ratio" else stat


def _weights(old: Tensor, rollout: Tensor, x: Tensor, k: Mask, c: Correction) -> tuple[Tensor, list[Tensor]]:
    """(weights [B, T], the IS metrics) of reference.rollout_correction."""
    if c.level == "token":
        log_stat = x
    else:
        log_stat = _masked(x, k).sum(-1, keepdim=True)
        if c.level == "geometric":
            log_stat = log_stat / k.n_rows.clamp(min=1).unsqueeze(-1)
    unit = torch.exp(_clamp(log_stat, c.log_ratio_min, c.log_ratio_max))
    zero = _zero(x)
    raw = torch.where(k.selected, unit.expand_as(x), zero)
    lo, hi = -math.inf if c.low is None else c.low, math.inf if c.high is None else c.high
    if c.mode == "truncate":
        unit_w = torch.clamp(unit, c.low, c.high)
        filtered = (unit < lo) | (unit > hi)
    else:
        stat = _gate(old, rollout, x, k, c)
        in_band = (stat >= lo) & (stat <= hi)
        value = unit if c.weight == "level" else torch.exp(_clamp(x, c.log_ratio_min, c.log_ratio_max))
        unit_w = torch.where(in_band, value, zero)
        filtered = ~in_band
    weights = torch.where(k.selected, unit_w.expand_as(x), zero)
    metrics = _is_metrics(weights, raw, log_stat, k, c)
    metrics += _trl_ratio_metrics(weights, unit_w, k, c)
    if c.level == "token":
        metrics.append(_frac(filtered, k))
    else:
        metrics.append((filtered | ~k.nonempty.unsqueeze(-1)).to(x.dtype).mean())
    if c.mode == "mask":
        metrics.append(_frac((raw < (1.0 / hi if c.low is None else lo)) | (raw > hi), k))
    if c.batch_normalize:
        mean = _mean(weights, k) if c.level == "token" else _rows_mean(_row_means(weights, k), k)
        normalize = mean > BATCH_NORMALIZE_MIN
        weights = torch.where(normalize, weights / mean, weights)
        metrics.append(torch.where(normalize, mean, torch.ones_like(mean)))
    return weights, metrics


def _is_metrics(weights: Tensor, raw: Tensor, log_stat: Tensor, k: Mask, c: Correction) -> list[Tensor]:
    """IS_METRICS[:14] (reference._is_metrics)."""
    upper = math.inf if c.high is None else c.high
    lower = 1.0 / upper if c.low is None else c.low
    dtype = weights.dtype
    if c.level == "token":
        head = [_extreme(weights, k.selected, k.n, True), _extreme(weights, k.selected, k.n, False),
                _frac(raw > upper, k), _frac(raw < lower, k)]
    else:
        log_upper = math.log(upper) if upper > 0 else -math.inf
        log_lower = math.log(lower) if lower > 0 else -math.inf
        head = [torch.exp(torch.clamp(log_stat.amax(), max=LOG_RATIO_CLAMP)), torch.exp(log_stat.amin()),
                (log_stat > log_upper).to(dtype).mean(), (log_stat < log_lower).to(dtype).mean()]
    clipped = torch.clamp(weights, 0.0, upper)
    mean = _mean(clipped, k)
    normalized = clipped / (mean + IS_ESS_EPS)
    per_row = _row_means(weights, k)
    raw_rows = _row_means(raw, k)
    std_rows = per_row.std() if per_row.numel() > 1 else _zero(per_row)
    ess = torch.where(k.n > 0, 1.0 / _mean(normalized * normalized, k), _zero(weights))
    return [_mean(weights, k), *head, _std_of_clipped(weights, k, 0.0, upper), ess,
            per_row.mean(), std_rows, per_row.amax(), per_row.amin(), (per_row - 1.0).abs().amax(),
            (raw_rows > upper).to(dtype).mean(), (raw_rows < lower).to(dtype).mean()]


def _trl_ratio_metrics(weights: Tensor, unit_w: Tensor, k: Mask, c: Correction) -> list[Tensor]:
    """importance_sampling_ratio_min / _mean / _max (reference.trl_ratio_metrics)."""
    if unit_w.shape[-1] != 1 or c.level == "token":
        return [_extreme(weights, k.selected, k.n, False), _mean(weights, k), _extreme(weights, k.selected, k.n, True)]
    return [unit_w.amin(), unit_w.mean(), unit_w.amax()]


def _correction_torch(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, c: Correction):
    dtype = out_dtype(old_logp)
    old, rollout = old_logp.to(dtype), rollout_logp.to(dtype)
    k = _mask(mask, dtype)
    x = old - rollout
    if c.ignore_missing:
        x = torch.where(torch.isnan(x), _zero(x), x)
    metrics = _offpolicy(old, rollout, k)
    keep = k.selected
    if c.reject:
        keep, rs = _rejection(x, k, c.reject)
        metrics += rs
    weights = None
    if c.level is not None:
        weights, is_metrics = _weights(old, rollout, x, k, c)
        metrics += is_metrics
    return weights, keep, torch.stack(metrics)


# ---------------------------------------------------------------- fastrlhf::rollout_correction


@torch.library.custom_op("fastrlhf::rollout_correction", mutates_args=())
def _rollout_correction_op(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, level: str, mode: str,
                           low: float | None, high: float | None, gate: str, weight: str, log_ratio_min: float | None,
                           log_ratio_max: float | None, ignore_missing: bool, batch_normalize: bool,
                           reject_criteria: list[int], reject_lower: list[float],
                           reject_upper: list[float]) -> tuple[Tensor, Tensor, Tensor]:
    """[B, T] inputs -> (weights [B, T] ([0] for level ""), keep [B, T] bool, metrics [len(metric_names)]);
    reject_criteria index REJECTION_CRITERIA (the schema takes no list of strings)."""
    c = _unflatten(level, mode, low, high, gate, weight, log_ratio_min, log_ratio_max, ignore_missing,
                   batch_normalize, reject_criteria, reject_lower, reject_upper)
    weights, keep, metrics = _correction_torch(old_logp, rollout_logp, mask, c)
    return (old_logp.new_empty(0, dtype=out_dtype(old_logp)) if weights is None else weights), keep, metrics


@_rollout_correction_op.register_fake
def _(old_logp, rollout_logp, mask, level, mode, low, high, gate, weight, log_ratio_min, log_ratio_max,
      ignore_missing, batch_normalize, reject_criteria, reject_lower, reject_upper):
    c = _unflatten(level, mode, low, high, gate, weight, log_ratio_min, log_ratio_max, ignore_missing,
                   batch_normalize, reject_criteria, reject_lower, reject_upper)
    dtype = out_dtype(old_logp)
    weights = old_logp.new_empty(old_logp.shape if c.level is not None else (0,), dtype=dtype)
    return weights, old_logp.new_empty(old_logp.shape, dtype=torch.bool), old_logp.new_empty(
        len(metric_names(c)), dtype=dtype)


def _unflatten(level, mode, low, high, gate, weight, log_ratio_min, log_ratio_max, ignore_missing, batch_normalize,
               reject_criteria, reject_lower, reject_upper) -> Correction:
    """The Correction from the custom op's flat arguments (level "" is None; a NaN lower is None)."""
    reject = tuple((REJECTION_CRITERIA[i], None if math.isnan(lo) else lo, up)
                   for i, lo, up in zip(reject_criteria, reject_lower, reject_upper))
    return Correction(level or None, mode, low, high, gate, weight, log_ratio_min, log_ratio_max, ignore_missing,
                      batch_normalize, reject)


def _check_reject(reject) -> tuple:
    """verl's rejection criteria {name: threshold} as ((name, lower, upper), ...), k1 bounds in log space."""
    if not reject:
        return ()
    if not isinstance(reject, dict):
        raise TypeError(f"reject must be a dict {{criterion: threshold}}, got {type(reject).__name__}")
    out = []
    for name, threshold in reject.items():
        check_choice("reject criterion", name, REJECTION_CRITERIA)
        if name.endswith("k1"):
            if isinstance(threshold, numbers.Real):
                upper = check_number(f"reject[{name!r}]", threshold, positive=True)
                lower = 1.0 / upper
            elif isinstance(threshold, (tuple, list)) and len(threshold) == 2:
                lower = check_number(f"reject[{name!r}] lower", threshold[0], positive=True)
                upper = check_number(f"reject[{name!r}] upper", threshold[1], positive=True)
            else:
                raise ValueError(f"reject[{name!r}] must be a ratio bound u > 0 (meaning [1/u, u]) or (lower, upper), "
                                 f"got {threshold!r}")
            if lower > upper:
                raise ValueError(f"reject[{name!r}]: lower {lower} > upper {upper}")
            out.append((name, math.log(lower), math.log(upper)))
        else:
            out.append((name, None, check_number(f"reject[{name!r}]", threshold, positive=True)))
    return tuple(out)


def _check_log_ratio_clamp(bounds) -> tuple[float | None, float | None]:
    if bounds is None:
        return None, None
    if isinstance(bounds, numbers.Real) and not isinstance(bounds, bool):
        c = check_number("log_ratio_clamp", bounds, positive=True)
        return -c, c
    if isinstance(bounds, (tuple, list)) and len(bounds) == 2:
        lo, hi = (None if b is None else check_number("log_ratio_clamp", b) for b in bounds)
        return lo, hi
    raise ValueError(f"log_ratio_clamp must be None, c > 0 or (lo, hi), got {bounds!r}")


def rollout_correction(old_logp, rollout_logp, mask, *, level="token", mode="truncate", low=None, high=2.0,
                       gate="ratio", weight="level", log_ratio_clamp=LOG_RATIO_CLAMP, missing="propagate",
                       batch_normalize=False, reject=None):
    """Importance weights pi_train / pi_rollout for tokens sampled by another engine than the trainer,
    and a rejection mask (docs/ops.md; the conventions of verl, OpenRLHF and TRL as options).

    Args:
        old_logp: [B, T] float, the trainer's log-probs of the sampled tokens (no gradient is taken).
        rollout_logp: [B, T] float, the sampler's log-probs of the same tokens.
        mask: [B, T] bool/int/float; non-zero = a response token.
        level: the weight's unit: "token" (each token's ratio), "sequence" (the product over the
            sequence: verl's and TRL's sequence level), "geometric" (its per-token geometric mean:
            OpenRLHF's seq gate), or None for no weights (rejection and metrics only).
        mode: "truncate" (clamp the weight into [low, high]: verl's TIS with high only, TRL's *_truncate,
            OpenRLHF's clip) or "mask" (a unit whose gate statistic leaves [low, high] gets weight 0:
            verl's IcePop "low_high", TRL's *_mask, OpenRLHF's mask).
        low, high: the bounds, None for an open side (truncate needs one of them).
        gate: mask mode's statistic: "ratio" (the unit's ratio), "binary_kl" or "tv" (OpenRLHF's divergence
            of the sampled token's two probabilities, summed / averaged per row at the row levels).
        weight: mask mode's weight of a kept unit: "level" (the unit's ratio) or "token" (each token its
            own ratio: OpenRLHF's seq level).
        log_ratio_clamp: None, c (to [-c, c]) or (lo, hi) on the unit's log-ratio before exp: verl's 20;
            None for OpenRLHF and TRL.
        missing: "propagate" (a NaN sampler log-prob gives NaN) or "ignore" (its log-ratio counts as 0:
            TRL, whose vLLM cannot score every token).
        batch_normalize: divide the weights by their mean (over the tokens; over the non-empty rows' means
            at the row levels) when that is > 1e-8 (verl's rollout_is_batch_normalize).
        reject: verl's rejection sampling, {criterion: threshold} with criterion one of token_k1/k2/k3,
            seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3 (k1 = -x, k2 = x^2 / 2, k3 = exp(x) - 1 - x
            of the +-20-clamped log-ratio x; a k1 threshold is a ratio bound u, meaning [1/u, u], or
            (lower, upper); the others an upper bound); a token or row failing any is rejected.

    Returns:
        (weights, keep, metrics): weights [B, T] float32 (float64 for float64 inputs), 0 where mask = 0,
        or None for level=None; keep [B, T] bool, mask != 0 and not rejected (verl's modified
        response_mask); metrics {name: 0-dim tensor}, named as verl's rollout_corr/* without the prefix
        plus is_filtered_fraction (OpenRLHF) and sampling_* / importance_sampling_ratio_* (TRL): see
        `metric_names`. An empty mask gives zero weights and zero metrics (verl raises).
    """
    check_float("old_logp", old_logp)
    if old_logp.dim() != 2:
        raise ValueError(f"old_logp must be [B, T], got shape {tuple(old_logp.shape)}")
    check_same("old_logp", old_logp, rollout_logp=rollout_logp)
    check_mask(mask, old_logp, "old_logp")
    if level is not None:
        check_choice("level", level, CORRECTION_LEVELS)
    check_choice("mode", mode, CORRECTION_MODES)
    check_choice("gate", gate, CORRECTION_GATES)
    check_choice("weight", weight, CORRECTION_WEIGHTS)
    check_choice("missing", missing, CORRECTION_MISSING)
    low = None if low is None else check_number("low", low, nonnegative=True)
    high = None if high is None else check_number("high", high, positive=True)
    if low is not None and high is not None and low > high:
        raise ValueError(f"low ({low}) must be <= high ({high})")
    if level is not None and mode == "truncate" and low is None and high is None:
        raise ValueError("mode='truncate' needs low or high (or both)")
    if mode == "truncate" and (gate != "ratio" or weight != "level"):
        raise ValueError("gate and weight apply to mode='mask' only: a truncated weight is the unit's own ratio")
    log_ratio_min, log_ratio_max = _check_log_ratio_clamp(log_ratio_clamp)
    c = Correction(level, mode, low, high, gate, weight, log_ratio_min, log_ratio_max, missing == "ignore",
                   bool(batch_normalize), _check_reject(reject))
    criteria = [REJECTION_CRITERIA.index(r[0]) for r in c.reject]
    lower = [math.nan if r[1] is None else r[1] for r in c.reject]
    upper = [r[2] for r in c.reject]
    weights, keep, values = _rollout_correction_op(
        old_logp.detach(), rollout_logp.detach(), mask, level or "", mode, low, high, gate, weight, log_ratio_min,
        log_ratio_max, c.ignore_missing, c.batch_normalize, criteria, lower, upper)
    return (None if level is None else weights), keep, dict(zip(metric_names(c), values.unbind()))
