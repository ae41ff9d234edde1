"""fastrlhf.integrations.openrlhf against the installed OpenRLHF: patched == original (forward
and gradients, both backends), OpenRLHF's conventions kept, patch()/unpatch() bookkeeping."""

import functools
import importlib.metadata
import math

import pytest
import torch
from helpers import make_mask

from fastrlhf import reference

from .peer_checks import (
    assert_close_to_peer,
    assert_float64_as_peer,
    check_inputs_the_peer_rejects,
    check_ratio_tie_gradients,
    clamp_gradient_at_bound,
    compare,
    grad_of,
    gradient_only,
    ratio_tie_inputs,
    unpatched,
)

B, T, V = 6, 13, 37


@pytest.fixture
def orl(openrlhf_integration):
    import openrlhf.models.loss as loss
    import openrlhf.models.utils as utils
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    originals = {
        "log_probs_from_logits": utils.log_probs_from_logits,
        # the original is torch.compile'd; compare with the same code run eagerly (no inductor build in tests)
        "compute_entropy": utils.compute_entropy._torchdynamo_orig_callable,
        "compute_approx_kl": utils.compute_approx_kl,
        "PolicyLoss.forward": loss.PolicyLoss.forward,
        "ValueLoss.forward": loss.ValueLoss.forward,
        "gae": RemoteExperienceMaker.get_advantages_and_returns,
        "aggregate_loss": loss.aggregate_loss,
    }
    for name in ("PolicyLoss.forward", "ValueLoss.forward"):  # they call aggregate_loss through the module
        originals[name] = unpatched(openrlhf_integration, originals[name])
    openrlhf_integration.patch()
    patched = {
        "log_probs_from_logits": utils.log_probs_from_logits,
        "compute_entropy": utils.compute_entropy,
        "compute_approx_kl": utils.compute_approx_kl,
        "PolicyLoss.forward": loss.PolicyLoss.forward,
        "ValueLoss.forward": loss.ValueLoss.forward,
        "gae": RemoteExperienceMaker.get_advantages_and_returns,
        "aggregate_loss": loss.aggregate_loss,
    }
    return originals, patched, loss


# ---------------------------------------------------------------- bookkeeping


def test_patch_rebinds_every_reference_and_unpatch_restores(openrlhf_integration):
    import openrlhf.models as models
    import openrlhf.models.actor as actor
    import openrlhf.models.loss as loss
    import openrlhf.models.utils as utils
    import openrlhf.trainer.ppo_utils.experience_maker as em
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    def refs():
        return (utils.log_probs_from_logits, actor.log_probs_from_logits, utils.compute_entropy, actor.compute_entropy,
                utils.compute_approx_kl, em.compute_approx_kl, ppo_actor.compute_approx_kl,
                loss.PolicyLoss.forward, loss.ValueLoss.forward, em.RemoteExperienceMaker.get_advantages_and_returns,
                loss.aggregate_loss, models.aggregate_loss, ppo_actor.aggregate_loss)

    before = refs()
    reward = utils.compute_reward
    openrlhf_integration.patch()
    openrlhf_integration.patch()
    after = refs()
    assert all(a is not b for a, b in zip(after, before))
    assert actor.log_probs_from_logits is utils.log_probs_from_logits
    assert ppo_actor.compute_approx_kl is utils.compute_approx_kl is em.compute_approx_kl
    assert ppo_actor.aggregate_loss is models.aggregate_loss is loss.aggregate_loss
    assert utils.compute_reward is reward  # deliberately not replaced (module docstring)
    openrlhf_integration.unpatch()
    openrlhf_integration.unpatch()
    assert all(a is b for a, b in zip(refs(), before))


def test_refuses_unsupported_version(openrlhf_integration, monkeypatch):
    from fastrlhf.integrations import UnsupportedPeerError

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.10.4" if d == "openrlhf" else real(d))
    with pytest.raises(UnsupportedPeerError, match=r"OpenRLHF >= 0\.11.*0\.10\.4"):
        openrlhf_integration.patch()


# ---------------------------------------------------------------- log-probs and entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_from_logits(orl, backend, dtype, op_calls):
    originals, patched, _ = orl
    logits = (torch.randn(B, T, V) * 3).to(dtype)
    labels = torch.roll(torch.randint(0, V, (B, T)), -1, 1)
    compare(patched["log_probs_from_logits"], originals["log_probs_from_logits"], [logits, labels], diff=(0,))
    assert op_calls["logprobs"] == 1


