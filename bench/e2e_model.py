"""The models and prompts bench/e2e.py hands to every trainer: Hugging Face directories that fastrlhf
and TRL load the same way, with random weights (timing) or an SFT checkpoint (learning).

Timing models answer in exactly R tokens: their EOS and pad tokens are unreachable *in the weights*
(pad too: TRL 1.12's PPOTrainer reads a sampled pad token as the end of the response), so this
holds in any sampler: transformers' `generate`, TRL's, fastrlhf's own rollout engine, vLLM. One
residual dimension k carries a constant c > 0: the embedding's column k is c, no layer writes to
it (every o_proj and down_proj row k is 0) nor reads it (every layer norm's weight k is 0), so the
final norm gives h_k = c / rms(x) > 0 at every position. The lm_head rows of EOS and pad are
-M e_k: their logit is -M c / rms(x) = -M sqrt(H) / sqrt(1 + |x without k|^2 / c^2) for hidden
size H, with c = 1 and M = 1e4 about -1e5 on these models: exp() of it is 0 in float32 and
bfloat16. The other rows' column k is 0 (untied lm_head) or c (tied embeddings: every other logit
moves by the same c * h_k, which softmax ignores).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fastrlhf.train import task
from fastrlhf.train.models import BUILTIN_MODELS

CONST_DIM = 0  # the residual dimension that carries the constant
CONST_VALUE = 1.0  # c
UNREACHABLE_SCALE = 1e4  # M


def _llama_10m(vocab_size: int):
    """A 10.2M-parameter Llama body (12 layers, hidden 256) with the char tokenizer's vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=12,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                       tie_word_embeddings=False)


def _llama_10m_v32k(vocab_size: int):
    """The same body with a 32000-token vocabulary (Llama-2's): +16.4M parameters in embedding and lm_head."""
    config = _llama_10m(vocab_size)
    config.vocab_size = 32000
    return config


# name -> config from the char tokenizer's size; the built-in ones are fastrlhf's own
MODELS = {"tiny": BUILTIN_MODELS["tiny"], "llama-10m": _llama_10m, "llama-10m-v32k": _llama_10m_v32k,
          "qwen2-0.5b": BUILTIN_MODELS["qwen2-0.5b"]}


@torch.no_grad()
def make_unreachable(lm, token_ids: list[int]) -> None:
    """Set the weights as the module docstring says for each of `token_ids` (EOS, and pad: TRL 1.12's
    PPOTrainer reads a sampled pad token as the end of the response) (Llama and Qwen2 layouts)."""
    base = lm.model
    k = CONST_DIM
    embed, head = base.embed_tokens.weight, lm.lm_head.weight
    tied = embed.data_ptr() == head.data_ptr()
    embed[:, k] = CONST_VALUE
    for layer in base.layers:
        layer.self_attn.o_proj.weight[k, :] = 0.0
        layer.mlp.down_proj.weight[k, :] = 0.0
        layer.input_layernorm.weight[k] = 0.0
        layer.post_attention_layernorm.weight[k] = 0.0
    base.norm.weight[k] = 1.0
    if not tied:
        head[:, k] = 0.0
    head[token_ids, :] = 0.0
    head[token_ids, k] = -UNREACHABLE_SCALE


def write_model(name: str, path: Path, *, seed: int = 0, eos_unreachable: bool = True) -> dict:
    """A model directory (config, safetensors, the char tokenizer) of the named config with random
    weights from `seed`; returns what it is (parameters, vocabulary, hidden size, layers)."""
    from transformers import AutoModelForCausalLM

    if name not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {name!r}")
    tokenizer = task.build_char_tokenizer()
    config = MODELS[name](len(tokenizer))
    config.pad_token_id, config.eos_token_id, config.bos_token_id = (tokenizer.pad_token_id, tokenizer.eos_token_id,
                                                                    tokenizer.bos_token_id)
    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_config(config)
    if eos_unreachable:
        make_unreachable(lm, [tokenizer.eos_token_id, tokenizer.pad_token_id])
    lm.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {"name": name, "parameters": sum(p.numel() for p in lm.parameters()), "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "layers": config.num_hidden_layers,
            "tied_embeddings": bool(config.tie_word_embeddings), "eos_unreachable": eos_unreachable}


def write_prompts(path: Path, n: int, seed: int) -> Path:
    """n prompts of the built-in task (3-6 letters and ':') as JSONL rows {"prompt": ...}."""
    rows = task.synthetic_prompt_rows(n, seed)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
