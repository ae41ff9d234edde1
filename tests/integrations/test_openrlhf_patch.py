"""fastrlhf.integrations.openrlhf against the installed OpenRLHF: patched == original (forward
and gradients, both backends), OpenRLHF's conventions kept, patch()/unpatch() bookkeeping."""

import importlib.metadata
import math

import pytest
import torch
from helpers import make_mask

from .peer_checks import compare

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
    }
    openrlhf_integration.patch()
    patched = {
        "log_probs_from_logits": utils.log_probs_from_logits,
        "compute_entropy": utils.compute_entropy,
        "compute_approx_kl": utils.compute_approx_kl,
        "PolicyLoss.forward": loss.PolicyLoss.forward,
        "ValueLoss.forward": loss.ValueLoss.forward,
        "gae": RemoteExperienceMaker.get_advantages_and_returns,
    }
    return originals, patched, loss


# ---------------------------------------------------------------- bookkeeping


def test_patch_rebinds_every_reference_and_unpatch_restores(openrlhf_integration):
    import openrlhf.models.actor as actor
    import openrlhf.models.loss as loss
    import openrlhf.models.utils as utils
    import openrlhf.trainer.ppo_utils.experience_maker as em
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    def refs():
        return (utils.log_probs_from_logits, actor.log_probs_from_logits, utils.compute_entropy, actor.compute_entropy,
                utils.compute_approx_kl, em.compute_approx_kl, ppo_actor.compute_approx_kl,
                loss.PolicyLoss.forward, loss.ValueLoss.forward, em.RemoteExperienceMaker.get_advantages_and_returns)

    before = refs()
    reward = utils.compute_reward
    openrlhf_integration.patch()
    openrlhf_integration.patch()
    after = refs()
    assert all(a is not b for a, b in zip(after, before))
    assert actor.log_probs_from_logits is utils.log_probs_from_logits
    assert ppo_actor.compute_approx_kl is utils.compute_approx_kl is em.compute_approx_kl
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
def test_compute_entropy(orl, backend, dtype):
    originals, patched, _ = orl
    logits = (torch.randn(B, T, V) * 3).to(dtype)
    compare(patched["compute_entropy"], originals["compute_entropy"], [logits], diff=(0,))


# ---------------------------------------------------------------- KL


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compute_approx_kl(orl, backend, estimator, unbiased, dtype, op_calls):
    originals, patched, _ = orl
    logp = torch.randn(B, T) * 2
    base = logp + torch.randn(B, T) * 3
    base[0, :4] = logp[0, :4]  # exact ties
    base[1, :4] = logp[1, :4] + torch.tensor([25.0, -25.0, 12.0, -12.0])  # past the -10 / +-10 clamps
    old = logp + 0.3 * torch.randn(B, T)
    args = [logp.to(dtype), base.to(dtype), old.to(dtype) if unbiased else None, estimator, unbiased]
    compare(patched["compute_approx_kl"], originals["compute_approx_kl"], args, diff=(0, 1))
    assert bool(op_calls["token_kl"]) == (not unbiased)  # TODO(ops: straight-through KL): fused for unbiased too


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


def _fused_today(token_level, info):
    if token_level:
        return "batch_num_tokens" not in info or info.get("dp_size", 1) == 1
    return "global_batch_size" not in info


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
    assert bool(op_calls["policy_loss"]) == _fused_today(token_level, info)


@pytest.mark.parametrize("kwargs", [
    dict(policy_loss_type="gspo"),
    dict(is_correction_level="token", is_correction_mode="mask"),
    dict(is_correction_level="token", is_correction_mode="clip"),
    dict(is_correction_level="seq", is_correction_mode="mask"),
], ids=lambda k: "-".join(map(str, k.values())))
def test_policy_loss_variants_without_a_fused_path_run_openrlhfs(orl, backend, kwargs):
    originals, patched, loss = orl
    module = loss.PolicyLoss(**kwargs)
    logp, old, adv, mask, rollout = _policy_inputs()
    compare(lambda *a, **k: patched["PolicyLoss.forward"](module, *a, **k),
            lambda *a, **k: originals["PolicyLoss.forward"](module, *a, **k),
            [logp, old, adv, mask, rollout], diff=(0,), upstream=torch.tensor(1.0, dtype=torch.float64))


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
    assert bool(op_calls["value_loss"]) == _fused_today(token_level, info)


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
