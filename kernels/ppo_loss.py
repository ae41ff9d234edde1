"""Clipped PPO losses: one kernel per formula, forward and gradient in the same pass.

Every aggregation mode reduces to per-row weights (computed by `fastrlhf.ops`):
    loss = sum_b row_scale[b] * sum_t m[b, t] * l[b, t],   d_x[b, t] = row_scale[b] * m[b, t] * dl/dx
(the policy loss optionally times per-token importance weights). A token with m = 0 adds exactly
0 and gets gradient 0, whatever (NaN, inf) its inputs hold.
Each program writes its partial sums to its own slot of a buffer which torch then sums, so the
result is deterministic (no float atomics).

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

Where fast: elementwise and memory-bound; one program per (row, block of T), so the grid is
B * cdiv(T, BLOCK_T) in x only (fine up to 2^31 - 1 programs). Short rows (T << BLOCK_T) leave
lanes idle: BLOCK_T is the next power of two of T, capped at 1024.

The whole actor loss from logits (`_actor_loss_fwd_kernel`): every term of
    L = sum_i w_i (is_i pg(logp_i) + kl_coef KL(logp_i) - entropy_coef H_i),  w = row_scale * mask
is token-local once w is known, so one program per token row does it all in one launch:
    pass 1  read the row: lse, entropy, logp (the base-2 online softmax of kernels/logprobs.py)
    then    dL/dlogp and dL/dH of the token (the policy and KL formulas above and in kernels/kl.py)
    pass 2  read the row again, write d(logits) = p (a + b t) [+ g_logp / temperature at the label]
instead of a log-prob forward, torch glue, and a log-prob backward that re-reads the logits from
DRAM. The bet (to be measured, `fastrlhf bench`: ppo_actor_loss fwd+bwd vs logprobs fwd+bwd): pass 2
walks the row from its end with L2 hints (pass-1 loads evict-last, pass-2 loads and the d(logits)
stores evict-first), so the tiles read last are re-read from L2 rather than DRAM. The hit rate is
about L2 / (rows in flight x row bytes): a row is 297 KiB at V = 151936 in bf16, an H100's L2 50 MB.
One program per row, at 127 registers x 256 threads two per SM, keeps ~264 rows, ~78 MB, in
flight: ~60% of pass 2 from L2, ~2.4 passes of DRAM traffic instead of 3. A persistent grid (the
kernel walks rows pid, pid + grid, ...) of 1 program per SM keeps 39 MB in flight (nearly all of
pass 2 from L2; the 0.75 target needs ~75%) but half the bytes in flight to hide DRAM latency;
2 per SM is the one-row-per-program occupancy without the tail effect of 16k short-lived programs.
Measured on an H100 (B = 16, T = 1024, V = 151936 bf16, autotuned among the first three configs,
the winner not recorded): fwd+bwd 0.977x logprobs fwd+bwd, so pass 2 costs about a full DRAM read
and write, not L2 hits. Possible reasons (not measured): even 39 MB of rows in flight, next to the
streamed d(logits) stores, is more than L2 (two partitions of 25 MB) keeps under an evict-last hint.
So the list also offers persistent grids of fewer programs than SMs: 0.5 per SM (66 rows, ~20 MB in
flight on 132 SMs) and 0.25 (33 rows, ~10 MB). The prediction: these re-read most of pass 2 from L2,
at the cost of fewer bytes in flight per SM to hide DRAM latency in pass 1; which effect wins is for
the tuner (and the bench, which records the config it picked) to tell.
On CUDA for V >= TUNE_MIN_V the launch is autotuned among ACTOR_CONFIGS (tile x
warps x programs per SM, keyed on V, NEED_GRAD, HAS_ENTROPY and dtypes): one program per row with
8192 x 8, two per SM with 8192 x 8, then 16384 x 16 (32 logits per thread) at one, one half and one
quarter program per SM (at least one program).
Elsewhere: one program per row, the log-prob kernels' fixed tile (8192 at most on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fastrlhf.kernels._masks import as_loadable
from fastrlhf.kernels.kl import ESTIMATOR_IDS, _kl_derivative
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

from fastrlhf.constants import IGNORE_INDEX, LOG_RATIO_CLAMP

LR_CLAMP = tl.constexpr(LOG_RATIO_CLAMP)  # |log-ratio| bound inside exp
_MAX_BLOCK_T = 1024
# the fused actor loss on CUDA: tile x warps x grid, autotuned among these (module docstring)
ACTOR_CONFIGS = [triton.Config({"BLOCK_V": block_v, "PROGRAMS_PER_SM": per_sm}, num_warps=warps)
                 for block_v, warps, per_sm in ((8192, 8, 0), (8192, 8, 2), (16384, 16, 1), (16384, 16, 0.5),
                                                (16384, 16, 0.25))]
IGNORE = tl.constexpr(IGNORE_INDEX)
POLICY_SUMS = ("loss", "n_clipped", "n_clipped_lower", "neg_log_ratio", "n_mask", "neg_log_ratio_unclamped")
VALUE_SUMS = ("loss", "n_clipped", "n_mask")


@triton.jit
def _policy_token(x, a, lo, hi, dual_clip, DUAL_CLIP: tl.constexpr):
    # verl's vanilla clipped loss at x = logp - old_logp (module docstring), advantage a:
    # (loss, dloss/dx, clipped = [l2 > l1], lower = dual-clipped, log_ratio)
    log_ratio = tl.minimum(tl.maximum(x, -LR_CLAMP), LR_CLAMP)
    ratio = tl.exp(log_ratio)
    l1 = -a * ratio
    l2 = -a * tl.minimum(tl.maximum(ratio, lo), hi)
    takes_l2 = l2 > l1  # max(l1, l2); a tie goes to the unclipped l1
    loss = tl.where(takes_l2, l2, l1)
    lower = tl.zeros_like(takes_l2)
    if DUAL_CLIP:
        l3 = -a * dual_clip
        lower = (a < 0) & (loss > l3)  # min(loss, l3) where A < 0; a tie goes to loss
        loss = tl.where(lower, l3, loss)
    # dl1/dratio = -A; dl2/dratio = -A * [lo <= ratio <= hi]; dratio/dx = ratio * [|x| <= 20];
    # the dual-clip term -A c is constant
    in_clip = (ratio >= lo) & (ratio <= hi)
    d_ratio = tl.where(takes_l2 & ~in_clip, 0.0, -a)
    in_lr = (x >= -LR_CLAMP) & (x <= LR_CLAMP)
    d = tl.where(in_lr & ~lower, d_ratio * ratio, 0.0)
    return loss, d, takes_l2, lower, log_ratio


@triton.jit
def _policy_loss_fwd_kernel(
    # pointers
    logp_ptr,  # [B, T] fp32/bf16/fp16, contiguous
    old_ptr,  # [B, T] fp32/bf16/fp16, contiguous
    adv_ptr,  # [B, T] fp32/bf16/fp16, contiguous
    mask_ptr,  # [B, T] bool (as int8) or float, contiguous
    scale_ptr,  # [B] fp32 per-row weight of the aggregation
    is_weights_ptr,  # [B, T] fp32/bf16/fp16, contiguous, read only if HAS_IS_WEIGHTS
    partial_ptr,  # [6, n_programs] fp32 out: see POLICY_SUMS
    dlogp_ptr,  # [B, T] fp32 out, written when NEED_GRAD
    # shapes
    T,
    n_programs,
    # meta
    ratio_low,  # fp32, 1 - clip_low
    ratio_high,  # fp32, 1 + clip_high
    dual_clip,  # fp32, used only when DUAL_CLIP
    DUAL_CLIP: tl.constexpr,
    HAS_IS_WEIGHTS: tl.constexpr,
    NEED_GRAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    blocks_per_row = tl.cdiv(T, BLOCK_T)
    row = (pid // blocks_per_row).to(tl.int64)
    t = (pid % blocks_per_row) * BLOCK_T + tl.arange(0, BLOCK_T)
    inb = t < T
    offs = row * T + t
    m = tl.load(mask_ptr + offs, mask=inb, other=0).to(tl.float32)
    x = tl.load(logp_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    x -= tl.load(old_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    a = tl.load(adv_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    counts = m != 0.0  # a token under mask = 0 adds exactly 0, whatever (NaN, inf) its inputs hold
    w = tl.load(scale_ptr + row) * m
    if HAS_IS_WEIGHTS:  # the policy term of each token times its importance weight
        w = w * tl.load(is_weights_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    loss, d, takes_l2, lower, log_ratio = _policy_token(x, a, ratio_low, ratio_high, dual_clip, DUAL_CLIP)

    tl.store(partial_ptr + pid, tl.sum(tl.where(counts, w * loss, 0.0), axis=0))
    tl.store(partial_ptr + n_programs + pid, tl.sum(tl.where(takes_l2 & counts, m, 0.0), axis=0))
    tl.store(partial_ptr + 2 * n_programs + pid, tl.sum(tl.where(lower & counts, m, 0.0), axis=0))
    tl.store(partial_ptr + 3 * n_programs + pid, tl.sum(tl.where(counts, -log_ratio * m, 0.0), axis=0))
    tl.store(partial_ptr + 4 * n_programs + pid, tl.sum(m, axis=0))
    tl.store(partial_ptr + 5 * n_programs + pid, tl.sum(tl.where(counts, -x * m, 0.0), axis=0))

    if NEED_GRAD:
        tl.store(dlogp_ptr + offs, tl.where(counts, w * d, 0.0), mask=inb)


@triton.jit
def _value_loss_fwd_kernel(
    # pointers
    values_ptr,  # [B, T] fp32/bf16/fp16, contiguous
    old_ptr,  # [B, T] fp32/bf16/fp16, contiguous
    returns_ptr,  # [B, T] fp32/bf16/fp16, contiguous
    mask_ptr,  # [B, T] bool (as int8) or float, contiguous
    scale_ptr,  # [B] fp32 per-row weight of the aggregation
    partial_ptr,  # [3, n_programs] fp32 out: see VALUE_SUMS
    dvalues_ptr,  # [B, T] fp32 out, written when NEED_GRAD
    # shapes
    T,
    n_programs,
    # meta
    clip,  # fp32, used only when HAS_CLIP
    HAS_CLIP: tl.constexpr,
    NEED_GRAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    blocks_per_row = tl.cdiv(T, BLOCK_T)
    row = (pid // blocks_per_row).to(tl.int64)
    t = (pid % blocks_per_row) * BLOCK_T + tl.arange(0, BLOCK_T)
    inb = t < T
    offs = row * T + t
    m = tl.load(mask_ptr + offs, mask=inb, other=0).to(tl.float32)
    v = tl.load(values_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    ret = tl.load(returns_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    counts = m != 0.0  # a token under mask = 0 adds exactly 0, whatever (NaN, inf) its inputs hold
    w = tl.load(scale_ptr + row) * m

    err1 = v - ret
    l1 = err1 * err1
    if HAS_CLIP:
        c = clip  # fp32 scalar
        v_low = old - c
        v_high = old + c
        v_clip = tl.minimum(tl.maximum(v, v_low), v_high)
        err2 = v_clip - ret
        l2 = err2 * err2
        takes_l2 = l2 > l1  # max(l1, l2); a tie goes to the unclipped l1
        loss = tl.where(takes_l2, l2, l1)
        n_clipped = tl.sum(tl.where(takes_l2 & counts, m, 0.0), axis=0)
    else:
        loss = l1
        n_clipped = 0.0
    tl.store(partial_ptr + pid, tl.sum(tl.where(counts, 0.5 * w * loss, 0.0), axis=0))
    tl.store(partial_ptr + n_programs + pid, n_clipped)
    tl.store(partial_ptr + 2 * n_programs + pid, tl.sum(m, axis=0))

    if NEED_GRAD:
        # d(0.5 (v - R)^2)/dv = v - R
        # d(0.5 (v_clip - R)^2)/dv = (v_clip - R) * [old - clip <= v <= old + clip]
        if HAS_CLIP:
            in_clip = (v >= v_low) & (v <= v_high)
            d = tl.where(takes_l2, tl.where(in_clip, err2, 0.0), err1)
        else:
            d = err1
        tl.store(dvalues_ptr + offs, tl.where(counts, w * d, 0.0), mask=inb)


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
    ratio_low,  # fp32, 1 - clip_low
    ratio_high,  # fp32, 1 + clip_high
    dual_clip,  # fp32, used only when DUAL_CLIP
    kl_coef,  # fp32, used only when HAS_KL
    kl_clamp,  # fp32, used only when HAS_KL_CLAMP
    entropy_coef,  # fp32, used only when HAS_ENTROPY
    DUAL_CLIP: tl.constexpr,
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
                        ratio_low, ratio_high, dual_clip, kl_coef, kl_clamp, entropy_coef, DUAL_CLIP, HAS_IS_WEIGHTS,
                        HAS_KL, KL_ESTIMATOR, HAS_KL_CLAMP, KL_STRAIGHT_THROUGH, HAS_ENTROPY, NEED_GRAD, SAME_LAYOUT,
                        ALIGN, BLOCK_V)


@triton.jit
def _actor_loss_row(logits_ptr, labels_ptr, old_ptr, adv_ptr, mask_ptr, weight_ptr, ref_ptr, is_weights_ptr, logp_ptr,
                    entropy_ptr, dlogits_ptr, row, T, V, stride_b, stride_t, scale, inv_temperature, ratio_low,
                    ratio_high, dual_clip, kl_coef, kl_clamp, entropy_coef, DUAL_CLIP: tl.constexpr,
                    HAS_IS_WEIGHTS: tl.constexpr, HAS_KL: tl.constexpr, KL_ESTIMATOR: tl.constexpr,
                    HAS_KL_CLAMP: tl.constexpr, KL_STRAIGHT_THROUGH: tl.constexpr, HAS_ENTROPY: tl.constexpr,
                    NEED_GRAD: tl.constexpr, SAME_LAYOUT: tl.constexpr, ALIGN: tl.constexpr, BLOCK_V: tl.constexpr):
    # one token row of _actor_loss_fwd_kernel (its arguments), row an int64 index. The row is walked as
    # in kernels/logprobs.py: its 16-byte aligned middle in BLOCK_V tiles (the last one masked in whole
    # 16-byte groups), then its few ragged columns at either end
    row_off = (row // T) * stride_b + (row % T) * stride_t  # elements from logits_ptr, int64
    a, n = _aligned_span(row_off, 0, V, ALIGN)
    n_full = n // BLOCK_V * BLOCK_V
    cols = tl.arange(0, BLOCK_V)
    src = logits_ptr + a
    col, ok = _ragged_ends(0, V, a - row_off, n, ALIGN)

    # pass 1: lse, entropy, logp (base 2, kernels/logprobs.py); these loads ask L2 to keep the row
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
    m, d, s = _online_tile(x_ends, m, d, s, scale, True)
    log2_d = tl.log2(d)
    lse2 = m + log2_d  # lse / ln 2
    entropy = (log2_d - s / d) * LN2
    label = tl.load(labels_ptr + row)
    valid = (label >= 0) & (label < V)
    x_label = tl.load(logits_ptr + row_off + tl.where(valid, label, 0), mask=valid, other=0.0).to(tl.float32)
    logp = tl.where(valid, x_label * inv_temperature - lse2 * LN2, float("nan"))
    logp = tl.where(label == IGNORE, 0.0, logp)
    tl.store(logp_ptr + row, logp)
    tl.store(entropy_ptr + row, entropy)

    if NEED_GRAD:
        # the token's upstream gradients, dL/dlogp and dL/dH: token-local once w is known
        # L = sum_i w_i (is_i pg_i + kl_coef kl_i - entropy_coef H_i)
        counts = tl.load(mask_ptr + row) != 0.0  # a token with mask 0 gets exactly 0, whatever its inputs
        w = tl.load(weight_ptr + row)
        _, d_pg, _, _, _ = _policy_token(logp - tl.load(old_ptr + row), tl.load(adv_ptr + row), ratio_low,
                                         ratio_high, dual_clip, DUAL_CLIP)
        pg_w = w
        if HAS_IS_WEIGHTS:
            pg_w = w * tl.load(is_weights_ptr + row)
        g_logp = pg_w * d_pg
        if HAS_KL:
            r = logp - tl.load(ref_ptr + row)
            if KL_STRAIGHT_THROUGH:
                d_kl = r
            else:
                d_kl = _kl_derivative(r, KL_ESTIMATOR, HAS_KL_CLAMP, kl_clamp)
            g_logp += kl_coef * w * d_kl
        # ignored and out-of-range labels have no log-prob, hence no gradient through it
        takes_grad = counts & valid & (label != IGNORE)
        g_logp = tl.where(takes_grad, g_logp, 0.0)
        # d(logits) = p (a + b t) [+ g_logp / temperature at the label], p = 2^t, t = y - lse / ln 2
        a_coef = -g_logp * inv_temperature
        b_coef = tl.zeros((), tl.float32)
        if HAS_ENTROPY:
            g_ent = tl.where(counts, -entropy_coef * w, 0.0)
            a_coef -= g_ent * entropy * inv_temperature
            b_coef = -g_ent * LN2 * inv_temperature
        g_label = g_logp * inv_temperature
        label_col = tl.where(takes_grad, label - (a - row_off), -1).to(tl.int32)  # from the aligned start

        # pass 2, from the row's end back to its start: the tiles read last in pass 1 are the likeliest
        # still in L2; d(logits) is written once and streamed out (evict first). d(logits) is contiguous
        # (or the logits themselves): with SAME_LAYOUT (contiguous logits) its rows align as theirs.
        drow_off = row * V
        dst = dlogits_ptr + (drow_off + (a - row_off))
        if SAME_LAYOUT:
            drow_off = row_off
            dst = dlogits_ptr + a  # as aligned as the loads
        out_ty = dlogits_ptr.dtype.element_ty
        if n_full < n:
            in_span = n_full + cols < n
            x_tail = tl.load(src + n_full + cols, mask=in_span, other=0.0, eviction_policy="evict_first")
            dz = _bwd_tile(x_tail.to(tl.float32), scale, lse2, a_coef, b_coef, HAS_ENTROPY)
            dz += tl.where(cols == label_col - n_full, g_label, 0.0)
            tl.store(dst + n_full + cols, dz.to(out_ty), mask=in_span, eviction_policy="evict_first")
        for i in range(0, n_full // BLOCK_V):
            k = n_full - BLOCK_V - i * BLOCK_V
            x = tl.load(src + k + cols, eviction_policy="evict_first").to(tl.float32)
            dz = _bwd_tile(x, scale, lse2, a_coef, b_coef, HAS_ENTROPY)
            dz += tl.where(cols == label_col - k, g_label, 0.0)
            tl.store(dst + k + cols, dz.to(out_ty), eviction_policy="evict_first")
        x_ends = tl.load(logits_ptr + row_off + col, mask=ok, other=0.0).to(tl.float32)
        dz = _bwd_tile(x_ends, scale, lse2, a_coef, b_coef, HAS_ENTROPY)
        dz += tl.where(col == label, g_label, 0.0)  # g_label is 0 where the label takes no gradient
        tl.store(dlogits_ptr + drow_off + col, dz.to(out_ty), mask=ok)


@triton.jit
def _scale_unless_one_kernel(
    # pointers
    x_ptr,  # [N] any float dtype, scaled in place
    g_ptr,  # [] fp32: the factor
    # shapes
    N,
    # meta
    BLOCK: tl.constexpr,
):
    # x *= g, skipped when g == 1 (x * 1 == x exactly): a grid-stride loop over blocks, so a
    # skipped call costs one launch of a few programs, not one program per block
    g = tl.load(g_ptr)
    if g != 1.0:
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, N, step):  # int64: N may pass 2^31
            offs = start + tl.arange(0, BLOCK)
            inb = offs < N
            x = tl.load(x_ptr + offs, mask=inb, other=0.0)
            tl.store(x_ptr + offs, (x.to(tl.float32) * g).to(x_ptr.dtype.element_ty), mask=inb)


# the fused actor loss, autotuned on CUDA for V >= TUNE_MIN_V (module docstring); it writes only its outputs,
# so the tuner may run it once per config
_actor_loss_tuned = triton.autotune(configs=ACTOR_CONFIGS, key=["V", "NEED_GRAD", "HAS_ENTROPY"])(
    _actor_loss_fwd_kernel)


def _grid(B: int, T: int) -> tuple[int, int]:
    block_t = min(triton.next_power_of_2(max(T, 1)), _MAX_BLOCK_T)
    return B * triton.cdiv(T, block_t), block_t


def policy_loss_fwd(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    row_scale: torch.Tensor,
    is_weights: torch.Tensor | None = None,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    need_grad: bool,
):
    """Returns (sums fp32 [6] = POLICY_SUMS, d_logp fp32 [B, T] or None).

    sums: the weighted loss (row_scale[b] * mask * is_weights), then over mask (not weighted):
    clipped count, dual-clipped count, sum of -log_ratio, the token count, sum of -(logp - old_logp)
    (the log-ratio before its +-20 clamp).
    """
    B, T = logp.shape
    device = logp.device
    d_logp = torch.empty((B, T), dtype=torch.float32, device=device) if need_grad else None
    n_programs, block_t = _grid(B, T)
    if n_programs == 0:
        return torch.zeros(len(POLICY_SUMS), dtype=torch.float32, device=device), d_logp
    partials = torch.empty((len(POLICY_SUMS), n_programs), dtype=torch.float32, device=device)
    _policy_loss_fwd_kernel[(n_programs,)](
        logp,
        old_logp,
        advantages,
        as_loadable(mask),
        row_scale,
        is_weights if is_weights is not None else row_scale,  # never read without HAS_IS_WEIGHTS
        partials,
        d_logp if need_grad else partials,  # never written without NEED_GRAD
        T,
        n_programs,
        1.0 - float(clip_low),
        1.0 + float(clip_high),
        float(dual_clip if dual_clip is not None else 0.0),
        DUAL_CLIP=dual_clip is not None,
        HAS_IS_WEIGHTS=is_weights is not None,
        NEED_GRAD=need_grad,
        BLOCK_T=block_t,
    )
    return partials.sum(1), d_logp


def value_loss_fwd(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    row_scale: torch.Tensor,
    *,
    clip: float | None,
    need_grad: bool,
):
    """Returns (sums fp32 [3] = VALUE_SUMS, d_values fp32 [B, T] or None); the loss includes 0.5."""
    B, T = values.shape
    device = values.device
    d_values = torch.empty((B, T), dtype=torch.float32, device=device) if need_grad else None
    n_programs, block_t = _grid(B, T)
    if n_programs == 0:
        return torch.zeros(len(VALUE_SUMS), dtype=torch.float32, device=device), d_values
    partials = torch.empty((len(VALUE_SUMS), n_programs), dtype=torch.float32, device=device)
    _value_loss_fwd_kernel[(n_programs,)](
        values,
        old_values,
        returns,
        as_loadable(mask),
        row_scale,
        partials,
        d_values if need_grad else partials,  # never written without NEED_GRAD
        T,
        n_programs,
        float(clip if clip is not None else 0.0),
        HAS_CLIP=clip is not None,
        NEED_GRAD=need_grad,
        BLOCK_T=block_t,
    )
    return partials.sum(1), d_values


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; elsewhere (the interpreter) 2, so that a persistent
    grid still walks several rows per program in the CPU tests."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def actor_config(V: int, device: torch.device) -> dict:
    """The fused actor loss's untuned launch (CPU, and V < TUNE_MIN_V on CUDA): one program per row,
    the log-prob kernels' fixed tile (up to ACTOR_CONFIGS[0]'s on CUDA)."""
    config = fixed_config(V)
    if device.type == "cuda":
        block_v = min(ACTOR_CONFIGS[0].kwargs["BLOCK_V"], triton.next_power_of_2(V))
        config = {"BLOCK_V": block_v, "num_warps": 8 if block_v >= 2048 else 4}
    return config | {"PROGRAMS_PER_SM": 0}


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
    temperature: float,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    kl_coef: float,
    kl_estimator: str,
    kl_clamp: float | None,
    kl_straight_through: bool,
    entropy_coef: float,
    need_grad: bool,
    inplace: bool = False,
):
    """The fused actor loss over logits [B, T, V] (stride(-1) == 1), per-token fp32 [B * T] inputs
    (weight = row_scale * mask). Returns (logp fp32 [B * T], entropy fp32 [B * T], d(logits)
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
    has_kl = ref_logp is not None and kl_coef != 0.0
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
        LOG2E / float(temperature), 1.0 / float(temperature), 1.0 - float(clip_low), 1.0 + float(clip_high),
        float(dual_clip if dual_clip is not None else 0.0), float(kl_coef),
        float(kl_clamp if kl_clamp is not None else 0.0), float(entropy_coef),
        DUAL_CLIP=dual_clip is not None, HAS_IS_WEIGHTS=is_weights is not None, HAS_KL=has_kl,
        KL_ESTIMATOR=ESTIMATOR_IDS[kl_estimator], HAS_KL_CLAMP=kl_clamp is not None,
        KL_STRAIGHT_THROUGH=bool(kl_straight_through), HAS_ENTROPY=entropy_coef != 0.0, NEED_GRAD=need_grad,
        SAME_LAYOUT=logits.is_contiguous(), ALIGN=16 // logits.element_size(), **config,
    )
    return logp, entropy, d_logits


def scale_unless_one_(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x *= g in place for a contiguous x and a one-element g, without a host sync; no read or write
    of x when g == 1 (the common `loss.backward()`). Returns x."""
    n = x.numel()
    if n:
        block = 4096
        # enough programs to stream x when it is scaled, few enough that a skipped call is one wave
        programs = 8 * sm_count(x.device)
        _scale_unless_one_kernel[(max(1, min(triton.cdiv(n, block), programs)),)](
            x, g.reshape(()).float(), n, BLOCK=block, num_warps=8)
    return x
