"""Causal LMs: built-in configs, loading a local Hugging Face directory, and the accessors
the stages use (trunk, lm_head, final hidden states).

- `load_causal_lm(name_or_path)`: a local Hugging Face directory (model + tokenizer), or a
  built-in config with random weights (`tiny`: the embedded default; `qwen2-0.5b`,
  `llama-0.5b`: 0.5B-class models for GPU timing runs) with the built-in task's char tokenizer.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from fastrlhf.data import ensure_pad_token
from fastrlhf.devices import attention_backend, cpu_threads_for
from fastrlhf.task import build_char_tokenizer

log = logging.getLogger("fastrlhf")


# ---------------------------------------------------------------- built-in configs


def _tiny_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                       tie_word_embeddings=False)


def _qwen2_05b_config(vocab_size: int):
    """Qwen2-0.5B's shapes with random weights, for GPU timing runs. The real vocabulary
    (151936, tied embeddings) is kept whatever `vocab_size` the tokenizer has: the lm_head and
    log-prob cost is what such a run measures; sampled ids past the tokenizer decode as unknown."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, tie_word_embeddings=True)


def _llama_05b_config(vocab_size: int):
    """A 0.5B Llama (vocab 32000 kept whatever `vocab_size` is, as `_qwen2_05b_config`)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
                       tie_word_embeddings=False)


BUILTIN_MODELS = {"tiny": _tiny_config, "qwen2-0.5b": _qwen2_05b_config, "llama-0.5b": _llama_05b_config}


# ---------------------------------------------------------------- loading


def load_causal_lm(name_or_path: str, *, device: torch.device, dtype: torch.dtype = torch.float32,
                   gradient_checkpointing: bool = False):
    """(model, tokenizer) from a local HF directory or a built-in config name (random weights,
    the embedded char tokenizer). The tokenizer always has a pad token (EOS, with a warning)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    attn = attention_backend(device)
    path = Path(str(name_or_path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json (not a Hugging Face model)")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=dtype)
    elif str(name_or_path) in BUILTIN_MODELS:
        tokenizer = build_char_tokenizer()
        config = BUILTIN_MODELS[str(name_or_path)](len(tokenizer))
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    else:
        raise ValueError(f"model {str(name_or_path)!r}: no such directory, and not a built-in config "
                         f"({', '.join(BUILTIN_MODELS)})")
    ensure_pad_token(tokenizer)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.to(device=device, dtype=dtype)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n = sum(p.numel() for p in model.parameters())
    cpu_threads_for(n, device)
    log.info("model %s: %.2fM parameters, attention=%s, dtype=%s, device=%s",
             name_or_path, n / 1e6, attn, dtype, device)
    return model, tokenizer


# ---------------------------------------------------------------- accessors


def unwrap(lm):
    """The plain HF causal LM under a peft wrapper (or `lm` itself)."""
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def trunk(lm) -> nn.Module:
    """The decoder stack of a causal LM (e.g. LlamaModel): gives the final, normed hidden states."""
    base = unwrap(lm)
    return getattr(base, base.base_model_prefix)


def lm_head(lm) -> nn.Linear:
    return unwrap(lm).get_output_embeddings()


def hidden_states(lm, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """[B, T, H] final hidden states; logits would be `hidden @ lm_head.weight.T`."""
    out = trunk(lm)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=False)
    return out.last_hidden_state
