"""fastrlhf.reference's policy-loss family and rollout correction (float64) == the installed peers'
own code (float64): loss, every metric (names mapped) and d(loss)/d(logp).

- verl 0.9.1: every POLICY_LOSS_REGISTRY entry (through get_policy_loss_fn), bypass_mode, and
  rollout_corr_helper.compute_rollout_correction_and_rejection_mask.
- OpenRLHF 0.11.2: PolicyLoss ("ppo", "gspo") with every train/rollout correction option.
- TRL 1.16: GRPOTrainer._compute_loss for every loss_type, both importance_sampling_levels, the KL
  term, entropy masking, off-policy masking and the entropy bonus, on a trainer built without
  __init__ whose model forward returns given log-probs; the vLLM importance-sampling ratio from
  TRL's own lines (family_peers.trl_vllm_importance_sampling).
Edge cases throughout: right/left padding, an empty row, gaps, ratios in every clip band, IS weights
on and off, two aggregations each, global counts with dp_size > 1 where the peer has them.
"""

import pytest
import torch

import fastrlhf
from fastrlhf import reference as R

from .family_peers import (
    F64,
    assert_f64,
    grpo_inputs,
    loss_and_grad,
    policy_inputs,
    rollout_logprobs,
    trl_inputs,
    trl_trainer,
    trl_vllm_importance_sampling,
)


def test_policy_inputs_cover_every_band():
    """The inputs reach every branch: ratios below 1 - 0.2, exactly 1, inside, between 1 + 0.28 and 3
    with A > 0, past the dual clip 3 with A < 0, on mask=1 tokens; an empty row, gaps, padding."""
    old, logp, adv, mask = policy_inputs()
    ratio = (logp - old).exp()
    on = mask.bool()
    for name, band in (("below", ratio < 0.8), ("one", ratio == 1), ("inside", (ratio > 0.8) & (ratio < 1.28)),
                       ("high", (ratio > 1.28) & (ratio < 3) & (adv > 0)), ("dual", (ratio > 3) & (adv < 0))):
        assert (band & on).any(), name
    assert not on[2].any() and on.any(-1).sum() == on.shape[0] - 1 and not on[3, 1]


# ---------------------------------------------------------------- verl


@pytest.fixture
def core_algos():
    pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed (.ci/install_peers.sh)")
    import verl.trainer.ppo.core_algos as core_algos

    return core_algos


def verl_config(agg="token-mean", info=None, policy_loss=None, **overrides):
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    kw = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2, clip_ratio_low=0.2,
              clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=agg, tau_pos=1.0, tau_neg=1.05)
    kw.update(overrides)
    config = ActorConfig(policy_loss=PolicyLossConfig(**(policy_loss or {})), **kw)
    config.global_batch_info.update(info or {})
    return config


def verl_agg(info):
    """verl's global_batch_info as agg_loss keywords."""
    names = {"batch_num_tokens": "global_num_tokens", "global_batch_size": "global_num_seqs",
             "dp_size": "dp_size", "loss_scale_factor": "loss_scale_factor"}
    return {names[k]: v for k, v in info.items()}


def verl_reference(name, config, agg, info):
    """(reference function, its keywords) for verl's registry entry `name` under `config`."""
    clips = dict(clip_low=config.clip_ratio_low, clip_high=config.clip_ratio_high)
    pl = config.policy_loss
    agg_kw = dict(agg=agg, **verl_agg(info))
    return {
        "vanilla": (R.clipped_surrogate, dict(clips, dual_clip=config.clip_ratio_c, **agg_kw)),
        "gspo": (R.gspo_token, dict(clips, **agg_kw)),
        "cispo": (R.cispo, dict(clips, **agg_kw)),
        # verl's sapo always aggregates "seq-mean-token-mean"
        "sapo": (R.sapo, dict(agg_kw, tau_pos=config.tau_pos, tau_neg=config.tau_neg, agg="seq-mean-token-mean")),
        "gpg": (R.reinforce, agg_kw),
        "dro": (R.dro, dict(beta=pl.dro_beta, **agg_kw)),
        "dppo_tv": (R.dppo_tv, dict(clips, ratio_max=config.clip_ratio_c, **agg_kw)),
        "dppo_kl": (R.dppo_kl, dict(clips, ratio_max=config.clip_ratio_c, **agg_kw)),
        "clip_cov": (R.clip_cov, dict(clips, clip_cov_ratio=pl.clip_cov_ratio, clip_cov_lb=pl.clip_cov_lb,
                                      clip_cov_ub=pl.clip_cov_ub, **agg_kw)),
        "kl_cov": (R.kl_cov, dict(kl_cov_ratio=pl.kl_cov_ratio, ppo_kl_coef=pl.ppo_kl_coef, **agg_kw)),
        "geo_mean": (R.geo_mean, dict(clips)),  # verl's geo_mean ignores loss_agg_mode and the global info
    }[name]


