"""A user-path review of the stages: every numeric key is checked before a model loads (and
before config.json is written), naming the key as given; `--resume` compares paths as paths
and follows a moved run folder; `--eval_every` does not wait for a logging step; the README's
way of loading the reward model; no peft deprecation noise at a LoRA start."""

import json
import math
import re
import shutil
import warnings
from pathlib import Path

import helpers
import pytest
import torch
from helpers import metric_rows
from local_model import write_jsonl

from fastrlhf import cli
from fastrlhf.train import task
from fastrlhf.train.checkpoint import config_changes
from fastrlhf.train.config import DPOConfig, PipelineConfig, PPOConfig, RMConfig, SFTConfig, to_dict
from fastrlhf.train.recipes import dpo, pipeline, ppo, rm, sft

ROOT = Path(__file__).resolve().parents[2]
TINY_PPO = dict(helpers.TINY_PPO, data="builtin", steps=1)


pytestmark = pytest.mark.usefixtures("keep_threads_and_warnings")


# ---------------------------------------------------------------- numeric keys, before a model loads


@pytest.mark.parametrize("key,value,expected", [
    ("max_grad_norm", -1.0, "must be > 0 (inf = no clipping), got -1.0"),  # would negate the gradient
    ("max_grad_norm", 0.0, "must be > 0 (inf = no clipping), got 0.0"),
    ("vf_coef", -1.0, "must be >= 0, got -1.0"),
    ("kl_coef", -1.0, "must be >= 0, got -1.0"),
    ("kl_target", -1.0, "must be >= 0 (0 = fixed kl_coef), got -1.0"),
    ("entropy_coef", -0.1, "must be >= 0, got -0.1"),
    ("lr", -1.0, "must be > 0, got -1.0"),
    ("lr", 0.0, "must be > 0, got 0.0"),  # PPO's lr has no auto
    ("lr", math.nan, "must be > 0, got nan"),
    ("clip", -1.0, "must be > 0, got -1.0"),
    ("value_clip", -1.0, "must be > 0, got -1.0"),
    ("lam", -1.0, "must be in [0, 1], got -1.0"),
    ("lam", 1.5, "must be in [0, 1], got 1.5"),
    ("gamma", 1.01, "must be in [0, 1], got 1.01"),
    ("temperature", math.inf, "must be > 0, got inf"),
    ("lora_rank", -2, "must be >= 0 (0 = full fine-tuning), got -2"),
    ("lora_alpha", 0.0, "must be > 0, got 0.0"),
    ("max_new_tokens", -1, "must be >= 0 (0 = auto), got -1"),
    ("stop_after", -1, "must be >= 0 (0 = run to the end), got -1"),
    ("kl_horizon", 0, "must be >= 1, got 0"),
])
def test_a_ppo_number_out_of_range_is_refused_naming_its_key(tmp_path, key, value, expected):
    with pytest.raises(ValueError, match=re.escape(f"ppo: --{key} {expected}")):
        ppo.prepare(PPOConfig(out=str(tmp_path), **dict(TINY_PPO, **{key: value})))
    assert not (tmp_path / "ppo").exists()


@pytest.mark.parametrize("stage,cfg", [
    (sft, SFTConfig(lr=-1e-5)), (rm, RMConfig(model="tiny", lr=-1e-5)), (dpo, DPOConfig(model="tiny", lr=-1e-5)),
    (sft, SFTConfig(max_response_len=-4)), (rm, RMConfig(model="tiny", eval_fraction=0.0)),
])
def test_every_stage_checks_its_numbers(tmp_path, stage, cfg):
    cfg.out = str(tmp_path)
    name = stage.__name__.rsplit(".", 1)[-1]
    with pytest.raises(ValueError, match=rf"^{name}: --(lr|max_response_len|eval_fraction) must be"):
        stage.prepare(cfg)


def test_the_boundary_values_the_code_means_are_accepted(tmp_path):
    """lr 0 = auto (sft, rm, dpo), inf = no gradient clipping, gamma/lam at 0 and 1, no KL."""
    assert sft.prepare(SFTConfig(out=str(tmp_path), lr=0.0)).cfg.lr > 0
    plan = ppo.prepare(PPOConfig(out=str(tmp_path), **dict(TINY_PPO, max_grad_norm=math.inf, gamma=0.0, lam=1.0,
                                                           kl_coef=0.0, lora_rank=0)))
    assert plan.cfg.max_grad_norm == math.inf
    grad = torch.tensor([3.0, -4.0])
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = grad.clone()
    torch.nn.utils.clip_grad_norm_([w], math.inf)  # what ppo_update calls with it: the gradient unchanged
    assert torch.equal(w.grad, grad)