def test_labels_and_logits_openrlhf_rejects_get_fastrlhfs_answers(orl, backend):
    """Documented under "Not kept" in fastrlhf.integrations.openrlhf."""
    originals, patched, _ = orl
    check_inputs_the_peer_rejects(patched["log_probs_from_logits"], originals["log_probs_from_logits"],
                                  patched["compute_entropy"], originals["compute_entropy"])


def test_log_probs_from_logits_temperature_divides_in_place(orl, backend):
    originals, patched, _ = orl
    logits = torch.randn(B, T, V) * 3
    labels = torch.randint(0, V, (B, T))
    a, b = logits.clone(), logits.clone()
    got = patched["log_probs_from_logits"](a, labels, temperature=0.6)
    want = originals["log_probs_from_logits"](b, labels, temperature=0.6)
    assert torch.equal(a, b)  # OpenRLHF leaves the caller's logits divided; so does the patched function
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compute_entropy(orl, backend, dtype, op_calls):
    originals, patched, _ = orl
    logits = (torch.randn(B, T, V) * 3).to(dtype)
    compare(patched["compute_entropy"], originals["compute_entropy"], [logits], diff=(0,))
    assert op_calls["entropy"] == 1 and op_calls["logprobs"] == 0


# ---------------------------------------------------------------- KL


def _kl_inputs():
    logp = torch.randn(B, T) * 2
    base = logp + torch.randn(B, T) * 3
    base[0, :4] = logp[0, :4]  # exact ties
    base[1, :4] = logp[1, :4] + torch.tensor([25.0, -25.0, 12.0, -12.0])  # past the -10 / +-10 clamps
    old = logp + 0.3 * torch.randn(B, T)
    old[2, :2] = logp[2, :2] - torch.tensor([3.0, 0.0])  # an importance weight past KL_IS_WEIGHT_CLIP, one of 1
    return logp, base, old


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_compute_approx_kl(orl, backend, estimator, dtype, op_calls):
    originals, patched, _ = orl
    logp, base, _ = _kl_inputs()
    args = [logp.to(dtype), base.to(dtype), None, estimator, False]
    # OpenRLHF computes in float32 whatever the input dtype: float64 inputs get float32's atol
    compare(patched["compute_approx_kl"], originals["compute_approx_kl"], args, diff=(0, 1),
            atol=1e-6 if dtype == torch.float64 else None)
    assert op_calls["token_kl"] == 1


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_old", [True, False])
def test_compute_approx_kl_unbiased_gradient(orl, backend, estimator, dtype, with_old, op_calls):
    """unbiased_gradient: the estimator's value, the gradient of w r^2 / 2 (w the clamped importance
    weight). OpenRLHF forms the value as (v + g) - g in float32, which rounds it by up to an ulp
    of g = w r^2 / 2; the truth is v itself, reference.py's estimator in float64 (OpenRLHF's k3,
    with its log-ratio clamped at -10, equals reference.py's after the +-10 clamp for these r).
    Values against that truth by DESIGN.md's rule; gradients against OpenRLHF's."""
    originals, patched, _ = orl
    logp, base, old = (t.to(dtype) for t in _kl_inputs())
    old = old if with_old else None
    got = patched["compute_approx_kl"](logp, base, old, estimator, True)
    peer = originals["compute_approx_kl"](logp, base, old, estimator, True)
    truth = reference.token_kl(logp.double(), base.double(), estimator=estimator, clamp=10.0)
    assert got.dtype == peer.dtype == torch.float32
    assert_close_to_peer(got, truth, peer, atol=1e-6, name="value")
    compare(gradient_only(patched["compute_approx_kl"]), gradient_only(originals["compute_approx_kl"]),
            [logp, base, old, estimator, True], diff=(0, 1))
    assert op_calls["token_kl"] == 2


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("unbiased", [False, True])
def test_compute_approx_kl_non_finite_log_probs(orl, backend, estimator, unbiased, op_calls):
    """-inf / inf / NaN and huge log-probs: OpenRLHF's clamps give a zero gradient at NaN and past
    their bounds where fastrlhf's gradient is NaN (such calls run OpenRLHF's own), k3's clamped
    linear term gives +10 at r = -inf, and the unbiased value is NaN where w r^2 / 2 is not finite."""
    originals, patched, _ = orl
    logp, base, old = _kl_inputs()
    logp[0, :5] = torch.tensor([-float("inf"), 0.0, float("nan"), -3e9, 3e9])
    base[0, :5] = torch.tensor([-1.0, -float("inf"), 0.0, 0.0, 0.0])
    if not unbiased:
        compare(patched["compute_approx_kl"], originals["compute_approx_kl"], [logp, base, None, estimator, False],
                diff=(0, 1))
        assert op_calls["token_kl"] == 0
        return
    got = patched["compute_approx_kl"](logp, base, old, estimator, True)
    peer = originals["compute_approx_kl"](logp, base, old, estimator, True)
    assert torch.equal(got.isnan(), peer.isnan()) and bool(peer.isnan().any())
    finite = ~peer.isnan()
    truth = reference.token_kl(logp.double(), base.double(), estimator=estimator, clamp=10.0)
    if estimator == "k3":  # OpenRLHF's k3 clamps r at -10 in its linear term too: +10 for r = -3e9
        truth = torch.where(logp.double() - base.double() < -10, 10.0, truth)
    assert_close_to_peer(got[finite], truth[finite], peer[finite], atol=1e-6, name="value")
    compare(gradient_only(patched["compute_approx_kl"]), gradient_only(originals["compute_approx_kl"]),
            [logp, base, old, estimator, True], diff=(0, 1))
    assert op_calls["token_kl"] == 2


