"""User data, tokenisation and collation (the built-in task lives in fastrlhf.task).

Layout of a packed batch (`pack`): prompts left-padded to P tokens, responses right-padded
to R tokens, `position_ids = cumsum(attention_mask) - 1`, so every response starts at
column P and a left-padded row gives the same positions as the unpadded sequence.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

IGNORE_INDEX = -100  # label of a token that is not scored (the ops' `ignore_index`)


# ---------------------------------------------------------------- tokenizer


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

    @property
    def labels(self) -> torch.Tensor:
        """[B, R] response token ids, IGNORE_INDEX where response_mask is 0."""
        return torch.where(self.response_mask.bool(), self.responses, IGNORE_INDEX)

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
