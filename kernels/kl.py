"""Token-level KL estimators and KL-shaped rewards.

With r = logp - ref_logp (fp32 math whatever the input dtype):
    k1 = r;  k2 = r^2 / 2;  k3 = exp(-c) - 1 + c with c = clamp(r, -20, 20) (verl's low_var_kl);  abs = |r|
and, when `clamp` is given, kl = clamp(kl, -clamp, clamp). Gradients follow the tie rules stated in
`fastrlhf.reference`: both clamps pass the gradient at their bounds (closed intervals), d|r|/dr = 0 at 0.
k3 and its derivative 1 - exp(-c) cancel for small |c| (k3 ~ c^2 / 2 from terms ~1): below
K3_SERIES_BELOW they are summed as their Taylor series instead (relative error ~1e-7, not ~1e-7 / c^2).

Where fast: elementwise, memory-bound; one program per BLOCK elements (flat grid, up to 2^31-1
programs), so any shape that fits in memory. `kl_shaped_rewards` runs one program per row and
reads the mask twice (once to find the last response token): fast when B is at least a few
hundred rows; with only a handful of very long rows the GPU is under-occupied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fastrlhf.kernels._masks import as_loadable

from fastrlhf.constants import K3_SERIES_BELOW, LOG_RATIO_CLAMP

ESTIMATOR_IDS = {"k1": 0, "k2": 1, "k3": 2, "abs": 3}
R_CLAMP = tl.constexpr(LOG_RATIO_CLAMP)  # |r| bound of k3
SERIES_BELOW = tl.constexpr(K3_SERIES_BELOW)
_BLOCK = 1024
_ROW_BLOCK = 1024


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
    logp_ptr,  # [N] fp32/bf16/fp16
    ref_ptr,  # [N] fp32/bf16/fp16
    grad_ptr,  # [N] upstream d(kl), any float dtype
    dlogp_ptr,  # [N] fp32 out; d(ref_logp) = -d(logp)
    # shapes
    N,
    # meta
    clamp,  # fp32, used only when HAS_CLAMP
    ESTIMATOR: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # d(logp) = g * dkl/dr (see _kl_derivative)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    r = tl.load(logp_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    r -= tl.load(ref_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    g = tl.load(grad_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    tl.store(dlogp_ptr + offs, g * _kl_derivative(r, ESTIMATOR, HAS_CLAMP, clamp), mask=valid)


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
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    cols = tl.arange(0, BLOCK_T)
    # pass 1: the last response token of the row (-1 when the row has none)
    last = tl.full((BLOCK_T,), -1, tl.int32)
    for start in range(0, T, BLOCK_T):
        t = start + cols
        m = tl.load(mask_ptr + base + t, mask=t < T, other=0).to(tl.float32)
        last = tl.maximum(last, tl.where(m != 0.0, t, -1))
    last_t = tl.max(last, axis=0)
    score = tl.load(scores_ptr + row).to(tl.float32)
    coef = kl_coef
    c = clamp
    # pass 2: the shaped rewards
    for start in range(0, T, BLOCK_T):
        t = start + cols
        inb = t < T
        m = tl.load(mask_ptr + base + t, mask=inb, other=0).to(tl.float32)
        r = tl.load(logp_ptr + base + t, mask=inb, other=0.0).to(tl.float32)
        r -= tl.load(ref_ptr + base + t, mask=inb, other=0.0).to(tl.float32)
        kl = _kl_value(r, ESTIMATOR, HAS_CLAMP, c)
        rew = tl.where(m != 0.0, -coef * kl * m, 0.0) + tl.where(t == last_t, score, 0.0)  # NaN-proof off the mask
        tl.store(out_ptr + base + t, rew, mask=inb)


def _canonical(estimator: str) -> int:
    if estimator not in ESTIMATOR_IDS:
        raise ValueError(f"estimator must be one of {sorted(ESTIMATOR_IDS)}, got {estimator!r}")
    return ESTIMATOR_IDS[estimator]


def token_kl_fwd(logp: torch.Tensor, ref_logp: torch.Tensor, *, estimator: str, clamp: float | None):
    """Per-token KL estimate, fp32, same shape as `logp`."""
    est = _canonical(estimator)
    lp, rf = logp.reshape(-1), ref_logp.reshape(-1)
    n = lp.numel()
    out = torch.empty(n, dtype=torch.float32, device=logp.device)
    if n:
        grid = (triton.cdiv(n, _BLOCK),)
        _token_kl_fwd_kernel[grid](
            lp,
            rf,
            out,
            n,
            float(clamp or 0.0),
            ESTIMATOR=est,
            HAS_CLAMP=clamp is not None,
            BLOCK=_BLOCK,
        )
    return out.view(logp.shape)


def token_kl_bwd(
    logp: torch.Tensor, ref_logp: torch.Tensor, grad: torch.Tensor, *, estimator: str, clamp: float | None
):
    """d(loss)/d(logp) given d(loss)/d(kl) = `grad`; fp32. d(ref_logp) is its negation."""
    est = _canonical(estimator)
    lp, rf, g = logp.reshape(-1), ref_logp.reshape(-1), grad.reshape(-1)
    n = lp.numel()
    out = torch.empty(n, dtype=torch.float32, device=logp.device)
    if n:
        grid = (triton.cdiv(n, _BLOCK),)
        _token_kl_bwd_kernel[grid](
            lp,
            rf,
            g,
            out,
            n,
            float(clamp or 0.0),
            ESTIMATOR=est,
            HAS_CLAMP=clamp is not None,
            BLOCK=_BLOCK,
        )
    return out.view(logp.shape)


def kl_shaped_rewards_fwd(
    scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str,
    clamp: float | None,
):
    """rewards [B, T] fp32: -kl_coef * KL on mask=1 tokens plus scores[b] on the row's last one."""
    est = _canonical(estimator)
    B, T = logp.shape
    out = torch.empty((B, T), dtype=torch.float32, device=logp.device)
    if B and T:
        block_t = min(triton.next_power_of_2(T), _ROW_BLOCK)
        _kl_shaped_rewards_fwd_kernel[(B,)](
            scores,
            logp,
            ref_logp,
            as_loadable(mask),
            out,
            T,
            float(kl_coef),
            float(clamp or 0.0),
            ESTIMATOR=est,
            HAS_CLAMP=clamp is not None,
            BLOCK_T=block_t,
        )
    return out
