"""policy_loss and value_loss against reference.py in float64, on both backends."""

import math

import pytest
import torch
from helpers import assert_close_to_ref, make_mask, poison_outputs

from fastrlhf import ops
from fastrlhf import reference as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATOL = 1e-5
POLICY_STATS = ("clipfrac", "clipfrac_lower", "approx_kl", "approx_kl_unclamped")
# the aggregation keywords beyond the mode, one case per mode that uses them
AGG_KW = [("token-mean", dict(global_num_tokens=1000, dp_size=4)), ("token-sum", dict(dp_size=3)),
          ("seq-mean-token-sum", dict(global_num_seqs=17, dp_size=2)), ("seq-mean-token-mean", dict(global_num_seqs=9)),
          ("seq-mean-token-sum-norm", dict(global_num_seqs=12, dp_size=2, loss_scale_factor=4096))]


@pytest.fixture
def poison(monkeypatch):
    poison_outputs(monkeypatch, "fastrlhf.kernels.ppo_loss", "fastrlhf.ops.losses")


def make_policy_inputs(B, T, dtype):
    """Ratios around 1 (many outside [0.8, 1.28]); some log-ratios beyond the +-20 clamp."""
    logp = -torch.rand(B, T) * 4
    old_logp = logp + torch.randn(B, T) * 0.3
    adv = torch.randn(B, T)
    old_logp.view(-1)[::13] = logp.view(-1)[::13] + 25.0  # log-ratio -25: clamped, no gradient
    far = slice(5, None, 17)
    old_logp.view(-1)[far] = logp.view(-1)[far] - 25.0  # log-ratio +25 with A > 0: ratio clipped
    adv.view(-1)[far] = adv.view(-1)[far].abs()
    return logp.to(dtype), old_logp.to(dtype), adv.to(dtype)


def run_policy(fn, logp, old_logp, adv, mask, grad, **kw):
    x = logp.clone().requires_grad_()
    loss, stats = fn(x, old_logp, adv, mask, **kw)
    loss.backward(grad.to(loss.dtype))
    return loss, stats, x.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("agg", ref.AGG_MODES)
@pytest.mark.parametrize("clip_high,dual_clip", [(None, None), (0.28, None), (None, 3.0), (0.28, 1.5)])
def test_policy_loss_matches_reference(backend, poison, dtype, agg, clip_high, dual_clip):
    B, T = 5, 37
    logp, old_logp, adv = make_policy_inputs(B, T, dtype)
    mask = make_mask(B, T)
    grad = torch.randn(())
    kw = dict(clip_low=0.2, clip_high=clip_high, dual_clip=dual_clip, agg=agg)
    loss, stats, d = run_policy(ops.policy_loss, logp, old_logp, adv, mask, grad, **kw)
    assert loss.dtype == torch.float32 and d.dtype == dtype
    loss64, stats64, d64 = run_policy(
        ref.policy_loss, logp.double(), old_logp.double(), adv.double(), mask, grad, **kw
    )
    loss_s, stats_s, d_s = run_policy(ref.policy_loss, logp, old_logp, adv, mask, grad, **kw)
    assert_close_to_ref(loss, loss64, loss_s, atol=ATOL, name="loss")
    assert_close_to_ref(d, d64, d_s, atol=ATOL, name="d_logp")
    for name in POLICY_STATS:
        assert stats[name].dtype == torch.float32 and not stats[name].requires_grad
        assert_close_to_ref(stats[name], stats64[name], stats_s[name], atol=ATOL, name=name)


