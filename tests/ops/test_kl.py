"""token_kl and kl_shaped_rewards against reference.py in float64, on both backends."""

import math

import pytest
import torch
from helpers import assert_close_to_ref, make_mask, poison_outputs

from fastrlhf import ops
from fastrlhf import reference as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATOL = 1e-5
ESTIMATORS = ["k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl"]


@pytest.fixture
def poison(monkeypatch):
    poison_outputs(monkeypatch, "fastrlhf.kernels.kl", "fastrlhf.ops.kl")


def make_logps(shape, dtype, spread=1.0):
    """Log-probs of a policy and a reference that differ by ~N(0, spread); a few |r| > 20."""
    logp = -torch.rand(shape) * 6
    ref_logp = logp + torch.randn(shape) * spread
    ref_logp.view(-1)[::11] = logp.view(-1)[::11] + 25.0 * torch.sign(torch.randn(1))
    return logp.to(dtype), ref_logp.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("clamp", [None, 1.5])
def test_token_kl_forward_backward(backend, poison, dtype, estimator, clamp):
    logp, ref_logp = make_logps((3, 37), dtype)
    lp, rp = logp.clone().requires_grad_(), ref_logp.clone().requires_grad_()
    out = ops.token_kl(lp, rp, estimator=estimator, clamp=clamp)
    assert out.dtype == torch.float32 and out.shape == logp.shape

    lp64, rp64 = logp.double().requires_grad_(), ref_logp.double().requires_grad_()
    want = ref.token_kl(lp64, rp64, estimator=estimator, clamp=clamp)
    lps, rps = logp.clone().requires_grad_(), ref_logp.clone().requires_grad_()
    same = ref.token_kl(lps, rps, estimator=estimator, clamp=clamp)
    assert_close_to_ref(out, want, same, atol=ATOL, name="kl")

    grad = torch.randn(logp.shape)
    out.backward(grad)
    want.backward(grad.double())
    same.backward(grad.to(dtype))
    assert_close_to_ref(lp.grad, lp64.grad, lps.grad, atol=ATOL, name="d_logp")
    assert_close_to_ref(rp.grad, rp64.grad, rps.grad, atol=ATOL, name="d_ref_logp")


def test_token_kl_hand_worked(backend):
    # r = 1: k1 = 1, k2 = 0.5, k3 = e^-1 - 1 + 1 = 0.3679, abs = 1; r = -30: k3 = e^20 - 1 - 20 (r clamped
    # to -20 in both terms, as verl's low_var_kl); r = 25: k3 = e^-20 - 1 + 20 (not 24: float32 tells these
    # apart, not e^20 - 21 from e^20 - 31)
    logp = torch.tensor([0.0, -30.0, 25.0])
    ref_logp = torch.tensor([-1.0, 0.0, 0.0])
    assert ops.token_kl(logp, ref_logp, estimator="k1").tolist() == [1.0, -30.0, 25.0]
    assert ops.token_kl(logp, ref_logp, estimator="k2").tolist() == [0.5, 450.0, 312.5]
    k3 = ops.token_kl(logp, ref_logp, estimator="k3")
    expected = torch.tensor([math.exp(-1), math.exp(20) - 21, math.exp(-20) + 19])
    torch.testing.assert_close(k3, expected, rtol=1e-6, atol=0)
    assert ops.token_kl(logp, ref_logp, estimator="k3", clamp=10).tolist() == pytest.approx(
        [math.exp(-1), 10.0, 10.0]
    )
    # a -inf log-prob: +10 after verl's clamp (not -10), no gradient; outside |r| <= 20 k3 is flat
    x = torch.tensor([float("-inf"), -30.0, 25.0], requires_grad=True)
    k3 = ops.token_kl(x, torch.tensor([-1.0, 0.0, 0.0]), estimator="k3", clamp=10)
    k3.sum().backward()
    assert k3.tolist() == [10.0, 10.0, 10.0] and x.grad.tolist() == [0.0, 0.0, 0.0]
    y = torch.tensor([-30.0, 25.0], requires_grad=True)
    ops.token_kl(y, torch.zeros(2), estimator="k3").sum().backward()
    assert y.grad.tolist() == [0.0, 0.0]
    # d|r|/dr at r = 0 is 0, as torch's abs
    x = torch.zeros(2, requires_grad=True)
    ops.token_kl(x, torch.zeros(2), estimator="abs").sum().backward()
    assert x.grad.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_k3_near_zero_keeps_its_relative_accuracy(backend, sign):
    """k3 ~ r^2 / 2 and its derivative ~ r near r = 0, against float64 on the same r (the direct
    exp(-r) - 1 + r is off by ~1e-7 / r^2 there: 10% at r = 1e-3). The kernels sum the series: 1e-6
    relative, either side of its bound |r| = 0.5. The torch path's expm1(-r) + r: ~1e-7 / |r| relative
    (expm1's rounding of ~r), so 1e-6 relative from |r| = 0.1 and 2e-7 |r| absolute below."""
    r = sign * torch.tensor([1e-6, 1e-4, 1e-3, 3e-2, 0.1, 0.3, 0.4999, 0.5, 0.5001, 2.0])
    x = r.clone().requires_grad_()
    k3 = ops.token_kl(x, torch.zeros_like(r), estimator="k3")
    k3.sum().backward()
    r64 = r.double()
    expected = torch.expm1(-r64) + r64
    err = (k3.double() - expected).abs()
    if backend == "triton":
        assert (err <= 1e-6 * expected).all(), err / expected
    else:
        assert (err <= torch.maximum(1e-6 * expected, 2e-7 * r64.abs())).all(), err / expected
    torch.testing.assert_close(x.grad.double(), -torch.expm1(-r64), rtol=1e-6, atol=0)


