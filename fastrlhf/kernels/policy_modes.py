"""The policy-loss family's per-token formulas for the Triton kernels of kernels/ppo_loss.py: the mirror of
fastrlhf.ops.policy_modes (formulas, gradients and tie rules written out there and in reference.POLICY_LOSSES).

One formula per constexpr FORMULA (FORMULAS below), never a runtime branch over modes: a kernel compiled for
one mode holds only that mode's arithmetic. Every loss is L = sum_bt w_bt l_bt with

    dL/dlogp_bt = w_bt a_bt + dS_bt sum_t' w_bt' e_bt'

a = the token's own derivative (`local`), e = its row coefficient (`coef`, the row-gradient modes only: the
clipped surrogate and SAPO at the sequence level, where r = exp(clamp(S_b)) with S_b the row's mean log-ratio,
dS_bt = m_t / max(n_b, 1); and geo_mean, e = its row loss, dS_bt = m_t [x~ passes] / max(n_b, 1)). What a
formula needs of its row (S_b; geo_mean's mean advantage, clipped log-ratio and IS weights; vespo's summed
log-ratio and sampler weights) is one row reduction before the per-token pass (`row_stats` in the kernels).

Ties (as reference.py): the clamps pass the gradient on their closed interval; max(l1, l2) at l1 == l2 and
min(l, -A c) at l == -A c give it to the unclipped term; |x| at 0 (kl_cov) has gradient 0.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import triton
import triton.language as tl

from fastrlhf.constants import (
    DPPO_BINARY_KL_EPS,
    GEO_MEAN_IS_EPS,
    LOG_RATIO_CLAMP,
    VESPO_LAMBDA_MIN,
    VESPO_LOG_W_MIN,
)

# the formulas (constexpr FORMULA values)
SURROGATE, CISPO, SAPO, REINFORCE, DRO, DPPO_TV, DPPO_KL, CLIP_COV, KL_COV, GEO_MEAN, VESPO = (
    tl.constexpr(i) for i in range(11))
# the loss_mode names users write -> the formula the kernels compile
FORMULAS = {name: f.value for name, f in (
    ("vanilla", SURROGATE), ("ppo", SURROGATE), ("gspo", SURROGATE), ("gspo_token", SURROGATE), ("luspo", SURROGATE),
    ("cispo", CISPO), ("sapo", SAPO), ("gpg", REINFORCE), ("reinforce", REINFORCE), ("dro", DRO), ("dppo_tv", DPPO_TV),
    ("dppo_kl", DPPO_KL), ("clip_cov", CLIP_COV), ("kl_cov", KL_COV), ("geo_mean", GEO_MEAN), ("vespo", VESPO))}
LEVELS = {"token": 0, "sequence": 1, "sequence_token": 2}
_SELECTION = (CLIP_COV.value, KL_COV.value)

LR_CLAMP = tl.constexpr(LOG_RATIO_CLAMP)
GEO_EPS = tl.constexpr(GEO_MEAN_IS_EPS)
BKL_EPS = tl.constexpr(DPPO_BINARY_KL_EPS)
LOG_W_MIN = tl.constexpr(VESPO_LOG_W_MIN)
LAMBDA_MIN = tl.constexpr(VESPO_LAMBDA_MIN)


class ModeLaunch(NamedTuple):
    """A policy-loss mode as the kernels take it (`mode_launch` builds it from an ops.policy_modes.ModeSpec):
    the constexprs, then the fp32 scalars in the kernels' argument order (None: 0, unused)."""

    formula: int
    level: int
    dual_clip: bool
    has_delta: bool
    has_lr_min: bool
    has_lr_max: bool
    has_ratio_max: bool
    row_stat: bool  # a row reduction before the per-token pass
    row_grad: bool  # a gradient through the row statistic (a third walk over the row, writing d(logp))
    scalars: tuple  # SCALARS, as floats

    @property
    def token_local(self) -> bool:
        """Whether every token's gradient is known from the token alone (the fused actor-loss kernel)."""
        return not self.row_stat and self.formula not in _SELECTION

    @property
    def selection(self) -> bool:
        return self.formula in _SELECTION


