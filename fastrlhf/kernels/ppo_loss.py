"""Clipped PPO losses: one kernel per formula, forward and gradient in the same pass, and the aggregation
inside the kernels.

Every aggregation mode (verl's agg_loss) is per-row weights, n_b = sum_t m[b, t], S = #{b: n_b > 0}:
    loss = sum_b scale[b] * sum_t m[b, t] * l[b, t],   d_x[b, t] = scale[b] * m[b, t] * dl/dx
    token-mean               scale = dp / (global_num_tokens or sum_b n_b)
    token-sum                scale = dp
    seq-mean-token-sum       scale = dp [n_b > 0] / (global_num_seqs or S)
    seq-mean-token-sum-norm  scale = dp [n_b > 0] / ((global_num_seqs or S) (loss_scale_factor or T))
    seq-mean-token-mean      scale = dp [n_b > 0] / (n_b (global_num_seqs or S))
(the policy loss optionally times per-token importance weights). Two launches, no torch op between:
    main    one program per row: the per-token loss and gradient, and the row's sums (loss, n_b, what
            the stats average), with every factor of the scale known at launch (dp, a global count,
            1 / n_b counted in a first pass over the row's mask) already in the gradient
    finish  one program over the rows in a fixed order (deterministic, no float atomics): the counts,
            the scale, the loss, the stats, and, when the count is local, the factor the gradient still
            needs, which the backward's one in-place scale applies (`scale_unless_one_`: together with
            the upstream gradient; nothing read or written when their product is 1)
A token with m = 0 adds exactly 0 and gets gradient 0, whatever (NaN, inf) its inputs hold.

Policy (verl's vanilla loss, `fastrlhf.reference.policy_loss`):
    lr = clamp(logp - old_logp, -20, 20), ratio = exp(lr)
    l1 = -A * ratio, l2 = -A * clamp(ratio, 1 - clip_low, 1 + clip_high), l = max(l1, l2)
    dual-clip c, for A < 0 only: l = min(l, -A * c)
Value: l = 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip = old + clamp(v - old, -clip, clip),
computed as clamp(v, old - clip, old + clip) (verl's clip_by_value): equal in exact arithmetic, and
v_clip == v bit for bit inside the range, so rounding never counts an unclipped token as clipped.
Gradients follow the tie rules stated in `fastrlhf.reference`: clamp passes the gradient on its
closed interval and blocks it outside; at a tie of max(l1, l2) (or of the dual-clip min) the
unclipped term takes the whole gradient, as the clip fractions count only strict inequalities.

Where fast: elementwise and memory-bound; one program per row (grid B, fine up to 2^31 - 1 rows), the
row walked in tiles of BLOCK_T (the next power of two of T, capped at 1024): well occupied from a few
hundred rows; a handful of very long rows leaves most SMs idle. The finish kernel reads 4-6 floats per
row in one program (B = 1024: a few microseconds).

The whole actor loss from logits (`_actor_loss_fwd_kernel`): every term of
    L = sum_i w_i (is_i pg(logp_i) + kl_coef KL(logp_i) - entropy_coef H_i),  w = row_scale * mask
is token-local once w is known, so one program per token row does it all in one launch, in small jit
helpers (`_actor_loss_row` composes them):
    `_row_stats`           pass 1 over the row: lse, entropy (the base-2 online softmax of kernels/logprobs.py)
    `_token_logp`          logp of the label
    `_actor_token_grads`   dL/dlogp and dL/dH of the token (the policy and KL formulas above and in kernels/kl.py)
    `_write_dlogits`       pass 2, the row again from its end (L2 hints: pass-1 loads evict-last, pass-2 loads
                           and the d(logits) stores evict-first), d(logits) = p (a + b t) [+ g_logp / T at the label]
instead of a log-prob forward, torch glue, and a log-prob backward. The options arrive as one spec
(fastrlhf.ops.losses.ActorSpec), unpacked into the kernel's scalars and constexprs by `actor_loss_fwd`.
On CUDA for V >= TUNE_MIN_V the launch is autotuned among ACTOR_CONFIGS (tile x warps x programs per SM,
keyed on V, NEED_GRAD, HAS_ENTROPY and dtypes): one program per row with 8192 x 8, two per SM with
8192 x 8, then 16384 x 16 at one, one half and one quarter program per SM (a persistent grid walking rows
pid, pid + grid, ...). Elsewhere: one program per row, the log-prob kernels' fixed tile (8192 at most on
CUDA). Whether pass 2 is served from L2, the configs measured and the candidates for the <= 0.75x goal
(ppo_actor_loss fwd+bwd over logprobs fwd+bwd): bench/experiments/README.md, "The actor loss in two passes".
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fastrlhf.constants import IGNORE_INDEX, LOG_RATIO_CLAMP
from fastrlhf.kernels._launch import cdiv, next_power_of_2, sm_count
from fastrlhf.kernels._masks import as_loadable
from fastrlhf.kernels.kl import ESTIMATOR_IDS, _kl_derivative, _rounded
from fastrlhf.kernels.logprobs import (
    FP32_MIN,
    LN2,
    LOG2E,
    TUNE_MIN_V,
    _aligned_span,
    _bwd_tile,
    _online_tile,
    _ragged_ends,
    fixed_config,
)
from fastrlhf.kernels.policy_modes import (
    CLIP_COV,
    GEO_MEAN,
    KL_COV,
    VESPO,
    ModeLaunch,
    geo_clipped,
    geo_log_is,
    mode_launch,
    policy_token,
    vespo_log_ratio,
    vespo_log_sampler,
    vespo_log_w,
)

LR_CLAMP = tl.constexpr(LOG_RATIO_CLAMP)  # |log-ratio| bound inside exp
_MAX_BLOCK_T = 1024
_FINISH_BLOCK_B = 1024
_SCALE_BLOCK = 4096
# the fused actor loss on CUDA: tile x warps x grid, autotuned among these (module docstring)
ACTOR_CONFIGS = [triton.Config({"BLOCK_V": block_v, "PROGRAMS_PER_SM": per_sm}, num_warps=warps)
                 for block_v, warps, per_sm in ((8192, 8, 0), (8192, 8, 2), (16384, 16, 1), (16384, 16, 0.5),
                                                (16384, 16, 0.25))]
IGNORE = tl.constexpr(IGNORE_INDEX)
POLICY_SUMS = ("loss", "n_mask", "n_clipped", "n_clipped_lower", "neg_log_ratio", "neg_log_ratio_unclamped", "extra")
VALUE_SUMS = ("loss", "n_mask", "n_clipped")


class AggLaunch(NamedTuple):
    """An aggregation as the policy / value launchers take it (ops.losses builds it once per mode and counts)."""

    agg_id: int  # the mode's index in fastrlhf.constants.AGG_MODES (0 token-mean ... 4 seq-mean-token-sum-norm)
    has_global: bool  # global_count given (token-mean: global_num_tokens; seq-mean-*: global_num_seqs)
    global_count: float
    dp_size: float
    norm: float | None  # seq-mean-token-sum-norm: loss_scale_factor (None: T)
    row_mean: bool  # seq-mean-token-mean: 1 / n_b per row, in the main kernel
    grad_scale: float  # the gradient's factor known at launch: dp / global count (/ norm), else 1
    pending: bool  # the count's factor is known only after the finish kernel (no global count given)


@triton.jit
def _row_inverse_count(mask_ptr, base, T, cols, BLOCK_T: tl.constexpr):
    # 1 / n_b (0 for an empty row) of one row of the mask: seq-mean-token-mean's per-row factor
    n = tl.zeros((BLOCK_T,), tl.float32)
    for start in range(0, T, BLOCK_T):
        t = start + cols
        n += tl.load(mask_ptr + base + t, mask=t < T, other=0).to(tl.float32)
    n_b = tl.sum(n, axis=0)
    return tl.where(n_b > 0, 1.0 / tl.where(n_b > 0, n_b, 1.0), 0.0)


@triton.jit
def _policy_loss_fwd_kernel(
    # pointers
    logp_ptr,  # [B, T] fp32/bf16/fp16, stride(1) == 1
    old_ptr,  # [B, T] fp32/bf16/fp16, stride(1) == 1
    adv_ptr,  # [B, T] fp32/bf16/fp16, stride(1) == 1
    mask_ptr,  # [B, T] bool (as int8) or float, stride(1) == 1
    weight_ptr,  # [B, T] fp32 w = row_scale * mask, stride(1) == 1, read only if WEIGHTED
    is_weights_ptr,  # [B, T] fp32/bf16/fp16, stride(1) == 1, read only if HAS_IS_WEIGHTS
    selected_ptr,  # [B, T] bool (as int8), stride(1) == 1, read only for clip_cov / kl_cov
    sampler_ptr,  # [B, T] fp32/bf16/fp16, stride(1) == 1, read only if HAS_SAMPLER (vespo)
    dlogp_ptr,  # [B, T] out (fp32, fp64 for fp64 inputs), contiguous, written when NEED_GRAD
    partial_ptr,  # [7, B] fp32 out, per row: see POLICY_SUMS
    # shapes
    B,
    T,
    # strides (rows)
    stride_logp,
    stride_old,
    stride_adv,
    stride_mask,
    stride_weight,
    stride_is,
    stride_sel,
    stride_sampler,
    # meta
    grad_scale,  # fp32: the part of the row scale known at launch (1 when it waits for the finish kernel)
    ratio_low,  # fp32, 1 - clip_low; the mode's scalars: kernels.policy_modes.SCALARS, each fp32
    ratio_high,
    clip_low,
    clip_high,
    dual_clip,
    delta,
    lr_min,
    lr_max,
    ratio_max,
    tau_pos,
    tau_neg,
    beta,
    ppo_kl_coef,
    k_pos,
    lambda_pos,
    k_neg,
    lambda_neg,
    FORMULA: tl.constexpr,  # kernels.policy_modes.FORMULAS
    LEVEL: tl.constexpr,  # the ratio's level: 0 token, 1 sequence, 2 sequence_token
    DUAL_CLIP: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_LR_MIN: tl.constexpr,
    HAS_LR_MAX: tl.constexpr,
    HAS_RATIO_MAX: tl.constexpr,
    ROW_STAT: tl.constexpr,  # a row reduction before the per-token pass
    ROW_GRAD: tl.constexpr,  # a gradient through the row statistic: d(logp) in a third walk over the row
    HAS_IS_WEIGHTS: tl.constexpr,
    HAS_SAMPLER: tl.constexpr,
    WEIGHTED: tl.constexpr,  # w = weight (the actor loss's row_scale * mask, scale included), else w = mask
    NEED_GRAD: tl.constexpr,
    ROW_MEAN: tl.constexpr,  # seq-mean-token-mean: the row's loss and gradient times 1 / n_b
    BLOCK_T: tl.constexpr,
):
    # one program per row: the row's statistic (ROW_STAT), then the per-token loss and gradient and the row's sums
    # (unscaled but for 1 / n_b), then (ROW_GRAD) the gradient through the statistic. The row's [T] inputs are
    # read again by the same program (from L1 / L2): one read of [B, T] from DRAM and one write.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_T)
    inv_n = 1.0
    if ROW_MEAN:
        inv_n = _row_inverse_count(mask_ptr, row * stride_mask, T, cols, BLOCK_T)
    row_lr = 0.0
    row_loss = 0.0
    inv_count = 1.0
    if ROW_STAT:  # S_b = mean_t m x (sequence levels); geo_mean's and vespo's row sums
        acc_n = tl.zeros((BLOCK_T,), tl.float32)
        acc_x = tl.zeros((BLOCK_T,), tl.float32)
        acc_a = tl.zeros((BLOCK_T,), tl.float32)
        acc_w = tl.zeros((BLOCK_T,), tl.float32)
        for start in range(0, T, BLOCK_T):
            t = start + cols
            inb = t < T
            m = tl.load(mask_ptr + row * stride_mask + t, mask=inb, other=0).to(tl.float32)
            counts = m != 0.0
            x = tl.load(logp_ptr + row * stride_logp + t, mask=inb, other=0.0).to(tl.float32)
            x -= tl.load(old_ptr + row * stride_old + t, mask=inb, other=0.0).to(tl.float32)
            acc_n += m
            if FORMULA == GEO_MEAN:
                a = tl.load(adv_ptr + row * stride_adv + t, mask=inb, other=0.0).to(tl.float32)
                x_clipped, _ = geo_clipped(x, a, clip_low, clip_high)
                acc_x += tl.where(counts, m * x_clipped, 0.0)
                acc_a += tl.where(counts, m * a, 0.0)
                if HAS_IS_WEIGHTS:
                    w_is = tl.load(is_weights_ptr + row * stride_is + t, mask=inb, other=1.0).to(tl.float32)
                    acc_w += tl.where(counts, m * geo_log_is(w_is), 0.0)
            elif FORMULA == VESPO:
                acc_x += tl.where(counts, m * vespo_log_ratio(x), 0.0)
                if HAS_SAMPLER:
                    s = tl.load(sampler_ptr + row * stride_sampler + t, mask=inb, other=1.0).to(tl.float32)
                    acc_w += tl.where(counts, m * vespo_log_sampler(s), 0.0)
            else:
                acc_x += tl.where(counts, m * x, 0.0)
        n_b = tl.sum(acc_n, axis=0)
        inv_count = 1.0 / tl.maximum(n_b, 1.0)
        if FORMULA == GEO_MEAN:  # l_b = -mean_t(A) exp(mean_t x~) [exp(mean_t log(is + 1e-10))]
            row_loss = -(tl.sum(acc_a, axis=0) * inv_count) * tl.exp(tl.sum(acc_x, axis=0) * inv_count)
            if HAS_IS_WEIGHTS:
                row_loss = row_loss * tl.exp(tl.sum(acc_w, axis=0) * inv_count)
        elif FORMULA == VESPO:  # log w = clamp(sum_t m clamp(x) [+ sum_t m clamp(log s)])
            row_lr = vespo_log_w(tl.sum(acc_x, axis=0) + tl.sum(acc_w, axis=0))
        else:
            row_lr = tl.sum(acc_x, axis=0) * inv_count
    acc_loss = tl.zeros((BLOCK_T,), tl.float32)
    acc_clipped = tl.zeros((BLOCK_T,), tl.float32)
    acc_lower = tl.zeros((BLOCK_T,), tl.float32)
    acc_nlr = tl.zeros((BLOCK_T,), tl.float32)
    acc_m = tl.zeros((BLOCK_T,), tl.float32)
    acc_nlru = tl.zeros((BLOCK_T,), tl.float32)
    acc_extra = tl.zeros((BLOCK_T,), tl.float32)
    acc_coef = tl.zeros((BLOCK_T,), tl.float32)
    for start in range(0, T, BLOCK_T):
        t = start + cols
        inb = t < T
        m = tl.load(mask_ptr + row * stride_mask + t, mask=inb, other=0).to(tl.float32)
        logp = tl.load(logp_ptr + row * stride_logp + t, mask=inb, other=0.0).to(tl.float32)
        old = tl.load(old_ptr + row * stride_old + t, mask=inb, other=0.0).to(tl.float32)
        a = tl.load(adv_ptr + row * stride_adv + t, mask=inb, other=0.0).to(tl.float32)
        counts = m != 0.0  # a token under mask = 0 adds exactly 0, whatever (NaN, inf) its inputs hold
        w = m
        if WEIGHTED:
            w = tl.load(weight_ptr + row * stride_weight + t, mask=inb, other=0.0)
        if HAS_IS_WEIGHTS and FORMULA != GEO_MEAN:  # the policy term of each token times its importance weight
            w = w * tl.load(is_weights_ptr + row * stride_is + t, mask=inb, other=0.0).to(tl.float32)
        sel = 0.0
        if FORMULA == CLIP_COV or FORMULA == KL_COV:
            sel = tl.load(selected_ptr + row * stride_sel + t, mask=inb, other=0).to(tl.float32)
        loss, local, coef, clipped, lower, stat_lr, extra = policy_token(
            logp, old, a, sel, row_lr, row_loss, ratio_low, ratio_high, clip_low, clip_high, dual_clip, delta,
            lr_min, lr_max, ratio_max, tau_pos, tau_neg, beta, ppo_kl_coef, k_pos, lambda_pos, k_neg, lambda_neg,
            FORMULA, LEVEL, DUAL_CLIP, HAS_DELTA, HAS_LR_MIN, HAS_LR_MAX, HAS_RATIO_MAX)
        acc_loss += tl.where(counts, w * loss, 0.0)
        acc_clipped += tl.where(counts, m * clipped, 0.0)
        acc_lower += tl.where(counts, m * lower, 0.0)
        acc_nlr += tl.where(counts, -stat_lr * m, 0.0)
        acc_m += m
        acc_nlru += tl.where(counts, (old - logp) * m, 0.0)
        acc_extra += tl.where(counts, m * extra, 0.0)
        if ROW_GRAD:
            acc_coef += tl.where(counts, w * coef, 0.0)
        elif NEED_GRAD:
            tl.store(dlogp_ptr + row * T + t, tl.where(counts, (grad_scale * inv_n) * (w * local), 0.0), mask=inb)
    if ROW_GRAD and NEED_GRAD:  # dL/dlogp_t = dS_t sum_t' w e: dS_t = m_t / n_b [x~ passes, geo_mean]
        row_coef = tl.sum(acc_coef, axis=0) * inv_count * (grad_scale * inv_n)
        for start in range(0, T, BLOCK_T):
            t = start + cols
            inb = t < T
            m = tl.load(mask_ptr + row * stride_mask + t, mask=inb, other=0).to(tl.float32)
            d_s = m
            if FORMULA == GEO_MEAN:
                x = tl.load(logp_ptr + row * stride_logp + t, mask=inb, other=0.0).to(tl.float32)
                x -= tl.load(old_ptr + row * stride_old + t, mask=inb, other=0.0).to(tl.float32)
                a = tl.load(adv_ptr + row * stride_adv + t, mask=inb, other=0.0).to(tl.float32)
                _, moves = geo_clipped(x, a, clip_low, clip_high)
                d_s = m * moves
            tl.store(dlogp_ptr + row * T + t, tl.where(m != 0.0, d_s * row_coef, 0.0), mask=inb)
    tl.store(partial_ptr + row, tl.sum(acc_loss, axis=0) * inv_n)
    tl.store(partial_ptr + B + row, tl.sum(acc_m, axis=0))
    tl.store(partial_ptr + 2 * B + row, tl.sum(acc_clipped, axis=0))
    tl.store(partial_ptr + 3 * B + row, tl.sum(acc_lower, axis=0))
    tl.store(partial_ptr + 4 * B + row, tl.sum(acc_nlr, axis=0))
    tl.store(partial_ptr + 5 * B + row, tl.sum(acc_nlru, axis=0))
    tl.store(partial_ptr + 6 * B + row, tl.sum(acc_extra, axis=0))


@triton.jit
def _value_loss_fwd_kernel(
    # pointers
    values_ptr,  # [B, T] fp32/bf16/fp16, stride(1) == 1
    old_ptr,  # [B, T] fp32/bf16/fp16, stride(1) == 1
    returns_ptr,  # [B, T] fp32/bf16/fp16, stride(1) == 1
    mask_ptr,  # [B, T] bool (as int8) or float, stride(1) == 1
    dvalues_ptr,  # [B, T] out (fp32, fp64 for fp64 inputs), contiguous, written when NEED_GRAD
    partial_ptr,  # [3, B] fp32 out, per row: see VALUE_SUMS
    # shapes
    B,
    T,
    # strides (rows)
    stride_v,
    stride_old,
    stride_ret,
    stride_mask,
    # meta
    grad_scale,  # fp32: the part of the row scale known at launch (1 when it waits for the finish kernel)
    clip,  # fp32, used only when HAS_CLIP
    HAS_CLIP: tl.constexpr,
    NEED_GRAD: tl.constexpr,
    ROW_MEAN: tl.constexpr,  # seq-mean-token-mean: the row's loss and gradient times 1 / n_b
    BLOCK_T: tl.constexpr,
):
    # one program per row: l = 0.5 max((v - R)^2, (v_clip - R)^2) per token, its gradient, the row's sums
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_T)
    inv_n = 1.0
    if ROW_MEAN:
        inv_n = _row_inverse_count(mask_ptr, row * stride_mask, T, cols, BLOCK_T)
    acc_loss = tl.zeros((BLOCK_T,), tl.float32)
    acc_clipped = tl.zeros((BLOCK_T,), tl.float32)
    acc_m = tl.zeros((BLOCK_T,), tl.float32)
    for start in range(0, T, BLOCK_T):
        t = start + cols
        inb = t < T
        m = tl.load(mask_ptr + row * stride_mask + t, mask=inb, other=0).to(tl.float32)
        v = tl.load(values_ptr + row * stride_v + t, mask=inb, other=0.0).to(tl.float32)
        old = tl.load(old_ptr + row * stride_old + t, mask=inb, other=0.0).to(tl.float32)
        ret = tl.load(returns_ptr + row * stride_ret + t, mask=inb, other=0.0).to(tl.float32)
        counts = m != 0.0  # a token under mask = 0 adds exactly 0, whatever (NaN, inf) its inputs hold
        err1 = v - ret
        l1 = err1 * err1
        d = err1  # d(0.5 (v - R)^2)/dv
        if HAS_CLIP:
            v_low = old - clip
            v_high = old + clip
            err2 = tl.minimum(tl.maximum(v, v_low), v_high) - ret
            l2 = err2 * err2
            takes_l2 = l2 > l1  # max(l1, l2); a tie goes to the unclipped l1
            loss = tl.where(takes_l2, l2, l1)
            acc_clipped += tl.where(takes_l2 & counts, m, 0.0)
            # d(0.5 (v_clip - R)^2)/dv = (v_clip - R) [old - clip <= v <= old + clip]
            d = tl.where(takes_l2, tl.where((v >= v_low) & (v <= v_high), err2, 0.0), err1)
        else:
            loss = l1
        acc_loss += tl.where(counts, 0.5 * m * loss, 0.0)
        acc_m += m
        if NEED_GRAD:
            tl.store(dvalues_ptr + row * T + t, tl.where(counts, (grad_scale * inv_n) * (m * d), 0.0), mask=inb)
    tl.store(partial_ptr + row, tl.sum(acc_loss, axis=0) * inv_n)
    tl.store(partial_ptr + B + row, tl.sum(acc_m, axis=0))
    tl.store(partial_ptr + 2 * B + row, tl.sum(acc_clipped, axis=0))


@triton.jit
def _loss_finish_kernel(
    # pointers
    partial_ptr,  # [K, B] fp32 per-row sums: row 0 the loss, row 1 n_b = sum_t m, rows 2.. what the stats average
    loss_ptr,  # [] out (fp32, fp64 for fp64 inputs)
    stats_ptr,  # [K - 2] out: the masked means sum_b partial[k] / sum_b n_b
    factor_ptr,  # [1] fp32 out, written when PENDING: the gradient's factor left to the backward
    # shapes
    B,
    # meta
    global_count,  # fp32: global_num_tokens (token-mean) or global_num_seqs (seq-mean-*), used if HAS_GLOBAL
    dp_size,  # fp32
    norm,  # fp32: seq-mean-token-sum-norm's loss_scale_factor or T
    K: tl.constexpr,
    AGG: tl.constexpr,  # AggLaunch.agg_id
    HAS_GLOBAL: tl.constexpr,
    PENDING: tl.constexpr,  # the main kernel wrote the gradient without the count's factor
    BLOCK_B: tl.constexpr,
    K_PAD: tl.constexpr,
):
    # one program, rows in a fixed order (deterministic): the counts, the row scale of the aggregation
    # (module docstring), the loss and the stats
    k = tl.arange(0, K_PAD)
    cols = tl.arange(0, BLOCK_B)
    acc = tl.zeros((K_PAD, BLOCK_B), tl.float32)
    acc_seqs = tl.zeros((BLOCK_B,), tl.float32)  # S = #{b: n_b > 0}
    acc_seq_loss = tl.zeros((BLOCK_B,), tl.float32)  # the loss of those rows
    for start in range(0, B, BLOCK_B):
        rows = start + cols
        tile = tl.load(partial_ptr + k[:, None] * B + rows[None, :], mask=(k[:, None] < K) & (rows[None, :] < B),
                       other=0.0)
        acc += tile
        n_b = tl.sum(tl.where(k[:, None] == 1, tile, 0.0), axis=0)
        nonempty = n_b > 0
        acc_seqs += tl.where(nonempty, 1.0, 0.0)
        acc_seq_loss += tl.where(nonempty, tl.sum(tl.where(k[:, None] == 0, tile, 0.0), axis=0), 0.0)
    sums = tl.sum(acc, axis=1)
    n = tl.sum(tl.where(k == 1, sums, 0.0), axis=0)
    if AGG < 2:  # token-mean, token-sum
        total = tl.sum(tl.where(k == 0, sums, 0.0), axis=0)
        count = n
    else:
        total = tl.sum(acc_seq_loss, axis=0)
        count = tl.sum(acc_seqs, axis=0)
    if HAS_GLOBAL:
        count = global_count + 0.0 * count
    c = dp_size + 0.0 * count
    if AGG != 1:
        c = tl.where(count > 0, dp_size / tl.where(count > 0, count, 1.0), 0.0)
    if AGG == 4:
        c = c / norm
    tl.store(loss_ptr, c * total)
    inv_n = tl.where(n > 0, 1.0 / tl.where(n > 0, n, 1.0), 0.0)
    tl.store(stats_ptr + k - 2, sums * inv_n, mask=(k >= 2) & (k < K))
    if PENDING:
        tl.store(factor_ptr, c)


@triton.jit
def _actor_loss_fwd_kernel(
    # pointers
    logits_ptr,  # [B, T, V] bf16/fp16/fp32, stride(-1) == 1
    labels_ptr,  # [B * T] int64; IGNORE_INDEX: logp 0, no gradient through it
    old_ptr,  # [B * T] fp32, read only if NEED_GRAD
    adv_ptr,  # [B * T] fp32, read only if NEED_GRAD
    mask_ptr,  # [B * T] fp32, read only if NEED_GRAD: a token with mask 0 gets no gradient
    weight_ptr,  # [B * T] fp32 w = row_scale * mask, read only if NEED_GRAD
    ref_ptr,  # [B * T] fp32, read only if NEED_GRAD and HAS_KL
    is_weights_ptr,  # [B * T] fp32, read only if NEED_GRAD and HAS_IS_WEIGHTS
    logp_ptr,  # [B * T] fp32 out
    entropy_ptr,  # [B * T] fp32 out
    dlogits_ptr,  # [B, T, V] logits dtype out, contiguous, written only if NEED_GRAD
    # shapes
    N,
    T,
    V,
    # strides
    stride_b,
    stride_t,
    # meta
    scale,  # fp32, log2(e) / temperature
    inv_temperature,  # fp32
    kl_coef,  # fp32, used only when HAS_KL
    kl_clamp,  # fp32, used only when HAS_KL_CLAMP
    entropy_coef,  # fp32, used only when HAS_ENTROPY
    ratio_low,  # fp32, 1 - clip_low; the policy-loss mode's scalars: kernels.policy_modes.SCALARS, each fp32
    ratio_high,
    clip_low,
    clip_high,
    dual_clip,
    delta,
    lr_min,
    lr_max,
    ratio_max,
    tau_pos,
    tau_neg,
    beta,
    ppo_kl_coef,
    k_pos,
    lambda_pos,
    k_neg,
    lambda_neg,
    FORMULA: tl.constexpr,  # the policy-loss mode: a token-local one (kernels.policy_modes), at the token level
    DUAL_CLIP: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_LR_MIN: tl.constexpr,
    HAS_LR_MAX: tl.constexpr,
    HAS_RATIO_MAX: tl.constexpr,
    HAS_IS_WEIGHTS: tl.constexpr,
    HAS_KL: tl.constexpr,  # a KL term in the gradient: ref_logp given and kl_coef != 0
    KL_ESTIMATOR: tl.constexpr,  # kernels.kl.ESTIMATOR_IDS
    HAS_KL_CLAMP: tl.constexpr,
    KL_STRAIGHT_THROUGH: tl.constexpr,  # the KL gradient is r = logp - ref_logp (that of r^2 / 2)
    HAS_ENTROPY: tl.constexpr,  # entropy_coef != 0
    NEED_GRAD: tl.constexpr,
    SAME_LAYOUT: tl.constexpr,  # the logits are contiguous (as d(logits)): both rows align alike
    ALIGN: tl.constexpr,  # logits in 16 bytes
    BLOCK_V: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,  # the grid (read by the launcher): 0 = one program per row, else k per SM
    # (k may be a fraction: 0.5 = one program per two SMs)
):
    # rows pid, pid + grid, ...: one each with a grid of N programs, several with a persistent grid
    for row in range(tl.program_id(0).to(tl.int64), N, tl.num_programs(0)):
        _actor_loss_row(logits_ptr, labels_ptr, old_ptr, adv_ptr, mask_ptr, weight_ptr, ref_ptr, is_weights_ptr,
                        logp_ptr, entropy_ptr, dlogits_ptr, row, T, V, stride_b, stride_t, scale, inv_temperature,
                        kl_coef, kl_clamp, entropy_coef, ratio_low, ratio_high, clip_low, clip_high, dual_clip, delta,
                        lr_min, lr_max, ratio_max, tau_pos, tau_neg, beta, ppo_kl_coef, k_pos, lambda_pos, k_neg,
                        lambda_neg, FORMULA, DUAL_CLIP, HAS_DELTA, HAS_LR_MIN, HAS_LR_MAX, HAS_RATIO_MAX,
                        HAS_IS_WEIGHTS, HAS_KL, KL_ESTIMATOR, HAS_KL_CLAMP, KL_STRAIGHT_THROUGH, HAS_ENTROPY, NEED_GRAD,
                        SAME_LAYOUT, ALIGN, BLOCK_V)


@triton.jit
def _row_stats(logits_ptr, row_off, src, n, n_full, cols, col, ok, scale, BLOCK_V: tl.constexpr):
    # pass 1 over a row: the base-2 online softmax stats (m, d, s) of kernels/logprobs.py, over the row's
    # aligned middle `src` [0, n) in BLOCK_V tiles and its ragged ends `col` (ok); the loads ask L2 to keep
    # the row for pass 2
    m = tl.full((), FP32_MIN, tl.float32)
    d = tl.zeros((), tl.float32)
    s = tl.zeros((), tl.float32)
    for k in range(0, n_full, BLOCK_V):
        x = tl.load(src + k + cols, eviction_policy="evict_last").to(tl.float32)
        m, d, s = _online_tile(x, m, d, s, scale, True)
    if n_full < n:
        x_tail = tl.load(src + n_full + cols, mask=n_full + cols < n, other=float("-inf"),
                         eviction_policy="evict_last")
        m, d, s = _online_tile(x_tail.to(tl.float32), m, d, s, scale, True)
    x_ends = tl.load(logits_ptr + row_off + col, mask=ok, other=float("-inf")).to(tl.float32)
    return _online_tile(x_ends, m, d, s, scale, True)


@triton.jit
def _token_logp(logits_ptr, row_off, label, V, inv_temperature, lse2):
    # logits[label] / temperature - lse: 0 for an ignored label, NaN for one outside [0, V)
    valid = (label >= 0) & (label < V)
    x_label = tl.load(logits_ptr + row_off + tl.where(valid, label, 0), mask=valid, other=0.0).to(tl.float32)
    logp = tl.where(valid, x_label * inv_temperature - lse2 * LN2, float("nan"))
    return tl.where(label == IGNORE, 0.0, logp)


@triton.jit
def _actor_token_grads(logp, entropy, row, old_ptr, adv_ptr, mask_ptr, weight_ptr, ref_ptr, is_weights_ptr, kl_coef,
                       kl_clamp, entropy_coef, ratio_low, ratio_high, clip_low, clip_high, dual_clip, delta, lr_min,
                       lr_max, ratio_max, tau_pos, tau_neg, beta, ppo_kl_coef, k_pos, lambda_pos, k_neg, lambda_neg,
                       FORMULA: tl.constexpr, DUAL_CLIP: tl.constexpr, HAS_DELTA: tl.constexpr,
                       HAS_LR_MIN: tl.constexpr, HAS_LR_MAX: tl.constexpr, HAS_RATIO_MAX: tl.constexpr,
                       HAS_IS_WEIGHTS: tl.constexpr, HAS_KL: tl.constexpr, KL_ESTIMATOR: tl.constexpr,
                       HAS_KL_CLAMP: tl.constexpr, KL_STRAIGHT_THROUGH: tl.constexpr, HAS_ENTROPY: tl.constexpr):
    # the token's upstream gradients, token-local once w is known:
    #   L = sum_i w_i (is_i pg_i + kl_coef kl_i - entropy_coef H_i);  returns (dL/dlogp, dL/dH), 0 under mask 0
    # pg_i is the token-local policy-loss mode FORMULA (kernels.policy_modes.policy_token, at the token level)
    counts = tl.load(mask_ptr + row) != 0.0  # a token with mask 0 gets exactly 0, whatever its inputs
    w = tl.load(weight_ptr + row)
    _, d_pg, _, _, _, _, _ = policy_token(
        logp, tl.load(old_ptr + row), tl.load(adv_ptr + row), 0.0, 0.0, 0.0, ratio_low, ratio_high, clip_low,
        clip_high, dual_clip, delta, lr_min, lr_max, ratio_max, tau_pos, tau_neg, beta, ppo_kl_coef, k_pos, lambda_pos,
        k_neg, lambda_neg, FORMULA, 0, DUAL_CLIP, HAS_DELTA, HAS_LR_MIN, HAS_LR_MAX, HAS_RATIO_MAX)
    pg_w = w
    if HAS_IS_WEIGHTS:
        pg_w = w * tl.load(is_weights_ptr + row)
    g_logp = pg_w * d_pg
    if HAS_KL:
        r = logp - tl.load(ref_ptr + row)
        if KL_STRAIGHT_THROUGH:  # the gradient of r^2 / 2
            d_kl = r
        else:
            d_kl = _kl_derivative(r, KL_ESTIMATOR, HAS_KL_CLAMP, kl_clamp)
        g_logp += kl_coef * w * d_kl
    g_logp = tl.where(counts, g_logp, 0.0)
    g_ent = tl.zeros((), tl.float32)
    if HAS_ENTROPY:
        g_ent = tl.where(counts, -entropy_coef * w, 0.0)
    return g_logp, g_ent


@triton.jit
def _write_dlogits(logits_ptr, dlogits_ptr, row, row_off, a, src, n, n_full, cols, col, ok, V, label, scale, lse2,
                   a_coef, b_coef, g_label, takes_grad, HAS_ENTROPY: tl.constexpr, SAME_LAYOUT: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    # pass 2, from the row's end back to its start (the tiles read last in pass 1 are the likeliest still in
    # L2): d(logits) = p (a + b t) [+ g_label at the label], written once and streamed out (evict first).
    # d(logits) is contiguous (or the logits themselves): with SAME_LAYOUT its rows align as theirs
    label_col = tl.where(takes_grad, label - (a - row_off), -1).to(tl.int32)  # from the aligned start
    drow_off = row * V
    dst = dlogits_ptr + (drow_off + (a - row_off))
    if SAME_LAYOUT:
        drow_off = row_off
        dst = dlogits_ptr + a  # as aligned as the loads
    out_ty = dlogits_ptr.dtype.element_ty
    if n_full < n:
        in_span = n_full + cols < n
        x_tail = tl.load(src + n_full + cols, mask=in_span, other=0.0, eviction_policy="evict_first")
        dz = _bwd_tile(x_tail.to(tl.float32), scale, lse2, 0.0, a_coef, b_coef, HAS_ENTROPY)
        dz += tl.where(cols == label_col - n_full, g_label, 0.0)
        tl.store(dst + n_full + cols, dz.to(out_ty), mask=in_span, eviction_policy="evict_first")
    for i in range(0, n_full // BLOCK_V):
        k = n_full - BLOCK_V - i * BLOCK_V
        x = tl.load(src + k + cols, eviction_policy="evict_first").to(tl.float32)
        dz = _bwd_tile(x, scale, lse2, 0.0, a_coef, b_coef, HAS_ENTROPY)
        dz += tl.where(cols == label_col - k, g_label, 0.0)
        tl.store(dst + k + cols, dz.to(out_ty), eviction_policy="evict_first")
    x_ends = tl.load(logits_ptr + row_off + col, mask=ok, other=0.0).to(tl.float32)
    dz = _bwd_tile(x_ends, scale, lse2, 0.0, a_coef, b_coef, HAS_ENTROPY)
    dz += tl.where(col == label, g_label, 0.0)  # g_label is 0 where the label takes no gradient
    tl.store(dlogits_ptr + drow_off + col, dz.to(out_ty), mask=ok)


@triton.jit
def _actor_loss_row(logits_ptr, labels_ptr, old_ptr, adv_ptr, mask_ptr, weight_ptr, ref_ptr, is_weights_ptr, logp_ptr,
                    entropy_ptr, dlogits_ptr, row, T, V, stride_b, stride_t, scale, inv_temperature, kl_coef, kl_clamp,
                    entropy_coef, ratio_low, ratio_high, clip_low, clip_high, dual_clip, delta, lr_min, lr_max,
                    ratio_max, tau_pos, tau_neg, beta, ppo_kl_coef, k_pos, lambda_pos, k_neg, lambda_neg,
                    FORMULA: tl.constexpr, DUAL_CLIP: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_LR_MIN: tl.constexpr,
                    HAS_LR_MAX: tl.constexpr, HAS_RATIO_MAX: tl.constexpr, HAS_IS_WEIGHTS: tl.constexpr,
                    HAS_KL: tl.constexpr, KL_ESTIMATOR: tl.constexpr, HAS_KL_CLAMP: tl.constexpr,
                    KL_STRAIGHT_THROUGH: tl.constexpr, HAS_ENTROPY: tl.constexpr, NEED_GRAD: tl.constexpr,
                    SAME_LAYOUT: tl.constexpr, ALIGN: tl.constexpr, BLOCK_V: tl.constexpr):
    # one token row of _actor_loss_fwd_kernel (its arguments), row an int64 index: the row is walked as in
    # kernels/logprobs.py, its 16-byte aligned middle in BLOCK_V tiles (the last one masked in whole 16-byte
    # groups), then its few ragged columns at either end
    row_off = (row // T) * stride_b + (row % T) * stride_t  # elements from logits_ptr, int64
    a, n = _aligned_span(row_off, 0, V, ALIGN)
    n_full = n // BLOCK_V * BLOCK_V
    cols = tl.arange(0, BLOCK_V)
    src = logits_ptr + a
    col, ok = _ragged_ends(0, V, a - row_off, n, ALIGN)
    m, d, s = _row_stats(logits_ptr, row_off, src, n, n_full, cols, col, ok, scale, BLOCK_V)  # pass 1
    log2_d = tl.log2(d)
    lse2 = m + log2_d  # lse / ln 2
    entropy = (log2_d - s / d) * LN2
    label = tl.load(labels_ptr + row)
    logp = _token_logp(logits_ptr, row_off, label, V, inv_temperature, lse2)
    tl.store(logp_ptr + row, logp)
    tl.store(entropy_ptr + row, entropy)
    if NEED_GRAD:
        g_logp, g_ent = _actor_token_grads(logp, entropy, row, old_ptr, adv_ptr, mask_ptr, weight_ptr, ref_ptr,
                                           is_weights_ptr, kl_coef, kl_clamp, entropy_coef, ratio_low, ratio_high,
                                           clip_low, clip_high, dual_clip, delta, lr_min, lr_max, ratio_max, tau_pos,
                                           tau_neg, beta, ppo_kl_coef, k_pos, lambda_pos, k_neg, lambda_neg, FORMULA,
                                           DUAL_CLIP, HAS_DELTA, HAS_LR_MIN, HAS_LR_MAX, HAS_RATIO_MAX,
                                           HAS_IS_WEIGHTS, HAS_KL, KL_ESTIMATOR, HAS_KL_CLAMP, KL_STRAIGHT_THROUGH,
                                           HAS_ENTROPY)
        # ignored and out-of-range labels have no log-prob, hence no gradient through it
        takes_grad = (label >= 0) & (label < V) & (label != IGNORE)
        g_logp = tl.where(takes_grad, g_logp, 0.0)
        # d(logits) = p (a + b t) [+ g_logp / temperature at the label], p = 2^t, t = y - lse / ln 2
        a_coef = -g_logp * inv_temperature
        b_coef = tl.zeros((), tl.float32)
        if HAS_ENTROPY:
            a_coef -= g_ent * entropy * inv_temperature
            b_coef = -g_ent * LN2 * inv_temperature
        _write_dlogits(logits_ptr, dlogits_ptr, row, row_off, a, src, n, n_full, cols, col, ok, V, label, scale, lse2,
                       a_coef, b_coef, g_logp * inv_temperature, takes_grad, HAS_ENTROPY, SAME_LAYOUT, BLOCK_V)


@triton.jit
def _scale_unless_one_kernel(
    # pointers
    x_ptr,  # [N] any float dtype, contiguous
    g_ptr,  # [] any float dtype: the upstream gradient
    factor_ptr,  # [1] fp32, read only if HAS_FACTOR: a factor the forward left to the backward
    out_ptr,  # [N] any float dtype, contiguous; may be x_ptr (in place)
    # shapes
    N,
    # meta
    HAS_FACTOR: tl.constexpr,
    INPLACE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # out = x * g [* factor] in float32, rounded once to out's dtype; in place nothing is read or written
    # when the product is 1 (x * 1 == x exactly). A grid-stride loop over blocks, so a skipped call costs
    # one launch of a few programs, not one program per block
    g = tl.load(g_ptr).to(tl.float32)
    if HAS_FACTOR:
        g = g * tl.load(factor_ptr)
    if (g != 1.0) or (not INPLACE):
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, N, step):  # int64: N may pass 2^31
            offs = start + tl.arange(0, BLOCK)
            inb = offs < N
            x = tl.load(x_ptr + offs, mask=inb, other=0.0)
            tl.store(out_ptr + offs, _rounded(x.to(tl.float32) * g, out_ptr.dtype.element_ty), mask=inb)


# the fused actor loss, autotuned on CUDA for V >= TUNE_MIN_V (module docstring); it writes only its outputs,
# so the tuner may run it once per config
_actor_loss_tuned = triton.autotune(configs=ACTOR_CONFIGS, key=["V", "NEED_GRAD", "HAS_ENTROPY"])(
    _actor_loss_fwd_kernel)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """x with stride(-1) == 1: itself, or a contiguous copy (rows may have any stride)."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _block_t(T: int) -> int:
    return min(next_power_of_2(T), _MAX_BLOCK_T)


