"""fastrlhf.ops.policy_modes (each mode's per-token loss and its gradient written out) against
reference.POLICY_LOSSES in float64: the loss, d(loss)/d(logp) by autograd of the reference, and every
stat, for every mode and option, two aggregations and global counts, IS weights on and off, exact
ties at every clamp and clip bound."""

import pytest
import torch
from helpers import SELECTION

from fastrlhf import reference as R
from fastrlhf.constants import POLICY_LOSS_MODES
from fastrlhf.ops import policy_modes as pm

F64 = torch.float64
B, T = 7, 11


def make_inputs():
    """float64 (old_logp, logp, advantages, mask): log-probs <= 0, ratios in every clip band, one
    token past +20 and one past -20 in log-ratio, a row whose mean log-ratio is past +10 (gspo_token's
    clamp); right / left padding, an empty row, gaps."""
    old = -torch.rand(B, T, dtype=F64) * 3 - 0.5
    log_ratio = torch.randn(B, T, dtype=F64) * 0.3
    log_ratio[:, :3] = torch.tensor([-0.9, 1.2, 0.45], dtype=F64)
    logp = torch.clamp(old + log_ratio, max=-1e-3)
    old[0, 5], logp[0, 5] = -30.0, -1.0
    old[4, 6], logp[4, 6] = -0.5, -25.0
    old[5], logp[5] = -15.0, -3.0 + torch.rand(T, dtype=F64) * 0.1
    adv = torch.randn(B, T, dtype=F64)
    adv[:, 1] = adv[:, 1].abs() * (1 - 2 * (torch.arange(B) % 2 == 0))  # A < 0 past a dual clip c in even rows
    mask = torch.rand(B, T) > 0.2
    mask[0] = torch.arange(T) < T - 3
    mask[1] = torch.arange(T) >= 4
    mask[2] = False
    mask[3] = torch.arange(T) % 3 != 1
    mask[0, 5] = mask[4, 6] = mask[5, 2] = True
    return old, logp, adv, mask


def agg_weights(mask, agg, **agg_kw):
    """w [B, T] with agg_loss(l) = sum w l: the reference's aggregation differentiated at any l."""
    z = torch.zeros(mask.shape, dtype=F64, requires_grad=True)
    (w,) = torch.autograd.grad(R.agg_loss(z, mask, agg, **agg_kw), z)
    return w


CASES = [  # (name, options shared by the reference and the spec)
    ("vanilla", {}),
    ("vanilla", dict(clip_high=0.28, dual_clip=3.0)),
    ("ppo", dict(delta=1.5, log_ratio_clamp=None)),
    ("vanilla", dict(ratio_level="sequence", dual_clip=2.0, log_ratio_clamp=None)),
    ("gspo", {}),
    ("gspo", dict(clip_high=0.28, delta=1.4, dual_clip=2.5)),
    ("gspo_token", {}),
    ("luspo", {}),
    ("cispo", dict(clip_high=0.28)),
    ("cispo", dict(ratio_max=2.0, ratio_level="sequence", log_ratio_clamp=None)),
    ("sapo", {}),
    ("sapo", dict(tau_pos=1.2, tau_neg=0.9, ratio_level="sequence", log_ratio_clamp=None)),
    ("sapo", dict(ratio_level="sequence_token")),
    ("gpg", {}),
    ("reinforce", {}),
    ("dro", dict(beta=0.3)),
    ("dppo_tv", dict(clip_high=0.28, ratio_max=3.0)),
    ("dppo_kl", dict(clip_low=0.1, clip_high=0.05, ratio_max=20.0)),
    ("clip_cov", dict(clip_high=0.28)),
    ("kl_cov", dict(ppo_kl_coef=0.1)),
    ("kl_cov", dict(ppo_kl_coef=0.1, log_ratio_clamp=0.5)),  # |clamped log-ratio|: its gradient 0 past the clamp
    ("geo_mean", dict(clip_high=0.28)),
    ("vespo", {}),
    ("vespo", dict(k_pos=1.5, lambda_pos=2.0, k_neg=2.5, lambda_neg=1.0)),
]
AGGS = [("token-mean", {}), ("seq-mean-token-mean", {}),
        ("seq-mean-token-sum-norm", dict(global_num_seqs=11, dp_size=2, loss_scale_factor=64))]


