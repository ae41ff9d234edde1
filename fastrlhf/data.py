"""Datasets, tokenisation and collation, plus the built-in synthetic task and its tokenizer.

The synthetic task ("echo the key letter"): a prompt is 3-6 letters from a..h followed by
":", e.g. "cafe:". Its key is the prompt's first letter. A response is letters; its true
score is the number of key letters among its first 8 characters over max(8, its length):

    true_score("cafe:", "cccccccc") = 1.0,   true_score("cafe:", "cbcahdcc") = 0.5,
    true_score("cafe:", "cccc") = 0.5,       true_score("cafe:", "cccccccccc") = 0.8

The SFT data mixes good responses (8 x key) and poor ones (the prompt's second letter
repeated, or random letters that hit the key with probability 0.2), so the SFT policy
scores about 0.5-0.55 (measured): clearly imperfect.
Preference pairs are two responses drawn from that same mixture (a quarter of them cut
short), the higher-scoring one chosen: the reward model must learn "count the key letter"
from comparisons alone.

Layout of a packed batch (`pack`): prompts left-padded to P tokens, responses right-padded
to R tokens, `position_ids = cumsum(attention_mask) - 1`, so every response starts at
column P and a left-padded row gives the same positions as the unpadded sequence.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

TASK_LETTERS = "abcdefgh"
TASK_RESPONSE_LEN = 8
GOOD_FRACTION = 0.5
POOR_KEY_PROB = 0.2
TRUNCATE_PROB = 0.2
EXTEND_PROB = 0.2
CHAR_VOCAB = " abcdefghijklmnopqrstuvwxyz0123456789:.,;!?-+=*/()'\"\n"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


# ---------------------------------------------------------------- tokenizer


def build_char_tokenizer():
    """A character-level tokenizer (`tokenizers` WordLevel) with <pad>, <bos>, <eos>, <unk>;
    encoding a text with special tokens prepends <bos>. Saved and reloaded with AutoTokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(CHAR_VOCAB))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def ensure_pad_token(tokenizer) -> None:
    """Use EOS as the pad token (with a warning) when the tokenizer has none."""
    if tokenizer.pad_token_id is not None:
        return
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has neither a pad token nor an EOS token; set one of them")
    warnings.warn(f"tokenizer has no pad token; using the EOS token {tokenizer.eos_token!r} as pad", stacklevel=2)
    tokenizer.pad_token = tokenizer.eos_token


def encode_prompts(tokenizer, prompts: list[str], max_len: int) -> list[list[int]]:
    """Token ids per prompt (with the tokenizer's own special tokens, e.g. BOS); prompts longer
    than `max_len` keep their last `max_len` tokens, with one warning for the lot."""
    ids = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    too_long = sum(len(x) > max_len for x in ids)
    if too_long:
        warnings.warn(f"{too_long} of {len(ids)} prompts are longer than max_prompt_len={max_len} tokens; "
                      "keeping their last tokens", stacklevel=2)
    return [x[-max_len:] for x in ids]


def encode_responses(tokenizer, responses: list[str], max_len: int) -> list[list[int]]:
    """Token ids per response followed by EOS, cut to `max_len` tokens."""
    eos = tokenizer.eos_token_id
    return [(tokenizer(r, add_special_tokens=False)["input_ids"] + [eos])[:max_len] for r in responses]


# ---------------------------------------------------------------- collation


