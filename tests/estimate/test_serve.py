"""`fastrlhf estimate --stage serve`: memory, latency, throughput, GPUs for a rate and the price of serving the
policy (fastrlhf.estimate.serve). Its calibration on published vLLM measurements is in test_time.py."""

import json
import math

import pytest

from fastrlhf import estimate as est
from fastrlhf.estimate import serve, timing

GB = 1e9
BASE = dict(stage="serve", model="llama-3.1-8b", gpu="h100", seq_len=1024, gen_len=256)


def _serve(**kw) -> dict:
    return est.estimate(**{**BASE, **kw})["stages"]["serve"]


@pytest.mark.parametrize("weights,bytes_per_param", [("bf16", 2), ("fp8", 1), ("int8", 1), ("int4", 0.5 + 2 / 128)])
@pytest.mark.parametrize("tp", [1, 2])
def test_weights_per_gpu_follow_precision_and_tensor_parallelism(weights, bytes_per_param, tp):
    r = _serve(serve_weights=weights, gen_tp=tp)
    params = est.PRESETS["llama-3.1-8b"].params()
    assert r["memory_per_gpu_bytes"]["weights"] == int(params * bytes_per_param / tp)
    assert r["weights_precision"] == weights and r["gpus_per_replica"] == tp


def test_kv_cache_per_request_and_the_concurrency_that_fits():
    """Llama-3.1-8B: 32 layers x 8 KV heads x 128 x (K and V) x 2 bytes = 128 KiB per token; 1280 tokens per request.
    What fits is what 0.9 of the GPU leaves after the weights and a prefill chunk, at most max_num_seqs."""
    r = _serve(gpu="a100-40g")
    assert r["kv_bytes_per_sequence"] == 32 * 8 * 128 * 2 * 2 * 1280
    e = serve.Engine(est.PRESETS["llama-3.1-8b"], est.device("a100-40g"), 1, "bf16", 1024, 256)
    budget = 0.9 * est.device("a100-40g").memory_bytes - e.weight_bytes - e.activations()
    assert r["max_concurrency"] == min(timing.VLLM_MAX_NUM_SEQS, math.floor(budget / r["kv_bytes_per_sequence"]))
    assert r["max_concurrency"] < timing.VLLM_MAX_NUM_SEQS  # 40 GB holds fewer than 256 such requests
    assert _serve(gpu="h200")["max_concurrency"] == timing.VLLM_MAX_NUM_SEQS


def test_latency_and_throughput_with_concurrency():
    one, many = _serve(concurrency=1), _serve(concurrency=64)
    assert many["tpot_s"] > one["tpot_s"] and many["tokens_per_s_per_replica"] > 20 * one["tokens_per_s_per_replica"]
    assert one["ttft_s"] < one["tpot_s"] * 20  # one prompt's prefill, not a queue
    assert one["tokens_per_s_per_replica"] == pytest.approx(1 / one["tpot_s"])
    lo, hi = one["tpot_range_s"]
    assert lo <= one["tpot_s"] <= hi


def test_a_decode_step_at_one_request_reads_the_weights():
    """At one request a step streams the weights: int4 weights cut the step, fp8 compute cannot help it."""
    bf16, int4 = _serve(concurrency=1), _serve(concurrency=1, serve_weights="int4")
    assert int4["tpot_s"] < 0.5 * bf16["tpot_s"]
    params = est.PRESETS["llama-3.1-8b"].params()
    floor = params * 2 / est.device("h100").bandwidth  # every weight read once at full bandwidth
    assert floor < bf16["tpot_s"] < 2 * floor


def test_fp8_computes_in_fp8_where_the_gpu_has_it():
    """fp8 is W8A8 on fp8 tensor cores (H100: twice the bf16 peak), weight-only on an A100."""
    h100, a100 = (serve.engine_of(est.Spec(**{**BASE, "gpu": g, "serve_weights": "fp8", "dtype": "bf16"}),
                                  est.PRESETS["llama-3.1-8b"]) for g in ("h100", "a100-80g"))
    assert h100.peak == est.device("h100").fp8_flops == pytest.approx(2 * est.device("h100").peak_flops, rel=1e-3)
    assert a100.peak == est.device("a100-80g").peak_flops


def test_gpus_for_a_request_rate_and_the_price():
    r = _serve(request_rate=40.0, price=2.0)
    assert r["replicas"] == math.ceil(40.0 / r["max_requests_per_s_per_replica"])
    assert r["gpus"] == r["replicas"] * r["gpus_per_replica"]
    # Little's law at the rate each replica gets: the requests in flight are rate x the time each one spends
    per_replica = 40.0 / r["replicas"]
    assert r["concurrency"] == pytest.approx(per_replica * (r["ttft_s"] + (256 - 1) * r["tpot_s"]), rel=0.02)
    assert r["usd_per_1m_output_tokens"] == pytest.approx(2.0 / 3600 / r["tokens_per_s_per_replica"] * 1e6)


def test_a_model_that_does_not_fit_says_so(capsys):
    r = _serve(model="llama-3.1-70b", gpu="a100-40g")
    assert not r["fits"] and r["max_concurrency"] <= 0
    assert _serve(model="llama-3.1-70b", gpu="a100-80g", gen_tp=4)["fits"]
    assert est.main(["--stage", "serve", "--model", "llama-3.1-70b", "--gpu", "a100-40g"]) == 0
    assert "does NOT fit" in capsys.readouterr().out


def test_cli_table_and_json(capsys):
    argv = ["--stage", "serve", "--model", "llama-3.1-8b", "--gpu", "h100", "--request-rate", "20", "--price", "2.5"]
    assert est.main(argv) == 0
    out = capsys.readouterr().out
    for text in ("time to first token", "time per output token", "output tokens/s", "replica(s)",
                 "per 1M output tokens"):
        assert text in out, text
    assert est.main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["stages"]["serve"]
    assert {"ttft_s", "tpot_s", "tokens_per_s_per_replica", "gpus", "usd_per_1m_output_tokens"} <= set(r)
