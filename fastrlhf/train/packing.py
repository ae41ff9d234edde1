"""Packed, token-budget micro-batches (`--micro_batch_tokens N`): whole sequences laid end to end
in one row of at most N tokens, with no padding inside it.

A rollout's `Batch` holds B rows: prompts left-padded to P columns, responses right-padded to R,
so a micro-batch of rows costs rows x (P + R) token positions whatever its sequences' lengths. A
pack takes the real tokens of each of its sequences (prompt + response: `Lengths`) end to end,
[1, n] with n <= N, with position_ids restarting at 0 for every sequence. Attention keeps the
sequences apart through those position_ids: called without an attention mask, transformers
(5.x `masking_utils`) finds the packed sequences from them and builds a block-diagonal causal mask
for SDPA (the CPU path), a BlockMask for flex_attention, and takes flash_attention_2's varlen path
(`devices.attention_backend` picks it where flash-attn is installed).

The hidden states that predict the response tokens are read back into rows, [n_seq, R'] (R' the
pack's longest response), so every op sees the rows and masks of the unpacked batch: per-token,
per-sequence and global normalisations are unchanged; packing changes the speed, not the gradient.

How sequences are grouped (facts read from verl 0.9.1, verl/utils/seqlen_balancing.py,
`rearrange_micro_batches`): a sequence's length is its attention-mask sum (prompt + response); the
budget must hold the longest sequence; every data-parallel rank runs the same number of
micro-batches (verl all-reduces the maximum). verl balances ceil(total / budget) partitions by
Karmarkar-Karp over 24576 L + L^2; here the rows are sorted longest first and filled next-fit, so
a pack holds sequences of similar length and its response rows [n_seq, R'] are nearly unpadded too.

The host plans, the device computes: the lengths are read once per rollout (`read_lengths`), every
index of a phase is built on the host and copied to the device in one non-blocking transfer
(`micro_batches`), so a loop over micro-batches never waits on the device for its indices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from fastrlhf.train.attention import block_causal_mask, causal_padding_mask, shared_prompt_plan, varlen_kernel
from fastrlhf.train.data import Batch


class Lengths(NamedTuple):
    """Real tokens per row of a Batch (host arrays [B] int64): the prompt's (left-padded) and the
    response's (EOS included); with `group_size` G > 1, `same_prompt` [B / G] bool: whether rows
    g G .. g G + G - 1 hold the same prompt (a group whose prompt can be shared)."""

    prompt: np.ndarray
    response: np.ndarray
    group_size: int = 1
    same_prompt: np.ndarray | None = None

    @property
    def total(self) -> np.ndarray:
        return self.prompt + self.response


def read_lengths(batch: Batch, group_size: int = 1) -> Lengths:
    """The batch's `Lengths` (with G = `group_size` > 1, whether each group's prompt columns are the
    same on every row): one read of the device."""
    P = batch.prompt_len
    if group_size > 1 and batch.input_ids.shape[0] % group_size:
        raise ValueError(f"read_lengths: {batch.input_ids.shape[0]} rows are not whole groups of group_size "
                         f"{group_size}")
    parts = [batch.attention_mask[:, :P].sum(-1), batch.response_mask.sum(-1).long()]
    if group_size > 1:
        prompts = torch.cat([batch.input_ids[:, :P], batch.attention_mask[:, :P]], dim=1).view(-1, group_size, 2 * P)
        same = (prompts == prompts[:, :1]).all(-1).all(-1)
        parts.append(same.long().repeat_interleave(group_size))
    read = torch.stack(parts).cpu().numpy().astype(np.int64)
    return Lengths(read[0], read[1], group_size, read[2, ::group_size].astype(bool) if group_size > 1 else None)


def partition(lengths: np.ndarray, rows: np.ndarray, budget: int) -> list[np.ndarray]:
    """`rows` in groups of at most `budget` tokens (lengths[row] each): sorted longest first, filled
    next-fit (a group closes when the next sequence does not fit)."""
    rows = np.asarray(rows)
    longest = int(lengths[rows].max()) if rows.size else 0
    if longest > budget:
        raise ValueError(f"micro_batch_tokens ({budget}) must hold the longest sequence ({longest} tokens, prompt and "
                         "response)")
    groups, current, used = [], [], 0
    for row in rows[np.argsort(-lengths[rows], kind="stable")]:
        n = int(lengths[row])
        if current and used + n > budget:
            groups.append(np.array(current, dtype=np.int64))
            current, used = [], 0
        current.append(row)
        used += n
    if current:
        groups.append(np.array(current, dtype=np.int64))
    return groups


class Units(NamedTuple):
    """The rows of a shared-prompt pack: units of rows that share one prompt (a group, or one row),
    each laid out as [prompt, response 1, ..., response k], the prompt's real tokens once."""

    units: tuple[np.ndarray, ...]

    @property
    def rows(self) -> np.ndarray:
        return np.concatenate(self.units)


