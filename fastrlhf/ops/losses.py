"""The clipped PPO losses: `policy_loss`, `value_loss` and the whole actor loss from logits,
`ppo_actor_loss` (kernels: fastrlhf/kernels/ppo_loss.py and kernels/logprobs.py).

Every aggregation mode is per-row weights, computed host-side by `row_scale`:
    loss = sum_b scale[b] * sum_t mask[b, t] * l[b, t]
    token-mean               scale = 1 / (global_num_tokens or sum(mask))
    seq-mean-token-sum       scale = 1 / B
    seq-mean-token-mean      scale = 1 / (n_b * #rows with n_b > 0)
    seq-mean-token-sum-norm  scale = 1 / T
so one kernel per formula serves every mode, and the gradient of the loss is w * dl/dx with
w = scale[b] * mask. The per-token formulas and their gradients are written out below with the
tie rules of reference.py (the clamps pass the gradient at their bounds; at a tie of max/min the
unclipped term takes it), never left to a torch version's autograd.

Custom ops: fastrlhf::policy_loss, fastrlhf::value_loss (each -> (sums, d(loss)/d(input)), the
gradient formed in the same pass), fastrlhf::ppo_actor_loss (-> loss, stats, and what its
backward needs: one log-prob backward writes d(logits) once).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastrlhf.constants import AGG_MODES, IGNORE_INDEX, KL_ESTIMATORS, LOG_RATIO_CLAMP
from fastrlhf.ops._common import (
    as_rows,
    check_choice,
    check_float,
    check_int,
    check_mask,
    check_number,
    check_same,
    out_dtype,
    safe_inverse,
    use_triton,
)
from fastrlhf.ops.kl import kl_grad, kl_value
from fastrlhf.ops.logprobs import as_3d, logprobs_backward_op, logprobs_fwd

POLICY_SUMS = ("loss", "n_clipped", "n_clipped_lower", "neg_log_ratio", "n_mask")
VALUE_SUMS = ("loss", "n_clipped", "n_mask")
# per-token values the actor loss keeps, one row each, and the stats made from them
TOKEN_TERMS = ("pg", "kl", "clipped", "clipped_lower", "neg_log_ratio", "entropy")
ACTOR_STATS = ("clipfrac", "clipfrac_lower", "approx_kl", "pg_loss", "entropy", "kl")


# ---------------------------------------------------------------- aggregation and shared checks


def row_scale(mask: Tensor, agg: str, global_num_tokens, dtype: torch.dtype) -> Tensor:
    """Per-row weights [B] that turn sum_t mask * l into `agg` (module docstring); mask [B, T]."""
    m = mask.to(dtype)
    B, T = m.shape
    n_b = m.sum(-1)
    if agg == "token-mean":
        n = n_b.sum() if global_num_tokens is None else torch.tensor(float(global_num_tokens), dtype=dtype,
                                                                      device=m.device)
        return safe_inverse(n).expand(B)
    if agg == "seq-mean-token-sum":
        return torch.full((B,), 1.0 / max(B, 1), dtype=dtype, device=m.device)
    if agg == "seq-mean-token-mean":
        return safe_inverse(n_b * (n_b > 0).sum())
    return torch.full((B,), 1.0 / max(T, 1), dtype=dtype, device=m.device)  # seq-mean-token-sum-norm


def check_agg(agg, global_num_tokens) -> None:
    check_choice("agg", agg, AGG_MODES)
    if global_num_tokens is not None:
        if agg != "token-mean":
            raise ValueError(f"global_num_tokens applies to agg='token-mean' only, got agg={agg!r}")
        check_number("global_num_tokens", global_num_tokens, positive=True)


def check_clips(clip_low, clip_high, dual_clip):
    """(clip_low, clip_high defaulted to clip_low, dual_clip) as floats."""
    clip_low = check_number("clip_low", clip_low, nonnegative=True)
    clip_high = clip_low if clip_high is None else check_number("clip_high", clip_high, nonnegative=True)
    if dual_clip is not None:
        dual_clip = check_number("dual_clip", dual_clip, above=1.0)
    return clip_low, clip_high, dual_clip


def _masked_sum(flags, m: Tensor) -> Tensor:
    """sum(m) over the flagged tokens (None: no token is flagged)."""
    return m.new_zeros(()) if flags is None else (flags * m).sum()


# ---------------------------------------------------------------- per-token formulas (torch)


def policy_terms(logp, old_logp, advantages, clip_low, clip_high, dual_clip, need_grad=True):
    """verl's vanilla clipped surrogate per token, in the inputs' dtype:
    (loss l, dl/dlogp or None, clipped = [l2 > l1], clipped_lower or None, log_ratio).
    Selections are products with masks where they can be (torch.where is slow on CPU)."""
    x = logp - old_logp
    log_ratio = x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    neg_adv = -advantages
    l1 = neg_adv * torch.exp(log_ratio)
    l2 = neg_adv * torch.exp(log_ratio).clamp_(1.0 - clip_low, 1.0 + clip_high)
    clipped = l2 > l1  # counts as clipped only when strictly larger
    loss = torch.maximum(l1, l2)
    lower = None
    if dual_clip is not None:
        l3 = neg_adv * dual_clip
        lower = (advantages < 0) & (loss > l3)  # min(loss, l3) where A < 0
        loss = torch.where(lower, l3, loss)
    if not need_grad:
        return loss, None, clipped, lower, log_ratio
    # The gradient is dl1/dx = -A ratio = l1 wherever it counts, 0 elsewhere: where clipped (l2 > l1
    # only for a ratio outside [1 - clip_low, 1 + clip_high], where the clamp passes nothing), where
    # dual-clipped (-A c is constant) and where |x| > 20 (inside, the clamp returns x itself). At a
    # tie (l1 == l2, or loss == -A c) the unclipped term keeps it.
    counts = ~clipped & (x == log_ratio)
    if lower is not None:
        counts = counts & ~lower
    return loss, l1 * counts, clipped, lower, log_ratio


def value_terms(values, old_values, returns, clip, need_grad=True):
    """0.5 max((v - R)^2, (clamp(v, old - clip, old + clip) - R)^2) per token, in the inputs' dtype:
    (loss, dloss/dv or None, clipped = [clipped term > plain term] or None)."""
    err1 = values - returns
    l1 = err1 * err1
    if clip is None:
        return 0.5 * l1, (err1 if need_grad else None), None
    err2 = torch.minimum(torch.maximum(values, old_values - clip), old_values + clip) - returns
    l2 = err2 * err2
    clipped = l2 > l1  # counts as clipped only when strictly larger
    # l2 > l1 only where v lies outside [old - clip, old + clip] (inside, the clamp returns v itself),
    # where the clamped term's gradient is 0: the gradient is v - R where not clipped (ties included)
    return 0.5 * torch.maximum(l1, l2), (err1 * ~clipped if need_grad else None), clipped


def actor_token_terms(logp, entropy, old_logp, advantages, ref_logp, weight, *, kl_coef, kl_estimator,
                      entropy_coef, clip_low, clip_high, dual_clip, need_grad):
    """The actor loss L = sum_i w_i (pg_i + kl_coef kl_i - entropy_coef H_i) per token (flat [n]
    tensors, one dtype): (TOKEN_TERMS [6, n], dL/dlogp [n] or None, dL/dH [n] or None)."""
    pg, d_logp, clipped, lower, log_ratio = policy_terms(logp, old_logp, advantages, clip_low, clip_high, dual_clip,
                                                         need_grad)
    kl = torch.zeros_like(pg)
    if ref_logp is not None:
        kl = kl_value(logp, ref_logp, kl_estimator, None)
        if kl_coef != 0.0 and need_grad:
            d_logp = d_logp + kl_coef * kl_grad(logp, ref_logp, kl_estimator, None)
    lower = torch.zeros_like(pg) if lower is None else lower.to(pg.dtype)
    terms = torch.stack([pg, kl, clipped.to(pg.dtype), lower, -log_ratio, entropy])
    if not need_grad:
        return terms, None, None
    return terms, weight * d_logp, (-entropy_coef * weight if entropy_coef != 0.0 else None)


def actor_loss_and_stats(terms, weight, mask, kl_coef, entropy_coef):
    """(loss = sum_i w_i l_i, ACTOR_STATS [6]) from the TOKEN_TERMS; the stats' means are over `mask`."""
    pg, kl, clipped, lower, neg_log_ratio, entropy = terms
    per_token = pg
    if kl_coef != 0.0:
        per_token = per_token + kl_coef * kl
    if entropy_coef != 0.0:
        per_token = per_token - entropy_coef * entropy
    inv_n = safe_inverse(mask.sum())
    mean = lambda t: (mask * t).sum() * inv_n  # noqa: E731
    stats = torch.stack([mean(clipped), mean(lower), mean(neg_log_ratio), (weight * pg).sum(), mean(entropy),
                         mean(kl)])
    return (weight * per_token).sum(), stats


