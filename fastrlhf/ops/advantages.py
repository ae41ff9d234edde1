"""Critic-free outcome advantages: `outcome_advantages` and the `ADVANTAGES` registry
(formulas: reference.outcome_advantages; the peers' conventions behind each option: docs/ops.md).

One score per sequence r_i; group g (size n, mean m_g, std s_g) of sequence i:
    grpo                   a_i = (r_i - m_g) / (s_g + eps)          (s over the batch: scale="batch")
    dr_grpo                a_i = r_i - m_g
    rloo                   a_i = r_i - (sum_g - r_i) / (n - 1)
    reinforce_pp           a_i = r_i                                 then whitened over the tokens
    reinforce_pp_baseline  a_i = r_i - m_g                           then whitened over the tokens
then broadcast to the sequence's response tokens, 0 off the mask.

No Triton kernel: every statistic is over B scores (index_add over groups); whitening over the
tokens needs only the per-sequence token counts (token-weighted moments of B values); the one
[B, T] pass is the broadcast. Custom op: fastrlhf::outcome_advantages (no gradient: advantages
are data).

New estimators: `register_advantage("name")` on a function
`fn(scores [B], groups: Groups, *, eps, scale, unbiased, singleton) -> [B]`; a name can be
registered once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from fastrlhf.constants import ADVANTAGE_EPS, GROUP_SCALES, SINGLETON_MODES, VAR_EPS_MODES, WHITEN_EPS, WHITEN_MODES
from fastrlhf.ops._common import check_choice, check_device, check_float, check_number, check_tensor, out_dtype
from fastrlhf.ops._dispatch import register


class Groups(NamedTuple):
    """Groups of a batch: `index` [B] long in 0..G-1, `count` [G] sizes, `size` = count[index] [B]
    (all in the scores' dtype except index)."""

    index: Tensor
    count: Tensor
    size: Tensor

    def sum(self, x: Tensor) -> Tensor:
        """Per-group sums [G] of x [B]."""
        return x.new_zeros(self.count.shape).index_add_(0, self.index, x)

    def mean(self, x: Tensor) -> Tensor:
        """Each sequence's group mean [B]."""
        return (self.sum(x) / self.count)[self.index]

    def std(self, x: Tensor, unbiased: bool) -> Tensor:
        """Each sequence's group standard deviation [B]; unbiased for groups of more than one."""
        dev = x - self.mean(x)
        n = self.count - 1 if unbiased else self.count
        return (self.sum(dev * dev) / n.clamp(min=1)).sqrt()[self.index]


def batch_std(x: Tensor, unbiased: bool) -> Tensor:
    n = x.numel()
    if n == 0:
        return x.new_zeros(())
    return (((x - x.mean()) ** 2).sum() / (n - 1 if unbiased and n > 1 else n)).sqrt()


# ---------------------------------------------------------------- the registry

ADVANTAGES: dict[str, Callable] = {}
DEFAULT_WHITEN: dict[str, str] = {}
GROUPED: dict[str, bool] = {}


def register_advantage(name: str, *, whiten: str = "none", grouped: bool = True):
    """Decorator: ADVANTAGES[name] = fn, with its default whitening and whether it needs groups.
    A name already registered (to another function) is a ValueError, as verl's register_adv_est."""
    check_choice("whiten", whiten, WHITEN_MODES)

    def decorator(fn):
        if name in ADVANTAGES and ADVANTAGES[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered ({ADVANTAGES[name].__name__})")
        ADVANTAGES[name], DEFAULT_WHITEN[name], GROUPED[name] = fn, whiten, grouped
        return fn

    return decorator


def _singletons(adv: Tensor, scores: Tensor, groups: Groups, value: Tensor, singleton: str) -> Tensor:
    """Groups of one: `value` (the estimator's "baseline 0" value) for singleton="score", else 0."""
    one = groups.size == 1
    return torch.where(one, value if singleton == "score" else torch.zeros_like(scores), adv)


@register_advantage("grpo")
def grpo_advantages(scores, groups, *, eps, scale, unbiased, singleton):
    """(r - group mean) / (group std + eps); scale="batch": the std of the whole batch (TRL).
    A group of one has mean 0 and std 1 (the batch std with scale="batch")."""
    std = groups.std(scores, unbiased) if scale == "group" else batch_std(scores, unbiased).expand_as(scores)
    adv = (scores - groups.mean(scores)) / (std + eps)
    lone_std = torch.ones_like(scores) if scale == "group" else std
    return _singletons(adv, scores, groups, scores / (lone_std + eps), singleton)


@register_advantage("dr_grpo")
def dr_grpo_advantages(scores, groups, *, eps, scale, unbiased, singleton):
    """r - group mean (Dr. GRPO: no std); a group of one has mean 0."""
    return _singletons(scores - groups.mean(scores), scores, groups, scores, singleton)


@register_advantage("rloo")
def rloo_advantages(scores, groups, *, eps, scale, unbiased, singleton):
    """r minus the mean of the other members of its group, (n r - sum) / (n - 1); a group of one
    has baseline 0."""
    n = groups.size
    adv = (n * scores - groups.sum(scores)[groups.index]) / (n - 1).clamp(min=1)
    return _singletons(adv, scores, groups, scores, singleton)


@register_advantage("reinforce_pp", whiten="tokens", grouped=False)
def reinforce_pp_advantages(scores, groups, *, eps, scale, unbiased, singleton):
    """r itself: the token whitening that follows removes the batch mean (the batch baseline)."""
    return scores


@register_advantage("reinforce_pp_baseline", whiten="tokens")
def reinforce_pp_baseline_advantages(scores, groups, *, eps, scale, unbiased, singleton):
    """r - group mean, then whitened over the tokens; a group of one has mean 0."""
    return _singletons(scores - groups.mean(scores), scores, groups, scores, singleton)


# ---------------------------------------------------------------- whitening


def _whiten_tokens(adv: Tensor, n_tokens: Tensor, unbiased: bool, var_eps: float, var_eps_mode: str) -> Tensor:
    """Whitening of the [B, T] broadcast over its mask=1 tokens, from B values and their token
    counts n_b: mean = sum n_b a_b / n, var = sum n_b (a_b - mean)^2 / n (x n / (n - 1))."""
    n = n_tokens.sum()
    mean = (n_tokens * adv).sum() / n.clamp(min=1)
    var = (n_tokens * (adv - mean) ** 2).sum() / n.clamp(min=1)
    if unbiased:
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), var)
    denom = torch.sqrt(var + var_eps) if var_eps_mode == "add" else torch.sqrt(var.clamp(min=var_eps))
    return (adv - mean) / denom