def test_compute_approx_kl_errors_are_openrlhfs(orl):
    originals, patched, _ = orl
    for fn in (originals["compute_approx_kl"], patched["compute_approx_kl"]):
        with pytest.raises(ValueError, match="Unknown kl_estimator"):
            fn(torch.randn(2, 3), torch.randn(2, 3), kl_estimator="k4")


# ---------------------------------------------------------------- PPO losses


def _policy_inputs(empty=False):
    old = torch.randn(B, T) - 1
    logp = old + torch.randn(B, T) * 0.4
    logp[0, 0] = old[0, 0] + 30.0  # past the +-20 log-ratio clamp: OpenRLHF's ppo_kl keeps it unclamped
    adv = torch.randn(B, T)
    mask = torch.zeros(B, T, dtype=torch.bool) if empty else make_mask(B, T)
    rollout = old + 0.2 * torch.randn(B, T)
    return logp, old, adv, mask, rollout


BATCH_INFO = [
    {},
    {"batch_num_tokens": 40.0},
    {"dp_size": 2, "batch_num_tokens": 90.0, "global_batch_size": 11.0},
    {"global_batch_size": 9.0},
    {"dp_size": 4},
]


def _info_id(d):
    return ",".join(f"{k}={v}" for k, v in d.items()) or "local"


DTYPES = [(torch.float32, torch.bool), (torch.bfloat16, torch.float32), (torch.float64, torch.int64)]


def _float64_on_kernels(backend, cases):
    """How many (dtype, ...) cases the adapters send to OpenRLHF's own function because the Triton
    kernels compute float64 inputs in float32 (the torch path keeps float64)."""
    return sum(c[0] == torch.float64 for c in cases) if backend == "triton" else 0


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("info", BATCH_INFO, ids=_info_id)
def test_aggregate_loss(orl, backend, token_level, info, op_calls):
    originals, patched, _ = orl
    for loss_dtype, mask_dtype in DTYPES:
        loss = (torch.randn(B, T) * 2).to(loss_dtype)
        mask = make_mask(B, T).to(mask_dtype)
        compare(patched["aggregate_loss"], originals["aggregate_loss"], [loss, mask, token_level], kwargs=info,
                diff=(0,), upstream=torch.tensor(1.3, dtype=torch.float64))
    assert op_calls["agg_loss"] == len(DTYPES)


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("info", [{}, {"dp_size": 2, "batch_num_tokens": 90.0, "global_batch_size": 11.0}],
                         ids=_info_id)
