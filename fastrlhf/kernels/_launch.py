"""Launch arithmetic on Python ints, shared by the launchers: no `triton.cdiv` / `next_power_of_2` (about
1.5 us each in Triton >= 3.5, against a few hundredths of a microsecond for integer arithmetic) and no
`get_device_properties` per call (the SM count is cached per device)."""

from __future__ import annotations

import functools

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device); elsewhere (the interpreter) 2, so
    that the CPU tests reach the few-rows split and the persistent grids with a handful of rows."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2
