"""User data, tokenisation and collation (the built-in task lives in fastrlhf.train.task).

Data (`load_table`) is read with the `datasets` library: a JSONL/JSON, parquet or CSV file, or
a folder written by `Dataset.save_to_disk`; the stage's columns are mapped from the user's
(`--prompt_key`, `--response_key`, `--chosen_key`, `--rejected_key`) and checked: present,
text, not null.

How a prompt and a response become one token sequence (`Encoder`):

- Plain (the tokenizer has no chat template, or `--chat_template false`): the prompt is
  tokenized alone, with the tokenizer's own special tokens (e.g. BOS): these are the tokens
  PPO's rollout conditions on. The response is what follows them when prompt + response is
  tokenized as one text, and EOS is appended. The sequence is thus the tokenization of
  prompt + response: nothing is inserted between them (a normalizer that prepends "▁" to
  every text, as legacy Llama-2 tokenizers do, applies once), so a separator (a space, a
  newline, "Answer:") belongs in the data. When the prompt's tokens are not a prefix of the
  joint tokens (tokens merge across the boundary, e.g. a prompt ending in a space), the
  response is tokenized alone and follows the prompt's own tokens, with one warning that
  counts such rows: the prompt stays what generation sees. (TRL's prompt-completion SFT
  starts the completion where the two tokenizations diverge and warns, training on a
  prompt cut short; OpenRLHF's SFT splits the joint tokens at the prompt's length unchecked.)
- A prompt that encodes to no tokens (an empty prompt with a tokenizer that adds no BOS)
  is an error in every stage's data (`Encoder.prompts(..., where=...)`), naming its row:
  its first response token would be predicted from a padding column. (OpenRLHF drops such
  rows silently.)
- Chat template: the prompt is the user turn rendered with the generation prompt
  (`apply_chat_template(..., add_generation_prompt=True)`); the response is the tokens the
  template adds after it when the assistant's answer is rendered too (TRL's prompt-completion
  rule), cut after the last EOS among them, or followed by EOS if they hold none. A template
  that renders the prompt differently alone and followed by an answer is an error.

Over-long prompts keep their last tokens and over-long responses their first, each with one
warning that counts them. Empty prompts and empty responses (EOS alone) are counted in a warning.

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

from fastrlhf.constants import IGNORE_INDEX
from fastrlhf.train import distributed
from fastrlhf.train.metrics import progress

log = logging.getLogger("fastrlhf")

BUILTIN = "builtin"  # `--data builtin`: the built-in task
AUTO = "auto"  # `--data auto`: the built-in task where it fits the model, else an error
TABLE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Encoding this many texts or more shows progress on rank 0 (a chat template renders some 10k rows/s on
# a CPU core: a million rows is minutes); the plain rule tokenizes in blocks of ENCODE_BLOCK texts.
PROGRESS_TEXTS = 20_000
ENCODE_BLOCK = 4096


# ---------------------------------------------------------------- reading user data


def _utf8_lines(path: Path):
    """(line number, text) of each line of a text file; a line that is not UTF-8 is a ValueError
    naming the file, the line and the byte."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                 f"{e.start + 1}); save the file as UTF-8") from None


def _diagnose(path: Path, fmt: str) -> str | None:
    """Why a text file the reader refused is bad, as 'path:line: ...': a line that is not UTF-8,
    or (JSON lines) the first line that does not parse; None when neither is found."""
    try:
        if fmt == "json":
            return _first_bad_json_line(path)
        for _ in _utf8_lines(path):
            pass
    except ValueError as e:
        return str(e)
    return None


def _unique_keys(pairs: list[tuple]) -> dict:
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"key {twice[0]!r} appears twice in one object")
    return dict(pairs)


def _first_bad_json_line(path: Path) -> str:
    """Where a JSON-lines file stops parsing, as 'path:line: ...' (for the error message)."""
    for lineno, line in _utf8_lines(path):
        if not line.strip():
            continue
        try:
            json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as e:
            return f"{path}:{lineno}: malformed JSON line ({e.msg})"
        except ValueError as e:
            return f"{path}:{lineno}: {e}"
    return f"{path}: not a JSON-lines file"


