"""A small local Hugging Face model with its own BPE tokenizer, and user data for it: what a
user brings (import as `from local_model import ...`). Nothing is downloaded.

The task, "repeat the last word": prompt "alpha beta gamma ->", response " gamma".
"""

import json
import random
from pathlib import Path

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def task_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 4))]
        other = rng.choice([w for w in WORDS if w != words[-1]])
        rows.append({"prompt": " ".join(words) + " ->", "response": " " + words[-1], "wrong": " " + other})
    return rows


def bpe_tokenizer(texts: list[str], vocab_size: int = 120, *, pad: bool = True):
    """A byte-level BPE tokenizer trained on `texts` with `tokenizers`, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>" if pad else None)


def make_local_model(path: Path, *, tokenizer=None, max_positions: int = 64, vocab_size: int | None = None,
                     seed: int = 0) -> Path:
    """A 2-layer Qwen2 with random weights and a BPE tokenizer trained on the task's texts, saved
    as a Hugging Face directory (config.json, model.safetensors, tokenizer files)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if tokenizer is None:
        rows = task_rows(200)
        tokenizer = bpe_tokenizer([r["prompt"] + r["response"] for r in rows])
    vocab_size = vocab_size or len(tokenizer)
    pad = tokenizer.pad_token_id if (tokenizer.pad_token_id or 0) < vocab_size else None
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(path)


def write_task_data(folder: Path, n: int = 24) -> dict[str, Path]:
    """sft.jsonl (prompt, response), rm.jsonl (prompt, chosen, rejected), ppo.jsonl (prompt)."""
    rows = task_rows(n)
    return {
        "sft": write_jsonl(folder / "sft.jsonl", [{"prompt": r["prompt"], "response": r["response"]} for r in rows]),
        "rm": write_jsonl(folder / "rm.jsonl", [{"prompt": r["prompt"], "chosen": r["response"],
                                                 "rejected": r["wrong"]} for r in rows]),
        "ppo": write_jsonl(folder / "ppo.jsonl", [{"prompt": r["prompt"]} for r in rows]),
    }


REWARD_FILE = '''
def score(prompts, responses):
    """1 when the response is the prompt's last word, else 0."""
    return [float(r.strip() == p.split()[-2]) for p, r in zip(prompts, responses)]
'''