def _finish(partial: torch.Tensor, B: int, T: int, spec: AggLaunch, loss: torch.Tensor, stats: torch.Tensor,
            factor: torch.Tensor | None) -> None:
    K = partial.shape[0]
    _loss_finish_kernel[(1,)](
        partial, loss, stats, partial if factor is None else factor, B,
        spec.global_count, spec.dp_size, spec.norm if spec.norm is not None else float(max(T, 1)),
        K=K, AGG=spec.agg_id, HAS_GLOBAL=spec.has_global, PENDING=factor is not None,
        BLOCK_B=min(next_power_of_2(B), _FINISH_BLOCK_B), K_PAD=next_power_of_2(K), num_warps=4)


def _outputs(x: torch.Tensor, n_stats: int, n_sums: int, spec: AggLaunch, need_grad: bool, out_dtype):
    """(loss [], stats [n_stats], d [B, T] or None, factor [1] or None, partial [n_sums, B])."""
    B, T = x.shape
    device = x.device
    loss = torch.empty((), dtype=out_dtype, device=device)
    stats = torch.empty(n_stats, dtype=out_dtype, device=device)
    d = torch.empty((B, T), dtype=out_dtype, device=device) if need_grad else None
    factor = torch.empty(1, dtype=torch.float32, device=device) if need_grad and spec.pending else None
    partial = torch.empty((n_sums, B), dtype=torch.float32, device=device)
    return loss, stats, d, factor, partial


