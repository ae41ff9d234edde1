"""Generalised advantage estimation and masked whitening: `gae`, `whiten`, `raw_moments`
(kernels: fastrlhf/kernels/gae.py; formulas: reference.gae / reference.whiten).

Whitening over data-parallel ranks: each rank takes `raw_moments(x, mask)` (n, sum x, sum x^2 in
float64: additive), the caller all-reduces them, and `whiten(x, mask, moments=...)` whitens its
share with the whole batch's mean and variance. The math stays here; fastrlhf.train.distributed only sums.

Custom ops (what torch.compile sees; eager calls run the same bodies, ops._dispatch): fastrlhf::gae ->
(advantages, returns), fastrlhf::whiten, fastrlhf::raw_moments, fastrlhf::whiten_with_moments. No
gradient: advantages and returns are data (the public functions detach their inputs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastrlhf import reference as ref
from fastrlhf.constants import MASK_MODES, WHITEN_EPS
from fastrlhf.ops._common import (
    as_rows,
    check_choice,
    check_device,
    check_float,
    check_mask,
    check_number,
    check_rows,
    check_same,
    contiguous,
    out_dtype,
    use_triton,
)
from fastrlhf.ops._dispatch import register


def _math(x: Tensor) -> Tensor:
    return x.to(out_dtype(x))


def _whiten_host(x: Tensor, m: Tensor, unbiased: bool, shift_mean: bool) -> Tensor:
    """reference.whiten on CPU, its count, mean and variance read on the host (fewer ops than on the device)."""
    n = float(m.sum())
    if n == 0:
        return torch.zeros_like(x)
    mean = float((x * m).sum()) / n
    centered = x - mean
    var = float((centered * centered).mul_(m).sum()) / (n - 1 if unbiased and n > 1 else n)
    out = centered.mul_((var + WHITEN_EPS) ** -0.5)
    if not shift_mean:
        out = out.add_(mean)
    return out.mul_(m)


def _whiten_torch(x: Tensor, selected: Tensor, unbiased: bool, shift_mean: bool) -> Tensor:
    """reference.whiten without its host sync (an empty selection gives 0 without a branch)."""
    m = selected.to(x.dtype)
    if x.device.type == "cpu":
        return _whiten_host(x, m, unbiased, shift_mean)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    centered = x - mean
    var = (centered * centered * m).sum()
    var = var / (torch.where(n > 1, n - 1, n.clamp(min=1)) if unbiased else n.clamp(min=1))
    out = centered.mul_(torch.rsqrt(var + WHITEN_EPS))
    if not shift_mean:
        out = out.add_(mean)
    return out.mul_(m)


# ---------------------------------------------------------------- fastrlhf::whiten


def _whiten_fwd(x: Tensor, mask: Tensor, unbiased: bool, shift_mean: bool, use_triton: bool) -> Tensor:
    if x.numel() == 0:
        return torch.zeros(x.shape, dtype=out_dtype(x), device=x.device)
    if not use_triton:
        return _whiten_torch(_math(x), mask != 0, unbiased, shift_mean)
    from fastrlhf.kernels import gae as kernels

    out = kernels.whiten_fwd(contiguous(as_rows(x)), contiguous(as_rows(mask)), unbiased=unbiased,
                             shift_mean=shift_mean)
    return out.view(x.shape).to(out_dtype(x))


def _fake_whiten(x, mask, unbiased, shift_mean, use_triton):
    return x.new_empty(x.shape, dtype=out_dtype(x))


_whiten = register("whiten", _whiten_fwd, _fake_whiten)


def whiten(x, mask, *, unbiased=True, shift_mean=True, moments=None):
    """Masked whitening over all mask=1 entries (docs/ops.md).

    Args:
        x: [...] float.
        mask: x's shape, bool/int/float; any non-zero entry selects (it is not a weight).
        unbiased: the variance times n / (n - 1) (when n > 1).
        shift_mean: False adds the mean back after scaling.
        moments: None (the mean and variance of x's own mask=1 entries), or a [3] float tensor
            (n, sum x, sum x^2) of a larger batch: `raw_moments` of every data-parallel rank's
            share, summed (all-reduced), so each rank whitens with the global batch's moments.

    Returns:
        (x - mean) / sqrt(var + 1e-8) where mask != 0, 0 elsewhere; float32 (float64 for
        float64 x). No gradient.
    """
    check_float("x", x)
    check_rows("x", x)
    check_mask(mask, x, "x")
    if moments is None:
        return _whiten(x.detach(), mask, bool(unbiased), bool(shift_mean), use_triton(x))
    check_float("moments", moments)
    if tuple(moments.shape) != (3,):
        raise ValueError(f"moments must be [3] (n, sum x, sum x^2: raw_moments), got shape {tuple(moments.shape)}")
    check_device("moments", moments, "x", x)
    return _whiten_with_moments(x.detach(), mask, moments.detach().to(torch.float64), bool(unbiased),
                                   bool(shift_mean))


# ---------------------------------------------------------------- fastrlhf::raw_moments, whiten_with_moments


def _raw_moments_fwd(x: Tensor, mask: Tensor) -> Tensor:
    selected = mask != 0
    xd = torch.where(selected, x.to(torch.float64), 0.0)
    return torch.stack([selected.sum().to(torch.float64), xd.sum(), (xd * xd).sum()])


def _fake_raw_moments(x, mask):
    return x.new_empty(3, dtype=torch.float64)


_raw_moments = register("raw_moments", _raw_moments_fwd, _fake_raw_moments)


def raw_moments(x, mask):
    """(n, sum x, sum x^2) over the mask != 0 entries of x, as a [3] float64 tensor: additive over
    the parts of a batch, so their sum (an all-reduce over data-parallel ranks) is the whole
    batch's, which `whiten(..., moments=)` and `mean_var` take. No gradient.

    Args:
        x: [...] float; mask: x's shape, bool/int/float (any non-zero entry selects).
    """
    check_float("x", x)
    check_mask(mask, x, "x")
    return _raw_moments(x.detach(), mask)


def mean_var(moments: Tensor, *, unbiased: bool) -> tuple[Tensor, Tensor]:
    """(mean, variance) from `raw_moments` (float64; the variance times n / (n - 1) when unbiased
    and n > 1; 0 and 0 for n = 0)."""
    n, total, squares = moments.unbind()
    mean = total / n.clamp(min=1)
    var = (squares / n.clamp(min=1) - mean * mean).clamp(min=0)
    if unbiased:
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), var)
    return mean, var


def _whiten_with_moments_fwd(x: Tensor, mask: Tensor, moments: Tensor, unbiased: bool, shift_mean: bool) -> Tensor:
    dtype = out_dtype(x)
    mean, var = (t.to(dtype) for t in mean_var(moments, unbiased=unbiased))
    out = (x.to(dtype) - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    return torch.where(mask != 0, out, torch.zeros((), dtype=dtype, device=x.device))


def _fake_whiten_with_moments(x, mask, moments, unbiased, shift_mean):
    return x.new_empty(x.shape, dtype=out_dtype(x))


_whiten_with_moments = register("whiten_with_moments", _whiten_with_moments_fwd, _fake_whiten_with_moments)


# ---------------------------------------------------------------- fastrlhf::gae


def _gae_fwd(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float, mask_mode: str, whiten: bool,
             use_triton: bool) -> tuple[Tensor, Tensor]:
    if rewards.numel() == 0:
        empty = torch.zeros(rewards.shape, dtype=out_dtype(rewards), device=rewards.device)
        return empty, empty.clone()
    if not use_triton:
        return ref.gae(_math(rewards), _math(values), mask != 0, gamma=gamma, lam=lam, mask_mode=mask_mode,
                       whiten=whiten)
    from fastrlhf.kernels import gae as kernels

    adv, ret = kernels.gae_fwd(contiguous(rewards), contiguous(values), contiguous(mask), gamma=gamma, lam=lam,
                               mask_mode=mask_mode, whiten=whiten)
    return adv.to(out_dtype(rewards)), ret.to(out_dtype(rewards))


def _fake_gae(rewards, values, mask, gamma, lam, mask_mode, whiten, use_triton):
    dtype = out_dtype(rewards)
    return rewards.new_empty(rewards.shape, dtype=dtype), rewards.new_empty(rewards.shape, dtype=dtype)


_gae = register("gae", _gae_fwd, _fake_gae)


def gae(rewards, values, mask, *, gamma=1.0, lam=1.0, mask_mode="skip", whiten=True):
    """Generalised advantage estimation over [B, T] (docs/ops.md).

    Args:
        rewards, values: [B, T] float.
        mask: [B, T] bool/int/float; any non-zero entry counts as 1 (it selects, it is not a weight).
        gamma, lam: >= 0.
        mask_mode: "skip" (verl): masked tokens are skipped, the recursion carries across them;
            "zero" (OpenRLHF): rewards and values are zeroed under the mask and discounting runs
            through gaps.
        whiten: whiten the advantages (masked, unbiased).

    Returns:
        (advantages, returns) [B, T] float32 (float64 for float64 rewards); returns = raw
        advantages + values; both 0 where mask = 0. No gradient.
    """
    check_float("rewards", rewards)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, T], got shape {tuple(rewards.shape)}")
    check_same("rewards", rewards, values=values)
    check_mask(mask, rewards, "rewards")
    gamma = check_number("gamma", gamma, nonnegative=True)
    lam = check_number("lam", lam, nonnegative=True)
    check_choice("mask_mode", mask_mode, MASK_MODES)
    return _gae(rewards.detach(), values.detach(), mask, gamma, lam, mask_mode, bool(whiten), use_triton(rewards))