class Batch(NamedTuple):
    """Prompts left-padded to P columns, responses right-padded to R columns.

    input_ids       [B, P+R] long
    attention_mask  [B, P+R] long, 1 = real token
    position_ids    [B, P+R] long, cumsum(attention_mask) - 1 (0 on padding)
    response_mask   [B, R] float, 1 = response token (EOS included)
    prompt_len      int P: response token j sits at column P + j and is predicted at column P + j - 1
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    prompt_len: int

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len:]

    def to(self, device) -> Batch:
        return Batch(*(t.to(device) for t in self[:4]), self.prompt_len)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def pack(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> Batch:
    """Collate prompts (left-padded) and responses (right-padded) into one Batch."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"pack: {len(prompt_ids)} prompts but {len(response_ids)} responses")
    B = len(prompt_ids)
    P = max(len(p) for p in prompt_ids)
    R = max(1, max(len(r) for r in response_ids))
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + R), dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[b, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        input_ids[b, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[b, P - len(p):P + len(r)] = 1
    response_mask = attention_mask[:, P:].float()
    return Batch(input_ids, attention_mask, position_ids_from_mask(attention_mask), response_mask, P)


def left_pad(prompt_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, P] of left-padded prompts, as generation wants them."""
    batch = pack(prompt_ids, [[]] * len(prompt_ids), pad_id)
    P = batch.prompt_len
    return batch.input_ids[:, :P], batch.attention_mask[:, :P]


# ---------------------------------------------------------------- JSONL


def read_jsonl(path: str, keys: tuple[str, ...]) -> list[dict]:
    """Rows of a JSONL file, each an object with string values for `keys`.

    A missing file, a malformed line or a row without a key is a ValueError naming the file
    and the line number. Blank lines are skipped.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {path!r} does not exist")
    rows = []
    with p.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON line ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with keys {list(keys)}")
            missing = [k for k in keys if not isinstance(row.get(k), str)]
            if missing:
                raise ValueError(f"{path}:{lineno}: missing string field(s) {missing}; expected keys {list(keys)}")
            rows.append({k: row[k] for k in keys})
    if not rows:
        raise ValueError(f"data file {path!r} has no rows")
    return rows


# ---------------------------------------------------------------- the synthetic task


def synthetic_prompts(n: int, rng: random.Random) -> list[str]:
    return ["".join(rng.choice(TASK_LETTERS) for _ in range(rng.randint(3, 6))) + ":" for _ in range(n)]


def _good_response(key: str) -> str:
    return key * TASK_RESPONSE_LEN


def _poor_response(prompt: str, rng: random.Random) -> str:
    """Half the time the prompt's second letter repeated (echoing the wrong letter), half the
    time random letters, each the key with probability POOR_KEY_PROB."""
    key = prompt[0]
    if rng.random() < 0.5:
        return prompt[1] * TASK_RESPONSE_LEN
    others = TASK_LETTERS.replace(key, "")
    return "".join(key if rng.random() < POOR_KEY_PROB else rng.choice(others) for _ in range(TASK_RESPONSE_LEN))


def _sample_response(prompt: str, rng: random.Random) -> str:
    return _good_response(prompt[0]) if rng.random() < GOOD_FRACTION else _poor_response(prompt, rng)


def synthetic_sft(n: int, seed: int) -> list[dict]:
    """(prompt, response) pairs from the good/poor mixture."""
    rng = random.Random(f"sft-{seed}")
    return [{"prompt": p, "response": _sample_response(p, rng)} for p in synthetic_prompts(n, rng)]


def _pair_response(prompt: str, rng: random.Random) -> str:
    """A response from the SFT mixture, cut short (0-7 letters) with probability TRUNCATE_PROB
    or run on (1-4 more letters) with probability EXTEND_PROB, so the reward model also learns
    that the length is part of the rule."""
    response = _sample_response(prompt, rng)
    u = rng.random()
    if u < TRUNCATE_PROB:
        return response[:rng.randint(0, TASK_RESPONSE_LEN - 1)]
    if u < TRUNCATE_PROB + EXTEND_PROB:
        return response + "".join(rng.choice(TASK_LETTERS) for _ in range(rng.randint(1, 4)))
    return response


def synthetic_pairs(n: int, seed: int) -> list[dict]:
    """(prompt, chosen, rejected): two responses from the SFT mixture (some cut short), ties redrawn."""
    rng = random.Random(f"rm-{seed}")
    rows = []
    while len(rows) < n:
        (prompt,) = synthetic_prompts(1, rng)
        a, b = _pair_response(prompt, rng), _pair_response(prompt, rng)
        sa, sb = true_score([prompt, prompt], [a, b])
        if sa != sb:
            chosen, rejected = (a, b) if sa > sb else (b, a)
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def synthetic_prompt_rows(n: int, seed: int, split: str = "train") -> list[dict]:
    rng = random.Random(f"ppo-{split}-{seed}")
    return [{"prompt": p} for p in synthetic_prompts(n, rng)]


def true_score(prompts: list[str], responses: list[str]) -> list[float]:
    """The synthetic task's rule: (number of the first 8 response characters equal to the
    prompt's first letter) / max(8, response length), in [0, 1]: 1 only for exactly 8 key
    letters. Also usable as a rule-based reward: `--reward fastrlhf.data:true_score`."""
    scores = []
    for prompt, response in zip(prompts, responses):
        key = prompt[:1]
        hits = sum(ch == key for ch in response[:TASK_RESPONSE_LEN]) if key else 0
        scores.append(hits / max(TASK_RESPONSE_LEN, len(response)))
    return scores