def test_aggregate_loss_empty_mask_non_finite_values_and_small_weights(orl, backend, token_level, info, op_calls):
    """Without global counts an empty mask gives OpenRLHF's 0 / 0 = NaN with NaN gradients; a
    NaN / inf at any mask = 0 token makes every mode's loss NaN (loss * mask), gradients finite;
    the per-sample mean divides by n_b + 1e-8 (visible with weights summing below 1, or float64)."""
    originals, patched, _ = orl
    mask = make_mask(B, T)
    nan_in_empty_row, inf_in_padding = torch.randn(B, T), torch.randn(B, T)
    nan_in_empty_row[2, 0] = float("nan")  # row 2 is fully masked
    inf_in_padding[0, -1] = float("inf")  # row 0 is right-padded
    cases = [(torch.randn(B, T), torch.zeros(B, T, dtype=torch.bool)), (nan_in_empty_row, mask),
             (inf_in_padding, mask), (torch.randn(B, T), mask * torch.rand(B, T) * 1e-4),
             (torch.randn(B, T, dtype=torch.float64), mask.double())]
    for loss, m in cases:
        got, _ = compare(patched["aggregate_loss"], originals["aggregate_loss"], [loss, m, token_level], kwargs=info,
                         diff=(0,), upstream=torch.tensor(0.9, dtype=torch.float64))
        assert math.isnan(got.item()) == (not torch.isfinite(loss).all().item() or (not m.any() and not info))
    assert op_calls["agg_loss"] == len(cases)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32, torch.float64], ids=str)
def test_per_sample_mean_of_float64_losses_divides_as_openrlhf(orl, backend, mask_dtype):
    """token_level_loss=False divides row b by mask.sum(-1) + 1e-8 in the MASK's arithmetic:
    float32 for a bool, int or float32 mask (where n + 1e-8 == n), float64 for a float64 mask. A
    float64 loss gets OpenRLHF's number to float64 precision, value and gradient, in
    aggregate_loss, PolicyLoss and ValueLoss (losses of one sign: nothing cancels in the means)."""
    originals, patched, loss = orl
    mask = make_mask(B, T).to(mask_dtype)
    per_token = torch.rand(B, T, dtype=torch.float64) + 0.5
    assert_float64_as_peer(patched["aggregate_loss"], originals["aggregate_loss"], [per_token, mask, False], diff=0)
    policy = loss.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0, token_level_loss=False)
    logp, old, adv, _, _ = (t.double() for t in _policy_inputs())
    assert_float64_as_peer(lambda *a: patched["PolicyLoss.forward"](policy, *a),
                           lambda *a: originals["PolicyLoss.forward"](policy, *a),
                           [logp, old, adv.abs() + 0.1, mask], diff=0)
    value = loss.ValueLoss(clip_eps=0.2, token_level_loss=False)
    values, old_values, returns = (torch.randn(B, T, dtype=torch.float64) for _ in range(3))
    assert_float64_as_peer(lambda *a: patched["ValueLoss.forward"](value, *a),
                           lambda *a: originals["ValueLoss.forward"](value, *a),
                           [values, old_values, returns, mask], diff=0)


def test_aggregate_loss_bad_counts_run_openrlhfs(orl, op_calls):
    originals, patched, _ = orl
    loss, mask = torch.randn(B, T).abs(), make_mask(B, T)
    for kwargs in (dict(batch_num_tokens=0.0), dict(token_level_loss=False, global_batch_size=-1.0)):
        got = patched["aggregate_loss"](loss, mask, **kwargs)
        assert got.item() == originals["aggregate_loss"](loss, mask, **kwargs).item()
    assert op_calls["agg_loss"] == 0


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("info", BATCH_INFO, ids=_info_id)
def test_policy_loss(orl, backend, token_level, dual_clip, info, op_calls):
    originals, patched, loss = orl
    module = loss.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip, token_level_loss=token_level)
    logp, old, adv, mask, rollout = _policy_inputs()
    compare(lambda *a, **k: patched["PolicyLoss.forward"](module, *a, **k),
            lambda *a, **k: originals["PolicyLoss.forward"](module, *a, **k),
            [logp, old, adv, mask], kwargs=info, diff=(0,), upstream=torch.tensor(1.3, dtype=torch.float64))
    assert op_calls["policy_loss"] == 1 and op_calls["agg_loss"] == 0


@pytest.mark.parametrize("token_level", [True, False])
def test_policy_loss_dtypes_and_weighting_masks(orl, backend, token_level, op_calls):
    originals, patched, loss = orl
    module = loss.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0, token_level_loss=token_level)
    cases = [(torch.bfloat16, make_mask(B, T)), (torch.float64, make_mask(B, T).long()),
             (torch.float32, make_mask(B, T) * torch.rand(B, T)), (torch.float64, make_mask(B, T) * 1e-3)]
    for dtype, mask in cases:
        logp, old, adv, _, _ = (t.to(dtype) for t in _policy_inputs())
        compare(lambda *a, **k: patched["PolicyLoss.forward"](module, *a, **k),
                lambda *a, **k: originals["PolicyLoss.forward"](module, *a, **k),
                [logp, old, adv, mask], kwargs={"dp_size": 2, "batch_num_tokens": 90.0, "global_batch_size": 11.0},
                diff=(0,), upstream=torch.tensor(0.7, dtype=torch.float64))
    assert op_calls["policy_loss"] == len(cases) - _float64_on_kernels(backend, cases)