# verl's metric keys -> fastrlhf's stats
VERL_METRICS = {"actor/pg_clipfrac": "clipfrac", "actor/ppo_kl": "approx_kl",
                "actor/pg_clipfrac_lower": "clipfrac_lower"}
VERL_METRICS_BY_MODE = {"kl_cov": {"actor/ppo_kl": "approx_kl_abs"}, "dro": {"actor/ppo_kl": "approx_kl"},
                        "clip_cov": {"actor/pg_clipfrac": "clipfrac", "actor/ppo_kl": "approx_kl"}, "gpg": {}}
VERL_POLICY_LOSSES = ["vanilla", "gspo", "cispo", "sapo", "gpg", "dro", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov",
                      "geo_mean"]
VERL_GLOBALS = [{}, {"dp_size": 2, "batch_num_tokens": 90, "global_batch_size": 11}]
POLICY_LOSS_SETTINGS = dict(dro_beta=0.3, kl_cov_ratio=0.1, ppo_kl_coef=0.1, clip_cov_ratio=0.1, clip_cov_lb=-5.0,
                            clip_cov_ub=5.0)


def check_verl_policy_loss(core_algos, name, config, agg, info, inputs, weights):
    old, logp, adv, mask = inputs
    fn = core_algos.get_policy_loss_fn(name)
    assert fn is core_algos.POLICY_LOSS_REGISTRY[name]
    ours_fn, kw = verl_reference(name, config, agg, info)
    torch.manual_seed(1234)  # clip_cov draws with torch.randperm on the default generator: the same draw
    loss, grad, (metrics,) = loss_and_grad(lambda x: fn(old, x, adv, mask, agg, config, weights), logp)
    torch.manual_seed(1234)
    ours, g_ours, (stats,) = loss_and_grad(lambda x: ours_fn(x, old, adv, mask, is_weights=weights, **kw), logp)
    if name == "clip_cov":
        assert stats["clipfrac"] > 0  # tokens were dropped
    if name == "vanilla":
        assert stats["clipfrac"] > 0 and stats["clipfrac_lower"] > 0
    key = ("verl", name)
    assert_f64(ours, loss, key=key + ("loss",))
    assert_f64(g_ours, grad, key=key + ("grad",))
    names = VERL_METRICS_BY_MODE.get(name, VERL_METRICS)
    assert set(metrics) == set(names), f"{name}: verl's metrics {sorted(metrics)}"
    for peer_key, ours_key in names.items():
        assert type(metrics[peer_key]) is float
        # verl's clip fractions are float32 (a .float() of the comparison)
        assert_f64(stats[ours_key], metrics[peer_key], key=key + (peer_key,), float32="clipfrac" in peer_key)