def _check_csv_header(path: Path) -> None:
    """A CSV file whose header names a column twice is an error (the reader would rename the second
    `name.1` and use the first without a word)."""
    import csv

    for _, line in _utf8_lines(path):
        header = next(csv.reader([line]))
        twice = sorted({c for c in header if header.count(c) > 1})
        if twice:
            raise ValueError(f"{path}:1: the header names column(s) {', '.join(map(repr, twice))} more than once; "
                             "give each column its own name")
        return


def _blank(path: Path) -> bool:
    """Whether the file holds nothing but whitespace (read until the first other byte)."""
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return False
    return True


def _saved_without_rows(path: Path) -> bool:
    """Whether a `save_to_disk` folder (or its 'train' split) records no data files, as an
    empty Dataset is saved (datasets cannot load it back: an IndexError deep inside)."""
    for state in (path / "state.json", path / "train" / "state.json"):
        if state.is_file():
            try:
                return not json.loads(state.read_text()).get("_data_files", [None])
            except (OSError, ValueError):
                return False
    return False


def _read(path: Path, where: str):
    import datasets

    datasets.disable_progress_bars()
    if path.is_dir():
        try:
            table = datasets.load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001 - an empty folder fails inside datasets with an IndexError
            if _saved_without_rows(path):
                raise ValueError(f"{where}: {path} has no rows") from None
            raise ValueError(f"{where}: {path} is not a folder written by Dataset.save_to_disk "
                             f"({type(e).__name__}: {e})") from None
        if isinstance(table, datasets.DatasetDict):
            if "train" not in table:
                raise ValueError(f"{where}: {path} holds splits {list(table)} but no 'train' split")
            table = table["train"]
        return table
    fmt = TABLE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{where}: cannot read {path}: expected a file ending in "
                         f"{', '.join(TABLE_FORMATS)} or a Dataset.save_to_disk folder")
    if _blank(path):
        raise ValueError(f"{where}: {path} has no rows (the file is empty or blank)")
    try:
        if fmt == "csv":
            _check_csv_header(path)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()
    try:
        return datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as e:  # noqa: BLE001 - datasets wraps parser errors in its own types
        if "corresponds to no data" in str(e):  # datasets' error for a split of 0 rows (a header-only CSV, ...)
            raise ValueError(f"{where}: {path} has no rows") from None
        found = _diagnose(path, fmt)
        if found:
            raise ValueError(f"{where}: {found}") from None
        raise ValueError(f"{where}: cannot read {path} as {fmt} ({type(e).__name__}: {e})") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def load_table(path: str, columns: dict[str, str], *, where: str, key_prefix: str = ""):
    """A `datasets.Dataset` with exactly the columns `columns` names (canonical name -> the
    user's column), each a non-null string in every row. Any problem (no rows included) is a
    ValueError that names `where` (e.g. "sft data"), the file and, for a bad value, the row. A
    missing column names the flag that maps it, `--{key_prefix}{name}_key` (key_prefix "rm."
    in the pipeline)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{where}: {path!r} does not exist")
    table = _read(p, where)
    absent = [name for name, user in columns.items() if user not in table.column_names]
    if absent:
        missing = ", ".join(f"{columns[name]!r} (for the {name})" for name in absent)
        keys = ", ".join(f"--{key_prefix}{name}_key" for name in absent)
        raise ValueError(f"{where}: {path} has no column {missing}; its columns are "
                         f"{table.column_names} (map yours with {keys})")
    if len(table) == 0:
        raise ValueError(f"{where}: {path} has no rows")
    table = table.select_columns(list(columns.values()))
    try:
        for user in columns.values():
            for i, value in enumerate(table[user]):
                if not isinstance(value, str):
                    got = "null" if value is None else f"a {type(value).__name__} ({value!r:.40})"
                    raise ValueError(f"{where}: {path} row {i}: column {user!r} is {got}; expected text")
    except UnicodeDecodeError:  # the JSON reader keeps bytes that are not UTF-8 until a value is read
        raise ValueError(f"{where}: {_diagnose(p, 'text') or f'{path} holds text that is not UTF-8'}") from None
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
    `chat_template` asks for the tokenizer's chat template; it is used only when there is one.
    With `vocab_size` (the model's embedding rows), an id at or past it is an error naming the token
    and the row (a special token the model has no embedding for, e.g. an unk the data produced)."""

    def __init__(self, tokenizer, *, chat_template: bool = True, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.uses_template = bool(chat_template and getattr(tokenizer, "chat_template", None))
        self.vocab_size = vocab_size

    def _check_ids(self, ids: list[list[int]], what: str, where: str | None) -> None:
        if self.vocab_size is None:
            return
        for row, x in enumerate(ids):
            if x and max(x) >= self.vocab_size:
                i = max(x)
                raise ValueError(f"{where or 'data'}: {what} row {row} encodes to token "
                                 f"{self.tokenizer.convert_ids_to_tokens(i)!r} (id {i}), outside the model's embedding "
                                 f"(vocab_size {self.vocab_size}); remove it from the data or resize the embeddings "
                                 "(model.resize_token_embeddings(len(tokenizer))) and save the model again")

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                 tokenize=True, return_dict=True)
        return list(out["input_ids"])

    def _tokenize(self, texts: list[str], special: bool, what: str) -> list[list[int]]:
        """Plain token ids of many texts, in batched tokenizer calls of ENCODE_BLOCK texts each."""
        texts, out, bar = list(texts), [], _progress(len(texts), what)
        for i in range(0, len(texts), ENCODE_BLOCK):
            block = texts[i:i + ENCODE_BLOCK]
            out += [list(x) for x in self.tokenizer(block, add_special_tokens=special)["input_ids"]]
            bar.update(len(block))
        bar.close()
        return out

    def prompts(self, texts: list[str], *, where: str | None = None) -> list[list[int]]:
        """Token ids per prompt. With `where` (the data, e.g. "sft data: q.jsonl"), a prompt that
        encodes to no tokens is an error naming it and its row: its first response token would be
        predicted from a padding column (an empty prompt with a tokenizer that adds no BOS)."""
        if self.uses_template:
            ids = [self._render([{"role": "user", "content": t}], True) for t in _each(texts, "prompts")]
        else:
            ids = self._tokenize(texts, True, "prompts")
        empty = [i for i, x in enumerate(ids) if not x]
        if where is not None and empty:
            raise ValueError(f"{where}: {len(empty)} of {len(ids)} prompts encode to no tokens (first: row "
                             f"{empty[0]}, prompt {texts[empty[0]]!r:.60}) and the tokenizer adds no BOS token: "
                             "the first response token would be predicted from a padding column; give every row "
                             "a non-empty prompt")
        blank = [i for i, t in enumerate(texts) if not t.strip()]
        if where is not None and blank:
            seen = "the chat template's turn" if self.uses_template else "the tokenizer's special tokens"
            warnings.warn(f"{where}: {len(blank)} of {len(texts)} prompts are empty or blank (first: row {blank[0]}); "
                          f"the model sees {seen} alone there", stacklevel=2)
        self._check_ids(ids, "prompt", where)
        return ids

    def _template_response(self, prompt_text: str, prompt_ids: list[int], text: str) -> list[int]:
        eos = self.tokenizer.eos_token_id
        full = self._render([{"role": "user", "content": prompt_text}, {"role": "assistant", "content": text}], False)
        if full[:len(prompt_ids)] != prompt_ids:
            raise ValueError(f"the tokenizer's chat template renders the prompt {prompt_text!r:.60} differently "
                             "alone and followed by an answer; pass --chat_template false to join plain tokens")
        ids = full[len(prompt_ids):]
        if eos in ids:
            return ids[:len(ids) - ids[::-1].index(eos)]
        return ids + [eos]

    def _plain_responses(self, prompt_texts: list[str], prompt_ids: list[list[int]],
                         texts: list[str], what: str) -> list[list[int]]:
        """The tokens that follow each prompt's in the tokenized prompt + response, EOS appended.
        Where the prompt's tokens are not a prefix of those (tokens merge across the boundary),
        the response is tokenized alone, after the prompt's own tokens: one warning counts them."""
        eos = self.tokenizer.eos_token_id
        joint = self._tokenize([p + t for p, t in zip(prompt_texts, texts)], True, what)
        merged = [i for i, (p, j) in enumerate(zip(prompt_ids, joint)) if j[:len(p)] != p]
        out = [j[len(p):] for p, j in zip(prompt_ids, joint)]
        for i, ids in zip(merged, self._tokenize([texts[i] for i in merged], False, f"{what} alone")):
            out[i] = ids
        if merged:
            i = merged[0]
            decode = self.tokenizer.decode
            changed = sum(decode(prompt_ids[k] + out[k]) != decode(joint[k]) for k in merged)
            note = (f"; in {changed} of them the text reads differently (the tokenizer adds to every text it "
                    "encodes, e.g. a leading '▁'): check the tokenizer" if changed else "")
            warnings.warn(f"{len(merged)} of {len(texts)} {what}: tokenized after their prompt, the tokens merge "
                          f"across the boundary (first: prompt {prompt_texts[i]!r:.40}, response {texts[i]!r:.40}); "
                          "those responses are tokenized alone after the prompt's own tokens, the context "
                          "generation sees. A prompt that ends on a token boundary (no trailing space) avoids "
                          f"it{note}",
                          stacklevel=3)
        return [ids + [eos] for ids in out]

    def responses(self, prompt_texts: list[str], prompt_ids: list[list[int]], texts: list[str],
                  *, what: str = "responses", warn_empty: bool = True, where: str | None = None) -> list[list[int]]:
        """Token ids per response (EOS included), given each prompt's text and its untruncated ids
        from `prompts`; warns with a count when some are empty."""
        if self.uses_template:
            rows = _each(list(zip(prompt_texts, prompt_ids, texts)), what)
            ids = [self._template_response(p, pi, t) for p, pi, t in rows]
        else:
            ids = self._plain_responses(prompt_texts, prompt_ids, texts, what)
        empty = sum(not t.strip() for t in texts)
        if empty and warn_empty:
            warnings.warn(f"{empty} of {len(texts)} {what} are empty: the model is trained to answer with "
                          "EOS alone there", stacklevel=2)
        self._check_ids(ids, what.removesuffix("s"), where)
        return ids