def test_a_bad_lr_leaves_no_config_json_behind_so_the_corrected_rerun_starts(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["sft", "--out", str(out), "--steps", "1", "--lr", "-1"]) == 2
    assert "fastrlhf sft: error: sft: --lr must be >= 0 (0 = auto), got -1.0" in capsys.readouterr().err
    assert not (out / "sft").exists()
    sft.prepare(SFTConfig(out=str(out), steps=1, lr=1e-3))  # not refused as "already holds a run"


def test_in_the_pipeline_the_error_names_the_stage_key(tmp_path):
    cfg = PipelineConfig(out=str(tmp_path / "run"))
    cfg.ppo.max_grad_norm = -1.0
    with pytest.raises(ValueError, match=re.escape("ppo: --ppo.max_grad_norm must be > 0")):
        pipeline.prepare(cfg)
    cfg = PipelineConfig(out=str(tmp_path / "run"))
    cfg.sft.lr = math.inf
    with pytest.raises(ValueError, match=re.escape("sft: --sft.lr must be >= 0 (0 = auto), got inf")):
        pipeline.prepare(cfg)


# ---------------------------------------------------------------- resume: paths as paths, a moved folder


def test_resume_compares_the_paths_keys_name_not_their_spelling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("m", "m2", "data.jsonl"):
        (tmp_path / name).mkdir() if name.startswith("m") else (tmp_path / name).write_text("")
    recorded = {"out": "run", "model": "m", "data": "data.jsonl", "reward": "run/rm/final", "lr": 0.1}
    same = {"out": str(tmp_path / "moved"), "model": str(tmp_path / "m"), "data": "./data.jsonl",
            "reward": str(tmp_path / "moved" / "rm" / "final"), "lr": 0.1}
    assert config_changes(recorded, same) == []
    nested = {"out": "run", "rm": {"out": "run", "model": "run/sft/final"}, "ppo": {"reward": "rule:score"}}
    moved = {"out": "/elsewhere/run2", "rm": {"out": "/elsewhere/run2", "model": "/elsewhere/run2/sft/final"},
             "ppo": {"reward": "rule:score"}}
    assert config_changes(nested, moved) == []
    other = dict(same, model=str(tmp_path / "m2"), reward="rule:score")
    assert config_changes(recorded, other) == [f"model: 'm' -> '{tmp_path / 'm2'}'",
                                               "reward: 'run/rm/final' -> 'rule:score'"]
    assert config_changes({"model": "tiny"}, {"model": "qwen2-0.5b"}) == ["model: 'tiny' -> 'qwen2-0.5b'"]


def test_a_run_resumes_under_another_spelling_of_out_and_after_its_folder_moved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["sft", "--steps", "3", "--batch_size", "4", "--num_examples", "40"]
    assert cli.main([*args, "--out", "run", "--stop_after", "1"]) == 0
    assert cli.main([*args, "--out", str(tmp_path / "run"), "--stop_after", "1", "--resume"]) == 0
    shutil.move(tmp_path / "run", tmp_path / "moved")
    assert cli.main([*args, "--out", "moved", "--resume"]) == 0
    # log_every 10: the row of the last step alone, as an uninterrupted run writes (an invocation that
    # stops between two rows writes none: its logging window goes into the checkpoint)
    assert [r["step"] for r in metric_rows(tmp_path / "moved", "sft")] == [3]
    assert (tmp_path / "moved" / "sft" / "final").is_dir()


# ---------------------------------------------------------------- eval_every, independent of log_every


def _readme_reward_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return next(b for b in blocks if "RewardModel.from_pretrained" in b)