@pytest.mark.parametrize("name", VERL_POLICY_LOSSES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("info", VERL_GLOBALS, ids=["local", "global"])
@pytest.mark.parametrize("with_weights", [False, True], ids=["no_is", "is"])
def test_verl_policy_losses(core_algos, name, agg, info, with_weights):
    inputs = policy_inputs()
    weights = torch.rand(inputs[0].shape, dtype=F64) * 2 if with_weights else None
    config = verl_config(agg, info, POLICY_LOSS_SETTINGS)
    check_verl_policy_loss(core_algos, name, config, agg, info, inputs, weights)


@pytest.mark.parametrize("name", VERL_POLICY_LOSSES)
def test_verl_policy_losses_defaults_integer_mask_and_row_advantages(core_algos, name):
    """verl's own option defaults (ActorConfig's), an int64 mask, advantages constant per row."""
    old, logp, adv, mask = policy_inputs(row_advantages=True)
    policy_loss = {"dro_beta": 0.5} if name == "dro" else {}
    config = verl_config("seq-mean-token-sum", {"global_batch_size": 9}, policy_loss)
    check_verl_policy_loss(core_algos, name, config, "seq-mean-token-sum", {"global_batch_size": 9},
                           (old, logp, adv, mask.long()), None)


def test_verl_gspo_equals_gspo_with_row_advantages(core_algos):
    """GSPO-token (verl's gspo) and GSPO give the same loss and gradient when the advantage is constant
    over each sequence (the GSPO paper's remark); with per-token advantages the gradients differ."""
    old, logp, adv, mask = policy_inputs(row_advantages=True)
    kw = dict(clip_low=0.2, clip_high=0.28, agg="seq-mean-token-mean")
    a = loss_and_grad(lambda x: R.gspo_token(x, old, adv, mask, log_ratio_clamp=None, **kw), logp)
    b = loss_and_grad(lambda x: R.gspo(x, old, adv, mask, **kw), logp)
    assert_f64(a[0], b[0], key=("reference", "gspo_token==gspo", "loss"))
    assert_f64(a[1], b[1], key=("reference", "gspo_token==gspo", "grad"))
    adv = torch.randn(adv.shape, dtype=F64)
    a = loss_and_grad(lambda x: R.gspo_token(x, old, adv, mask, log_ratio_clamp=None, **kw), logp)
    b = loss_and_grad(lambda x: R.gspo(x, old, adv, mask, **kw), logp)
    assert (a[1] - b[1]).abs().max() > 1e-3


def test_verl_log_ratio_clamps(core_algos):
    """Log-ratios past +-20 (vanilla, cispo, sapo, dppo clamp them there) and past gspo's +10."""
    old, logp, adv, mask = policy_inputs()
    logp = logp.clone()
    logp[0, 4], logp[0, 5], old[0, 6] = old[0, 4] + 25.0, old[0, 5] - 25.0, logp[0, 6] + 22.0
    logp[5] = old[5] + 11.0  # a whole row past gspo's log(s) <= 10
    config = verl_config("token-sum", {}, POLICY_LOSS_SETTINGS)
    for name in ("vanilla", "gspo", "cispo", "sapo"):
        check_verl_policy_loss(core_algos, name, config, "token-sum", {}, (old, logp, adv, mask), None)


# ---------------------------------------------------------------- verl rollout correction and bypass mode


@pytest.fixture(params=["reference", "op"])
def correction(request):
    """reference.rollout_correction and the public op (float64 here), each against the peers."""
    return R.rollout_correction if request.param == "reference" else fastrlhf.rollout_correction


def verl_threshold(spec):
    """verl's rollout_is_threshold ("lower_upper" string or an upper bound) as (mode, low, high)."""
    if isinstance(spec, str) and "_" in spec:
        low, high = (float(v) for v in spec.split("_"))
        return "mask", low, high
    return "truncate", None, float(spec)


def verl_rejection(options, thresholds):
    """verl's rollout_rs / rollout_rs_threshold strings as reference.rollout_correction's `reject`."""
    names, specs = options.split(","), str(thresholds).split(",")
    specs = specs * len(names) if len(specs) == 1 else specs
    return {n: tuple(float(v) for v in s.split("_")) if "_" in s else float(s) for n, s in zip(names, specs)}


def verl_correction(rollout_is, threshold, batch_normalize, rs, rs_threshold):
    """reference.rollout_correction's keywords for verl's rollout-correction settings."""
    mode, low, high = verl_threshold(threshold) if rollout_is else ("truncate", None, None)
    return dict(level=rollout_is, mode=mode, low=low, high=high, batch_normalize=batch_normalize,
                reject=verl_rejection(rs, rs_threshold) if rs else None)


def verl_float32_metric(key):
    """verl's rollout-correction metrics that are float32 (a .float() of a comparison, then a mean)."""
    return any(s in key for s in ("fraction_high", "fraction_low", "oob_ratio")) or key.endswith(
        "rollout_rs_seq_masked_fraction")


def check_correction_metrics(metrics, ours, key, prefix="rollout_corr/"):
    assert {k[len(prefix):] for k in metrics if k.startswith(prefix)} <= set(ours), sorted(
        set(k[len(prefix):] for k in metrics) - set(ours))
    for k, v in metrics.items():
        if k.startswith(prefix):
            assert_f64(ours[k[len(prefix):]], v, key=key + (k,), float32=verl_float32_metric(k))


CORRECTIONS = [  # (rollout_is, rollout_is_threshold, batch_normalize, rollout_rs, rollout_rs_threshold)
    ("token", 2.0, False, None, None),
    ("sequence", 2.0, False, None, None),
    ("token", "0.5_2.0", False, None, None),
    ("sequence", "0.5_3.0", False, None, None),
    ("token", 1.5, True, None, None),
    ("sequence", 4.0, True, None, None),
    (None, None, False, "token_k1,seq_mean_k3,seq_max_k2,seq_sum_k1,token_k2", "0.6_1.5,0.05,0.3,2.0,0.1"),
    ("token", 2.0, False, "seq_sum_k2,token_k3,seq_mean_k1,seq_max_k3,seq_sum_k3,seq_mean_k2",
     "1.0,0.2,0.8_1.2,0.5,0.4,0.03"),
    ("sequence", "0.5_2.0", False, "token_k1", 1.5),  # a single k1 number u means (1 / u, u)
]


@pytest.mark.parametrize("setting", CORRECTIONS, ids=lambda s: "-".join(str(v) for v in s))
def test_verl_rollout_correction(setting, correction):
    pytest.importorskip("verl.trainer.ppo.rollout_corr_helper", reason="verl is not installed")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    old, _, _, mask = policy_inputs()
    rollout = rollout_logprobs(old)
    rollout_is, threshold, batch_normalize, rs, rs_threshold = setting
    proto, new_mask, metrics = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask.long(), rollout_is=rollout_is, rollout_is_threshold=threshold,
        rollout_is_batch_normalize=batch_normalize, rollout_rs=rs, rollout_rs_threshold=rs_threshold)
    weights, keep, ours = correction(old, rollout, mask, **verl_correction(*setting))
    key = ("verl", "rollout_correction")
    if proto is None:
        assert weights is None
    else:
        assert_f64(weights, proto.batch["rollout_is_weights"], key=key + ("weights",))
    assert torch.equal(keep, new_mask.bool()) and new_mask.dtype == torch.long
    check_correction_metrics(metrics, ours, key)


