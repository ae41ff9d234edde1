"""`fastrlhf estimate` against published measurements, exact CPU state bytes, and bad input.

Published figures are decimal GB (1e9 bytes), as the sources print them
(`torch.cuda.max_memory_allocated() / 1e9` in LitGPT, `... / 1e9` in torchtune's memory stats).
"""

import json

import pytest
import torch

from fastrlhf import estimate as est

GB = 1e9


def _rel(predicted: float, published: float) -> float:
    return (predicted - published) / published


def _sft_peak(**kw) -> int:
    return est.estimate(stage="sft", gen_len=0, **kw)["stages"]["sft"]["memory_per_gpu_bytes"]["peak"]


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


# --- published measurements ---------------------------------------------------------------------

# LitGPT tutorials/resource-tables.md ("Finetuning with LoRA on 1 GPU", commit 8641822, A100-SXM4-40GB,
# PyTorch 2.1, --precision bf16-true): Llama 2 7B, finetune/lora.py, 4,194,304 trainable parameters
# (r=8 on query and value), Alpaca whose longest example is 1304 Llama-2 tokens; the first iteration
# uses that longest example, so every micro-batch row is padded to 1304. Max GPU RAM: micro-batch 1
# 21.30 GB, micro-batch 2 29.07 GB. LitGPT runs SDPA (flash) without activation checkpointing and
# chunks lm_head + cross-entropy in bf16, which is what our fused setting models (bf16 logits +
# bf16 gradient, no fp32 copy).
LITGPT = dict(model="llama-2-7b", lora_rank=8, lora_targets=("q", "v"), seq_len=1304, gpu="a100-40g")


@pytest.mark.parametrize("micro_batch,published_gb", [(1, 21.30), (2, 29.07)])
def test_litgpt_llama2_7b_lora(micro_batch, published_gb):
    predicted = _sft_peak(micro_batch=micro_batch, **LITGPT)
    assert abs(_rel(predicted, published_gb * GB)) <= 0.15, predicted / GB


# torchtune recipes/configs/llama2/7B_lora_single_device.yaml (v0.1): lora_attn_modules [q_proj, v_proj],
# rank 8, batch_size 2, dtype bf16, enable_activation_checkpointing True, alpaca_cleaned with the
# dataset's default max_seq_len=512, AdamW; the model returns fp32 logits (`self.output(h).float()`)
# and nn.CrossEntropyLoss runs on them, i.e. materialised fp32 logits (--no-fused).
TORCHTUNE_LORA = dict(model="llama-2-7b", lora_rank=8, lora_targets=("q", "v"), micro_batch=2, seq_len=512,
                      gradient_checkpointing=True, fused=False)


def test_torchtune_llama2_7b_lora():
    """README (1 x RTX 4090, "Peak Memory per GPU"): 17.18 GB. The README does not say which counter
    that is; torchtune's QLoRA tutorial (docs/source/tutorials/qlora_finetune.rst) reports the same
    recipe and config at 15.57 GB *peak reserved* during training (13.98 GB at model init). We
    predict allocated memory: within 15% of the tutorial's 15.57 GB (-6%), and below the README's
    17.18 GB (-15.1%; reserved memory and the un-stated counter make it an upper bound, not a target)."""
    predicted = _sft_peak(**TORCHTUNE_LORA)
    assert abs(_rel(predicted, 15.57 * GB)) <= 0.15, predicted / GB
    assert predicted < 17.18 * GB


def test_torchtune_llama2_7b_qlora():
    """Published 9.29 GB (qlora_finetune.rst table, LoRA q/k/v/o + MLP rank 8, NF4 base, batch 2,
    activation checkpointing) is *peak reserved* memory, and the same table shows 9.13 GB reserved at
    model init, before any batch exists: the figure is set by loading (bf16 weights staged on the GPU
    and quantised), which the caching allocator never returns, not by training. So the configuration
    differs from what we model (training-time allocations); we check that the training prediction is
    below the init-time figure, that NF4 cuts the weights to ~0.27x of bf16 (4.5 of 16 bits on the
    ~96% of parameters in block linears), and that the saving vs LoRA exceeds the published saving
    (15.57 - 9.29 GB reserved), which includes that loading overhead in the QLoRA number."""
    qlora = est.estimate(stage="sft", gen_len=0, model="llama-2-7b", lora_rank=8, qlora=True, micro_batch=2,
                         seq_len=512, gradient_checkpointing=True, fused=False)["stages"]["sft"]
    lora = est.estimate(stage="sft", gen_len=0, **TORCHTUNE_LORA)["stages"]["sft"]
    q_mem, l_mem = qlora["memory_per_gpu_bytes"], lora["memory_per_gpu_bytes"]
    assert q_mem["peak"] < 9.13 * GB
    assert 0.26 < q_mem["weights"] / l_mem["weights"] < 0.32
    assert l_mem["peak"] - q_mem["peak"] > (15.57 - 9.29) * GB


# DeepSpeed deepspeed/runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs (no offload):
# gpu_mem = 4 * total_params + 16 * total_params / total_gpus; stage3.py
# estimate_zero3_model_states_mem_needs (no offload): largest_layer_memory + 18 * total_params / total_gpus,
# largest_layer_memory = 4 * largest_layer_params (the largest single module: Llama-2-7B's embedding).
@pytest.mark.parametrize("zero,gpus", [(2, 8), (2, 64), (3, 8), (3, 64)])
def test_deepspeed_model_state_formulas(zero, gpus):
    arch = est.PRESETS["llama-2-7b"]
    p = arch.params()
    if zero == 2:
        deepspeed = 4 * p + 16 * p / gpus
    else:
        deepspeed = 4 * arch.vocab * arch.hidden + 18 * p / gpus
    result = est.estimate(model="llama-2-7b", stage="sft", zero=zero, gpus=gpus)
    mem = result["stages"]["sft"]["memory_per_gpu_bytes"]
    states = mem["weights"] + mem["gradients"] + mem["optimizer"]
    assert abs(_rel(states, deepspeed)) <= 0.15, (states / GB, deepspeed / GB)