@dataclasses.dataclass
class MicroBatch:
    """Rows of a Batch processed together, on the device: padded rows (`tokens` None: the rows as the
    Batch holds them, [n_seq, P + R]; the loss reads [n_seq, R]) or a pack (one row of the sequences'
    real tokens: `tokens` indexes the Batch's flattened [B * (P + R)] tensors). A pack's loss layout:
    `index` into the flattened [B * R] per-response-token tensors and `slots`, the pack position of
    the hidden state that predicts each of those tokens, both [n_seq, R'] (rows, R' the pack's
    longest response; 0 past a row's end) or [1, n] (`flat`: only the n real response tokens, for
    the token-level aggregations). `live` False: a stand-in that runs the forwards (every
    data-parallel rank must run as many) and counts nothing (its mask is zero)."""

    rows: torch.Tensor
    tokens: torch.Tensor | None = None
    index: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    """A pack: [n_seq + 1] int32 offsets of its sequences (a varlen kernel's cu_seqlens)."""
    max_length: int = 0
    """A pack: its longest sequence (host)."""
    segments: torch.Tensor | None = None
    """A shared-prompt pack: [2, n], each token's unit and its member in it (0: the prompt, i: response
    i), what its attention mask is made of (fastrlhf.train.attention.shared_prompt_plan)."""
    has_padding: bool = True
    """Padded rows: whether any row is shorter than the Batch's width (host)."""
    live: bool = True
    n_tokens: int = 0
    """Response tokens it holds (host; 0 for a stand-in)."""
    n_sequences: int = 0
    """Sequences with a response token it holds (host; 0 for a stand-in)."""

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """A per-response-token tensor [B, R, ...] in this micro-batch's loss layout."""
        if self.index is None:
            return x[self.rows]
        return x.reshape(-1, *x.shape[2:])[self.index]

    def put(self, out: torch.Tensor, value: torch.Tensor) -> None:
        """Write `value` (the loss layout) into its places of `out` [B, R]."""
        if self.index is None:
            out[self.rows] = value
        else:
            out.view(-1)[self.index] = value

    def response_mask(self, batch: Batch) -> torch.Tensor:
        mask = self.take(batch.response_mask)
        return mask if self.live else torch.zeros_like(mask)


def forward_responses(fn: Callable, batch: Batch, mb: MicroBatch) -> tuple:
    """fn(input_ids, attention_mask, position_ids, attention=...) -> tensors [b, T, ...] (or None), run
    on the micro-batch's rows (padded) or its pack, with its attention planned on the host
    (fastrlhf.train.attention: no device read); each output at the positions that predict the response
    tokens, in the loss layout."""
    if mb.tokens is None:
        mask = batch.attention_mask[mb.rows]
        planned = {"fastrlhf_mask": causal_padding_mask(mask)} if mb.has_padding else {}
        outs = fn(batch.input_ids[mb.rows], mask, batch.position_ids[mb.rows], attention=planned)
        P = batch.prompt_len
        return tuple(None if o is None else o[:, P - 1:-1] for o in outs)
    ids = batch.input_ids.reshape(-1)[mb.tokens].unsqueeze(0)
    positions = batch.position_ids.reshape(-1)[mb.tokens].unsqueeze(0)
    if mb.segments is not None:  # a response sees its unit's prompt and itself
        planned = shared_prompt_plan(mb.segments)
    else:
        planned = {"cu_seq_lens_q": mb.cu_seqlens, "max_length_q": mb.max_length}
        if not (ids.is_cuda and varlen_kernel() is not None):  # SDPA with the block-diagonal causal mask
            planned["fastrlhf_mask"] = block_causal_mask((positions[0] == 0).cumsum(0))
    outs = fn(ids, None, positions, attention=planned)
    return tuple(None if o is None else o[0, mb.slots] for o in outs)