BYPASS = [  # (loss_type, rollout_is, threshold, rollout_rs, rollout_rs_threshold)
    ("ppo_clip", "sequence", 2.0, None, None),
    ("ppo_clip", None, 2.0, "token_k1,seq_max_k3", "0.7_1.4,0.3"),
    ("reinforce", "token", 2.0, None, None),
    ("reinforce", "sequence", "0.1_10.0", "seq_mean_k2", 0.2),  # verl divides by 0 when IcePop drops every row
    ("reinforce", None, 2.0, None, None),
]


@pytest.mark.parametrize("setting", BYPASS, ids=lambda s: "-".join(str(v) for v in s))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_verl_bypass_mode(core_algos, setting, agg, correction):
    """bypass_mode is rollout_correction (current log-probs vs the rollout's, which stand in for the
    old ones) followed by a loss on the rejection mask: reinforce with the IS weights, or the vanilla
    clipped surrogate (ppo_clip) without them."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    loss_type, rollout_is, threshold, rs, rs_threshold = setting
    rollout_correction = RolloutCorrectionConfig(loss_type=loss_type, rollout_is=rollout_is,
                                                 rollout_is_threshold=threshold, rollout_rs=rs,
                                                 rollout_rs_threshold=rs_threshold)
    config = verl_config(agg, {}, {"rollout_correction": rollout_correction})
    rollout, logp, adv, mask = policy_inputs()
    fn = core_algos.get_policy_loss_fn("bypass_mode")
    loss, grad, (metrics,) = loss_and_grad(lambda x: fn(rollout, x, adv, mask, agg, config), logp)

    def ours_fn(x):
        weights, keep, corr = correction(x.detach(), rollout, mask, **verl_correction(
            rollout_is, threshold, False, rs, rs_threshold))
        if loss_type == "reinforce":
            out, stats = R.reinforce(x, rollout, adv, keep, is_weights=weights, agg=agg)
        else:
            out, stats = R.clipped_surrogate(x, rollout, adv, keep, clip_low=config.clip_ratio_low,
                                             clip_high=config.clip_ratio_high, dual_clip=config.clip_ratio_c, agg=agg)
        return out, stats, corr

    ours, g_ours, (stats, corr) = loss_and_grad(ours_fn, logp)
    key = ("verl", "bypass_mode")
    assert_f64(ours, loss, key=key + ("loss",))
    assert_f64(g_ours, grad, key=key + ("grad",))
    names = VERL_METRICS if loss_type == "ppo_clip" else {"actor/ppo_kl": "approx_kl_unclamped"}
    for peer_key, ours_key in names.items():
        assert_f64(stats[ours_key], metrics[peer_key], key=key + (peer_key,), float32="clipfrac" in peer_key)
    check_correction_metrics(metrics, corr, key)
    assert set(metrics) == set(names) | {k for k in metrics if k.startswith("rollout_corr/")}


# ---------------------------------------------------------------- OpenRLHF


@pytest.fixture
def PolicyLoss():
    pytest.importorskip("openrlhf.models.loss", reason="OpenRLHF is not installed (.ci/install_peers.sh)")
    from openrlhf.models.loss import PolicyLoss

    return PolicyLoss


def openrlhf_reference(module, logp, old, adv, mask, rollout, dp_size, batch_num_tokens, global_batch_size):
    """OpenRLHF's PolicyLoss.forward as reference calls: (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)."""
    if module.token_level_loss:
        agg = dict(agg="token-mean")
        if batch_num_tokens is not None:
            agg.update(global_num_tokens=batch_num_tokens, dp_size=dp_size)
    else:
        agg = dict(agg="seq-mean-token-mean")
        if global_batch_size is not None:
            agg.update(global_num_seqs=global_batch_size, dp_size=dp_size)
    clips = dict(clip_low=module.clip_eps_low, clip_high=module.clip_eps_high, dual_clip=module.dual_clip)
    correction = module.is_correction_level != "off"
    vllm_kl = filtered = None
    if module.policy_loss_type == "gspo":  # the ratio against the rollout's log-probs under correction
        loss, stats = R.gspo(logp, rollout if correction else old, adv, mask, **clips, **agg)
    else:
        weights = None
        if correction:
            low, high = module.is_correction_threshold
            weights, _, corr = R.rollout_correction(
                old, rollout, mask, level="token" if module.is_correction_level == "token" else "geometric",
                mode="truncate" if module.is_correction_mode == "clip" else "mask", low=low, high=high,
                gate=module.is_correction_gating, weight="token", log_ratio_clamp=None)
            vllm_kl, filtered = corr["kl"], corr["is_filtered_fraction"]
        loss, stats = R.clipped_surrogate(logp, old, adv, mask, **clips, is_weights=weights, **agg)
    return loss, stats["clipfrac"], R.masked_mean(old - logp, mask), vllm_kl, filtered