def run_reference(name, opts, old, logp, adv, mask, agg, agg_kw, is_weights, sampler):
    kw = dict(opts, **SELECTION.get(name, {}), is_weights=is_weights)
    if name == "geo_mean":
        kw.update(global_num_seqs=agg_kw.get("global_num_seqs"), dp_size=agg_kw.get("dp_size", 1))
    else:
        kw.update(agg=agg, **agg_kw)
    if name == "vespo":
        kw["sampler_weights"] = sampler
    x = logp.clone().requires_grad_()
    torch.manual_seed(7)  # clip_cov's draw
    loss, stats = R.POLICY_LOSSES[name](x, old, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, stats


def run_modes(name, opts, old, logp, adv, mask, agg, agg_kw, is_weights, sampler):
    spec = pm.make_spec(name, **opts, **SELECTION.get(name, {}))
    x = pm.Inputs(logp, old, adv, mask, is_weights=is_weights, sampler_weights=sampler if name == "vespo" else None)
    torch.manual_seed(7)
    x = x._replace(selected=pm.selection(x, spec))
    if name in pm.ROW_LOSS:  # one loss per row, averaged over all B rows (or global_num_seqs)
        w = agg_weights(mask, "seq-mean-token-mean", global_num_seqs=agg_kw.get("global_num_seqs", mask.shape[0]),
                        dp_size=agg_kw.get("dp_size", 1))
    else:
        w = agg_weights(mask, agg, **agg_kw)
    loss, grad, flags = pm.policy_mode_terms(spec, x, w)
    return loss, grad, pm.mode_stats(flags, mask)


def assert_f64(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name,opts", CASES, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
@pytest.mark.parametrize("agg,agg_kw", AGGS, ids=[a for a, _ in AGGS])
@pytest.mark.parametrize("with_weights", [False, True], ids=["no_is", "is"])
def test_mode_loss_gradient_and_stats_equal_the_reference(name, opts, agg, agg_kw, with_weights):
    old, logp, adv, mask = make_inputs()
    is_weights = torch.rand(B, T, dtype=F64) * 2 if with_weights else None
    sampler = torch.rand(B, T, dtype=F64) + 0.5
    if name == "sapo" and "ratio_level" not in opts:
        agg, agg_kw = "seq-mean-token-mean", {}
    want, want_grad, want_stats = run_reference(name, opts, old, logp, adv, mask, agg, agg_kw, is_weights, sampler)
    got, got_grad, got_stats = run_modes(name, opts, old, logp, adv, mask, agg, agg_kw, is_weights, sampler)
    assert want_grad.abs().sum() > 0
    assert_f64(got, want, "loss")
    assert_f64(got_grad, want_grad, "d loss / d logp")
    assert set(want_stats) == set(pm.STATS[name])
    for key, value in want_stats.items():
        assert_f64(got_stats[key], value, key)


def test_selections_are_exercised():
    old, logp, adv, mask = make_inputs()
    x = pm.Inputs(logp, old, adv, mask)
    assert pm.clip_cov_dropped(x, pm.make_spec("clip_cov", **SELECTION["clip_cov"])).sum() > 1
    assert pm.kl_cov_chosen(x, pm.make_spec("kl_cov", **SELECTION["kl_cov"])).sum() > 1


def test_off_mask_non_finite_inputs_add_nothing():
    """NaN / inf under mask = 0 changes neither the loss, the gradient nor the stats of any mode."""
    old, logp, adv, mask = make_inputs()
    w = agg_weights(mask, "token-mean")
    bad_logp, bad_adv = logp.clone(), adv.clone()
    bad_logp[2, 0], bad_adv[2, 1], bad_logp[0, -1], bad_adv[3, 1] = float("nan"), float("inf"), -float("inf"), float(
        "nan")
    for name, opts in CASES:
        spec = pm.make_spec(name, **opts)
        selected = torch.zeros(B, T, dtype=torch.bool)
        clean = pm.policy_mode_terms(spec, pm.Inputs(logp, old, adv, mask, selected=selected), w)
        dirty = pm.policy_mode_terms(spec, pm.Inputs(bad_logp, old, bad_adv, mask, selected=selected), w)
        assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1]), name
        for k, v in pm.mode_stats(clean[2], mask).items():
            assert torch.equal(v, pm.mode_stats(dirty[2], mask)[k]), (name, k)


