"""Plain PyTorch ground truth for the critic-free outcome advantages and the DPO losses.

Same rules as reference.py (and to be merged into it as a section): readable, no tricks,
computes in the dtype of its floating-point inputs (float64 for the ground truth), imports
only torch. The peers' conventions behind every option are in docs/ops.md; each was read
from the peer's source (verl 0.9.1 core_algos, OpenRLHF 0.11.2 experience maker and DPOLoss,
TRL 1.16 GRPOTrainer / RLOOTrainer / DPOTrainer).

Shapes: B sequences, T tokens. `mask` is bool or float [B, T]; any non-zero entry selects.
"""

from __future__ import annotations

import torch

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
GROUP_SCALES = ("group", "batch")
SINGLETON_MODES = ("score", "zero")
WHITEN_MODES = ("none", "tokens", "sequences")
VAR_EPS_MODES = ("add", "clamp")
DPO_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo")


# ---------------------------------------------------------------- outcome advantages


def group_index(B, *, group_ids=None, group_size=None, device=None):
    """[B] long: the group of each sequence, numbered 0..G-1 in order of first appearance.

    `group_ids` (verl's `index`): any integer ids, any order, any group sizes.
    `group_size` G (OpenRLHF, TRL): contiguous blocks, rows [k G, (k+1) G) form group k.
    Neither: every sequence its own group.
    """
    if group_ids is not None:
        ids = group_ids.tolist()
        first = {}
        for i in ids:
            first.setdefault(i, len(first))
        return torch.tensor([first[i] for i in ids], dtype=torch.long, device=device)
    if group_size is not None:
        return torch.arange(B, device=device) // group_size
    return torch.arange(B, device=device)


def _std(x, unbiased):
    """Standard deviation of a 1-d tensor; unbiased with n > 1, else the plain (population) one."""
    n = x.numel()
    var = ((x - x.mean()) ** 2).sum() / (n - 1 if unbiased and n > 1 else n)
    return var.sqrt()


def whiten_tokens(values, mask, *, unbiased=True, var_eps=1e-8, var_eps_mode="add"):
    """(values - mean) / sqrt(var + var_eps) over the mask=1 tokens (verl's masked_whiten), or
    / sqrt(max(var, var_eps)) with var_eps_mode="clamp" (OpenRLHF); var unbiased when asked and
    n > 1. 0 where mask = 0, all zeros for an empty mask."""
    m = (mask != 0).to(values.dtype)
    n = m.sum()
    if n == 0:
        return torch.zeros_like(values)
    mean = (values * m).sum() / n
    var = ((values - mean) ** 2 * m).sum() / n
    if unbiased and n > 1:
        var = var * n / (n - 1)
    denom = torch.sqrt(var + var_eps) if var_eps_mode == "add" else torch.sqrt(torch.clamp(var, min=var_eps))
    return (values - mean) / denom * m