SCALARS = ("ratio_low", "ratio_high", "clip_low", "clip_high", "dual_clip", "delta", "lr_min", "lr_max", "ratio_max",
           "tau_pos", "tau_neg", "beta", "ppo_kl_coef", "k_pos", "lambda_pos", "k_neg", "lambda_neg")


@functools.cache
def mode_launch(spec) -> ModeLaunch:
    """The launch view of a ModeSpec (a NamedTuple, read by attribute)."""
    formula, level = FORMULAS[spec.mode], LEVELS[spec.ratio_level]
    if formula not in (SURROGATE.value, CISPO.value, SAPO.value):
        level = 0  # the other formulas have no ratio level
    values = dict(spec._asdict(), ratio_low=1.0 - spec.clip_low, ratio_high=1.0 + spec.clip_high,
                  lr_min=spec.log_ratio_min, lr_max=spec.log_ratio_max)
    scalars = tuple(0.0 if values[k] is None else float(values[k]) for k in SCALARS)
    surrogate = formula == SURROGATE.value
    row_stat = level != 0 or formula in (GEO_MEAN.value, VESPO.value)
    row_grad = (level == 1 and formula in (SURROGATE.value, SAPO.value)) or formula == GEO_MEAN.value
    return ModeLaunch(formula, level, surrogate and spec.dual_clip is not None, surrogate and spec.delta is not None,
                      spec.log_ratio_min is not None and math.isfinite(spec.log_ratio_min),
                      spec.log_ratio_max is not None and math.isfinite(spec.log_ratio_max),
                      formula == CISPO.value and spec.ratio_max is not None, row_stat, row_grad, scalars)


@triton.jit
def _clamp_log_ratio(x, lr_min, lr_max, HAS_LR_MIN: tl.constexpr, HAS_LR_MAX: tl.constexpr):
    # (clamp(x, lr_min, lr_max), its derivative: 1.0 on the closed interval, 0.0 outside)
    y = x
    inside = 1.0
    if HAS_LR_MIN:
        inside = tl.where(x >= lr_min, inside, 0.0)
        y = tl.maximum(y, lr_min)
    if HAS_LR_MAX:
        inside = tl.where(x <= lr_max, inside, 0.0)
        y = tl.minimum(y, lr_max)
    return y, inside


@triton.jit
def _surrogate(a, r, ratio_low, ratio_high, dual_clip, delta, DUAL_CLIP: tl.constexpr, HAS_DELTA: tl.constexpr):
    # PPO's clipped surrogate of the ratio r: (l, dl/dr, clipped = [l2 > l1], lower = dual-clipped)
    #   l1 = -A min(r, delta), l2 = -A clamp(r, 1 - clip_low, 1 + clip_high), l = max(l1, l2) (a tie: l1);
    #   dual-clip c, A < 0 only: l = min(l, -A c) (a tie: l)
    r1 = r
    d_unclipped = -a
    if HAS_DELTA:
        r1 = tl.minimum(r, delta)
        d_unclipped = tl.where(r <= delta, -a, 0.0)
    l1 = -a * r1
    l2 = -a * tl.minimum(tl.maximum(r, ratio_low), ratio_high)
    clipped = l2 > l1
    loss = tl.where(clipped, l2, l1)
    in_clip = (r >= ratio_low) & (r <= ratio_high)
    d_r = tl.where(clipped, tl.where(in_clip, -a, 0.0), d_unclipped)
    lower = l1 < l1  # all False (NaN too), in clipped's shape
    if DUAL_CLIP:
        l3 = -a * dual_clip
        lower = (a < 0) & (loss > l3)
        loss = tl.where(lower, l3, loss)
        d_r = tl.where(lower, 0.0, d_r)
    return loss, d_r, clipped, lower


@triton.jit
def _dppo(logp, old, a, x, valid, lr_min, lr_max, ratio_max, HAS_LR_MIN: tl.constexpr, HAS_LR_MAX: tl.constexpr):
    # l = -A sg[min(r, ratio_max)] logp [valid]: (loss, local, clipped = 1 - valid, lower, stat log-ratio)
    lr, _ = _clamp_log_ratio(x, lr_min, lr_max, HAS_LR_MIN, HAS_LR_MAX)
    r = tl.exp(lr)
    v = tl.where(valid, 1.0, 0.0)
    local = -a * tl.minimum(r, ratio_max) * v
    return local * logp, local, 1.0 - v, tl.where(r > ratio_max, v, 0.0), lr