# ---------------------------------------------------------------- fastrlhf::policy_loss


def _policy_sums_torch(logp, old_logp, advantages, mask, scale, clip_low, clip_high, dual_clip, need_grad):
    dtype = out_dtype(logp)
    lp, olp, adv, m = (t.to(dtype) for t in (logp, old_logp, advantages, mask))
    w = scale.to(dtype).unsqueeze(1) * m
    loss, d_logp, clipped, lower, log_ratio = policy_terms(lp, olp, adv, clip_low, clip_high, dual_clip, need_grad)
    sums = torch.stack([(w * loss).sum(), _masked_sum(clipped, m), _masked_sum(lower, m), (-log_ratio * m).sum(),
                        m.sum()])
    return sums, (w * d_logp if need_grad else None)


@torch.library.custom_op("fastrlhf::policy_loss", mutates_args=())
def _policy_loss_op(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, row_scale: Tensor,
                    clip_low: float, clip_high: float, dual_clip: float | None, need_grad: bool,
                    use_triton: bool) -> tuple[Tensor, Tensor]:
    """[B, T] inputs, row_scale [B] -> (POLICY_SUMS [5], d(loss)/d(logp) [B, T], [0] without need_grad)."""
    dtype = out_dtype(logp)
    if use_triton:
        from fastrlhf.kernels import ppo_loss as kernels

        sums, d_logp = kernels.policy_loss_fwd(
            logp.contiguous(), old_logp.contiguous(), advantages.contiguous(), mask.contiguous(),
            row_scale.float().contiguous(), clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
            need_grad=need_grad)
    else:
        sums, d_logp = _policy_sums_torch(logp, old_logp, advantages, mask, row_scale, clip_low, clip_high,
                                          dual_clip, need_grad)
    return sums.to(dtype), (d_logp.to(dtype) if need_grad else sums.new_empty(0, dtype=dtype))