OPENRLHF_SETTINGS = [  # PolicyLoss keywords
    dict(policy_loss_type="ppo"),
    dict(policy_loss_type="ppo", dual_clip=3.0, clip_eps_high=0.28),
    dict(policy_loss_type="ppo", token_level_loss=False),
    dict(policy_loss_type="ppo", is_correction_level="token", is_correction_mode="mask"),
    dict(policy_loss_type="ppo", is_correction_level="token", is_correction_mode="clip",
         is_correction_threshold=(0.8, 1.5)),
    dict(policy_loss_type="ppo", is_correction_level="seq", is_correction_mode="mask",
         is_correction_threshold=(0.8, 1.25)),
    dict(policy_loss_type="ppo", is_correction_level="token", is_correction_gating="binary_kl",
         is_correction_threshold=(0.0, 0.02)),
    dict(policy_loss_type="ppo", is_correction_level="seq", is_correction_gating="tv",
         is_correction_threshold=(0.0, 0.05), token_level_loss=False),
    dict(policy_loss_type="ppo", is_correction_level="seq", is_correction_gating="binary_kl",
         is_correction_threshold=(0.0, 0.01)),
    dict(policy_loss_type="gspo"),
    dict(policy_loss_type="gspo", dual_clip=2.0),
    dict(policy_loss_type="gspo", is_correction_level="token"),
]


