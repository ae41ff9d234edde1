"""`fastrlhf bench` on CPU: the CLI runs every op and writes a well-formed record.

The run is the real `--quick` CLI path (argument parsing, probes, every op, provider and
pass, targets, JSON, plot) with each case's dimensions divided by 8 so the test stays a
few seconds on 2 cores (the unshrunk `--quick` run takes about a minute). Timings are
never asserted.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from fastrlhf import bench

ROW_KEYS = {"op", "shape", "dtype", "pass", "provider", "median_ms", "gbps", "peak_mem_bytes"}
RECORD_KEYS = {"device", "torch", "triton", "commit", "kernels_tree", "command", "driver", "peak_read_gbps",
               "peak_copy_gbps", "results", "targets", "skipped", "errors"}


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """One CPU bench run over every op (shrunk cases), its JSON and PNG."""
    out = tmp_path_factory.mktemp("bench")
    full_cases = bench.cases

    def shrunk(quick=False):
        return [dataclasses.replace(c, dims={k: max(2, v // 8) for k, v in c.dims.items()})
                for c in full_cases(quick)]

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FASTRLHF_BACKEND", raising=False)  # the CPU torch path, not the interpreter
        mp.setattr(bench, "cases", shrunk)
        rc = bench.main(["--quick", "--device", "cpu", "--json", str(out / "out.json"),
                         "--plot", str(out / "out.png"), "--rep-ms", "1"])
    return rc, json.loads((out / "out.json").read_text()), out / "out.png", shrunk(True)


def test_run_succeeds_and_records_environment(record):
    rc, result, _, _ = record
    assert rc == 0, result["errors"]
    assert result["errors"] == []
    assert RECORD_KEYS <= result.keys()
    assert result["kind"] == "cpu" and result["device"].startswith("CPU")
    assert result["torch"] == torch.__version__
    assert result["command"].startswith("fastrlhf bench --quick --device cpu")
    assert result["peak_mem_source"] is None  # no allocator statistics on CPU
    for probe in ("peak_read_gbps", "peak_copy_gbps"):
        assert math.isfinite(result[probe]) and result[probe] > 0


def test_rows_for_every_op_pass_and_provider(record):
    _, result, _, cases = record
    rows = result["results"]
    for row in rows:
        assert ROW_KEYS <= row.keys(), row
        assert row["pass"] in bench.PASSES and row["provider"] in bench.PROVIDERS
        assert math.isfinite(row["median_ms"]) and row["median_ms"] > 0
        assert row["gbps"] == pytest.approx(row["bytes"] / 1e9 / (row["median_ms"] / 1e3))
        assert row["peak_mem_bytes"] is None
    measured = {(r["op"], r["shape"], r["dtype"], r["pass"], r["provider"]) for r in rows}
    assert {c.op for c in cases} == set(bench.OPS)
    for case in cases:
        for pass_ in case.passes:
            for provider in ("fastrlhf", "torch"):
                assert (case.op, case.shape, case.dtype_name, pass_, provider) in measured
    fastrlhf = [r for r in rows if r["provider"] == "fastrlhf"]
    assert {r["backend"] for r in fastrlhf} == {"torch"}  # CPU tensors take the torch path
    matmuls = {(r["op"], r["pass"]) for r in rows if r["provider"] == "matmuls"}
    assert matmuls == {(op, p) for op in ("linear_logprobs", "linear_ppo_actor_loss") for p in ("fwd", "fwd+bwd")}


def test_absent_peers_and_compile_are_skipped_with_a_note(record):
    _, result, _, _ = record
    providers = {r["provider"] for r in result["results"]}
    assert "torch.compile" not in providers
    assert any("torch.compile" in note for note in result["notes"])
    skipped = {s["provider"] for s in result["skipped"]}
    for peer, module in [("verl", "verl"), ("openrlhf", "openrlhf"), ("trl", "trl")]:
        if importlib.util.find_spec(module) is None:
            assert peer in skipped and peer not in providers
    assert "liger" in skipped  # needs CUDA
    assert all(s["reason"] and s["ops"] for s in result["skipped"])


def test_targets_are_computed_from_the_rows(record):
    _, result, _, _ = record
    by_name = {t["name"]: t for t in result["targets"]}
    # 6 targets; 2 again with d(weight) accumulated in the weight dtype; time and peak of the trainer's
    # linear_ppo_actor_loss, for both accumulations
    assert len(by_name) == 12
    rows = result["results"]

    def ms(op, pass_, provider):
        return next(r["median_ms"] for r in rows if (r["op"], r["pass"], r["provider"]) == (op, pass_, provider)
                    and r["dtype"] == "bfloat16")

    actor = by_name["ppo_actor_loss fwd+bwd / logprobs fwd+bwd"]
    assert actor["value"] == pytest.approx(ms("ppo_actor_loss", "fwd+bwd", "fastrlhf")
                                           / ms("logprobs", "fwd+bwd", "fastrlhf"))
    assert actor["met"] == (actor["value"] <= 1.15)
    assert "not the target shape" in actor["detail"]
    for name in ("linear_logprobs fwd+bwd extra peak (GiB)",
                 f"linear_logprobs fwd+bwd extra peak (GiB), {bench.WEIGHT_ACCUM}"):
        assert by_name[name]["value"] is None and by_name[name]["met"] is None  # no peak memory on CPU
    for t in result["targets"]:
        assert {"name", "goal", "value", "met", "detail"} <= t.keys()


def test_plot_and_markdown(record):
    _, result, png, _ = record
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = bench.markdown_table(result)
    for op in bench.OPS:
        assert f"| {op} |" in table
    assert result["command"] in table


def test_readme_table_prefers_the_latest_gpu_run(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "readme_table", Path(__file__).resolve().parents[1] / "bench" / "README_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, kind, date in [("a.json", "cuda", "2026-01-01"), ("b.json", "cuda", "2026-02-01"),
                             ("c.json", "cpu", "2026-03-01")]:
        (tmp_path / name).write_text(json.dumps({"kind": kind, "date": date}))
    assert module.latest(tmp_path).name == "b.json"


def test_bad_arguments():
    with pytest.raises(SystemExit) as exc:
        bench.main(["--ops", "logprobs,nope"])
    assert exc.value.code == 2
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device"):
            bench.main(["--device", "cuda", "--ops", "gae"])
