"""Device, precision, attention backend and CPU thread choices."""

from __future__ import annotations

import contextlib
import os

import torch

from fastrlhf.constants import SMALL_MODEL_PARAMS


def resolve_device(name: str) -> torch.device:
    """`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, *, lora: bool) -> torch.dtype:
    """`auto`: bfloat16 for a frozen LoRA base on CUDA, else float32."""
    if name == "auto":
        return torch.bfloat16 if (device.type == "cuda" and lora) else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype must be 'auto' or one of {list(dtypes)}, got {name!r}")
    return dtypes[name]


def autocast(device: torch.device):
    """bf16 autocast on CUDA; nothing on CPU (the tiny default trains in float32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def attention_backend(device: torch.device) -> str:
    """`flash_attention_2` when flash_attn is importable on CUDA, else PyTorch `sdpa`
    (whose CUDA flash backend is FlashAttention-2)."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def cpu_threads_for(num_params: int, device: torch.device) -> None:
    """One intra-op thread for a small model on CPU, unless OMP_NUM_THREADS says otherwise:
    kernels this small cost more in thread hand-offs than they gain (measured: the default
    PPO stage runs ~3x faster on one thread of a busy 2-core machine)."""
    if device.type == "cpu" and num_params < SMALL_MODEL_PARAMS and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