@pytest.mark.parametrize("settings", OPENRLHF_SETTINGS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
@pytest.mark.parametrize("counts", [(1, None, None), (2, 90.0, 11.0)], ids=["local", "global"])
def test_openrlhf_policy_loss(PolicyLoss, settings, counts):
    module = PolicyLoss(**settings)
    old, logp, adv, mask = policy_inputs()
    mask = mask.clone()
    mask[2, 3] = True  # OpenRLHF's per-row masked means are NaN for an empty row: every row has a token here
    rollout = rollout_logprobs(old, spread=0.1)
    args = (mask, rollout, *counts)
    peer, g_peer, rest = loss_and_grad(lambda x: module(x, old, adv, *args), logp)
    ours, g_ours, ours_rest = loss_and_grad(lambda x: openrlhf_reference(module, x, old, adv, *args), logp)
    key = ("openrlhf", settings["policy_loss_type"] + ("+correction" if "is_correction_level" in settings else ""))
    assert_f64(ours, peer, key=key + ("loss",))
    assert_f64(g_ours, g_peer, key=key + ("grad",))
    for name, a, b in zip(("clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"), ours_rest, rest):
        assert (a is None) == (b is None), name
        if a is not None:  # clip_ratio and is_filter_ratio are float32 (a .float() of the comparison)
            assert_f64(a, b, key=key + (name,), float32=name in ("clip_ratio", "is_filter_ratio"))


def test_openrlhf_sequence_correction_counts_an_empty_row_as_filtered(PolicyLoss):
    """OpenRLHF's sequence gate is NaN for a row without tokens, so the row counts as filtered; the
    reference's is_filtered_fraction counts it so (its weights are 0 there either way)."""
    module = PolicyLoss(is_correction_level="seq", is_correction_mode="mask", is_correction_threshold=(0.5, 2.0))
    old, logp, adv, mask = policy_inputs()
    rollout = rollout_logprobs(old, spread=0.1)
    assert not mask[2].any()
    peer = module(logp, old, adv, mask, rollout)
    ours = openrlhf_reference(module, logp, old, adv, mask, rollout, 1, None, None)
    assert_f64(ours[0], peer[0], key=("openrlhf", "ppo+correction", "loss"))
    assert_f64(ours[4], peer[4], key=("openrlhf", "ppo+correction", "is_filter_ratio"), float32=True)


# ---------------------------------------------------------------- TRL


TRL_LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]


def trl_aggregation(t, mask, num_items):
    """TRL 1.16's normalisation of each loss_type (GRPOTrainer._compute_loss, train mode) as agg_loss
    keywords, gradient accumulation folded into the global counts."""
    B = mask.shape[0]
    steps = t.current_gradient_accumulation_steps
    if t.loss_type in ("grpo", "sapo"):
        return dict(agg="seq-mean-token-mean", global_num_seqs=B * steps)
    if t.loss_type == "bnpo":
        return dict(agg="token-mean", global_num_tokens=max(float(mask.sum()), 1.0) * steps)
    if t.loss_type == "dr_grpo":
        return dict(agg="seq-mean-token-sum-norm", global_num_seqs=B, loss_scale_factor=t.max_completion_length * steps)
    if t.loss_type == "luspo":
        return dict(agg="seq-mean-token-sum", global_num_seqs=B * steps)
    normalizer = max(num_items, 1.0) / t.accelerator.num_processes * steps / t.args.steps_per_generation
    return dict(agg="token-mean", global_num_tokens=normalizer)  # dapo, cispo, vespo


def _f32(x):
    """A Python float rounded to float32, as TRL's torch.where of two Python floats makes it."""
    return float(torch.tensor(x, dtype=torch.float32))


def trl_reference(t, logp, old, adv_rows, mask, entropy, *, ref=None, sampler=None, sampling=None, num_items):
    """TRL 1.16 GRPOTrainer._compute_loss (train mode) from reference pieces: (loss, metrics under
    TRL's keys). sampler: fastrlhf's rollout_correction weights for TRL's vLLM IS ratio."""
    B, T = mask.shape
    adv = adv_rows.unsqueeze(1).expand(B, T)
    level = t.importance_sampling_level
    agg = trl_aggregation(t, mask, num_items)
    weights = torch.ones_like(logp)
    if t.off_policy_mask_threshold is not None:
        kept = R.off_policy_sequence_mask(logp, sampling if sampling is not None else old, adv, mask,
                                          threshold=t.off_policy_mask_threshold)
        assert 0 < kept[:, 0].sum() < B  # the case is exercised: some rows dropped, some kept
        weights = weights * kept
    entropy_mask = None
    if t.top_entropy_quantile < 1.0:
        entropy_mask = R.high_entropy_mask(entropy, mask, t.top_entropy_quantile)
        assert 0 < entropy_mask.sum() < mask.sum()
        weights = weights * entropy_mask
    if sampler is not None and t.loss_type != "vespo":
        weights = weights * sampler
    common = dict(ratio_level=level, log_ratio_clamp=None, is_weights=weights, **agg)
    if t.loss_type == "cispo":
        loss, stats = R.cispo(logp, old, adv, mask, ratio_max=t.epsilon_high, **common)
    elif t.loss_type == "sapo":
        loss, stats = R.sapo(logp, old, adv, mask, tau_pos=_f32(t.args.sapo_temperature_pos),
                             tau_neg=_f32(t.args.sapo_temperature_neg), **common)
    elif t.loss_type == "vespo":
        common.pop("ratio_level"), common.pop("log_ratio_clamp")
        a = t.args
        loss, stats = R.vespo(logp, old, adv, mask, k_pos=a.vespo_k_pos, lambda_pos=a.vespo_lambda_pos,
                              k_neg=a.vespo_k_neg, lambda_neg=a.vespo_lambda_neg, sampler_weights=sampler, **common)
    else:
        loss, stats = R.clipped_surrogate(logp, old, adv, mask, clip_low=t.epsilon_low, clip_high=t.epsilon_high,
                                          delta=t.args.delta, **common)
    ratio, _ = R.importance_ratio(logp, old, mask, level=level, log_ratio_clamp=None)
    metrics = {}
    if t.beta != 0.0:
        kl = R.token_kl(logp, ref, estimator="k3")
        if t.args.use_bias_correction_kl:
            kl = kl * ratio
        loss = loss + t.beta * R.agg_loss(kl, mask, **agg)
        metrics["kl"] = R.masked_mean(kl, mask)
    steps = t.current_gradient_accumulation_steps
    policy_loss = loss * steps if t.loss_type not in ("cispo", "dapo", "vespo") else loss
    if t.entropy_coef != 0.0:
        effective = mask if entropy_mask is None else mask & entropy_mask
        loss = loss - t.entropy_coef * R.masked_mean(entropy, effective) / steps
        metrics["policy_loss"] = policy_loss.detach()
        metrics["entropy_coef"] = t.entropy_coef  # logged at each optimizer step (static control here)
    metrics["entropy"] = R.masked_mean(entropy, mask)
    metrics.update(trl_ratio_metrics(t, ratio, adv, mask, logp - old, sampler))
    return loss, metrics