@_policy_loss_op.register_fake
def _(logp, old_logp, advantages, mask, row_scale, clip_low, clip_high, dual_clip, need_grad, use_triton):
    dtype = out_dtype(logp)
    return logp.new_empty(len(POLICY_SUMS), dtype=dtype), logp.new_empty(logp.shape if need_grad else (0,),
                                                                          dtype=dtype)


def _setup_input_gradient(ctx, inputs, output):
    """policy_loss / value_loss: the op formed d(loss)/d(input 0) in its forward."""
    _, d_input = output
    ctx.mark_non_differentiable(d_input)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(d_input)
    ctx.in_dtype = inputs[0].dtype
    ctx.n_inputs = len(inputs)
    ctx.need_grad = inputs[-2]


def _backward_input_gradient(ctx, grad_sums, _grad_d):
    (d_input,) = ctx.saved_tensors
    if grad_sums is None or not ctx.need_grad or not ctx.needs_input_grad[0]:
        return (None,) * ctx.n_inputs
    return ((d_input * grad_sums[0]).to(ctx.in_dtype),) + (None,) * (ctx.n_inputs - 1)


_policy_loss_op.register_autograd(_backward_input_gradient, setup_context=_setup_input_gradient)


def policy_loss(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None, dual_clip=None,
                agg="token-mean", global_num_tokens=None):
    """verl's vanilla clipped PPO surrogate (docs/ops.md).

    ratio = exp(clamp(logp - old_logp, -20, 20));
    l = max(-A ratio, -A clamp(ratio, 1 - clip_low, 1 + clip_high)), and with dual-clip c (> 1):
    l = min(l, -A c) where A < 0. The loss is agg(l).

    Args:
        logp, old_logp, advantages: [B, T] (or [T]) float; gradients flow to `logp` only
            (old_logp and advantages are constants).
        mask: same shape, bool/int/float (a float mask weighs tokens).
        clip_low, clip_high: the ratio's clip range (clip_high defaults to clip_low).
        dual_clip: c > 1, or None.
        agg: "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm".
        global_num_tokens: token-mean's divisor across ranks / micro-batches.

    Returns:
        (loss, stats): loss a 0-dim float32 (float64 for float64 logp); stats, masked means over the
        local tokens (no gradient): clipfrac, clipfrac_lower, approx_kl = mean(old_logp - logp).
    """
    check_float("logp", logp)
    check_same("logp", logp, old_logp=old_logp, advantages=advantages)
    check_mask(mask, logp, "logp")
    clip_low, clip_high, dual_clip = check_clips(clip_low, clip_high, dual_clip)
    check_agg(agg, global_num_tokens)
    lp, m = as_rows(logp), as_rows(mask)
    scale = row_scale(m, agg, global_num_tokens, out_dtype(logp))
    need_grad = torch.is_grad_enabled() and logp.requires_grad
    sums, _ = _policy_loss_op(lp, as_rows(old_logp.detach()), as_rows(advantages.detach()), m, scale, clip_low,
                              clip_high, dual_clip, need_grad, use_triton(logp))
    counts = sums.detach()
    inv_n = safe_inverse(counts[4])
    return sums[0], {"clipfrac": counts[1] * inv_n, "clipfrac_lower": counts[2] * inv_n,
                     "approx_kl": counts[3] * inv_n}