def _pack_index(lengths: Lengths, rows: np.ndarray, batch: Batch, flat: bool) -> list[np.ndarray]:
    """[tokens, index, slots, cu_seqlens] of a pack of `rows`: sequence i takes the Batch's columns
    [P - p_i, P + r_i) of its row; its response token j is predicted at pack position
    start_i + p_i + j - 1."""
    p, r = lengths.prompt[rows], lengths.response[rows]
    if (p < 1).any():
        raise ValueError(f"packing: row {int(rows[np.argmin(p)])} has no prompt token (a response is predicted from "
                         "the prompt's last token)")
    P, width, R = batch.prompt_len, batch.input_ids.shape[1], batch.response_mask.shape[1]
    cu = np.concatenate([[0], np.cumsum(p + r)])
    tokens = np.concatenate([row * width + np.arange(P - pi, P + ri) for row, pi, ri in zip(rows, p, r)])
    if flat:
        index = np.concatenate([row * R + np.arange(ri) for row, ri in zip(rows, r)])[None]
        slots = np.concatenate([start + pi - 1 + np.arange(ri) for start, pi, ri in zip(cu, p, r)])[None]
    else:
        j = np.arange(max(1, int(r.max())))
        live = j < r[:, None]
        index = rows[:, None] * R + j
        slots = np.where(live, cu[:-1, None] + p[:, None] + j - 1, 0)
    return [tokens, index, slots, cu]


def _shared_index(lengths: Lengths, units: Units, batch: Batch, flat: bool) -> list[np.ndarray]:
    """[tokens, index, slots, segments] of a shared-prompt pack: a unit of rows sharing a prompt of p
    tokens, starting at pack position s, holds that prompt once (the Batch's columns [P - p, P) of its
    first row), then each row's response (columns [P, P + r_i)); response i's token 0 is predicted at the
    prompt's last position s + p - 1, its token j > 0 at its own token j - 1."""
    P, width, R = batch.prompt_len, batch.input_ids.shape[1], batch.response_mask.shape[1]
    tokens, unit, member, slots, start = [], [], [], [], 0
    for u, rows in enumerate(units.units):
        p, r = lengths.prompt[rows], lengths.response[rows]
        if (p != p[0]).any() or p[0] < 1:
            raise ValueError(f"shared prompt: rows {rows.tolist()} have prompts of {p.tolist()} tokens (one shared "
                             "prompt of at least one token expected)")
        p = int(p[0])
        tokens += [rows[0] * width + np.arange(P - p, P)]
        tokens += [row * width + np.arange(P, P + n) for row, n in zip(rows, r)]
        unit.append(np.full(p + int(r.sum()), u))
        member += [np.zeros(p, np.int64)] + [np.full(n, i + 1) for i, n in enumerate(r)]
        begins = start + p + np.concatenate([[0], np.cumsum(r)[:-1]])  # each response's first pack position
        slots += [np.concatenate([[start + p - 1], first + np.arange(n - 1)])[:n] for first, n in zip(begins, r)]
        start += p + int(r.sum())
    rows = units.rows
    if flat:
        index = np.concatenate([row * R + np.arange(n) for row, n in zip(rows, lengths.response[rows])])[None]
        slot = np.concatenate(slots)[None]
    else:
        index = rows[:, None] * R + np.arange(max(1, int(lengths.response[rows].max())))
        slot = np.zeros(index.shape, np.int64)  # 0 past a row's end, as a pack's
        for i, s in enumerate(slots):
            slot[i, :len(s)] = s
    return [np.concatenate(tokens), index, slot, np.stack([np.concatenate(unit), np.concatenate(member)])]