@triton.jit
def policy_token(logp, old, a, sel, row_lr, row_loss, ratio_low, ratio_high, clip_low, clip_high, dual_clip, delta,
                 lr_min, lr_max, ratio_max, tau_pos, tau_neg, beta, ppo_kl_coef, k_pos, lambda_pos, k_neg, lambda_neg,
                 FORMULA: tl.constexpr, LEVEL: tl.constexpr, DUAL_CLIP: tl.constexpr, HAS_DELTA: tl.constexpr,
                 HAS_LR_MIN: tl.constexpr, HAS_LR_MAX: tl.constexpr, HAS_RATIO_MAX: tl.constexpr):
    # One token of the mode FORMULA (a block of tokens or one), fp32: (loss l, local a = dl/dlogp, row coefficient
    # e, clipped, lower, the log-ratio approx_kl averages, the mode's extra stat), the flags as 0.0 / 1.0.
    # row_lr: the row's statistic (sequence levels: S_b, the mean log-ratio; vespo: log w, its clamped sum);
    # row_loss: geo_mean's row loss; sel: clip_cov's dropped / kl_cov's chosen token (1.0 / 0.0).
    x = logp - old
    zero = x * 0.0
    local = zero
    coef = zero
    clipped = zero
    lower = zero
    extra = zero
    stat_lr = x
    if FORMULA == SURROGATE or FORMULA == CISPO or FORMULA == SAPO:  # a ratio at LEVEL
        if LEVEL == 0:
            lr, inside = _clamp_log_ratio(x, lr_min, lr_max, HAS_LR_MIN, HAS_LR_MAX)
            stat_lr = lr
        else:  # the row's mean log-ratio; approx_kl averages the raw token log-ratio
            lr, inside = _clamp_log_ratio(row_lr + zero, lr_min, lr_max, HAS_LR_MIN, HAS_LR_MAX)
        r = tl.exp(lr)
        dr = r * inside
        if FORMULA == CISPO:  # l = -sg[c] A logp, c = clamp(r, 1 - low, 1 + high) or min(r, ratio_max)
            if HAS_RATIO_MAX:
                c = tl.minimum(r, ratio_max)
                extra = tl.where((r > ratio_max) & (a > 0), 1.0, 0.0)
            else:
                c = tl.minimum(tl.maximum(r, ratio_low), ratio_high)
            clipped = tl.where(r != c, 1.0, 0.0)
            local = -c * a
            loss = local * logp
        else:
            if FORMULA == SURROGATE:
                loss, d_r, is_clipped, is_lower = _surrogate(a, r, ratio_low, ratio_high, dual_clip, delta, DUAL_CLIP,
                                                            HAS_DELTA)
                clipped = tl.where(is_clipped, 1.0, 0.0)
                lower = tl.where(is_lower, 1.0, 0.0)
            else:  # SAPO: l = -A sigmoid(tau (r - 1)) 4 / tau, dl/dr = -A 4 s (1 - s)
                tau = tl.where(a > 0, tau_pos, tau_neg)
                s = tl.sigmoid(tau * (r - 1.0))
                loss = -s * (4.0 / tau) * a
                d_r = -a * 4.0 * s * (1.0 - s)
            if LEVEL == 1:  # the gradient through the row's mean
                coef = d_r * dr
            else:
                local = d_r * dr
    elif FORMULA == REINFORCE:  # / GPG: l = -A logp
        local = -a + zero
        loss = local * logp
    elif FORMULA == DRO:  # l = -(A logp - beta x^2 / 2)
        loss = -(logp * a - 0.5 * beta * x * x)
        local = -a + beta * x
    elif FORMULA == DPPO_TV:  # p - p_old <= clip_high (A > 0), >= -clip_low (A <= 0)
        change = tl.exp(logp) - tl.exp(old)
        valid = tl.where(a > 0, change <= clip_high, change >= -clip_low)
        loss, local, clipped, lower, stat_lr = _dppo(logp, old, a, x, valid, lr_min, lr_max, ratio_max, HAS_LR_MIN,
                                                     HAS_LR_MAX)
    elif FORMULA == DPPO_KL:  # the binary KL of the sampled token's probability
        p = tl.exp(logp)
        q = tl.exp(old)
        binary_kl = q * (old - logp) + (1.0 - q) * tl.log((1.0 - q + BKL_EPS) / (1.0 - p + BKL_EPS))
        valid = tl.where(a > 0, (binary_kl <= clip_high) | (p <= q), (binary_kl <= clip_low) | (p >= q))
        loss, local, clipped, lower, stat_lr = _dppo(logp, old, a, x, valid, lr_min, lr_max, ratio_max, HAS_LR_MIN,
                                                     HAS_LR_MAX)
    elif FORMULA == CLIP_COV:  # the surrogate (no dual clip, no delta) times 1 - dropped
        lr, inside = _clamp_log_ratio(x, lr_min, lr_max, HAS_LR_MIN, HAS_LR_MAX)
        r = tl.exp(lr)
        loss, d_r, _, _ = _surrogate(a, r, ratio_low, ratio_high, 0.0, 0.0, False, False)
        keep = 1.0 - sel
        loss = loss * keep
        local = d_r * r * inside * keep
        clipped = sel + zero
        stat_lr = lr
    elif FORMULA == KL_COV:  # l = -A r + ppo_kl_coef |lr| at the chosen tokens, lr the (clamped) log-ratio
        lr, inside = _clamp_log_ratio(x, lr_min, lr_max, HAS_LR_MIN, HAS_LR_MAX)
        r = tl.exp(lr)
        sign = tl.where(lr > 0, 1.0, tl.where(lr < 0, -1.0, 0.0))  # |lr|'s derivative, 0 at 0
        loss = -a * r + sel * (ppo_kl_coef * tl.abs(lr))
        local = (-a * r + sel * (ppo_kl_coef * sign)) * inside
        extra = tl.abs(lr)
        stat_lr = lr
    elif FORMULA == GEO_MEAN:  # the row's loss on every token; the gradient through the row's mean
        loss = row_loss + zero
        coef = loss
        outside = x != tl.minimum(tl.maximum(x, -clip_low), clip_high)
        clipped = tl.where(outside & (a > 0), 1.0, 0.0)
        lower = tl.where(outside & (a < 0), 1.0, 0.0)
    else:  # VESPO: l = -phi A logp, phi = exp(lam + k log w - lam w) of the row's w (0 where not finite)
        nonneg = a >= 0
        k = tl.where(nonneg, k_pos, k_neg)
        lam = tl.maximum(tl.where(nonneg, lambda_pos, lambda_neg), LAMBDA_MIN)
        phi = tl.exp(lam + k * row_lr - lam * tl.exp(row_lr))
        phi = tl.where((phi == phi) & (tl.abs(phi) < float("inf")), phi, 0.0)
        local = -phi * a
        loss = local * logp
        extra = phi
    return loss, local, coef, clipped, lower, stat_lr, extra


