"""`fastrlhf bench`: the CLI runs every op and writes a well-formed record; the harness rules
(minimum repetitions, fresh inputs per provider, extra peak memory, targets as same-run ratios,
time budget) hold. Timings are never asserted.

The CLI run is the real path (argument parsing, probes, every op, provider and pass, targets,
JSON, plot) on the `tiny` case set, a few seconds on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import time
import types
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE

from fastrlhf import bench
from fastrlhf.bench import environment, measure, providers, run
from fastrlhf.bench.cases import GRID_TARGET, LINEAR_TARGET, LOGITS_TARGET, OP_SETS

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"op", "shape", "dims", "dtype", "pass", "provider", "backend", "median_ms", "p10_ms", "p90_ms", "reps",
            "bytes", "gbps", "roofline", "peak_mem_bytes", "grad_bytes", "extra_peak_bytes", "autotune", "host_us",
            "wall_ms"}
RECORD_KEYS = {"schema", "device", "kind", "torch", "triton", "commit", "kernels_tree", "kernels_tree_files", "dirty",
               "command", "driver", "probes", "settings", "cases", "finished", "results", "targets", "skipped",
               "errors", "notes"}


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """One CPU bench run over every op (the tiny case set), its JSON and PNG."""
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FASTRLHF_BACKEND", raising=False)  # the CPU torch path, not the interpreter
        rc = bench.main(["--device", "cpu", "--cases", "tiny", "--threads", "1", "--rep-ms", "1",
                         "--json", str(out / "out.json"), "--plot", str(out / "out.png")])
    return rc, json.loads((out / "out.json").read_text()), out / "out.png"


def test_run_succeeds_and_records_environment(record):
    rc, result, _ = record
    assert rc == 0, result["errors"]
    assert result["errors"] == []
    assert RECORD_KEYS <= result.keys()
    assert result["schema"] == 2 and result["finished"] is True and result["cases"] == "tiny"
    assert result["kind"] == "cpu" and result["device"].startswith("CPU")
    assert result["torch"] == torch.__version__
    assert result["command"].startswith("fastrlhf bench --device cpu --cases tiny")
    assert result["peak_mem_source"] is None  # no allocator statistics on CPU
    for probe in ("read_gbps", "copy_gbps"):
        assert math.isfinite(result["probes"][probe]) and result["probes"][probe] > 0
    assert result["settings"]["min_reps"] == 3


def test_rows_for_every_op_pass_and_provider(record):
    _, result, _ = record
    rows = result["results"]
    for row in rows:
        assert ROW_KEYS <= row.keys(), row
        assert row["pass"] in bench.PASSES and row["provider"] in bench.PROVIDERS
        assert math.isfinite(row["median_ms"]) and row["median_ms"] > 0
        assert row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
        assert row["reps"] >= 3  # --min-reps defaults to 3 on CPU, whatever --rep-ms says
        assert row["gbps"] == pytest.approx(row["bytes"] / 1e9 / (row["median_ms"] / 1e3))
        assert row["peak_mem_bytes"] is None and row["extra_peak_bytes"] is None
        assert row["autotune"] == []  # CPU tensors: no autotuned launch
        # on CPU all three timings are one: the host's
        assert row["host_us"] == pytest.approx(row["median_ms"] * 1e3) and row["wall_ms"] == row["median_ms"]
    measured = {(r["op"], r["shape"], r["dtype"], r["pass"], r["provider"]) for r in rows}
    cases = bench.cases("tiny")
    assert {c.op for c in cases} == set(bench.OPS)
    for case in cases:
        for pass_ in case.passes:
            for provider in ("fastrlhf", "torch"):
                assert (case.op, case.shape, case.dtype_name, pass_, provider) in measured
    assert {r["backend"] for r in rows if r["provider"] == "fastrlhf"} == {"torch"}  # CPU tensors: the torch path
    matmuls = {(r["op"], r["pass"]) for r in rows if r["provider"] == "matmuls"}
    assert matmuls == ({(op, p) for op in ("linear_logprobs", "linear_ppo_actor_loss") for p in ("fwd", "fwd+bwd")}
                       | {("linear_distill_loss", "fwd+bwd")})
    # TRL's chunked kernel runs on CPU too (its torch tiles): the distillation case's peer column is measured
    if importlib.util.find_spec("trl") is not None:
        assert any(r["provider"] == "trl" and r["op"] == "linear_distill_loss" for r in rows)


def test_absent_peers_and_compile_are_skipped_with_a_note(record):
    _, result, _ = record
    providers_seen = {r["provider"] for r in result["results"]}
    assert "torch.compile" not in providers_seen
    assert any("torch.compile" in note for note in result["notes"])
    skipped = {s["provider"] for s in result["skipped"]}
    for peer, module in [("verl", "verl"), ("openrlhf", "openrlhf"), ("trl", "trl")]:
        if importlib.util.find_spec(module) is None:
            assert peer in skipped and peer not in providers_seen
    assert "liger" in skipped  # needs CUDA
    assert all(s["reason"] and s["ops"] for s in result["skipped"])


def test_targets_in_a_cpu_run_are_computed_but_not_judged(record):
    _, result, _ = record
    by_name = {t["name"]: t for t in result["targets"]}
    assert set(by_name) == {t.name for t in bench.TARGETS}
    rows = result["results"]

    def ms(op, pass_, provider, dtype="bfloat16"):
        return next(r["median_ms"] for r in rows
                    if (r["op"], r["pass"], r["provider"], r["dtype"]) == (op, pass_, provider, dtype))

    actor = by_name["ppo_actor_loss fwd+bwd / logprobs fwd+bwd"]
    assert actor["value"] == pytest.approx(ms("ppo_actor_loss", "fwd+bwd", "fastrlhf")
                                           / ms("logprobs", "fwd+bwd", "fastrlhf"))
    assert "not the target shape" in actor["detail"] and actor["at_target"] is False
    gae = by_name["gae speed-up over the Python loop over T"]
    assert gae["value"] == pytest.approx(ms("gae", "fwd", "torch", "float32") / ms("gae", "fwd", "fastrlhf", "float32"))
    for t in result["targets"]:
        assert t["met"] is None  # never judged on CPU, nor off the target shape
    assert by_name["linear_logprobs fwd+bwd extra peak (GiB)"]["value"] is None  # no peak memory on CPU
    for mode, provider in bench.providers.MODE_PROVIDERS.items():  # issue 24: each mode over vanilla, same case
        target = by_name[f"ppo_actor_loss fwd+bwd {mode} / vanilla"]
        assert target["value"] == pytest.approx(ms("ppo_actor_loss", "fwd+bwd", provider)
                                                / ms("ppo_actor_loss", "fwd+bwd", "fastrlhf"))


def test_plot_and_markdown(record):
    _, result, png = record
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = bench.markdown_table(result)
    for op in bench.OPS:
        assert f"| {op} |" in table
    assert result["command"] in table
    assert "read probe" in table
    # the CUDA-only fields (nominal bandwidth, clocks, peak memory) render too
    clocks = {"clocks.sm": 1980.0, "clocks.max.sm": 1980.0, "clocks.mem": 2619.0, "clocks.max.mem": 2619.0}
    gpu = dict(result, kind="cuda", probes=dict(result["probes"], nominal_gbps=3352.3, clocks_after=clocks),
               results=[dict(r, peak_mem_bytes=3 * 2**20, grad_bytes=2**20, extra_peak_bytes=2 * 2**20)
                        for r in result["results"]])
    table = bench.markdown_table(gpu)
    assert "nominal 3352 GB/s" in table and "SM 1980/1980 MHz, memory 2619/2619 MHz" in table
    assert "| 2 |" in table  # extra peak MiB of the fastrlhf rows
    bench.print_table(gpu)


# ---------------------------------------------------------------- harness rules


def _row(op, pass_, provider, dims, ms, dtype="bfloat16", **extra):
    return {"op": op, "pass": pass_, "provider": provider, "dims": dims, "dtype": dtype,
            "shape": " ".join(f"{k}={v}" for k, v in dims.items()), "median_ms": ms, **extra}


def test_targets_are_same_run_ratios_judged_on_cuda_at_the_target_shape():
    probes = {"read_gbps": 3000.0, "copy_gbps": 2800.0}
    mm = _row("linear_ppo_actor_loss", "fwd+bwd", "matmuls", LINEAR_TARGET, 100.0)
    rows = [_row("logprobs", "fwd", "fastrlhf", LOGITS_TARGET, 1.0, gbps=2850.0),  # 0.95 of the read probe
            _row("logprobs", "bwd", "fastrlhf", LOGITS_TARGET, 1.0, gbps=2240.0),  # 0.80 of the copy probe
            _row("logprobs", "fwd+bwd", "fastrlhf", LOGITS_TARGET, 4.0),
            _row("ppo_actor_loss", "fwd+bwd", "fastrlhf", LOGITS_TARGET, 2.8),  # 0.70x logprobs
            mm, _row("linear_ppo_actor_loss", "fwd+bwd", "fastrlhf", LINEAR_TARGET, 120.0,  # 1.2x matmuls
                     peak_mem_bytes=3 * 2**30, grad_bytes=2.5 * 2**30, extra_peak_bytes=0.5 * 2**30),
            _row("gae", "fwd", "fastrlhf", GRID_TARGET, 0.1, dtype="float32"),
            _row("gae", "fwd", "torch", GRID_TARGET, 150.0, dtype="float32")]  # 1500x
    got = {t["name"]: t for t in bench.targets(rows, probes, "cuda")}
    expect = {"logprobs fwd / read probe, V=151936": (0.95, True), "logprobs bwd / copy probe, V=151936": (0.8, False),
              "ppo_actor_loss fwd+bwd / logprobs fwd+bwd": (0.7, True),
              "linear_ppo_actor_loss fwd+bwd / 3 bare matmuls": (1.2, False),
              "linear_ppo_actor_loss fwd+bwd extra peak (GiB)": (0.5, True),
              "gae speed-up over the Python loop over T": (1500.0, True)}
    for name, (value, met) in expect.items():
        assert got[name]["value"] == pytest.approx(value), name
        assert got[name]["met"] is met and got[name]["at_target"], name
    for name in ("gae speed-up over verl compute_gae_advantage_return", "logprobs fwd / read probe, V=50257"):
        assert got[name]["met"] is None, name  # verl not measured; V=50257 row absent (another V stands in)
    assert all(t["met"] is None for t in bench.targets(rows, probes, "cpu"))


def test_every_target_is_measured_by_the_targets_and_full_sets():
    for name in ("targets", "full"):
        measured = {(c.op, tuple(c.dims.items()), c.dtype_name, p) for c in bench.cases(name) for p in c.passes}
        for t in bench.TARGETS:
            assert (t.op, tuple(t.dims.items()), t.dtype, t.pass_) in measured, (name, t.name)
            assert t.provider in bench.providers_of(t.op) and t.pass_ in bench.passes_of(t.op, t.provider, bench.PASSES)
    needed = {("linear_logprobs", "matmuls"), ("linear_ppo_actor_loss", "matmuls"), ("gae", "torch"), ("gae", "verl"),
              ("logprobs", "fastrlhf")}
    assert all(p in bench.providers_of(op) for op, p in needed)
    for name in bench.CASE_SETS:  # every op in every set, but the sets of one op, named after it
        assert {c.op for c in bench.cases(name)} == ({name} if name in OP_SETS else set(bench.OPS)), name
    assert set(OP_SETS) <= set(bench.CASE_SETS) & set(bench.OPS)


def test_min_reps_for_long_calls():
    calls = []
    settings = bench.Settings(torch.device("cpu"), rep_ms=1.0, rotate_bytes=0, min_reps=5)
    timing = bench.time_fn(lambda: (calls.append(1), time.sleep(0.01)), settings)
    assert timing.reps == 5 and len(calls) == 1 + 5  # one estimating call, then min_reps timed ones
    assert timing.median_ms >= 10
    assert measure.n_reps(200.0, settings) == 5  # a 0.2 s call with a 1 ms budget: still min_reps
    assert measure.n_reps(0.001, settings) == measure.MAX_REPS
    assert measure.n_reps(0.1, bench.Settings(torch.device("cpu"), 100.0, 0, 10)) == 1000


def test_every_provider_gets_fresh_identical_inputs(monkeypatch):
    """A provider that writes into its inputs (as Liger writes d(logits) into the logits) must not
    change what the next provider sees."""
    seen = {}

    def spy(name, mutate):
        def load(pass_):
            def fn(logits, labels):
                seen.setdefault(name, logits.detach().double().sum().item())
                if mutate:
                    logits.data.zero_()
                return torch.zeros(labels.shape)

            return fn

        return load

    monkeypatch.setitem(providers.TABLE, "logprobs", {"fastrlhf": spy("fastrlhf", True), "torch": spy("torch", False)})
    case = bench.Case("logprobs", {"B": 2, "T": 4, "V": 64}, torch.float32, ("fwd",))
    settings = bench.Settings(torch.device("cpu"), rep_ms=0.0, rotate_bytes=0, min_reps=1)
    out = run.bench([case], ["fastrlhf", "torch"], settings, {"read_gbps": 1.0, "copy_gbps": 1.0})
    assert [r["provider"] for r in out.rows] == ["fastrlhf", "torch"]
    assert seen["torch"] == seen["fastrlhf"] != 0.0
    a, b = bench.make_pool(case, settings), bench.make_pool(case, settings)
    assert torch.equal(a[0]["logits"], b[0]["logits"]) and a[0]["logits"].data_ptr() != b[0]["logits"].data_ptr()


@triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=2, num_stages=2)], key=["n"])
@triton.jit
def _tuned_fill_kernel(out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, 1.0, mask=offs < n)


def test_rows_record_the_autotuned_configs(monkeypatch):
    """Each row names the config every `triton.autotune` kernel of its provider chose (here one that
    runs in the interpreter; on CUDA the log-prob and actor-loss kernels), and the bench leaves
    triton's Autotuner as it found it."""
    from triton.runtime.autotuner import Autotuner

    def load(pass_):
        def fn(logits, labels):
            out = torch.empty(labels.numel(), device=labels.device)
            _tuned_fill_kernel[lambda meta: (triton.cdiv(out.numel(), meta["BLOCK"]),)](out, out.numel())
            return out

        return fn

    monkeypatch.setitem(providers.TABLE, "logprobs", {"fastrlhf": load, "torch": providers.TABLE["logprobs"]["torch"]})
    case = bench.Case("logprobs", {"B": 2, "T": 4, "V": 64}, torch.float32, ("fwd",))
    settings = bench.Settings(torch.device(DEVICE), rep_ms=0.0, rotate_bytes=0, min_reps=1)
    run_before = Autotuner.run
    out = run.bench([case], ["fastrlhf", "torch"], settings, {"read_gbps": 1.0, "copy_gbps": 1.0})
    assert Autotuner.run is run_before
    rows = {r["provider"]: r for r in out.rows}
    assert rows["fastrlhf"]["autotune"] == [{"kernel": f"{__name__}._tuned_fill_kernel",
                                            "config": {"BLOCK": 16, "num_warps": 2, "num_stages": 2}}]
    assert rows["torch"]["autotune"] == []


