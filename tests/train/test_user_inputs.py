"""Issue 14: a user's own model and data. Each numbered finding of the issue has a test here:
the command (a stage's `prepare`/`train`, `fastrlhf.cli.main`, or the CLI as a subprocess)
and the clear error or warning it now gives."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import helpers
import pytest
import torch
from local_model import REWARD_FILE, bpe_tokenizer, make_local_model, task_rows, write_jsonl, write_task_data

from fastrlhf import cli
from fastrlhf.train.checkpoint import latest_checkpoint, save_checkpoint
from fastrlhf.train.config import PipelineConfig, PPOConfig, RMConfig, SFTConfig, help_text
from fastrlhf.train.metrics import update_summary
from fastrlhf.train.recipes import pipeline, ppo, rm, sft
from fastrlhf.train.rewards import check_scores, import_rule, load_reward
from fastrlhf.train.rollout import Rollout
from fastrlhf.train.run import start_stage_dir

ROOT = Path(__file__).resolve().parents[2]
TINY_PPO = dict(helpers.TINY_PPO, steps=1, data="builtin")


pytestmark = pytest.mark.usefixtures("keep_threads_and_warnings")


@pytest.fixture(scope="module")
def user_model(tmp_path_factory):
    """A local 2-layer Qwen2 directory with its own BPE tokenizer, and JSONL data for every stage."""
    folder = tmp_path_factory.mktemp("user")
    return make_local_model(folder / "model"), write_task_data(folder)


def _fake_run(stage_dir: Path, steps=(100, 120)):
    """What an earlier run leaves: checkpoints and a `latest` pointer."""
    for s in steps:
        (stage_dir / "checkpoints" / f"step_{s:06d}").mkdir(parents=True)
    (stage_dir / "checkpoints" / "latest").write_text(f"step_{steps[-1]:06d}\n")


# ---------------------------------------------------------------- 1. silent fallback to the toy task


def test_1_only_sft_data_is_refused_before_any_training(user_model, tmp_path, caplog):
    model, data = user_model
    out = tmp_path / "run"
    cfg = PipelineConfig(out=str(out))
    cfg.sft.model, cfg.sft.data = str(model), str(data["sft"])
    with pytest.raises(ValueError, match=r"rm: no data given \(--rm\.data auto\), and the model .*sft/final, "
                                         r"trained on .*sft\.jsonl is neither a built-in config nor trained on "
                                         r"the built-in task; pass --rm\.data FILE"):
        pipeline.run(cfg)
    assert not out.exists()  # refused before SFT trained or anything was written
    # the tiny default with only SFT data: the same refusal (the RM would train on the built-in task)
    cfg = PipelineConfig(out=str(out))
    cfg.sft.data = str(data["sft"])
    with pytest.raises(ValueError, match=r"rm: no data given \(--rm\.data auto\)"):
        pipeline.run(cfg)
    # on purpose, the built-in task is allowed, and the log says it is used
    cfg.rm.data, cfg.ppo.data = "builtin", "builtin"
    with caplog.at_level(logging.INFO, logger="fastrlhf"):
        pipeline.prepare(cfg)
    assert "rm: model" in caplog.text and "data the built-in task (fastrlhf.train.task, --data builtin)" in caplog.text


def test_1_a_user_model_never_gets_the_builtin_task_by_default(user_model, tmp_path):
    model, _ = user_model
    with pytest.raises(ValueError, match=r"sft: no data given \(--data auto\), and the model .* is neither a "
                                         r"built-in config nor trained on the built-in task"):
        sft.prepare(SFTConfig(model=str(model), out=str(tmp_path)))
    with pytest.raises(ValueError, match=r"ppo: no data given \(--data auto\)"):
        ppo.prepare(PPOConfig(model=str(model), reward="fastrlhf.train.task:true_score", out=str(tmp_path)))
    plan = sft.prepare(SFTConfig(model=str(model), data="builtin", out=str(tmp_path)))  # explicit: allowed
    assert plan.cfg.data == "builtin"


# ---------------------------------------------------------------- 2. toy-sized, hidden defaults


def test_2_lengths_and_learning_rates_fit_the_model_and_the_data(user_model, tmp_path):
    model, data = user_model
    plan = sft.prepare(SFTConfig(model=str(model), data=str(data["sft"]), out=str(tmp_path)))
    longest_p, longest_r = max(map(len, plan.prompt_ids)), max(map(len, plan.response_ids))
    assert (plan.cfg.max_prompt_len, plan.cfg.max_response_len) == (longest_p, longest_r)  # from the data
    assert plan.cfg.lr == 5e-6  # not the tiny model's 3e-3
    assert rm.prepare(RMConfig(model=str(model), data=str(data["rm"]), out=str(tmp_path))).cfg.lr == 9e-6
    plan = ppo.prepare(PPOConfig(model=str(model), data=str(data["ppo"]), reward="fastrlhf.train.task:true_score",
                                 out=str(tmp_path)))
    assert plan.cfg.max_new_tokens == 64 - plan.cfg.max_prompt_len  # the rest of max_position_embeddings
    # the tiny default keeps its preset
    plan = sft.prepare(SFTConfig(out=str(tmp_path)))
    assert (plan.cfg.max_prompt_len, plan.cfg.max_response_len, plan.cfg.lr) == (32, 16, 3e-3)


def test_2_auto_max_new_tokens_is_capped_on_a_long_context_model(user_model, tmp_path):
    """What the prompt leaves of a 32k-context model would be a 32k-token rollout: the auto value is
    at most 512, verl's and TRL's default; an explicit value is kept."""
    model, data = user_model
    long_context = shutil.copytree(model, tmp_path / "long")
    config = json.loads((long_context / "config.json").read_text())
    (long_context / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=32768)))
    kw = dict(model=str(long_context), data=str(data["ppo"]), reward="fastrlhf.train.task:true_score",
              out=str(tmp_path))
    assert ppo.prepare(PPOConfig(**kw)).cfg.max_new_tokens == ppo.AUTO_MAX_NEW_TOKENS == 512
    assert ppo.prepare(PPOConfig(**kw, max_new_tokens=4096)).cfg.max_new_tokens == 4096


def test_2_truncation_warns_with_counts_for_prompts_and_responses(user_model, tmp_path):
    model, _ = user_model
    rows = [{"prompt": "alpha " * 30 + "->", "response": " beta" * 30}, {"prompt": "beta ->", "response": " beta"}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.warns(UserWarning) as record:
        plan = sft.prepare(SFTConfig(model=str(model), data=str(path), out=str(tmp_path / "o")))
    messages = [str(w.message) for w in record]
    assert plan.cfg.max_prompt_len + plan.cfg.max_response_len <= 64  # within max_position_embeddings
    assert any(m.startswith("1 of 2 prompts are longer than max_prompt_len=32") for m in messages), messages
    assert any(m.startswith("1 of 2 responses are longer than max_response_len=32") for m in messages), messages
    with pytest.raises(ValueError, match="max_prompt_len 60 \\+ response length 30 exceed the model's "
                                         "max_position_embeddings 64"):
        sft.prepare(SFTConfig(model=str(model), data=str(path), out=str(tmp_path / "o"), max_prompt_len=60,
                              max_response_len=30))


def test_2_every_default_is_in_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["sft", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--lr (float, default 0.0)" in out and "0 = auto: 3e-3 for the built-in `tiny` model" in out
    assert "--max_response_len (int, default 0)" in out and "--data (str, default 'auto')" in out
    text = help_text(PipelineConfig)
    assert "--ppo.max_new_tokens (int, default 0)" in text and "--overwrite (bool, default False)" in text


# ---------------------------------------------------------------- 3. a reused run directory


def test_3_a_fresh_run_in_a_used_folder_is_refused_unless_overwrite(tmp_path):
    _fake_run(tmp_path / "sft")
    with pytest.raises(ValueError, match=r"sft: .*sft already holds a run \(checkpoints up to step 120\); pass "
                                         r"--resume to continue it, or --overwrite to delete it and start over"):
        sft.prepare(SFTConfig(out=str(tmp_path), stop_after=30))
    plan = sft.prepare(SFTConfig(out=str(tmp_path), steps=2, overwrite=True))
    sft.train(plan.cfg, plan)
    assert sorted(p.name for p in (tmp_path / "sft" / "checkpoints").glob("step_*")) == ["step_000002"]
    assert json.loads((tmp_path / "sft" / "config.json").read_text())["steps"] == 2  # stand-alone: config.json


def test_3_a_log_written_into_the_run_folder_is_not_a_run(tmp_path):
    """Issue 29: `fastrlhf pipeline --out D > D/train.log` creates D/train.log before the run starts.
    Only a run's own files make a folder hold a run (listed in the refusal); --overwrite deletes
    those and nothing else."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "train.log").write_text("what the shell redirected\n")
    cfg = PipelineConfig(out=str(out))
    cfg.sft.num_examples, cfg.rm.num_pairs, cfg.ppo.eval_prompts = 40, 40, 4
    resolved, _ = pipeline.prepare(cfg)  # not refused
    start_stage_dir(out, resolved, resume=False, overwrite=False, remove=pipeline.OUTPUTS)
    (out / "metrics.jsonl").write_text("")
    (out / "plots").mkdir()
    with pytest.raises(ValueError, match=r"pipeline: .*run already holds a run \(config\.json; metrics\.jsonl; "
                                         r"plots/\); pass --resume"):
        pipeline.prepare(cfg)
    cfg.overwrite = True
    resolved, _ = pipeline.prepare(cfg)
    start_stage_dir(out, resolved, resume=False, overwrite=True, remove=pipeline.OUTPUTS)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "train.log"]  # the log is kept
    assert (out / "train.log").read_text() == "what the shell redirected\n"