# ---------------------------------------------------------------- fastrlhf::value_loss


@torch.library.custom_op("fastrlhf::value_loss", mutates_args=())
def _value_loss_op(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, row_scale: Tensor,
                   clip: float | None, need_grad: bool, use_triton: bool) -> tuple[Tensor, Tensor]:
    """[B, T] inputs, row_scale [B] -> (VALUE_SUMS [3], d(loss)/d(values) [B, T], [0] without need_grad)."""
    dtype = out_dtype(values)
    if use_triton:
        from fastrlhf.kernels import ppo_loss as kernels

        sums, d_values = kernels.value_loss_fwd(
            values.contiguous(), old_values.contiguous(), returns.contiguous(), mask.contiguous(),
            row_scale.float().contiguous(), clip=clip, need_grad=need_grad)
    else:
        v, ov, ret, m = (t.to(dtype) for t in (values, old_values, returns, mask))
        w = row_scale.to(dtype).unsqueeze(1) * m
        loss, d, clipped = value_terms(v, ov, ret, clip, need_grad)
        sums = torch.stack([(w * loss).sum(), _masked_sum(clipped, m), m.sum()])
        d_values = w * d if need_grad else None
    return sums.to(dtype), (d_values.to(dtype) if need_grad else sums.new_empty(0, dtype=dtype))


@_value_loss_op.register_fake
def _(values, old_values, returns, mask, row_scale, clip, need_grad, use_triton):
    dtype = out_dtype(values)
    return values.new_empty(len(VALUE_SUMS), dtype=dtype), values.new_empty(values.shape if need_grad else (0,),
                                                                             dtype=dtype)


_value_loss_op.register_autograd(_backward_input_gradient, setup_context=_setup_input_gradient)