def _whiten_sequences(adv: Tensor, eps: float, unbiased: bool) -> Tensor:
    """(a - mean) / (std + eps) over the B sequences (TRL RLOO's normalize_advantages)."""
    if adv.numel() == 0:
        return adv
    return (adv - adv.mean()) / (batch_std(adv, unbiased) + eps)


# ---------------------------------------------------------------- fastrlhf::outcome_advantages


def _outcome_advantages_op(scores: Tensor, mask: Tensor, group_ids: Tensor, estimator: str, eps: float, scale: str,
                           unbiased: bool, singleton: str, whiten: str, var_eps: float,
                           var_eps_mode: str) -> Tensor:
    dtype = out_dtype(scores)
    r = scores.to(dtype)
    selected = mask != 0
    if r.numel() == 0:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    _, index = torch.unique(group_ids, return_inverse=True)
    count = torch.zeros(int(index.max()) + 1, dtype=dtype, device=r.device).index_add_(0, index, torch.ones_like(r))
    groups = Groups(index, count, count[index])
    adv = ADVANTAGES[estimator](r, groups, eps=eps, scale=scale, unbiased=unbiased, singleton=singleton)
    if whiten == "tokens":
        adv = _whiten_tokens(adv, selected.sum(-1).to(dtype), unbiased, var_eps, var_eps_mode)
    elif whiten == "sequences":
        adv = _whiten_sequences(adv, eps, unbiased)
    return torch.where(selected, adv.unsqueeze(-1), torch.zeros((), dtype=dtype, device=r.device))


def _fake_outcome_advantages(scores, mask, group_ids, estimator, eps, scale, unbiased, singleton, whiten, var_eps,
                             var_eps_mode):
    return scores.new_empty(mask.shape, dtype=out_dtype(scores))


_outcome_advantages = register("outcome_advantages", _outcome_advantages_op, _fake_outcome_advantages)