def tie_inputs():
    """float64 log-ratios whose ratios are exactly the bounds (clip_high, clip_low, dual clip c and
    delta are set from them), plus log-ratios at exactly +-20; A signs where each bound binds."""
    x = torch.tensor([[0.25, -0.3, 1.2, 0.4, 20.0, -20.0, 0.05, 0.0]], dtype=F64).repeat(2, 1)
    r = x.exp()
    clip_high, clip_low, c, delta = r[0, 0].item() - 1, 1 - r[0, 1].item(), r[0, 2].item(), r[0, 3].item()
    assert (1 + clip_high, 1 - clip_low) == (r[0, 0].item(), r[0, 1].item())
    adv = torch.tensor([[1.0, -1.0, -2.0, 1.5, 1.0, -1.0, 0.5, -0.5], [-1.0, 1.0, 2.0, -1.5, -1.0, 1.0, -0.5, 0.5]],
                       dtype=F64)
    old = torch.zeros_like(x) - 1.0
    return old, old + x, adv, torch.ones_like(x, dtype=torch.bool), (clip_low, clip_high, c, delta)


@pytest.mark.parametrize("name,opts", [
    ("vanilla", "clips_dual"), ("ppo", "clips_delta"), ("gspo_token", "clips"), ("clip_cov", "clips"),
    ("geo_mean", "geo"), ("kl_cov", {}), ("cispo", "clips"), ("dppo_tv", {}),
])
def test_ties_follow_the_stated_rules(name, opts):
    """At exact ties the explicit gradients are the reference's (torch.where, never autograd's clamp /
    min / max conventions): the clamps pass the gradient at their bounds, a max / min tie goes to the
    unclipped term, |x| at 0 has gradient 0."""
    old, logp, adv, mask, (clip_low, clip_high, c, delta) = tie_inputs()
    options = {"clips": dict(clip_low=clip_low, clip_high=clip_high),
               "clips_dual": dict(clip_low=clip_low, clip_high=clip_high, dual_clip=c),
               "clips_delta": dict(clip_low=clip_low, clip_high=clip_high, delta=delta),
               "geo": dict(clip_low=0.3, clip_high=0.25)}.get(opts, opts) if isinstance(opts, str) else opts
    if name == "dppo_tv":
        options = dict(clip_high=(logp.exp() - old.exp())[0, 0].item())  # a probability change exactly at the bound
    want = run_reference(name, options, old, logp, adv, mask, "token-sum", {}, None, None)
    got = run_modes(name, options, old, logp, adv, mask, "token-sum", {}, None, None)
    assert_f64(got[0], want[0], "loss")
    assert_f64(got[1], want[1], "d loss / d logp")


def test_make_spec_checks_its_arguments():
    with pytest.raises(ValueError, match="loss_mode must be one of"):
        pm.make_spec("nope")
    with pytest.raises(TypeError, match="takes no option"):
        pm.make_spec("vanilla", clip_ratio=0.2)
    with pytest.raises(TypeError, match="takes no option"):
        pm.make_spec("gpg", dual_clip=2.0)
    with pytest.raises(TypeError, match="ratio_max must be"):
        pm.make_spec("dppo_tv", ratio_max=None)
    with pytest.raises(ValueError, match="beta > 0"):
        pm.make_spec("dro")
    with pytest.raises(ValueError, match="dual_clip must be > 1.0"):
        pm.make_spec("vanilla", dual_clip=0.5)
    with pytest.raises(ValueError, match="ratio_level must be one of"):
        pm.make_spec("vanilla", ratio_level="row")
    spec = pm.make_spec("gspo_token", clip_low=0.1)
    assert (spec.clip_high, spec.log_ratio_max, spec.ratio_level) == (0.1, 10.0, "sequence_token")


def test_registries_reject_a_name_twice():
    with pytest.raises(ValueError, match="already registered"):
        R.register_policy_loss("cispo")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="already registered"):
        pm.register_mode("sapo")(lambda x, spec: None)
    assert sorted(R.POLICY_LOSSES) == sorted(pm.MODES) == sorted(POLICY_LOSS_MODES)
