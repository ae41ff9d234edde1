"""verl.patch() runs every POLICY_LOSS_REGISTRY entry on fastrlhf.policy_loss(loss_mode=...): patched ==
verl's own function (run unpatched, in the input dtype and in float64) for the loss, every metric (keys,
types, values) and d(loss)/d(log_prob), on both backends: ratios in every clip band, an empty row, gaps,
IS weights on and off, two aggregations, global counts with dp_size > 1."""

import pytest
import torch

from .family_peers import F64, policy_inputs, rollout_logprobs
from .peer_checks import check_like_peer, compare, unpatched
from .test_policy_family_peers import CORRECTIONS, POLICY_LOSS_SETTINGS, VERL_POLICY_LOSSES, verl_config

pytestmark = pytest.mark.slow  # verl's own functions on every registry entry, aggregation and correction

AGGS = ["token-mean", "seq-mean-token-mean"]
INFOS = [{}, {"dp_size": 2, "batch_num_tokens": 90, "global_batch_size": 11}]


@pytest.fixture
def verl(verl_integration):
    import verl.trainer.ppo.core_algos as core_algos

    originals = dict(core_algos.POLICY_LOSS_REGISTRY)
    verl_integration.patch()
    return verl_integration, originals, core_algos


def float32_inputs(**kw):
    """family_peers.policy_inputs in float32, the mask kept bool."""
    old, logp, adv, mask = policy_inputs(B=6, T=11, **kw)
    return old.float(), logp.float(), adv.float(), mask


def seeded(fn, seed=1234):
    """fn with the default generator seeded first: clip_cov's draw (torch.randperm) is then the same."""

    def run(*args, **kwargs):
        torch.manual_seed(seed)
        return fn(*args, **kwargs)

    return run


def check(verl, name, config, agg, inputs, weights, op_calls, upstream=1.3):
    integration, originals, core_algos = verl
    fn = core_algos.get_policy_loss_fn(name)
    assert fn is core_algos.POLICY_LOSS_REGISTRY[name] and fn is not originals[name]
    old, logp, adv, mask = inputs
    args = [old, logp, adv, mask, agg, config] + ([] if weights is None else [weights])
    before = op_calls["policy_loss"]
    compare(seeded(fn), seeded(unpatched(integration, originals[name])), args, diff=(1,),
            upstream=torch.tensor(upstream, dtype=F64))
    assert op_calls["policy_loss"] == before + 1  # fastrlhf answered, verl's own did not run


@pytest.mark.parametrize("name", VERL_POLICY_LOSSES)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("info", INFOS, ids=["local", "global"])
def test_every_registry_entry_patched_equals_verl(verl, backend, name, agg, info, op_calls):
    old, logp, adv, mask = float32_inputs()
    config = verl_config(agg, info, POLICY_LOSS_SETTINGS)
    for weights in (None, torch.rand(old.shape) * 2):
        check(verl, name, config, agg, (old, logp, adv, mask), weights, op_calls)


@pytest.mark.parametrize("name", VERL_POLICY_LOSSES)
def test_every_registry_entry_defaults_bf16_and_int_mask(verl, backend, name, op_calls):
    """verl's option defaults (ActorConfig's), bf16 inputs, an int64 mask, advantages constant per row."""
    old, logp, adv, mask = policy_inputs(B=6, T=11, row_advantages=True)
    config = verl_config("seq-mean-token-sum", {"global_batch_size": 9}, {"dro_beta": 0.5} if name == "dro" else {})
    inputs = (old.bfloat16(), logp.bfloat16(), adv.bfloat16(), mask.long())
    if name == "geo_mean":
        inputs = (old.float(), logp.float(), adv.float(), mask.long())
    check(verl, name, config, "seq-mean-token-sum", inputs, None, op_calls)


