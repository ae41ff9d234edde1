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


def row_mean_factor(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """n_b / (n_b + 1e-8) per row, [..., 1], n_b = sum_t mask: the peers' per-sequence token mean
    divides by n_b + 1e-8 where fastrlhf's divides by n_b. In float32 with a 0/1 mask the two are
    the same number (1e-8 is below half an ulp of any n_b >= 1); in float64, or with a weighting
    mask whose rows sum below 1, they are not, and this factor, multiplied into the per-token loss,
    gives the peers' mean exactly."""
    n = mask.to(dtype).sum(-1, keepdim=True)
    return n / (n + 1e-8)


def row_mean_differs(loss_dtype: torch.dtype, mask: torch.Tensor) -> bool:
    """Whether `row_mean_factor` can differ from 1 (see there)."""
    return mask.is_floating_point() or torch.float64 in (loss_dtype, mask.dtype)