def test_time_budget_and_compile_last(monkeypatch):
    selected = bench.cases("tiny")
    items = run.work_items(selected, list(bench.PROVIDERS))
    first_compile = next(i for i, (_, p) in enumerate(items) if p == "torch.compile")
    assert all(p == "torch.compile" for _, p in items[first_compile:])
    assert {c.op for c, p in items if p == "torch.compile"} == set(bench.OPS)  # gae's is skipped with its reason
    settings = bench.Settings(torch.device("cpu"), rep_ms=0.0, rotate_bytes=0, min_reps=1)
    checkpoints = []
    out = run.bench(selected[:2], ["fastrlhf"], settings, {"read_gbps": 1.0, "copy_gbps": 1.0}, budget_s=1e-9,
                    after_each=checkpoints.append)
    assert out.rows == [] and len(checkpoints) == len(run.work_items(selected[:2], ["fastrlhf"]))
    assert out.skipped and all("time budget" in s["reason"] for s in out.skipped)


def test_peak_memory_is_none_off_cuda():
    assert measure.peak_memory(lambda: None, torch.device("cpu")) == (None, None)


@pytest.mark.gpu
def test_extra_peak_excludes_inputs_and_returned_gradients():
    """On CUDA: a provider that allocates nothing beyond its gradients has ~0 extra peak."""
    device = torch.device("cuda")
    w = torch.randn(1024, 1024, device=device, requires_grad=True)

    def step():
        (w * 2).sum().backward()  # the product (4 MiB) is the only extra allocation

    peak, grad_bytes = measure.peak_memory(step, device, [w])
    assert grad_bytes == w.nbytes
    assert peak >= grad_bytes and peak - grad_bytes <= w.nbytes + 2**20


