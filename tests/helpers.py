"""Assertions shared by the op tests (import as `from helpers import ...`)."""

import torch


def worst(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where a and b differ most, for failure messages."""
    d = (a.double() - b.double()).abs().nan_to_num(float("inf"))
    if d.numel() == 0:
        return "empty"
    i = int(d.argmax())
    idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), d.shape)) if d.dim() else ()
    return f"worst |diff| {d.flatten()[i].item():.3e} at {idx}: {a.flatten()[i].item()!r} vs {b.flatten()[i].item()!r}"


def assert_close_to_ref(out, ref64, ref_same_dtype, *, atol, name="output"):
    """DESIGN.md rule: |out - ref64| <= 2 * |ref_same_dtype - ref64| + atol, elementwise-max.

    `ref64` is reference.py in float64; `ref_same_dtype` is reference.py run in the input
    dtype. NaN must match NaN exactly.
    """
    out, ref64, same = out.detach().double().cpu(), ref64.detach().double().cpu(), ref_same_dtype.detach().double().cpu()
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    nan_out, nan_ref = torch.isnan(out), torch.isnan(ref64)
    assert torch.equal(nan_out, nan_ref), f"{name}: NaN pattern differs ({int(nan_out.sum())} vs {int(nan_ref.sum())})"
    ok = ~nan_ref
    if not ok.any():
        return
    err = (out[ok] - ref64[ok]).abs().max().item()
    base = (same[ok] - ref64[ok]).abs().nan_to_num(0.0).max().item()
    assert err <= 2 * base + atol, (
        f"{name}: max err {err:.3e} > 2 x {base:.3e} (same-dtype reference) + atol {atol:.1e}; "
        f"{worst(out.masked_fill(~ok, 0), ref64.masked_fill(~ok, 0))}"
    )
