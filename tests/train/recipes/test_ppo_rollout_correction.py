"""`ppo --rollout_correction`: the policy loss weighs each token by pi_train / pi_sampler from the decode
engine's own log-probs (ops.rollout_correction), and logs verl's rollout_corr/* metrics."""

import math

import helpers
import pytest

from fastrlhf.train.config import PPOConfig
from fastrlhf.train.recipes import ppo

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("keep_threads_and_warnings")]  # PPO runs

ONE_UPDATE = dict(helpers.TINY_PPO, steps=1, ppo_epochs=1, rollout_engine="graph", device="cpu", advantage="grpo",
                  num_generations=2, reward="varied:score")  # one minibatch: its loss is taken before any step


@pytest.fixture(autouse=True)
def varied_reward(tmp_path, monkeypatch):
    """A reward that differs between a prompt's two responses (the tiny model's true score is 0 for all)."""
    (tmp_path / "varied.py").write_text("def score(prompts, responses):\n"
                                        "    return [float(sum(map(ord, r)) % 7) for r in responses]\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def _first_row(tmp_path, name, **kw):
    ppo.train(PPOConfig(out=str(tmp_path / name), **dict(ONE_UPDATE, **kw)))
    return helpers.metric_rows(tmp_path / name, "ppo")[0]


def test_the_weights_scale_the_policy_loss_and_their_metrics_are_logged(tmp_path, monkeypatch):
    plain = _first_row(tmp_path, "plain")
    same = _first_row(tmp_path, "same", rollout_correction="token")
    # fp32 on the CPU: the engine's log-probs are the trainer's (within 1e-5), so every weight is ~1
    assert same["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
    # the loss is the policy loss alone (no critic, no KL or entropy term): its gradient scales with the weights
    # (the loss itself is 0 at ratio 1: a group's advantages sum to 0 over equally long responses)
    assert plain["grad_norm"] > 0 and same["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
    assert {"rollout_corr/kl", "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/rollout_ppl"} <= set(same)

    sample = ppo.sample

    def sampler_thought_4x_likelier(*args, **kwargs):  # the sampler's log-probs + log 4: every weight 1/4
        rollout = sample(*args, **kwargs)
        return rollout._replace(sampler_logp=rollout.sampler_logp + math.log(4) * rollout.batch.response_mask)

    monkeypatch.setattr(ppo, "sample", sampler_thought_4x_likelier)
    quarter = _first_row(tmp_path, "quarter", rollout_correction="token")
    assert quarter["rollout_corr/rollout_is_mean"] == pytest.approx(0.25, rel=1e-4)
    assert quarter["grad_norm"] == pytest.approx(0.25 * plain["grad_norm"], rel=1e-4)
    masked = _first_row(tmp_path, "masked", rollout_correction="sequence", rollout_correction_mode="mask",
                        rollout_correction_low=0.5)
    assert masked["grad_norm"] == 0.0 and masked["rollout_corr/rollout_is_mean"] == 0.0  # every row out of band


@pytest.mark.parametrize("changes, message", [
    (dict(rollout_correction="token", rollout_engine="hf"), "--rollout_correction token reads the sampler's own "
                                                            "log-probs, which transformers' torch.multinomial draw"),
    (dict(old_logprobs="sampler", rollout_engine="hf"), "--old_logprobs sampler reads the sampler's own log-probs"),
    (dict(old_logprobs="rollout"), "--old_logprobs must be one of recompute, sampler, got 'rollout'"),
    (dict(old_logprobs="sampler", rollout_correction="token"), "--old_logprobs sampler makes them the same"),
    (dict(rollout_correction="tokens"), "--rollout_correction must be one of none, token, sequence, geometric"),
    (dict(rollout_correction="token", rollout_correction_mode="clip"), "--rollout_correction_mode must be one of"),
    (dict(rollout_correction="token", rollout_correction_low=3.0), "--rollout_correction_low .3.0. must be >= 0 and"),
])
def test_bad_settings_are_refused_before_a_model_loads(changes, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        ppo.prepare(PPOConfig(out=str(tmp_path), **dict(ONE_UPDATE, **changes)))


@pytest.mark.parametrize("sampler", [dict(rollout_engine="graph"),
                                     dict(rollout_engine="hf", rollout_sampler="inverse_cdf"),
                                     dict(rollout_engine="graph", advantage="gae")])
def test_old_logprobs_from_the_sampler_give_the_recomputed_update(tmp_path, sampler):
    """--old_logprobs sampler (verl's bypass_mode) against recomputing them, one update from the same seed on
    fp32: the same samples, and a loss and gradient within the sampler's rounding (its log-probs are the
    trainer's within 1e-5); the hf path with inverse_cdf reports them too, and the recomputing run logs how
    far they are (rollout/logp_gap_*), which the bypassing one cannot. With a critic (GAE) the graph engine
    gives the values too: the same value loss and explained variance."""
    recomputed = _first_row(tmp_path, "recomputed", **sampler)
    bypassed = _first_row(tmp_path, "bypassed", old_logprobs="sampler", **sampler)
    assert recomputed["rollout/logp_gap_max"] < 1e-4 and "rollout/logp_gap_max" not in bypassed
    assert bypassed["reward"] == recomputed["reward"] and bypassed["response_length"] == recomputed["response_length"]
    assert bypassed["grad_norm"] > 0 and bypassed["grad_norm"] == pytest.approx(recomputed["grad_norm"], rel=1e-3)
    assert bypassed["kl"] == pytest.approx(recomputed["kl"], abs=1e-4)
    if sampler.get("advantage") == "gae":
        for key in ("value_loss", "explained_variance"):
            assert bypassed[key] == pytest.approx(recomputed[key], rel=1e-3, abs=1e-5), key
