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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fastrlhf.kernels._masks import as_loadable

from fastrlhf.constants import LOG_RATIO_CLAMP

LR_CLAMP = tl.constexpr(LOG_RATIO_CLAMP)  # |log-ratio| bound inside exp
_MAX_BLOCK_T = 1024
POLICY_SUMS = ("loss", "n_clipped", "n_clipped_lower", "neg_log_ratio", "n_mask", "neg_log_ratio_unclamped")
VALUE_SUMS = ("loss", "n_clipped", "n_mask")


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
    lo = ratio_low
    hi = ratio_high

    log_ratio = tl.minimum(tl.maximum(x, -LR_CLAMP), LR_CLAMP)
    ratio = tl.exp(log_ratio)
    l1 = -a * ratio
    l2 = -a * tl.minimum(tl.maximum(ratio, lo), hi)
    takes_l2 = l2 > l1  # max(l1, l2); a tie goes to the unclipped l1
    clipped = tl.where(takes_l2, l2, l1)
    loss = clipped
    lower = tl.zeros((BLOCK_T,), tl.int1)
    if DUAL_CLIP:
        l3 = -a * dual_clip
        lower = (a < 0) & (clipped > l3)  # min(clipped, l3) where A < 0; a tie goes to clipped
        loss = tl.where(lower, l3, clipped)

    tl.store(partial_ptr + pid, tl.sum(tl.where(counts, w * loss, 0.0), axis=0))
    tl.store(partial_ptr + n_programs + pid, tl.sum(tl.where(takes_l2 & counts, m, 0.0), axis=0))
    tl.store(partial_ptr + 2 * n_programs + pid, tl.sum(tl.where(lower & counts, m, 0.0), axis=0))
    tl.store(partial_ptr + 3 * n_programs + pid, tl.sum(tl.where(counts, -log_ratio * m, 0.0), axis=0))
    tl.store(partial_ptr + 4 * n_programs + pid, tl.sum(m, axis=0))
    tl.store(partial_ptr + 5 * n_programs + pid, tl.sum(tl.where(counts, -x * m, 0.0), axis=0))

    if NEED_GRAD:
        # dl1/dratio = -A; dl2/dratio = -A * [lo <= ratio <= hi]; dratio/dx = ratio * [|x| <= 20];
        # the dual-clip term -A c is constant
        in_clip = (ratio >= lo) & (ratio <= hi)
        d_ratio = tl.where(takes_l2 & ~in_clip, 0.0, -a)
        in_lr = (x >= -LR_CLAMP) & (x <= LR_CLAMP)
        d = tl.where(in_lr & ~lower & counts, w * d_ratio * ratio, 0.0)
        tl.store(dlogp_ptr + offs, d, mask=inb)


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