# ---------------------------------------------------------------- environment


def test_kernels_tree_hash_matches_git():
    if shutil.which("git") is None or environment.git("rev-parse", "HEAD") is None:
        pytest.skip("not a git checkout")
    if environment.git("status", "--porcelain", "--", "fastrlhf/kernels"):
        pytest.skip("fastrlhf/kernels/ has uncommitted changes")
    rev = environment.revision()
    assert rev["kernels_tree"] == subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD:fastrlhf/kernels"],
                                                 capture_output=True, text=True).stdout.strip()
    assert rev["kernels_tree_files"] == rev["kernels_tree"]


def test_nominal_bandwidth_from_clock_and_bus_width(monkeypatch):
    h100 = types.SimpleNamespace(memory_clock_rate=2_619_000, memory_bus_width=5120)  # kHz, bits
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h100)
    got = environment.nominal_bandwidth(torch.device("cuda"), None)
    assert got["gbps"] == pytest.approx(2 * 2.619e9 * 5120 / 8 / 1e9)  # 3352 GB/s, the H100 SXM datasheet figure
    no_clock = types.SimpleNamespace(memory_clock_rate=0, memory_bus_width=5120)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: no_clock)
    got = environment.nominal_bandwidth(torch.device("cuda"), {"clocks.max.mem": 2619.0})
    assert got["gbps"] == pytest.approx(3352.32) and "nvidia-smi" in got["source"]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace())
    assert environment.nominal_bandwidth(torch.device("cuda"), None)["gbps"] is None


