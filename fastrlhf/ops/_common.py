"""What every op module shares: backend dispatch, the output dtype rule and argument checks.

Imports nothing of `fastrlhf.ops` (the op modules import it, never the reverse).
"""

from __future__ import annotations

import math
import numbers
import os

import torch

BACKENDS = ("auto", "torch", "triton")


# ---------------------------------------------------------------- dispatch and dtypes


def use_triton(x: torch.Tensor) -> bool:
    """True when `x` goes through the Triton kernels: CUDA tensors, or any tensor with
    FASTRLHF_BACKEND=triton (on CPU that needs TRITON_INTERPRET=1); FASTRLHF_BACKEND=torch
    forces the torch path."""
    backend = os.environ.get("FASTRLHF_BACKEND", "auto").lower()
    if backend == "auto":
        return x.is_cuda
    if backend == "torch":
        return False
    if backend not in BACKENDS:
        raise ValueError(f"FASTRLHF_BACKEND must be one of {BACKENDS}, got {backend!r}")
    interpreted = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
    if backend == "triton" and not x.is_cuda and not interpreted:
        raise ValueError(f"FASTRLHF_BACKEND=triton needs CUDA tensors, or TRITON_INTERPRET=1 (set before triton is "
                         f"imported) for {x.device} tensors; got a {x.device} tensor")
    return backend == "triton"


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`: itself when it already is (no dispatcher call)."""
    return x if x.dtype == dtype else x.to(dtype)


def out_dtype(x: torch.Tensor) -> torch.dtype:
    """Outputs are float32 whatever the input dtype, float64 for float64 inputs (ground-truth
    checks; the Triton path computes in float32 either way)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, T] view of a per-token tensor: [T] -> [1, T], [..., T] -> [-1, T]."""
    if x.dim() == 1:
        return x.unsqueeze(0)
    if x.dim() > 2:
        return x.reshape(-1, x.shape[-1])
    return x


def contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself when contiguous (no dispatcher call), else a contiguous copy."""
    return x if x.is_contiguous() else x.contiguous()


def safe_inverse(n: torch.Tensor) -> torch.Tensor:
    """1 / n, and 0 where n == 0 (an empty mask contributes nothing), without a host sync."""
    return torch.where(n > 0, 1.0 / torch.where(n > 0, n, 1.0), 0.0)


# ---------------------------------------------------------------- argument checks


def check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_float(name: str, x) -> None:
    check_tensor(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (bf16/fp16/fp32/fp64), got {x.dtype}")


def check_int(name: str, x) -> None:
    check_tensor(name, x)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of token ids, got {x.dtype}")


def check_device(name: str, x: torch.Tensor, first: str, like: torch.Tensor) -> None:
    if x.device != like.device:
        raise ValueError(f"{name} is on {x.device} but {first} is on {like.device}; expected one device")


def check_shape(name: str, x: torch.Tensor, shape, what: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {what} = {tuple(shape)}, got {tuple(x.shape)}")


def check_mask(mask, like_tensor: torch.Tensor, like: str) -> None:
    check_tensor("mask", mask)
    if mask.is_complex():
        raise TypeError(f"mask must be bool, integer or float, got {mask.dtype}")
    if mask.shape != like_tensor.shape:
        raise ValueError(f"mask must have the shape of {like} {tuple(like_tensor.shape)}, got {tuple(mask.shape)}")
    check_device("mask", mask, like, like_tensor)


def check_same(first: str, x: torch.Tensor, **others) -> None:
    """Every tensor in `others` (None: skipped) is a float tensor with x's shape and device."""
    for name, y in others.items():
        if y is None:
            continue
        check_float(name, y)
        if y.shape != x.shape:
            raise ValueError(f"{name} must have the shape of {first} {tuple(x.shape)}, got {tuple(y.shape)}")
        check_device(name, y, first, x)


def check_number(name: str, value, *, positive=False, nonnegative=False, above=None) -> float:
    # `abs(value) < inf`, not math.isfinite: under torch.compile a float argument whose value changed
    # between calls is a SymFloat, and math.isfinite of one breaks the graph (an error with fullgraph)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not abs(value) < math.inf:
        raise TypeError(f"{name} must be a finite real number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if nonnegative and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if above is not None and value <= above:
        raise ValueError(f"{name} must be > {above}, got {value}")
    return float(value)


def check_integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


def check_rows(name: str, x: torch.Tensor) -> None:
    """A per-token tensor has at least one dim: [B, T], [T] or [..., T]."""
    if x.dim() == 0:
        raise ValueError(f"{name} must be a per-token tensor [B, T], [T] or [..., T], got a 0-d tensor")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