def test_3_a_new_checkpoint_is_never_pruned_and_latest_never_dangles(tmp_path):
    _fake_run(tmp_path, steps=(100, 120))
    w = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(w.parameters(), lr=0.1)
    save_checkpoint(tmp_path, 30, dict(w.named_parameters()), opt, {})
    assert latest_checkpoint(tmp_path).name == "step_000030"  # exists: the later (stale) ones went instead
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000030"]
    shutil.rmtree(tmp_path / "checkpoints" / "step_000030")
    with pytest.raises(ValueError, match="latest names step_000030, which does not exist"):
        latest_checkpoint(tmp_path)  # never a silent restart from step 0


def test_3_resume_without_a_checkpoint_says_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="fastrlhf"):
        sft.train(SFTConfig(out=str(tmp_path), steps=1, resume=True))
    assert "sft: --resume, but" in caplog.text and "holds no checkpoint: starting from step 0" in caplog.text


def test_3_resume_with_a_changed_configuration_lists_the_changes(tmp_path, capsys):
    plan = sft.prepare(SFTConfig(out=str(tmp_path), steps=2, stop_after=1))
    sft.train(plan.cfg, plan)
    code = cli.main(["sft", "--out", str(tmp_path), "--steps", "2", "--resume", "--batch_size", "8", "--lr", "0.01"])
    err = capsys.readouterr().err
    assert code == 2
    assert ("sft: --resume with a configuration that differs from the one recorded in" in err
            and "batch_size: 32 -> 8; lr: 0.003 -> 0.01" in err)
    sft.prepare(SFTConfig(out=str(tmp_path), steps=4, resume=True))  # more steps: allowed