@triton.jit
def geo_clipped(x, a, clip_low, clip_high):
    # geo_mean's log-ratio clipped on the side its advantage pushes, and whether the gradient passes:
    # A > 0: min(x, clip_high); A < 0: max(x, -clip_low); A == 0: 0 (no gradient)
    beyond = tl.where(a > 0, x > clip_high, x < -clip_low)
    bound = tl.where(a > 0, clip_high, -clip_low)
    x_clipped = tl.where(a == 0, 0.0, tl.where(beyond, bound, x))
    moves = tl.where((~beyond) & (a != 0), 1.0, 0.0)
    return x_clipped, moves


@triton.jit
def vespo_log_ratio(x):
    # the clamped log-ratio vespo sums over a row
    return tl.minimum(tl.maximum(x, -LR_CLAMP), LR_CLAMP)


@triton.jit
def vespo_log_sampler(s):
    # the clamped log of a sampler weight vespo adds to the row's sum
    return tl.minimum(tl.maximum(tl.log(s), LOG_W_MIN), LR_CLAMP)


@triton.jit
def vespo_log_w(seq):
    return tl.minimum(tl.maximum(seq, LOG_W_MIN), LR_CLAMP)


@triton.jit
def geo_log_is(w):
    return tl.log(w + GEO_EPS)
