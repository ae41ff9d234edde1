"""Property tests (hypothesis) over random shapes and masks, on both backends.

Each property holds for every B, T and mask: agreement with reference.py in float64 (docs/ops.md
rule), and invariances the conventions promise (what lies under mask = 0 never matters).
"""

import pytest
import torch
from helpers import assert_close_to_ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastrlhf import ops
from fastrlhf import reference as ref

ATOL = 1e-5
# the backend fixture only sets an environment variable, valid for every example
SETTINGS = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@st.composite
def batches(draw, max_b=4, max_t=70):
    """(B, T, generator seed, mask): the mask drawn with a random density, or all ones / all zeros."""
    B = draw(st.integers(1, max_b))
    T = draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(["random", "ones", "zeros", "prefix"]))
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    if kind == "random":
        mask = torch.rand(B, T, generator=g) < draw(st.floats(0.05, 0.95))
    elif kind == "prefix":  # right padding of random lengths
        mask = torch.arange(T) < torch.randint(0, T + 1, (B, 1), generator=g)
    else:
        mask = torch.full((B, T), kind == "ones")
    return B, T, g, mask


@SETTINGS
@given(
    batch=batches(),
    mask_mode=st.sampled_from(["skip", "zero"]),
    whiten=st.booleans(),
    gamma=st.floats(0.5, 1.0),
    lam=st.floats(0.5, 1.0),
)
def test_gae_property(backend, batch, mask_mode, whiten, gamma, lam):
    B, T, g, mask = batch
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    kw = dict(gamma=gamma, lam=lam, mask_mode=mask_mode, whiten=whiten)
    adv, ret = ops.gae(rewards, values, mask, **kw)
    adv64, ret64 = ref.gae(rewards.double(), values.double(), mask, **kw)
    adv32, ret32 = ref.gae(rewards, values, mask, **kw)
    assert_close_to_ref(adv, adv64, adv32, atol=ATOL, name="advantages")
    assert_close_to_ref(ret, ret64, ret32, atol=ATOL, name="returns")
    # what lies under mask = 0 never matters
    off = ~mask
    noisy_r = torch.where(off, torch.randn(B, T, generator=g) * 100, rewards)
    noisy_v = torch.where(off, torch.randn(B, T, generator=g) * 100, values)
    adv2, ret2 = ops.gae(noisy_r, noisy_v, mask, **kw)
    assert torch.equal(adv2, adv) and torch.equal(ret2, ret)


@SETTINGS
@given(batch=batches(), unbiased=st.booleans())
def test_whiten_property(backend, batch, unbiased):
    B, T, g, mask = batch
    x = torch.randn(B, T, generator=g) * 3 + 5
    out = ops.whiten(x, mask, unbiased=unbiased)
    assert_close_to_ref(
        out,
        ref.whiten(x.double(), mask, unbiased=unbiased),
        ref.whiten(x, mask, unbiased=unbiased),
        atol=ATOL,
    )
    n = int(mask.sum())
    if n > 1:
        sel = out[mask].double()
        assert abs(sel.mean().item()) < 1e-5
        var = sel.var(unbiased=unbiased).item()
        assert var == pytest.approx(1.0, rel=1e-4) or var < 1e-4  # var < 1e-4: all equal up to eps


