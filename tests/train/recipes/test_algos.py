"""Critic-free PPO (`fastrlhf ppo --advantage grpo ...`) and DPO (`fastrlhf dpo`, `fastrlhf
pipeline --algo dpo`): the ops each calls, no critic where there is none, resume, bad input,
and, at a reduced size of the embedded default, that each raises the true score by >= 0.2
from the same SFT model (the full-size runs and their figures are in the README)."""

import json
from pathlib import Path

import pytest
import torch
from helpers import main_in_process, metric_rows

from fastrlhf import ops
from fastrlhf.train.config import DPOConfig, PPOConfig, SFTConfig
from fastrlhf.train.heads import VALUE_HEAD_FILE
from fastrlhf.train.recipes import dpo, ppo, sft

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("keep_threads_and_warnings")]  # runs whole stages


ROOT = Path(__file__).resolve().parents[3]
TINY_GRPO = dict(model="tiny", reward="fastrlhf.train.task:true_score", advantage="grpo", num_generations=4,
                 rollout_batch_size=8, mini_batch_size=4, micro_batch_size=2, eval_prompts=8, max_new_tokens=5,
                 save_every=1)
TINY_DPO = dict(model="tiny", data="builtin", num_pairs=40, batch_size=4, eval_every=2, log_every=1, save_every=1,
                eval_prompts=8, max_new_tokens=5)


def _spy(monkeypatch, names):
    calls = {}
    for name in names:
        real = getattr(ops, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.setdefault(_name, []).append(kwargs)
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, spy)
    return calls


# ---------------------------------------------------------------- critic-free PPO


def test_grpo_is_critic_free_and_puts_k3_kl_in_the_loss(tmp_path, monkeypatch):
    calls = _spy(monkeypatch, ("outcome_advantages", "gae", "value_loss", "linear_ppo_actor_loss"))
    summary = ppo.train(PPOConfig(out=str(tmp_path), steps=2, kl_in_loss=True, kl_coef=0.05, **TINY_GRPO))
    assert "gae" not in calls and "value_loss" not in calls
    assert [c["group_size"] for c in calls["outcome_advantages"]] == [4, 4]
    assert all(c["estimator"] == "grpo" for c in calls["outcome_advantages"])
    actor = calls["linear_ppo_actor_loss"]  # 2 steps x 2 epochs x 2 minibatches x 2 micro-batches
    assert len(actor) == 16
    assert all(c["ref_logp"] is not None and c["kl_coef"] == 0.05 and c["kl_estimator"] == "k3" for c in actor)
    assert summary["advantage"] == "grpo" and summary["num_generations"] == 4
    final = tmp_path / "ppo" / "final"
    assert (final / "config.json").is_file() and not (final / VALUE_HEAD_FILE).exists()
    row = metric_rows(tmp_path, "ppo", timing=False)[-1]
    assert "value_loss" not in row and "explained_variance" not in row
    for key in ("group_reward_std", "kl_k3", "kl", "clipfrac", "entropy", "pg_loss"):
        assert key in row, key


def test_rollout_answers_each_prompt_num_generations_times(tmp_path, monkeypatch):
    seen = []
    real = ppo.generate

    def spy(lm, tokenizer, prompt_ids, prompts, **kw):
        seen.append(list(prompts))
        return real(lm, tokenizer, prompt_ids, prompts, **kw)

    monkeypatch.setattr(ppo, "generate", spy)
    ppo.train(PPOConfig(out=str(tmp_path), steps=1, **dict(TINY_GRPO, advantage="rloo")))
    (rollout,) = seen  # the held-out evaluation samples through fastrlhf.train.run, not this name
    assert len(rollout) == 8
    assert all(len(set(rollout[i:i + 4])) == 1 for i in range(0, 8, 4))


def test_kl_in_the_reward_without_kl_in_loss(tmp_path, monkeypatch):
    """Critic-free with the KL in the reward: each response's score is its reward minus
    kl_coef x its summed k1 KL (verl's token_level_rewards.sum(-1)); the actor loss has no KL."""
    calls = _spy(monkeypatch, ("kl_shaped_rewards", "outcome_advantages", "linear_ppo_actor_loss"))
    ppo.train(PPOConfig(out=str(tmp_path), steps=1, kl_coef=0.3, **dict(TINY_GRPO, advantage="dr_grpo")))
    assert calls["kl_shaped_rewards"][0]["kl_coef"] == 0.3
    assert all(c["ref_logp"] is None and c["kl_coef"] == 0.0 for c in calls["linear_ppo_actor_loss"])


