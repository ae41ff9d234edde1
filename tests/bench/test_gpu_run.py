"""`bench/gpu_run.sh --dry-run`: the one-call GPU script runs every step on CPU at small shapes
and leaves, in its output folder, the files the device tool brings back (at most 8, no folders).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # every part's --dry-run runs the part's scripts on CPU

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_run.sh"
# each part's steps and the files it leaves in OUT (bench/parts/PART.sh); every run also leaves these two
PART_STEPS = {"tests": ["tests"], "ops": ["ops"], "ppo": ["ppo"], "experiments": ["dist", "coop", "chunks", "few_rows"],
              "rollout": ["rollout_graph", "rollout_static", "rollout_dynamic"], "update": ["update"], "e2e": ["e2e"],
              "decode_attention": ["decode_attention"],
              "rollout_lengths": ["lengths_new", "lengths_before", "lengths_hf_cb"]}
PART_FILES = {"tests": {"tests.log"}, "ops": {"bench.json", "bench.png"}, "ppo": {"ppo.json"},
              "experiments": {"coop.json", "linear_chunks.json", "dist_peak_memory.json", "few_rows.json"},
              "rollout": {"rollout.json"}, "update": {"update.json"}, "e2e": {"e2e.json"},
              "decode_attention": {"decode_attention.json"}, "rollout_lengths": {"rollout_lengths.json"}}
ALWAYS = {"status.json", "logs.tar.gz"}
# the parts the shared dry run runs, in this order: the default three, then the others (e2e: tests/bench/test_e2e_bench)
DRY_PARTS = ["tests", "ops", "ppo", "experiments", "rollout", "update", "decode_attention", "rollout_lengths"]
needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and timeout")
on_cpu = pytest.mark.skipif(torch.cuda.is_available(),
                            reason="on a GPU machine the real run is what runs (bench/gpu_run.sh)")


def _env(tmp: Path, python: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FASTRLHF_BACKEND", "TRITON_INTERPRET")}
    return env | {"PYTHON": python, "TMPDIR": str(tmp)}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """(OUT, the finished process) of one `bench/gpu_run.sh OUT --dry-run --only DRY_PARTS` on this python, which
    every part's test below reads; it must exit 0. Its deadline is the sum of the separate runs' it stands for."""
    tmp = tmp_path_factory.mktemp("gpu_run")
    out = tmp / "out"
    env = _env(tmp, sys.executable) | {"GPU_RUN_DEADLINE_S": "900"}
    proc = subprocess.run(["bash", str(SCRIPT), str(out), "--dry-run", "--only", ",".join(DRY_PARTS)], cwd=tmp,
                          env=env, capture_output=True, text=True, errors="replace", timeout=960)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return out, proc


def _planned_steps(tmp_path: Path, *flags) -> list[str]:
    """The steps `bench/gpu_run.sh OUT *flags` runs, in order, with a python that does nothing (`true`): which
    steps run is the shell's choice alone; steps.tsv, kept in logs.tar.gz, lists them."""
    out = tmp_path / "plan"
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(["bash", str(SCRIPT), str(out), *flags], cwd=tmp_path, env=_env(tmp_path, "true"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with tarfile.open(out / "logs.tar.gz") as tar:
        steps = tar.extractfile("./steps.tsv").read().decode()
    return [line.split("\t")[0] for line in steps.splitlines()]


@needs_bash
def test_the_steps_of_each_call(tmp_path):
    """Without --only, the parts tests, ops and ppo; --experiments is --only experiments; --only runs the named
    parts' steps alone, in the order named; a dry run runs the same steps as the GPU run."""
    parts = sorted(p.stem for p in (ROOT / "bench" / "parts").glob("*.sh"))
    assert parts == sorted(PART_STEPS), "a new part: name its steps and files in PART_STEPS and PART_FILES"
    first = ["install", "env"]
    for dry in (["--dry-run"], []):
        assert _planned_steps(tmp_path, *dry) == first + ["tests", "ops", "ppo"]
        assert _planned_steps(tmp_path, *dry, "--experiments") == first + PART_STEPS["experiments"]
    for part in parts:
        assert _planned_steps(tmp_path, "--dry-run", "--only", part) == first + PART_STEPS[part], part
    assert _planned_steps(tmp_path, "--dry-run", "--only", "update,ops") == first + ["update", "ops"]


@needs_bash
@on_cpu
def test_dry_run(dry_run):
    """The shared dry run: every part's steps ran, in order, and each left its files (and no other); the default
    parts' records (tests, ops, ppo)."""
    out, proc = dry_run
    assert {p.name for p in out.iterdir()} == ALWAYS.union(*(PART_FILES[p] for p in DRY_PARTS))
    assert all(p.is_file() for p in out.iterdir())
    status = json.loads((out / "status.json").read_text())
    assert status["dry_run"] is True and status["ok"] is True
    steps = ["install", "env"] + [s for p in DRY_PARTS for s in PART_STEPS[p]]
    assert [s["name"] for s in status["steps"]] == steps  # --only: the named parts' steps alone
    assert all(s["rc"] == 0 and not s["timed_out"] and s["seconds"] <= s["limit_s"] for s in status["steps"])
    assert status["kernels_tree_files"] and len(status["kernels_tree_files"]) == 40
    assert status["environment"]["kind"] == "cpu"

    bench = json.loads((out / "bench.json").read_text())
    assert bench["finished"] is True and bench["cases"] == "tiny" and bench["errors"] == []
    assert {r["op"] for r in bench["results"]} >= {"logprobs", "linear_ppo_actor_loss", "gae"}
    assert all({"host_us", "wall_ms"} <= row.keys() for row in bench["results"])  # host and GPU apart
    assert bench["kernels_tree_files"] == status["kernels_tree_files"]
    if importlib.util.find_spec("verl") is not None:  # its unused ray import stood in for by the tests' peer_stubs
        assert any(r["op"] == "gae" and r["provider"] == "verl" for r in bench["results"]), bench["skipped"]

    ppo = json.loads((out / "ppo.json").read_text())
    assert ppo["finished"] is True and ppo["summary"]["steps"] == 2
    assert [s["step"] for s in ppo["steps"]] == [1, 2]
    assert set(ppo["summary"]["phase_seconds"]) == {"rollout", "reward", "logprobs", "advantages", "update"}
    assert ppo["steady_state_steps"] == [2] and ppo["steady_state_mean"]["rollout_s"] > 0
    assert ppo["kernels_tree_files"] == status["kernels_tree_files"]

    assert " passed" in (out / "tests.log").read_text()
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"./logs/{s}.log" for s in steps} <= names and "./env.json" in names
    assert "./ppo_run/metrics.jsonl" in names and not any(n.startswith("./ppo_run/ppo/") for n in names)
    assert "gpu_run (dry run) ok=True" in proc.stdout


@needs_bash
@on_cpu
def test_experiments_dry_run(dry_run):
    """The experiments part (`--experiments`) of the dry run: each experiment on CPU, each leaving its JSON (its steps
    and files: test_dry_run)."""
    out, _ = dry_run
    assert json.loads((out / "coop.json").read_text())["finished"] is True
    chunks = json.loads((out / "linear_chunks.json").read_text())
    assert {(r["op"], r["accum"]) for r in chunks["rows"]} == {(op, accum) for op in ("linear_logprobs",
                                                               "linear_ppo_actor_loss") for accum in ("fp32", "weight")}
    assert all(r["median_ms"] > 0 for r in chunks["rows"])
    few = json.loads((out / "few_rows.json").read_text())["providers"]
    assert {"fastrlhf", "torch"} <= set(few) and all(p["wall_us_per_call"] > 0 for p in few.values())
    dist = json.loads((out / "dist_peak_memory.json").read_text())
    assert dist["measured"]["ranks"] == 1 and "error" not in dist["predicted"], dist["predicted"]


def _gpu_record():
    spec = importlib.util.spec_from_file_location("gpu_record", ROOT / "bench" / "gpu_record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_records_of_a_stopped_run(tmp_path):
    """A PPO run killed by its time limit leaves no summary: ppo.json still holds the logged steps;
    a timed-out or skipped step makes the status not ok."""
    gpu_record = _gpu_record()
    rows = [{"stage": "ppo", "step": s, "tokens_per_s": 100.0 * s, **{f"time/{p}": float(s) for p in gpu_record.PHASES},
             **{f"memory/{p}": 1e9 for p in gpu_record.PHASES}} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ppo = gpu_record.ppo_record(tmp_path, "fastrlhf ppo ...")
    assert ppo["finished"] is False and ppo["summary"] is None and [s["step"] for s in ppo["steps"]] == [1, 2, 3]
    assert ppo["steady_state_steps"] == [2, 3] and ppo["steady_state_mean"]["rollout_s"] == 2.5
    assert ppo["steady_state_mean"]["tokens_per_s"] == 250.0
    (tmp_path / "steps.tsv").write_text("install\t0\t3\t45\ntests\t124\t180\t180\nppo\tskipped\t0\t0\n")
    status = gpu_record.status_record(tmp_path / "steps.tsv", tmp_path / "missing.json", dry_run=False)
    assert status["ok"] is False and status["environment"] is None
    assert [(s["timed_out"], s["skipped"]) for s in status["steps"]] == [(False, False), (True, False), (False, True)]


def test_the_ops_part_fits_eight_minutes():
    """`--only ops` on a GPU: install and environment at their limits, the ops step at its own, and a few seconds
    for the record stay within 8 minutes (the device call's limit); the bench's budget leaves the step time to
    finish its last measurement and write the record."""

    script = (ROOT / "bench" / "gpu_run.sh").read_text()
    part = (ROOT / "bench" / "parts" / "ops.sh").read_text()
    install, env = (int(x) for x in re.search(r"L_INSTALL=(\d+) L_ENV=(\d+)\n\s*fi", script).groups())
    ops = int(re.search(r'L_OPS=\$\(\[ "\$DRY" = 1 \] && echo \d+ \|\| echo (\d+)\)', part).group(1))
    assert install + env + ops + 20 <= 8 * 60, (install, env, ops)
    margin = re.search(r"--budget-s \$\(\(L_OPS - (\d+)\)\)\)  #", part)
    assert margin and int(margin.group(1)) >= 30, "the GPU bench budget: the step's less a margin"


@needs_bash
@on_cpu
def test_rollout_dry_run(dry_run):
    """The rollout part of the dry run: the three samplers, each in its own step (test_dry_run), merged into
    rollout.json with every figure issue 26 asks for (at the tiny size on CPU: no CUDA graph, no launch counts,
    no goal judged)."""
    out, proc = dry_run
    rollout = json.loads((out / "rollout.json").read_text())
    assert [e["engine"] for e in rollout["engines"]] == ["graph", "static", "dynamic"] and rollout["missing"] == []
    for e in rollout["engines"]:
        for key in ("decode_ms_per_step", "floor_ms_per_step", "rollout_s", "step_s", "compile_s"):
            assert e[key] is not None and e[key] >= 0, (e["engine"], key)
        assert e["decode_ms_per_step"] > 0 and e["rollout_s"] > 0 and e["step_s"] > e["rollout_s"]
        assert e["launches"] is None  # CPU
    graph = rollout["engines"][0]
    assert graph["capture_s"] == 0.0 and 0 <= graph["logp_gap"]["max"] < 1e-5  # fp32 on CPU: the same numbers
    assert [g["met"] for g in rollout["goals"]] == [None] * 4
    assert "rollout graph" in proc.stdout


def test_bad_arguments():
    script = str(SCRIPT)
    parts = sorted(p.stem for p in (ROOT / "bench" / "parts").glob("*.sh"))
    assert {"tests", "ops", "ppo", "experiments"} <= set(parts)
    for args in ([], ["--nope"], ["a", "b"], ["a", "--only"], ["a", "--only", "nope"], ["a", "--only", "ops,nope"]):
        proc = subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and "usage" in proc.stderr, (args, proc.stderr)
        assert all(part in proc.stderr for part in parts), proc.stderr


@needs_bash
@on_cpu
def test_update_part_dry_run(dry_run):
    """The update part of the dry run: the update phase timed compile off/on x padded/packed and packed vs padded
    on a length spread, against the planner's FLOP floor; lr 0 and one minibatch draw, so every entry on a
    rollout has the same gradient norm (packed = padded, compiled = eager) to float32 rounding."""
    out, _ = dry_run
    record = json.loads((out / "update.json").read_text())
    assert record["finished"] is True and record["dry_run"] is True and record["floor_s"] > 0
    entries = {(e["rollout"], e["compile"], e["packed"]): e for e in record["entries"]}
    assert set(entries) == {("uniform", c, p) for c in (False, True) for p in (False, True)} | {
        ("spread", True, False), ("spread", True, True)}
    for rollout in ("uniform", "spread"):
        norms = [e["grad_norm"] for k, e in entries.items() if k[0] == rollout]
        assert max(norms) - min(norms) <= 1e-5 * max(norms), (rollout, norms)
    assert all(e["update_s"] > 0 and e["skipped_nonfinite"] == 0 for e in entries.values())
    assert entries["uniform", True, False]["compiled_graphs"] > 0
    assert all(entries["uniform", c, False]["ops_per_layer"] > 0 for c in (False, True))
    assert record["floor_spread"]["padded_micro_batch_padding"]["trunk"] > 0.05  # 12% in the dry run
    assert set(record["goals"]) >= {"update_vs_floor", "spread_packed_vs_padded"}


def test_the_decode_attention_part_fits_eight_minutes():
    """`--only decode_attention` on a GPU: install, environment and the part's step at their limits, and a few
    seconds for the record, within 8 minutes; the bench inside it stops starting measurements well before."""

    script = (ROOT / "bench" / "gpu_run.sh").read_text()
    part = (ROOT / "bench" / "parts" / "decode_attention.sh").read_text()
    install, env = (int(x) for x in re.search(r"L_INSTALL=(\d+) L_ENV=(\d+)\n\s*fi", script).groups())
    step, budget = (int(x) for x in re.search(r"L_DECODE=(\d+) DECODE_ARGS=\(--budget-s (\d+)\)", part).groups())
    assert install + env + step + 20 <= 8 * 60, (install, env, step)
    assert budget + 60 <= step, "the bench's budget leaves the step time for a last flex compile and the tile counts"


@needs_bash
@on_cpu
def test_decode_attention_dry_run(dry_run):
    """`--only decode_attention --dry-run`: the tiny set's decode cases on CPU (fastrlhf's torch path and SDPA; flex
    and flash-attn skipped, CUDA only), the kernel's tile counts in the interpreter, every goal computed and none
    judged off CUDA."""
    out, proc = dry_run
    record = json.loads((out / "decode_attention.json").read_text())
    assert record["finished"] is True and record["dry_run"] is True and record["errors"] == []
    assert [e["dims"]["G"] for e in record["cases"]] == [1, 2]
    for e in record["cases"]:
        assert {"fastrlhf", "torch"} <= set(e["providers"]) and e["providers"]["fastrlhf"]["backend"] == "torch"
        kv = e["kernel_kv"]
        assert kv["tiles"] > 0 and kv["bytes_read"] == kv["bytes_needed_whole_tiles"] >= kv["bytes_needed"]
    assert {s["provider"] for s in record["skipped"]} >= {"flex", "flash_attn"}
    names = [g["name"] for g in record["goals"]]
    assert sum(n.startswith("GPU time / fastest peer") for n in names) == 2
    assert sum("prompt once" in n for n in names) == 1
    assert all(g["met"] is None and g["value"] is not None for g in record["goals"])
    assert "decode_attention (" in proc.stdout  # gpu_record.py's summary


@needs_bash
@on_cpu
def test_rollout_lengths_dry_run(dry_run):
    """The rollout_lengths part of the dry run (issue 42): the three engines, each in its own step, merged
    into rollout_lengths.json on the same drawn lengths: the new engine decodes exactly the drawn tokens
    (the old one its whole static batch), prefills each group's prompt once, and its sampler's log-probs are
    the trainer's in fp32; nothing is judged on CPU."""
    out, proc = dry_run
    record = json.loads((out / "rollout_lengths.json").read_text())
    engines = {e["engine"]: e for e in record["engines"]}
    before_commit = re.search(r'^BEFORE = "(\w+)"', (ROOT / "bench" / "rollout_lengths.py").read_text(), re.M)[1]
    has_before = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e",
                                 f"{before_commit}^{{commit}}"]).returncode == 0
    if has_before:
        assert list(engines) == ["new", "before", "hf_cb"] and record["missing"] == []
    else:  # a shallow clone: the old engine cannot be read, and the record says so
        assert list(engines) == ["new", "hf_cb"] and [m.split(":")[0] for m in record["missing"]] == ["before"]
    assert all(e["finished"] and e["rollout_s"] > 0 for e in engines.values())
    new, cb = engines["new"], engines["hf_cb"]
    sizes, drawn = new["sizes"], new["lengths"]
    assert new["tokens"] == cb["tokens"] == drawn["sum"] and drawn["max"] == sizes["new_tokens"]
    stats = new["stats"]
    assert stats["prefill_rows"] == sizes["rows"] // sizes["group"]
    assert stats["row_steps"] < sizes["new_tokens"] * sizes["rows"]  # a static batch's, to R
    if has_before:
        before = engines["before"]
        assert before["tokens"] == sizes["rows"] * sizes["new_tokens"]  # no per-row limit: the batch runs to R
        assert before["stats"]["decode_steps"] == sizes["new_tokens"] - 1
    assert new["full_batch_step"]["steps"] >= 8 and new["full_batch_step"]["floor"]["ms"] > 0
    assert record["logp_gap"]["rollout/logp_gap_max"] < 1e-5  # fp32 on CPU
    assert [g["met"] for g in record["goals"]] == [None] * 4
    assert "rollout new" in proc.stdout