def outcome_advantages(scores, mask, *, group_ids=None, group_size=None, estimator="grpo", eps=ADVANTAGE_EPS,
                       scale="group", unbiased=True, singleton="score", whiten=None, var_eps=WHITEN_EPS,
                       var_eps_mode="add"):
    """Per-token advantages from one score per sequence, for critic-free PPO (docs/ops.md).

    Args:
        scores: [B] float, one score per sequence (e.g. verl's token_level_rewards.sum(-1)).
        mask: [B, T] bool/int/float; non-zero = a response token.
        group_ids: [B] integer ids (verl's index: any values, any order, any group sizes), or
        group_size: G, groups of G consecutive sequences (OpenRLHF, TRL); must divide B.
            One of the two for the grouped estimators; reinforce_pp ignores groups.
        estimator: a name in ADVANTAGES: "grpo", "dr_grpo", "rloo", "reinforce_pp",
            "reinforce_pp_baseline", or one added with `register_advantage`.
        eps: > 0, added to every std divided by: verl 1e-6, OpenRLHF 1e-9, TRL 1e-4.
        scale: grpo's std: "group" (all peers) or "batch" (TRL's scale_rewards="batch": group
            mean, batch std). TRL's scale_rewards="none" is estimator="dr_grpo".
        unbiased: Bessel-corrected std and variance (all peers, except OpenRLHF's token whitening).
        singleton: a group of one: "score" (verl: baseline 0, std 1, so the advantage is the
            score, / (1 + eps) for grpo) or "zero" (TRL, verl's rloo_vectorized).
        whiten: None (the estimator's default: "tokens" for the reinforce_pp estimators, else
            "none"), "none", "tokens" (over every mask=1 token of the batch, token-weighted:
            verl's masked_whiten, OpenRLHF's normalisation) or "sequences" (over the B sequences,
            / (std + eps): TRL RLOO's normalize_advantages).
        var_eps, var_eps_mode: token whitening divides by sqrt(var + var_eps) ("add", verl) or
            sqrt(max(var, var_eps)) ("clamp", OpenRLHF).

    Returns:
        advantages [B, T] float32 (float64 for float64 scores), constant over each sequence's
        tokens and 0 where mask = 0. Finite for groups of one and equal scores. No gradient.
    """
    check_float("scores", scores)
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got shape {tuple(scores.shape)}")
    check_tensor("mask", mask)
    if mask.dim() != 2 or mask.shape[0] != scores.shape[0]:
        raise ValueError(f"mask must be [B, T] with B = {scores.shape[0]} (scores), got {tuple(mask.shape)}")
    if mask.is_complex():
        raise TypeError(f"mask must be bool, integer or float, got {mask.dtype}")
    check_device("mask", mask, "scores", scores)
    check_choice("estimator", estimator, ADVANTAGES)
    eps = check_number("eps", eps, positive=True)
    var_eps = check_number("var_eps", var_eps, positive=True)
    check_choice("scale", scale, GROUP_SCALES)
    check_choice("singleton", singleton, SINGLETON_MODES)
    check_choice("var_eps_mode", var_eps_mode, VAR_EPS_MODES)
    whiten = DEFAULT_WHITEN[estimator] if whiten is None else whiten
    check_choice("whiten", whiten, WHITEN_MODES)
    group_ids = _group_ids(scores, group_ids, group_size, estimator)
    return _outcome_advantages(scores.detach(), mask, group_ids, estimator, eps, scale, bool(unbiased), singleton,
                               whiten, var_eps, var_eps_mode)


def _group_ids(scores: Tensor, group_ids, group_size, estimator: str) -> Tensor:
    """[B] integer group ids from `group_ids` or `group_size` (checked); each sequence its own
    group when the estimator needs none and neither is given."""
    B = scores.shape[0]
    if group_ids is not None and group_size is not None:
        raise ValueError("pass group_ids or group_size, not both")
    if group_ids is not None:
        check_tensor("group_ids", group_ids)
        if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
            raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
        if tuple(group_ids.shape) != (B,):
            raise ValueError(f"group_ids must have shape [B] = ({B},), got {tuple(group_ids.shape)}")
        check_device("group_ids", group_ids, "scores", scores)
        return group_ids
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if B % group_size:
            raise ValueError(f"group_size ({group_size}) must divide the batch size B = {B}")
        return torch.arange(B, device=scores.device) // group_size
    if GROUPED[estimator]:
        raise ValueError(f"estimator {estimator!r} compares the responses to one prompt: pass group_ids "
                         "(one id per prompt) or group_size (responses per prompt, laid out consecutively)")
    return torch.arange(B, device=scores.device)