def test_rm_evaluates_every_eval_every_steps_and_loads_as_the_readme_says(tmp_path):
    out = tmp_path / "run"
    rm.train(RMConfig(out=str(out), model="tiny", data="builtin", num_pairs=40, steps=6, batch_size=4,
                      log_every=2, eval_every=3, device="cpu"))
    rows = metric_rows(out, "rm")
    assert [r["step"] for r in rows] == [2, 3, 4, 6]
    assert [r["step"] for r in rows if "accuracy" in r] == [3, 6]
    # the README's snippet: batched scores equal one row at a time (read at each row's EOS)
    prompts = [r["prompt"] for r in task.synthetic_prompt_rows(3, 0)]
    responses = ["a", "bcd", "ab"]
    snippet = _readme_reward_snippet().replace("runs/demo/rm/final", str(out / "rm" / "final"))
    batched = {"prompts": prompts, "responses": responses}
    exec(snippet, batched)
    alone = []
    for p, r in zip(prompts, responses):
        scope = {"prompts": [p], "responses": [r]}
        exec(snippet, scope)
        alone.append(scope["scores"].item())
    assert batched["scores"].shape == (3,)
    torch.testing.assert_close(batched["scores"], torch.tensor(alone), rtol=1e-5, atol=1e-5)


def test_dpo_evaluates_every_eval_every_steps(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in task.synthetic_pairs(40, 0)))
    out = tmp_path / "run"
    dpo.train(DPOConfig(out=str(out), model="tiny", data=str(pairs), steps=4, batch_size=4, log_every=4,
                        eval_every=3, lora_rank=4, device="cpu"))
    rows = metric_rows(out, "dpo")
    assert [r["step"] for r in rows] == [3, 4]
    assert all("accuracy" in r and "loss" in r for r in rows)


# ---------------------------------------------------------------- no deprecation noise at a LoRA start


def test_a_lora_actor_critic_starts_without_peft_deprecation_warnings():
    from fastrlhf.train.heads import ActorCritic
    from fastrlhf.train.models import load_causal_lm, model_source

    lm, _ = load_causal_lm(model_source("tiny", where="test"), device=torch.device("cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ActorCritic(lm, lora_rank=4)
    assert [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)] == []


# ---------------------------------------------------------------- a batch larger than the data


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "ppo"])
def test_a_batch_of_more_rows_than_the_data_warns_that_rows_repeat(tmp_path, stage):
    """Batches are drawn with replacement: more rows per batch than the training data holds is
    allowed (a tiny data set is a fair test) but warned, naming the flag; the defaults do not warn."""
    data = write_jsonl(tmp_path / "data.jsonl",
                       task.synthetic_pairs(12, 0) if stage in ("rm", "dpo") else task.synthetic_sft(6, 0))
    module, make = {"sft": (sft, SFTConfig), "rm": (rm, RMConfig), "dpo": (dpo, DPOConfig),
                    "ppo": (ppo, PPOConfig)}[stage]
    base = dict(TINY_PPO, data=str(data)) if stage == "ppo" else dict(model="tiny", data=str(data))
    big = (dict(rollout_batch_size=16, num_generations=1, mini_batch_size=16, micro_batch_size=4) if stage == "ppo"
           else dict(batch_size=16))
    flag = "--rollout_batch_size / --num_generations prompts" if stage == "ppo" else "--batch_size"
    with pytest.warns(UserWarning, match=rf"{stage}: each batch draws 16 rows \({flag}\) from \d+ training rows, "
                                         "so every batch repeats rows"):
        module.prepare(make(out=str(tmp_path / "big"), **{**base, **big}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.prepare(make(out=str(tmp_path / "default"), **(TINY_PPO if stage == "ppo" else dict(model="tiny"))))
    assert not [w for w in caught if "repeats rows" in str(w.message)]


def test_a_key_a_recorded_run_lacks_is_no_change_at_its_default():
    """A run recorded by an older fastrlhf lacks the keys added since: resuming it with their defaults is
    the same run; a value other than the default is a change, named."""
    current, defaults = to_dict(PPOConfig()), to_dict(PPOConfig())
    recorded = {k: v for k, v in current.items() if k != "rollout_engine"}
    assert config_changes(recorded, current, defaults=defaults) == []
    assert config_changes(recorded, current) == ["rollout_engine: '<absent>' -> 'hf'"]
    changed = dict(current, rollout_engine="graph")
    assert config_changes(recorded, changed, defaults=defaults) == ["rollout_engine: '<absent>' -> 'graph'"]
