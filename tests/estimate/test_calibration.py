"""The planner against published RLHF runs and this trainer's recorded runs (fastrlhf.estimate.calibrate): the checks
that fit nothing, the recorded runs, the held-out benchmark, `--compare-run` and run records. The fit and its
leave-one-source-out cross-validation are tested in test_time.py.

Published points (DeepSpeed-Chat): fastrlhf/estimate/data/points_deepspeed_chat.json, each with its
source, setup and band. Recorded runs: bench/results/cpu_*.json (`python -m fastrlhf.estimate.record`) and
fastrlhf/estimate/data/recorded/h100_*.json (`record --from-steps` of bench/results/2026-11-23-h100-ppo-*.json).
OpenRLHF's benchmark is held out: never fitted, only reported (and its runs, which completed, must be
judged to fit).
"""

import json

import pytest

from fastrlhf import estimate as est
from fastrlhf.estimate import calibrate, timing
from fastrlhf.estimate.compare import RunRecord, compare, read_run, spec_from_run


@pytest.fixture(scope="module")
def checks():
    return {p["id"]: p for p in calibrate.check_published()}


def test_published_checks_within_their_bands(checks):
    """The DeepSpeed-Chat checks that fit nothing: the step-3 log's peak memory within 25%, the Llama-2 blog's
    minimum V100 counts within a factor 2 (Figure 5's generation share: test_figure_5_generation_share)."""
    assert checks["dschat-log-opt1.3b-v100x16-memory"]["within_band"], checks["dschat-log-opt1.3b-v100x16-memory"]
    rows = {r["case"]: r for r in checks["dschat-blog-8-31-fig4-min-gpus-llama2-7b"]["rows"]}
    assert all(r["within_band"] for r in rows.values()), rows
    assert rows["ZeRO-3"]["predicted"] == 16 and rows["ZeRO-3 + ZeRO-Offload"]["predicted"] == 1


@pytest.mark.xfail(strict=True, reason="DeepSpeed-Chat's blog Figure 5 (digitised 0.53) is predicted at 0.70: the "
                   "batch per GPU is not published; at the benchmark rule's 8 per A100-40G the hybrid engine's "
                   "decode (HF generate's loop over DeepSpeed-Inference layers, no CUDA graph on that path) is "
                   "host-bound, 9 ms a step; the figure's proportions match about 16 per GPU, which the planner "
                   "judges not to fit 40 GB (docs/planner.md)")
def test_figure_5_generation_share(checks):
    fig5 = checks["dschat-blog-fig5-opt1.3b-a100-40gx8"]
    assert abs(fig5["predicted"] - fig5["published"]) <= 0.1, fig5


def test_every_deepspeed_chat_table_1_run_is_judged_to_fit(checks):
    """Every row of DeepSpeed-Chat's README Table 1 completed on its hardware: none may be judged not to fit."""
    rows = checks["dschat-readme-table1-step3-e2e"]["rows"]
    assert len(rows) == 22 and all(r.get("predicted_s") for r in rows), [r for r in rows if not r.get("predicted_s")]