# ---------------------------------------------------------------- 4. the README's reward example


def test_4_a_reward_module_in_the_current_directory_imports(tmp_path, monkeypatch):
    (tmp_path / "myreward_cwd.py").write_text(REWARD_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    fn = import_rule("myreward_cwd:score")
    assert fn(["a b ->"], [" b"]) == [1.0]
    with pytest.raises(ValueError, match=r"cannot import 'nope' from 'myreward_cwd' .*looked in the current "
                                         r"directory"):
        import_rule("myreward_cwd:nope")


# ---------------------------------------------------------------- 5. bad rewards


def _rollout(n):
    return Rollout(batch=None, prompts=[f"p{i}" for i in range(n)], responses=[f"r{i}" for i in range(n)])


def test_5_scores_are_checked_for_count_type_and_finiteness():
    r, cpu = _rollout(3), torch.device("cpu")
    with pytest.raises(ValueError, match=r"reward f returned a non-finite score \(nan\) for sample 1 \(prompt "
                                         r"'p1', response 'r1'\)"):
        check_scores([0.0, float("nan"), 1.0], r, "f", device=cpu)
    with pytest.raises(ValueError, match=r"non-finite score \(inf\) for sample 2"):
        check_scores(torch.tensor([0.0, 1.0, float("inf")]), r, "f", device=cpu)
    with pytest.raises(TypeError, match=r"reward f returned NoneType; expected a list of 3 floats"):
        check_scores(None, r, "f", device=cpu)
    with pytest.raises(ValueError, match=r"returned 2 scores for 3 responses"):
        check_scores([1.0, 2.0], r, "f", device=cpu)
    with pytest.raises(TypeError, match=r"returned str '1' for sample 0 .*expected a real number"):
        check_scores(["1", 2, 3], r, "f", device=cpu)
    with pytest.raises(ValueError, match=r"array of shape \(3, 1\); expected \(3,\)"):
        check_scores(torch.zeros(3, 1), r, "f", device=cpu)
    assert check_scores([1, 0, True], r, "f", device=cpu).tolist() == [1.0, 0.0, 1.0]  # ints and bools: numbers
    t = torch.ones(3, requires_grad=True)
    out = check_scores(t, r, "f", device=cpu)
    assert out.dtype == torch.float32 and not out.requires_grad  # tensors: used detached


def test_5_large_scores_warn_once_and_types_are_logged(tmp_path, monkeypatch, caplog):
    (tmp_path / "bigreward.py").write_text("def score(prompts, responses):\n    return [10**6 for _ in prompts]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("bigreward:score", device=torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="fastrlhf"), pytest.warns(UserWarning, match=r"up to 1e\+06 .*order 1"):
        assert fn(_rollout(2)).tolist() == [1e6, 1e6]
    assert "reward bigreward:score returns a list of int; used as float32" in caplog.text


def test_5_a_nan_reward_stops_ppo_with_an_error_naming_it(tmp_path, monkeypatch):
    (tmp_path / "nanreward.py").write_text("def score(prompts, responses):\n    return [float('nan')] * len(prompts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = PPOConfig(out=str(tmp_path / "run"), **dict(TINY_PPO, reward="nanreward:score"))
    with pytest.raises(ValueError, match=r"reward nanreward:score returned a non-finite score \(nan\) for sample 0"):
        ppo.train(cfg)


def test_5_summaries_and_metrics_are_valid_json_with_nan_as_null(tmp_path):
    from fastrlhf.train.metrics import RunLogger

    update_summary(tmp_path, "ppo", {"kl_final": float("nan"), "x": [float("inf"), 1.0]})
    strict = dict(parse_constant=lambda c: pytest.fail(f"invalid JSON constant {c}"))
    assert json.loads((tmp_path / "summary.json").read_text(), **strict)["ppo"] == {"kl_final": None,
                                                                                    "x": [None, 1.0]}
    RunLogger(tmp_path, "ppo").log(1, {"kl": float("nan")})
    assert json.loads((tmp_path / "metrics.jsonl").read_text(), **strict)["kl"] is None


# ---------------------------------------------------------------- 6. tokenizer and vocabulary


def test_6_a_weights_only_model_directory_is_a_clear_error(user_model, tmp_path):
    model, _ = user_model
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(model / f, bare / f)
    code = cli.main(["sft", "--model", str(bare), "--data", "builtin", "--out", str(tmp_path / "o")])
    assert code == 2
    with pytest.raises(ValueError, match=r"sft model: model directory .*bare' has no tokenizer \(none of "
                                         r"tokenizer\.json, .*save the model's tokenizer there"):
        sft.prepare(SFTConfig(model=str(bare), data="builtin", out=str(tmp_path / "o")))


def test_6_a_pad_id_outside_the_embedding_is_a_clear_error(tmp_path):
    tok = bpe_tokenizer([r["prompt"] + r["response"] for r in task_rows(50)], pad=False)
    tok.add_special_tokens({"pad_token": "<newpad>"})  # id len(vocab): one past the model's rows
    model = make_local_model(tmp_path / "m", tokenizer=tok, vocab_size=len(tok) - 1)
    with pytest.raises(ValueError, match=r"the tokenizer's pad token '<newpad>' has id \d+, outside the model's "
                                         r"embedding \(vocab_size \d+\); resize the embeddings"):
        sft.prepare(SFTConfig(model=str(model), data="builtin", out=str(tmp_path / "o")))


def _qwen2_folder_with_unk_past_the_embedding(path):
    """A tiny local Qwen2 with its own byte-level BPE (pad, BOS, EOS inside its vocabulary, no unk):
    AutoTokenizer maps the folder to Qwen2Tokenizer, which adds an unk '<|endoftext|>' one past the
    embedding, a token byte-level BPE never emits."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([r["prompt"] + r["response"] for r in task_rows(200)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    model = make_local_model(path, tokenizer=tok)
    loaded = AutoTokenizer.from_pretrained(model)
    assert len(loaded) == len(tok) + 1 and loaded.unk_token_id == len(tok)  # the case: an unk past the embedding
    return model, loaded.unk_token


def test_6_a_special_token_the_model_never_sees_is_a_warning_not_a_refusal(tmp_path):
    model, unk = _qwen2_folder_with_unk_past_the_embedding(tmp_path / "m")
    data = write_task_data(tmp_path)
    with pytest.warns(UserWarning, match=rf"special token\(s\) {re.escape(repr(unk))} \(id \d+\) lie outside the "
                                         r"model's embedding \(vocab_size \d+\); the trainer never feeds them"):
        plan = sft.prepare(SFTConfig(model=str(model), data=str(data["sft"]), out=str(tmp_path / "o")))
    assert plan is not None


def test_6_a_data_that_encodes_to_a_token_past_the_embedding_names_the_row(tmp_path):
    model, unk = _qwen2_folder_with_unk_past_the_embedding(tmp_path / "m")
    rows = [{"prompt": r["prompt"], "response": r["response"]} for r in task_rows(8)]
    rows[5]["response"] = " beta" + unk  # the unk's text is a special token: the tokenizer encodes it to its id
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    with pytest.warns(UserWarning, match="lie outside the model's embedding"), \
            pytest.raises(ValueError, match=rf"sft data: .*sft.jsonl: response row 5 encodes to token "
                                            rf"{re.escape(repr(unk))} \(id \d+\), outside the model's embedding"):
        sft.prepare(SFTConfig(model=str(model), data=str(data), out=str(tmp_path / "o")))


def test_6_a_reward_model_with_another_tokenizer_scores_the_re_tokenized_text(tmp_path):
    from fastrlhf.train.data import Encoder, pack
    from fastrlhf.train.heads import RewardModel
    from fastrlhf.train.models import load_causal_lm

    cpu = torch.device("cpu")
    lm, char_tok = load_causal_lm("tiny", device=cpu)
    RewardModel(lm).save_pretrained(tmp_path / "rm", char_tok)  # an RM on the char tokenizer
    policy_tok = bpe_tokenizer([r["prompt"] + r["response"] for r in task_rows(50)])
    prompts, responses = ["alpha beta ->", "gamma ->"], [" beta", " gamma delta"]
    enc = Encoder(policy_tok)
    p_ids = enc.prompts(prompts)
    rollout = Rollout(pack(p_ids, enc.responses(prompts, p_ids, responses), policy_tok.pad_token_id), prompts,
                      responses)
    assert rollout.batch.input_ids.max() >= len(char_tok)  # these ids would index past the RM's embedding
    scores = load_reward(str(tmp_path / "rm"), device=cpu, policy_tokenizer=policy_tok)(rollout)
    rm_model, _ = RewardModel.from_pretrained(tmp_path / "rm", device=cpu)
    rm_enc = Encoder(char_tok)
    rp = rm_enc.prompts(prompts)
    b = pack(rp, rm_enc.responses(prompts, rp, responses), char_tok.pad_token_id)
    with torch.no_grad():
        expected = rm_model(b.input_ids, b.attention_mask, b.position_ids)
    torch.testing.assert_close(scores, expected)


# ---------------------------------------------------------------- 7. late validation


def test_7_a_missing_ppo_data_is_reported_before_sft_trains(user_model, tmp_path):
    model, data = user_model
    out = tmp_path / "run"
    code = cli.main(["pipeline", "--out", str(out), "--sft.model", str(model), "--sft.data", str(data["sft"]),
                     "--rm.data", str(data["rm"]), "--ppo.data", str(tmp_path / "missing.jsonl")])
    assert code == 2 and not out.exists()  # nothing trained, nothing written
    with pytest.raises(ValueError, match=r"ppo data: '.*missing\.jsonl' does not exist"):
        pipeline.prepare(PipelineConfig(out=str(out), sft=SFTConfig(model=str(model), data=str(data["sft"])),
                                        rm=RMConfig(data=str(data["rm"])),
                                        ppo=PPOConfig(data=str(tmp_path / "missing.jsonl"))))


# ---------------------------------------------------------------- 8. smaller problems


def test_8_pairs_with_chosen_equal_to_rejected_are_dropped_with_a_warning(user_model, tmp_path):
    model, data = user_model
    rows = [json.loads(line) for line in data["rm"].read_text().splitlines()]
    rows[0]["rejected"] = rows[0]["chosen"]
    path = write_jsonl(tmp_path / "rm.jsonl", rows)
    with pytest.warns(UserWarning, match=rf"rm: 1 of {len(rows)} pairs have chosen == rejected \(first: row 0\); "
                                         "they carry no preference and are dropped"):
        plan = rm.prepare(RMConfig(model=str(model), data=str(path), out=str(tmp_path)))
    assert len(plan.train_idx) + len(plan.eval_idx) == len(rows) - 1


def test_8_empty_responses_warn_with_a_count(user_model, tmp_path):
    model, _ = user_model
    rows = [{"prompt": "a ->", "response": ""}, {"prompt": "b ->", "response": "b"}]
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    with pytest.warns(UserWarning, match="1 of 2 responses are empty"):
        sft.prepare(SFTConfig(model=str(model), data=str(path), out=str(tmp_path)))


def test_8_a_rule_reward_skips_the_reward_model_stage(tmp_path, caplog):
    cfg = PipelineConfig(out=str(tmp_path))
    cfg.ppo.reward = "fastrlhf.train.task:true_score"
    with caplog.at_level(logging.INFO, logger="fastrlhf"):
        resolved, stages = pipeline.prepare(cfg)
    assert [name for name, _, _ in stages] == ["sft", "ppo"]
    assert resolved["rm"] == "skipped (ppo.reward fastrlhf.train.task:true_score)"
    assert "the reward-model stage is skipped" in caplog.text


# ---------------------------------------------------------------- acceptance


def _fastrlhf(*args, cwd, timeout=600):
    """The installed console script (not `python -m`, which would put the cwd on sys.path itself)."""
    exe = Path(sys.executable).with_name("fastrlhf")
    command = [str(exe)] if exe.is_file() else [sys.executable, "-c", "from fastrlhf.cli import main; "
                                                                      "raise SystemExit(main())"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(command + list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_acceptance_user_model_user_data_rule_reward_from_the_working_directory(user_model, tmp_path):
    """The pipeline on a local Qwen2 with its own BPE tokenizer and user JSONL for every stage;
    then PPO with a rule reward from ./myreward.py; the final models reload with plain
    transformers and generate. Logs are line-based (no TTY): no progress-bar redraws."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, data = user_model
    (tmp_path / "myreward.py").write_text(REWARD_FILE)
    small = ["--ppo.rollout_batch_size", "8", "--ppo.mini_batch_size", "8", "--ppo.micro_batch_size", "8",
             "--ppo.steps", "2", "--ppo.max_new_tokens", "4", "--ppo.lora_rank", "4"]
    r = _fastrlhf("pipeline", "--out", "run", "--sft.model", str(model), "--sft.data", str(data["sft"]),
                  "--sft.steps", "4", "--sft.batch_size", "8", "--rm.data", str(data["rm"]), "--rm.steps", "2",
                  "--rm.batch_size", "8", "--rm.eval_fraction", "0.25", "--ppo.data", str(data["ppo"]), *small,
                  cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "\r" not in r.stderr and "sft: 4/4 (100%)" in r.stderr  # line-based progress without a TTY
    assert "None ->" not in r.stderr and "ppo: done, reward" in r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert set(summary) == {"sft", "rm", "ppo", "pipeline"} and "true_score_after" not in summary["ppo"]
    for stage in ("sft", "rm", "ppo"):
        assert (tmp_path / "run" / stage / "config.json").is_file(), stage
    r = _fastrlhf("ppo", "--out", "rule", "--model", "run/sft/final", "--reward", "myreward:score",
                  "--data", str(data["ppo"]), *[a.replace("--ppo.", "--") for a in small], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reward myreward:score returns a list of float" in r.stderr
    for final in ("run/ppo/final", "rule/ppo/final"):
        path = tmp_path / final
        lm = AutoModelForCausalLM.from_pretrained(path)  # plain transformers, LoRA merged
        tok = AutoTokenizer.from_pretrained(path)
        ids = tok("alpha beta ->", return_tensors="pt")
        out = lm.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
        assert out.shape[1] > ids["input_ids"].shape[1], final


def test_8_a_prompt_that_encodes_to_no_tokens_is_refused_in_every_stage(user_model, tmp_path):
    model, _ = user_model  # its BPE tokenizer adds no BOS: "" encodes to no tokens
    sft_path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "a ->", "response": " a"},
                                                    {"prompt": "", "response": " b"}])
    with pytest.raises(ValueError, match=rf"sft data: {sft_path}: 1 of 2 prompts encode to no tokens \(first: row 1"):
        sft.prepare(SFTConfig(model=str(model), data=str(sft_path), out=str(tmp_path)))
    rows = [{"prompt": p, "chosen": " a", "rejected": " b"} for p in ("a ->", "b ->", "", "c ->")]
    rm_path = write_jsonl(tmp_path / "rm.jsonl", rows)
    with pytest.raises(ValueError, match=rf"rm data: {rm_path}: 1 of 4 prompts encode to no tokens \(first: row 2"):
        rm.prepare(RMConfig(model=str(model), data=str(rm_path), out=str(tmp_path)))
    ppo_path = write_jsonl(tmp_path / "ppo.jsonl", [{"prompt": ""}, {"prompt": "a ->"}])
    with pytest.raises(ValueError, match=rf"ppo data: {ppo_path}: 1 of 2 prompts encode to no tokens \(first: row 0"):
        ppo.prepare(PPOConfig(model=str(model), data=str(ppo_path), reward="fastrlhf.train.task:true_score",
                              out=str(tmp_path)))


def test_8_the_pipeline_names_its_own_flags_for_a_missing_column(user_model, tmp_path):
    model, data = user_model
    with pytest.raises(ValueError, match=r"rm data: .*rm\.jsonl has no column 'q' \(for the prompt\).* \(map yours "
                                         r"with --rm\.prompt_key\)"):
        pipeline.prepare(PipelineConfig(out=str(tmp_path / "run"),
                                        sft=SFTConfig(model=str(model), data=str(data["sft"])),
                                        rm=RMConfig(data=str(data["rm"]), prompt_key="q"),
                                        ppo=PPOConfig(data=str(data["ppo"]))))


# ---------------------------------------------------------------- review of the user path


def test_a_user_folder_named_like_a_builtin_config_is_a_user_model(user_model, tmp_path, monkeypatch):
    """./tiny holding the user's model is the user's model (no built-in task, no tiny lr); a folder
    that a stage trained from the built-in config keeps that lineage."""
    model, data = user_model
    shutil.copytree(model, tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"sft: no data given \(--data auto\), and the model tiny is neither"):
        sft.prepare(SFTConfig(model="tiny", out=str(tmp_path / "o")))
    plan = sft.prepare(SFTConfig(model="tiny", data=str(data["sft"]), out=str(tmp_path / "o")))
    assert plan.model.origin == str((tmp_path / "tiny").resolve()) and plan.cfg.lr == 5e-6
    (tmp_path / "tiny" / "fastrlhf.json").write_text(json.dumps({"origin": "tiny", "trained_on": None}))
    plan = sft.prepare(SFTConfig(model="tiny", out=str(tmp_path / "o")))
    assert plan.cfg.data == "builtin" and plan.cfg.lr == 3e-3


def _reward_model(path: Path, tok, *, config=None) -> Path:
    """A RewardModel (random head) on a 2-layer model over `tok`, saved at `path`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fastrlhf.train.heads import RewardModel

    config = config or Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    RewardModel(AutoModelForCausalLM.from_config(config)).save_pretrained(path, tok)
    return path


def _policy_rollout(tok, prompts, responses):
    from fastrlhf.train.data import Encoder, pack

    enc = Encoder(tok)
    p_ids = enc.prompts(prompts)
    return Rollout(pack(p_ids, enc.responses(prompts, p_ids, responses), tok.pad_token_id), prompts, responses)


def _scores_of(rm_dir, tok, prompt_ids, response_ids):
    from fastrlhf.train.data import pack
    from fastrlhf.train.heads import RewardModel

    model, _ = RewardModel.from_pretrained(rm_dir, device=torch.device("cpu"))
    b = pack(prompt_ids, response_ids, tok.pad_token_id)
    with torch.no_grad():
        return model(b.input_ids, b.attention_mask, b.position_ids)


CHAT = ("{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n{% else %}A:{{ m['content'] }}"
        "</s>{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}")


def test_a_reward_model_with_the_same_vocabulary_but_another_chat_template_re_tokenizes(tmp_path, caplog):
    """Same vocabulary and special ids, but the RM renders a chat template the policy does not:
    it scores the text as it was trained to read it (its own Encoder), and the log says which path."""
    from fastrlhf.train.data import Encoder
    from fastrlhf.train.models import same_encoding

    policy_tok = bpe_tokenizer([r["prompt"] + r["response"] for r in task_rows(50)])
    rm_tok = bpe_tokenizer([r["prompt"] + r["response"] for r in task_rows(50)])
    rm_tok.chat_template = CHAT
    assert policy_tok.get_vocab() == rm_tok.get_vocab()
    assert not same_encoding(Encoder(policy_tok), Encoder(rm_tok))
    assert same_encoding(Encoder(policy_tok), Encoder(rm_tok, chat_template=False))
    rm_dir = _reward_model(tmp_path / "rm", rm_tok)
    prompts, responses = ["alpha beta ->", "gamma delta omega ->"], [" beta", " omega kappa"]
    rollout = _policy_rollout(policy_tok, prompts, responses)
    with caplog.at_level(logging.INFO, logger="fastrlhf"):
        scores = load_reward(str(rm_dir), device=torch.device("cpu"), policy_tokenizer=policy_tok)(rollout)
    assert "it scores the text re-tokenized by its own tokenizer" in caplog.text and "chat template" in caplog.text
    rm_enc = Encoder(rm_tok)
    rp = rm_enc.prompts(prompts)
    expected = _scores_of(rm_dir, rm_tok, rp, rm_enc.responses(prompts, rp, responses))
    torch.testing.assert_close(scores, expected)
    # the same encoding on both sides: the policy's ids are scored as they are
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastrlhf"):
        scores = load_reward(str(rm_dir), device=torch.device("cpu"), policy_tokenizer=policy_tok,
                             chat_template=False)(rollout)
    assert "it scores the policy's token ids" in caplog.text
    p_ids = Encoder(policy_tok).prompts(prompts)
    expected = _scores_of(rm_dir, rm_tok, p_ids, Encoder(policy_tok).responses(prompts, p_ids, responses))
    torch.testing.assert_close(scores, expected)


def test_re_tokenized_texts_are_cut_to_the_reward_models_lengths(tmp_path):
    """Re-tokenized prompts longer than the RM's positions (learned positions: an IndexError in
    torch before) are cut as the stages cut them: to the lengths `fastrlhf rm` recorded, else
    to what fits max_position_embeddings; one warning counts the cut rows."""
    from transformers import GPT2Config

    from fastrlhf.train.data import Encoder, auto_lengths

    policy_tok = bpe_tokenizer([r["prompt"] + r["response"] for r in task_rows(50)])
    rm_tok = bpe_tokenizer([r["prompt"] + r["response"] for r in task_rows(50)])
    rm_tok.chat_template = CHAT
    config = GPT2Config(vocab_size=len(rm_tok), n_positions=24, n_embd=32, n_layer=2, n_head=2)
    prompts = [" ".join(["alpha beta gamma"] * 12) + " ->", "gamma ->"]
    responses = [" gamma delta omega kappa", " gamma"]
    rollout = _policy_rollout(policy_tok, prompts, responses)
    rm_enc = Encoder(rm_tok)
    rp = rm_enc.prompts(prompts)
    rr = rm_enc.responses(prompts, rp, responses)
    assert len(rp[0]) + len(rr[0]) > 24
    for recorded in (True, False):
        rm_dir = _reward_model(tmp_path / f"rm_{recorded}", rm_tok, config=config)
        if recorded:  # as `fastrlhf rm` records them
            lineage = json.loads((rm_dir / "fastrlhf.json").read_text()) if (rm_dir / "fastrlhf.json").is_file() else {}
            lineage.update(max_prompt_len=10, max_response_len=3, chat_template=True)
            (rm_dir / "fastrlhf.json").write_text(json.dumps(lineage))
            P, R = 10, 3
        else:
            P, R = auto_lengths(max(map(len, rp)), max(map(len, rr)), 24, max_prompt_len=0, max_response_len=0,
                                where="test")
        long_p, long_r = sum(len(x) > P for x in rp), sum(len(x) > R for x in rr)
        assert long_p >= 1 and P + R <= 24
        fn = load_reward(str(rm_dir), device=torch.device("cpu"), policy_tokenizer=policy_tok)
        with pytest.warns(UserWarning, match=rf"{long_p} of 2 re-tokenized prompts are longer than {P} tokens and "
                                             rf"{long_r} responses longer than {R} \(EOS included\), the lengths "
                                             f"{'it was trained with' if recorded else 'fit its max_position'}"):
            scores = fn(rollout)
        expected = _scores_of(rm_dir, rm_tok, [x[-P:] for x in rp], [x[:R] for x in rr])
        torch.testing.assert_close(scores, expected)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fn(rollout)  # warned once per run