def micro_batches(batch: Batch, groups: Sequence[Sequence[np.ndarray | Units]], lengths: Lengths, *, packed: bool,
                  flat: bool = False, device: torch.device, stand_ins: Sequence[int] = ()) -> list[list[MicroBatch]]:
    """Device micro-batches of `groups` (per minibatch, the row groups of its micro-batches): packs
    (their losses read only the real response tokens with `flat`), or padded rows; a `Units` group is a
    shared-prompt pack, packed or not. `stand_ins[k]`: how many non-live micro-batches (one short
    sequence each) to append to minibatch k (data-parallel ranks with fewer micro-batches than
    another). Every index goes to the device in one transfer."""
    width = batch.input_ids.shape[1]
    arrays, layout = [], []
    for k, minibatch in enumerate(groups):
        specs = [(spec, True) for spec in minibatch]
        if stand_ins and stand_ins[k]:
            every = np.concatenate([rows_of(spec) for spec in minibatch])
            specs += [(every[np.argmin(lengths.total[every])].reshape(1), False)] * stand_ins[k]
        layout.append([])
        for spec, live in specs:
            rows = rows_of(spec)
            host = {"live": live, "n_tokens": int(lengths.response[rows].sum()) if live else 0,
                    "n_sequences": int((lengths.response[rows] > 0).sum()) if live else 0}
            if isinstance(spec, Units):
                arrays += [rows, *_shared_index(lengths, spec, batch, flat)]
                kind = "shared"
            elif packed:
                arrays += [rows, *_pack_index(lengths, rows, batch, flat)]
                host["max_length"], kind = int(lengths.total[rows].max()), "pack"
            else:
                arrays.append(rows)
                host["has_padding"], kind = bool((lengths.total[rows] < width).any()), "rows"
            layout[-1].append((kind, host))
    flat_arrays = iter(_upload(arrays, device))
    out = []
    for specs in layout:
        out.append([])
        for kind, host in specs:
            if kind == "rows":
                out[-1].append(MicroBatch(next(flat_arrays), **host))
                continue
            rows, tokens, index, slots, last = (next(flat_arrays) for _ in range(5))
            if kind == "shared":
                out[-1].append(MicroBatch(rows, tokens, index, slots, segments=last, **host))
            else:
                out[-1].append(MicroBatch(rows, tokens, index, slots, last.to(torch.int32), **host))
    return out


def rows_of(spec: np.ndarray | Units) -> np.ndarray:
    """The Batch rows of a micro-batch's spec (its rows, or a shared-prompt pack's)."""
    return spec.rows if isinstance(spec, Units) else np.asarray(spec, dtype=np.int64)


def _upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays as int64 tensors on `device`, copied in one transfer (pinned and non-blocking on
    CUDA: the host does not wait for the device)."""
    sizes = [a.size for a in arrays]
    flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0, np.int64))
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return [t.view(a.shape) for t, a in zip(torch.split(flat, sizes), arrays)]


def padding_fraction(lengths: Lengths, groups: Sequence[np.ndarray], *, packed: bool, prompt_len: int,
                     response_len: int, flat: bool = False) -> dict[str, float]:
    """The share of the token positions processed that are padding, over `groups` (the micro-batches'
    rows of a Batch [B, P + R]): `trunk` (the decoder stack: rows x (P + R) padded, only the real
    tokens packed) and `loss` (the response positions the loss reads: rows x R padded, rows x R'
    packed, only the real ones packed `flat`)."""
    real = sum(int(lengths.total[g].sum()) for g in groups)
    real_responses = sum(int(lengths.response[g].sum()) for g in groups)
    if packed:
        trunk = real
        loss = real_responses if flat else sum(len(g) * int(lengths.response[g].max()) for g in groups)
    else:
        trunk = sum(len(g) * (prompt_len + response_len) for g in groups)
        loss = sum(len(g) * response_len for g in groups)
    return {"trunk": 1 - real / max(1, trunk), "loss": 1 - real_responses / max(1, loss)}
