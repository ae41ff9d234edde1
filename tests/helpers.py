"""Assertions and inputs shared by the op tests (import as `from helpers import ...`)."""

import importlib
import math

import torch


def worst(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where a and b differ most, for failure messages."""
    d = (a.double() - b.double()).abs().nan_to_num(float("inf"))
    if d.numel() == 0:
        return "empty"
    i = int(d.argmax())
    idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), d.shape)) if d.dim() else ()
    got, want = a.flatten()[i].item(), b.flatten()[i].item()
    return f"worst |diff| {d.flatten()[i].item():.3e} at {idx}: {got!r} vs {want!r}"


def assert_close_to_ref(out, ref64, ref_same_dtype, *, atol, name="output"):
    """docs/ops.md rule: |out - ref64| <= 2 * max|ref_same_dtype - ref64| + atol, plus the
    rounding of the float32 output itself (2 eps32 * |ref64|, elementwise): a float32 result
    cannot be closer than its own last bit, however lucky the same-dtype reference was.

    `ref64` is reference.py in float64; `ref_same_dtype` is reference.py run in the input
    dtype. NaN must match NaN exactly.
    """
    out, ref64, same = (x.detach().double().cpu() for x in (out, ref64, ref_same_dtype))
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    nan_out, nan_ref = torch.isnan(out), torch.isnan(ref64)
    assert torch.equal(nan_out, nan_ref), (
        f"{name}: NaN pattern differs ({int(nan_out.sum())} vs {int(nan_ref.sum())} NaNs)")
    ok = ~nan_ref
    if not ok.any():
        return
    diff = (out[ok] - ref64[ok]).abs()
    base = (same[ok] - ref64[ok]).abs().nan_to_num(0.0).max().item()
    allowed = 2 * base + atol + 2 * torch.finfo(torch.float32).eps * ref64[ok].abs()
    excess = diff - allowed
    i = int(excess.argmax())
    assert excess[i] <= 0, (
        f"{name}: err {diff[i].item():.3e} > 2 x {base:.3e} (same-dtype reference) + atol {atol:.1e} "
        f"+ fp32 rounding at |ref| {ref64[ok][i].item():.3e}; "
        f"{worst(out.masked_fill(~ok, 0), ref64.masked_fill(~ok, 0))}"
    )


def make_mask(B, T):
    """Row 0 right padding, row 1 left padding, row 2 all masked, row 3 gaps, the rest random."""
    m = torch.rand(B, T) > 0.25
    m[0] = torch.arange(T) < T - 5
    if B > 1:
        m[1] = torch.arange(T) >= 7
    if B > 2:
        m[2] = False
    if B > 3:
        m[3] = torch.arange(T) % 3 != 1
    return m


def poison_outputs(monkeypatch, *modules: str):
    """Make `torch.empty` / `torch.empty_like` in each named module (kernel launchers, op modules)
    return NaN-filled memory: every output element they allocate must then be written. Library
    code has no test hook for this; the fixture swaps the module's `torch` for a proxy. Modules
    are named, as `fastrlhf.ops.gae` the attribute is the function `gae`."""

    class _NaNTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            out = torch.empty(*args, **kwargs)
            return out.fill_(math.nan) if out.is_floating_point() else out

        @staticmethod
        def empty_like(*args, **kwargs):
            out = torch.empty_like(*args, **kwargs)
            return out.fill_(math.nan) if out.is_floating_point() else out

    for name in modules:
        monkeypatch.setattr(importlib.import_module(name), "torch", _NaNTorch())
