"""Plain PyTorch ground truth for every fastrlhf op.

Readable, no tricks, no fusion: each function computes in the dtype of its floating-point
inputs (pass float64 for the ground truth; pass bf16 to measure what plain PyTorch in
bf16 gets wrong). Conventions are those of the op contract, docs/ops.md (verl's
`core_algos` by default, OpenRLHF's where an option says so). Imports only torch (and the
dependency-free `fastrlhf.constants`).

Shapes: B sequences, T tokens, V vocab, H hidden. `mask` is bool or float [B, T].

Gradient rules at ties are stated here and written out with `torch.where`, whose gradient
goes to the branch it selects and has no tie to break, so no torch version's autograd
convention decides them (torch 2.14 changed clamp's gradient at exactly its bound to 0):
- clamp(x, lo, hi): the gradient passes for lo <= x <= hi, bounds included (there the
  value is x itself), and is 0 outside: `clamped` below.
- |x|: the gradient is sign(x), 0 at x = 0: `absolute` below.
- max / min of an unclipped and a clipped term (the PPO losses): at a tie the unclipped term
  takes the whole gradient, as the clip fractions count a token as clipped only when the
  clipped term is strictly larger (strictly smaller for dual-clip): `where(l2 > l1, l2, l1)`.
- the hinge DPO loss max(0, 1 - beta d): the gradient is -beta for beta d < 1 and 0 from the
  kink on (beta d = 1: the margin is met): `dpo_loss` below.
The kernels and the ops' torch path implement the same rules.
"""

from __future__ import annotations

import torch

from fastrlhf.constants import (
    ADVANTAGE_EPS,
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    DPO_LOSS_TYPES,
    IGNORE_INDEX,
    KL_ESTIMATORS,
    LOG_MIX_FLOOR,
    LOG_RATIO_CLAMP,
    MASK_MODES,
    SINGLETON_MODES,
    WHITEN_EPS,
)

__all__ = ["ADVANTAGE_ESTIMATORS", "AGG_MODES", "DPO_LOSS_TYPES", "KL_ESTIMATORS", "MASK_MODES", "SINGLETON_MODES",
           "absolute", "agg_loss", "clamped", "distill_divergence", "distill_logprobs", "distill_loss", "dpo_loss",
           "entropy", "gae", "group_index", "kl_shaped_rewards", "linear_distill_loss", "linear_logprobs", "logprobs",
           "masked", "masked_mean", "outcome_advantages", "policy_loss", "ppo_actor_loss", "token_kl",
           "topk_distill_loss", "value_loss", "whiten", "whiten_tokens"]


# ---------------------------------------------------------------- gradient rules at ties


def clamped(x, lo=None, hi=None):
    """torch.clamp(x, lo, hi) whose gradient passes on the closed interval [lo, hi] and is 0
    outside; `lo` / `hi` are numbers, tensors or None."""
    inside = torch.ones_like(x, dtype=torch.bool)
    if lo is not None:
        inside = inside & (x >= lo)
    if hi is not None:
        inside = inside & (x <= hi)
    return torch.where(inside, x, torch.clamp(x, lo, hi).detach())


def absolute(x):
    """|x| with gradient sign(x), 0 at x = 0 (x * sign(x) is |x| exactly)."""
    return x * torch.sign(x).detach()


# ---------------------------------------------------------------- log-probs / entropy


def logprobs(logits, labels, *, temperature=1.0, return_entropy=False, ignore_index=IGNORE_INDEX):
    """logp[..] = log softmax(logits / temperature)[label]; entropy = -sum p log p.

    labels [...] = logits.shape[:-1] gives logp [...]; labels [..., K] (K labels per position,
    TRL's selective_log_softmax) gives logp [..., K]; the entropy is [...] either way.
    `labels == ignore_index` gives logp 0; a label outside [0, V) gives NaN.
    The entropy is computed for every position (ignored or not).
    """
    z = logits / temperature
    logsm = torch.log_softmax(z, dim=-1)
    V = logits.shape[-1]
    per_position = labels.dim() == logits.dim() - 1
    index = labels.unsqueeze(-1) if per_position else labels
    ignored = index == ignore_index
    valid = (index >= 0) & (index < V)
    safe = torch.where(valid, index, torch.zeros_like(index))
    lp = logsm.gather(-1, safe.long())
    lp = torch.where(valid, lp, torch.full_like(lp, float("nan")))
    lp = torch.where(ignored, torch.zeros_like(lp), lp)
    if per_position:
        lp = lp.squeeze(-1)
    if not return_entropy:
        return lp
    return lp, entropy(logits, temperature=temperature)


