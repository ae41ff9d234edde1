"""`fastrlhf distill` and `fastrlhf pipeline --algo distill`: the real CLI for a few steps (offline,
on-policy, LoRA), resume to the same metrics, 1 vs 2 ranks (torchrun, gloo), the checks before a model
loads. The full-length demo's figures (true scores, time) are measured outside the tests (README)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import main_in_process
from local_model import bpe_tokenizer, make_local_model, task_rows, write_jsonl

from fastrlhf.train import distributed
from fastrlhf.train.config import DistillConfig
from fastrlhf.train.models import load_causal_lm
from fastrlhf.train.recipes import distill

# distillation runs, on 1 and 2 ranks
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("keep_threads_and_warnings")]

ROOT = Path(__file__).resolve().parents[3]
TIMING = ("time/", "time_mean/", "memory/", "memory_mean/", "tokens_per_s")
TINY = ["--teacher", "tiny", "--model", "tiny-student", "--batch_size", "8", "--num_examples", "64",
        "--eval_prompts", "8", "--log_every", "1", "--save_every", "2"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in distributed.LAUNCH_ENV}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _cli(*args, launcher=(sys.executable, "-m", "fastrlhf"), timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _rows(out: Path, stage: str = "distill") -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows if r["stage"] == stage]


@pytest.mark.parametrize("mode", ["offline", "on_policy"])
def test_distill_cli(tmp_path, mode, capsys, caplog):
    """A few steps of each mode: the loss falls, the summary reports the true scores and both models'
    sizes, the final student loads with the student's shape. (`fastrlhf distill` in this process; as a
    process of its own under torchrun: test_same_training_on_1_and_2_ranks.)"""
    r = main_in_process("distill", "--out", str(tmp_path), *TINY, "--steps", "6", "--mode", mode, capsys=capsys,
                        caplog=caplog)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(tmp_path)
    assert [row["step"] for row in rows] == list(range(1, 7))
    assert rows[-1]["loss"] < rows[0]["loss"] and all(row["entropy"] > 0 for row in rows)
    assert ("true_score" in rows[0]) == (mode == "on_policy")  # the student's own samples, scored
    summary = json.loads((tmp_path / "summary.json").read_text())["distill"]
    assert summary["mode"] == mode and summary["steps"] == 6
    assert summary["rollout_engine"] == ("hf" if mode == "on_policy" else None)
    assert summary["student_params"] < summary["teacher_params"] / 2
    for k in ("true_score_teacher", "true_score_before", "true_score_after"):
        assert 0 <= summary[k] <= 1
    lm, _ = load_causal_lm(str(tmp_path / "distill" / "final"), device=torch.device("cpu"))
    assert sum(p.numel() for p in lm.parameters()) == summary["student_params"]
    assert json.loads((tmp_path / "distill" / "final" / "fastrlhf.json").read_text())["origin"] == "tiny-student"


def test_on_policy_samples_with_the_decode_engine(tmp_path, caplog):
    """--rollout_engine graph: the student's samples come from PPO's decode engine (its step run eagerly on CPU,
    its weights re-formed from the student before each step's samples); the loss falls as with generate."""
    caplog.set_level("INFO", logger="fastrlhf")
    cfg = DistillConfig(teacher="tiny", model="tiny-student", out=str(tmp_path), steps=6, batch_size=8,
                        num_examples=64, eval_prompts=8, log_every=1, mode="on_policy", rollout_engine="graph",
                        device="cpu")
    summary = distill.train(cfg)
    assert "rollout: engine graph" in caplog.text
    assert summary["rollout_engine"] == "graph" and summary["loss_final"] < summary["loss_first"]
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(r["response_length"] > 0 for r in rows)


def test_resume_gives_the_same_metrics(tmp_path, capsys, caplog):
    """Stopped after 2 steps and resumed: the same rows as an uninterrupted run (weights, optimizer, RNG),
    with a LoRA student (its adapters merged into the final model). The three runs share this process, as
    the resume of a process killed mid-run does in test_a_signal_stops_distill_with_a_checkpoint_..."""
    args = [*TINY, "--steps", "4", "--mode", "on_policy", "--lora_rank", "4"]
    full, split = tmp_path / "full", tmp_path / "split"

    def cli(*a):
        return main_in_process("distill", *a, capsys=capsys, caplog=caplog)

    assert (r := cli("--out", str(full), *args)).returncode == 0, r.stderr[-3000:]
    assert (r := cli("--out", str(split), *args, "--stop_after", "2")).returncode == 0, r.stderr[-3000:]
    assert len(_rows(split)) == 2 and not (split / "distill" / "final").exists()
    assert (r := cli("--out", str(split), *args, "--resume")).returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr
    assert _rows(split) == _rows(full)
    summaries = [json.loads((d / "summary.json").read_text())["distill"] for d in (full, split)]
    for k in ("true_score_teacher", "true_score_before", "true_score_after"):
        assert summaries[0][k] == summaries[1][k], k
    assert not any("lora" in k for k in json.loads((full / "distill" / "final" / "config.json").read_text()))


def test_same_training_on_1_and_2_ranks(tmp_path, capsys, caplog):
    """torchrun, 2 CPU ranks, both models sharded (FSDP2, gloo): the global batch and the global token count
    give the same losses as one process (this one)."""
    args = [*TINY, "--steps", "3", "--batch_size", "8"]
    one, two = tmp_path / "one", tmp_path / "two"
    r = main_in_process("distill", "--out", str(one), *args, capsys=capsys, caplog=caplog)
    assert r.returncode == 0, r.stderr[-3000:]
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                "fastrlhf")
    r = _cli("distill", "--out", str(two), *args, launcher=torchrun)
    assert r.returncode == 0, r.stderr[-4000:]
    for a, b in zip(_rows(one), _rows(two), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
    assert (two / "distill" / "final" / "model.safetensors").is_file()
    assert json.loads((two / "summary.json").read_text())["distill"]["state_bytes_mean"]["params"] > 0


def test_user_data_offline(tmp_path, capsys, caplog):
    """A local model pair with its own BPE tokenizer and (prompt, response) JSONL data; no true score."""
    rows = task_rows(40)
    tok = bpe_tokenizer([r["prompt"] + r["response"] for r in task_rows(200)])
    teacher = make_local_model(tmp_path / "teacher", tokenizer=tok, seed=1)
    student = make_local_model(tmp_path / "student", tokenizer=tok, seed=2)
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    r = main_in_process("distill", "--out", str(tmp_path / "run"), "--teacher", str(teacher), "--model",
                        str(student), "--data", str(data), "--steps", "3", "--batch_size", "4", "--beta", "1.0",
                        "--lr", "1e-3", capsys=capsys, caplog=caplog)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["distill"]
    assert summary["beta"] == 1.0 and "true_score_after" not in summary and summary["loss_final"] > 0


@pytest.mark.parametrize("change,match", [
    (dict(mode="online"), "mode must be one of offline, on_policy"),
    (dict(rollout_engine="vllm"), "rollout_engine must be one of hf, graph, auto"),
    (dict(beta=1.5), r"beta must be in \[0, 1\]"),
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(teacher=""), "no teacher given and .* does not exist; pass --teacher"),
    (dict(model=""), "no student given and .* does not exist; pass --model"),
])
def test_checked_before_a_model_loads(tmp_path, change, match):
    cfg = DistillConfig(**{**dict(teacher="tiny", model="tiny-student", out=str(tmp_path)), **change})
    with pytest.raises(ValueError, match=match):
        distill.prepare(cfg)