def test_recorded_h100_runs_in_sample():
    """The 0.5B PPO run on an H100 (qwen2-0.5b, LoRA r16, 64 x 256 tokens) with HF's dynamic KV cache and with the
    static one: every phase over 0.5% of the step within 30% of its measured wall time with the committed factors
    (the out-of-sample check is the leave-one-source-out test, test_time.py)."""
    from fastrlhf.estimate.compare import spec_from_run
    from fastrlhf.estimate.phases import host_engine

    runs = {r["id"]: r for r in calibrate.check_runs() if r["id"].startswith("h100_")}
    assert set(runs) == {"h100_ppo_qwen2-0.5b_dynamic", "h100_ppo_qwen2-0.5b_static"}
    for run in runs.values():
        assert run["measured"] == "time"
        judged = {phase: r for phase, r in run["phases"].items() if r["judged"]}
        assert set(judged) == {"rollout", "logprobs", "update"}
        for phase, r in judged.items():
            assert abs(r["ratio"] - 1) <= 0.30, (run["id"], phase, r)
    records = {name: rec for name, rec, _ in calibrate.run_records() if name in runs}
    engines = {name: host_engine(spec_from_run(rec)) for name, rec in records.items()}
    assert engines == {"h100_ppo_qwen2-0.5b_dynamic": "hf", "h100_ppo_qwen2-0.5b_static": "hf-static"}
    dynamic = runs["h100_ppo_qwen2-0.5b_dynamic"]["phases"]["rollout"]
    static = runs["h100_ppo_qwen2-0.5b_static"]["phases"]["rollout"]
    assert dynamic["measured_seconds"] > 5 * static["measured_seconds"]  # 13.4 s vs 2.1 s measured
    assert dynamic["predicted_seconds"] > 5 * static["predicted_seconds"]


def test_heldout_openrlhf_runs_are_judged_to_fit():
    """OpenRLHF's benchmark is never fitted; its runs completed, so the planner must judge them to fit."""
    rows = calibrate.check_heldout()
    assert len(rows) == 8
    for r in rows:
        assert r["fits"], r
        assert r["range_s"][0] <= r["predicted_s"] <= r["range_s"][1]


# --- --compare-run on a run directory -------------------------------------------------------------


def _fake_run(tmp_path):
    """A fastrlhf pipeline run directory as the trainer writes it: config.json, metrics.jsonl, summary.json,
    and the SFT policy and reward model it used (tiny, random)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastrlhf.train.task import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    for stage in ("sft", "rm"):
        LlamaForCausalLM(config).save_pretrained(tmp_path / stage / "final")
        tokenizer.save_pretrained(tmp_path / stage / "final")
    from fastrlhf.train.config import PipelineConfig, to_dict

    (tmp_path / "config.json").write_text(json.dumps(to_dict(PipelineConfig())))
    ppo = {"device": "cpu", "max_prompt_len": 32, "max_new_tokens": 16}  # the lengths as the stage resolved them
    (tmp_path / "summary.json").write_text(json.dumps({"ppo": ppo}))
    rows = []
    for step in range(1, 5):
        row = {"stage": "ppo", "step": step, "response_length": 9.0}
        for i, phase in enumerate(est.PPO_PHASES):
            row[f"time/{phase}"] = 0.01 * (i + 1) * (2 if step == 1 else 1)  # the first iteration warms up
            row[f"memory/{phase}"] = 5e8
        rows.append(row)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_compare_run_reads_the_trainers_rows(tmp_path, capsys):
    out = _fake_run(tmp_path)
    record = read_run(out)
    assert record.prompt_len == 8  # 3-6 letters, a colon and <bos>, left-padded to the longest
    assert record.phase_seconds() == pytest.approx({ph: 0.01 * (i + 1) for i, ph in enumerate(est.PPO_PHASES)})
    assert RunRecord.from_json(json.loads(json.dumps(record.to_json()))).phase_seconds() == record.phase_seconds()
    result = compare(record)
    assert set(result["phases"]) == set(est.PPO_PHASES)
    assert result["phases"]["update"]["measured_seconds"] == pytest.approx(0.05)
    assert est.main(["--compare-run", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pred/med" in text and "update" in text and "planner device cpu" in text
    assert est.main(["--compare-run", str(out), "--seq-len", "16", "--json"]) == 0  # given flags override the run's
    over = json.loads(capsys.readouterr().out)
    assert over["phases"]["update"]["predicted_seconds"] > result["phases"]["update"]["predicted_seconds"]


def test_compare_run_takes_the_logged_response_width(tmp_path):
    """generate stops at the batch's longest response and phases 2, 3 and 5 run over prompt + its columns:
    the Spec takes the rows' mean `response_width` as gen_len, max_new_tokens where no row has it."""
    record = read_run(_fake_run(tmp_path))
    assert record.mean_response_width() is None
    assert spec_from_run(record).gen_len == 16 and spec_from_run(record).mean_gen_len == 9
    for row, width in zip(record.rows, (12, 11, 12, 13)):
        row["response_width"] = width
    assert record.mean_response_width() == 12.0
    spec = spec_from_run(record)
    assert spec.gen_len == 12 and spec.mean_gen_len == 9 and spec.seq_len == 8
    assert RunRecord.from_json(json.loads(json.dumps(record.to_json()))).mean_response_width() == 12.0
    narrower = compare(record)["phases"]
    wider = compare(read_run(tmp_path))["phases"]
    for phase in ("rollout", "logprobs", "update"):
        assert narrower[phase]["predicted_seconds"] < wider[phase]["predicted_seconds"], phase