def value_loss(values, old_values, returns, mask, *, clip=0.2, agg="token-mean", global_num_tokens=None):
    """Clipped value loss 0.5 * agg(max((v - R)^2, (v_clipped - R)^2)) (docs/ops.md),
    v_clipped = clamp(v, old_values - clip, old_values + clip).

    Args:
        values: [B, T] (or [T]) float; the only input that gets a gradient.
        old_values, returns: same shape; constants.
        mask: same shape, bool/int/float.
        clip: >= 0, or None for no clipping.
        agg, global_num_tokens: as `policy_loss`.

    Returns:
        (loss, stats): loss 0-dim float32 (float64 for float64 values); stats["clipfrac"], the
        masked fraction of tokens whose clipped term is larger.
    """
    check_float("values", values)
    check_same("values", values, old_values=old_values, returns=returns)
    check_mask(mask, values, "values")
    if clip is not None:
        clip = check_number("clip", clip, nonnegative=True)
    check_agg(agg, global_num_tokens)
    v, m = as_rows(values), as_rows(mask)
    scale = row_scale(m, agg, global_num_tokens, out_dtype(values))
    need_grad = torch.is_grad_enabled() and values.requires_grad
    sums, _ = _value_loss_op(v, as_rows(old_values.detach()), as_rows(returns.detach()), m, scale, clip, need_grad,
                             use_triton(values))
    counts = sums.detach()
    return sums[0], {"clipfrac": counts[1] * safe_inverse(counts[2])}


# ---------------------------------------------------------------- fastrlhf::ppo_actor_loss