def test_policy_loss_ties_give_the_unclipped_gradient(orl, monkeypatch):
    """At a tie of the clipped and unclipped terms fastrlhf gives the unclipped term -A ratio the
    whole gradient (docs/ops.md, "Gradient rules at ties"; the OpenRLHF module docstring says so).
    OpenRLHF's torch.min / torch.max split a tie in half and its clamps follow torch's gradient at
    the bound g (1 through torch 2.13, 0 from 2.14): at ratio == dual_clip (A < 0) its gradient is
    half the unclipped one, at ratio == 1 +- eps (1 + g) / 2 of it, at the log-ratio clamp's -20
    bound g times it. Every other token has OpenRLHF's gradient. The torch path only: the Triton
    kernels' exp is not bit-for-bit torch's (see the verl test of the same name)."""
    monkeypatch.setenv("FASTRLHF_BACKEND", "torch")
    originals, patched, loss = orl
    old, logp, adv, ratio, (clip_low, clip_high, c) = ratio_tie_inputs()
    module = loss.PolicyLoss(clip_eps_low=clip_low, clip_eps_high=clip_high, dual_clip=c)
    args = [logp, old, adv, torch.ones(2, 8, dtype=torch.bool)]
    got = grad_of(lambda *a: patched["PolicyLoss.forward"](module, *a), args, 0)
    peer = grad_of(lambda *a: originals["PolicyLoss.forward"](module, *a), args, 0)
    unclipped = -adv * ratio / 16  # d(-A ratio) / d(log-prob); the token mean of 16 tokens
    check_ratio_tie_gradients(got, peer, unclipped)


def test_policy_loss_non_finite_inputs_run_openrlhfs(orl, backend, op_calls):
    """OpenRLHF's gradients are NaN at a token whose advantage is NaN, even off the mask (0 * NaN
    in its backward), where fastrlhf's are 0: such a call runs OpenRLHF's own function."""
    originals, patched, loss = orl
    module = loss.PolicyLoss()
    logp, old, adv, mask, _ = _policy_inputs()
    adv[0, -1] = float("nan")  # off the mask
    x = logp.clone().requires_grad_()
    (g,) = torch.autograd.grad(originals["PolicyLoss.forward"](module, x, old, adv, mask)[0], x)
    assert bool(g.isnan().any())
    compare(lambda *a, **k: patched["PolicyLoss.forward"](module, *a, **k),
            lambda *a, **k: originals["PolicyLoss.forward"](module, *a, **k),
            [logp, old, adv, mask], diff=(0,), upstream=torch.tensor(1.0, dtype=torch.float64))
    assert op_calls["policy_loss"] == 0


IS_CORRECTIONS = [dict(is_correction_level=level, is_correction_mode="mask", is_correction_gating=gating,
                      is_correction_threshold=(0.5, 5.0) if gating == "ratio" else (0.0, delta))
                 for level in ("token", "seq") for gating, delta in (("ratio", None), ("binary_kl", 0.02), ("tv", 0.1))]
IS_CORRECTIONS.append(dict(is_correction_level="token", is_correction_mode="clip", is_correction_gating="ratio",
                           is_correction_threshold=(0.8, 1.2)))


@pytest.mark.parametrize("kwargs", IS_CORRECTIONS, ids=lambda k: "-".join(str(v) for v in list(k.values())[:3]))
@pytest.mark.parametrize("token_level", [True, False])
def test_policy_loss_is_correction(orl, backend, kwargs, token_level, op_calls):
    """OpenRLHF's train/rollout IS correction (every level / mode / gating its __init__ accepts):
    its coefficient goes to policy_loss as is_weights; vllm_kl and is_filter_ratio as OpenRLHF's."""
    originals, patched, loss = orl
    module = loss.PolicyLoss(token_level_loss=token_level, **kwargs)
    logp, old, adv, mask, rollout = _policy_inputs()
    rollout[3, :4] = old[3, :4] + torch.tensor([2.0, -2.0, 0.5, 0.0])  # ratios and divergences outside the band
    got, _ = compare(lambda *a, **k: patched["PolicyLoss.forward"](module, *a, **k),
                     lambda *a, **k: originals["PolicyLoss.forward"](module, *a, **k),
                     [logp, old, adv, mask, rollout], kwargs={"dp_size": 2, "batch_num_tokens": 90.0,
                                                              "global_batch_size": 11.0},
                     diff=(0,), upstream=torch.tensor(1.0, dtype=torch.float64))
    assert 0 < got[4].item() < 1  # some units filtered, not all
    assert op_calls["policy_loss"] == 1