def test_teacher_and_student_must_share_a_vocabulary(tmp_path):
    tok = bpe_tokenizer([r["prompt"] + r["response"] for r in task_rows(200)])
    other = make_local_model(tmp_path / "other", tokenizer=tok)
    with pytest.raises(ValueError, match="must share a vocabulary"):
        distill.prepare(DistillConfig(teacher=str(other), model="tiny-student", out=str(tmp_path / "o")))


def test_pipeline_distill_short(tmp_path, capsys, caplog):
    """`fastrlhf pipeline --algo distill` end to end in a few steps per stage: the student's SFT in its own
    run folder, the distillation from the PPO policy, the headline figures; --resume skips what finished.
    (In this process: the pipeline's own process runs in tests/train/recipes/test_pipeline.py.)"""
    args = ["--algo", "distill", "--out", str(tmp_path), "--sft.steps", "4", "--sft.num_examples", "64",
            "--rm.steps", "2", "--rm.num_pairs", "40", "--ppo.steps", "2", "--ppo.rollout_batch_size", "8",
            "--ppo.mini_batch_size", "8", "--ppo.micro_batch_size", "8", "--ppo.eval_prompts", "8",
            "--student.steps", "4", "--student.num_examples", "64", "--distill.steps", "3",
            "--distill.batch_size", "8", "--distill.eval_prompts", "8", "--distill.mode", "on_policy"]
    assert (r := main_in_process("pipeline", *args, capsys=capsys, caplog=caplog)).returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (tmp_path / "student" / "sft" / "final" / "config.json").is_file()
    assert summary["distill"]["steps"] == 3 and summary["distill"]["student_params"] == 293760
    assert set(summary["pipeline"]) >= {"seconds", "recovered_gain", "recovered_gain_student_start"}
    assert "distill.true_score_after" in r.stderr and "pipeline.recovered_gain" in r.stderr
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["student"]["model"] == "tiny-student" and config["distill"]["teacher"].endswith("ppo/final")
    r = main_in_process("pipeline", *args, "--resume", capsys=capsys, caplog=caplog)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("already finished, skipping") == 5


HOLD_LOCK = """
import sys, time
from pathlib import Path
from fastrlhf.train.checkpoint import run_lock
with run_lock(Path(sys.argv[1]), "test"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_signal_stops_distill_with_a_checkpoint_and_a_second_process_is_refused(tmp_path, capsys, caplog):
    """As every stage (fastrlhf.train.run): SIGINT finishes the step, writes its checkpoint and exits 130, --resume
    continues from it; a folder another process holds is refused before a model loads, naming that process.
    The signalled run and the holder are processes of their own; the resume and the refused run run here."""
    from train.test_faults import DRIVER

    out = tmp_path / "run"
    args = ["distill", "--out", str(out), *TINY, "--steps", "4"]
    stopped = subprocess.run([sys.executable, "-c", DRIVER, "signal", "3", "SIGINT", *args], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=600)
    assert stopped.returncode == 130, stopped.stderr[-3000:]  # SIGTERM's 143: tests/train/test_faults.py
    assert "distill: SIGINT received: finishing this step, then a checkpoint" in stopped.stderr
    assert "distill: stopped at step 3; continue with --resume" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert (out / "distill" / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert not (out / "distill" / "final").exists()
    resumed = main_in_process(*args, "--resume", capsys=capsys, caplog=caplog)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [row["step"] for row in _rows(out)] == [1, 2, 3, 4] and (out / "distill" / "final").is_dir()

    held = tmp_path / "held"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(held)], cwd=ROOT, env=_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = main_in_process("distill", "--out", str(held), *TINY, "--steps", "2", capsys=capsys,
                                  caplog=caplog)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert f"{held} is in use by another run (PID {holder.pid}" in refused.stderr
        assert not (held / "distill").exists()
    finally:
        holder.kill()
        holder.wait()