def trl_ratio_metrics(t, ratio, adv, mask, log_ratio, sampler):
    """TRL's clip metrics: token flags are masked means over the tokens; at the sequence level, where its
    ratio is one per row, means over the B rows (empty rows included); low_min / high_max are the
    extremes of the per-row means over the rows that have tokens."""
    per_row = t.importance_sampling_level == "sequence"

    def mean(flag):
        return flag[:, 0].to(F64).mean() if per_row else R.masked_mean(flag.to(F64), mask)

    def row_means(flag):
        if per_row:
            return flag[:, 0].to(F64)
        n = mask.sum(-1)
        return R.masked(flag.to(F64), mask).sum(-1)[n > 0] / n[n > 0]

    if t.loss_type == "cispo":
        return {"cispo_clip_ratio": mean((ratio > t.epsilon_high) & (adv > 0))}
    if t.loss_type == "vespo":  # TRL's phi is one per row (its advantages are [B, 1]): a mean over the B rows
        a = t.args
        phi = R.vespo_weights(log_ratio, adv, mask, k_pos=a.vespo_k_pos, lambda_pos=a.vespo_lambda_pos,
                              k_neg=a.vespo_k_neg, lambda_neg=a.vespo_lambda_neg, sampler_weights=sampler)
        return {"vespo/phi_seq_mean": phi[:, 0].mean()}
    if t.loss_type == "sapo":
        return {}
    r1 = ratio if t.args.delta is None else torch.clamp(ratio, max=t.args.delta)
    low = (r1 < 1 - t.epsilon_low) & (adv < 0)
    high = (r1 > 1 + t.epsilon_high) & (adv > 0)
    return {"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
            "clip_ratio/region_mean": mean(low | high), "clip_ratio/low_min": row_means(low).min(),
            "clip_ratio/high_max": row_means(high).max()}


def trl_float32_metric(key):
    return key.startswith("clip_ratio/") or key == "cispo_clip_ratio"