def _progress(n: int, what: str):
    return progress(n, 0, f"encoding {what}", show=n >= PROGRESS_TEXTS and distributed.is_main())


def _each(items: list, what: str):
    """The items, with progress (rank 0) when there are PROGRESS_TEXTS or more."""
    bar = _progress(len(items), what)
    for x in items:
        yield x
        bar.update()
    bar.close()


def truncate_prompts(ids: list[list[int]], max_len: int, *, what: str = "prompts") -> list[list[int]]:
    """Keep the last `max_len` tokens of each prompt, with one warning that counts the cut ones."""
    too_long = sum(len(x) > max_len for x in ids)
    if too_long:
        warnings.warn(f"{too_long} of {len(ids)} {what} are longer than max_prompt_len={max_len} tokens; "
                      "keeping their last tokens (their start is lost: a BOS token or a chat template's header "
                      "with it)", stacklevel=2)
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


def pad_to_width_multiple(batch: Batch, multiple: int, pad_id: int) -> Batch:
    """`batch` with `-width % multiple` more prompt columns of left padding, so that its width P + R is a
    multiple of `multiple`; the real tokens, their positions and the response columns are unchanged."""
    extra = -batch.input_ids.shape[1] % multiple
    if extra == 0:
        return batch

    def left(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t.new_full((t.shape[0], extra), value), t], dim=1)

    return Batch(left(batch.input_ids, pad_id), left(batch.attention_mask, 0), left(batch.position_ids, 0),
                 batch.response_mask, batch.prompt_len + extra)


def left_pad(prompt_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, P] of left-padded prompts, as generation wants them."""
    batch = pack(prompt_ids, [[]] * len(prompt_ids), pad_id)
    P = batch.prompt_len
    return batch.input_ids[:, :P], batch.attention_mask[:, :P]