def entropy(logits, *, temperature=1.0):
    """-sum_j p_j log p_j of p = softmax(logits / temperature), per position; 0 log 0 = 0 (-inf logits)."""
    logsm = torch.log_softmax(logits / temperature, dim=-1)
    p = logsm.exp()
    # where p = 0 the log is -inf: replaced by 0 before the product, so no 0 * -inf reaches the gradient
    return -(p * torch.where(p > 0, logsm, torch.zeros_like(logsm))).sum(-1)


def linear_logprobs(hidden, weight, labels, *, bias=None, temperature=1.0, return_entropy=False,
                    ignore_index=IGNORE_INDEX):
    """`logprobs(hidden @ weight.T + bias, labels, ...)` with the logits materialised."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    return logprobs(logits, labels, temperature=temperature, return_entropy=return_entropy,
                    ignore_index=ignore_index)


# ---------------------------------------------------------------- KL


def token_kl(logp, ref_logp, *, estimator="k1", clamp=None, straight_through=False, grad_weight=None):
    """Per-token KL estimate with r = logp - ref_logp.

    k1 = r; k2 = r^2 / 2; k3 = exp(-c) - 1 + c with c = r clamped to +-20 (in both terms, as verl);
    abs = |r|. Aliases: kl = k1, mse = k2, low_var_kl = k3. `clamp` clamps the output
    to [-clamp, clamp] (verl clamps low_var_kl to 10, OpenRLHF every estimator to 10).
    Ties: both clamps pass the gradient at their bounds; d|r|/dr = 0 at r = 0.

    straight_through: the value is the estimator's, the gradient that of w * r^2 / 2, i.e.
    d/dlogp = w * r = -d/dref_logp, w = grad_weight (detached; None = 1): verl's "k1+", "k3+", ...
    and OpenRLHF's unbiased_gradient (w = its clamped importance weight).
    """
    name = KL_ESTIMATORS[estimator]
    r = logp - ref_logp
    if name == "k1":
        kl = r
    elif name == "k2":
        kl = 0.5 * r * r
    elif name == "k3":
        c = clamped(r, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = torch.expm1(-c) + c
    else:
        kl = absolute(r)
    if clamp is not None:
        kl = clamped(kl, -clamp, clamp)
    if straight_through:
        surrogate = 0.5 * r * r if grad_weight is None else grad_weight.detach() * (0.5 * r * r)
        kl = kl.detach() + (surrogate - surrogate.detach())
    return kl


def kl_shaped_rewards(scores, logp, ref_logp, mask, *, kl_coef, estimator="k1", clamp=None):
    """rewards[b, t] = -kl_coef * KL[b, t] on response tokens, plus scores[b] on the last
    mask=1 token of row b; 0 where mask = 0. A row with no response token gets nothing."""
    m = mask.to(logp.dtype)
    rewards = -kl_coef * masked(token_kl(logp, ref_logp, estimator=estimator, clamp=clamp), m)
    T = mask.shape[-1]
    has_token = m.sum(-1) > 0
    positions = torch.arange(T, device=mask.device).expand_as(m)
    last = torch.where(m > 0, positions, torch.full_like(positions, -1)).max(-1).values
    for b in range(mask.shape[0]):
        if has_token[b]:
            rewards[b, last[b]] += scores[b].to(rewards.dtype)
    return rewards


# ---------------------------------------------------------------- whitening and GAE


def whiten(x, mask, *, unbiased=True, shift_mean=True):
    """Masked whitening: (x - mean) / sqrt(var + 1e-8) over the mask=1 entries.

    var is the masked variance, times n / (n - 1) when `unbiased` and n > 1.
    With `shift_mean=False` the mean is added back. 0 where mask = 0; all zeros when the
    mask is empty.
    """
    m = mask.to(x.dtype)
    n = m.sum()
    if n == 0:
        return torch.zeros_like(x)
    mean = (x * m).sum() / n
    var = ((x - mean) ** 2 * m).sum() / n
    if unbiased and n > 1:
        var = var * n / (n - 1)
    out = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    return out * m


def gae(rewards, values, mask, *, gamma=1.0, lam=1.0, mask_mode="skip", whiten=True):
    """Generalised advantage estimation over [B, T]; returns (advantages, returns).

    "skip" (verl): masked tokens are skipped, the recursion carries across them:
        delta_t = r_t + gamma * V_next - V_t,  A_t = delta_t + gamma * lam * A_next
        where V_next / A_next are those of the next mask=1 token (0 past the end).
    "zero" (OpenRLHF): rewards and values are zeroed under the mask and the recursion
        runs through every position: V_next = V_{t+1}, A_next = A_{t+1}.
    returns = raw advantages + values; advantages are then whitened (masked, unbiased)
    if `whiten`. Both outputs are 0 where mask = 0.
    """
    m = mask.to(rewards.dtype)
    B, T = rewards.shape
    if mask_mode == "zero":
        rewards = rewards * m
        values = values * m
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    adv = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        if mask_mode == "skip":
            mt = m[:, t]
            next_value = values[:, t] * mt + next_value * (1 - mt)
            next_adv = a * mt + next_adv * (1 - mt)
        else:
            next_value = values[:, t]
            next_adv = a
        adv[:, t] = a
    returns = (adv + values) * m
    adv = adv * m
    if whiten:
        adv = globals()["whiten"](adv, m)
    return adv, returns


# ---------------------------------------------------------------- PPO losses


def masked(x, mask):
    """x * mask, exactly 0 where mask == 0 whatever x holds there (NaN, inf): what lies under
    mask = 0 never matters, to the value or to the gradient."""
    m = mask.to(x.dtype)
    return torch.where(m != 0, x * m, torch.zeros_like(x))


def agg_loss(loss_mat, mask, agg="token-mean", *, global_num_tokens=None, global_num_seqs=None, dp_size=1,
             loss_scale_factor=None):
    """verl 0.9.1's core_algos.agg_loss of a [B, T] loss matrix l into a scalar; m = mask,
    n_b = sum_t m[b, t], S = #{b: n_b > 0}:

    token-mean:              sum(l m) / (global_num_tokens or sum(m)) * dp_size
    token-sum:               sum(l m) * dp_size
    seq-mean-token-sum:      sum_{b: n_b > 0} sum_t l m / (global_num_seqs or S) * dp_size
    seq-mean-token-mean:     sum_{b: n_b > 0} (sum_t l m / n_b) / (global_num_seqs or S) * dp_size
    seq-mean-token-sum-norm: seq-mean-token-sum / (loss_scale_factor or T)
    Fully masked rows are excluded from every sequence mean; an empty local mask gives 0.
    (verl divides seq-mean-token-mean by n_b + 1e-8: below fp32 resolution for n_b >= 1.)
    """
    if loss_mat.dim() == 1:
        loss_mat, mask = loss_mat.unsqueeze(0), mask.unsqueeze(0)
    m = mask.to(loss_mat.dtype)
    values = masked(loss_mat, m)
    if agg == "token-mean":
        n = m.sum() if global_num_tokens is None else torch.tensor(float(global_num_tokens), dtype=m.dtype)
        return values.sum() / n * dp_size if n > 0 else values.sum() * 0
    if agg == "token-sum":
        return values.sum() * dp_size
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    n_b = m.sum(-1)
    nonempty = n_b > 0
    per_seq = values.sum(-1)
    if agg == "seq-mean-token-mean":
        per_seq = torch.where(nonempty, per_seq / torch.where(nonempty, n_b, torch.ones_like(n_b)),
                              torch.zeros_like(per_seq))
    n_seqs = nonempty.sum() if global_num_seqs is None else global_num_seqs
    loss = per_seq.sum() / n_seqs * dp_size if n_seqs > 0 else per_seq.sum() * 0
    if agg == "seq-mean-token-sum-norm":
        T = loss_mat.shape[-1]
        loss = loss / (T if loss_scale_factor is None else loss_scale_factor) if T > 0 else loss * 0
    return loss


def masked_mean(x, mask):
    m = mask.to(x.dtype)
    n = m.sum()
    return masked(x, m).sum() / n if n > 0 else masked(x, m).sum() * 0


def policy_loss(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None, dual_clip=None,
                is_weights=None, agg="token-mean", **agg_kw):
    """verl's vanilla clipped surrogate; returns (loss, stats).

    log_ratio = clamp(logp - old_logp, -20, 20), ratio = exp(log_ratio)
    l1 = -A * ratio, l2 = -A * clamp(ratio, 1 - clip_low, 1 + clip_high), l = max(l1, l2)
    dual-clip (c > 1), for A < 0 only: l = min(l, -A * c)
    is_weights (verl's rollout_is_weights, OpenRLHF's IS correction): l * is_weights; the loss is agg(l).
    stats: clipfrac = mean(l2 > l1), clipfrac_lower = mean(l > -A c and A < 0),
    approx_kl = mean(-log_ratio) (verl's ppo_kl), approx_kl_unclamped = mean(old_logp - logp)
    (OpenRLHF's ppo_kl), all masked means over the local tokens.
    Ties (module docstring): the clamps pass the gradient at their bounds; max(l1, l2) at
    l1 == l2 and min(l, -A c) at l == -A c give it to the unclipped term.
    """
    clip_high = clip_low if clip_high is None else clip_high
    log_ratio = clamped(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * clamped(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.where(l2 > l1, l2, l1)  # max(l1, l2); a tie goes to l1
    stats = {
        "clipfrac": masked_mean((l2 > l1).to(logp.dtype), mask),
        "approx_kl": masked_mean(-log_ratio, mask),
        "approx_kl_unclamped": masked_mean((old_logp - logp).detach(), mask),
    }
    if dual_clip is not None:
        l3 = -advantages * dual_clip
        lower = (clipped > l3) & (advantages < 0)
        losses = torch.where(lower, l3, clipped)  # min(clipped, l3) where A < 0; a tie goes to clipped
        stats["clipfrac_lower"] = masked_mean(lower.to(logp.dtype), mask)
    else:
        losses = clipped
        stats["clipfrac_lower"] = masked_mean(torch.zeros_like(logp), mask)
    if is_weights is not None:
        losses = losses * is_weights.detach()
    return agg_loss(losses, mask, agg, **agg_kw), stats


def value_loss(values, old_values, returns, mask, *, clip=0.2, agg="token-mean", **agg_kw):
    """0.5 * agg(max((v - R)^2, (v_clipped - R)^2)), v_clipped = clamp(v, old - clip, old + clip)
    (verl's form: v comes back bit-exact inside the range, so rounding never counts as clipping).

    `clip=None` disables clipping. stats: clipfrac = masked mean of (clipped loss > plain loss).
    Ties: the clamp passes the gradient at its bounds; max(l1, l2) at a tie gives it to l1.
    """
    l1 = (values - returns) ** 2
    if clip is None:
        losses, frac = l1, torch.zeros_like(l1)
    else:
        v_clipped = clamped(values, old_values - clip, old_values + clip)
        l2 = (v_clipped - returns) ** 2
        losses, frac = torch.where(l2 > l1, l2, l1), (l2 > l1).to(values.dtype)
    loss = 0.5 * agg_loss(losses, mask, agg, **agg_kw)
    return loss, {"clipfrac": masked_mean(frac, mask)}


def ppo_actor_loss(logits, labels, old_logp, advantages, mask, *, ref_logp=None, kl_coef=0.0,
                   kl_estimator="k3", kl_clamp=None, kl_straight_through=False, entropy_coef=0.0,
                   temperature=1.0, clip_low=0.2, clip_high=None, dual_clip=None, is_weights=None,
                   agg="token-mean", **agg_kw):
    """The whole actor loss from logits:
    policy_loss(logp) + kl_coef * agg(KL(logp, ref_logp)) - entropy_coef * agg(entropy).

    is_weights weigh the policy term only; the KL term is token_kl(estimator=kl_estimator,
    clamp=kl_clamp, straight_through=kl_straight_through). Returns (loss, stats): clipfrac,
    clipfrac_lower, approx_kl, `pg_loss` (the aggregated policy term), `entropy` (masked mean)
    and, with a reference, `kl` (masked mean).
    """
    logp, entropy_ = logprobs(logits, labels, temperature=temperature, return_entropy=True)
    pg, stats = policy_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                            dual_clip=dual_clip, is_weights=is_weights, agg=agg, **agg_kw)
    del stats["approx_kl_unclamped"]
    loss = pg
    stats = dict(stats, pg_loss=pg, entropy=masked_mean(entropy_, mask))
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * agg_loss(entropy_, mask, agg, **agg_kw)
    if ref_logp is not None:
        kl = token_kl(logp, ref_logp, estimator=kl_estimator, clamp=kl_clamp, straight_through=kl_straight_through)
        stats["kl"] = masked_mean(kl, mask)
        if kl_coef != 0.0:
            loss = loss + kl_coef * agg_loss(kl, mask, agg, **agg_kw)
    return loss, stats


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


def whiten_tokens(values, mask, *, unbiased=True, var_eps=WHITEN_EPS, var_eps_mode="add"):
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


def outcome_advantages(scores, mask, *, group_ids=None, group_size=None, estimator="grpo", eps=ADVANTAGE_EPS,
                       scale="group", unbiased=True, singleton="score", whiten=None, var_eps=WHITEN_EPS,
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


# ---------------------------------------------------------------- distillation


def distill_logprobs(logits, *, temperature=1.0, logit_scale=1.0, softcap=None):
    """log softmax(z) over the vocabulary, z = softcap tanh(logit_scale x / softcap) / temperature
    (without softcap: logit_scale x / temperature): TRL's order, the scale, then the softcap, then
    the temperature."""
    z = logits * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return torch.log_softmax(z / temperature, dim=-1)


def _expected_log_ratio(p, log_a, log_b):
    """sum_j p_j (log_a_j - log_b_j) with 0 log 0 = 0: where p_j = 0 the term is 0 (its log-ratio,
    possibly infinite, is replaced before the product, so no 0 * inf reaches the value or the gradient)."""
    diff = torch.where(p > 0, log_a - log_b, torch.zeros_like(p))
    return (p * diff).sum(-1)


def _jsd(ls, lt, ps, pt, beta):
    """beta KL(t || m) + (1 - beta) KL(s || m), log m = logaddexp(log s + log(1 - beta), log t + log beta)."""
    b = torch.tensor(beta, dtype=ls.dtype)
    lm = torch.logaddexp(ls.clamp(min=LOG_MIX_FLOOR) + torch.log1p(-b), lt.clamp(min=LOG_MIX_FLOOR) + torch.log(b))
    return beta * _expected_log_ratio(pt, lt, lm) + (1 - beta) * _expected_log_ratio(ps, ls, lm)


def distill_divergence(student_logits, teacher_logits, *, beta, temperature=1.0, student_logit_scale=1.0,
                       teacher_logit_scale=1.0, student_softcap=None, teacher_softcap=None):
    """Per-position divergence [...] of the student's next-token distribution s from the
    teacher's t (each `distill_logprobs` of its logits), TRL's generalized JSD (beta = the
    teacher's weight in the mixture; TRL 1.16 DistillationTrainer, GKD, Liger's JSD):

      beta = 0:  KL(t || s) = sum_j t_j (log t_j - log s_j)          (forward KL)
      beta = 1:  KL(s || t) = sum_j s_j (log s_j - log t_j)          (reverse KL)
      else:      beta KL(t || m) + (1 - beta) KL(s || m),  m = (1 - beta) s + beta t

    0 log 0 = 0: a token with probability 0 under the weighting distribution adds 0; one with
    mass under it and probability 0 under the other model makes the KL infinite (as it is).
    The teacher is a constant: no gradient reaches `teacher_logits`.
    """
    ls = distill_logprobs(student_logits, temperature=temperature, logit_scale=student_logit_scale,
                          softcap=student_softcap)
    lt = distill_logprobs(teacher_logits.detach(), temperature=temperature, logit_scale=teacher_logit_scale,
                          softcap=teacher_softcap)
    ps, pt = ls.exp(), lt.exp()
    if beta == 0:
        return _expected_log_ratio(pt, lt, ls)
    if beta == 1:
        return _expected_log_ratio(ps, ls, lt)
    return _jsd(ls, lt, ps, pt, beta)


def distill_loss(student_logits, teacher_logits, mask, *, beta, temperature=1.0, student_logit_scale=1.0,
                 teacher_logit_scale=1.0, student_softcap=None, teacher_softcap=None, global_num_tokens=None):
    """(loss, stats): the token mean of `distill_divergence` over the mask, TRL's reduction
    (DistillationTrainer's num_items_in_batch is global_num_tokens):

      loss = sum(D m) / (global_num_tokens or sum(m)),  0 for an empty mask

    mask [...] bool or float (a float mask weighs tokens; TRL counts mask != 0); positions under
    mask = 0 add exactly 0 whatever their logits hold. stats: "entropy", the mask-weighted mean
    entropy of the student's distribution (detached; 0 for an empty mask)."""
    kw = dict(temperature=temperature, student_logit_scale=student_logit_scale,
              teacher_logit_scale=teacher_logit_scale, student_softcap=student_softcap,
              teacher_softcap=teacher_softcap)
    d = distill_divergence(student_logits, teacher_logits, beta=beta, **kw)
    loss = agg_loss(d.reshape(-1), mask.reshape(-1), "token-mean", global_num_tokens=global_num_tokens)
    with torch.no_grad():
        ls = distill_logprobs(student_logits, temperature=temperature, logit_scale=student_logit_scale,
                              softcap=student_softcap)
        ent = -_expected_log_ratio(ls.exp(), ls, torch.zeros_like(ls))
        stats = {"entropy": masked_mean(ent.reshape(-1), mask.reshape(-1))}
    return loss, stats


def linear_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, mask, *, beta,
                        student_bias=None, teacher_bias=None, **kwargs):
    """`distill_loss` of the materialised logits hidden @ weight.T + bias of each model."""
    s = student_hidden @ student_weight.T
    t = teacher_hidden @ teacher_weight.T
    s = s if student_bias is None else s + student_bias
    t = t if teacher_bias is None else t + teacher_bias
    return distill_loss(s, t, mask, beta=beta, **kwargs)


def topk_distill_loss(student_logits, teacher_ids, teacher_logprobs, mask, *, beta, temperature=1.0,
                      candidate_mask=None, tail_bucket=True, global_num_tokens=None):
    """(loss, stats): the divergence on the teacher's top-K support (TRL 1.16's async distillation, from a
    teacher that reports K candidates per position: ids [..., K] and their log-probs [..., K]).

    s_k = log softmax(student_logits / temperature)[id_k] and t_k = the teacher's log-prob, on the valid
    candidates (candidate_mask, default ids >= 0); tail_bucket: each gets one more element, the mass left
    out, log(1 - sum exp), with sum exp clamped below exp(-1e-7) (TRL's `_add_tail_bucket`); else both
    are renormalised over the candidates. D is `distill_divergence`'s formula over those K (+ 1)
    probabilities; the loss is its token mean over `mask`, as distill_loss. stats: "entropy", the
    student's full-vocabulary entropy (mask-weighted mean, detached)."""
    ls_full = distill_logprobs(student_logits, temperature=temperature)
    valid = teacher_ids >= 0 if candidate_mask is None else candidate_mask.bool()
    minus_inf = torch.full((), float("-inf"), dtype=ls_full.dtype)
    ls = torch.where(valid, ls_full.gather(-1, torch.where(valid, teacher_ids, 0).long()), minus_inf)
    lt = torch.where(valid, teacher_logprobs.detach().to(ls.dtype), minus_inf)
    if tail_bucket:
        def tail(lp):
            rest = torch.log(-torch.expm1(torch.logsumexp(lp, -1, keepdim=True).clamp(max=-1e-7)))
            return torch.cat([lp, rest], -1)

        ls, lt = tail(ls), tail(lt)
    else:
        ls, lt = ls - torch.logsumexp(ls, -1, keepdim=True), lt - torch.logsumexp(lt, -1, keepdim=True)
    ps, pt = ls.exp(), lt.exp()
    if beta == 0:
        d = _expected_log_ratio(pt, lt, ls)
    elif beta == 1:
        d = _expected_log_ratio(ps, ls, lt)
    else:
        d = _jsd(ls, lt, ps, pt, beta)
    loss = agg_loss(d.reshape(-1), mask.reshape(-1), "token-mean", global_num_tokens=global_num_tokens)
    with torch.no_grad():
        ent = -_expected_log_ratio(ls_full.exp(), ls_full, torch.zeros_like(ls_full))
        stats = {"entropy": masked_mean(ent.reshape(-1), mask.reshape(-1))}
    return loss, stats