def test_compare_run_reads_how_phase_3_ran(tmp_path):
    """A critic-free run is the planner's grpo stage (G samples per prompt, rollout_batch_size / G prompts), with
    the run's --old_logprobs and whether its KL sits in the loss (or is off), which decide the forwards of phase 3."""
    record = read_run(_fake_run(tmp_path))
    spec = spec_from_run(record)
    assert (spec.stage, spec.num_generations, spec.old_logprobs, spec.kl_in_loss) == ("ppo", 1, "recompute", False)
    record.config.update(advantage="grpo", num_generations=4, kl_coef=0.0, old_logprobs="sampler")
    spec = spec_from_run(record)
    assert (spec.stage, spec.num_generations, spec.old_logprobs, spec.kl_in_loss) == ("grpo", 4, "sampler", True)
    assert spec.rollout_batch * spec.num_generations == record.config["rollout_batch_size"]
    assert set(compare(record)["phases"]) == set(est.PPO_PHASES)


def test_compare_run_errors(tmp_path, capsys):
    assert est.main(["--compare-run", str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_a_gpu_record_joins_the_gpu_calibration(tmp_path):
    """The path a GPU run takes (`python -m fastrlhf.estimate.record ... -- fastrlhf ppo --model qwen2-0.5b ...`
    on CUDA): its record names the GPU, the planner predicts it on that GPU in the trainer's CUDA precision, and its
    phases become rows of the gpu fit, with the code path of its KV cache: eager decoding launches every op from the
    host, the static cache's compiled step replays its kernels from a CUDA graph."""
    from fastrlhf.estimate.compare import spec_from_run

    cpu = json.loads((calibrate.RESULTS / "cpu_pipeline_tiny.json").read_text())
    record = dict(cpu, device="cuda:0", device_name="NVIDIA H100 80GB HBM3", reward_config=None,
                  machine=dict(cpu["machine"], omp_num_threads=None))
    (tmp_path / "gpu_ppo_test.json").write_text(json.dumps(record))
    spec = spec_from_run(RunRecord.from_json(record))
    assert (spec.gpu, spec.dtype, spec.lora_rank, spec.reward) == ("h100", "bf16", 16, "rule")
    rows = [r for r in calibrate.record_rows("gpu", tmp_path) if r.label.startswith("gpu_ppo_test")]
    assert {r.source for r in rows} == {"fastrlhf-gpu-runs"}
    assert {"rollout", "logprobs", "update"} <= {r.label.split(":")[1] for r in rows}

    def decode_step(rows_):
        work = next(r for r in rows_ if r.label.endswith(":rollout")).parts[0][0]
        return max(work.steps, key=lambda s: s.count)  # the decode step (prefill runs once per call)

    eager = decode_step(rows)  # a record without rollout_cache: the trainer's default, the dynamic cache
    assert eager.ops == eager.kernels > 0
    for cache in ("static", "auto"):  # auto: static on one CUDA process, as the trainer
        record["config"] = dict(record["config"], rollout_cache=cache)
        (tmp_path / "gpu_ppo_test.json").write_text(json.dumps(record))
        graph = decode_step(calibrate.record_rows("gpu", tmp_path))
        # outside the graph only generate's own loop (sampling, stopping, the mask) and one graph replay
        assert graph.ops == timing.HF_STEP_OPS + 1 < eager.ops and graph.kernels > graph.ops, cache


def test_record_from_steps_keeps_the_steady_state_steps(tmp_path):
    """`record --from-steps`: a bench/results PPO run in step format -> a record; steps outside
    steady_state_steps (compilation, warm-up) go to warmup_rows, not into the medians."""
    from fastrlhf.estimate import record as rec_mod

    source = calibrate.RESULTS / "2026-11-23-h100-ppo-dynamic.json"
    data = json.loads(source.read_text())
    with pytest.raises(ValueError, match="rollout_cache"):
        rec_mod.from_steps(data, source=str(source), device_name="NVIDIA H100 80GB HBM3")
    out = rec_mod.from_steps(data, source=str(source), device_name="NVIDIA H100 80GB HBM3", rollout_cache="dynamic")
    assert [r["step"] for r in out["rows"]] == data["steady_state_steps"] == [2]
    assert [r["step"] for r in out["warmup_rows"]] == [1]
    assert out["median_phase_seconds"]["rollout"] == pytest.approx(data["steady_state_mean"]["rollout_s"])
    assert out["config"]["rollout_cache"] == "dynamic" and out["source"] == str(source)
    committed = json.loads((calibrate.DATA / "recorded" / "h100_ppo_qwen2-0.5b_dynamic.json").read_text())
    assert committed["median_phase_seconds"] == out["median_phase_seconds"]


def test_a_cpu_record_keeps_the_faster_round_and_the_probe_its_best_rates(tmp_path):
    """bench/record_cpu.sh on a machine whose speed drifts: `record --keep-faster` keeps the round whose medians
    sum to less and lists every round; `calibrate.merged_probes` takes the best matmul and copy rates of the
    probes and the mean of their latencies."""
    from fastrlhf.estimate.record import faster

    def record(scale: float, when: str) -> dict:
        rows = [{"step": s, **{f"cpu/{ph}": scale * (i + 1) for i, ph in enumerate(est.PPO_PHASES)},
                 **{f"time/{ph}": 2 * scale for ph in est.PPO_PHASES}} for s in range(1, 5)]
        return {"command": "fastrlhf ppo --out x", "recorded": when, "machine": {"cpu": "C", "load_avg_before": [1]},
                "out": "x", "config": {}, "device": "cpu", "prompt_len": 8, "rows": rows, "model_config": {}}

    path = tmp_path / "r.json"
    first = faster(record(1.5, "t1"), path)
    assert [r["recorded"] for r in first["rounds"]] == ["t1"] and first["rounds"][0]["key"] == "cpu"
    path.write_text(json.dumps(first))
    kept = faster(record(1.0, "t2"), path)
    assert kept["recorded"] == "t2" and [r["total"] for r in kept["rounds"]] == [1.5 * 15, 15.0]
    path.write_text(json.dumps(kept))
    assert faster(record(1.2, "t3"), path)["recorded"] == "t2"
    other = dict(record(1.0, "t4"), command="fastrlhf ppo --out y")
    with pytest.raises(SystemExit, match="another command"):
        faster(other, path)

    probes = [{"peak_flops": 74e9, "bandwidth": 27e9, "op_latency": 2.0e-6, "bare_op_latency": 3.0e-6},
              {"peak_flops": 93e9, "bandwidth": 26e9, "op_latency": 1.2e-6, "bare_op_latency": 2.0e-6}]
    merged = calibrate.merged_probes({"name": "C", "probes": probes})
    assert (merged["peak_flops_1_thread"], merged["bandwidth"]) == (93e9, 27e9)
    assert merged["op_latency_1_thread"] == pytest.approx(1.6e-6)
    assert merged["bare_op_latency_1_thread"] == pytest.approx(2.5e-6)
