"""Generalised advantage estimation (a reverse scan per row) and masked whitening.

GAE, both mask modes (see `fastrlhf.reference.gae`):
    delta_t = r_t + gamma * V_next(t) - V_t,   A_t = delta_t + gamma * lam * A_next(t)
    "skip": V_next / A_next are those of the next mask=1 token (0 past the end);
    "zero": r, V are zeroed under the mask and V_next = V_{t+1}, A_next = A_{t+1}.
The recursion A_t = a_t * A_next + b_t is a composition of affine maps, so it is an associative
scan: a_t = gamma * lam, b_t = delta_t on counted tokens, and the identity (a = 1, b = 0) on
skipped ones. A row is walked in blocks from its end to its start; each block is loaded in
reversed order so that a forward `tl.associative_scan` runs backwards in time, and the carry
(A and, in skip mode, the next counted value) passes from block to block. In skip mode V_next is
itself a scan: "the nearest counted value at a later time", over values loaded shifted by one.

Whitening is global over all mask=1 entries of the batch: each row writes (n, mean, M2) in float64
(combined block by block with Chan's formula, stable when |mean| >> std), one program combines the
B partials in a fixed order (deterministic) into (mean, rstd), and a light elementwise pass writes
(x - mean) * rsqrt(var + 1e-8). Three launches, no torch op between them. The mean is carried below
float32's last bit: a block's mean is its float32 mean (the pivot) plus the mean deviation from it
(small, so exact far below the pivot's ulp), summed in float64; the elementwise pass subtracts it as
a float32 pair (hi + lo). With |mean| >> std a float32 mean's half ulp is a visible error in
(x - mean) / std (at mean 300, std 0.5: 6e-5); the pair leaves the output's own rounding.

Where fast: one program per row, the row streamed once (plus a cached re-read of V and the mask
shifted by one in skip mode); well occupied from B >= a few hundred, any T (the row loops over
blocks). With few rows (B < number of SMs) most of the GPU idles. Grid x = B only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastrlhf.constants import MASK_MODES, WHITEN_EPS
from fastrlhf.kernels._launch import cdiv, next_power_of_2
from fastrlhf.kernels._masks import as_loadable

_MAX_BLOCK_T = 1024
_BLOCK = 1024
_MOMENTS_BLOCK_B = 1024
EPS = tl.constexpr(WHITEN_EPS)


@triton.jit
def _affine_combine(a_l, b_l, a_r, b_r):
    # maps f(x) = a * x + b; `l` is applied first (a later time), then `r`: r(l(x))
    return a_r * a_l, a_r * b_l + b_r


@triton.jit
def _last_valid_combine(v_l, f_l, v_r, f_r):
    # "the most recent element with flag 1": r wins when it is flagged
    return tl.where(f_r != 0, v_r, v_l), tl.maximum(f_l, f_r)


@triton.jit
def _chan_combine(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    # merge two (count, mean, sum of squared deviations) summaries
    n = n_a + n_b
    delta = mean_b - mean_a
    frac = tl.where(n > 0, n_b / tl.maximum(n, 1.0), 0.0)
    return n, mean_a + delta * frac, m2_a + m2_b + delta * delta * n_a * frac


@triton.jit
def _block_stats(x, m):
    # (count, mean, M2) of the masked entries of one block, float64, two-pass inside the block: the float32
    # mean is the pivot, the mean of the deviations from it the correction below its last bit
    n = tl.sum(m, axis=0)
    inv_n = 1.0 / tl.maximum(n, 1.0)
    pivot = tl.sum(x * m, axis=0) * inv_n
    dev = (x - pivot) * m
    correction = tl.sum(dev, axis=0) * inv_n
    dev = (dev - correction) * m
    mean = pivot.to(tl.float64) + correction.to(tl.float64)
    return n.to(tl.float64), mean, tl.sum(dev * dev, axis=0).to(tl.float64)


@triton.jit
def _gae_fwd_kernel(
    # pointers
    rewards_ptr,  # [B, T] fp32/bf16/fp16, contiguous
    values_ptr,  # [B, T] fp32/bf16/fp16, contiguous
    mask_ptr,  # [B, T] bool (as int8), int or float, contiguous; any non-zero selects
    adv_ptr,  # [B, T] fp32 out: raw advantages * mask
    ret_ptr,  # [B, T] fp32 out: (raw advantages + values) * mask
    stats_ptr,  # [3, B] fp64 out: per-row (n, mean, M2) of the advantages, when WHITEN
    # shapes
    B,
    T,
    # meta
    gamma,  # fp32
    gamma_lam,  # fp32, gamma * lam
    SKIP: tl.constexpr,  # True: "skip" mask mode, False: "zero"
    WHITEN: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    i = tl.arange(0, BLOCK_T)
    g = gamma
    gl = gamma_lam
    adv_carry = 0.0  # A_next at the end of the block (a later time)
    v_carry = 0.0  # skip mode: the nearest counted value at a later time (0 past the end)
    n_row = tl.zeros((), tl.float64)
    mean_row = tl.zeros((), tl.float64)
    m2_row = tl.zeros((), tl.float64)
    for blk in range(0, tl.cdiv(T, BLOCK_T)):
        t = T - 1 - blk * BLOCK_T - i  # reversed: i = 0 is the latest time of the block
        inb = t >= 0
        m = (tl.load(mask_ptr + base + t, mask=inb, other=0) != 0).to(tl.float32)
        r = tl.load(rewards_ptr + base + t, mask=inb, other=0.0).to(tl.float32)
        v = tl.load(values_ptr + base + t, mask=inb, other=0.0).to(tl.float32)
        # the same row shifted by one: time t + 1 (out of the row past T - 1)
        nxt = inb & (t + 1 < T)
        m_next = (tl.load(mask_ptr + base + t + 1, mask=nxt, other=0) != 0).to(tl.float32)
        v_next = tl.load(values_ptr + base + t + 1, mask=nxt, other=0.0).to(tl.float32)
        counted = m != 0.0
        if SKIP:
            # V_next(t) = the counted value nearest after t: scan over (V_{t+1}, m_{t+1})
            f_next = tl.where(m_next != 0.0, 1.0, 0.0)
            v_scan, f_scan = tl.associative_scan((v_next, f_next), 0, _last_valid_combine)
            v_next = tl.where(f_scan != 0.0, v_scan, v_carry)
            delta = r + g * v_next - v
            a = tl.where(counted, gl, 1.0)
            b = tl.where(counted, delta, 0.0)
        else:
            # rewards and values zeroed under the mask; the recursion runs through every position
            delta = r * m + g * v_next * m_next - v * m
            a = tl.where(inb, gl, 1.0)
            b = tl.where(inb, delta, 0.0)
        a_scan, b_scan = tl.associative_scan((a, b), 0, _affine_combine)
        adv = a_scan * adv_carry + b_scan
        tl.store(adv_ptr + base + t, adv * m, mask=inb)
        tl.store(ret_ptr + base + t, (adv + v) * m, mask=inb)
        # carries for the next (earlier) block: the values at i = BLOCK_T - 1, the earliest time
        first = i == BLOCK_T - 1
        adv_carry = tl.sum(tl.where(first, adv, 0.0), axis=0)
        if SKIP:
            f_first = tl.sum(tl.where(first, f_scan, 0.0), axis=0)
            v_first = tl.sum(tl.where(first, v_scan, 0.0), axis=0)
            v_carry = tl.where(f_first != 0.0, v_first, v_carry)
        if WHITEN:
            n_blk, mean_blk, m2_blk = _block_stats(adv, m)
            n_row, mean_row, m2_row = _chan_combine(n_row, mean_row, m2_row, n_blk, mean_blk, m2_blk)
    if WHITEN:
        tl.store(stats_ptr + row, n_row)
        tl.store(stats_ptr + B + row, mean_row)
        tl.store(stats_ptr + 2 * B + row, m2_row)


@triton.jit
def _row_stats_kernel(
    # pointers
    x_ptr,  # [B, T] fp32/bf16/fp16, contiguous
    mask_ptr,  # [B, T] bool (as int8), int or float, contiguous; any non-zero selects
    stats_ptr,  # [3, B] fp64 out: per-row (n, mean, M2) of the masked entries
    # shapes
    B,
    T,
    # meta
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    cols = tl.arange(0, BLOCK_T)
    n_row = tl.zeros((), tl.float64)
    mean_row = tl.zeros((), tl.float64)
    m2_row = tl.zeros((), tl.float64)
    for start in range(0, T, BLOCK_T):
        t = start + cols
        inb = t < T
        m = (tl.load(mask_ptr + base + t, mask=inb, other=0) != 0).to(tl.float32)
        x = tl.load(x_ptr + base + t, mask=inb, other=0.0).to(tl.float32)
        n_blk, mean_blk, m2_blk = _block_stats(x, m)
        n_row, mean_row, m2_row = _chan_combine(n_row, mean_row, m2_row, n_blk, mean_blk, m2_blk)
    tl.store(stats_ptr + row, n_row)
    tl.store(stats_ptr + B + row, mean_row)
    tl.store(stats_ptr + 2 * B + row, m2_row)


@triton.jit
def _moments_kernel(
    # pointers
    stats_ptr,  # [3, B] fp64: per-row (n, mean, M2)
    moments_ptr,  # [2] fp64 out: (mean, rstd)
    # shapes
    B,
    # meta
    UNBIASED: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # one program, in float64: the rows' summaries merged block by block in a fixed order (Chan's formula); an empty
    # mask gives mean 0 and a finite rstd (every output is then masked to 0), without a host sync
    rows = tl.arange(0, BLOCK_B)
    n = tl.zeros((), tl.float64)
    mean = tl.zeros((), tl.float64)
    m2 = tl.zeros((), tl.float64)
    for start in range(0, B, BLOCK_B):
        b = start + rows
        ok = b < B
        n_b = tl.load(stats_ptr + b, mask=ok, other=0.0)
        mean_b = tl.load(stats_ptr + B + b, mask=ok, other=0.0)
        m2_b = tl.load(stats_ptr + 2 * B + b, mask=ok, other=0.0)
        n_blk = tl.sum(n_b, axis=0)
        mean_blk = tl.sum(n_b * mean_b, axis=0) / tl.maximum(n_blk, 1.0)
        dev = mean_b - mean_blk
        m2_blk = tl.sum(m2_b + n_b * dev * dev, axis=0)
        n, mean, m2 = _chan_combine(n, mean, m2, n_blk, mean_blk, m2_blk)
    denom = tl.maximum(n, 1.0)
    if UNBIASED:
        denom = tl.where(n > 1, n - 1.0, denom)
    rstd = 1.0 / tl.sqrt(m2 / denom + EPS)
    tl.store(moments_ptr, mean)
    tl.store(moments_ptr + 1, rstd)


@triton.jit
def _normalize_kernel(
    # pointers
    x_ptr,  # [N] fp32/bf16/fp16
    mask_ptr,  # [N] bool (as int8), int or float; any non-zero selects
    moments_ptr,  # [2] fp64: (mean, rstd)
    out_ptr,  # [N] fp32 out (may be x_ptr)
    # shapes
    N,
    # meta
    SHIFT_MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # out = (x - mean) * rstd * m, plus mean * m when not SHIFT_MEAN; the float64 mean as the float32 pair hi + lo
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    mean = tl.load(moments_ptr)
    hi = mean.to(tl.float32)
    lo = (mean - hi.to(tl.float64)).to(tl.float32)
    rstd = tl.load(moments_ptr + 1).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    m = (tl.load(mask_ptr + offs, mask=valid, other=0) != 0).to(tl.float32)
    y = ((x - hi) - lo) * rstd
    if not SHIFT_MEAN:
        y = (y + lo) + hi
    tl.store(out_ptr + offs, y * m, mask=valid)


def _normalize(x: torch.Tensor, mask: torch.Tensor, stats: torch.Tensor, unbiased: bool, shift_mean: bool,
               out: torch.Tensor) -> torch.Tensor:
    """out = (x - mean) * rstd * mask from the per-row (n, mean, M2) `stats` [3, B]: the moments kernel, then
    the elementwise pass."""
    B = stats.shape[1]
    moments = torch.empty(2, dtype=torch.float64, device=x.device)
    _moments_kernel[(1,)](stats, moments, B, UNBIASED=unbiased, BLOCK_B=min(next_power_of_2(B), _MOMENTS_BLOCK_B))
    n = x.numel()
    _normalize_kernel[(cdiv(n, _BLOCK),)](
        x,
        as_loadable(mask),
        moments,
        out,
        n,
        SHIFT_MEAN=shift_mean,
        BLOCK=_BLOCK,
    )
    return out


def gae_fwd(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    mask_mode: str,
    whiten: bool,
):
    """(advantages, returns), fp32 [B, T]; both 0 where mask = 0. Advantages whitened if `whiten`."""
    if mask_mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be one of {MASK_MODES}, got {mask_mode!r}")
    B, T = rewards.shape
    device = rewards.device
    adv = torch.empty((B, T), dtype=torch.float32, device=device)
    ret = torch.empty((B, T), dtype=torch.float32, device=device)
    if B == 0 or T == 0:
        return adv, ret
    stats = torch.empty((3, B), dtype=torch.float64, device=device)
    block_t = min(next_power_of_2(T), _MAX_BLOCK_T)
    mask_l = as_loadable(mask)
    _gae_fwd_kernel[(B,)](
        rewards,
        values,
        mask_l,
        adv,
        ret,
        stats,
        B,
        T,
        float(gamma),
        float(gamma) * float(lam),
        SKIP=mask_mode == "skip",
        WHITEN=whiten,
        BLOCK_T=block_t,
    )
    if whiten:
        _normalize(adv, mask_l, stats, True, True, out=adv)
    return adv, ret


def whiten_fwd(x: torch.Tensor, mask: torch.Tensor, *, unbiased: bool, shift_mean: bool):
    """Masked whitening over all mask=1 entries: (x - mean) * rsqrt(var + 1e-8) * mask, fp32."""
    B, T = x.shape
    out = torch.empty((B, T), dtype=torch.float32, device=x.device)
    if B == 0 or T == 0:
        return out
    stats = torch.empty((3, B), dtype=torch.float64, device=x.device)
    mask_l = as_loadable(mask)
    _row_stats_kernel[(B,)](x, mask_l, stats, B, T, BLOCK_T=min(next_power_of_2(T), _MAX_BLOCK_T))
    return _normalize(x, mask_l, stats, unbiased, shift_mean, out=out)