def policy_loss_fwd(logp, old_logp, advantages, mask, is_weights, *, mode: ModeLaunch, spec: AggLaunch,
                    need_grad: bool, out_dtype=torch.float32, weight=None, selected=None, sampler_weights=None):
    """[B, T] inputs with stride(1) == 1 (any row strides); `mode` the policy-loss mode
    (kernels.policy_modes.mode_launch), `selected` its batch-wide selection (clip_cov / kl_cov, bool),
    `sampler_weights` vespo's. Returns (loss [], stats [5] = clipfrac, clipfrac_lower, approx_kl,
    approx_kl_unclamped, the mode's extra stat (masked means), d(loss)/d(logp) [B, T] or None, factor [1] or
    None): the main kernel, then the one-program finish kernel. d(logp) holds every factor of the row scale
    known at launch; `factor` (spec.pending) is the count's, applied by `scale_unless_one_`. With `weight`
    ([B, T] fp32 row_scale * mask, the actor loss's) the per-token weights are given: spec must be token-sum
    with dp_size 1."""
    B, T = logp.shape
    logp, old_logp, advantages, mask = (_unit_last(x) for x in (logp, old_logp, advantages, mask))
    is_weights, weight, selected, sampler_weights = (None if x is None else _unit_last(x)
                                                     for x in (is_weights, weight, selected, sampler_weights))
    loss, stats, d, factor, partial = _outputs(logp, len(POLICY_SUMS) - 2, len(POLICY_SUMS), spec, need_grad,
                                               out_dtype)
    if B:
        stride = lambda x: 0 if x is None else x.stride(0)  # noqa: E731
        _policy_loss_fwd_kernel[(B,)](
            logp, old_logp, advantages, as_loadable(mask), logp if weight is None else weight,
            logp if is_weights is None else is_weights, mask if selected is None else as_loadable(selected),
            logp if sampler_weights is None else sampler_weights,  # each read only when given
            partial if d is None else d, partial,  # d never written without NEED_GRAD
            B, T, logp.stride(0), old_logp.stride(0), advantages.stride(0), mask.stride(0), stride(weight),
            stride(is_weights), stride(selected), stride(sampler_weights),
            spec.grad_scale, *mode.scalars,
            FORMULA=mode.formula, LEVEL=mode.level, DUAL_CLIP=mode.dual_clip, HAS_DELTA=mode.has_delta,
            HAS_LR_MIN=mode.has_lr_min, HAS_LR_MAX=mode.has_lr_max, HAS_RATIO_MAX=mode.has_ratio_max,
            ROW_STAT=mode.row_stat, ROW_GRAD=mode.row_grad, HAS_IS_WEIGHTS=is_weights is not None,
            HAS_SAMPLER=sampler_weights is not None, WEIGHTED=weight is not None, NEED_GRAD=need_grad,
            ROW_MEAN=spec.row_mean, BLOCK_T=_block_t(T))
    _finish(partial, B, T, spec, loss, stats, factor)
    return loss, stats, d, factor


