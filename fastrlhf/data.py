"""User data, tokenisation and collation (the built-in task lives in fastrlhf.task).

Data (`load_table`) is read with the `datasets` library: a JSONL/JSON, parquet or CSV file, or
a folder written by `Dataset.save_to_disk`; the stage's columns are mapped from the user's
(`--prompt_key`, `--response_key`, `--chosen_key`, `--rejected_key`) and checked: present,
text, not null.

How a prompt and a response become one token sequence (`Encoder`):

- Plain (the tokenizer has no chat template, or `--chat_template false`): the prompt is
  tokenized with the tokenizer's own special tokens (e.g. BOS), the response without them,
  and EOS is appended to the response. The sequence is the prompt's tokens followed by the
  response's: nothing is inserted between them, so a separator (a space, a newline,
  "Answer:") belongs in the data.
- Chat template: the prompt is the user turn rendered with the generation prompt
  (`apply_chat_template(..., add_generation_prompt=True)`); the response is the tokens the
  template adds after it when the assistant's answer is rendered too (TRL's prompt-completion
  rule), cut after the last EOS among them, or followed by EOS if they hold none. A template
  that renders the prompt differently alone and followed by an answer is an error.

Over-long prompts keep their last tokens and over-long responses their first, each with one
warning that counts them. Empty responses (EOS alone) are counted in a warning.

Layout of a packed batch (`pack`): prompts left-padded to P tokens, responses right-padded
to R tokens, `position_ids = cumsum(attention_mask) - 1`, so every response starts at
column P and a left-padded row gives the same positions as the unpadded sequence.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger("fastrlhf")

IGNORE_INDEX = -100  # label of a token that is not scored (the ops' `ignore_index`)
BUILTIN = "builtin"  # `--data builtin`: the built-in task
AUTO = "auto"  # `--data auto`: the built-in task where it fits the model, else an error
TABLE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


# ---------------------------------------------------------------- reading user data


def _first_bad_json_line(path: Path) -> str:
    """Where a JSON-lines file stops parsing, as 'path:line: ...' (for the error message)."""
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                return f"{path}:{lineno}: malformed JSON line ({e.msg})"
    return f"{path}: not a JSON-lines file"


def _read(path: Path, where: str):
    import datasets

    datasets.disable_progress_bars()
    if path.is_dir():
        try:
            table = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"{where}: {path} is not a folder written by Dataset.save_to_disk ({e})") from None
        if isinstance(table, datasets.DatasetDict):
            if "train" not in table:
                raise ValueError(f"{where}: {path} holds splits {list(table)} but no 'train' split")
            table = table["train"]
        return table
    fmt = TABLE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{where}: cannot read {path}: expected a file ending in "
                         f"{', '.join(TABLE_FORMATS)} or a Dataset.save_to_disk folder")
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()
    try:
        return datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as e:  # noqa: BLE001 - datasets wraps parser errors in its own types
        if fmt == "json":
            raise ValueError(f"{where}: {_first_bad_json_line(path)}") from None
        raise ValueError(f"{where}: cannot read {path} as {fmt} ({type(e).__name__}: {e})") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def load_table(path: str, columns: dict[str, str], *, where: str):
    """A `datasets.Dataset` with exactly the columns `columns` names (canonical name -> the
    user's column), each a non-null string in every row. Any problem is a ValueError that
    names `where` (e.g. "sft data"), the file and, for a bad value, the row."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{where}: {path!r} does not exist")
    table = _read(p, where)
    missing = [f"{user!r} (for the {name})" for name, user in columns.items() if user not in table.column_names]
    if missing:
        keys = ", ".join(f"--{name}_key" for name, user in columns.items() if user not in table.column_names)
        raise ValueError(f"{where}: {path} has no column {', '.join(missing)}; its columns are "
                         f"{table.column_names} (map yours with {keys})")
    if len(table) == 0:
        raise ValueError(f"{where}: {path} has no rows")
    table = table.select_columns(list(columns.values()))
    for user in columns.values():
        for i, value in enumerate(table[user]):
            if not isinstance(value, str):
                got = "null" if value is None else f"a {type(value).__name__} ({value!r:.40})"
                raise ValueError(f"{where}: {path} row {i}: column {user!r} is {got}; expected text")
    rename = {user: name for name, user in columns.items() if user != name}
    return table.rename_columns(rename) if rename else table


def builtin_table(rows: list[dict]):
    """The built-in task's rows as a `datasets.Dataset`, like user data."""
    import datasets

    return datasets.Dataset.from_list(rows)


# ---------------------------------------------------------------- tokenizer


def ensure_pad_token(tokenizer) -> None:
    """Use EOS as the pad token (with a warning) when the tokenizer has none."""
    if tokenizer.pad_token_id is not None:
        return
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has neither a pad token nor an EOS token; set one of them")
    warnings.warn(f"tokenizer has no pad token; using the EOS token {tokenizer.eos_token!r} as pad", stacklevel=2)
    tokenizer.pad_token = tokenizer.eos_token


