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
    BATCH_NORMALIZE_MIN,
    DPO_LOSS_TYPES,
    DPPO_BINARY_KL_EPS,
    GATE_PROB_CLAMP,
    GEO_MEAN_IS_EPS,
    IGNORE_INDEX,
    IS_ESS_EPS,
    KL_ESTIMATORS,
    LOG_MIX_FLOOR,
    LOG_RATIO_CLAMP,
    MASK_MODES,
    SINGLETON_MODES,
    VESPO_LAMBDA_MIN,
    VESPO_LOG_W_MIN,
    WHITEN_EPS,
)

__all__ = ["ADVANTAGE_ESTIMATORS", "AGG_MODES", "DPO_LOSS_TYPES", "KL_ESTIMATORS", "MASK_MODES", "SINGLETON_MODES",
           "absolute", "agg_loss", "clamped", "decode_attention", "distill_divergence", "distill_logprobs",
           "distill_loss", "dpo_loss", "entropy", "gae", "group_index", "kl_shaped_rewards", "linear_distill_loss",
           "linear_logprobs", "logprobs", "masked", "masked_mean", "outcome_advantages", "policy_loss",
           "ppo_actor_loss", "token_kl", "topk_distill_loss", "value_loss", "whiten", "whiten_tokens"]


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
    loss, stats = clipped_surrogate(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                    dual_clip=dual_clip, is_weights=is_weights, agg=agg, **agg_kw)
    return loss, {k: stats[k] for k in ("clipfrac", "approx_kl", "approx_kl_unclamped", "clipfrac_lower")}


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
                   temperature=1.0, loss_mode="vanilla", clip_low=0.2, clip_high=None, dual_clip=None,
                   is_weights=None, agg=None, **kw):
    """The whole actor loss from logits:
    policy term (loss_mode: POLICY_LOSSES) + kl_coef * agg(KL(logp, ref_logp)) - entropy_coef * agg(entropy).

    is_weights weigh the policy term only; the KL term is token_kl(estimator=kl_estimator,
    clamp=kl_clamp, straight_through=kl_straight_through). `kw`: the aggregation keywords (agg_loss's) and
    the mode's options (its POLICY_LOSSES function's). agg=None: the mode's own default aggregation; geo_mean
    aggregates one loss per sequence over all B sequences (or global_num_seqs), and its KL and entropy terms
    as "seq-mean-token-mean" over as many. Returns (loss, stats): the mode's stats but approx_kl_unclamped,
    `pg_loss` (the aggregated policy term), `entropy` (masked mean) and, with a reference, `kl` (masked mean).
    """
    logp, entropy_ = logprobs(logits, labels, temperature=temperature, return_entropy=True)
    agg_names = ("global_num_tokens", "global_num_seqs", "dp_size", "loss_scale_factor")
    agg_kw = {k: kw.pop(k) for k in agg_names if k in kw}
    fn = POLICY_LOSSES[loss_mode]
    clips = {k: v for k, v in (("clip_low", clip_low), ("clip_high", clip_high), ("dual_clip", dual_clip))
             if v is not None and k in _keywords(fn)}
    if fn is geo_mean:
        seqs = agg_kw.get("global_num_seqs", logp.shape[0])
        pg, stats = fn(logp, old_logp, advantages, mask, **clips, is_weights=is_weights, global_num_seqs=seqs,
                       dp_size=agg_kw.get("dp_size", 1), **kw)
        agg, agg_kw = "seq-mean-token-mean", dict(agg_kw, global_num_seqs=seqs)
    else:
        agg = _keywords(fn)["agg"] if agg is None else agg
        pg, stats = fn(logp, old_logp, advantages, mask, **clips, is_weights=is_weights, agg=agg, **agg_kw, **kw)
    stats.pop("approx_kl_unclamped")
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


def _keywords(fn) -> dict:
    """{keyword: default} of a POLICY_LOSSES function (its keyword-only arguments with a default)."""
    return fn.__kwdefaults__ or {}


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
# ---------------------------------------------------------------- decode attention


