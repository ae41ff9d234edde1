"""`fastrlhf estimate --qlora` against the bytes of a QLoRA model as `fastrlhf sft --qlora` loads it on CPU:
its NF4 weights with their quantisation statistics, the rest in float32, the adapters, their gradients and
AdamW states (fastrlhf.estimate.measure, exact tensor bytes)."""

import pytest

from fastrlhf import estimate as est
from fastrlhf.estimate.arch import arch_from_config
from fastrlhf.estimate.memory import NF4_BYTES_PER_PARAM, weight_bytes

pytest.importorskip("bitsandbytes")

# a 30M Llama: 8 layers of 4 x 512^2 + 3 x 512 x 1376 block-linear weights (25.3M), 2 x 4000 x 512 embeddings
LLAMA_30M = {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
             "num_key_value_heads": 8, "intermediate_size": 1376, "vocab_size": 4000, "tie_word_embeddings": False,
             "max_position_embeddings": 128}


def test_planner_qlora_weight_bytes_match_the_tracked_nf4_bytes():
    import torch

    from fastrlhf.estimate.measure import build_tiny_model
    from fastrlhf.train.models import nf4_bytes

    model = build_tiny_model(0, LLAMA_30M, qlora=True)
    arch = arch_from_config(LLAMA_30M)
    quantised = arch.layers * arch.layer_linear_params()
    assert quantised == 25_296_896
    tracked = nf4_bytes(model)  # 4-bit codes, 8-bit absmax per 64, fp32 absmax per 256 blocks, code books
    assert abs(quantised * NF4_BYTES_PER_PARAM / tracked - 1) <= 0.05, (quantised * NF4_BYTES_PER_PARAM, tracked)
    unquantised = sum(p.numel() * p.element_size() for p in model.parameters() if p.dtype != torch.uint8)
    assert unquantised == (arch.params() - quantised) * 4  # embeddings, norms and lm_head stay float32
    planned = weight_bytes(arch, 4, qlora=True)  # what `fastrlhf estimate --qlora` puts under the adapters
    assert abs(planned / (tracked + unquantised) - 1) <= 0.05, (planned, tracked + unquantised)


def test_planner_qlora_state_bytes_against_a_measured_step():
    """Weights (NF4 base + fp32 rest + fp32 adapters), gradients and AdamW states after two steps of the tiny
    Llama (the 30M model's weights: the test above)."""
    result = est.measure(8, device="cpu", qlora=True)
    measured, predicted = result["measured"], result["predicted"]
    assert measured["gradients"] > 0 and measured["optimizer"] == 2 * measured["gradients"]
    assert predicted["gradients"] == measured["gradients"] and predicted["optimizer"] == measured["optimizer"]
    assert abs(predicted["weights"] / measured["weights"] - 1) <= 0.05, (predicted["weights"], measured["weights"])