def value_loss_fwd(values, old_values, returns, mask, *, clip: float | None, spec: AggLaunch, need_grad: bool,
                   out_dtype=torch.float32):
    """As `policy_loss_fwd` for the clipped value loss (0.5 included): stats [1] = clipfrac."""
    B, T = values.shape
    values, old_values, returns, mask = (_unit_last(x) for x in (values, old_values, returns, mask))
    loss, stats, d, factor, partial = _outputs(values, len(VALUE_SUMS) - 2, len(VALUE_SUMS), spec, need_grad,
                                               out_dtype)
    if B:
        _value_loss_fwd_kernel[(B,)](
            values, old_values, returns, as_loadable(mask), partial if d is None else d, partial,
            B, T, values.stride(0), old_values.stride(0), returns.stride(0), mask.stride(0),
            spec.grad_scale, 0.0 if clip is None else clip,
            HAS_CLIP=clip is not None, NEED_GRAD=need_grad, ROW_MEAN=spec.row_mean, BLOCK_T=_block_t(T))
    _finish(partial, B, T, spec, loss, stats, factor)
    return loss, stats, d, factor


@functools.cache
def actor_config(V: int, device: torch.device) -> dict:
    """The fused actor loss's untuned launch (CPU, and V < TUNE_MIN_V on CUDA): one program per row,
    the log-prob kernels' fixed tile (up to ACTOR_CONFIGS[0]'s on CUDA)."""
    config = fixed_config(V)
    if device.type == "cuda":
        block_v = min(ACTOR_CONFIGS[0].kwargs["BLOCK_V"], next_power_of_2(V))
        config = {"BLOCK_V": block_v, "num_warps": 8 if block_v >= 2048 else 4}
    return config | {"PROGRAMS_PER_SM": 0}