def test_what_fastrlhf_cannot_answer_runs_verls_own_logged_once(verl, op_calls, caplog, monkeypatch):
    """Non-finite inputs (verl's gradients are NaN there) run verl's own function, logged once."""
    integration, originals, core_algos = verl
    monkeypatch.setattr(integration, "_FALLBACKS", set())
    old, logp, adv, mask = float32_inputs()
    adv[0, -1] = float("nan")  # off the mask: verl's gradient is NaN there, fastrlhf's 0
    config = verl_config("token-mean", {}, POLICY_LOSS_SETTINGS)
    fn = core_algos.get_policy_loss_fn("clip_cov")
    with caplog.at_level("INFO", logger="fastrlhf.integrations"):
        for _ in range(2):
            compare(seeded(fn), seeded(unpatched(integration, originals["clip_cov"])),
                    [old, logp, adv, mask, "token-mean", config], diff=(1,), upstream=torch.tensor(1.0, dtype=F64))
    assert op_calls["policy_loss"] == 0
    assert sum("verl's own compute_policy_loss_clip_cov runs" in r.message for r in caplog.records) == 1


BYPASS = [("ppo_clip", "sequence", 2.0, None, None), ("reinforce", "token", 2.0, None, None),
          ("reinforce", "sequence", "0.1_10.0", "token_k1", 1.5)]


@pytest.mark.parametrize("setting", BYPASS, ids=lambda s: "-".join(str(v) for v in s))
@pytest.mark.parametrize("agg", AGGS)
def test_bypass_mode_runs_on_the_patched_losses(verl, setting, agg, op_calls):
    """bypass_mode calls the rollout-correction helper, then compute_policy_loss_vanilla (ppo_clip) or
    compute_policy_loss_reinforce by name: the patched ones, loss, metrics and gradient as verl's."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    integration, originals, core_algos = verl
    rollout, logp, adv, mask = float32_inputs()
    loss_type, level, threshold, rs, rs_threshold = setting
    correction = RolloutCorrectionConfig(loss_type=loss_type, rollout_is=level, rollout_is_threshold=threshold,
                                         rollout_rs=rs, rollout_rs_threshold=rs_threshold)
    config = verl_config(agg, {}, {"rollout_correction": correction})
    compare(core_algos.get_policy_loss_fn("bypass_mode"), unpatched(integration, originals["bypass_mode"]),
            [rollout, logp, adv, mask, agg, config], diff=(1,), upstream=torch.tensor(0.8, dtype=F64))
    assert op_calls["policy_loss"] == 1 and op_calls["rollout_correction"] == 1


# ---------------------------------------------------------------- rollout_corr_helper


@pytest.mark.parametrize("setting", CORRECTIONS, ids=lambda s: "-".join(str(v) for v in s))
def test_rollout_correction_patched_equals_verl(verl, backend, setting, op_calls):
    """compute_rollout_correction_and_rejection_mask on fastrlhf.rollout_correction: IS weights (in
    verl's DataProto), the rejected mask (verl's dtype) and every rollout_corr/* metric (keys, floats)."""
    from verl.trainer.ppo import rollout_corr_helper as helper

    integration, _, _ = verl
    old, _, _, mask = policy_inputs(B=6, T=11)
    rollout = rollout_logprobs(old)
    keywords = dict(zip(("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                         "rollout_rs_threshold"), setting))
    fn = helper.compute_rollout_correction_and_rejection_mask
    original = unpatched(integration, fn.__wrapped__)
    got = fn(old.float(), rollout.float(), mask.long(), **keywords)
    peer = original(old.float(), rollout.float(), mask.long(), **keywords)
    peer64 = original(old, rollout, mask.long(), **keywords)
    assert op_calls["rollout_correction"] == 1
    assert (got[0] is None) == (peer[0] is None)
    if peer[0] is not None:
        check_like_peer(got[0].batch["rollout_is_weights"], peer[0].batch["rollout_is_weights"],
                        peer64[0].batch["rollout_is_weights"], atol=1e-6, name="weights")
    assert torch.equal(got[1], peer[1]) and got[1].dtype == peer[1].dtype
    check_like_peer(got[2], peer[2], peer64[2], atol=1e-6, name="metrics")
