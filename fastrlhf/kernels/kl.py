"""Token-level KL estimators and KL-shaped rewards.

With r = logp - ref_logp (fp32 math whatever the input dtype):
    k1 = r;  k2 = r^2 / 2;  k3 = exp(-c) - 1 + c with c = clamp(r, -20, 20) (verl's low_var_kl);  abs = |r|
and, when `clamp` is given, kl = clamp(kl, -clamp, clamp). Gradients follow the tie rules stated in
`fastrlhf.reference`: both clamps pass the gradient at their bounds (closed intervals), d|r|/dr = 0 at 0.
k3 and its derivative 1 - exp(-c) cancel for small |c| (k3 ~ c^2 / 2 from terms ~1): below
K3_SERIES_BELOW they are summed as their Taylor series instead (relative error ~1e-7, not ~1e-7 / c^2).

Where fast: elementwise, memory-bound; one program per BLOCK elements (flat grid, up to 2^31-1
programs), so any shape that fits in memory. The backward writes d(logp) and d(ref_logp) = -d(logp)
in one pass, reading the upstream gradient through its strides (the expanded ones of `kl.sum()`
are never materialised) and the straight-through weight w in place. `kl_shaped_rewards` runs one
program per row and reads each input once (the last response token's reward is kept in registers
and its score added after the row): fast when B is at least a few hundred rows; with only a
handful of very long rows the GPU is under-occupied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastrlhf.constants import K3_SERIES_BELOW, LOG_RATIO_CLAMP
from fastrlhf.kernels._launch import cdiv, next_power_of_2
from fastrlhf.kernels._masks import as_loadable

ESTIMATOR_IDS = {"k1": 0, "k2": 1, "k3": 2, "abs": 3}
R_CLAMP = tl.constexpr(LOG_RATIO_CLAMP)  # |r| bound of k3
SERIES_BELOW = tl.constexpr(K3_SERIES_BELOW)
_BLOCK = 1024
_ROW_BLOCK = 1024


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    # fp32 x in `dtype`, rounded to nearest even: the compiled cast does so; the interpreter truncates
    # fp32 -> bf16, so there the bits are rounded first (the cast of the rounded value is then exact)
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN kept as it is
    return x.to(dtype)


@triton.jit
def _k3(c):
    # exp(-c) - 1 + c = c^2 (1/2 - c/6 + c^2/24 - ...): the series up to c^8 where |c| < SERIES_BELOW
    # (truncation < 1e-7 relative), the direct form elsewhere
    s = c * (1.0 / 5040 - c * (1.0 / 40320))
    s = c * (1.0 / 120 - c * (1.0 / 720 - s))
    s = c * c * (0.5 - c * (1.0 / 6 - c * (1.0 / 24 - s)))
    return tl.where(tl.abs(c) < SERIES_BELOW, s, tl.exp(-c) - 1.0 + c)


@triton.jit
def _dk3(c):
    # 1 - exp(-c) = c (1 - c/2 + c^2/6 - ...), as _k3
    s = c * (1.0 / 720 - c * (1.0 / 5040))
    s = c * (1.0 / 24 - c * (1.0 / 120 - s))
    s = c * (1.0 - c * (0.5 - c * (1.0 / 6 - s)))
    return tl.where(tl.abs(c) < SERIES_BELOW, s, 1.0 - tl.exp(-c))


@triton.jit
def _kl_value(r, ESTIMATOR: tl.constexpr, HAS_CLAMP: tl.constexpr, clamp):
    # k1 = r, k2 = r^2 / 2, k3 = exp(-c) - 1 + c with c = clamp(r, +-20), abs = |r|; then clamp to +-clamp
    if ESTIMATOR == 0:
        kl = r
    elif ESTIMATOR == 1:
        kl = 0.5 * r * r
    elif ESTIMATOR == 2:
        kl = _k3(tl.minimum(tl.maximum(r, -R_CLAMP), R_CLAMP))
    else:
        kl = tl.abs(r)
    if HAS_CLAMP:
        kl = tl.minimum(tl.maximum(kl, -clamp), clamp)
    return kl


@triton.jit
def _kl_derivative(r, ESTIMATOR: tl.constexpr, HAS_CLAMP: tl.constexpr, clamp):
    # dk1/dr = 1, dk2/dr = r, dk3/dr = (1 - exp(-r)) [|r| <= 20], dabs/dr = sign(r) (0 at 0);
    # times [|kl| <= clamp] when clamped: the gradient passes at the bounds
    if ESTIMATOR == 0:
        d = tl.full(r.shape, 1.0, tl.float32)
    elif ESTIMATOR == 1:
        d = r
    elif ESTIMATOR == 2:
        inside = (r >= -R_CLAMP) & (r <= R_CLAMP)
        d = tl.where(inside, _dk3(tl.minimum(tl.maximum(r, -R_CLAMP), R_CLAMP)), 0.0)
    else:
        d = tl.where(r > 0, 1.0, tl.where(r < 0, -1.0, 0.0))
    if HAS_CLAMP:
        kl = _kl_value(r, ESTIMATOR, False, clamp)
        d = tl.where((kl >= -clamp) & (kl <= clamp), d, 0.0)
    return d


@triton.jit
def _token_kl_fwd_kernel(
    # pointers
    logp_ptr,  # [N] fp32/bf16/fp16
    ref_ptr,  # [N] fp32/bf16/fp16
    kl_ptr,  # [N] fp32 out
    # shapes
    N,
    # meta
    clamp,  # fp32, used only when HAS_CLAMP
    ESTIMATOR: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    r = tl.load(logp_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    r -= tl.load(ref_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    kl = _kl_value(r, ESTIMATOR, HAS_CLAMP, clamp)
    tl.store(kl_ptr + offs, kl, mask=valid)


@triton.jit
def _token_kl_bwd_kernel(
    # pointers
    logp_ptr,  # [N] fp32/bf16/fp16, contiguous
    ref_ptr,  # [N] fp32/bf16/fp16, contiguous
    grad_ptr,  # [R, C] upstream d(kl), any float dtype, any strides (R * C = N)
    weight_ptr,  # [N] straight-through weight w, contiguous, read only if HAS_WEIGHT
    dlogp_ptr,  # [N] logp's dtype out, written only if HAS_DLOGP
    dref_ptr,  # [N] ref_logp's dtype out, written only if HAS_DREF
    # shapes
    N,
    C,
    # strides
    stride_gr,
    stride_gc,
    # meta
    clamp,  # fp32, used only when HAS_CLAMP
    ESTIMATOR: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_DLOGP: tl.constexpr,
    HAS_DREF: tl.constexpr,
    GRAD_FLAT: tl.constexpr,  # the upstream gradient is contiguous: read at the flat offsets
    BLOCK: tl.constexpr,
):
    # d(logp) = g [w] dkl/dr = -d(ref_logp) (see _kl_derivative), both written in this one pass
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    r = tl.load(logp_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    r -= tl.load(ref_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    g_offs = offs
    if not GRAD_FLAT:
        g_offs = (offs // C) * stride_gr + (offs % C) * stride_gc
    g = tl.load(grad_ptr + g_offs, mask=valid, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        g *= tl.load(weight_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    d = g * _kl_derivative(r, ESTIMATOR, HAS_CLAMP, clamp)
    if HAS_DLOGP:
        tl.store(dlogp_ptr + offs, _rounded(d, dlogp_ptr.dtype.element_ty), mask=valid)
    if HAS_DREF:
        tl.store(dref_ptr + offs, _rounded(-d, dref_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _kl_shaped_rewards_fwd_kernel(
    # pointers
    scores_ptr,  # [B] any float dtype
    logp_ptr,  # [B, T] fp32/bf16/fp16, contiguous
    ref_ptr,  # [B, T] fp32/bf16/fp16, contiguous
    mask_ptr,  # [B, T] bool (as int8) or float, contiguous
    out_ptr,  # [B, T] fp32 out
    # shapes
    T,
    # meta
    kl_coef,  # fp32
    clamp,  # fp32, used only when HAS_CLAMP
    ESTIMATOR: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # rewards[b, t] = -kl_coef * KL[b, t] * m[b, t] + scores[b] * [t == last mask=1 token of row b]
    # one pass over the row: the last response token so far and its reward are kept in registers, and the
    # score is added to that reward after the row (rewritten over what the pass stored there)
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    cols = tl.arange(0, BLOCK_T)
    coef = kl_coef
    c = clamp
    last_t = -1
    last_rew = 0.0
    for start in range(0, T, BLOCK_T):
        t = start + cols
        inb = t < T
        m = tl.load(mask_ptr + base + t, mask=inb, other=0).to(tl.float32)
        r = tl.load(logp_ptr + base + t, mask=inb, other=0.0).to(tl.float32)
        r -= tl.load(ref_ptr + base + t, mask=inb, other=0.0).to(tl.float32)
        kl = _kl_value(r, ESTIMATOR, HAS_CLAMP, c)
        rew = tl.where(m != 0.0, -coef * kl * m, 0.0)  # NaN-proof off the mask
        tl.store(out_ptr + base + t, rew, mask=inb)
        blk_last = tl.max(tl.where(m != 0.0, t, -1), axis=0)
        blk_rew = tl.sum(tl.where(t == blk_last, rew, 0.0), axis=0)
        last_rew = tl.where(blk_last >= 0, blk_rew, last_rew)
        last_t = tl.maximum(last_t, blk_last)
    tl.debug_barrier()  # every thread's stores of the row before the rewrite of its last token
    score = tl.load(scores_ptr + row).to(tl.float32)
    tl.store(out_ptr + base + last_t, last_rew + score, mask=last_t >= 0)


def _canonical(estimator: str) -> int:
    if estimator not in ESTIMATOR_IDS:
        raise ValueError(f"estimator must be one of {sorted(ESTIMATOR_IDS)}, got {estimator!r}")
    return ESTIMATOR_IDS[estimator]


def token_kl_fwd(logp: torch.Tensor, ref_logp: torch.Tensor, *, estimator: str, clamp: float | None,
                 out_dtype: torch.dtype = torch.float32):
    """Per-token KL estimate of contiguous logp, ref_logp, in `out_dtype` (fp32 math), logp's shape."""
    est = _canonical(estimator)
    out = torch.empty(logp.shape, dtype=out_dtype, device=logp.device)
    n = logp.numel()
    if n:
        _token_kl_fwd_kernel[(cdiv(n, _BLOCK),)](logp, ref_logp, out, n, float(clamp or 0.0), ESTIMATOR=est,
                                                  HAS_CLAMP=clamp is not None, BLOCK=_BLOCK)
    return out