def test_critic_free_resume_gives_the_same_metrics(tmp_path):
    cfg = dict(TINY_GRPO, advantage="reinforce_pp_baseline", steps=3, lora_rank=4)
    full, split = tmp_path / "full", tmp_path / "split"
    ppo.train(PPOConfig(out=str(full), **cfg))
    assert ppo.train(PPOConfig(out=str(split), stop_after=2, **cfg)) == {"stopped_at": 2}
    ppo.train(PPOConfig(out=str(split), resume=True, **cfg))
    assert [r["step"] for r in metric_rows(split, "ppo", timing=False)] == [1, 2, 3]
    assert metric_rows(split, "ppo", timing=False) == metric_rows(full, "ppo", timing=False)


def test_loss_mode_and_its_options_reach_the_actor_loss(tmp_path, monkeypatch):
    """--loss_mode / --loss_options: every micro-batch's actor loss gets the mode and its options as keywords
    (numbers as floats), and the registry's check runs before a model loads."""
    calls = _spy(monkeypatch, ("linear_ppo_actor_loss",))
    ppo.train(PPOConfig(out=str(tmp_path), steps=1, loss_mode="sapo", loss_options="tau_pos=0.9, tau_neg=1.1",
                        **TINY_GRPO))
    actor = calls["linear_ppo_actor_loss"]
    assert len(actor) == 8 and all(c["loss_mode"] == "sapo" and c["tau_pos"] == 0.9 and c["tau_neg"] == 1.1
                                   for c in actor)


@pytest.mark.parametrize("kwargs,match", [
    (dict(loss_mode="clipped"), r"loss_mode 'clipped'.*loss_mode must be one of"),
    (dict(loss_mode="cispo", loss_options="tau_pos=1.0"), r"takes no option\(s\) \['tau_pos'\]"),
    (dict(loss_options="clip_high"), "name=value pairs"),
])
def test_bad_loss_mode_settings(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ppo.prepare(PPOConfig(out=str(tmp_path), **dict(TINY_GRPO, **kwargs)))


@pytest.mark.parametrize("kwargs,match", [
    (dict(advantage="ppo"), "advantage must be one of gae, grpo"),
    (dict(num_generations=3), r"num_generations \(3\) must be >= 1 and divide rollout_batch_size \(8\)"),
    (dict(num_generations=1), "advantage 'grpo' compares the responses to one prompt"),
])
def test_bad_advantage_settings(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ppo.prepare(PPOConfig(out=str(tmp_path), **dict(TINY_GRPO, **kwargs)))


def test_reinforce_pp_needs_no_groups(tmp_path):
    plan = ppo.prepare(PPOConfig(out=str(tmp_path), **dict(TINY_GRPO, advantage="reinforce_pp", num_generations=1)))
    assert plan.cfg.advantage == "reinforce_pp"


# ---------------------------------------------------------------- DPO


def test_dpo_stage_calls_the_fused_ops_and_resumes(tmp_path, monkeypatch):
    calls = _spy(monkeypatch, ("linear_dpo_loss", "linear_sequence_logprobs"))
    cfg = dict(TINY_DPO, steps=3, lora_rank=4, loss_type="ipo", ipo_per_token=True, beta=0.5)
    full = dpo.train(DPOConfig(out=str(tmp_path / "full"), **cfg))
    losses = calls["linear_dpo_loss"]
    assert len(losses) == 3 and all(c["loss_type"] == "ipo" and c["ipo_per_token"] for c in losses)
    assert calls["linear_sequence_logprobs"]  # the reference's sums and the held-out accuracy
    for key in ("true_score_before", "true_score_after", "accuracy", "loss_final", "reward_margin_final"):
        assert isinstance(full[key], float), key
    assert (tmp_path / "full" / "dpo" / "final" / "config.json").is_file()
    row = metric_rows(tmp_path / "full", "dpo", timing=False)[-1]
    for key in ("loss", "reward_margin", "reward_accuracy", "reward_chosen", "logp_chosen", "accuracy"):
        assert key in row, key

    split = tmp_path / "split"
    assert dpo.train(DPOConfig(out=str(split), stop_after=2, **cfg)) == {"stopped_at": 2}
    resumed = dpo.train(DPOConfig(out=str(split), resume=True, **cfg))
    assert metric_rows(split, "dpo", timing=False) == metric_rows(tmp_path / "full", "dpo", timing=False)
    assert resumed["true_score_before"] == full["true_score_before"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(beta=0.0), "dpo: beta must be > 0"),
    (dict(loss_type="kto"), "dpo: loss_type must be one of"),
    (dict(loss_type="hinge", label_smoothing=0.1), "dpo: label_smoothing is used by loss_type"),
    (dict(ipo_per_token=True), "dpo: ipo_per_token applies to loss_type ipo only"),
    (dict(eval_fraction=1.0), r"dpo: --eval_fraction must be in \(0, 1\), got 1.0"),
    (dict(lora_rank=-1), r"dpo: --lora_rank must be >= 0 \(0 = full fine-tuning\), got -1"),
])
def test_bad_dpo_settings(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        dpo.prepare(DPOConfig(out=str(tmp_path), **dict(TINY_DPO, **kwargs)))


def test_pipeline_algo_dpo(tmp_path, capsys, caplog):
    """In this process (the pipeline's real CLI process: tests/train/recipes/test_pipeline.py)."""
    out = tmp_path / "run"
    args = ["--algo", "dpo", "--out", str(out), "--sft.steps", "4", "--dpo.steps", "3", "--dpo.num_pairs", "40",
            "--dpo.batch_size", "4", "--dpo.eval_prompts", "8", "--dpo.log_every", "1"]
    r = main_in_process("pipeline", *args, capsys=capsys, caplog=caplog)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"sft", "dpo", "pipeline"}
    assert isinstance(summary["dpo"]["true_score_after"], float)
    assert not (out / "rm").exists() and not (out / "ppo").exists()
    assert [r["step"] for r in metric_rows(out, "dpo", timing=False)] == [1, 2, 3]
    assert (out / "plots" / "dpo_curves.png").stat().st_size > 1000
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["algo"] == "dpo" and recorded["dpo"]["steps"] == 3 and recorded["ppo"] == "not run (algo dpo)"
    r = main_in_process("pipeline", *args, "--resume", capsys=capsys, caplog=caplog)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("already finished, skipping") == 2