@functools.cache
def _actor_grid(N: int, programs_per_sm: float, device: torch.device) -> tuple[int]:
    """(programs,): one per row for programs_per_sm == 0, else programs_per_sm x SMs (a fraction
    allowed), at least 1 and at most N."""
    if programs_per_sm == 0:
        return (N,)
    return (max(1, min(N, int(programs_per_sm * sm_count(device)))),)


def actor_loss_fwd(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor,
    ref_logp: torch.Tensor | None,
    is_weights: torch.Tensor | None,
    *,
    spec,
    need_grad: bool,
    inplace: bool = False,
):
    """The fused actor loss over logits [B, T, V] (stride(-1) == 1), per-token fp32 [B * T] inputs
    (weight = row_scale * mask), `spec` the options (fastrlhf.ops.losses.ActorSpec: temperature, clips, KL,
    entropy; read by attribute). Returns (logp fp32 [B * T], entropy fp32 [B * T], d(logits)
    [B, T, V] contiguous in logits.dtype or None): d(logits) is the gradient of
    L = sum_i w_i (is_i pg_i + kl_coef kl_i - entropy_coef H_i), formed in the same launch.
    inplace=True writes d(logits) over contiguous logits (each row is read in full before any of it
    is written) and returns them; that launch is never autotuned (the tuner runs it once per config)."""
    B, T, V = logits.shape
    N = B * T
    device = logits.device
    if logits.stride(-1) != 1 or labels.shape != (N,) or labels.dtype != torch.int64:
        raise ValueError(f"actor_loss_fwd: logits [B, T, V] with stride(-1) == 1 and labels int64 [B * T], got "
                         f"{tuple(logits.shape)} strides {logits.stride()}, labels {labels.dtype} "
                         f"{tuple(labels.shape)}")
    if inplace and not logits.is_contiguous():
        raise ValueError("actor_loss_fwd: inplace=True needs contiguous logits")
    logp = torch.empty(N, dtype=torch.float32, device=device)
    entropy = torch.empty(N, dtype=torch.float32, device=device)
    d_logits = None
    if need_grad:
        d_logits = logits if inplace else torch.empty((B, T, V), dtype=logits.dtype, device=device)
    if N == 0:
        return logp, entropy, d_logits
    has_kl = ref_logp is not None and spec.kl_coef != 0.0
    mode = mode_launch(spec.policy)
    if not mode.token_local:
        raise ValueError(f"actor_loss_fwd: loss_mode {spec.policy.mode!r} at ratio level {spec.policy.ratio_level!r} "
                         f"is not token-local (ops.losses runs it as a log-prob forward, the policy-loss kernel and a "
                         f"log-prob backward)")
    if logits.is_cuda and V >= TUNE_MIN_V and not inplace:
        kernel, config = _actor_loss_tuned, {}
        grid = lambda meta: _actor_grid(N, meta["PROGRAMS_PER_SM"], device)  # noqa: E731
    else:
        config = actor_config(V, device)
        kernel, grid = _actor_loss_fwd_kernel, _actor_grid(N, config["PROGRAMS_PER_SM"], device)
    kernel[grid](
        logits, labels, old_logp, advantages, mask, weight,
        ref_logp if has_kl else old_logp,  # never read without HAS_KL
        is_weights if is_weights is not None else old_logp,  # never read without HAS_IS_WEIGHTS
        logp, entropy,
        d_logits if need_grad else logits,  # never written without NEED_GRAD
        N, T, V,
        logits.stride(0), logits.stride(1),
        LOG2E / spec.temperature, 1.0 / spec.temperature, float(spec.kl_coef),
        0.0 if spec.kl_clamp is None else spec.kl_clamp, float(spec.entropy_coef), *mode.scalars,
        FORMULA=mode.formula, DUAL_CLIP=mode.dual_clip, HAS_DELTA=mode.has_delta, HAS_LR_MIN=mode.has_lr_min,
        HAS_LR_MAX=mode.has_lr_max, HAS_RATIO_MAX=mode.has_ratio_max, HAS_IS_WEIGHTS=is_weights is not None,
        HAS_KL=has_kl,
        KL_ESTIMATOR=ESTIMATOR_IDS[spec.kl_estimator], HAS_KL_CLAMP=spec.kl_clamp is not None,
        KL_STRAIGHT_THROUGH=bool(spec.kl_straight_through), HAS_ENTROPY=spec.entropy_coef != 0.0, NEED_GRAD=need_grad,
        SAME_LAYOUT=logits.is_contiguous(), ALIGN=16 // logits.element_size(), **config,
    )
    return logp, entropy, d_logits


def scale_unless_one_(x: torch.Tensor, g: torch.Tensor, factor: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """x * g [* factor] (g one element of any float dtype, factor fp32 [1]) for a contiguous x, without a host
    sync: in place (out None), no read or write of x when the product is 1 (the common `loss.backward()`);
    else into `out` (contiguous, x's shape, any float dtype). Returns the result."""
    n = x.numel()
    dst = x if out is None else out
    if n:
        # enough programs to stream x when it is scaled, few enough that a skipped call is one wave
        programs = min(cdiv(n, _SCALE_BLOCK), 8 * sm_count(x.device))
        _scale_unless_one_kernel[(programs,)](x, g, x if factor is None else factor, dst, n,
                                              HAS_FACTOR=factor is not None, INPLACE=out is None,
                                              BLOCK=_SCALE_BLOCK, num_warps=8)
    return dst