def token_kl_bwd(logp: torch.Tensor, ref_logp: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor | None, *,
                 estimator: str, clamp: float | None, need_logp: bool = True, need_ref: bool = True):
    """(d(logp) in logp.dtype or None, d(ref_logp) = -d(logp) in ref_logp.dtype or None) from the upstream
    d(kl) `grad` [R, C] (any strides; R * C = logp.numel()) and the weight w (contiguous, or None = 1):
    d(logp) = grad * w * dkl/dr. logp and ref_logp contiguous."""
    est = _canonical(estimator)
    d_logp = torch.empty(logp.shape, dtype=logp.dtype, device=logp.device) if need_logp else None
    d_ref = torch.empty(ref_logp.shape, dtype=ref_logp.dtype, device=logp.device) if need_ref else None
    n = logp.numel()
    if n and (need_logp or need_ref):
        R, C = grad.shape
        _token_kl_bwd_kernel[(cdiv(n, _BLOCK),)](
            logp, ref_logp, grad, logp if weight is None else weight,
            logp if d_logp is None else d_logp, logp if d_ref is None else d_ref,  # never written when None
            n, C, grad.stride(0), grad.stride(1), float(clamp or 0.0),
            ESTIMATOR=est, HAS_CLAMP=clamp is not None, HAS_WEIGHT=weight is not None, HAS_DLOGP=need_logp,
            HAS_DREF=need_ref, GRAD_FLAT=grad.stride(1) == 1 and grad.stride(0) == C, BLOCK=_BLOCK)
    return d_logp, d_ref


def kl_shaped_rewards_fwd(
    scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str,
    clamp: float | None,
    out_dtype: torch.dtype = torch.float32,
):
    """rewards [B, T] in `out_dtype`: -kl_coef * KL on mask=1 tokens plus scores[b] on the row's last one.
    Inputs contiguous."""
    est = _canonical(estimator)
    B, T = logp.shape
    out = torch.empty((B, T), dtype=out_dtype, device=logp.device)
    if B and T:
        _kl_shaped_rewards_fwd_kernel[(B,)](
            scores, logp, ref_logp, as_loadable(mask), out, T, float(kl_coef), float(clamp or 0.0), ESTIMATOR=est,
            HAS_CLAMP=clamp is not None, BLOCK_T=min(next_power_of_2(T), _ROW_BLOCK))
    return out