def test_pipeline_rejects_an_unknown_algo(tmp_path, capsys, caplog):
    """Refused before anything loads: in this process, no interpreter to start."""
    r = main_in_process("pipeline", "--algo", "kto", "--out", str(tmp_path / "run"), capsys=capsys, caplog=caplog)
    assert r.returncode == 2 and "algo must be one of ppo, dpo" in r.stderr
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- the acceptance runs, reduced


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    """The embedded default's SFT stage at half its steps: a policy that scores ~0.4-0.5. These reduced
    acceptance runs are calibrated on the CPU (float32), so they run there on a GPU machine too."""
    out = tmp_path_factory.mktemp("sft")
    n = torch.get_num_threads()
    sft.train(SFTConfig(out=str(out), steps=150, log_every=50, save_every=150, device="cpu"))
    torch.set_num_threads(n)
    return str(out / "sft" / "final")


def test_dpo_raises_the_true_score_from_sft(sft_model, tmp_path):
    s = dpo.train(DPOConfig(out=str(tmp_path), model=sft_model, steps=40, num_pairs=600, eval_prompts=64,
                            eval_every=40, log_every=20, device="cpu"))
    assert s["true_score_after"] - s["true_score_before"] >= 0.2, s


@pytest.mark.parametrize("engine", ["hf", "graph"])
def test_grpo_raises_the_true_score_from_sft(engine, sft_model, tmp_path):
    """With either sampler (`graph`: fastrlhf's decode engine, its step run eagerly on CPU)."""
    s = ppo.train(PPOConfig(out=str(tmp_path), model=sft_model, reward="fastrlhf.train.task:true_score",
                            advantage="grpo",
                            num_generations=4, kl_in_loss=True, kl_coef=0.05, steps=15, rollout_batch_size=32,
                            mini_batch_size=32, micro_batch_size=32, eval_prompts=64, device="cpu",
                            rollout_engine=engine))
    assert s["rollout_engine"] == engine
    assert s["true_score_after"] - s["true_score_before"] >= 0.2, s


def test_grpo_with_the_cispo_loss_raises_the_true_score_from_sft(sft_model, tmp_path):
    """`fastrlhf ppo --loss_mode cispo` (MiniMax-M1's clipped-weight REINFORCE, verl's compute_policy_loss_cispo)."""
    s = ppo.train(PPOConfig(out=str(tmp_path), model=sft_model, reward="fastrlhf.train.task:true_score",
                            advantage="grpo", loss_mode="cispo", num_generations=4, kl_in_loss=True, kl_coef=0.05,
                            steps=15, rollout_batch_size=32, mini_batch_size=32, micro_batch_size=32, eval_prompts=64,
                            device="cpu"))
    assert s["true_score_after"] - s["true_score_before"] >= 0.2, s