class Encoder:
    """Prompts and responses -> token ids, by the rule in this module's docstring.
    `chat_template` asks for the tokenizer's chat template; it is used only when there is one."""

    def __init__(self, tokenizer, *, chat_template: bool = True):
        self.tokenizer = tokenizer
        self.uses_template = bool(chat_template and getattr(tokenizer, "chat_template", None))

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                 tokenize=True, return_dict=True)
        return list(out["input_ids"])

    def prompt(self, text: str) -> list[int]:
        if self.uses_template:
            return self._render([{"role": "user", "content": text}], True)
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def response(self, prompt_text: str, prompt_ids: list[int], text: str) -> list[int]:
        """The response's tokens, EOS last (unless the template put one earlier and text after it)."""
        eos = self.tokenizer.eos_token_id
        if not self.uses_template:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [eos]
        full = self._render([{"role": "user", "content": prompt_text}, {"role": "assistant", "content": text}], False)
        if full[:len(prompt_ids)] != prompt_ids:
            raise ValueError(f"the tokenizer's chat template renders the prompt {prompt_text!r:.60} differently "
                             "alone and followed by an answer; pass --chat_template false to join plain tokens")
        ids = full[len(prompt_ids):]
        if eos in ids:
            return ids[:len(ids) - ids[::-1].index(eos)]
        return ids + [eos]

    def prompts(self, texts: list[str]) -> list[list[int]]:
        return [self.prompt(t) for t in texts]

    def responses(self, prompt_texts: list[str], prompt_ids: list[list[int]], texts: list[str],
                  *, what: str = "responses", warn_empty: bool = True) -> list[list[int]]:
        """Token ids per response (EOS included); warns with a count when some are empty."""
        ids = [self.response(p, pi, t) for p, pi, t in zip(prompt_texts, prompt_ids, texts)]
        empty = sum(not t.strip() for t in texts)
        if empty and warn_empty:
            warnings.warn(f"{empty} of {len(texts)} {what} are empty: the model is trained to answer with "
                          "EOS alone there", stacklevel=2)
        return ids


def truncate_prompts(ids: list[list[int]], max_len: int, *, what: str = "prompts") -> list[list[int]]:
    """Keep the last `max_len` tokens of each prompt, with one warning that counts the cut ones."""
    too_long = sum(len(x) > max_len for x in ids)
    if too_long:
        warnings.warn(f"{too_long} of {len(ids)} {what} are longer than max_prompt_len={max_len} tokens; "
                      "keeping their last tokens", stacklevel=2)
    return [x[-max_len:] for x in ids]


def truncate_responses(ids: list[list[int]], max_len: int, *, what: str = "responses") -> list[list[int]]:
    """Keep the first `max_len` tokens of each response (EOS included), with one warning that
    counts the cut ones (they lose their EOS)."""
    too_long = sum(len(x) > max_len for x in ids)
    if too_long:
        warnings.warn(f"{too_long} of {len(ids)} {what} are longer than max_response_len={max_len} tokens "
                      "(EOS included); keeping their first tokens, without EOS", stacklevel=2)
    return [x[:max_len] for x in ids]


def auto_lengths(longest_prompt: int, longest_response: int | None, max_positions: int | None, *,
                 max_prompt_len: int, max_response_len: int, where: str) -> tuple[int, int]:
    """(max_prompt_len, max_response_len), where a 0 means "from the data": the longest prompt
    and the longest response. When both cannot fit the model's `max_positions`, the prompt gets
    at most half and the response the rest. With no responses in the data
    (`longest_response=None`, PPO prompts) the response gets what the prompt leaves of
    `max_positions`. Values given explicitly are kept, but prompt + response must fit."""
    if longest_response is None and not max_response_len and not max_positions:
        raise ValueError(f"{where}: the model states no max_position_embeddings to derive the response length "
                         "from; set it explicitly")
    limit = max_positions or (longest_prompt + (longest_response or max_response_len))
    wanted_r = max_response_len or (longest_response if longest_response is not None else 1)
    P = max_prompt_len or (longest_prompt if longest_prompt + wanted_r <= limit else max(1, min(longest_prompt,
                                                                                               limit // 2)))
    if max_response_len:
        R = max_response_len
    elif longest_response is None:
        R = limit - P
    else:
        R = min(longest_response, limit - P)
    if max_positions and P + R > max_positions:
        raise ValueError(f"{where}: max_prompt_len {P} + response length {R} exceed the model's "
                         f"max_position_embeddings {max_positions}")
    if P < 1 or R < 1:
        raise ValueError(f"{where}: prompt length {P} and response length {R} must both be at least 1")
    return P, R


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