GSPO_SETTINGS = [dict(), dict(dual_clip=2.0, clip_eps_high=0.28), dict(is_correction_level="token"),
                 dict(is_correction_level="seq", dual_clip=3.0)]


@pytest.mark.parametrize("kwargs", GSPO_SETTINGS, ids=lambda k: "-".join(f"{a}={v}" for a, v in k.items()) or "plain")
@pytest.mark.parametrize("info", BATCH_INFO, ids=_info_id)
def test_policy_loss_gspo(orl, backend, kwargs, info, op_calls):
    """GSPO (a per-sequence ratio, against the rollout's log-probs under IS correction) runs on
    policy_loss(loss_mode="gspo"): loss, clip_ratio, ppo_kl (against old_log_probs), no vllm_kl."""
    originals, patched, loss = orl
    module = loss.PolicyLoss(policy_loss_type="gspo", **kwargs)
    logp, old, adv, mask, rollout = _policy_inputs()
    compare(lambda *a, **k: patched["PolicyLoss.forward"](module, *a, **k),
            lambda *a, **k: originals["PolicyLoss.forward"](module, *a, **k),
            [logp, old, adv, mask, rollout], kwargs=info, diff=(0,), upstream=torch.tensor(1.0, dtype=torch.float64))
    assert op_calls["policy_loss"] == 1


@pytest.mark.parametrize("token_level", [True, False])
def test_policy_loss_empty_mask_is_nan_like_openrlhf(orl, backend, token_level):
    """OpenRLHF divides by the local count: an empty mask gives NaN loss and metrics and NaN
    gradients (0 where a clamp cuts the path; the Triton path gives NaN there too: the step is
    poisoned either way, which is what matters to a trainer)."""
    originals, patched, loss = orl
    module = loss.PolicyLoss(token_level_loss=token_level)
    logp, old, adv, mask, _ = _policy_inputs(empty=True)
    outs = []
    for fn in (patched["PolicyLoss.forward"], originals["PolicyLoss.forward"]):
        x = logp.clone().requires_grad_()
        out = fn(module, x, old, adv, mask)
        (g,) = torch.autograd.grad(out[0], x)
        outs.append((out, g))
    (got, g_got), (peer, g_peer) = outs
    for a, b in zip(got[:3], peer[:3]):
        assert math.isnan(a.item()) and math.isnan(b.item())
    assert got[3:] == peer[3:] == (None, None)
    assert torch.isnan(g_got).any() and torch.isnan(g_peer).any()
    assert bool(((g_got == 0) | g_got.isnan()).all()) and bool(((g_peer == 0) | g_peer.isnan()).all())
    assert bool(g_got.isnan()[g_peer.isnan()].all())


@pytest.mark.parametrize("clip_eps", [None, 0.2])
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("info", BATCH_INFO, ids=_info_id)
def test_value_loss(orl, backend, clip_eps, token_level, info, op_calls):
    originals, patched, loss = orl
    module = loss.ValueLoss(clip_eps=clip_eps, token_level_loss=token_level)
    values, old, returns = torch.randn(B, T), torch.randn(B, T), torch.randn(B, T)
    old[0, :3] = values[0, :3]
    mask = make_mask(B, T)
    compare(lambda *a, **k: patched["ValueLoss.forward"](module, *a, **k),
            lambda *a, **k: originals["ValueLoss.forward"](module, *a, **k),
            [values, old, returns, mask], kwargs=info, diff=(0,), upstream=torch.tensor(0.7, dtype=torch.float64))
    assert op_calls["value_loss"] == 1 and op_calls["agg_loss"] == 0


