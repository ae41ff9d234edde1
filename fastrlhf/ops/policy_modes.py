"""The policy-loss family's per-token math with its gradients written out: what policy_loss /
ppo_actor_loss run for `loss_mode=` on the torch path, and what the Triton kernels mirror.
Formulas and the peers each follows: reference.POLICY_LOSSES and docs/ops.md.

Every mode is a sum L = sum_bt w_bt l_bt with w = the aggregation's row scale x mask x is_weights
(detached; geo_mean takes is_weights into its row loss instead), so that

    dL/dlogp_bt = w_bt a_bt + dS_bt sum_t' w_bt' e_bt'

a_bt = d l_bt / d logp_bt is the token's own derivative. Two modes also depend on a per-row
statistic S_b of every token's log-prob: "gspo" / "luspo" (S_b = the row's mean log-ratio, the
gradient through the mean, as OpenRLHF's and TRL's sequence level) and "geo_mean" (S_b = the row's
mean clipped log-ratio); for them e_bt = d l_bt / d S_b and dS_bt = d S_b / d logp_bt. Their
cost on [B, T] is one extra pass: the row reduction for S_b before the per-token pass, whose row
sums of w e ride along in the same pass; the gradient is then elementwise. Nothing here reads the
logits, so from logits the extra pass is over [B, T], never over [B, T, V].

Ties (reference.py's rules, written out here, never left to autograd):
- a clamp passes the gradient on its closed interval: the log-ratio clamp at exactly its bounds,
  the ratio clip at exactly 1 - clip_low / 1 + clip_high, TRL's delta at exactly delta;
- max(l1, l2) at l1 == l2 and min(l, -A c) at l == -A c: the unclipped term's gradient;
- |x| at 0 (kl_cov): 0; geo_mean's sign-side clip at x == clip_high (A > 0) / -clip_low (A < 0):
  the gradient passes (the value is x itself); A == 0: no gradient (its term is 0).
Tokens with mask = 0 add exactly 0 to the loss, the row sums and the gradient, whatever (NaN, inf)
their inputs hold.

Selections that need the whole batch (clip_cov's random draw, kl_cov's top-k by covariance) are made
by clip_cov_dropped / kl_cov_chosen and passed in as `selected`; they sync with the host (a count of
candidates), as the peers' own do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from fastrlhf import reference as ref
from fastrlhf.constants import (
    DPPO_BINARY_KL_EPS,
    GEO_MEAN_IS_EPS,
    LOG_RATIO_CLAMP,
    RATIO_LEVELS,
    VESPO_LAMBDA_MIN,
    VESPO_LOG_W_MIN,
)
from fastrlhf.ops._common import check_choice, check_number


class ModeSpec(NamedTuple):
    """One policy-loss mode and its options (make_spec fills each mode's defaults and checks them).
    The log-ratio clamp is [log_ratio_min, log_ratio_max], None for an open side."""

    mode: str = "vanilla"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None  # vanilla / ppo / gspo*: c > 1 bounds the loss at -A c for A < 0
    delta: float | None = None  # TRL's two-sided clip: the unclipped ratio at most delta
    ratio_level: str = "token"  # token / sequence / sequence_token (reference.importance_ratio)
    log_ratio_min: float | None = None
    log_ratio_max: float | None = None
    ratio_max: float | None = None  # cispo: TRL's absolute bound (else [1 - low, 1 + high]); dppo: truncation
    tau_pos: float = 1.0  # sapo
    tau_neg: float = 1.05
    beta: float | None = None  # dro
    ppo_kl_coef: float = 1.0  # kl_cov
    k_pos: float = 2.0  # vespo
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0


class Terms(NamedTuple):
    """A mode's per-token results, all [B, T]: loss l, its own derivative a (None: 0), the row
    coefficient e and dS (None for token-local modes), and the per-token values the stats average."""

    loss: Tensor
    local: Tensor | None
    row_coef: Tensor | None
    row_grad: Tensor | None
    flags: dict


MODES: dict[str, Callable] = {}
# each name's defaults where they differ from ModeSpec's (the peers' own, reference.POLICY_LOSSES)
DEFAULTS: dict[str, dict] = {}
# modes whose is_weights enter the row loss (geo_mean: the geometric mean over the sequence), not w
ROW_IS_WEIGHTS = ("geo_mean",)
# modes that aggregate one loss per sequence: w = row_scale x mask with "seq-mean-token-mean" over all B rows
ROW_LOSS = ("geo_mean",)


def register_mode(*names, **defaults):
    """Decorator: MODES[name] = fn (fn(x: Inputs, spec) -> Terms) with its defaults; a name once."""

    def decorator(fn):
        for name in names:
            if name in MODES:
                raise ValueError(f"policy-loss mode {name!r} is already registered ({MODES[name].__name__})")
            MODES[name], DEFAULTS[name] = fn, defaults
        return fn

    return decorator


class Inputs(NamedTuple):
    """The per-token inputs of a mode, [B, T] in one float dtype; the optional ones None."""

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    mask: Tensor
    is_weights: Tensor | None = None  # only the ROW_IS_WEIGHTS modes read them here
    sampler_weights: Tensor | None = None  # vespo: the sampler correction enters its gamma weight
    selected: Tensor | None = None  # clip_cov's dropped / kl_cov's chosen tokens (bool)


# ---------------------------------------------------------------- shared pieces


def _selected(m: Tensor) -> Tensor:
    return m != 0


def _zero_off(x: Tensor, m: Tensor) -> Tensor:
    """x where mask != 0, exactly 0 elsewhere (even where x is NaN or inf)."""
    return torch.where(_selected(m), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _row_mean(x: Tensor, m: Tensor) -> Tensor:
    """[B, 1]: sum_t m x / max(n_b, 1) (0 for an empty row): the one extra pass over [B, T]."""
    return (_zero_off(x * m, m)).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)


def _clamp_log_ratio(x: Tensor, spec: ModeSpec) -> tuple[Tensor, Tensor]:
    """(clamp(x, min, max), its derivative: 1 on the closed interval, 0 outside)."""
    lo, hi = spec.log_ratio_min, spec.log_ratio_max
    inside = torch.ones_like(x, dtype=torch.bool)
    if lo is not None:
        inside = inside & (x >= lo)
    if hi is not None:
        inside = inside & (x <= hi)
    return (x if lo is None and hi is None else torch.clamp(x, lo, hi)), inside.to(x.dtype)


class Ratio(NamedTuple):
    """The policy ratio at spec.ratio_level, [B, T]: value r, dr/dlogp_t of the token's own log-prob
    (token, sequence_token) or dr/dS_b (sequence: r = exp(clamp(S_b)), S_b the row mean, dS_bt = m_t /
    max(n_b, 1)), and the per-token log-ratio the stats average (approx_kl)."""

    value: Tensor
    d_own: Tensor | None
    d_row: Tensor | None
    row_grad: Tensor | None
    stat_log_ratio: Tensor


def ratio(x: Inputs, spec: ModeSpec) -> Ratio:
    diff = x.logp - x.old_logp
    if spec.ratio_level == "token":
        log_ratio, inside = _clamp_log_ratio(diff, spec)
        r = torch.exp(log_ratio)
        return Ratio(r, r * inside, None, None, log_ratio)
    log_ratio, inside = _clamp_log_ratio(_row_mean(diff, x.mask).expand_as(diff), spec)
    r = torch.exp(log_ratio)
    if spec.ratio_level == "sequence_token":  # value of the row, gradient of the token's own log-prob
        return Ratio(r, r * inside, None, None, diff)
    n = x.mask.sum(-1, keepdim=True).clamp(min=1)
    return Ratio(r, None, r * inside, x.mask / n, diff)


def _by_ratio(rt: Ratio, d_loss_d_ratio: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(local, row_coef, row_grad) of a loss whose derivative w.r.t. the ratio is d_loss_d_ratio."""
    if rt.d_own is not None:
        return d_loss_d_ratio * rt.d_own, None, None
    return None, d_loss_d_ratio * rt.d_row, rt.row_grad


def _stat_flags(x: Inputs, log_ratio: Tensor, **flags) -> dict:
    """The per-token values of the stats: the flags (None: 0), approx_kl, approx_kl_unclamped."""
    out = {k: torch.zeros_like(x.logp) if v is None else v.to(x.logp.dtype) for k, v in flags.items()}
    out["approx_kl"] = -log_ratio
    out["approx_kl_unclamped"] = x.old_logp - x.logp
    return out


def _band(r: Tensor, lo: float | None, hi: float | None) -> Tensor:
    """1 where lo <= r <= hi (closed; None: open), else 0: a clamp's derivative."""
    inside = torch.ones_like(r, dtype=torch.bool)
    if lo is not None:
        inside = inside & (r >= lo)
    if hi is not None:
        inside = inside & (r <= hi)
    return inside.to(r.dtype)


# ---------------------------------------------------------------- the modes


def _surrogate(x: Inputs, spec: ModeSpec, rt: Ratio):
    """The clipped surrogate of the ratio rt: (l, dl/dr, clipped [l2 > l1], lower or None).
    l1 = -A min(r, delta), l2 = -A clamp(r, 1 - low, 1 + high), l = max(l1, l2), dual-clip
    min(l, -A c) for A < 0. dl/dr: where l2 > l1, -A [1 - low <= r <= 1 + high]; else -A [r <= delta];
    0 where dual-clipped (-A c is constant). Ties go to the unclipped term."""
    a, r = x.advantages, rt.value
    r1 = r if spec.delta is None else torch.clamp(r, max=spec.delta)
    lo, hi = 1 - spec.clip_low, 1 + spec.clip_high
    l1 = -a * r1
    l2 = -a * torch.clamp(r, lo, hi)
    clipped = l2 > l1
    loss = torch.where(clipped, l2, l1)
    d_r = torch.where(clipped, -a * _band(r, lo, hi), -a * _band(r, None, spec.delta))
    lower = None
    if spec.dual_clip is not None:
        l3 = -a * spec.dual_clip
        lower = (loss > l3) & (a < 0)
        loss = torch.where(lower, l3, loss)
        d_r = torch.where(lower, torch.zeros_like(d_r), d_r)
    return loss, d_r, clipped, lower


@register_mode("vanilla", "ppo", log_ratio_min=-LOG_RATIO_CLAMP, log_ratio_max=LOG_RATIO_CLAMP)
@register_mode("gspo", "luspo", ratio_level="sequence")
@register_mode("gspo_token", ratio_level="sequence_token", log_ratio_max=10.0)
def clipped_surrogate(x: Inputs, spec: ModeSpec) -> Terms:
    """reference.clipped_surrogate / gspo / gspo_token / luspo (they differ in ratio_level, the
    log-ratio clamp and the aggregation)."""
    rt = ratio(x, spec)
    loss, d_r, clipped, lower = _surrogate(x, spec, rt)
    return Terms(loss, *_by_ratio(rt, d_r), _stat_flags(x, rt.stat_log_ratio, clipfrac=clipped,
                                                        clipfrac_lower=lower))


@register_mode("cispo", log_ratio_min=-LOG_RATIO_CLAMP, log_ratio_max=LOG_RATIO_CLAMP)
def cispo(x: Inputs, spec: ModeSpec) -> Terms:
    """l = -sg[c] A logp, c = clamp(r, 1 - low, 1 + high) or min(r, ratio_max): a = -c A (the ratio is
    detached at every level, so no row gradient)."""
    rt = ratio(x, spec)
    r = rt.value
    c = torch.clamp(r, 1 - spec.clip_low, 1 + spec.clip_high) if spec.ratio_max is None else torch.clamp(
        r, max=spec.ratio_max)
    high = None if spec.ratio_max is None else (r > spec.ratio_max) & (x.advantages > 0)
    local = -c * x.advantages
    return Terms(local * x.logp, local, None, None,
                 _stat_flags(x, rt.stat_log_ratio, clipfrac=r != c, clipfrac_lower=None, clipfrac_high=high))


@register_mode("sapo", log_ratio_min=-LOG_RATIO_CLAMP, log_ratio_max=LOG_RATIO_CLAMP)
def sapo(x: Inputs, spec: ModeSpec) -> Terms:
    """l = -A f(r), f = sigmoid(tau (r - 1)) 4 / tau: dl/dr = -A 4 s (1 - s), s the sigmoid."""
    rt = ratio(x, spec)
    a = x.advantages
    tau = torch.where(a > 0, torch.full_like(a, spec.tau_pos), torch.full_like(a, spec.tau_neg))
    s = torch.sigmoid(tau * (rt.value - 1))
    loss = -s * (4 / tau) * a
    return Terms(loss, *_by_ratio(rt, -a * 4 * s * (1 - s)),
                 _stat_flags(x, rt.stat_log_ratio, clipfrac=None, clipfrac_lower=None))


@register_mode("gpg", "reinforce")
def reinforce(x: Inputs, spec: ModeSpec) -> Terms:
    """l = -A logp: a = -A."""
    return Terms(-x.advantages * x.logp, -x.advantages, None, None, _stat_flags(x, x.logp - x.old_logp))


@register_mode("dro")
def dro(x: Inputs, spec: ModeSpec) -> Terms:
    """l = -(A logp - beta d^2 / 2), d = logp - old_logp: a = -A + beta d."""
    d = x.logp - x.old_logp
    loss = -(x.logp * x.advantages - 0.5 * spec.beta * d.square())
    return Terms(loss, -x.advantages + spec.beta * d, None, None, _stat_flags(x, d))


def _dppo(x: Inputs, spec: ModeSpec, valid: Tensor) -> Terms:
    """l = -A sg[min(r, ratio_max)] logp valid: a = -A min(r, ratio_max) valid."""
    log_ratio, _ = _clamp_log_ratio(x.logp - x.old_logp, spec)
    r = torch.exp(log_ratio)
    valid = valid.to(x.logp.dtype)
    truncated = torch.clamp(r, max=spec.ratio_max)
    loss = -x.advantages * truncated * x.logp * valid
    return Terms(loss, -x.advantages * truncated * valid, None, None,
                 _stat_flags(x, log_ratio, clipfrac=1 - valid, clipfrac_lower=(r > spec.ratio_max) * valid))


@register_mode("dppo_tv", ratio_max=20.0, log_ratio_min=-LOG_RATIO_CLAMP, log_ratio_max=LOG_RATIO_CLAMP)
def dppo_tv(x: Inputs, spec: ModeSpec) -> Terms:
    change = torch.exp(x.logp) - torch.exp(x.old_logp)
    return _dppo(x, spec, torch.where(x.advantages > 0, change <= spec.clip_high, change >= -spec.clip_low))


@register_mode("dppo_kl", ratio_max=20.0, log_ratio_min=-LOG_RATIO_CLAMP, log_ratio_max=LOG_RATIO_CLAMP)
def dppo_kl(x: Inputs, spec: ModeSpec) -> Terms:
    p, q = torch.exp(x.logp), torch.exp(x.old_logp)
    eps = DPPO_BINARY_KL_EPS
    binary_kl = q * (x.old_logp - x.logp) + (1 - q) * torch.log((1.0 - q + eps) / (1.0 - p + eps))
    valid = torch.where(x.advantages > 0, (binary_kl <= spec.clip_high) | (p <= q),
                        (binary_kl <= spec.clip_low) | (p >= q))
    return _dppo(x, spec, valid)


@register_mode("clip_cov")
def clip_cov(x: Inputs, spec: ModeSpec) -> Terms:
    """The clipped surrogate (no dual clip) times 1 - dropped (x.selected: clip_cov_dropped)."""
    rt = ratio(x, spec._replace(ratio_level="token", dual_clip=None, delta=None))
    loss, d_r, _, _ = _surrogate(x, spec._replace(dual_clip=None, delta=None), rt)
    keep = (~x.selected).to(loss.dtype)
    return Terms(loss * keep, d_r * rt.d_own * keep, None, None, _stat_flags(x, rt.stat_log_ratio, clipfrac=x.selected))


@register_mode("kl_cov")
def kl_cov(x: Inputs, spec: ModeSpec) -> Terms:
    """l = -A r + ppo_kl_coef |d| at the chosen tokens (x.selected: kl_cov_chosen), d = logp - old_logp:
    a = -A r (times the clamp's derivative) + ppo_kl_coef sign(d) there (0 at d = 0)."""
    rt = ratio(x, spec._replace(ratio_level="token"))
    d = x.logp - x.old_logp
    chosen = x.selected.to(d.dtype)
    loss = -x.advantages * rt.value + chosen * (spec.ppo_kl_coef * d.abs())
    local = -x.advantages * rt.d_own + chosen * (spec.ppo_kl_coef * torch.sign(d))
    flags = _stat_flags(x, rt.stat_log_ratio)
    flags["approx_kl_abs"] = d.abs()
    return Terms(loss, local, None, None, flags)


@register_mode("geo_mean")
def geo_mean(x: Inputs, spec: ModeSpec) -> Terms:
    """One loss per row on every token, l_b = -mean_t(A) exp(S_b) g_b, S_b = mean_t x~ (x~ the
    log-ratio clipped on its advantage's side), g_b = exp(mean_t log(is + 1e-10)) (1 without
    is_weights): e = l_b, dS = m_t [x~ passes the gradient] / max(n_b, 1)."""
    a, m = x.advantages, x.mask
    d = x.logp - x.old_logp
    bound = torch.where(a > 0, torch.full_like(d, spec.clip_high), torch.full_like(d, -spec.clip_low))
    beyond = torch.where(a > 0, d > spec.clip_high, d < -spec.clip_low)
    moves = (~beyond) & (a != 0)
    d_clipped = torch.where(a == 0, torch.zeros_like(d), torch.where(beyond, bound, d))
    row_loss = -_row_mean(a, m) * torch.exp(_row_mean(d_clipped, m))
    if x.is_weights is not None:
        row_loss = row_loss * torch.exp(_row_mean(torch.log(x.is_weights + GEO_MEAN_IS_EPS), m))
    loss = row_loss.expand_as(d)
    row_grad = m * moves.to(d.dtype) / m.sum(-1, keepdim=True).clamp(min=1)
    outside = d != torch.clamp(d, -spec.clip_low, spec.clip_high)
    return Terms(loss, None, loss, row_grad,
                 _stat_flags(x, d, clipfrac=outside & (a > 0), clipfrac_lower=outside & (a < 0)))


@register_mode("vespo")
def vespo(x: Inputs, spec: ModeSpec) -> Terms:
    """l = -phi A logp with phi the detached gamma weight of the row's summed log-ratio
    (reference.vespo_weights): a = -phi A."""
    d = x.logp - x.old_logp
    seq = _zero_off(torch.clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * x.mask, x.mask).sum(-1, keepdim=True)
    if x.sampler_weights is not None:
        log_s = torch.clamp(torch.log(x.sampler_weights), VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
        seq = seq + _zero_off(log_s * x.mask, x.mask).sum(-1, keepdim=True)
    log_w = torch.clamp(seq, VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
    nonneg = x.advantages >= 0
    k = torch.where(nonneg, torch.full_like(d, spec.k_pos), torch.full_like(d, spec.k_neg))
    lam = torch.where(nonneg, torch.full_like(d, spec.lambda_pos), torch.full_like(d, spec.lambda_neg))
    lam = lam.clamp(min=VESPO_LAMBDA_MIN)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    local = -phi * x.advantages
    flags = _stat_flags(x, d)
    flags["phi_mean"] = phi
    return Terms(local * x.logp, local, None, None, flags)


# ---------------------------------------------------------------- selections over the batch


def clip_cov_dropped(x: Inputs, spec: ModeSpec, *, clip_cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0,
                     generator=None) -> Tensor:
    """[B, T] bool: clip_cov's dropped tokens: max(int(clip_cov_ratio n), 1) drawn by
    torch.randperm(#candidates, generator=generator) among the tokens with lb < cov < ub that the ratio
    clip left alone, candidates in row-major order (verl's draw; reference.clip_cov)."""
    rt = ratio(x, spec._replace(ratio_level="token"))
    _, _, clipped, _ = _surrogate(x, spec._replace(dual_clip=None, delta=None), rt)
    selected = _selected(x.mask)
    cov = ref.covariance(x.advantages, x.logp, x.mask)
    candidates = torch.nonzero((cov > clip_cov_lb) & (cov < clip_cov_ub) & selected & ~clipped)
    dropped = torch.zeros_like(selected)
    if len(candidates) > 0:
        k = max(int(clip_cov_ratio * float(x.mask.sum())), 1)
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:k].to(candidates.device)]
        dropped[chosen[:, 0], chosen[:, 1]] = True
    return dropped


def kl_cov_chosen(x: Inputs, *, kl_cov_ratio=2e-4) -> Tensor:
    """[B, T] bool: kl_cov's max(int(kl_cov_ratio n), 1) tokens of largest covariance (torch.topk)."""
    selected = _selected(x.mask).flatten()
    chosen = torch.zeros_like(selected)
    n = int(selected.sum())
    if n > 0:
        cov = ref.covariance(x.advantages, x.logp, x.mask).flatten()[selected]
        top = torch.topk(cov, max(1, int(n * kl_cov_ratio))).indices
        chosen[selected.nonzero().flatten()[top]] = True
    return chosen.view(x.mask.shape)


# ---------------------------------------------------------------- one call


def make_spec(mode: str, **options) -> ModeSpec:
    """The ModeSpec of `mode` (a name in MODES) with its defaults, `options` over them, checked:
    clip_high defaults to clip_low; a log_ratio_clamp option (None, c or (lo, hi)) sets the bounds."""
    check_choice("loss_mode", mode, MODES)
    values = dict(DEFAULTS[mode])
    if "log_ratio_clamp" in options:
        bounds = options.pop("log_ratio_clamp")
        lo, hi = (None, None) if bounds is None else (-bounds, bounds) if isinstance(bounds, (int, float)) else bounds
        values.update(log_ratio_min=lo, log_ratio_max=hi)
    values.update(options)
    if values.get("clip_high") is None:
        values["clip_high"] = values.get("clip_low", ModeSpec._field_defaults["clip_low"])
    unknown = set(values) - set(ModeSpec._fields)
    if unknown:
        raise TypeError(f"unknown option(s) for loss_mode={mode!r}: {sorted(unknown)}")
    spec = ModeSpec(mode=mode, **values)
    for name in ("clip_low", "clip_high"):
        check_number(name, getattr(spec, name), nonnegative=True)
    if spec.dual_clip is not None:
        check_number("dual_clip", spec.dual_clip, above=1.0)
    check_choice("ratio_level", spec.ratio_level, RATIO_LEVELS)
    if mode == "dro" and (spec.beta is None or check_number("beta", spec.beta) <= 0):
        raise ValueError(f"loss_mode='dro' needs beta > 0, got {spec.beta!r}")
    return spec


def policy_mode_terms(spec: ModeSpec, x: Inputs, token_weight: Tensor, need_grad: bool = True):
    """(loss = sum w l, dL/dlogp [B, T] or None, per-token stat values) of one mode, w = token_weight x
    is_weights (except ROW_IS_WEIGHTS modes); token_weight = the aggregation's row scale x mask."""
    x = x._replace(mask=x.mask.to(x.logp.dtype))
    terms = MODES[spec.mode](x, spec)
    m = x.mask
    w = token_weight if x.is_weights is None or spec.mode in ROW_IS_WEIGHTS else token_weight * x.is_weights
    loss = _zero_off(w * terms.loss, m).sum()
    if not need_grad:
        return loss, None, terms.flags
    grad = torch.zeros_like(x.logp) if terms.local is None else w * terms.local
    if terms.row_coef is not None:
        grad = grad + terms.row_grad * _zero_off(w * terms.row_coef, m).sum(-1, keepdim=True)
    return loss, _zero_off(grad, m), terms.flags


def mode_stats(flags: dict, mask: Tensor) -> dict:
    """The masked means of the per-token stat values (0 for an empty mask)."""
    m = mask.to(next(iter(flags.values())).dtype)
    n = m.sum().clamp(min=1)
    return {k: _zero_off(v * m, m).sum() / n for k, v in flags.items()}