@torch.library.custom_op("fastrlhf::ppo_actor_loss", mutates_args=())
def _ppo_actor_loss_op(logits: Tensor, labels: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                       token_weight: Tensor, ref_logp: Tensor | None, temperature: float, kl_coef: float,
                       kl_estimator: str, entropy_coef: float, clip_low: float, clip_high: float,
                       dual_clip: float | None, need_grad: bool,
                       use_triton: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """logits [B, T, V], per-token [B, T] -> (loss, ACTOR_STATS [6], and for the backward, flat [B * T]:
    lse, entropy, dL/dlogp, dL/dH ([0] without need_grad or entropy term))."""
    logp, entropy, lse = logprobs_fwd(logits, labels.long(), temperature=temperature, ignore_index=IGNORE_INDEX,
                                      return_entropy=True, use_triton=use_triton)
    flat = lambda t: None if t is None else t.reshape(-1).to(logp.dtype)  # noqa: E731
    weight = flat(token_weight)
    terms, g_logp, g_ent = actor_token_terms(
        logp, entropy, flat(old_logp), flat(advantages), flat(ref_logp), weight, kl_coef=kl_coef,
        kl_estimator=kl_estimator, entropy_coef=entropy_coef, clip_low=clip_low, clip_high=clip_high,
        dual_clip=dual_clip, need_grad=need_grad)
    loss, stats = actor_loss_and_stats(terms, weight, flat(mask), kl_coef, entropy_coef)
    or_empty = lambda t: logp.new_empty(0) if t is None else t  # noqa: E731
    return loss, stats, lse, entropy, or_empty(g_logp), or_empty(g_ent)


@_ppo_actor_loss_op.register_fake
def _(logits, labels, old_logp, advantages, mask, token_weight, ref_logp, temperature, kl_coef, kl_estimator,
      entropy_coef, clip_low, clip_high, dual_clip, need_grad, use_triton):
    dtype, n = out_dtype(logits), labels.numel()
    new = lambda *shape: logits.new_empty(shape, dtype=dtype)  # noqa: E731
    return (new(), new(len(ACTOR_STATS)), new(n), new(n), new(n if need_grad else 0),
            new(n if need_grad and entropy_coef != 0.0 else 0))


def _setup_actor(ctx, inputs, output):
    logits, labels = inputs[:2]
    _, stats, lse, entropy, g_logp, g_ent = output
    ctx.mark_non_differentiable(stats, lse, entropy, g_logp, g_ent)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(logits, labels, lse, entropy, g_logp, g_ent)
    ctx.temperature, ctx.use_triton, ctx.n_inputs = inputs[7], inputs[-1], len(inputs)


def _backward_actor(ctx, grad_loss, *_):
    logits, labels, lse, entropy, g_logp, g_ent = ctx.saved_tensors
    if grad_loss is None or not ctx.needs_input_grad[0] or g_logp.numel() != lse.numel():
        return (None,) * ctx.n_inputs
    d = logprobs_backward_op(logits, labels, lse, entropy, g_logp * grad_loss,
                           g_ent * grad_loss if g_ent.numel() else None, ctx.temperature, IGNORE_INDEX,
                           ctx.use_triton)
    return (d,) + (None,) * (ctx.n_inputs - 1)


_ppo_actor_loss_op.register_autograd(_backward_actor, setup_context=_setup_actor)


def check_actor_args(shape, device, old_logp, advantages, mask, ref_logp, kl_coef, kl_estimator, entropy_coef,
                     clip_low, clip_high, dual_clip, agg, global_num_tokens, what):
    """The checks of the actor losses' per-token arguments against `shape` (what: its name);
    returns (kl_coef, entropy_coef, clip_low, clip_high, dual_clip) as floats."""
    for name, x in (("old_logp", old_logp), ("advantages", advantages), ("ref_logp", ref_logp)):
        if x is None:
            continue
        check_float(name, x)
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {what} = {tuple(shape)}, got {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but the logits are on {device}; expected one device")
    check_mask(mask, old_logp, "old_logp")
    kl_coef = check_number("kl_coef", kl_coef)
    entropy_coef = check_number("entropy_coef", entropy_coef)
    check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    clips = check_clips(clip_low, clip_high, dual_clip)
    check_agg(agg, global_num_tokens)
    return (kl_coef, entropy_coef, *clips)


def ppo_actor_loss(logits, labels, old_logp, advantages, mask, *, ref_logp=None, kl_coef=0.0, kl_estimator="k3",
                   entropy_coef=0.0, temperature=1.0, clip_low=0.2, clip_high=None, dual_clip=None,
                   agg="token-mean", global_num_tokens=None):
    """The whole actor loss straight from logits (docs/ops.md):
    policy_loss + kl_coef * KL - entropy_coef * entropy, each aggregated with `agg`.

    One fused pass over the logits forward (log-prob, entropy and log-sum-exp together) forms
    the per-token gradients; one backward writes d(logits) once, carrying the policy, KL and
    entropy terms together.

    Args:
        logits: [B, T, V] (or [..., V]) float, any strides but the vocab one.
        labels: logits.shape[:-1] integer; -100 is ignored (logp 0, no gradient).
        old_logp, advantages, mask, ref_logp: logits.shape[:-1]; constants (no gradient).
        kl_coef, kl_estimator: the KL term against ref_logp (see `token_kl`), none without ref_logp.
        entropy_coef, temperature, clip_low, clip_high, dual_clip, agg, global_num_tokens:
            as `logprobs` and `policy_loss`.

    Returns:
        (loss, stats): loss 0-dim float32 (float64 for float64 logits); stats (no gradient):
        clipfrac, clipfrac_lower, approx_kl, pg_loss (the aggregated policy term), entropy and,
        with ref_logp, kl (masked means).
    """
    check_float("logits", logits)
    check_int("labels", labels)
    shape = tuple(logits.shape[:-1])
    if logits.dim() < 1 or tuple(labels.shape) != shape:
        raise ValueError(f"labels must have shape logits.shape[:-1] = {shape}, got {tuple(labels.shape)}")
    kl_coef, entropy_coef, clip_low, clip_high, dual_clip = check_actor_args(
        shape, logits.device, old_logp, advantages, mask, ref_logp, kl_coef, kl_estimator, entropy_coef, clip_low,
        clip_high, dual_clip, agg, global_num_tokens, "logits.shape[:-1]")
    temperature = check_number("temperature", temperature, positive=True)
    x = as_3d(logits)
    B, T = x.shape[:2]
    rows = lambda t: None if t is None else t.detach().reshape(B, T)  # noqa: E731
    dtype = out_dtype(logits)
    m = rows(mask)
    weight = row_scale(m, agg, global_num_tokens, dtype).unsqueeze(1) * m.to(dtype)
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    loss, stats, *_ = _ppo_actor_loss_op(
        x, labels.reshape(B, T), rows(old_logp), rows(advantages), m, weight, rows(ref_logp), temperature, kl_coef,
        KL_ESTIMATORS[kl_estimator], entropy_coef, clip_low, clip_high, dual_clip, need_grad, use_triton(logits))
    names = ACTOR_STATS if ref_logp is not None else ACTOR_STATS[:-1]
    return loss, dict(zip(names, stats.unbind()))
