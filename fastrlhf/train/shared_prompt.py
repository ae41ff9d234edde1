"""Shared-prompt packs (`--shared_prompt on|off|auto`): the G responses to one prompt forwarded as one
unit [prompt, response 1, ..., response G], the prompt's real tokens once, P + sum R_i tokens instead of
sum (P + R_i).

Causal attention makes it exact: a prompt token's hidden state does not depend on what follows it, and
each response attends to the prompt and to itself only (fastrlhf.train.attention.shared_prompt_mask),
its position ids continuing from the prompt's end (the Batch's own). Every response's hidden states,
hence its log-probs, entropy, values and reference log-probs, are the unshared forward's; in the update
the prompt's states feed G responses and their gradients add up through the one forward.

Contract: a group is rows g G .. g G + G - 1 of a rollout (the responses to one prompt side by side) whose
prompt columns are the same (`Lengths.same_prompt`); `units` lays whole groups out as one unit each, never
split across micro-batches; a group over the token budget falls back to its rows one by one (counted and
logged by the caller); rows outside a whole group are units of one row. Everything the losses read (rows,
masks, counts) is the unshared batch's: only the forwards' layout changes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fastrlhf.constants import SHARED_PROMPT_MIN_SAVING, SHARED_PROMPT_MODES
from fastrlhf.train.packing import Lengths, Units, partition

MODES = SHARED_PROMPT_MODES
MIN_SAVING = SHARED_PROMPT_MIN_SAVING


class Saving(NamedTuple):
    """The tokens one forward over a rollout processes: shared (P + sum R_i per group) and unshared
    (sum P + R_i, the real tokens of a pack), and whether the prompt is shared."""

    shared: int
    unshared: int
    on: bool

    @property
    def fraction(self) -> float:
        return 1.0 - self.shared / max(1, self.unshared)

    def describe(self) -> str:
        counts = f"{self.shared} tokens per pass instead of {self.unshared}"
        saving = f"{self.unshared - self.shared} fewer, {100 * self.fraction:.0f}%"
        if self.on:
            return f"shared prompt on: {counts} ({saving})"
        return (f"shared prompt off: sharing would process {counts} ({saving}; auto shares from "
                f"{100 * MIN_SAVING:.0f}% with 2 or more responses per prompt)")


def token_counts(lengths: Lengths, found: list[np.ndarray] | None = None) -> tuple[int, int]:
    """(shared, unshared) tokens of one pass over every row (`found`: over these units instead of the
    groups of `lengths`): a unit of rows with the same prompt counts its prompt once."""
    if found is not None:
        rows = np.concatenate(found)
        return sum(unit_tokens(lengths, u) for u in found), int(lengths.total[rows].sum())
    unshared = int(lengths.total.sum())
    if lengths.same_prompt is None:
        return unshared, unshared
    G = lengths.group_size
    repeats = (G - 1) * int(lengths.prompt.reshape(-1, G)[lengths.same_prompt, 0].sum())
    return unshared - repeats, unshared


def decide(mode: str, lengths: Lengths, found: list[np.ndarray] | None = None) -> Saving:
    """Whether this rollout's forwards share their prompts (`found`: the units that would share, else the
    groups of `lengths`): `on`, `off`, or `auto` (on where units have 2 or more rows and the saving is at
    least MIN_SAVING)."""
    if mode not in MODES:
        raise ValueError(f"shared_prompt must be one of {', '.join(MODES)}, got {mode!r}")
    shared, unshared = token_counts(lengths, found)
    grouped = lengths.group_size > 1 if found is None else any(len(u) > 1 for u in found)
    if mode == "auto":
        on = grouped and 1.0 - shared / max(1, unshared) >= MIN_SAVING
    else:
        on = mode == "on" and grouped
    return Saving(shared, unshared, on)


def units(lengths: Lengths, rows: np.ndarray, budget: int = 0) -> tuple[list[np.ndarray], int]:
    """(units of `rows`, how many groups fell back to their rows one by one): each whole group of rows
    with the same prompt is one unit (its rows in order) unless its P + sum R_i exceeds `budget`
    (> 0); any other row is a unit of its own."""
    G = lengths.group_size
    rows = np.asarray(rows, dtype=np.int64)
    out, fallbacks, seen = [], 0, set()
    present = set(rows.tolist())
    for row in rows.tolist():
        g = row // G
        if g in seen:
            continue
        members = np.arange(g * G, (g + 1) * G)
        whole = G > 1 and lengths.same_prompt is not None and lengths.same_prompt[g] and present.issuperset(
            members.tolist())
        if not whole:
            out.append(np.array([row]))
            continue
        seen.add(g)
        size = int(lengths.prompt[g * G] + lengths.response[members].sum())
        if budget and size > budget:
            out += [np.array([m]) for m in members]
            fallbacks += 1
        else:
            out.append(members)
    return out, fallbacks


def unit_tokens(lengths: Lengths, unit: np.ndarray) -> int:
    """The tokens a unit's forward processes: its prompt once and every response."""
    return int(lengths.prompt[unit[0]] + lengths.response[unit].sum())


def packs(lengths: Lengths, rows: np.ndarray, budget: int, per_pack: int = 0) -> tuple[list[Units], int]:
    """(shared-prompt packs of `rows`, groups fallen back): the units packed by tokens into `budget`
    (> 0: longest first, next-fit, a unit never split), else `per_pack` rows' worth of units each (at
    least one unit; 0: all in one pack)."""
    found, fallbacks = units(lengths, rows, budget)
    if budget > 0:
        sizes = np.array([unit_tokens(lengths, u) for u in found], dtype=np.int64)
        return [Units(tuple(found[i] for i in group)) for group in partition(sizes, np.arange(len(found)),
                                                                              budget)], fallbacks
    out, current, held = [], [], 0
    for unit in found:
        if current and per_pack and held + len(unit) > per_pack:
            out.append(Units(tuple(current)))
            current, held = [], 0
        current.append(unit)
        held += len(unit)
    if current:
        out.append(Units(tuple(current)))
    return out, fallbacks