@SETTINGS
@given(
    batch=batches(), estimator=st.sampled_from(["k1", "k2", "k3", "abs"]), clamp=st.sampled_from([None, 10.0])
)
def test_kl_property(backend, batch, estimator, clamp):
    B, T, g, mask = batch
    logp = -torch.rand(B, T, generator=g) * 8
    ref_logp = logp + torch.randn(B, T, generator=g) * 2
    kl = ops.token_kl(logp, ref_logp, estimator=estimator, clamp=clamp)
    assert_close_to_ref(
        kl,
        ref.token_kl(logp.double(), ref_logp.double(), estimator=estimator, clamp=clamp),
        ref.token_kl(logp, ref_logp, estimator=estimator, clamp=clamp),
        atol=ATOL,
    )
    if estimator != "k1":
        assert (kl >= -1e-6).all()  # k2, k3, abs are non-negative estimators
    # shaped rewards: each row sums to score - kl_coef * sum(KL over its tokens), the score iff it has one
    scores = torch.randn(B, generator=g)
    rewards = ops.kl_shaped_rewards(
        scores, logp, ref_logp, mask, kl_coef=0.1, estimator=estimator, clamp=clamp
    )
    want = -0.1 * (kl.double() * mask).sum(-1) + scores.double() * mask.any(-1)
    torch.testing.assert_close(rewards.double().sum(-1), want, rtol=1e-5, atol=1e-5)
    assert (rewards[~mask] == 0).all()


@SETTINGS
@given(batch=batches(), agg=st.sampled_from(ref.AGG_MODES), dual_clip=st.sampled_from([None, 2.0]))
def test_policy_loss_property(backend, batch, agg, dual_clip):
    B, T, g, mask = batch
    logp = -torch.rand(B, T, generator=g) * 4
    old_logp = logp + torch.randn(B, T, generator=g) * 0.4
    adv = torch.randn(B, T, generator=g)
    upstream = torch.randn((), generator=g)
    kw = dict(clip_low=0.2, clip_high=0.3, dual_clip=dual_clip, agg=agg)

    def run(fn, lp, olp, a):
        x = lp.clone().requires_grad_()
        loss, stats = fn(x, olp, a, mask, **kw)
        loss.backward(upstream.to(loss.dtype))
        return loss, stats, x.grad

    loss, stats, d = run(ops.policy_loss, logp, old_logp, adv)
    loss64, stats64, d64 = run(ref.policy_loss, logp.double(), old_logp.double(), adv.double())
    loss32, stats32, d32 = run(ref.policy_loss, logp, old_logp, adv)
    assert_close_to_ref(loss, loss64, loss32, atol=ATOL, name="loss")
    assert_close_to_ref(d, d64, d32, atol=ATOL, name="d_logp")
    for k in ("clipfrac", "clipfrac_lower", "approx_kl"):
        assert_close_to_ref(stats[k], stats64[k], stats32[k], atol=ATOL, name=k)
    # garbage under mask = 0 changes nothing and gets no gradient
    off = ~mask
    loss2, _, d2 = run(
        ops.policy_loss, torch.where(off, logp + 50, logp), old_logp, torch.where(off, adv * 1e3, adv)
    )
    assert torch.equal(loss2, loss) and (d2[off] == 0).all()


@SETTINGS
@given(batch=batches(), agg=st.sampled_from(ref.AGG_MODES), clip=st.sampled_from([None, 0.1, 0.5]))
def test_value_loss_property(backend, batch, agg, clip):
    B, T, g, mask = batch
    values = torch.randn(B, T, generator=g)
    old_values = values + torch.randn(B, T, generator=g) * 0.3
    returns = torch.randn(B, T, generator=g)
    upstream = torch.randn((), generator=g)

    def run(fn, v, ov, r):
        x = v.clone().requires_grad_()
        loss, stats = fn(x, ov, r, mask, clip=clip, agg=agg)
        loss.backward(upstream.to(loss.dtype))
        return loss, stats, x.grad

    loss, stats, d = run(ops.value_loss, values, old_values, returns)
    loss64, stats64, d64 = run(ref.value_loss, values.double(), old_values.double(), returns.double())
    loss32, stats32, d32 = run(ref.value_loss, values, old_values, returns)
    assert_close_to_ref(loss, loss64, loss32, atol=ATOL, name="loss")
    assert_close_to_ref(d, d64, d32, atol=ATOL, name="d_values")
    assert loss.item() >= 0
    assert 0.0 <= stats["clipfrac"].item() <= 1.0
