"""Smoke runs of the real CLI (`python -m fastrlhf ...`) for a few steps at tiny sizes."""

import json
import logging
from pathlib import Path

import pytest
from helpers import main_in_process, run_cli
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # whole pipelines

ROOT = Path(__file__).resolve().parents[3]
PHASES = {"rollout", "reward", "logprobs", "advantages", "update"}


def test_pipeline_smoke(tmp_path, capsys, caplog, keep_threads_and_warnings):
    """The real CLI as a process of its own; the resume runs in this process."""
    out = tmp_path / "run"
    args = ["--out", str(out), "--sft.steps", "6", "--sft.save_every", "3", "--rm.steps", "4",
            "--rm.num_pairs", "120", "--ppo.steps", "3", "--ppo.rollout_batch_size", "16",
            "--ppo.mini_batch_size", "8", "--ppo.micro_batch_size", "4", "--ppo.eval_prompts", "16",
            "--ppo.max_new_tokens", "6", "--ppo.tensorboard"]
    r = run_cli("pipeline", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "attention=sdpa" in r.stderr  # the attention backend is logged
    summary = json.loads((out / "summary.json").read_text())
    for key in ("loss_final",):
        assert isinstance(summary["sft"][key], float)
    assert 0.0 <= summary["rm"]["accuracy"] <= 1.0
    ppo = summary["ppo"]
    for key in ("true_score_before", "true_score_after", "kl_final"):
        assert isinstance(ppo[key], float), key
    assert set(ppo["phase_seconds"]) == PHASES and all(v > 0 for v in ppo["phase_seconds"].values())
    assert set(ppo["phase_peak_memory_bytes"]) == PHASES
    assert all(v > 0 for v in ppo["phase_peak_memory_bytes"].values())

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in rows} == {"sft", "rm", "ppo"}
    ppo_rows = [r for r in rows if r["stage"] == "ppo"]
    assert [r["step"] for r in ppo_rows] == [1, 2, 3]
    for key in ("reward", "true_score", "kl", "entropy", "clipfrac", "approx_kl", "value_loss",
                "explained_variance", "response_length", "tokens_per_s", "time/rollout", "memory/update"):
        assert key in ppo_rows[0], key

    for png in ("sft_loss.png", "rm_curves.png", "ppo_reward_kl.png", "ppo_phases.png"):
        assert (out / "plots" / png).stat().st_size > 1000, png
    assert list((out / "tb" / "ppo").glob("events.out.tfevents.*"))
    ckpt = out / "sft" / "checkpoints" / "step_000006"
    assert (out / "sft" / "checkpoints" / "latest").read_text().strip() == "step_000006"
    assert load_file(ckpt / "model.safetensors") and (ckpt / "optimizer.pt").is_file()
    assert (ckpt / "state.pt").is_file()
    for stage in ("sft", "rm", "ppo"):
        assert (out / stage / "final" / "config.json").is_file(), stage

    # a finished pipeline resumes to a no-op that keeps every result
    r = main_in_process("pipeline", *args, "--resume", capsys=capsys, caplog=caplog)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("already finished, skipping") == 3
    assert json.loads((out / "summary.json").read_text())["ppo"] == ppo
    # (a changed configuration or a fresh run there is refused: tests/train/test_user_inputs.py, finding 3)


def test_stages_on_user_jsonl_with_full_finetuning(tmp_path, capsys, caplog, keep_threads_and_warnings):
    """`fastrlhf sft`, `rm` and `ppo` in turn, in this process (the real process: test_pipeline_smoke)."""
    sft_data, rm_data, prompts = tmp_path / "sft.jsonl", tmp_path / "rm.jsonl", tmp_path / "prompts.jsonl"
    sft_data.write_text("".join(json.dumps({"prompt": f"q{i}:", "response": "yes"}) + "\n" for i in range(20)))
    rm_data.write_text("".join(json.dumps({"prompt": f"q{i}:", "chosen": "yes", "rejected": "no"}) + "\n"
                               for i in range(20)))
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}:"}) + "\n" for i in range(20)))
    out = tmp_path / "run"
    def cli(*args):
        return main_in_process(*args, capsys=capsys, caplog=caplog)

    r = cli("sft", "--out", str(out), "--data", str(sft_data), "--steps", "3", "--batch_size", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli("rm", "--out", str(out), "--data", str(rm_data), "--steps", "3", "--batch_size", "4",
            "--eval_fraction", "0.25")
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli("ppo", "--out", str(out), "--data", str(prompts), "--steps", "2", "--lora_rank", "0",
            "--rollout_batch_size", "8", "--mini_batch_size", "4", "--micro_batch_size", "4",
            "--max_new_tokens", "4", "--kl_target", "1.0", "--gradient_checkpointing")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the reward model encodes text as the policy does: it scores the policy's token ids" in r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rm"]["eval_pairs"] == 5
    # the reward model records how it encoded its texts (what PPO re-tokenizes by when the policy differs)
    rm_config, lineage = (json.loads((out / "rm" / f).read_text()) for f in ("config.json", "final/fastrlhf.json"))
    for key in ("max_prompt_len", "max_response_len", "chat_template"):
        assert lineage[key] == rm_config[key], key
    assert "true_score_after" not in summary["ppo"]  # no rule for user data: only the reward is reported
    assert summary["ppo"]["lora_rank"] == 0 and (out / "ppo" / "final" / "value_head.safetensors").is_file()


@pytest.fixture
def no_captured_warnings():
    """cli.main sends Python warnings into logging; give them back to pytest afterwards."""
    yield
    logging.captureWarnings(False)


def test_bad_input_gives_a_clear_error(tmp_path, capsys, no_captured_warnings):
    """Bad input is `fastrlhf CMD: error: ...` and exit status 2, never a traceback (in-process:
    each of these fails before a model loads)."""
    from fastrlhf import cli

    def run(*args):
        code = cli.main(list(args))
        return code, capsys.readouterr().err

    code, err = run("ppo", "--model", str(tmp_path / "missing"), "--reward", "fastrlhf.train.task:true_score")
    assert code == 2 and "no such directory, and not a built-in config" in err and "Traceback" not in err
    code, err = run("sft", "--stepz", "3")
    assert code == 2 and "unknown config key(s): 'stepz' (did you mean 'steps'?)" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\nnot json\n')
    code, err = run("sft", "--out", str(tmp_path / "o"), "--data", str(bad), "--steps", "1")
    assert code == 2 and f"sft data: {bad}:2: malformed JSON line" in err
    code, err = run("ppo", "--model", "tiny", "--reward", "no_such_module:fn", "--out", str(tmp_path / "o"))
    assert code == 2 and "cannot import 'fn' from 'no_such_module'" in err
    code, err = run("pipeline", "--ppo.kl_estimator", "k9", "--out", str(tmp_path / "p"))
    assert code == 2 and "ppo: kl_estimator 'k9': estimator must be one of" in err
    assert not (tmp_path / "p").exists()  # found before SFT trained