def test_token_kl_nd_and_empty(backend):
    logp, ref_logp = make_logps((2, 3, 5), torch.float32)
    out = ops.token_kl(logp, ref_logp, estimator="k3")
    assert_close_to_ref(
        out,
        ref.token_kl(logp.double(), ref_logp.double(), estimator="k3"),
        ref.token_kl(logp, ref_logp, estimator="k3"),
        atol=ATOL,
    )
    empty = ops.token_kl(torch.zeros(0, 4), torch.zeros(0, 4), estimator="k2")
    assert empty.shape == (0, 4) and empty.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("estimator,clamp", [("k1", None), ("k3", 10.0), ("k2", 0.5), ("abs", None)])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_kl_shaped_rewards(backend, poison, dtype, estimator, clamp, mask_dtype):
    B, T = 5, 37
    logp, ref_logp = make_logps((B, T), dtype)
    mask = make_mask(B, T).to(mask_dtype)
    scores = torch.randn(B).to(dtype)
    kw = dict(kl_coef=0.05, estimator=estimator, clamp=clamp)
    out = ops.kl_shaped_rewards(scores, logp, ref_logp, mask, **kw)
    assert out.dtype == torch.float32
    want = ref.kl_shaped_rewards(scores.double(), logp.double(), ref_logp.double(), mask, **kw)
    same = ref.kl_shaped_rewards(scores, logp, ref_logp, mask, **kw)
    assert_close_to_ref(out, want, same, atol=ATOL, name="rewards")
    assert (out[~mask.bool()] == 0).all()


def test_kl_shaped_rewards_hand_worked(backend):
    # row 0: tokens 0..2 count, score on token 2; row 1: left-padded, score on token 3; row 2: nothing
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    logp = torch.full((3, 4), -1.0)
    ref_logp = torch.full((3, 4), -1.5)  # k1 = 0.5 everywhere
    scores = torch.tensor([2.0, -1.0, 7.0])
    out = ops.kl_shaped_rewards(scores, logp, ref_logp, mask, kl_coef=0.1)
    want = torch.tensor([[-0.05, -0.05, 1.95, 0.0], [0.0, 0.0, -0.05, -1.05], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("estimator,clamp", [("k1", None), ("k3", 10.0), ("abs", 1.5)])
@pytest.mark.parametrize("weighted", [False, True])
def test_straight_through(backend, poison, dtype, estimator, clamp, weighted):
    """The estimator's value, the gradient w * r of w * r^2 / 2 (verl "k3+", OpenRLHF unbiased_gradient)."""
    logp, ref_logp = make_logps((3, 37), dtype)
    weight = (torch.rand(3, 37) * 3).to(dtype) if weighted else None
    kw = dict(estimator=estimator, clamp=clamp, straight_through=True, grad_weight=weight)
    grad = torch.randn(logp.shape)
    outs = []
    for x, y, w in ((logp, ref_logp, weight), (logp.double(), ref_logp.double(), None if weight is None else
                                               weight.double()), (logp, ref_logp, weight)):
        x, y = x.clone().requires_grad_(), y.clone().requires_grad_()
        fn = ops.token_kl if not outs else ref.token_kl
        kl = fn(x, y, **dict(kw, grad_weight=w))
        outs.append((kl, *torch.autograd.grad(kl, (x, y), grad.to(kl.dtype))))
    for i, name in enumerate(("kl", "d_logp", "d_ref_logp")):
        assert_close_to_ref(outs[0][i], outs[1][i], outs[2][i], atol=ATOL, name=name)
    plain = ops.token_kl(logp, ref_logp, estimator=estimator, clamp=clamp)
    assert torch.equal(outs[0][0], plain), "straight-through changes the gradient only"
    if dtype == torch.float32:  # written out: d/dlogp = w * r * upstream
        r = logp.double() - ref_logp.double()
        want = r * grad.double() * (1.0 if weight is None else weight.double())
        torch.testing.assert_close(outs[0][1].double(), want, rtol=1e-5, atol=1e-6)
