"""The planner against published RLHF runs and this trainer's recorded runs (fastrlhf.estimate.calibrate).

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
from fastrlhf.estimate.compare import RunRecord, compare, read_run


@pytest.fixture(scope="module")
def published():
    return {p["id"]: p for p in calibrate.check_published()}


def test_committed_coefficients_are_what_the_fit_gives():
    """data/efficiency.json is the output of `calibrate --write` on the committed points, not hand-tuned."""
    tables = calibrate.fit_all()
    for kind in ("gpu", "cpu"):
        fitted = tables[kind]
        committed = timing.coefficients(kind)
        for feature in fitted:
            assert fitted[feature]["value"] == pytest.approx(committed[feature]["value"], rel=1e-6, abs=1e-15), \
                (kind, feature)
            assert fitted[feature]["range"] == pytest.approx(committed[feature]["range"], rel=1e-6, abs=1e-15)


def test_every_published_point_within_its_band(published):
    for result in published.values():
        if result["within_band"] is None:  # validation set without a band (DeepSpeed-Chat's Table 1)
            continue
        assert result["within_band"], json.dumps(result, indent=1, default=float)


def test_deepspeed_chat_1_3b_generation_share(published):
    """Issue 15's acceptance: the generation share of step time predicted for DeepSpeed-Chat's 1.3B run
    within 0.1 of its published split (the step-3 log: 'Generate time ... (66%)', medians of 466 steps;
    and the blog's Figure 5 on 8 x A100-40G, digitised, 0.53)."""
    log = published["dschat-log-opt1.3b-v100x16"]
    assert abs(log["predicted"]["generate_share"] - log["published"]["generate_share"]) <= 0.1
    fig5 = published["dschat-blog-fig5-opt1.3b-a100-40gx8"]
    assert abs(fig5["predicted"] - fig5["published"]) <= 0.1


def test_deepspeed_chat_phases_and_training_efficiency(published):
    log = published["dschat-log-opt1.3b-v100x16"]
    for key in ("generate_s", "training_s", "others_s", "e2e_s"):
        assert abs(log["predicted"][key] / log["published"][key] - 1) <= 0.15, key
    fig6 = published["dschat-blog-fig6-train-tflops"]
    assert len(fig6["rows"]) == 5 and all(abs(r["ratio"] - 1) <= 0.35 for r in fig6["rows"])


def test_minimum_gpus_for_llama2_7b(published):
    rows = {r["case"]: r for r in published["dschat-blog-8-31-fig4-min-gpus-llama2-7b"]["rows"]}
    assert rows["ZeRO-3"]["predicted"] == 16  # DeepSpeed-Chat: 16 V100-32G for Llama-2-7B ZeRO-3
    assert rows["ZeRO-3 + ZeRO-Offload"]["predicted"] == 1
    assert rows["ZeRO-3 + LoRA"]["predicted"] in (2, 4, 8)


def test_recorded_cpu_runs_within_30_percent():
    """Issue 15's acceptance: on this trainer's own CPU runs, predicted phase times within 30% of measured."""
    runs = [r for r in calibrate.check_runs() if not r["id"].startswith("h100_")]
    assert len(runs) >= 5
    for run in runs:
        assert run["measured"] == "cpu"  # process CPU seconds per phase (record --cpu-time)
        judged = {phase: r for phase, r in run["phases"].items() if r["judged"]}
        assert {"rollout", "logprobs", "update"} <= set(judged)
        for phase, r in judged.items():
            assert abs(r["ratio"] - 1) <= 0.30, (run["id"], phase, r)


def test_recorded_h100_runs_within_30_percent():
    """Issue 15's acceptance on a GPU: the 0.5B PPO run on an H100 (qwen2-0.5b, LoRA r16, 64 x 256 tokens),
    with HF's dynamic KV cache and with the static one (data/recorded/, from bench/results/2026-11-23-h100-ppo-*.json):
    every phase over 0.5% of the step within 30% of its measured wall time. The GPU host coefficients are
    fitted to these two runs (in-sample): this checks the fit and the cache switch, not a held-out GPU run."""
    from fastrlhf.estimate.compare import spec_from_run
    from fastrlhf.estimate.plan import host_engine

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

    from fastrlhf.task import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    for stage in ("sft", "rm"):
        LlamaForCausalLM(config).save_pretrained(tmp_path / stage / "final")
        tokenizer.save_pretrained(tmp_path / stage / "final")
    from fastrlhf.config import PipelineConfig, to_dict

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


def test_compare_run_errors(tmp_path, capsys):
    assert est.main(["--compare-run", str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_a_gpu_record_joins_the_gpu_calibration(tmp_path):
    """The path a GPU run takes (`python -m fastrlhf.estimate.record ... -- fastrlhf ppo --model qwen2-0.5b ...`
    on CUDA): its record names the GPU, the planner predicts it on that GPU in the trainer's CUDA precision,
    and its phases become rows of the gpu fit (hf decoding, which no published point constrains)."""
    from fastrlhf.estimate.compare import spec_from_run

    cpu = json.loads((calibrate.RESULTS / "cpu_pipeline_tiny.json").read_text())
    record = dict(cpu, device="cuda:0", device_name="NVIDIA H100 80GB HBM3", reward_config=None,
                  machine=dict(cpu["machine"], omp_num_threads=None))
    (tmp_path / "gpu_ppo_test.json").write_text(json.dumps(record))
    spec = spec_from_run(RunRecord.from_json(record))
    assert (spec.gpu, spec.dtype, spec.lora_rank, spec.reward) == ("h100", "bf16", 16, "rule")
    rows = [r for r in calibrate.calibration_rows("gpu", tmp_path) if r[0].startswith("gpu_ppo_test")]
    assert {label.split(":")[1] for label, _, _ in rows} == set(est.PPO_PHASES)
    rollout = next(w for label, w, _ in rows if label.endswith("rollout"))
    # a record without rollout_cache: the trainer's default, the dynamic cache (hf's host overhead)
    assert rollout["decode:hf"] > 0 and rollout["calls:hf"] > 0 and not rollout["calls:hf-static"]
    for cache in ("static", "auto"):  # auto: static on one CUDA process, as the trainer
        record["config"] = dict(record["config"], rollout_cache=cache)
        (tmp_path / "gpu_ppo_test.json").write_text(json.dumps(record))
        rows = [r for r in calibrate.calibration_rows("gpu", tmp_path) if r[0] == "gpu_ppo_test:rollout"]
        assert rows[0][1]["calls:hf-static"] > 0 and not rows[0][1]["calls:hf"], cache


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