@pytest.mark.parametrize("token_level", [True, False])
def test_value_loss_dtypes_weighting_masks_and_non_finite_inputs(orl, backend, token_level, op_calls):
    """bf16 / float64 inputs and int / float masks in OpenRLHF's dtypes; per sample where
    mask.sum(-1) + 1e-8 != n_b (small float32 weights; an int mask's sum + 1e-8 is float32, n_b
    exactly, even for float64 values) and with non-finite inputs (OpenRLHF's NaN gradients),
    OpenRLHF's own runs."""
    originals, patched, loss = orl
    module = loss.ValueLoss(clip_eps=0.2, token_level_loss=token_level)
    cases = [(torch.bfloat16, make_mask(B, T)), (torch.float64, make_mask(B, T).long()),
             (torch.float32, make_mask(B, T) * torch.rand(B, T) * 1e-3)]
    for dtype, mask in cases:
        values, old, returns = (torch.randn(B, T, dtype=dtype) for _ in range(3))
        compare(lambda *a, **k: patched["ValueLoss.forward"](module, *a, **k),
                lambda *a, **k: originals["ValueLoss.forward"](module, *a, **k),
                [values, old, returns, mask], diff=(0,), upstream=torch.tensor(0.7, dtype=torch.float64))
    values, old, returns, mask = torch.randn(B, T), torch.randn(B, T), torch.randn(B, T), make_mask(B, T)
    returns[0, -1] = float("inf")  # off the mask
    compare(lambda *a, **k: patched["ValueLoss.forward"](module, *a, **k),
            lambda *a, **k: originals["ValueLoss.forward"](module, *a, **k),
            [values, old, returns, mask], diff=(0,), upstream=torch.tensor(0.7, dtype=torch.float64))
    expected = 3 - (not token_level) - (backend == "triton")
    assert op_calls["value_loss"] == expected


@pytest.mark.usefixtures("backend")
def test_value_loss_clip_tie_gives_the_unclipped_gradient(orl):
    """At values == old_values +- clip_eps exactly OpenRLHF's clamp follows torch's gradient at the
    bound g (1 through torch 2.13, 0 from 2.14) and its torch.max of the two squared errors splits
    the tie, so its gradient there is (1 + g) / 2 of d(0.5 (v - R)^2) (the same through 2.13);
    fastrlhf gives the unclipped term the whole of it (docs/ops.md, "Gradient rules at ties").
    Elsewhere it is OpenRLHF's gradient."""
    originals, patched, loss = orl
    module = loss.ValueLoss(clip_eps=0.25)
    old = torch.randint(-8, 8, (2, 5)) / 4  # quarters: every sum below is exact in float32
    values = old + torch.tensor([[0.25, 0.25, 0.25, 0.05, 0.05], [-0.25, -0.25, -0.25, 0.05, 0.05]])
    returns = old + torch.tensor([3.0, -3.0, 3.0, 0.1, -0.1])
    tie = torch.zeros(2, 5, dtype=torch.bool)
    tie[:, :3] = True
    assert bool(((values - old).abs()[tie] == 0.25).all())  # exact ties
    args = [values, old, returns, torch.ones(2, 5, dtype=torch.bool)]
    got = grad_of(lambda *a: patched["ValueLoss.forward"](module, *a), args, 0)
    peer = grad_of(lambda *a: originals["ValueLoss.forward"](module, *a), args, 0)
    unclipped = (values - returns) / 10  # d(0.5 (v - R)^2) / dv; the token mean of 10 tokens
    close = functools.partial(torch.testing.assert_close, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(got[~tie], peer[~tie], rtol=1e-6, atol=1e-6)
    close(got[tie], unclipped[tie])
    close(peer[tie], unclipped[tie] * (1 + clamp_gradient_at_bound()) / 2)


# ---------------------------------------------------------------- GAE


@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_gae_keeps_openrlhfs_values_off_the_mask(orl, backend, gamma, lambd, mask_kind, op_calls):
    originals, patched, _ = orl
    values, rewards = torch.randn(B, T), torch.randn(B, T)
    mask = {"bool": make_mask(B, T), "float": make_mask(B, T).float(), "none": None}[mask_kind]
    got, peer = compare(lambda *a: patched["gae"](None, *a), lambda *a: originals["gae"](None, *a),
                        [values, rewards, mask, gamma, lambd])
    if mask is not None:  # left padding and gaps: OpenRLHF's recursion leaves values there; so does ours
        assert got[0][~mask.bool()].abs().sum() > 0
    assert op_calls["gae"] == 1
