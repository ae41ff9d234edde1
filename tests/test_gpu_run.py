"""`bench/gpu_run.sh --dry-run`: the one-call GPU script runs every step on CPU at small shapes
and leaves, in its output folder, the files the device tool brings back (at most 8, no folders).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["install", "env", "tests", "bench", "ppo"]
FILES = {"status.json", "bench.json", "bench.png", "ppo.json", "tests.log", "logs.tar.gz"}


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_dry_run(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("FASTRLHF_BACKEND", "TRITON_INTERPRET")}
    env |= {"PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_run.sh"), str(out), "--dry-run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=330)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

    assert {p.name for p in out.iterdir()} == FILES and all(p.is_file() for p in out.iterdir())
    status = json.loads((out / "status.json").read_text())
    assert status["dry_run"] is True and status["ok"] is True
    assert [s["name"] for s in status["steps"]] == STEPS
    assert all(s["rc"] == 0 and not s["timed_out"] and s["seconds"] <= s["limit_s"] for s in status["steps"])
    assert status["kernels_tree_files"] and len(status["kernels_tree_files"]) == 40
    assert status["environment"]["kind"] == "cpu"

    bench = json.loads((out / "bench.json").read_text())
    assert bench["finished"] is True and bench["cases"] == "tiny" and bench["errors"] == []
    assert {r["op"] for r in bench["results"]} >= {"logprobs", "linear_ppo_actor_loss", "gae"}
    assert bench["kernels_tree_files"] == status["kernels_tree_files"]

    ppo = json.loads((out / "ppo.json").read_text())
    assert ppo["finished"] is True and ppo["summary"]["steps"] == 2
    assert [s["step"] for s in ppo["steps"]] == [1, 2]
    assert set(ppo["summary"]["phase_seconds"]) == {"rollout", "reward", "logprobs", "advantages", "update"}
    assert ppo["steady_state_steps"] == [2] and ppo["steady_state_mean"]["rollout_s"] > 0
    assert ppo["kernels_tree_files"] == status["kernels_tree_files"]

    assert " passed" in (out / "tests.log").read_text()
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"./logs/{s}.log" for s in STEPS} <= names and "./env.json" in names
    assert "./ppo_run/metrics.jsonl" in names and not any(n.startswith("./ppo_run/ppo/") for n in names)
    assert "gpu_run (dry run) ok=True" in proc.stdout


def test_bad_arguments():
    script = str(ROOT / "bench" / "gpu_run.sh")
    for args in ([], ["--nope"], ["a", "b"]):
        proc = subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and "usage" in proc.stderr