# --- predicted vs measured on our own models -----------------------------------------------------


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_measure_cpu_exact_state_bytes(lora_rank):
    result = est.measure(lora_rank, device="cpu")
    for key, measured in result["measured"].items():
        assert abs(_rel(result["predicted"][key], measured)) <= 0.10, (key, result)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_cuda_state_bytes():
    result = est.measure(0, device="cuda")
    for key in ("weights", "gradients", "optimizer"):
        assert abs(_rel(result["predicted"][key], result["measured"][key])) <= 0.10, (key, result)


# --- model behaviour -----------------------------------------------------------------------------


def test_ppo_lora_reference_shares_weights_and_shared_critic_adds_no_model():
    ppo = est.estimate(model="qwen2.5-0.5b", stage="ppo", lora_rank=16)["stages"]["ppo"]
    assert ppo["models"]["reference"]["weights"] == 0
    assert "critic" not in ppo["models"]
    full = est.estimate(model="qwen2.5-0.5b", stage="ppo", critic="separate")["stages"]["ppo"]
    assert full["models"]["reference"]["weights"] == full["models"]["actor"]["weights"]
    assert full["models"]["critic"]["optimizer"] == full["models"]["actor"]["optimizer"]
    assert set(ppo["phases"]) == {"generation", "experience", "training"}


def test_knobs_move_the_right_component():
    base = dict(model="llama-3-8b", stage="sft", micro_batch=2, seq_len=1024, gen_len=0)
    mem = lambda **kw: est.estimate(**base, **kw)["stages"]["sft"]["memory_per_gpu_bytes"]  # noqa: E731
    plain, ckpt = mem(), mem(gradient_checkpointing=True)
    eager, unfused = mem(flash_attention=False), mem(fused=False)
    assert ckpt["activations"] < plain["activations"] / 5
    assert eager["activations"] > plain["activations"]
    # materialised: bf16 logits + fp32 copy, log-softmax and their grads = 18 B vs fused 4 B per logit
    assert unfused["logits"] == plain["logits"] * 18 // 4
    assert mem(params=16_000_000_000)["weights"] == pytest.approx(2 * 16e9)


def test_kv_cache_is_generation_only():
    result = est.estimate(model="llama-2-7b", stage="ppo", rollout_batch=8, seq_len=256, gen_len=256)
    ppo = result["stages"]["ppo"]
    kv = ppo["phases"]["generation"]["memory_per_gpu_bytes"]["kv_cache"]
    assert kv == 2 * 32 * 4096 * 512 * 8 * 2  # K and V, layers, kv dim, tokens, sequences, bf16
    assert ppo["phases"]["training"]["memory_per_gpu_bytes"]["kv_cache"] == 0


def test_cost_and_time_scale():
    one = est.estimate(model="opt-1.3b", stage="all", price=2.0)["stages"]
    eight = est.estimate(model="opt-1.3b", stage="all", price=2.0, gpus=8, rollout_batch=512)["stages"]
    assert one["sft"]["cost_usd"] == pytest.approx(one["sft"]["seconds"] * 2.0 / 3600)
    # 8x the work on 8 GPUs: same training time
    train = lambda stages: stages["ppo"]["phases"]["training"]["seconds"]  # noqa: E731
    assert train(eight) == pytest.approx(train(one))


# --- CLI, JSON schema, plot, errors --------------------------------------------------------------


def test_cli_json_schema(capsys):
    assert est.main(["--model", "qwen2.5-0.5b", "--stage", "all", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {"weights", "gradients", "optimizer", "activations", "logits", "kv_cache", "peak"}
    assert set(out["stages"]) == {"sft", "rm", "ppo"}
    for stage in out["stages"].values():
        assert set(stage["memory_per_gpu_bytes"]) == keys
        assert isinstance(stage["fits"], bool) and stage["flops"] > 0 and stage["seconds"] > 0
    for phase in out["stages"]["ppo"]["phases"].values():
        assert set(phase["memory_per_gpu_bytes"]) == keys
        assert {"flops", "seconds"} <= set(phase)


def test_cli_table_and_plot(tmp_path, capsys):
    path = tmp_path / "mem.png"
    assert est.main(["--model", "opt-13b", "--gpus", "4", "--zero", "3", "--plot", str(path)]) == 0
    out = capsys.readouterr().out
    assert "generation" in out and "training" in out
    assert path.stat().st_size > 1000


@pytest.mark.parametrize("overrides,match", [
    (dict(model="llama-9000"), "unknown preset"),
    (dict(micro_batch=-1), "micro_batch"),
    (dict(seq_len=0), "seq_len"),
    (dict(zero=4), "ZeRO stage"),
    (dict(qlora=True), "lora_rank"),
    (dict(gpu="tpu"), "gpu"),
    (dict(model={"hidden_size": 64, "num_hidden_layers": 2}), "num_attention_heads"),
])
def test_bad_input(overrides, match):
    with pytest.raises(ValueError, match=match):
        est.estimate(**overrides)


def test_cli_bad_config_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "vocab_size": 100}))
    assert est.main(["--model", str(path)]) == 2
    assert "missing num_hidden_layers" in capsys.readouterr().err