def decode_attention(q, k_cache, v_cache, lengths, *, scale, prefix=None):
    """out [B, H_q, L, D]: softmax attention of the L queries of each row over its written cache slots.

    q [B, H_q, L, D]; k_cache, v_cache [B, H_kv, T, D] (H_q a multiple of H_kv: query head h reads KV head
    h // (H_q / H_kv)); lengths [B] = slots written per row. With prefix = (k_prefix, v_prefix,
    prefix_lengths, G), rows b of a group of G consecutive rows first share the prefix
    k_prefix[b // G, :, :prefix_lengths[b // G]] and lengths count their own suffix slots. The keys of a row
    are its prefix slots then its suffix slots, at positions 0, 1, ...; query i sits at position
    P + n - L + i (P = the row's prefix length, n = lengths[b]) and sees the keys at positions <= its own.
    A query that sees no key gives 0."""
    B, H_q, L, D = q.shape
    group = H_q // k_cache.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        n = int(lengths[b])
        keys, values = k_cache[b, :, :n], v_cache[b, :, :n]
        P = 0
        if prefix is not None:
            k_prefix, v_prefix, prefix_lengths, G = prefix
            P = int(prefix_lengths[b // G])
            keys = torch.cat([k_prefix[b // G, :, :P], keys], dim=1)
            values = torch.cat([v_prefix[b // G, :, :P], values], dim=1)
        if P + n == 0:
            continue  # nothing written: 0
        keys = keys.repeat_interleave(group, dim=0)  # [H_q, P + n, D]
        values = values.repeat_interleave(group, dim=0)
        key_positions = torch.arange(P + n, device=q.device)
        query_positions = P + n - L + torch.arange(L, device=q.device)
        visible = key_positions[None, :] <= query_positions[:, None]  # [L, P + n]
        scores = (q[b] @ keys.transpose(-1, -2)) * scale  # [H_q, L, P + n]
        scores = torch.where(visible, scores, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, 0.0)  # a query that sees no key: all weights 0
        weights = torch.where(visible, torch.exp(scores - top), 0.0)
        total = weights.sum(-1, keepdim=True)
        out[b] = (weights / torch.where(total > 0, total, 1.0)) @ values
    return out


# ---------------------------------------------------------------- the policy-loss family
#
# One function per formula, registered under the names users write (POLICY_LOSSES; a name can be
# registered once, as verl's register_policy_loss). Each reads the peers' installed code (the
# file and function are named in its docstring) and takes
#     fn(logp, old_logp, advantages, mask, *, <its options>, is_weights=None, agg=..., **agg_kw)
# returning (loss, stats): loss = agg(l * is_weights) of its per-token loss l (agg_loss above;
# is_weights detached), stats masked means over the local tokens under fastrlhf's names:
#     clipfrac        verl actor/pg_clipfrac, OpenRLHF clip_ratio (each mode's own meaning below)
#     clipfrac_lower  verl actor/pg_clipfrac_lower
#     approx_kl       verl actor/ppo_kl: mean(-log-ratio), the log-ratio clamped as the mode clamps it
#     approx_kl_unclamped  OpenRLHF ppo_kl: mean(old_logp - logp)
# The peers' masked means divide by n + 1e-8 (verl; float32 arithmetic for a bool or integer mask,
# where that is n exactly), n (OpenRLHF) or max(n, 1) (TRL); these divide by n, 0 for an empty mask.
# Gradient rules at ties are this module's (docstring at the top).

POLICY_LOSSES: dict = {}


def register_policy_loss(*names):
    """Decorator: POLICY_LOSSES[name] = fn for each name; a name registered twice is a ValueError."""

    def decorator(fn):
        for name in names:
            if name in POLICY_LOSSES:
                raise ValueError(f"policy loss {name!r} is already registered ({POLICY_LOSSES[name].__name__})")
            POLICY_LOSSES[name] = fn
        return fn

    return decorator


def clamp_log_ratio(x, bounds):
    """x clamped to bounds: None (no clamp), c (to [-c, c]) or (lo, hi) with None for an open side."""
    if bounds is None:
        return x
    lo, hi = (-bounds, bounds) if isinstance(bounds, (int, float)) else bounds
    return clamped(x, lo, hi)


def row_mean(x, mask):
    """[B, 1]: sum_t m x / max(n_b, 1), the per-sequence mean of x over its mask=1 tokens (0 for an
    empty row), as verl's gspo, OpenRLHF's gspo and TRL's sequence level divide."""
    m = mask.to(x.dtype)
    return masked(x, m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)


def importance_ratio(logp, old_logp, mask, *, level="token", log_ratio_clamp=LOG_RATIO_CLAMP):
    """(ratio, log_ratio), both [B, T], of pi / pi_old at `level`:
    token:          x_t = logp_t - old_logp_t
    sequence:       s_b = mean_t x_t over the row's tokens (GSPO's length-normalised sequence ratio),
                    the gradient through the mean: d s_b / d logp_t = m_t / n_b (OpenRLHF gspo, TRL
                    importance_sampling_level="sequence")
    sequence_token: sg[s_b] + logp_t - sg[logp_t]: the value s_b, the gradient of x_t (GSPO-token;
                    verl's "gspo")
    then clamped with `log_ratio_clamp` (clamp_log_ratio), ratio = exp(log_ratio)."""
    x = logp - old_logp
    if level == "token":
        log_ratio = x
    elif level == "sequence":
        log_ratio = row_mean(x, mask).expand_as(x)
    else:
        log_ratio = row_mean(x, mask).detach() + (logp - logp.detach())
    log_ratio = clamp_log_ratio(log_ratio, log_ratio_clamp)
    return torch.exp(log_ratio), log_ratio


def _token_log_ratio(logp, old_logp, level, log_ratio_clamp):
    """The per-token log-ratio verl's metrics average (approx_kl): clamped as the mode clamps it at the
    token level, raw at the sequence levels."""
    x = logp - old_logp
    return clamp_log_ratio(x, log_ratio_clamp) if level == "token" else x


def _family_stats(mask, log_ratio, logp, old_logp, **flags):
    """The masked means every mode reports: approx_kl (of -log_ratio), approx_kl_unclamped, and each
    flag (a bool or float [B, T], None: 0)."""
    stats = {name: masked_mean(torch.zeros_like(logp) if f is None else f.to(logp.dtype), mask).detach()
             for name, f in flags.items()}
    stats["approx_kl"] = masked_mean(-log_ratio, mask).detach()
    stats["approx_kl_unclamped"] = masked_mean(old_logp - logp, mask).detach()
    return stats


def _weighted(losses, is_weights):
    return losses if is_weights is None else losses * is_weights.detach()


@register_policy_loss("vanilla", "ppo")
def clipped_surrogate(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None, dual_clip=None, delta=None,
                      ratio_level="token", log_ratio_clamp=LOG_RATIO_CLAMP, is_weights=None, agg="token-mean",
                      **agg_kw):
    """PPO's clipped surrogate, l = max(-A r1, -A clip(r, 1 - clip_low, 1 + clip_high)), r1 = min(r, delta)
    (delta: TRL's two-sided clip; None: r1 = r); dual-clip c (A < 0 only): l = min(l, -A c).
    r = importance_ratio(level=ratio_level, log_ratio_clamp).
    Read from verl 0.9.1 core_algos.compute_policy_loss_vanilla (token, +-20, dual-clip c =
    clip_ratio_c), OpenRLHF 0.11.2 models/loss.py PolicyLoss.forward "ppo" (token, +-20, optional
    dual_clip) and "gspo" (sequence, no clamp), TRL 1.16 GRPOTrainer._compute_loss for grpo, bnpo,
    dr_grpo, dapo and luspo (token or sequence, no clamp, delta): the same values; they differ in the
    options above and in the aggregation (agg, agg_kw).
    stats: clipfrac = [l2 > l1] (verl pg_clipfrac, OpenRLHF clip_ratio: surr2 < surr1), clipfrac_lower
    = [l > -A c and A < 0], approx_kl, approx_kl_unclamped.
    Ties: max(l1, l2) and min(l, -A c) give the gradient to the unclipped term; the clamps pass it at
    their bounds (module docstring)."""
    clip_high = clip_low if clip_high is None else clip_high
    ratio, log_ratio = importance_ratio(logp, old_logp, mask, level=ratio_level, log_ratio_clamp=log_ratio_clamp)
    l1 = -advantages * (ratio if delta is None else clamped(ratio, hi=delta))
    l2 = -advantages * clamped(ratio, 1 - clip_low, 1 + clip_high)
    losses = torch.where(l2 > l1, l2, l1)  # max(l1, l2); a tie goes to l1
    lower = None
    if dual_clip is not None:
        l3 = -advantages * dual_clip
        lower = (losses > l3) & (advantages < 0)
        losses = torch.where(lower, l3, losses)  # min(l, l3) where A < 0; a tie goes to l
    stats = _family_stats(mask, _token_log_ratio(logp, old_logp, ratio_level, log_ratio_clamp), logp, old_logp,
                          clipfrac=l2 > l1, clipfrac_lower=lower)
    return agg_loss(_weighted(losses, is_weights), mask, agg, **agg_kw), stats


@register_policy_loss("gspo")
def gspo(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None, dual_clip=None, delta=None,
         log_ratio_clamp=None, is_weights=None, agg="seq-mean-token-mean", **agg_kw):
    """GSPO: the clipped surrogate of the sequence ratio s_b = exp(mean_t (logp - old_logp)), its
    gradient through the mean (clipped_surrogate with ratio_level="sequence"). Read from OpenRLHF
    0.11.2 PolicyLoss.forward "gspo" (per-sample mean aggregation, which it forces) and TRL 1.16
    GRPOTrainer._compute_loss with importance_sampling_level="sequence". verl's "gspo" is gspo_token."""
    return clipped_surrogate(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                             dual_clip=dual_clip, delta=delta, ratio_level="sequence", log_ratio_clamp=log_ratio_clamp,
                             is_weights=is_weights, agg=agg, **agg_kw)


@register_policy_loss("gspo_token")
def gspo_token(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None, log_ratio_clamp=(None, 10.0),
               is_weights=None, agg="seq-mean-token-mean", **agg_kw):
    """GSPO-token: the clipped surrogate of s_bt = sg[s_b] pi_t / sg[pi_t] (value s_b, the gradient of
    the token's own log-prob), the log clamped at <= 10. Read from verl 0.9.1
    core_algos.compute_policy_loss_gspo (no dual clip; its pg_clipfrac_lower is 0). Equal to gspo in
    value, clipping and gradient when the advantage is constant over each sequence."""
    return clipped_surrogate(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                             ratio_level="sequence_token", log_ratio_clamp=log_ratio_clamp, is_weights=is_weights,
                             agg=agg, **agg_kw)


@register_policy_loss("luspo")
def luspo(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None, delta=None, ratio_level="sequence",
          log_ratio_clamp=None, is_weights=None, agg="seq-mean-token-sum", **agg_kw):
    """LUSPO: GSPO's clipped surrogate summed over each sequence's tokens (its loss scales with the
    length), averaged over sequences. Read from TRL 1.16 GRPOTrainer._compute_loss loss_type="luspo":
    (per_token_loss * mask).sum(-1).mean() / gradient_accumulation_steps (agg="seq-mean-token-sum",
    global_num_seqs = B x steps)."""
    return clipped_surrogate(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, delta=delta,
                             ratio_level=ratio_level, log_ratio_clamp=log_ratio_clamp, is_weights=is_weights, agg=agg,
                             **agg_kw)


@register_policy_loss("cispo")
def cispo(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None, ratio_max=None, ratio_level="token",
          log_ratio_clamp=LOG_RATIO_CLAMP, is_weights=None, agg="token-mean", **agg_kw):
    """CISPO: l = -sg[clip(r)] A logp, the ratio clipped and detached, the gradient through logp only.
    clip(r) = clamp(r, 1 - clip_low, 1 + clip_high) (verl 0.9.1 core_algos.compute_policy_loss_cispo,
    r of the +-20-clamped log-ratio), or min(r, ratio_max) when ratio_max is given (TRL 1.16
    GRPOTrainer._compute_loss loss_type="cispo": clamp(coef_1, max=epsilon_high), no log clamp, token or
    sequence level). stats: clipfrac = [r != clip(r)] (verl), clipfrac_high = [r > ratio_max and A > 0]
    (TRL cispo_clip_ratio), approx_kl."""
    clip_high = clip_low if clip_high is None else clip_high
    ratio, log_ratio = importance_ratio(logp, old_logp, mask, level=ratio_level, log_ratio_clamp=log_ratio_clamp)
    bounded = clamped(ratio, 1 - clip_low, 1 + clip_high) if ratio_max is None else clamped(ratio, hi=ratio_max)
    losses = -bounded.detach() * advantages * logp
    high = None if ratio_max is None else (ratio > ratio_max) & (advantages > 0)
    stats = _family_stats(mask, _token_log_ratio(logp, old_logp, ratio_level, log_ratio_clamp), logp, old_logp,
                          clipfrac=ratio != bounded, clipfrac_lower=None, clipfrac_high=high)
    return agg_loss(_weighted(losses, is_weights), mask, agg, **agg_kw), stats


@register_policy_loss("sapo")
def sapo(logp, old_logp, advantages, mask, *, tau_pos=1.0, tau_neg=1.05, ratio_level="token",
         log_ratio_clamp=LOG_RATIO_CLAMP, is_weights=None, agg="seq-mean-token-mean", **agg_kw):
    """SAPO: l = -A f(r), f(r) = sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos where A > 0, else tau_neg.
    Read from verl 0.9.1 core_algos.compute_policy_loss_sapo (token ratio of the +-20-clamped
    log-ratio, always aggregated "seq-mean-token-mean") and TRL 1.16 GRPOTrainer._compute_loss
    loss_type="sapo" (no log clamp, token or sequence level; its temperatures are float32 tensors:
    torch.where of two Python floats, so it uses float32(1.05) where this takes tau_neg as given).
    stats: clipfrac = clipfrac_lower = 0 (verl reports zeros), approx_kl."""
    ratio, log_ratio = importance_ratio(logp, old_logp, mask, level=ratio_level, log_ratio_clamp=log_ratio_clamp)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    losses = -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * advantages
    stats = _family_stats(mask, _token_log_ratio(logp, old_logp, ratio_level, log_ratio_clamp), logp, old_logp,
                          clipfrac=None, clipfrac_lower=None)
    return agg_loss(_weighted(losses, is_weights), mask, agg, **agg_kw), stats


@register_policy_loss("gpg", "reinforce")
def reinforce(logp, old_logp, advantages, mask, *, is_weights=None, agg="token-mean", **agg_kw):
    """REINFORCE / GPG: l = -A logp. Read from verl 0.9.1 core_algos.compute_policy_loss_gpg (no
    metrics) and compute_policy_loss_reinforce (bypass mode's; old_logp is the rollout's there, its
    ppo_kl = approx_kl_unclamped = mean(old_logp - logp))."""
    losses = -advantages * logp
    stats = _family_stats(mask, logp - old_logp, logp, old_logp)
    return agg_loss(_weighted(losses, is_weights), mask, agg, **agg_kw), stats


@register_policy_loss("dro")
def dro(logp, old_logp, advantages, mask, *, beta, is_weights=None, agg="token-mean", **agg_kw):
    """DRO: l = -(A logp - beta (logp - old_logp)^2 / 2), beta > 0. Read from verl 0.9.1
    core_algos.compute_policy_loss_dro (policy_loss.dro_beta); stats: approx_kl (unclamped)."""
    if beta is None or not beta > 0:
        raise ValueError(f"dro needs beta > 0, got {beta!r}")
    log_ratio = logp - old_logp
    losses = -(logp * advantages - 0.5 * beta * log_ratio.square())
    return agg_loss(_weighted(losses, is_weights), mask, agg, **agg_kw), _family_stats(mask, log_ratio, logp, old_logp)


def _dppo(logp, old_logp, advantages, mask, valid, ratio_max, log_ratio_clamp, is_weights, agg, agg_kw):
    """DPPO's l = -A sg[min(r, ratio_max)] logp [valid] (valid detached); stats: clipfrac = [not valid],
    clipfrac_lower = [r > ratio_max and valid], approx_kl."""
    ratio, log_ratio = importance_ratio(logp, old_logp, mask, log_ratio_clamp=log_ratio_clamp)
    valid = valid.detach().to(logp.dtype)
    losses = -advantages * clamped(ratio, hi=ratio_max).detach() * logp * valid
    stats = _family_stats(mask, log_ratio, logp, old_logp, clipfrac=1 - valid,
                          clipfrac_lower=(ratio > ratio_max) * valid)
    return agg_loss(_weighted(losses, is_weights), mask, agg, **agg_kw), stats


@register_policy_loss("dppo_tv")
def dppo_tv(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None, ratio_max=20.0,
            log_ratio_clamp=LOG_RATIO_CLAMP, is_weights=None, agg="token-mean", **agg_kw):
    """DPPO-Binary-TV: a token takes part while the probability moved less than the thresholds toward
    its advantage: p - p_old <= clip_high (A > 0), p - p_old >= -clip_low (A <= 0), p = exp(logp).
    Read from verl 0.9.1 core_algos.compute_policy_loss_dppo_tv (clip_ratio_low/high are TV thresholds;
    ratio_max = clip_ratio_c, whose code default is 20, ActorConfig's 3)."""
    clip_high = clip_low if clip_high is None else clip_high
    change = torch.exp(logp) - torch.exp(old_logp)
    valid = torch.where(advantages > 0, change <= clip_high, change >= -clip_low)
    return _dppo(logp, old_logp, advantages, mask, valid, ratio_max, log_ratio_clamp, is_weights, agg, agg_kw)


@register_policy_loss("dppo_kl")
def dppo_kl(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None, ratio_max=20.0,
            log_ratio_clamp=LOG_RATIO_CLAMP, is_weights=None, agg="token-mean", **agg_kw):
    """DPPO-Binary-KL: the binary KL of the sampled token's probability,
    kl = q (old_logp - logp) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8)), q = p_old, p = exp(logp),
    must stay <= clip_high (A > 0) / clip_low (A <= 0) unless p moved against the advantage.
    Read from verl 0.9.1 core_algos.compute_policy_loss_dppo_kl."""
    clip_high = clip_low if clip_high is None else clip_high
    p, q = torch.exp(logp), torch.exp(old_logp)
    eps = DPPO_BINARY_KL_EPS
    binary_kl = q * (old_logp - logp) + (1 - q) * torch.log((1.0 - q + eps) / (1.0 - p + eps))
    valid = torch.where(advantages > 0, (binary_kl <= clip_high) | (p <= q), (binary_kl <= clip_low) | (p >= q))
    return _dppo(logp, old_logp, advantages, mask, valid, ratio_max, log_ratio_clamp, is_weights, agg, agg_kw)


def covariance(advantages, logp, mask):
    """(A - mean A)(logp - mean logp) per token, the means over the mask=1 tokens, no gradient (the
    Clip-Cov / KL-Cov selection statistic)."""
    a, lp = advantages.detach(), logp.detach()
    return (a - masked_mean(a, mask)) * (lp - masked_mean(lp, mask))


@register_policy_loss("clip_cov")
def clip_cov(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None, clip_cov_ratio=2e-4,
             clip_cov_lb=1.0, clip_cov_ub=5.0, generator=None, log_ratio_clamp=None, is_weights=None,
             agg="token-mean", **agg_kw):
    """Clip-Cov: the clipped surrogate without dual clip, whose loss (and gradient) is dropped at
    max(int(clip_cov_ratio * n), 1) tokens drawn at random among those with clip_cov_lb < cov <
    clip_cov_ub (covariance above) that the ratio clip left alone. Read from verl 0.9.1
    core_algos.compute_policy_loss_clip_cov: the candidates in row-major order, the draw
    torch.randperm(#candidates, generator=generator)[:k] (verl's: the default CPU generator).
    stats: clipfrac = the dropped fraction (verl's pg_clipfrac), approx_kl."""
    clip_high = clip_low if clip_high is None else clip_high
    ratio, log_ratio = importance_ratio(logp, old_logp, mask, log_ratio_clamp=log_ratio_clamp)
    l1 = -advantages * ratio
    l2 = -advantages * clamped(ratio, 1 - clip_low, 1 + clip_high)
    selected = mask != 0
    cov = covariance(advantages, logp, mask)
    candidates = torch.nonzero((cov > clip_cov_lb) & (cov < clip_cov_ub) & selected & ~(l2 > l1))
    dropped = torch.zeros_like(selected)
    if len(candidates) > 0:
        k = max(int(clip_cov_ratio * float(mask.sum())), 1)
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:k]]
        dropped[chosen[:, 0], chosen[:, 1]] = True
    losses = torch.where(dropped, torch.zeros_like(l1), torch.where(l2 > l1, l2, l1))
    stats = _family_stats(mask, log_ratio, logp, old_logp, clipfrac=dropped)
    return agg_loss(_weighted(losses, is_weights), mask, agg, **agg_kw), stats


@register_policy_loss("kl_cov")
def kl_cov(logp, old_logp, advantages, mask, *, kl_cov_ratio=2e-4, ppo_kl_coef=1.0, log_ratio_clamp=None,
           is_weights=None, agg="token-mean", **agg_kw):
    """KL-Cov: l = -A r, plus ppo_kl_coef |logp - old_logp| at the max(int(kl_cov_ratio * n), 1) tokens
    of largest covariance (above; ties as torch.topk). Read from verl 0.9.1
    core_algos.compute_policy_loss_kl_cov (its ppo_kl_coef code default 1.0, PolicyLossConfig's 0.1).
    stats: approx_kl_abs = mean |logp - old_logp| (verl's actor/ppo_kl here), approx_kl."""
    ratio, log_ratio = importance_ratio(logp, old_logp, mask, log_ratio_clamp=log_ratio_clamp)
    losses = -advantages * ratio
    selected = (mask != 0).flatten()
    chosen = torch.zeros_like(selected)
    n = int(selected.sum())
    if n > 0:
        cov = covariance(advantages, logp, mask).flatten()[selected]
        top = torch.topk(cov, max(1, int(n * kl_cov_ratio)), largest=True).indices
        chosen[selected.nonzero().flatten()[top]] = True
    chosen = chosen.view(mask.shape)
    losses = torch.where(chosen, losses + ppo_kl_coef * absolute(log_ratio), losses)
    stats = _family_stats(mask, log_ratio, logp, old_logp)
    stats["approx_kl_abs"] = masked_mean(absolute(log_ratio), mask).detach()
    return agg_loss(_weighted(losses, is_weights), mask, agg, **agg_kw), stats


@register_policy_loss("geo_mean")
def geo_mean(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None, is_weights=None,
             global_num_seqs=None, dp_size=1):
    """GMPO: one loss per sequence, l_b = -mean_t(A) exp(mean_t x~), x~ the log-ratio clipped on the
    side its advantage pushes (A > 0: min(x, clip_high); A < 0: max(x, -clip_low); A = 0: 0);
    loss = sum_b l_b / (global_num_seqs or B) * dp_size, every row counted (an empty row's l_b is 0).
    is_weights enter per sequence as exp(mean_t log(w + 1e-10)). Read from verl 0.9.1
    core_algos.compute_policy_loss_geo_mean (torch.mean over the B rows; it ignores loss_agg_mode and
    the global batch info; its means divide by n + 1e-8, these by n). stats: clipfrac = [x != clamp(x,
    -clip_low, clip_high) and A > 0], clipfrac_lower the same for A < 0, approx_kl (unclamped).
    Ties: at x == clip_high (A > 0) or x == -clip_low (A < 0) the gradient passes."""
    clip_high = clip_low if clip_high is None else clip_high
    x = logp - old_logp
    bound = torch.where(advantages > 0, torch.full_like(x, clip_high), torch.full_like(x, -clip_low))
    beyond = torch.where(advantages > 0, x > clip_high, x < -clip_low)
    x_clipped = torch.where(advantages == 0, torch.zeros_like(x), torch.where(beyond, bound, x))
    losses = -row_mean(advantages, mask) * torch.exp(row_mean(x_clipped, mask))
    if is_weights is not None:
        losses = losses * torch.exp(row_mean(torch.log(is_weights.detach() + GEO_MEAN_IS_EPS), mask))
    n_seqs = losses.shape[0] if global_num_seqs is None else global_num_seqs
    loss = losses.sum() / n_seqs * dp_size if n_seqs > 0 else losses.sum() * 0
    outside = x != torch.clamp(x, -clip_low, clip_high)
    stats = _family_stats(mask, x, logp, old_logp, clipfrac=outside & (advantages > 0),
                          clipfrac_lower=outside & (advantages < 0))
    return loss, stats


def vespo_weights(log_ratio, advantages, mask, *, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0,
                  sampler_weights=None):
    """VESPO's gamma weights, no gradient: phi(w) = exp(lam + k log w - lam w), w the sequence ratio
    exp(clamp(sum_t m clamp(log_ratio, +-20) + sum_t m clamp(log s, log 1e-8, 20), log 1e-8, 20)) with
    s = sampler_weights (the sampler correction's per-token weights, None: none), (k, lam) =
    (k_pos, lambda_pos) where A >= 0 else (k_neg, lambda_neg), lam >= 1e-4; non-finite phi is 0.
    Read from TRL 1.16 GRPOTrainer.get_gamma_weights (it sums log s over every position, where TRL's
    own IS ratios are 1 off the mask; this sums over the mask)."""
    lr = clamp_log_ratio(log_ratio.detach(), LOG_RATIO_CLAMP)
    seq = masked(lr, mask).sum(-1, keepdim=True)
    if sampler_weights is not None:
        log_s = torch.clamp(torch.log(sampler_weights.detach()), VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
        seq = seq + masked(log_s, mask).sum(-1, keepdim=True)
    log_w = torch.clamp(seq, VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
    nonneg = advantages >= 0
    k = torch.where(nonneg, torch.full_like(advantages, k_pos), torch.full_like(advantages, k_neg))
    lam = torch.where(nonneg, torch.full_like(advantages, lambda_pos), torch.full_like(advantages, lambda_neg))
    lam = lam.clamp(min=VESPO_LAMBDA_MIN)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).detach()


@register_policy_loss("vespo")
def vespo(logp, old_logp, advantages, mask, *, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0,
          sampler_weights=None, is_weights=None, agg="token-mean", **agg_kw):
    """VESPO: l = -phi A logp with the detached gamma weight phi of the sequence ratio (vespo_weights);
    the sampler correction enters phi (sampler_weights), not the loss (TRL multiplies every other loss
    type by it). Read from TRL 1.16 GRPOTrainer._compute_loss loss_type="vespo". stats: phi_mean
    (masked mean of phi), approx_kl."""
    phi = vespo_weights(logp - old_logp, advantages, mask, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg,
                        lambda_neg=lambda_neg, sampler_weights=sampler_weights)
    losses = -phi * advantages * logp
    stats = _family_stats(mask, logp - old_logp, logp, old_logp)
    stats["phi_mean"] = masked_mean(phi, mask)
    return agg_loss(_weighted(losses, is_weights), mask, agg, **agg_kw), stats

def high_entropy_mask(entropy, mask, quantile):
    """[B, T] bool: the mask=1 tokens whose entropy is >= the (1 - quantile) quantile of the mask=1
    entropies (quantile = the fraction of tokens kept; 1 keeps all), the quantile computed in float32
    as TRL 1.16 GRPOTrainer.get_high_entropy_mask computes it (torch.quantile, linear
    interpolation). An empty mask keeps nothing."""
    selected = mask != 0
    values = entropy.detach()[selected].float()
    if values.numel() == 0:
        return torch.zeros_like(selected)
    threshold = torch.quantile(values, 1 - quantile)
    return (entropy.detach() * mask >= threshold) & selected


def off_policy_sequence_mask(logp, sampling_logp, advantages, mask, *, threshold):
    """[B, T] float: 0 for the sequences DeepSeek-V3.2's off-policy sequence masking drops (A < 0 and
    mean_t (sampling_logp - logp) > threshold, NaN differences counted as 0), 1 elsewhere. Read from
    TRL 1.16 GRPOTrainer.get_off_policy_mask (off_policy_mask_threshold)."""
    kl = torch.nan_to_num((sampling_logp - logp).detach(), nan=0.0)
    keep = (advantages >= 0) | (row_mean(kl, mask) <= threshold)
    return keep.to(logp.dtype)


# ---------------------------------------------------------------- rollout (sampler vs trainer) correction


def _row_sum(x, mask):
    return masked(x, mask).sum(-1, keepdim=True)


def _row_means(x, mask):
    """[B]: the per-row masked means, 0 for an empty row (verl's masked_mean(x, mask, axis=-1))."""
    m = mask.to(x.dtype)
    n = m.sum(-1)
    return torch.where(n > 0, masked(x, m).sum(-1) / n.clamp(min=1), torch.zeros_like(n))


def _extreme(x, mask, largest):
    """max (largest) or min of x over the mask=1 entries; 0 when there are none."""
    values = x[mask != 0]
    if values.numel() == 0:
        return x.new_zeros(())
    return values.max() if largest else values.min()


INF = float("inf")


def _log(v):
    """log of a Python number in float64 (-inf at 0)."""
    return torch.log(torch.tensor(v, dtype=torch.float64)).item()


def _bounds(low, high):
    return -INF if low is None else low, INF if high is None else high


def _gate_statistic(old_logp, rollout_logp, log_ratio, mask, level, gate):
    """The statistic a mask compares with [low, high], per token [B, T] or per row [B, 1]:
    gate="ratio": the level's ratio, exp(x), exp(sum_t x) or exp(mean_t x), x the log-ratio;
    "binary_kl" / "tv": the divergence of the sampled token's probabilities p = pi_rollout,
    q = pi_train, each clamped to [1e-6, 1 - 1e-6]: p log(p / q) + (1 - p) log((1 - p) / (1 - q)) or
    |p - q|, per token, or its row sum / mean. (OpenRLHF 0.11.2 PolicyLoss.forward's gating.)"""
    if gate == "ratio":
        stat = log_ratio
    else:
        p = torch.exp(rollout_logp).clamp(GATE_PROB_CLAMP, 1 - GATE_PROB_CLAMP)
        q = torch.exp(old_logp).clamp(GATE_PROB_CLAMP, 1 - GATE_PROB_CLAMP)
        if gate == "binary_kl":
            stat = p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))
        else:
            stat = absolute(p - q)
    if level == "sequence":
        stat = _row_sum(stat, mask)
    elif level == "geometric":
        stat = row_mean(stat, mask)
    return torch.exp(stat) if gate == "ratio" else stat


def rollout_correction(old_logp, rollout_logp, mask, *, level="token", mode="truncate", low=None, high=2.0,
                       gate="ratio", weight="level", log_ratio_clamp=LOG_RATIO_CLAMP, missing="propagate",
                       batch_normalize=False, reject=None):
    """Importance weights for tokens sampled by another engine (vLLM, SGLang) than the trainer, and a
    rejection mask; returns (weights [B, T] or None for level=None, keep [B, T] bool, metrics).

    x_t = old_logp_t - rollout_logp_t (log pi_train / pi_rollout; missing="ignore": a NaN x counts
    as 0, TRL). The level's log-ratio L: token x_t; sequence sum_t m x (the sequence's ratio);
    geometric mean_t m x (its per-token geometric mean); raw = exp(clamp_log_ratio(L,
    log_ratio_clamp)) on every token of the unit.
    mode="truncate": w = clamp(raw, low, high) (verl's TIS: high only; TRL's *_truncate; OpenRLHF's
        clip: token level);
    mode="mask": w = raw where the unit's gate statistic (_gate_statistic) lies in [low, high], else 0
        (verl's IcePop, TRL's *_mask, OpenRLHF's mask); weight="token" keeps each token's own ratio
        there instead of the unit's (OpenRLHF's seq level).
    batch_normalize (verl): w / mean(w) over the tokens (token level) or over the non-empty rows'
    means (otherwise), when that mean is > 1e-8. w is 0 where mask = 0 and carries no gradient.
    keep = mask != 0 and every rejection criterion of `reject` (verl's rollout_rs; _rejection).

    metrics (detached 0-dim tensors, named as verl's rollout_corr/* without the prefix, plus
    OpenRLHF's is_filtered_fraction and TRL's sampling_* ones): _is_metrics, _rejection,
    offpolicy_metrics. Read from verl 0.9.1 trainer/ppo/rollout_corr_helper.py
    (compute_rollout_correction_and_rejection_mask and the functions it calls), OpenRLHF 0.11.2
    models/loss.py PolicyLoss.forward (its train/rollout correction) and TRL 1.16
    GRPOTrainer._generate_and_score_completions (vllm_importance_sampling_*). An empty mask gives
    zero weights and metrics (verl raises).
    """
    selected = mask != 0
    x = old_logp.detach() - rollout_logp.detach()
    if missing == "ignore":
        x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    metrics = offpolicy_metrics(old_logp, rollout_logp, mask)
    metrics.update(trl_sampling_metrics(old_logp, rollout_logp, mask))
    keep = selected
    if reject:
        keep, rs_metrics = _rejection(x, mask, reject)
        metrics.update(rs_metrics)
    if level is None:
        return None, keep, metrics
    log_stat = x if level == "token" else (_row_sum(x, mask) if level == "sequence" else row_mean(x, mask))
    unit = torch.exp(clamp_log_ratio(log_stat, log_ratio_clamp))  # the unit's ratio, [B, T] or [B, 1]
    raw = torch.where(selected, unit.expand_as(x), torch.zeros_like(x))
    lo, hi = _bounds(low, high)
    if mode == "truncate":
        unit_w = torch.clamp(unit, low, high)
        filtered = (unit < lo) | (unit > hi)
    else:
        stat = _gate_statistic(old_logp.detach(), rollout_logp.detach(), x, mask, level, gate)
        in_band = (stat >= lo) & (stat <= hi)
        value = unit if weight == "level" else torch.exp(clamp_log_ratio(x, log_ratio_clamp))
        unit_w = torch.where(in_band, value, torch.zeros_like(value))
        filtered = ~in_band
    weights = torch.where(selected, unit_w.expand_as(x), torch.zeros_like(x))
    metrics.update(_is_metrics(weights, raw, log_stat, mask, level, mode, low, high))
    metrics.update(trl_ratio_metrics(weights, unit_w, mask, level))
    if level == "token":
        metrics["is_filtered_fraction"] = masked_mean(filtered.to(x.dtype), mask)
    else:  # a row with no token counts as filtered (OpenRLHF: its NaN statistic fails the band)
        empty = ~selected.any(-1, keepdim=True)
        metrics["is_filtered_fraction"] = (filtered | empty).to(x.dtype).mean()
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            nonempty = selected.any(-1)
            mean = _row_means(weights, mask)[nonempty].sum() / max(int(nonempty.sum()), 1)
        normalize = bool(mean > BATCH_NORMALIZE_MIN)
        weights = weights / mean if normalize else weights
        metrics["rollout_is_batch_norm_factor"] = mean if normalize else torch.ones_like(mean)
    return weights, keep, {k: v.detach() for k, v in metrics.items()}


def _is_metrics(weights, raw, log_stat, mask, level, mode, low, high):
    """verl 0.9.1 rollout_corr_helper.compute_is_metrics (before batch normalisation): upper = high,
    lower = low or 1 / high. At a row level the max / min / threshold fractions are of the rows' log
    statistic over all B rows (max clamped at exp(20)); at the token level of the tokens. std and ESS
    of the weights clamped to [0, upper]: ESS = 1 / mean((w / (mean(w) + 1e-8))^2). The per-row mean
    weights over all B rows (0 for an empty one) give the seq_* metrics; mask mode adds oob_ratio."""
    upper = INF if high is None else high
    lower = 1.0 / upper if low is None else low
    out = {"rollout_is_mean": masked_mean(weights, mask)}
    if level == "token":
        out["rollout_is_max"] = _extreme(weights, mask, True)
        out["rollout_is_min"] = _extreme(weights, mask, False)
        out["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).to(raw.dtype), mask)
        out["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).to(raw.dtype), mask)
    else:
        out["rollout_is_max"] = torch.exp(torch.clamp(log_stat.max(), max=LOG_RATIO_CLAMP))
        out["rollout_is_min"] = torch.exp(log_stat.min())
        out["rollout_is_ratio_fraction_high"] = (log_stat > _log(upper)).to(raw.dtype).mean()
        out["rollout_is_ratio_fraction_low"] = (log_stat < _log(lower)).to(raw.dtype).mean()
    clipped = torch.clamp(weights, 0.0, upper)
    mean = masked_mean(clipped, mask)
    n = mask.to(raw.dtype).sum()
    variance = masked_mean(clipped * clipped, mask) - mean * mean
    out["rollout_is_std"] = torch.sqrt(torch.clamp(variance, min=0.0)) if n > 1 else torch.zeros_like(mean)
    normalized = clipped / (mean + IS_ESS_EPS)
    # (0 for an empty mask, where verl raises)
    out["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalized * normalized, mask) if n > 0 else n * 0
    per_row = _row_means(weights, mask)
    out["rollout_is_seq_mean"] = per_row.mean()
    out["rollout_is_seq_std"] = per_row.std() if per_row.numel() > 1 else torch.zeros_like(mean)
    out["rollout_is_seq_max"] = per_row.max()
    out["rollout_is_seq_min"] = per_row.min()
    out["rollout_is_seq_max_deviation"] = absolute(per_row - 1.0).max()
    raw_rows = _row_means(raw, mask)
    out["rollout_is_seq_fraction_high"] = (raw_rows > upper).to(raw.dtype).mean()
    out["rollout_is_seq_fraction_low"] = (raw_rows < lower).to(raw.dtype).mean()
    if mode == "mask":
        out["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).to(raw.dtype), mask)
    return out


def _divergences(x):
    """verl's rejection statistics of the +-20-clamped log-ratio x: k1 = -x, k2 = x^2 / 2,
    k3 = exp(x) - 1 - x."""
    c = clamp_log_ratio(x, LOG_RATIO_CLAMP)
    return {"k1": -c, "k2": 0.5 * c * c, "k3": torch.exp(c) - 1.0 - c}


def _rejection(x, mask, reject):
    """(keep [B, T] bool, metrics) of verl 0.9.1 rollout_corr_helper.compute_rollout_rejection_mask.
    reject = {criterion: threshold}, criterion in REJECTION_CRITERIA: token_kN (per token), seq_sum_kN,
    seq_mean_kN, seq_max_kN (per row, over its mask=1 tokens) of the statistics of _divergences; a
    k1 criterion keeps log(lower) <= k1 <= log(upper) for threshold (lower, upper) (a single number u
    means (1 / u, u)), the others keep statistic <= threshold. Every criterion must pass.
    metrics per criterion c: rollout_rs_{c}_* (_rs_metrics), _masked_fraction (of the mask=1 tokens),
    _seq_masked_fraction (of the non-empty rows); overall rollout_rs_masked_fraction and
    rollout_rs_seq_masked_fraction (of all B rows: those with a rejected token)."""
    selected = mask != 0
    stats = _divergences(x)
    keep = torch.ones_like(selected)
    nonempty = selected.any(-1)
    metrics = {}
    for name, threshold in reject.items():
        level, k = name.rsplit("_", 1)
        if k == "k1":
            lower, upper = (1.0 / threshold, threshold) if isinstance(threshold, (int, float)) else threshold
            lower, upper = _log(lower), _log(upper)
        else:
            lower, upper = None, threshold
        token = stats[k]
        if level == "token":
            per_row, value = None, token
        else:
            if level == "seq_sum":
                per_row = masked(token, mask).sum(-1)
            elif level == "seq_mean":
                per_row = _row_means(token, mask)
            else:
                per_row = torch.where(nonempty, torch.where(selected, token, -INF).max(-1).values,
                                      torch.zeros_like(nonempty, dtype=token.dtype))
            value = per_row.unsqueeze(-1).expand_as(token)
        passes = (value <= upper) if lower is None else (value >= lower) & (value <= upper)
        keep = keep & passes
        metrics.update(_rs_metrics(f"rollout_rs_{name}", value, per_row, mask, upper, lower))
        metrics[f"rollout_rs_{name}_masked_fraction"] = masked_mean((~passes).to(x.dtype), mask)
        row_kept = ~((~passes) & selected).any(-1)
        metrics[f"rollout_rs_{name}_seq_masked_fraction"] = (
            (~row_kept & nonempty).to(x.dtype).sum() / max(int(nonempty.sum()), 1))
    metrics["rollout_rs_masked_fraction"] = masked_mean((~keep).to(x.dtype), mask)
    metrics["rollout_rs_seq_masked_fraction"] = ((~keep) & selected).any(-1).to(x.dtype).mean()
    return keep & selected, metrics


def _rs_metrics(prefix, value, per_row, mask, upper, lower):
    """verl 0.9.1 rollout_corr_helper.compute_rs_metrics of one criterion: value [B, T] (a row
    criterion's value broadcast), per_row [B] or None (token criteria: the per-row means). lower is
    None except for k1 (then the fractions below it and a seq_fraction_low are reported)."""
    selected = mask != 0
    nonempty = selected.any(-1)
    rows = (_row_means(value, mask) if per_row is None else per_row)[nonempty]
    dtype = value.dtype
    out = {f"{prefix}_mean": masked_mean(value, mask)}
    on_rows = per_row is not None and rows.numel() > 0
    out[f"{prefix}_max"] = rows.max() if on_rows else _extreme(value, mask, True)
    out[f"{prefix}_min"] = rows.min() if on_rows else _extreme(value, mask, False)
    if on_rows:
        out[f"{prefix}_fraction_high"] = (rows > upper).to(dtype).mean()
        low = (rows < lower).to(dtype).mean() if lower is not None else None
    else:
        out[f"{prefix}_fraction_high"] = masked_mean((value > upper).to(dtype), mask)
        low = masked_mean((value < lower).to(dtype), mask) if lower is not None else None
    out[f"{prefix}_fraction_low"] = torch.zeros((), dtype=dtype) if low is None else low
    if mask.to(dtype).sum() > 1:
        clipped = torch.clamp(value, 0.0 if lower is None else lower, upper)
        mean = masked_mean(clipped, mask)
        out[f"{prefix}_std"] = torch.sqrt(torch.clamp(masked_mean(clipped * clipped, mask) - mean * mean, min=0.0))
    else:
        out[f"{prefix}_std"] = torch.zeros((), dtype=dtype)
    zero = torch.zeros((), dtype=dtype)
    if rows.numel() > 0:
        out[f"{prefix}_seq_mean"] = rows.mean()
        out[f"{prefix}_seq_std"] = rows.std() if rows.numel() > 1 else zero
        out[f"{prefix}_seq_max"] = rows.max()
        out[f"{prefix}_seq_min"] = rows.min()
        out[f"{prefix}_seq_max_deviation"] = absolute(rows).max()
        out[f"{prefix}_seq_fraction_high"] = (rows > upper).to(dtype).mean()
        if lower is not None:
            out[f"{prefix}_seq_fraction_low"] = (rows < lower).to(dtype).mean()
    else:  # verl raises for an empty mask before it gets here; 0 for each, keys as above
        for name in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high"):
            out[f"{prefix}_{name}"] = zero
        if lower is not None:
            out[f"{prefix}_seq_fraction_low"] = zero
    return out


def offpolicy_metrics(train_logp, rollout_logp, mask):
    """verl 0.9.1 rollout_corr_helper.compute_offpolicy_metrics: per-row mean log-probs l_b (0 for an
    empty row), every per-row figure averaged over all B rows; x = train_logp - rollout_logp.
    training_ppl = mean_b exp(-l_b^train), training_log_ppl = mean_b -l_b^train, the same for the
    rollout; kl = mean(rollout_logp - train_logp) (OpenRLHF's vllm_kl too), k3_kl = mean(exp(x) - x - 1);
    log_ppl_diff (abs, max, min) of d_b = l_b^rollout - l_b^train, ppl_ratio = mean_b exp(d_b);
    chi2_token = mean(exp(2 c)) - 1, chi2_seq = mean_b exp(2 clamp(sum_t m x, +-20)) - 1,
    c = clamp(x, +-20). Token means are masked means."""
    train, rollout = train_logp.detach(), rollout_logp.detach()
    x = train - rollout
    train_rows, rollout_rows = _row_means(train, mask), _row_means(rollout, mask)
    diff = rollout_rows - train_rows
    rho = torch.exp(clamp_log_ratio(x, LOG_RATIO_CLAMP))
    return {
        "training_ppl": torch.exp(-train_rows).mean(),
        "training_log_ppl": (-train_rows).mean(),
        "kl": masked_mean(rollout - train, mask),
        "k3_kl": masked_mean(torch.exp(x) - x - 1, mask),
        "rollout_ppl": torch.exp(-rollout_rows).mean(),
        "rollout_log_ppl": (-rollout_rows).mean(),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": absolute(diff).mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": torch.exp(diff).mean(),
        "chi2_token": masked_mean(rho * rho, mask) - 1.0,
        "chi2_seq": torch.exp(2.0 * clamp_log_ratio(masked(x, mask).sum(-1), LOG_RATIO_CLAMP)).mean() - 1.0,
    }


def trl_sampling_metrics(train_logp, rollout_logp, mask):
    """TRL 1.16 (_generate_and_score_completions): sampling_logp_difference_mean / _max of
    |train_logp - rollout_logp| over the mask=1 tokens whose difference is not NaN (0 when none)."""
    delta = absolute(train_logp.detach() - rollout_logp.detach())
    counted = (mask != 0) & ~torch.isnan(delta)
    values = delta[counted]
    zero = delta.new_zeros(())
    return {"sampling_logp_difference_mean": values.mean() if values.numel() else zero,
            "sampling_logp_difference_max": values.max() if values.numel() else zero}


def trl_ratio_metrics(weights, unit_weights, mask, level):
    """TRL 1.16: importance_sampling_ratio_min / _mean / _max of the applied weights, over the mask=1
    tokens (token level, or per-token weights) or over the B rows' weights, empty rows included (one
    weight per row)."""
    per_row = level != "token" and unit_weights.shape[-1] == 1
    values = unit_weights.flatten() if per_row else weights[mask != 0]
    zero = weights.new_zeros(())
    if values.numel() == 0:
        return {f"importance_sampling_ratio_{k}": zero for k in ("min", "mean", "max")}
    return {"importance_sampling_ratio_min": values.min(), "importance_sampling_ratio_mean": values.mean(),
            "importance_sampling_ratio_max": values.max()}
