"""What the adapters share: reading a peer's counts, the dtype a peer's function returns, and
the checks that send a call to the peer's own function. Imports no peer.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from fastrlhf.ops._common import use_triton


def float64_on_kernels(*tensors) -> bool:
    """Whether float64 inputs would go to the Triton kernels (CUDA, or FASTRLHF_BACKEND=triton),
    which compute in float32: the peer's own function then keeps float64's precision. (The
    torch path computes float64 inputs in float64.) None entries are skipped."""
    given = [t for t in tensors if isinstance(t, torch.Tensor)]
    return bool(given) and use_triton(given[0]) and any(t.dtype == torch.float64 for t in given)


def scalar(x):
    """A count or factor from a peer's arguments as a Python number, or None when it is not a
    finite real number or a 0-dim tensor holding one (reading a tensor is one host sync)."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 0 or x.is_complex() or x.dtype == torch.bool:
            return None
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
        return None
    return x


def dtypes_of(fn, *args, **kwargs):
    """The dtype(s) `fn(*args, **kwargs)` returns, found by running `fn` once on meta tensors of
    the arguments' dtypes and ranks (strings, bools and None kept; other numbers stand in as 1 of
    their type), cached per signature: a peer's own type promotion (0-dim against dimensioned
    tensors, Python numbers, in-place steps) without re-deriving it or computing anything. `fn`
    must exist once (a module-level original): it is part of the cache key."""
    return _dtypes_of(fn, tuple(_kind(a) for a in args), tuple((k, _kind(v)) for k, v in kwargs.items()))


def like(dtype: torch.dtype, dim: int) -> torch.Tensor:
    """A stand-in for `dtypes_of`: a meta tensor of this dtype and rank (allocates nothing)."""
    return torch.empty((1,) * dim, dtype=dtype, device="meta")


def _kind(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", a.dtype, a.dim())
    if a is None or isinstance(a, (str, bool)):  # values that select a branch
        return ("value", a)
    return ("number", type(a))


def _stand_in(kind):
    if kind[0] == "tensor":
        return like(kind[1], kind[2])
    if kind[0] == "value":
        return kind[1]
    return kind[1](1)


@functools.cache
def _dtypes_of(fn, kinds, keyword_kinds):
    out = fn(*(_stand_in(k) for k in kinds), **{name: _stand_in(k) for name, k in keyword_kinds})
    if isinstance(out, tuple):
        return tuple(o.dtype if isinstance(o, torch.Tensor) else None for o in out)
    return out.dtype


def promoted(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype of elementwise arithmetic between same-shaped tensors (None entries skipped)."""
    dtype = None
    for t in tensors:
        if t is not None:
            dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
    return dtype


def all_finite(*tensors: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor: every element of every tensor (None entries skipped) is finite. No sync."""
    checks = [torch.isfinite(t).all() for t in tensors if t is not None]
    return torch.stack(checks).all()


def needs_grad(*tensors) -> bool:
    """Whether autograd would record a gradient for any of these tensors in this call."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def same_shape(first: torch.Tensor, *tensors) -> bool:
    """Every tensor (None entries skipped) is a tensor of `first`'s shape on its device (no broadcasting)."""
    return all(t is None or (isinstance(t, torch.Tensor) and t.shape == first.shape and t.device == first.device)
               for t in tensors)


def floats(*tensors, optional=()) -> bool:
    """Every argument is a floating-point tensor; so is every entry of `optional` that is not None."""
    given = [*tensors, *(t for t in optional if t is not None)]
    return all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in given)


def row_mean_weights(loss_dtype: torch.dtype, mask: torch.Tensor) -> torch.Tensor | None:
    """The peers' per-sequence token mean (verl's seq-mean-token-mean, OpenRLHF's
    token_level_loss=False) as a per-row factor [..., 1] for fastrlhf's, or None where it is 1.

    Both peers divide row b by `mask.sum(-1) + 1e-8`, computed in the MASK's arithmetic: for a
    bool / integer mask the sum is an integer and `+ 1e-8` gives torch's default float dtype
    (float32 unless changed), where n + 1e-8 rounds back to n; for a float mask it is the mask's
    dtype (float64 keeps the 1e-8; float32 keeps it for rows of weights summing below ~0.2; bf16
    rounds the sum itself). fastrlhf divides by n_b = sum of the mask in its compute dtype (float64
    when the loss or the mask is, else float32). The factor is n_b / (the peer's divisor), both
    taken as computed and divided in float64; multiplied into the per-token loss it gives the
    peer's mean. It is None where the two divisors are provably equal (a bool mask with at most
    2^24 tokens a row against a float32 count), or where they differ only past the loss's own
    rounding (an integer mask's count in float32 against a float32 loss)."""
    dtype = torch.float64 if torch.float64 in (loss_dtype, mask.dtype) else torch.float32
    if not _row_divisor_may_differ(dtype, mask):
        return None
    n = mask.to(dtype).sum(-1, keepdim=True)  # fastrlhf's count (ops.losses.row_scale)
    divisor = mask.sum(-1, keepdim=True) + 1e-8  # the peers' own expression, in its own dtype
    return (n.double() / divisor.double()).to(dtype)


def _row_divisor_may_differ(dtype: torch.dtype, mask: torch.Tensor) -> bool:
    """Whether the peers' `mask.sum(-1) + 1e-8` can differ from fastrlhf's count in `dtype`
    (see row_mean_weights). No host sync."""
    if mask.is_floating_point():
        return True
    count = torch.get_default_dtype()  # the dtype of an integer sum + 1e-8
    if count == torch.float64:
        return True  # the 1e-8 is kept
    if torch.finfo(count).eps <= torch.finfo(dtype).eps:
        return False  # n + 1e-8 == n; rounding n itself (past 2^24) is the loss's own rounding
    # a float64 loss (or a narrower default dtype): the count is exact up to 2 / eps (2^24 in
    # float32), which bounds a bool mask's rows by their length; an integer mask's sums are not bounded
    return mask.dtype != torch.bool or mask.shape[-1] > 2 / torch.finfo(count).eps
