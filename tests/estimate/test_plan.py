"""`fastrlhf estimate` against published measurements, exact CPU state bytes, its inputs, and bad input.

Published figures are decimal GB (1e9 bytes), as the sources print them
(`torch.cuda.max_memory_allocated() / 1e9` in LitGPT, `... / 1e9` in torchtune's memory stats).
The calibration against DeepSpeed-Chat and this trainer's recorded runs is in test_calibration.py.
"""

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch

from fastrlhf import estimate as est
from fastrlhf.estimate import plan, timing

GB = 1e9


def _rel(predicted: float, published: float) -> float:
    return (predicted - published) / published


def _sft(**kw) -> dict:
    return est.estimate(**{"stage": "sft", "gen_len": 0, **kw})["stages"]["sft"]


def _sft_peak(**kw) -> int:
    return _sft(**kw)["memory_per_gpu_bytes"]["peak"]


def _ppo(**kw) -> dict:
    return est.estimate(stage="ppo", **kw)["stages"]["ppo"]


# --- architecture numbers ---------------------------------------------------------------------


@pytest.mark.parametrize("preset,config_cls,kwargs", [
    ("llama-2-7b", "LlamaConfig", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                       num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                                       tie_word_embeddings=False)),
    ("qwen2.5-0.5b", "Qwen2Config", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                         tie_word_embeddings=True)),
    ("opt-1.3b", "OPTConfig", dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                                   ffn_dim=8192, vocab_size=50272, max_position_embeddings=2048,
                                   word_embed_proj_dim=2048)),
    ("opt-350m", "OPTConfig", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                   ffn_dim=4096, vocab_size=50272, max_position_embeddings=2048,
                                   word_embed_proj_dim=512, do_layer_norm_before=False)),
])
def test_preset_param_count_matches_transformers(preset, config_cls, kwargs):
    import transformers

    config = getattr(transformers, config_cls)(**kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in model.parameters())  # tied weights counted once
    assert est.PRESETS[preset].params() == expected


def test_config_json_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                                "num_attention_heads": 32, "num_key_value_heads": 8,
                                "intermediate_size": 14336, "vocab_size": 128256,
                                "tie_word_embeddings": False}))
    assert est.resolve_model(str(path)).params() == est.PRESETS["llama-3-8b"].params() == 8_030_261_248


def test_training_preset_names_resolve_to_the_trainers_models():
    """`--model qwen2-0.5b` is `fastrlhf ppo --model qwen2-0.5b`: fastrlhf.train.models' config, not a copy."""
    from fastrlhf.train.models import BUILTIN_MODELS
    from fastrlhf.train.task import build_char_tokenizer

    for name in BUILTIN_MODELS:
        config = BUILTIN_MODELS[name](len(build_char_tokenizer()))
        with torch.device("meta"):
            import transformers

            model = transformers.AutoModelForCausalLM.from_config(config)
        assert est.resolve_model(name).params() == sum(p.numel() for p in model.parameters()), name
    out = est.estimate(model="qwen2-0.5b", stage="ppo", lora_rank=16)
    assert out["params_text"] == "494M"