# ---------------------------------------------------------------- README table and CLI errors


def test_readme_table_picks_the_latest_gpu_bench_record(tmp_path, record):
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "bench" / "README_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _, result, _ = record
    for name, kind, date in [("a.json", "cuda", "2026-01-01"), ("b.json", "cuda", "2026-02-01"),
                             ("c.json", "cpu", "2026-03-01")]:
        (tmp_path / name).write_text(json.dumps(dict(result, kind=kind, date=date)))
    (tmp_path / "linear_memory_cpu.json").write_text(json.dumps({"device": "cpu", "results": []}))  # not a bench record
    assert module.latest(tmp_path).name == "b.json"
    assert module.main([str(tmp_path / "b.json")]) == 0


def test_bad_arguments():
    with pytest.raises(SystemExit) as exc:
        bench.main(["--ops", "logprobs,nope"])
    assert exc.value.code == 2
    with pytest.raises(ValueError, match="--min-reps"):
        bench.main(["--device", "cpu", "--min-reps", "0"])
    with pytest.raises(ValueError, match="case set"):
        bench.cases("huge")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device"):
            bench.main(["--device", "cuda", "--ops", "gae"])


def test_liger_is_pinned_alike_and_imports_on_cpu():
    """Liger's wheel for the GPU machine (bench/gpu_wheels.sh) is the version CI installs (.ci/install_peers.sh);
    installed, its provider's module imports on CPU and the provider is skipped only for needing CUDA."""
    import re

    pins = [re.findall(r"liger-kernel==([\w.]+)", (ROOT / path).read_text())
            for path in ("bench/gpu_wheels.sh", ".ci/install_peers.sh")]
    assert pins[0] and pins[0] == pins[1], pins
    if importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel not installed (.ci/install_peers.sh installs it)")
    from importlib.metadata import version

    assert version("liger-kernel") == pins[0][0]
    module = __import__(providers._LIGER_F, fromlist=["liger_cross_entropy"])
    assert callable(module.liger_cross_entropy) and callable(module.liger_fused_linear_cross_entropy)
    with pytest.raises(bench.Skip, match="needs CUDA"):
        bench.load_provider("logprobs", "liger", "fwd", torch.device("cpu"))