def check_trl(settings, *, vllm_mode=None, nan_sampling=False):
    old, logp, adv_rows, mask, entropy, ref, sampling = grpo_inputs()
    if nan_sampling:
        sampling[0, :2] = float("nan")  # tokens vLLM could not score
    num_items = float(mask.sum()) * 1.5
    is_ratio = sampler = None
    clip_min, clip_max = 0.5, 3.0
    if vllm_mode is not None:
        is_ratio, _ = trl_vllm_importance_sampling(old, sampling, mask, vllm_mode, clip_min, clip_max)
        level, mode = vllm_mode.split("_")
        sampler, _, _ = R.rollout_correction(old, sampling, mask, level=level, mode=mode, low=clip_min, high=clip_max,
                                             log_ratio_clamp=None, missing="ignore")
        settings = dict(settings, use_vllm=True, vllm_importance_sampling_correction=True)
    inputs = trl_inputs(mask, adv_rows, old, ref=ref, is_ratio=is_ratio, sampling=sampling, num_items=num_items)

    def peer(x, h):
        trainer = trl_trainer(x, h, **settings)
        return trainer._compute_loss(None, inputs), trainer

    x, h = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    loss, trainer = peer(x, h)
    g_peer = torch.autograd.grad(loss, (x, h), allow_unused=True)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    t = trl_trainer(logp, entropy, **settings)
    y, e = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    ours, ours_metrics = trl_reference(t, y, old, adv_rows, mask, e, ref=ref, sampler=sampler, sampling=sampling,
                                       num_items=num_items)
    g_ours = torch.autograd.grad(ours, (y, e), allow_unused=True)
    key = ("trl", settings.get("loss_type", "dapo"))
    assert_f64(ours, loss, key=key + ("loss",))
    for name, a, b in zip(("grad logp", "grad entropy"), g_ours, g_peer):
        assert (a is None) == (b is None), name
        if a is not None:
            assert_f64(a, b, key=key + (name,))
    for k, v in metrics.items():
        assert k in ours_metrics, f"TRL metric {k} not mapped"
        assert_f64(ours_metrics[k], v, key=key + (k,), float32=trl_float32_metric(k))
    return metrics


@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_grpo_loss_types(loss_type, level):
    pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is not installed")
    if loss_type == "vespo" and level == "sequence":
        pytest.skip("VESPO forms its own sequence weights (TRL warns to keep importance_sampling_level='token')")
    check_trl(dict(loss_type=loss_type, importance_sampling_level=level, current_gradient_accumulation_steps=2))


@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
def test_trl_kl_entropy_masking_and_bonus(loss_type):
    """beta != 0 with TRL's bias-corrected KL, top_entropy_quantile < 1, off-policy sequence masking and
    the entropy bonus (its gradient w.r.t. the entropies too), with TRL's vLLM IS ratio (token_truncate)."""
    pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is not installed")
    check_trl(dict(loss_type=loss_type, beta=0.04, top_entropy_quantile=0.6, off_policy_mask_threshold=0.05,
                   entropy_coef=0.01, current_gradient_accumulation_steps=3), vllm_mode="token_truncate")


@pytest.mark.parametrize("vllm_mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo", "vespo"])
def test_trl_vllm_importance_sampling(vllm_mode, loss_type):
    pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is not installed")
    if loss_type == "vespo" and vllm_mode.startswith("sequence"):
        pytest.skip("TRL rejects VESPO with a sequence-level vLLM IS mode")
    check_trl(dict(loss_type=loss_type, use_bias_correction_kl=False, beta=0.1), vllm_mode=vllm_mode,
              nan_sampling=True)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo"])
def test_trl_two_sided_delta_and_steps_per_generation(loss_type):
    pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is not installed")
    check_trl(dict(loss_type=loss_type, delta=1.5, steps_per_generation=4, current_gradient_accumulation_steps=2,
                   importance_sampling_level="sequence" if loss_type == "luspo" else "token"))


@pytest.mark.parametrize("vllm_mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(0.5, 3.0), (None, 2.0), (0.8, None)])
def test_trl_vllm_ratio_and_metrics(vllm_mode, bounds, correction):
    """TRL's IS ratio (its own lines) == rollout_correction's weights on the mask=1 tokens (TRL's are
    1 or its clamp of 1 off the mask, which its loss multiplies by 0; fastrlhf's are 0), and TRL's
    sampling/* metrics; NaN sampler log-probs count as no evidence (missing="ignore")."""
    pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is not installed")
    low, high = bounds
    if vllm_mode.endswith("truncate") and high is None:
        pytest.skip("truncate needs an upper bound in TRL (clamp(max=None) with min=None is an error)")
    old, _, _, mask = policy_inputs()
    sampling = rollout_logprobs(old)
    sampling[0, 1] = float("nan")
    ratio, metrics = trl_vllm_importance_sampling(old, sampling, mask, vllm_mode, low, high)
    level, mode = vllm_mode.split("_")
    weights, keep, ours = correction(old, sampling, mask, level=level, mode=mode, low=low, high=high,
                                     log_ratio_clamp=None, missing="ignore")
    key = ("trl", "rollout_correction")
    assert_f64(weights[mask], ratio.expand_as(weights)[mask], key=key + ("weights",))
    assert torch.equal(keep, mask)
    for k, v in metrics.items():
        assert_f64(ours[k.removeprefix("sampling/").replace("/", "_")], v, key=key + (k,))