def outcome_advantages(scores, mask, *, group_ids=None, group_size=None, estimator="grpo", eps=1e-6,
                       scale="group", unbiased=True, singleton="score", whiten=None, var_eps=1e-8,
                       var_eps_mode="add"):
    """Per-token advantages [B, T] from one score per sequence, 0 where mask = 0.

    Per sequence i in group g (size n, mean m_g, std s_g over the group's scores):
      grpo:                  a_i = (r_i - m_g) / (s_g + eps); scale="batch": s over all B scores
      dr_grpo:               a_i = r_i - m_g
      rloo:                  a_i = r_i - (sum_g - r_i) / (n - 1)
      reinforce_pp:          a_i = r_i, then whitened over the tokens
      reinforce_pp_baseline: a_i = r_i - m_g, then whitened over the tokens
    A group of one (n = 1): singleton="score" takes baseline 0 and std 1 (verl), so a_i = r_i
    (r_i / (1 + eps) for grpo); singleton="zero" gives a_i = 0 (TRL).
    Then a_i is broadcast to the response tokens and whitened when `whiten` (default: "tokens"
    for the reinforce_pp estimators, "none" otherwise) is
      "tokens":    whiten_tokens over every mask=1 token of the batch (token-weighted);
      "sequences": (a - mean(a)) / (std(a) + eps) over the B sequences (TRL RLOO).
    Every std / variance is unbiased when `unbiased` (and n > 1).
    """
    B = scores.shape[0]
    r = scores
    m = (mask != 0).to(r.dtype)
    groups = group_index(B, group_ids=group_ids, group_size=group_size, device=scores.device)
    if whiten is None:
        whiten = "tokens" if estimator.startswith("reinforce_pp") else "none"
    batch_std = _std(r, unbiased) if B > 0 else r.new_zeros(())

    adv = torch.zeros_like(r)
    for g in groups.unique().tolist():
        idx = (groups == g).nonzero().flatten()
        x = r[idx]
        n = x.numel()
        if estimator == "reinforce_pp":  # no baseline: the whitening's mean is the batch baseline
            adv[idx] = x
            continue
        if n == 1:
            if singleton == "zero":
                adv[idx] = 0.0
            elif estimator == "grpo":  # baseline 0, std 1 (or the batch std)
                adv[idx] = x / ((1.0 if scale == "group" else batch_std) + eps)
            else:  # baseline 0
                adv[idx] = x
            continue
        mean = x.mean()
        if estimator == "grpo":
            std = _std(x, unbiased) if scale == "group" else batch_std
            adv[idx] = (x - mean) / (std + eps)
        elif estimator in ("dr_grpo", "reinforce_pp_baseline"):
            adv[idx] = x - mean
        elif estimator == "rloo":
            adv[idx] = x - (x.sum() - x) / (n - 1)
        else:
            raise ValueError(f"estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")

    if whiten == "sequences":
        adv = (adv - adv.mean()) / (_std(adv, unbiased) + eps) if B > 0 else adv
    tokens = adv.unsqueeze(-1) * m
    if whiten == "tokens":
        tokens = whiten_tokens(tokens, m, unbiased=unbiased, var_eps=var_eps, var_eps_mode=var_eps_mode)
    return tokens


# ---------------------------------------------------------------- DPO


def dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, *, beta=0.1, loss_type="sigmoid",
             label_smoothing=0.0, chosen_lengths=None, rejected_lengths=None):
    """DPO on per-sequence summed log-probs [B]; returns (loss, stats).

    With chosen/rejected log-ratios c = logp_c - ref_c, r = logp_r - ref_r and d = c - r:
      sigmoid: -(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d)      (cDPO, e = label_smoothing)
      robust:  (-(1 - e) log sigmoid(beta d) + e log sigmoid(-beta d)) / (1 - 2 e)
      hinge:   max(0, 1 - beta d); gradient 0 at the kink (beta d = 1: the margin is met)
      ipo:     (d - 1 / (2 beta))^2, with d = c / n_c - r / n_r when the lengths n are given
               (clamped to >= 1)
    loss = mean over the B pairs (0 for B = 0). stats (detached means over pairs):
      reward_chosen = beta c, reward_rejected = beta r, reward_margin = beta (c - r),
      reward_accuracy = fraction with beta c > beta r (strict), logp_chosen, logp_rejected.
    """
    c = chosen_logp - ref_chosen_logp
    r = rejected_logp - ref_rejected_logp
    d = c - r
    e = label_smoothing
    logsig = torch.nn.functional.logsigmoid
    if loss_type == "sigmoid":
        losses = -(1 - e) * logsig(beta * d) - e * logsig(-beta * d)
    elif loss_type == "robust":
        losses = (-(1 - e) * logsig(beta * d) + e * logsig(-beta * d)) / (1 - 2 * e)
    elif loss_type == "hinge":
        z = 1 - beta * d
        losses = torch.where(z > 0, z, z.detach() * 0)  # gradient -beta where 1 - beta d > 0, else 0
    elif loss_type == "ipo":
        if chosen_lengths is not None:
            d = c / chosen_lengths.to(c.dtype).clamp(min=1) - r / rejected_lengths.to(c.dtype).clamp(min=1)
        losses = (d - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    B = losses.shape[0]
    loss = losses.mean() if B > 0 else losses.sum()
    with torch.no_grad():
        rc, rr = beta * c, beta * r

        def mean(x):
            return x.mean() if B > 0 else x.sum()

        stats = {
            "reward_chosen": mean(rc),
            "reward_rejected": mean(rr),
            "reward_margin": mean(rc - rr),
            "reward_accuracy": mean((rc > rr).to(c.dtype)),
            "logp_chosen": mean(chosen_logp),
            "logp_rejected": mean(rejected_logp),
        }
    return loss, stats