def test_policy_loss_hand_worked(backend):
    # token 0: ratio e, A = 1 -> max(-e, -1.2) = -1.2, clipped, no gradient
    # token 1: ratio e, A = -1 -> max(e, 1.2) = e, gradient -A * ratio = e; dual-clip 2 -> min(e, 2) = 2
    # token 2: ratio 1, A = 0.5 -> -0.5, gradient -0.5
    logp = torch.tensor([[1.0, 1.0, 0.0]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    e = math.e
    for dual, want_loss, want_grad, want_lower in [
        (None, (-1.2 + e - 0.5) / 3, [0.0, e / 3, -0.5 / 3], 0.0),
        (2.0, (-1.2 + 2.0 - 0.5) / 3, [0.0, 0.0, -0.5 / 3], 1 / 3),
    ]:
        x = logp.clone().requires_grad_()
        loss, stats = ops.policy_loss(x, old, adv, mask, clip_low=0.2, dual_clip=dual)
        loss.backward()
        assert loss.item() == pytest.approx(want_loss, rel=1e-6)
        assert x.grad[0].tolist() == pytest.approx(want_grad, rel=1e-6, abs=1e-7)
        assert stats["clipfrac"].item() == pytest.approx(1 / 3)
        assert stats["clipfrac_lower"].item() == pytest.approx(want_lower)
        assert stats["approx_kl"].item() == pytest.approx(-2 / 3)


def test_policy_loss_global_num_tokens(backend):
    B, T = 4, 37
    logp, old_logp, adv = make_policy_inputs(B, T, torch.float32)
    mask = make_mask(B, T)
    grad = torch.randn(())
    kw = dict(agg="token-mean", global_num_tokens=1000)
    loss, _, d = run_policy(ops.policy_loss, logp, old_logp, adv, mask, grad, **kw)
    loss64, _, d64 = run_policy(
        ref.policy_loss, logp.double(), old_logp.double(), adv.double(), mask, grad, **kw
    )
    loss_s, _, d_s = run_policy(ref.policy_loss, logp, old_logp, adv, mask, grad, **kw)
    assert_close_to_ref(loss, loss64, loss_s, atol=ATOL, name="loss")
    assert_close_to_ref(d, d64, d_s, atol=ATOL, name="d_logp")


@pytest.mark.parametrize("agg", ref.AGG_MODES)
def test_losses_all_masked_batch(backend, poison, agg):
    B, T = 3, 37
    logp, old_logp, adv = make_policy_inputs(B, T, torch.float32)
    mask = torch.zeros(B, T, dtype=torch.bool)
    loss, stats, d = run_policy(
        ops.policy_loss, logp, old_logp, adv, mask, torch.randn(()), agg=agg, dual_clip=3.0
    )
    assert loss.item() == 0.0 and (d == 0).all()
    assert all(math.isfinite(stats[k].item()) for k in POLICY_STATS)
    v = torch.randn(B, T, requires_grad=True)
    vloss, vstats = ops.value_loss(v, torch.randn(B, T), torch.randn(B, T), mask, agg=agg)
    vloss.backward()
    assert vloss.item() == 0.0 and (v.grad == 0).all() and math.isfinite(vstats["clipfrac"].item())


def test_losses_empty_batch(backend):
    x = torch.zeros(0, 7, requires_grad=True)
    loss, stats = ops.policy_loss(
        x, torch.zeros(0, 7), torch.zeros(0, 7), torch.zeros(0, 7, dtype=torch.bool)
    )
    assert loss.item() == 0.0 and all(stats[k].item() == 0.0 for k in POLICY_STATS)
    vloss, vstats = ops.value_loss(
        x, torch.zeros(0, 7), torch.zeros(0, 7), torch.zeros(0, 7, dtype=torch.bool)
    )
    assert vloss.item() == 0.0 and vstats["clipfrac"].item() == 0.0


def make_value_inputs(B, T, dtype):
    values = torch.randn(B, T)
    old_values = values + torch.randn(B, T) * 0.3  # about half the tokens move by more than the clip
    returns = torch.randn(B, T)
    return values.to(dtype), old_values.to(dtype), returns.to(dtype)


def run_value(fn, values, old_values, returns, mask, grad, **kw):
    v = values.clone().requires_grad_()
    loss, stats = fn(v, old_values, returns, mask, **kw)
    loss.backward(grad.to(loss.dtype))
    return loss, stats, v.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("agg", ref.AGG_MODES)
@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_reference(backend, poison, dtype, agg, clip):
    B, T = 5, 37
    values, old_values, returns = make_value_inputs(B, T, dtype)
    mask = make_mask(B, T).float()
    grad = torch.randn(())
    kw = dict(clip=clip, agg=agg)
    loss, stats, d = run_value(ops.value_loss, values, old_values, returns, mask, grad, **kw)
    assert loss.dtype == torch.float32 and d.dtype == dtype
    loss64, stats64, d64 = run_value(
        ref.value_loss, values.double(), old_values.double(), returns.double(), mask, grad, **kw
    )
    loss_s, stats_s, d_s = run_value(ref.value_loss, values, old_values, returns, mask, grad, **kw)
    assert_close_to_ref(loss, loss64, loss_s, atol=ATOL, name="loss")
    assert_close_to_ref(d, d64, d_s, atol=ATOL, name="d_values")
    assert_close_to_ref(
        stats["clipfrac"], stats64["clipfrac"], stats_s["clipfrac"], atol=ATOL, name="clipfrac"
    )


def test_value_loss_hand_worked(backend):
    # token 0: v = 1.5, old = 1 -> v_clip = 1.2; R = 0: max(2.25, 1.44) = 2.25, gradient v - R = 1.5
    # token 1: same v, old; R = 3: max(2.25, 3.24) = 3.24 (clipped), no gradient
    v = torch.tensor([[1.5, 1.5]], requires_grad=True)
    loss, stats = ops.value_loss(v, torch.ones(1, 2), torch.tensor([[0.0, 3.0]]), torch.ones(1, 2), clip=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (2.25 + 3.24) / 2, rel=1e-6)
    assert v.grad[0].tolist() == pytest.approx([1.5 / 2, 0.0], abs=1e-7)
    assert stats["clipfrac"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("agg,agg_kw", AGG_KW)
def test_policy_loss_is_weights_and_global_counts(backend, poison, dtype, agg, agg_kw):
    """Per-token importance weights and every aggregation keyword, against reference.py in float64."""
    B, T = 5, 37
    logp, old_logp, adv = make_policy_inputs(B, T, dtype)
    is_weights = (torch.rand(B, T) * 2).to(dtype)
    mask = make_mask(B, T)
    grad = torch.randn(())
    kw = dict(clip_high=0.28, dual_clip=3.0, agg=agg, **agg_kw)
    loss, stats, d = run_policy(ops.policy_loss, logp, old_logp, adv, mask, grad, is_weights=is_weights, **kw)
    loss64, stats64, d64 = run_policy(ref.policy_loss, logp.double(), old_logp.double(), adv.double(), mask, grad,
                                      is_weights=is_weights.double(), **kw)
    loss_s, stats_s, d_s = run_policy(ref.policy_loss, logp, old_logp, adv, mask, grad, is_weights=is_weights, **kw)
    assert_close_to_ref(loss, loss64, loss_s, atol=ATOL, name="loss")
    assert_close_to_ref(d, d64, d_s, atol=ATOL, name="d_logp")
    for name in POLICY_STATS:
        assert_close_to_ref(stats[name], stats64[name], stats_s[name], atol=ATOL, name=name)


@pytest.mark.parametrize("agg,agg_kw", AGG_KW)
def test_value_loss_global_counts(backend, poison, agg, agg_kw):
    B, T = 5, 37
    values, old_values, returns = make_value_inputs(B, T, torch.bfloat16)
    mask = make_mask(B, T)
    grad = torch.randn(())
    kw = dict(clip=0.2, agg=agg, **agg_kw)
    loss, _, d = run_value(ops.value_loss, values, old_values, returns, mask, grad, **kw)
    loss64, _, d64 = run_value(ref.value_loss, values.double(), old_values.double(), returns.double(), mask, grad,
                               **kw)
    loss_s, _, d_s = run_value(ref.value_loss, values, old_values, returns, mask, grad, **kw)
    assert_close_to_ref(loss, loss64, loss_s, atol=ATOL, name="loss")
    assert_close_to_ref(d, d64, d_s, atol=ATOL, name="d_values")


@pytest.mark.parametrize("agg", ref.AGG_MODES)
def test_agg_loss_matches_reference(backend, agg):
    B, T = 5, 37
    loss_mat = torch.randn(B, T, dtype=torch.float64)
    mask = make_mask(B, T).float() * torch.rand(B, T)  # a weighting float mask, row 2 empty
    upstream = torch.randn((), dtype=torch.float64)
    outs = []
    for x in (loss_mat.float(), loss_mat, loss_mat.float()):
        x = x.clone().requires_grad_()
        fn = ops.agg_loss if not outs else ref.agg_loss
        loss = fn(x, mask, agg=agg)
        outs.append((loss, torch.autograd.grad(loss, x, upstream.to(loss.dtype))[0]))
    assert outs[0][0].dtype == torch.float32 and outs[0][0].dim() == 0
    for i, name in enumerate(("loss", "d_loss_mat")):
        assert_close_to_ref(outs[0][i], outs[1][i], outs[2][i], atol=ATOL, name=name)
    assert ops.agg_loss(loss_mat, torch.zeros(B, T), agg=agg).item() == 0.0  # an empty local mask gives 0


def test_agg_loss_hand_worked(backend):
    # rows: [1, 2 | 3 masked], [4 | 5, 6 masked], [all masked]: n_b = 2, 1, 0; S = 2; T = 3
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    want = {"token-mean": 7 / 3, "token-sum": 7.0, "seq-mean-token-sum": (3 + 4) / 2,
            "seq-mean-token-mean": (1.5 + 4) / 2, "seq-mean-token-sum-norm": (3 + 4) / 2 / 3}
    for agg, value in want.items():
        assert ops.agg_loss(loss_mat, mask, agg=agg).item() == pytest.approx(value, rel=1e-6), agg
    assert ops.agg_loss(loss_mat, mask, agg="seq-mean-token-sum", global_num_seqs=7, dp_size=2).item() == \
        pytest.approx(7 / 7 * 2, rel=1e-6)
    assert ops.agg_loss(loss_mat, mask, agg="seq-mean-token-sum-norm", loss_scale_factor=10).item() == \
        pytest.approx(3.5 / 10, rel=1e-6)


@pytest.mark.parametrize("agg", ref.AGG_MODES)
def test_nan_off_the_mask_never_matters(backend, agg):
    """NaN / inf where mask = 0 (e.g. log-probs of padding labels) change no loss, stat or gradient."""
    B, T = 4, 37
    logp, old_logp, adv = make_policy_inputs(B, T, torch.float32)
    values, old_values, returns = make_value_inputs(B, T, torch.float32)
    mask = make_mask(B, T)
    off = ~mask
    noisy = lambda x, v: torch.where(off, torch.full_like(x, v), x)  # noqa: E731
    for fn, clean, dirty in (
        (ops.policy_loss, (logp, old_logp, adv), (noisy(logp, float("nan")), noisy(old_logp, float("inf")),
                                                  noisy(adv, float("nan")))),
        (ops.value_loss, (values, old_values, returns), (noisy(values, float("inf")), old_values,
                                                         noisy(returns, float("nan")))),
    ):
        results = []
        for x, *rest in (clean, dirty):
            x = x.clone().requires_grad_()
            loss, stats = fn(x, *rest, mask, agg=agg)
            results.append((loss, stats, torch.autograd.grad(loss, x)[0]))
        (loss, stats, d), (loss_n, stats_n, d_n) = results
        assert torch.equal(loss, loss_n), fn.__name__
        assert all(torch.equal(stats[k], stats_n[k]) for k in stats), fn.__name__
        assert torch.equal(d, d_n) and (d_n[off] == 0).all(), fn.__name__