def test_local_model_directory_reports_its_real_parameter_count(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True))
    model.save_pretrained(tmp_path)
    real = sum(p.numel() for p in model.parameters())
    assert est.resolve_model(str(tmp_path)).params() == real
    assert est.main(["--model", str(tmp_path), "--stage", "sft", "--gpu", "cpu"]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    assert f"{real / 1e3:.3g}K params" in title and "0.00B" not in title


@pytest.mark.parametrize("text,expected", [("7.5e9", 7_500_000_000), ("7.5B", 7_500_000_000), ("770M", 770_000_000),
                                           ("13b", 13_000_000_000), (7_000_000_000, 7_000_000_000), ("125k", 125_000)])
def test_parse_params(text, expected):
    assert est.parse_params(text) == expected


@pytest.mark.parametrize("bad", ["abc", "-1", "7.5X", "", True, 0])
def test_parse_params_rejects(bad):
    with pytest.raises((ValueError, TypeError), match="params"):
        est.parse_params(bad)


def test_params_rescales_everything_it_affects(capsys):
    """--params 13B on Llama-2-7B: 13e9 parameters exactly; weights, activations, KV cache and FLOPs
    grow with it, and the title names the count in use."""
    base = dict(model="llama-2-7b", micro_batch=2, rollout_batch=8, gpus=8, zero=3)
    small, big = _ppo(**base), _ppo(**base, params="13B")
    assert big["models"]["actor"]["params"] == 13_000_000_000
    for phase, component in (("update", "activations"), ("rollout", "kv_cache"), ("update", "optimizer")):
        s, b = (r["phases"][phase]["memory_per_gpu_bytes"][component] for r in (small, big))
        assert b > 1.2 * s, (phase, component)
    assert big["phases"]["update"]["flops"] > 1.7 * small["phases"]["update"]["flops"]
    assert est.main(["--model", "llama-2-7b", "--params", "7000000000", "--stage", "sft"]) == 0
    assert "7B params" in capsys.readouterr().out.splitlines()[0]


# --- published measurements (memory) ------------------------------------------------------------

# LitGPT tutorials/resource-tables.md ("Finetuning with LoRA on 1 GPU", commit 8641822, A100-SXM4-40GB,
# PyTorch 2.1, --precision bf16-true): Llama 2 7B, finetune/lora.py, 4,194,304 trainable parameters
# (r=8 on query and value), Alpaca whose longest example is 1304 Llama-2 tokens; the first iteration
# uses that longest example, so every micro-batch row is padded to 1304. Max GPU RAM: micro-batch 1
# 21.30 GB, micro-batch 2 29.07 GB. LitGPT runs SDPA (flash) without activation checkpointing and
# chunks lm_head + cross-entropy in bf16: bf16 logits and their bf16 gradient (--logits fused).
LITGPT = dict(model="llama-2-7b", lora_rank=8, lora_targets=("q", "v"), seq_len=1304, gpu="a100-40g", logits="fused")


@pytest.mark.parametrize("micro_batch,published_gb", [(1, 21.30), (2, 29.07)])
def test_litgpt_llama2_7b_lora(micro_batch, published_gb):
    predicted = _sft_peak(micro_batch=micro_batch, **LITGPT)
    assert abs(_rel(predicted, published_gb * GB)) <= 0.15, predicted / GB


# torchtune recipes/configs/llama2/7B_lora_single_device.yaml (v0.1): lora_attn_modules [q_proj, v_proj],
# rank 8, batch_size 2, dtype bf16, enable_activation_checkpointing True, alpaca_cleaned with the
# dataset's default max_seq_len=512, AdamW; the model returns fp32 logits (`self.output(h).float()`)
# and nn.CrossEntropyLoss runs on them, i.e. materialised fp32 logits (--logits materialised).
TORCHTUNE_LORA = dict(model="llama-2-7b", lora_rank=8, lora_targets=("q", "v"), micro_batch=2, seq_len=512,
                      gradient_checkpointing=True, logits="materialised")


def test_torchtune_llama2_7b_lora():
    """README (1 x RTX 4090, "Peak Memory per GPU"): 17.18 GB. The README does not say which counter
    that is; torchtune's QLoRA tutorial (docs/source/tutorials/qlora_finetune.rst) reports the same
    recipe and config at 15.57 GB *peak reserved* during training (13.98 GB at model init). We
    predict allocated memory: within 15% of the tutorial's 15.57 GB, and below the README's 17.18 GB
    (reserved memory and the un-stated counter make it an upper bound, not a target)."""
    predicted = _sft_peak(**TORCHTUNE_LORA)
    assert abs(_rel(predicted, 15.57 * GB)) <= 0.15, predicted / GB
    assert predicted < 17.18 * GB


def test_torchtune_llama2_7b_qlora():
    """Published 9.29 GB (qlora_finetune.rst table, LoRA q/k/v/o + MLP rank 8, NF4 base, batch 2,
    activation checkpointing) is *peak reserved* memory, and the same table shows 9.13 GB reserved at
    model init, before any batch exists: the figure is set by loading (bf16 weights staged on the GPU
    and quantised), which the caching allocator never returns, not by training. So we check that the
    training prediction is below the init-time figure, that NF4 cuts the weights to ~0.27x of bf16
    (4.5 of 16 bits on the ~96% of parameters in block linears), and that the saving vs LoRA exceeds
    the published saving (15.57 - 9.29 GB reserved), which includes that loading overhead."""
    qlora = _sft(model="llama-2-7b", lora_rank=8, qlora=True, micro_batch=2, seq_len=512,
                 gradient_checkpointing=True, logits="materialised")
    lora = _sft(**TORCHTUNE_LORA)
    q_mem, l_mem = qlora["memory_per_gpu_bytes"], lora["memory_per_gpu_bytes"]
    assert q_mem["peak"] < 9.13 * GB
    assert 0.26 < q_mem["weights"] / l_mem["weights"] < 0.32
    assert l_mem["peak"] - q_mem["peak"] > (15.57 - 9.29) * GB


# --- ZeRO: the paper's stage definitions, DeepSpeed's estimator, FSDP2 -------------------------


# ZeRO paper (Rajbhandari et al. 2020), Figure 1: model states per GPU of a 7.5B model on 64 GPUs with
# mixed-precision Adam (K = 12), as the figure prints them: baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB,
# P_os+g+p 1.9 GB.
ZERO_FIGURE_1_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_deepspeed_engine_reproduces_zero_paper_figure_1(zero):
    m = _sft(model="llama-2-7b", params="7.5B", engine="deepspeed", zero=zero, gpus=64)["models"]["actor"]
    states = m["weights"] + m["gradients"] + m["optimizer"]
    assert abs(_rel(states, ZERO_FIGURE_1_GB[zero] * GB)) <= 0.02, states / GB


@pytest.mark.parametrize("zero,gpus", [(0, 8), (1, 8), (2, 8), (2, 64), (3, 8), (3, 64)])
def test_deepspeed_engine_follows_the_zero_paper(zero, gpus):
    """ZeRO paper sec. 5 (K = 12): stage 1 divides the 12 optimizer bytes by N, stage 2 also the 2 gradient bytes,
    stage 3 also the 2 weight bytes. Everything else DeepSpeed holds is a buffer: the reduce bucket from stage 1
    on (5e8 elements, bf16), stage 3's two gathered layers and one layer's gradient before its reduce-scatter."""
    arch = est.PRESETS["llama-2-7b"]
    p = arch.params()
    paper = {0: 16 * p, 1: 4 * p + 12 * p / gpus, 2: 2 * p + 14 * p / gpus, 3: 16 * p / gpus}[zero]
    m = _sft(model="llama-2-7b", engine="deepspeed", zero=zero, gpus=gpus)["models"]["actor"]
    assert m["weights"] + m["gradients"] + m["optimizer"] == pytest.approx(paper, rel=1e-9)
    layer = plan.largest_layer(arch)  # Llama-2-7B: the embedding
    bucket = 2 * 500_000_000 if zero else 0
    assert m["buffers"] == pytest.approx(bucket + (3 * 2 * layer if zero == 3 else 0), rel=1e-9)
    text = est.parser().format_help()
    assert "2 + 14/N" in text and "estimate_zero2_model_states_mem_needs" in text


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_offload_keeps_only_16_bit_weights_and_buckets_on_the_gpu(zero):
    """ZeRO-Offload as DeepSpeed runs it (stage_1_and_2.py with offload_optimizer cpu): optimizer states and the
    fp32 gradient partitions on the host, reduced there from GPU buckets; the GPU keeps the 16-bit weights (their
    stage-3 partition), the reduce bucket and one largest-parameter gradient buffer. Host per GPU: 12 + 4 + 2 =
    18 bytes per parameter / N, reported per GPU."""
    p, gpus = est.PRESETS["llama-2-7b"].params(), 8
    layer = plan.largest_layer(est.PRESETS["llama-2-7b"])
    m = _sft(model="llama-2-7b", engine="deepspeed", zero=zero, gpus=gpus, offload="optimizer")["models"]["actor"]
    assert m["optimizer"] == 0 and m["gradients"] == 0
    assert m["weights"] == pytest.approx(2 * p / (gpus if zero == 3 else 1), rel=1e-9)
    assert m["host_bytes"] == pytest.approx(18 * p / gpus, rel=1e-9)
    assert m["buffers"] == pytest.approx(2 * 500_000_000 + 2 * layer + (3 * 2 * layer if zero == 3 else 0), rel=1e-9)
    ppo = _ppo(model="llama-2-7b", engine="deepspeed", zero=zero, gpus=gpus, offload="optimizer", critic="actor")
    assert ppo["host_memory_per_gpu_bytes"] == pytest.approx(
        sum(x["host_bytes"] for x in ppo["models"].values()), rel=1e-9)
    with pytest.raises(ValueError, match="offload"):
        est.estimate(engine="deepspeed", zero=0, offload="optimizer")


def test_fsdp2_engine_is_this_trainers_buffers():
    """Full fine-tuning: fp32 sharded weights (the master), fp32 gradients, fp32 AdamW m and v, and a bf16
    compute copy (two gathered layers under --zero 3, the whole model under --zero 2)."""
    arch = est.PRESETS["llama-2-7b"]
    p = arch.params()
    full = _sft(model="llama-2-7b", engine="fsdp2", zero=3, gpus=8)["models"]["actor"]
    assert full["weights"] == pytest.approx(4 * p / 8, rel=1e-6)
    assert full["optimizer"] == pytest.approx(8 * p / 8, rel=1e-6)
    grad_op = _sft(model="llama-2-7b", engine="fsdp2", zero=2, gpus=8)["models"]["actor"]
    assert grad_op["buffers"] >= 2 * p
    with pytest.raises(ValueError, match="no stage 1"):
        est.estimate(engine="fsdp2", zero=1)


def test_fsdp2_rollout_holds_the_whole_policy_gathered_once():
    """The trainer gathers the sharded policy once around HF generate (ShardedModel.run(gathered=policy)):
    the rollout holds the whole policy in bf16, not the reference, and gathers it once, not every layer
    at every decode step as ZeRO-3 under DeepSpeed (one all-gather of every layer per step)."""
    base = dict(model="llama-2-7b", rollout_batch=64, seq_len=256, gen_len=256, gpu="h100", gpus=8, zero=3)
    ours, ds = _ppo(**base, engine="fsdp2"), _ppo(**base, engine="deepspeed")
    p = est.PRESETS["llama-2-7b"].params()
    buffers = ours["phases"]["rollout"]["memory_per_gpu_bytes"]["buffers"]
    assert buffers == pytest.approx(2 * p, rel=1e-6)
    assert ds["phases"]["rollout"]["memory_per_gpu_bytes"]["buffers"] < p / 4
    assert ours["phases"]["rollout"]["seconds"] < ds["phases"]["rollout"]["seconds"]


def test_zero_per_model_and_cli_mapping(capsys):
    assert est.main(["--model", "opt-1.3b", "--critic", "opt-350m", "--reward", "opt-350m", "--gpus", "8",
                     "--engine", "deepspeed", "--zero", "actor=3,critic=2,all=0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    models = out["stages"]["ppo"]["models"]
    assert (models["actor"]["zero"], models["critic"]["zero"], models["reference"]["zero"],
            models["reward"]["zero"]) == (3, 2, 0, 0)
    assert out["inputs"]["zero"] == {"actor": 3, "critic": 2, "all": 0}


# --- predicted vs measured on our own models -----------------------------------------------------


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_measure_cpu_exact_state_bytes(lora_rank):
    result = est.measure(lora_rank, device="cpu")
    for key, measured in result["measured"].items():
        assert abs(_rel(result["predicted"][key], measured)) <= 0.10, (key, result)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_measure_cuda_state_bytes(lora_rank):
    result = est.measure(lora_rank, device="cuda")
    for key in ("weights", "gradients", "optimizer"):
        assert abs(_rel(result["predicted"][key], result["measured"][key])) <= 0.10, (key, result)


STATE_RECORD = Path(__file__).resolve().parents[2] / "bench" / "results" / "dist_state_bytes_cpu.json"
SHARD_ZERO = {"full": "3", "grad_op": "2", "none": "0"}  # --shard -> --zero (fsdp2 engine)


@pytest.mark.parametrize("run", list(json.loads(STATE_RECORD.read_text())["runs"]))
def test_planner_predicts_the_recorded_fsdp2_state_bytes(run, tmp_path, capsys):
    """Issue 11: the planner predicts the bytes per rank of parameters, gradients and AdamW states
    that `fastrlhf sft` measured on 1 process and on 2 ranks under each --shard mode (bench/
    dist_state_bytes.py), through the same `fastrlhf estimate` command line a user runs. The issue's bar is
    10%; the model is exact here (every first dimension of the 36M Llama divides 2, so FSDP2 pads nothing),
    so the test holds it to the byte."""
    record = json.loads(STATE_RECORD.read_text())
    assert record["device"] == "cpu" and record["model"]["dtype"] == "float32"
    assert record["model"]["optimizer"] == "AdamW" and record["model"]["mixed_precision"] == "none"
    command = shlex.split(record["runs"][run]["command"])
    ranks = int(command[command.index("--nproc-per-node") + 1]) if "--nproc-per-node" in command else 1
    zero = SHARD_ZERO[command[command.index("--shard") + 1]] if "--shard" in command else "0"
    (tmp_path / "config.json").write_text(json.dumps(record["model"]["config"]))
    argv = ["--model", str(tmp_path / "config.json"), "--stage", "sft", "--gpu", "cpu", "--gpus", str(ranks),
            "--engine", "fsdp2", "--zero", zero, "--lora-rank", "0", "--json"]  # dtype: the trainer's on cpu
    assert est.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["dtype"] == "fp32"
    assert out["params"] == record["model"]["num_params"]  # 35,660,288: the formula and the model agree
    predicted = out["stages"]["sft"]["models"]["actor"]
    measured = record["runs"][run]["max_over_ranks"]
    for ours, theirs in (("weights", "params"), ("gradients", "grads"), ("optimizer", "optimizer")):
        error = _rel(predicted[ours], measured[theirs])
        assert predicted[ours] == measured[theirs], (run, ours, predicted[ours], measured[theirs], f"{error:+.1%}")


# --- what real setups differ in ----------------------------------------------------------------


def test_critic_and_reward_of_their_own_size():
    ppo = _ppo(model="llama-2-7b", critic="350M", reward="opt-350m", gpus=8, zero=3)
    assert ppo["models"]["critic"]["params"] == 350_000_000
    assert ppo["models"]["reward"]["params"] == est.PRESETS["opt-350m"].params()
    shared = _ppo(model="qwen2.5-0.5b", lora_rank=16)
    assert "critic" not in shared["models"] and shared["models"]["reference"]["weights"] == 0
    rule = _ppo(model="qwen2.5-0.5b", reward="rule")
    assert "reward" not in rule["models"] and rule["phases"]["reward"]["flops"] == 0
    assert set(ppo["phases"]) == set(est.PPO_PHASES)


def test_phase_names_are_the_trainers():
    from fastrlhf.constants import PPO_PHASES
    from fastrlhf.estimate.compare import PPO_PHASES as compared

    assert est.PPO_PHASES == compared == PPO_PHASES


def test_micro_rollout_batch_bounds_the_kv_cache_and_costs_time():
    base = dict(model="llama-2-7b", rollout_batch=64, seq_len=256, gen_len=256, gpu="h100")
    whole, micro = _ppo(**base), _ppo(**base, micro_rollout_batch=8)
    kv = lambda r: r["phases"]["rollout"]["memory_per_gpu_bytes"]["kv_cache"]  # noqa: E731
    assert kv(whole) == 2 * 32 * 4096 * 512 * 64 * 2  # K and V, layers, kv dim, tokens, sequences, bf16
    assert kv(micro) == kv(whole) / 8
    assert micro["phases"]["rollout"]["seconds"] > 2 * whole["phases"]["rollout"]["seconds"]
    assert whole["phases"]["update"]["memory_per_gpu_bytes"]["kv_cache"] == 0


def test_rollout_cache_follows_the_trainers_rule_and_costs_host_time(capsys):
    """--rollout-cache mirrors `fastrlhf ppo --rollout_cache`: dynamic by default, as the trainer; auto = static
    for hf generate on one GPU, else dynamic; the two have their own host overhead per layer call (calls:hf,
    calls:hf-static)."""
    from fastrlhf.estimate.plan import host_engine, resolved

    default = est.Spec(model="qwen2-0.5b", gpu="h100", lora_rank=16, reward="rule", seq_len=8, gen_len=256,
                       rollout_batch=64, micro_batch=16, mini_batch=32, ppo_epochs=2)
    assert resolved(default).rollout_cache == "dynamic" and host_engine(default) == "hf"
    one = dataclasses.replace(default, rollout_cache="auto")
    assert resolved(one).rollout_cache == "static" and host_engine(one) == "hf-static"
    assert resolved(dataclasses.replace(one, gpus=2)).rollout_cache == "dynamic"
    assert resolved(dataclasses.replace(one, gpu="cpu")).rollout_cache == "dynamic"
    assert resolved(dataclasses.replace(one, gen_engine="vllm")).rollout_cache == "dynamic"
    t = lambda cache: est.estimate(one, rollout_cache=cache)["stages"]["ppo"]["phases"]["rollout"]  # noqa: E731
    assert t("auto")["seconds"] == t("static")["seconds"]
    assert t("dynamic")["seconds"] > 3 * t("static")["seconds"]
    # the eager step launches every op from Python (host-bound); the compiled one replays a CUDA graph
    assert t("dynamic")["terms"]["host_bound_share"] > 0.5 > t("static")["terms"]["host_bound_share"]
    assert t("dynamic")["terms"]["host"] > 10 * t("static")["terms"]["host"]
    with pytest.raises(ValueError, match="rollout_cache"):
        est.estimate(one, rollout_cache="paged")
    with pytest.raises(ValueError, match="rollout_cache"):
        est.estimate(one, rollout_cache="static", gen_engine="vllm")
    assert est.main(["--model", "qwen2-0.5b", "--gpu", "h100", "--rollout-cache", "dynamic", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["rollout_cache"] == "dynamic"


def test_mean_response_length_matters_to_vllm_not_to_hf():
    base = dict(model="llama-2-7b", rollout_batch=256, gpus=8, zero=3, gen_len=1024, gpu="h100")
    t = lambda **kw: _ppo(**base, **kw)["phases"]["rollout"]["seconds"]  # noqa: E731
    assert t(gen_engine="vllm", mean_gen_len=256) < 0.8 * t(gen_engine="vllm")
    assert t(gen_engine="hf", mean_gen_len=256) == t(gen_engine="hf")
    with pytest.raises(ValueError, match="mean_gen_len"):
        est.estimate(gen_len=100, mean_gen_len=200)


def test_vllm_runs_what_its_kv_cache_holds_and_queues_the_rest():
    """vLLM gets gpu_memory_utilization (0.9) of the GPU: the KV cache never breaks the budget; more
    prompts than it holds run in waves, each decoding to the longest response."""
    base = dict(model="llama-2-7b", gen_engine="vllm", gpus=1, lora_rank=16, gen_len=1024, seq_len=1024, gpu="a100-80g")
    small, big = _ppo(**base, rollout_batch=16), _ppo(**base, rollout_batch=512)
    kv = lambda r: r["phases"]["rollout"]["memory_per_gpu_bytes"]["kv_cache"]  # noqa: E731
    assert kv(big) < 512 / 16 * kv(small)  # capped, not 32x
    assert big["phases"]["rollout"]["memory_per_gpu_bytes"]["peak"] <= 0.9 * est.GPUS["a100-80g"].memory_bytes
    assert big["phases"]["rollout"]["seconds"] > 5 * small["phases"]["rollout"]["seconds"]
    with pytest.raises(ValueError, match="vllm"):
        est.estimate(placement="disaggregated", pools={"gen": 1, "actor": 1, "reference": 1, "reward": 1})


def test_graph_engine_prefills_each_group_once_and_decodes_the_live_rows():
    """gen_engine graph (`fastrlhf ppo --rollout_engine graph`): the prefill runs the N / G distinct prompts; the
    decode computes about N x the mean length rows over at least the longest response's steps (compaction and
    refill), so a long tail costs what its tokens cost; the KV pool is rollout_slots x (P + R); the pool and the
    engine's weight copy live in the rollout phase only (released for the update)."""
    base = dict(model="qwen2.5-0.5b", stage="grpo", gpu="h100", lora_rank=16, seq_len=512, gen_len=4096,
                rollout_batch=32, num_generations=8, gen_engine="graph")
    arch = est.estimate(**base)["stages"]["grpo"]
    roll = lambda **kw: est.estimate(**(base | kw))["stages"]["grpo"]["phases"]["rollout"]  # noqa: E731
    whole, pooled = roll(mean_gen_len=820), roll(mean_gen_len=820, rollout_slots=64)
    kv_per_token = 2 * 24 * 128 * 2  # K and V, layers, kv dim (2 heads x 64), bf16
    assert whole["memory_per_gpu_bytes"]["kv_cache"] == 256 * (512 + 4096) * kv_per_token
    assert pooled["memory_per_gpu_bytes"]["kv_cache"] == 64 * (512 + 4096) * kv_per_token
    assert arch["phases"]["update"]["memory_per_gpu_bytes"]["kv_cache"] == 0
    # the long tail: at mean 0.2 R the decode is a fraction of every row decoding to R
    assert roll(mean_gen_len=820)["seconds"] < 0.5 * roll()["seconds"]
    # the group's prompt once: at one new token the rollout is the prefill, and G = 8 runs an eighth of the
    # prompt tokens of G = 1 at the same 256 sequences (its GEMM time; the one decode step is the same)
    one = roll(rollout_batch=256, num_generations=1, gen_len=1)["terms"]["gemm"]
    eight = roll(gen_len=1)["terms"]["gemm"]
    assert eight < 0.2 * one
    # fastrlhf's engine against hf generate at the same shapes: a CUDA graph per step, not every op from Python
    hf = roll(gen_engine="hf", mean_gen_len=820)
    assert whole["seconds"] < 0.2 * hf["seconds"]
    with pytest.raises(ValueError, match="rollout_slots"):
        est.estimate(**(base | {"gen_engine": "hf", "rollout_slots": 64}))
    with pytest.raises(ValueError, match="gen_tp"):
        est.estimate(**(base | {"gpus": 2, "gen_tp": 2}))


def test_generation_tensor_parallel_splits_weights_and_kv():
    base = dict(model="llama-2-13b", rollout_batch=64, gpus=8, zero=3, gen_engine="vllm", gpu="a100-80g")
    one, four = _ppo(**base), _ppo(**base, gen_tp=4)
    kv = lambda r: r["phases"]["rollout"]["memory_per_gpu_bytes"]["kv_cache"]  # noqa: E731
    assert kv(four) == pytest.approx(kv(one), rel=1e-6)  # 4x the sequences per engine over 4 GPUs
    assert four["phases"]["rollout"]["engines"] == 2
    with pytest.raises(ValueError, match="gen_tp"):
        est.estimate(gpus=6, gen_tp=4)


def test_offload_moves_states_to_the_host():
    base = dict(model="llama-2-7b", gpus=8, zero=3, engine="deepspeed")
    none, opt, params = (_ppo(**base, offload=o) for o in ("none", "optimizer", "params"))
    assert opt["models"]["actor"]["optimizer"] == 0 and opt["models"]["actor"]["host_bytes"] > 0
    assert params["models"]["actor"]["weights"] == 0
    assert none["memory_per_gpu_bytes"]["peak"] > opt["memory_per_gpu_bytes"]["peak"] > \
        params["memory_per_gpu_bytes"]["peak"]
    assert opt["phases"]["update"]["seconds"] > none["phases"]["update"]["seconds"]  # the host link and CPU Adam
    frozen = _ppo(**base, offload_frozen=True)
    assert frozen["models"]["reference"]["weights"] == frozen["models"]["reward"]["weights"] == 0


def test_disaggregated_pools_are_judged_one_by_one():
    pools = {"gen": 2, "actor": 4, "critic": 2, "reference": 1, "reward": 1}
    r = _ppo(model="llama-2-7b", placement="disaggregated", pools=pools, critic="actor", gen_engine="vllm",
             zero=3, gpu="a100-80g", rollout_batch=128)
    assert set(r["pools"]) == set(pools)
    assert r["pools"]["reference"]["gpus"] == 1 and r["pools"]["reference"]["phase"] == "logprobs"
    assert r["models"]["critic"]["pool"] == "critic" and r["models"]["critic"]["gpus"] == 2
    assert set(r["phases"]["logprobs"]["seconds_by_pool"]) == {"actor", "critic", "reference"}
    with pytest.raises(ValueError, match="pool"):
        est.estimate(placement="disaggregated", pools={"actor": 4})
    with pytest.raises(ValueError, match="pools"):
        est.estimate(placement="disaggregated")


def test_grpo_is_critic_free_with_g_samples_per_prompt():
    base = dict(model="qwen2.5-7b", gpus=8, zero=3, rollout_batch=32, gpu="h100")
    ppo = est.estimate(stage="ppo", critic="actor", **base)["stages"]["ppo"]
    grpo = est.estimate(stage="grpo", num_generations=8, **base)["stages"]["grpo"]
    assert "critic" not in grpo["models"] and "critic" in ppo["models"]
    assert grpo["phases"]["update"]["flops"] > 4 * ppo["phases"]["update"]["flops"] / 2
    assert grpo["phases"]["rollout"]["memory_per_gpu_bytes"]["kv_cache"] == \
        8 * ppo["phases"]["rollout"]["memory_per_gpu_bytes"]["kv_cache"]


def test_phase_3_scores_what_the_trainer_scores():
    """The logprobs phase runs the forwards `fastrlhf.train.recipes.ppo.experience` runs: with old_logprobs sampler
    the actor's trunk only where PPO's shared value head needs values (no lm_head), none for GRPO; GRPO with the KL in
    the loss leaves the first minibatch's rows to the update (`ppo.old_from_first_update`)."""
    base = dict(model="qwen2-0.5b", gpu="h100", lora_rank=16, reward="rule", seq_len=64, gen_len=256,
                rollout_batch=16, micro_batch=16)

    def phase(**kw):
        stage = kw.get("stage", "ppo")
        return est.estimate(**base, **kw)["stages"][stage]["phases"]["logprobs"]

    from fastrlhf.estimate.arch import resolve_model

    ppo, ppo_sampler = phase(), phase(old_logprobs="sampler")
    head = 2 * resolve_model("qwen2-0.5b").head_params() * 16 * 256  # the lm_head over the 16 x 256 response tokens
    assert ppo_sampler["flops"] == pytest.approx(ppo["flops"] - head, rel=1e-9)  # the actor's trunk, for the values
    grpo = dict(stage="grpo", num_generations=4, mini_batch=16)  # 64 sequences, a minibatch of 16
    full, sampler, kl_loss = phase(**grpo), phase(**grpo, old_logprobs="sampler"), phase(**grpo, kl_in_loss=True)
    assert sampler["flops"] == pytest.approx(full["flops"] / 2, rel=1e-9)  # the reference only
    assert kl_loss["flops"] == pytest.approx(full["flops"] / 2 * (1 + 3 / 4), rel=1e-9)  # 48 of 64 rows scored
    assert kl_loss["seconds"] < full["seconds"] and sampler["seconds"] < kl_loss["seconds"]
    whole = phase(stage="grpo", num_generations=4, kl_in_loss=True)  # one minibatch: the update scores every row
    assert whole["flops"] == pytest.approx(sampler["flops"], rel=1e-9)


def test_dpo_holds_policy_and_reference_and_pairs():
    dpo = est.estimate(model="llama-2-7b", stage="dpo", lora_rank=16, micro_batch=2)["stages"]["dpo"]
    assert set(dpo["models"]) == {"actor", "reference"} and set(dpo["phases"]) == {"logprobs", "update"}
    sft = _sft(model="llama-2-7b", lora_rank=16, micro_batch=4, gen_len=512)
    assert dpo["phases"]["update"]["memory_per_gpu_bytes"]["activations"] == sft["memory_per_gpu_bytes"]["activations"]


# --- fit, advice, time ranges ---------------------------------------------------------------------


def test_fit_names_the_component_and_what_to_change():
    r = _ppo(model="llama-2-7b", critic="actor", gpus=1, gpu="a100-40g")
    assert not r["fits"]
    pool = r["pools"]["all"]
    assert pool["component"] == "weights" and not pool["fits"]
    changes = {a["change"]: a for a in r["advice"]["single"]}
    assert "--lora-rank 16" in changes and "--gpus 2 --zero 3" in changes
    assert changes["--lora-rank 16"]["peak_bytes"] < pool["peak"]
    path = r["advice"]["path"]
    assert path[-1]["fits"] and all(a["peak_bytes"] > b["peak_bytes"] for a, b in zip(path, path[1:]))


def test_time_ranges_and_the_dominant_phase(capsys):
    r = _ppo(model="llama-2-7b", gpus=8, zero=3, gpu="a100-80g")
    lo, hi = r["seconds_range"]
    assert lo <= r["seconds"] <= hi and lo < hi
    for p in r["phases"].values():
        assert p["seconds_range"][0] <= p["seconds"] <= p["seconds_range"][1]
    assert r["dominant_phase"] == max(r["phases"], key=lambda k: r["phases"][k]["seconds"])
    assert sum(p["share"] for p in r["phases"].values()) == pytest.approx(1.0)
    assert est.main(["--model", "llama-2-7b", "--gpus", "8", "--zero", "3"]) == 0
    assert f"{r['dominant_phase']} dominates" in capsys.readouterr().out


def test_cost_and_time_scale():
    one = est.estimate(model="opt-1.3b", stage="all", price=2.0)["stages"]
    eight = est.estimate(model="opt-1.3b", stage="all", price=2.0, gpus=8, rollout_batch=512)["stages"]
    assert one["sft"]["cost_usd"] == pytest.approx(one["sft"]["seconds"] * 2.0 / 3600)
    # 8x the work on 8 GPUs: the same compute per GPU, plus the gradient all-reduce of data parallelism
    update = lambda stages: stages["ppo"]["phases"]["update"]  # noqa: E731
    assert "comm" not in update(one)["terms"]
    p = est.PRESETS["opt-1.3b"].params()
    all_reduce = 2 * (p * 2 * 7 / 8 / est.GPUS["a100-80g"].link + timing.NCCL_LATENCY_S)  # bf16 gradients, ring
    assert update(eight)["terms"]["comm"] == pytest.approx(all_reduce / timing.factors("gpu")["net"], rel=1e-6)
    assert update(eight)["seconds"] - update(eight)["terms"]["comm"] == pytest.approx(update(one)["seconds"])


# --- CLI, JSON schema, plot, errors --------------------------------------------------------------


def test_cli_json_schema(capsys):
    assert est.main(["--model", "qwen2.5-0.5b", "--stage", "all", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {*est.COMPONENTS, "peak"}
    assert set(out["stages"]) == {"sft", "rm", "ppo"}
    assert out["inputs"]["gen_engine"] == "hf" and out["inputs"]["placement"] == "colocated"
    for stage in out["stages"].values():
        assert set(stage["memory_per_gpu_bytes"]) == keys
        assert isinstance(stage["fits"], bool) and stage["flops"] > 0 and stage["seconds"] > 0
        assert len(stage["seconds_range"]) == 2
    for phase in out["stages"]["ppo"]["phases"].values():
        assert set(phase["memory_per_gpu_bytes"]) == keys
        assert {"flops", "seconds", "seconds_range", "share", "memory_by_pool"} <= set(phase)


def test_help_shows_every_key_with_its_default():
    """--help lists every Spec field (the command line is built from Spec) with its type and default."""
    text = " ".join(est.parser().format_help().split())
    for f in dataclasses.fields(est.Spec):
        assert f"--{f.name} (" in text, f.name
    for default in ("--gen_engine (str, default 'hf')", "--placement (str, default 'colocated')",
                    "--engine (str, default 'fsdp2')", "--critic (str, default 'shared')",
                    "--reward (str, default 'actor')", "--offload (str, default 'none')", "--gen_tp (int, default 1)"):
        assert default in text, default


def test_cli_table_and_plot(tmp_path, capsys):
    path = tmp_path / "mem.png"
    assert est.main(["--model", "opt-13b", "--gpus", "4", "--zero", "3", "--plot", str(path)]) == 0
    out = capsys.readouterr().out
    assert "rollout" in out and "update" in out
    assert path.stat().st_size > 1000


@pytest.mark.parametrize("overrides,match", [
    (dict(model="llama-9000"), "unknown preset"),
    (dict(micro_batch=-1), "micro_batch"),
    (dict(seq_len=0), "seq_len"),
    (dict(zero=4), "ZeRO stage"),
    (dict(zero={"actr": 3}), "unknown model"),
    (dict(qlora=True), "lora_rank"),
    (dict(gpu="tpu"), "gpu"),
    (dict(gen_engine="trt"), "gen_engine"),
    (dict(offload="disk"), "offload"),
    (dict(old_logprobs="rollout"), "old_logprobs"),
    (dict(offload="optimizer"), "fsdp2 offloads"),
    (dict(critic="gpt-5"), "critic"),
    (dict(params="lots"), "params"),
    (dict(model={"hidden_size": 64, "num_hidden_layers": 2}), "num_attention_heads"),
])
def test_bad_input(overrides, match):
    with pytest.raises(ValueError, match=match):
        est.estimate(**overrides)


def test_cli_bad_input_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "vocab_size": 100}))
    assert est.main(["--model", str(path)]) == 2
    assert "missing num_hidden_layers" in capsys.readouterr().err
    assert est.main(["--pools", "gen=two"]) == 2
    assert "pools" in capsys.readouterr().err


def test_zero3_hf_generate_gathers_every_layer_at_every_decode_step():
    """DeepSpeed-Chat without its hybrid engine: HF generate under ZeRO-3 all-gathers every layer for every decode
    step (gen_len + 1 forwards per generate call); the hybrid engine gathers the actor once per call."""
    base = dict(model="llama-2-7b", engine="deepspeed", zero=3, gpus=16, gpu="a800-80g", rollout_batch=128,
                micro_rollout_batch=8, seq_len=1024, gen_len=1024)
    hf, he = (_ppo(**base, gen_engine=e)["phases"]["rollout"] for e in ("hf", "ds-he"))
    gathers = 128 / 16 / 8 * (1024 + 1)  # generate calls x forwards per call
    per_gather = est.PRESETS["llama-2-7b"].params() * 2 * 15 / 16 / est.GPUS["a800-80g"].network
    assert hf["terms"]["comm"] >= gathers * per_gather / timing.factors("gpu")["net"]
    assert hf["terms"]["comm"] > 100 * he["terms"]["comm"] and hf["seconds"] > 3 * he["seconds"]


def test_vllm_batches_continuously_not_in_micro_rollout_batches():
    """vLLM decodes all of an engine's prompts with continuous batching up to its KV capacity: the trainer's
    micro-rollout batch does not chunk it, and the decode steps follow the tokens over the running slots."""
    base = dict(model="llama-2-7b", gen_engine="vllm", gpus=8, zero=3, gpu="a100-80g", rollout_batch=8192,
                seq_len=512, gen_len=1024, mean_gen_len=400)  # 1024 prompts per engine, 256 slots
    whole, chunked = _ppo(**base), _ppo(**base, micro_rollout_batch=4)
    assert whole["phases"]["rollout"]["seconds"] == chunked["phases"]["rollout"]["seconds"]
    # 1024 x 400 tokens over 256 slots: 1600 steps; 1024 x 100 over 256: 400, so the longest response's 1024 steps
    short = _ppo(**dict(base, mean_gen_len=100))["phases"]["rollout"]["seconds"]
    assert short < 0.8 * whole["phases"]["rollout"]["seconds"]


def test_fit_allowance_is_the_cuda_context_and_tight_marks_the_allocator_margin():
    """fits: peak + 1 GiB of CUDA context <= the GPU; tight: what is left is under 5% of the GPU."""
    from fastrlhf.estimate.plan import FRAGMENTATION

    dev = est.GPUS["a100-80g"]
    assert dev.context_bytes == 2**30 and FRAGMENTATION == 0.05
    for micro in (1, 2, 4, 8, 16, 32):
        r = _sft(model="llama-2-7b", lora_rank=16, micro_batch=micro, seq_len=2048)
        left = dev.memory_bytes - dev.context_bytes - r["memory_per_gpu_bytes"]["peak"]
        assert r["fits"] == (left >= 0)
        assert r["tight"] == (0 <= left < 0.05 * dev.memory_bytes)
