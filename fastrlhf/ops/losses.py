"""The clipped PPO losses: `policy_loss`, `value_loss`, `agg_loss` and the whole actor loss from
logits, `ppo_actor_loss` (kernels: fastrlhf/kernels/ppo_loss.py and kernels/logprobs.py).

Every aggregation mode of verl 0.9.1's `agg_loss` is per-row weights, computed host-side by
`row_scale` (n_b = sum_t mask[b, t], S = #{b: n_b > 0}, dp = dp_size):
    loss = sum_b scale[b] * sum_t mask[b, t] * l[b, t]
    token-mean               scale = dp / (global_num_tokens or sum(mask))
    token-sum                scale = dp
    seq-mean-token-sum       scale = dp [n_b > 0] / (global_num_seqs or S)
    seq-mean-token-sum-norm  scale = dp [n_b > 0] / ((global_num_seqs or S) (loss_scale_factor or T))
    seq-mean-token-mean      scale = dp [n_b > 0] / (n_b (global_num_seqs or S))
so one kernel per formula serves every mode, and the gradient of the loss is w * dl/dx with
w = scale[b] * mask. A token with mask = 0 adds exactly 0 and gets gradient 0, whatever (NaN,
inf) its inputs hold. The per-token formulas and their gradients are written out below with the
tie rules of reference.py (the clamps pass the gradient at their bounds; at a tie of max/min the
unclipped term takes it), never left to a torch version's autograd.

Custom ops: fastrlhf::agg_loss, fastrlhf::policy_loss, fastrlhf::value_loss (each -> (sums,
d(loss)/d(input)), the gradient formed in the same pass), fastrlhf::ppo_actor_loss (-> loss,
stats and d(loss)/d(logits), formed in the forward: on the Triton path one kernel reads the logits,
forms each token's gradients and reads them again to write d(logits); kernels/ppo_loss.py),
fastrlhf::scale_unless_one_ (its backward: d(logits) times the upstream scalar, in place, skipped
on the device when that scalar is 1).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import torch
from torch import Tensor

import fastrlhf.ops.policy_modes as pm
from fastrlhf.constants import AGG_MODES, IGNORE_INDEX, KL_ESTIMATORS, LOG_RATIO_CLAMP
from fastrlhf.ops._common import (
    as_dtype,
    as_rows,
    check_choice,
    check_float,
    check_int,
    check_mask,
    check_number,
    check_rows,
    check_same,
    out_dtype,
    safe_inverse,
    use_triton,
)
from fastrlhf.ops._dispatch import eager, register
from fastrlhf.ops.kl import kl_grad, kl_value
from fastrlhf.ops.logprobs import as_3d, logprobs_bwd, logprobs_fwd

POLICY_STATS = ("clipfrac", "clipfrac_lower", "approx_kl", "approx_kl_unclamped")
VALUE_STATS = ("clipfrac",)
# per-token rows the actor loss keeps (0 where mask == 0): its three weighted terms, then what its stats average
TOKEN_TERMS = ("pg_loss", "kl_loss", "entropy_loss", "clipped", "clipped_lower", "neg_log_ratio", "entropy", "kl")
# the actor ops' stats as they come out of the op: the five policy stats (stats_layout), then these
ACTOR_STATS = ("pg_loss", "entropy", "kl")
N_ACTOR_STATS = len(POLICY_STATS) + 1 + len(ACTOR_STATS)


# ---------------------------------------------------------------- aggregation and shared checks


class Agg(NamedTuple):
    """An aggregation mode and its global counts (module docstring), checked."""

    mode: str = "token-mean"
    global_num_tokens: float | None = None
    global_num_seqs: float | None = None
    dp_size: int = 1
    loss_scale_factor: float | None = None


def check_agg(agg, global_num_tokens=None, global_num_seqs=None, dp_size=1, loss_scale_factor=None) -> Agg:
    """The aggregation keywords, checked; a keyword the mode does not use is an error, not ignored."""
    check_choice("agg", agg, AGG_MODES)
    if isinstance(dp_size, bool) or not isinstance(dp_size, numbers.Integral) or dp_size < 1:
        raise ValueError(f"dp_size must be a positive int, got {dp_size!r}")
    seq_mode = agg.startswith("seq-mean")
    if global_num_tokens is not None:
        if agg != "token-mean":
            raise ValueError(f"global_num_tokens applies to agg='token-mean' only, got agg={agg!r}")
        global_num_tokens = check_number("global_num_tokens", global_num_tokens, positive=True)
    if global_num_seqs is not None:
        if not seq_mode:
            raise ValueError(f"global_num_seqs applies to the seq-mean-* modes only, got agg={agg!r}")
        global_num_seqs = check_number("global_num_seqs", global_num_seqs, positive=True)
    if loss_scale_factor is not None:
        if agg != "seq-mean-token-sum-norm":
            raise ValueError(f"loss_scale_factor applies to agg='seq-mean-token-sum-norm' only, got agg={agg!r}")
        loss_scale_factor = check_number("loss_scale_factor", loss_scale_factor, positive=True)
    if dp_size > 1 and agg == "token-mean" and global_num_tokens is None:
        raise ValueError("dp_size > 1 with agg='token-mean' needs global_num_tokens (the global token count)")
    if dp_size > 1 and seq_mode and global_num_seqs is None:
        raise ValueError(f"dp_size > 1 with agg={agg!r} needs global_num_seqs (the global sequence count)")
    return Agg(agg, global_num_tokens, global_num_seqs, int(dp_size), loss_scale_factor)


def row_scale(mask: Tensor, agg: Agg, dtype: torch.dtype) -> Tensor:
    """Per-row weights [B] that turn sum_t mask * l into `agg` (module docstring); mask [B, T]."""
    m = mask.to(dtype)
    B, T = m.shape
    n_b = m.sum(-1)
    if agg.mode == "token-mean":
        n = n_b.sum() if agg.global_num_tokens is None else torch.tensor(agg.global_num_tokens, dtype=dtype,
                                                                          device=m.device)
        return (safe_inverse(n) * agg.dp_size).expand(B)
    if agg.mode == "token-sum":
        return torch.full((B,), float(agg.dp_size), dtype=dtype, device=m.device)
    nonempty = (n_b > 0).to(dtype)
    n_seqs = nonempty.sum() if agg.global_num_seqs is None else torch.tensor(agg.global_num_seqs, dtype=dtype,
                                                                               device=m.device)
    scale = nonempty * (safe_inverse(n_seqs) * agg.dp_size)
    if agg.mode == "seq-mean-token-mean":
        return scale * safe_inverse(n_b)
    if agg.mode == "seq-mean-token-sum-norm":
        return scale / (max(T, 1) if agg.loss_scale_factor is None else agg.loss_scale_factor)
    return scale  # seq-mean-token-sum


def token_weights(mask: Tensor, agg: Agg, dtype: torch.dtype) -> Tensor:
    """w [B, T] = row_scale[b] * mask[b, t]: the loss is sum(w * l), its gradient w * dl/dx."""
    return row_scale(mask, agg, dtype).unsqueeze(1) * mask.to(dtype)


def _off_mask_zero(products: Tensor, mask: Tensor, finite: bool | None = None) -> Tensor:
    """Products of per-token values with mask weights, made exactly 0 where mask == 0, even where a
    value is NaN or inf (0 * NaN is NaN). On CPU torch.where (and the mask != 0 it needs) costs as
    much as a dozen elementwise ops, so it is skipped when every product is finite (their sum is):
    then the products are already 0 there. `finite`: already known (the caller's totals were read);
    None: checked here."""
    if finite is None:
        finite = products.device.type == "cpu" and bool(torch.isfinite(products.sum()))  # NaN / inf never sum finite
    return products if finite else torch.where(mask != 0, products, 0.0)


def _masked_flags(flags, m: Tensor) -> Tensor:
    """m where a bool indicator is set, in m's dtype (None: no token is flagged)."""
    return torch.zeros_like(m) if flags is None else m * flags


# ---------------------------------------------------------------- fastrlhf::agg_loss


def _agg_loss_op(loss_mat: Tensor, mask: Tensor, row_scale: Tensor) -> Tensor:
    """sum_b row_scale[b] sum_t mask l (0-dim), exactly 0 from tokens with mask == 0; [B, T] inputs."""
    dtype = out_dtype(loss_mat)
    m = as_dtype(mask, dtype)
    return _off_mask_zero(as_dtype(loss_mat, dtype) * (as_dtype(row_scale, dtype).unsqueeze(1) * m), m).sum()


def _agg_loss_cpu(x: Tensor, mask: Tensor, agg: Agg) -> Tensor:
    """`_agg_loss_op` of `row_scale` on a CPU in eager mode, under torch's autograd: reading a count on the host
    costs no sync there, so each mode's scale is a Python number (`_host_scale`, as the policy and value losses'
    finish) and only seq-mean-token-mean divides per row (about half the torch ops of the tensor-valued scale).
    Rows whose mask sums to <= 0 count for nothing, and tokens with mask == 0 give exactly 0 even where x is NaN
    or inf (then the products go through torch.where)."""
    dtype = out_dtype(x)
    w = as_dtype(mask, dtype)
    products = as_dtype(x, dtype) * w
    if agg.mode.startswith("seq-mean"):
        n_b = w.sum(-1)
        nonempty = n_b > 0
        kept = int(nonempty.sum())
        per_row = products.sum(-1)
        if agg.mode == "seq-mean-token-mean":
            per_row = per_row / (n_b if kept == len(n_b) else torch.where(nonempty, n_b, 1.0))
        if kept < len(n_b):
            per_row = per_row * nonempty
        loss = per_row.sum() * _host_scale(agg, kept, x.shape[1])
    else:
        count = w.sum().item() if agg.mode == "token-mean" and agg.global_num_tokens is None else 0.0
        loss = products.sum() * _host_scale(agg, count, x.shape[1])
    if math.isfinite(loss.item()) or not torch.isfinite(x).logical_or(w == 0).all():
        return loss
    return _agg_loss_cpu(torch.where(w != 0, x, 0.0), mask, agg)  # a NaN or inf only where mask == 0


def _fake_agg_loss(loss_mat, mask, row_scale):
    return loss_mat.new_empty((), dtype=out_dtype(loss_mat))


def _setup_agg_loss(ctx, inputs, output):
    loss_mat, mask, scale = inputs
    ctx.save_for_backward(mask, scale)
    ctx.in_dtype = loss_mat.dtype


def _backward_agg_loss(ctx, grad):
    mask, scale = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None
    m = mask.to(grad.dtype)
    return (grad * scale.to(grad.dtype).unsqueeze(1) * m).to(ctx.in_dtype), None, None


_agg_loss = register("agg_loss", _agg_loss_op, _fake_agg_loss, setup_context=_setup_agg_loss,
                     backward=_backward_agg_loss)


def agg_loss(loss_mat, mask, *, agg="token-mean", global_num_tokens=None, global_num_seqs=None, dp_size=1,
             loss_scale_factor=None):
    """verl 0.9.1's `core_algos.agg_loss`: a [B, T] per-token loss matrix into a scalar (docs/ops.md).

    Args:
        loss_mat: [B, T] (or [T]) float; gets the gradient.
        mask: same shape, bool/int/float (a float mask weighs tokens).
        agg: "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
            "seq-mean-token-sum-norm" (module docstring of fastrlhf.ops.losses for the formulas).
        global_num_tokens: token-mean's divisor across ranks and micro-batches (verl's batch_num_tokens).
        global_num_seqs: the seq-mean-* modes' divisor (verl's global_batch_size).
        dp_size: data-parallel ranks; the loss is multiplied by it (it needs the global count).
        loss_scale_factor: seq-mean-token-sum-norm's divisor instead of T.

    Returns:
        the loss, 0-dim float32 (float64 for float64 loss_mat); 0 for an empty local mask.
    """
    check_float("loss_mat", loss_mat)
    check_rows("loss_mat", loss_mat)
    check_mask(mask, loss_mat, "loss_mat")
    agg_ = check_agg(agg, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor)
    x, m = as_rows(loss_mat), as_rows(mask)
    if x.is_cpu and eager(x):
        return _agg_loss_cpu(x, m, agg_)
    scale = row_scale(m, agg_, out_dtype(loss_mat))
    if eager(x):  # torch ops only, products and a sum: torch's autograd gives w = scale * m exactly
        return _agg_loss_op(x, m, scale)
    return _agg_loss(x, m, scale, grad=torch.is_grad_enabled() and loss_mat.requires_grad)


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


_VANILLA = pm.ModeSpec(log_ratio_min=-LOG_RATIO_CLAMP, log_ratio_max=LOG_RATIO_CLAMP)  # make_spec("vanilla")


class ActorSpec(NamedTuple):
    """The actor loss's options, checked (`actor_prologue`), as one object from the public ops
    (`ppo_actor_loss`, `linear_ppo_actor_loss`) to the launcher (kernels.ppo_loss.actor_loss_fwd); flattened
    into scalars only at the custom-op boundary (`flat`, rebuilt there by `unflat`). The policy-loss mode and
    its options are the last field, one pm.ModeSpec."""

    temperature: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # the canonical name (KL_ESTIMATORS' values)
    kl_clamp: float | None = None
    kl_straight_through: bool = False
    entropy_coef: float = 0.0
    policy: pm.ModeSpec = _VANILLA

    @property
    def has_kl(self) -> bool:
        """Whether the KL term enters the gradient (the value is reported whenever ref_logp is given)."""
        return self.kl_coef != 0.0

    def flat(self) -> tuple:
        """The scalars at a custom-op boundary: the fields in order, the mode as pm.ModeSpec.flat."""
        return (*self[:-1], *self.policy.flat())

    @classmethod
    def unflat(cls, *values) -> ActorSpec:
        return cls(*values[:-3], pm.ModeSpec.unflat(*values[-3:]))


class ActorTerms(NamedTuple):
    """What the per-token actor loss needs besides logp and entropy; per-token tensors flat [n = B T], one dtype;
    `shape` (B, T) gives them their rows."""

    old_logp: Tensor
    advantages: Tensor
    mask: Tensor
    weight: Tensor  # w = row_scale[row] * mask
    ref_logp: Tensor | None
    is_weights: Tensor | None
    sampler_weights: Tensor | None
    spec: ActorSpec
    shape: tuple[int, int]

    def at(self, s: slice) -> ActorTerms:
        """The same terms for the tokens s (as one row)."""
        cut = lambda t: None if t is None else t[s]  # noqa: E731
        return self._replace(old_logp=self.old_logp[s], advantages=self.advantages[s], mask=self.mask[s],
                             weight=self.weight[s], ref_logp=cut(self.ref_logp), is_weights=cut(self.is_weights),
                             sampler_weights=cut(self.sampler_weights), shape=(1, s.stop - s.start))


def actor_token_terms(logp, entropy, a: ActorTerms, need_grad: bool):
    """verl's vanilla actor loss L = sum_i w_i (is_i pg_i + kl_coef kl_i - entropy_coef H_i) per token (the torch
    path's fast formula, `fast_vanilla`): (TOKEN_TERMS [8, n], 0 where mask == 0; dL/dlogp [n] or None;
    dL/dH [n] or None)."""
    spec = a.spec
    policy = spec.policy
    pg, d_pg, clipped, lower, log_ratio = policy_terms(logp, a.old_logp, a.advantages, policy.clip_low,
                                                       policy.clip_high, policy.dual_clip, need_grad)
    pg_weight = a.weight if a.is_weights is None else a.weight * a.is_weights
    kl = torch.zeros_like(pg) if a.ref_logp is None else kl_value(logp, a.ref_logp, spec.kl_estimator, spec.kl_clamp)
    rows = torch.stack([pg * pg_weight, kl * a.weight, entropy * a.weight, clipped * a.mask,
                        _masked_flags(lower, a.mask), -log_ratio * a.mask, entropy * a.mask, kl * a.mask])
    terms = _off_mask_zero(rows, a.mask)
    if not need_grad:
        return terms, None, None
    d_logp = pg_weight * d_pg
    if a.ref_logp is not None and spec.has_kl:
        d_logp = d_logp + (spec.kl_coef * a.weight) * _kl_derivative(logp, a.ref_logp, spec)
    g_ent = -spec.entropy_coef * a.weight if spec.entropy_coef != 0.0 else None
    return terms, _off_mask_zero(d_logp, a.mask), g_ent


def _kl_derivative(logp, ref_logp, spec: ActorSpec) -> Tensor:
    if spec.kl_straight_through:  # the value is the estimator's, the gradient that of r^2 / 2
        return logp - ref_logp
    return kl_grad(logp, ref_logp, spec.kl_estimator, spec.kl_clamp)


def actor_loss_and_stats(terms: Tensor, n_mask: Tensor, spec: ActorSpec):
    """(loss, ACTOR_STATS [8]) from the TOKEN_TERMS rows of all tokens; n_mask = sum(mask)."""
    sums = terms.sum(-1)
    pg_loss, kl_loss, entropy_loss, n_clipped, n_lower, neg_log_ratio, entropy, kl = sums.unbind()
    loss = _actor_total(pg_loss, kl_loss, entropy_loss, spec)
    inv_n = safe_inverse(n_mask)
    zero = torch.zeros_like(pg_loss)
    stats = torch.stack([n_clipped * inv_n, n_lower * inv_n, neg_log_ratio * inv_n, zero, zero, pg_loss,
                         entropy * inv_n, kl * inv_n])
    return loss, stats


def _actor_total(pg_loss, kl_loss, entropy_loss, spec: ActorSpec):
    loss = pg_loss
    if spec.kl_coef != 0.0:
        loss = loss + spec.kl_coef * kl_loss
    if spec.entropy_coef != 0.0:
        loss = loss - spec.entropy_coef * entropy_loss
    return loss


def actor_pass(logp, entropy, a: ActorTerms, need_grad: bool, use_triton: bool):
    """The actor loss once every token's log-prob and entropy are known (flat [n]): (loss, ACTOR_STATS [8],
    dL/dlogp [n] or None, dL/dH [n] or None). The policy term is the policy-loss kernel over the [B, T] rows
    (Triton, the weights w given) or policy_modes (torch; verl's vanilla loss as actor_token_terms), after
    clip_cov's / kl_cov's batch-wide selection; the KL and entropy terms are elementwise [n] torch ops. This
    is the one pass over [B, T] between a log-prob forward and backward over the logits that the modes
    whose gradient depends on the whole row (the sequence levels, geo_mean, vespo) or batch (clip_cov,
    kl_cov) need; the token-local modes on the Triton path form their gradients inside the fused kernel and
    come here without need_grad."""
    spec = a.spec
    if not use_triton and fast_vanilla(spec.policy):
        terms, g_logp, g_ent = actor_token_terms(logp, entropy, a, need_grad)
        loss, stats = actor_loss_and_stats(terms, a.mask.sum(), spec)
        return loss, stats, g_logp, g_ent
    rows = lambda t: None if t is None else t.view(a.shape)  # noqa: E731
    lp, m, w = rows(logp), rows(a.mask), rows(a.weight)
    x = pm.Inputs(lp, rows(a.old_logp), rows(a.advantages), m, rows(a.is_weights), rows(a.sampler_weights))
    x = x._replace(selected=pm.selection(x, spec.policy))
    if use_triton:
        from fastrlhf.kernels import ppo_loss as kernels
        from fastrlhf.kernels.policy_modes import mode_launch

        pg_loss, pg_stats, d_pg, _ = kernels.policy_loss_fwd(
            lp, x.old_logp, x.advantages, m, x.is_weights, mode=mode_launch(spec.policy),
            spec=agg_launch(_WEIGHTED, a.shape[1]), need_grad=need_grad, weight=w.float().contiguous(),
            selected=x.selected, sampler_weights=x.sampler_weights, out_dtype=logp.dtype)
    else:
        pg_loss, d_pg, flags = pm.policy_mode_terms(spec.policy, x, w, need_grad)
        pg_stats = stats_layout(spec.policy.mode, pm.mode_stats(flags, m), lp)
    n_inv = safe_inverse(a.mask.sum())
    kl = None if a.ref_logp is None else kl_value(logp, a.ref_logp, spec.kl_estimator, spec.kl_clamp)
    sums = torch.stack([_off_mask_zero(t * u, a.mask).sum() for t in (entropy, kl) if t is not None
                        for u in (a.weight, a.mask)])
    entropy_loss, entropy_mean = sums[0], sums[1] * n_inv
    kl_loss, kl_mean = (sums[2], sums[3] * n_inv) if kl is not None else (None, torch.zeros_like(entropy_mean))
    loss = _actor_total(pg_loss, kl_loss, entropy_loss, spec)
    stats = torch.cat([pg_stats.to(entropy_mean.dtype), torch.stack([pg_loss.to(entropy_mean.dtype), entropy_mean,
                                                                      kl_mean])])
    if not need_grad:
        return loss, stats, None, None
    g_logp = d_pg.reshape(-1).to(logp.dtype)
    if kl is not None and spec.has_kl:
        g_logp = g_logp + _off_mask_zero((spec.kl_coef * a.weight) * _kl_derivative(logp, a.ref_logp, spec), a.mask)
    g_ent = -spec.entropy_coef * a.weight if spec.entropy_coef != 0.0 else None
    return loss, stats, g_logp, g_ent


# ---------------------------------------------------------------- policy and value: the shared parts


_WEIGHTED = Agg("token-sum")  # the actor loss's policy term: the weights w = row_scale * mask given per token


@functools.cache
def agg_launch(agg: Agg, T: int):
    """The aggregation as the policy / value launchers take it (kernels.ppo_loss.AggLaunch), per mode,
    counts and T: which factors of the row scale are known at launch and which the finish kernel finds."""
    from fastrlhf.kernels.ppo_loss import AggLaunch

    seq = agg.mode.startswith("seq-mean")
    given = agg.global_num_seqs if seq else agg.global_num_tokens
    norm = agg.loss_scale_factor if agg.mode == "seq-mean-token-sum-norm" else None
    known = agg.mode == "token-sum" or given is not None
    grad_scale = float(agg.dp_size)
    if known and agg.mode != "token-sum":
        grad_scale /= given
    if known and agg.mode == "seq-mean-token-sum-norm":
        grad_scale /= max(T, 1) if norm is None else norm
    return AggLaunch(AGG_MODES.index(agg.mode), given is not None, float(given or 0.0), float(agg.dp_size), norm,
                     agg.mode == "seq-mean-token-mean", grad_scale if known else 1.0, not known)


def _host_scale(agg: Agg, count: float, T: int) -> float:
    """The factor that turns a summed loss into `agg` as a Python number: dp_size over the global count given, or
    over `count` (this call's tokens or nonempty rows; 0 -> 0), then seq-mean-token-sum-norm's divisor."""
    given = agg.global_num_seqs if agg.mode.startswith("seq-mean") else agg.global_num_tokens
    count = count if given is None else given
    c = float(agg.dp_size) if agg.mode == "token-sum" else (agg.dp_size / count if count > 0 else 0.0)
    if agg.mode == "seq-mean-token-sum-norm":
        c /= max(T, 1) if agg.loss_scale_factor is None else agg.loss_scale_factor
    return c


def _agg_torch(terms: Tensor, agg: Agg, T: int):
    """The torch path's finish: (loss, stats, gradient scale [B, 1] or a float, finite) from the per-token
    terms [K, B, T] (products with the mask; row 0 the loss, row 1 the mask, then what the stats average), as
    the finish kernel. Token modes sum each term in one reduction; the seq-mean modes sum the loss and the mask
    per row first. Reads the totals on the host (this path is the CPU's; forced onto CUDA it syncs here).
    Where a total is NaN or inf (an input is, maybe only where mask == 0: 0 * NaN is NaN), the terms are
    zeroed off the mask first (`finite` False: so must the caller's gradient be); finite totals mean every
    product is finite, hence already 0 off the mask."""
    totals = terms.sum((1, 2))
    sums = totals.tolist()
    finite = all(map(math.isfinite, sums))
    if not finite:
        terms = torch.where(terms[1] != 0, terms, 0.0)
        totals = terms.sum((1, 2))
        sums = totals.tolist()
    n, *stat_sums = sums[1:]
    count, total, scale = n, totals[0], None
    if agg.mode.startswith("seq-mean"):
        row_sums = terms[:2].sum(2)
        nonempty = row_sums[1] > 0
        count = float(nonempty.sum())
        if agg.mode == "seq-mean-token-mean":
            scale = nonempty / torch.where(nonempty, row_sums[1], 1.0)
        total = (row_sums[0] * (nonempty if scale is None else scale)).sum()
    c = _host_scale(agg, count, T)
    inv_n = 1.0 / n if n > 0 else 0.0
    stats = torch.tensor([v * inv_n for v in stat_sums], dtype=terms.dtype, device=terms.device)
    return total * c, stats, (c if scale is None else (scale * c).unsqueeze(1)), finite


def _setup_input_gradient(ctx, inputs, output):
    """policy_loss / value_loss: the forward formed d(loss)/d(input 0); the backward scales it."""
    _, stats, d_input, factor = output
    ctx.mark_non_differentiable(stats, d_input, factor)
    ctx.set_materialize_grads(False)
    ctx.d, ctx.factor = (d_input, factor) if inputs[-2] else (None, None)  # need_grad
    ctx.inputs, ctx.in_dtype, ctx.used = inputs, inputs[0].dtype, False


def _backward_input_gradient(ctx, grad_loss, *_):
    """d(input) = g d [* factor]. On the Triton path in eager mode one kernel, in place over the forward's
    d when the dtypes match (nothing read or written when the product is 1; a second backward through the
    same graph recomputes d first), else into a new tensor of the input's dtype. Traced (torch.compile) or
    on the torch path: the plain product."""
    none = (None,) * (len(ctx.inputs) - 1)
    if grad_loss is None or ctx.d is None or not ctx.needs_input_grad[0]:
        return (None, *none)
    d, factor = ctx.d, ctx.factor
    if not ctx.inputs[-1] or not getattr(ctx, "eager", False):  # the torch path (scaled in the forward), or traced
        g = grad_loss if not factor.numel() else grad_loss * factor
        return ((d * g).to(ctx.in_dtype), *none)
    from fastrlhf.kernels.ppo_loss import scale_unless_one_

    factor = factor if factor.numel() else None
    if d.dtype != ctx.in_dtype:
        return (scale_unless_one_(d, grad_loss, factor, out=torch.empty(d.shape, dtype=ctx.in_dtype,
                                                                          device=d.device)), *none)
    if ctx.used:  # scaled in place by an earlier backward: the forward's d again
        _, _, d, factor = ctx.forward(*ctx.inputs)
    ctx.used = True
    return (scale_unless_one_(d, grad_loss, factor), *none)


def _empty_if_none(t, like: Tensor, dtype=None) -> Tensor:
    return like.new_empty(0, dtype=dtype) if t is None else t


def _fake_sums(x, n_stats, need_grad, pending):
    """The fake outputs of policy_loss / value_loss: loss, stats, d(input), the pending factor."""
    dtype = out_dtype(x)
    return (x.new_empty((), dtype=dtype), x.new_empty(n_stats, dtype=dtype),
            x.new_empty(x.shape if need_grad else (0,), dtype=dtype),
            x.new_empty(1 if need_grad and pending else 0, dtype=torch.float32))


# ---------------------------------------------------------------- fastrlhf::policy_loss


def resolve_mode(loss_mode: str, clip_low, clip_high, dual_clip, options: dict) -> pm.ModeSpec:
    """The checked ModeSpec of `loss_mode` with its options (dual_clip only when given: not every mode takes it)."""
    if not isinstance(loss_mode, str):
        raise TypeError(f"loss_mode must be a str, one of {tuple(pm.MODES)}, got {loss_mode!r}")
    extra = {} if dual_clip is None else {"dual_clip": dual_clip}
    return pm.make_spec(loss_mode, clip_low=clip_low, clip_high=clip_high, **extra, **options)


def resolve_agg(mode: str, agg, n_rows: int, global_num_tokens=None, global_num_seqs=None, dp_size=1,
                loss_scale_factor=None) -> Agg:
    """The checked aggregation of a policy-loss mode: `agg`, or the mode's own when None (pm.default_agg).
    geo_mean aggregates one loss per sequence over every one of the n_rows sequences (verl's torch.mean; an
    empty row's loss is 0), so it takes only global_num_seqs and dp_size."""
    if mode not in pm.ROW_LOSS:
        return check_agg(pm.DEFAULT_AGG[mode] if agg is None else agg, global_num_tokens, global_num_seqs, dp_size,
                         loss_scale_factor)
    if agg is not None or global_num_tokens is not None or loss_scale_factor is not None:
        raise ValueError(f"loss_mode={mode!r} aggregates one loss per sequence over all sequences (verl's mean over "
                         f"the batch): pass agg=None and at most global_num_seqs and dp_size, got agg={agg!r}, "
                         f"global_num_tokens={global_num_tokens!r}, loss_scale_factor={loss_scale_factor!r}")
    seqs = max(n_rows, 1) if global_num_seqs is None else global_num_seqs
    return check_agg("seq-mean-token-mean", global_num_seqs=seqs, dp_size=dp_size)


def fast_vanilla(spec: pm.ModeSpec) -> bool:
    """Whether `spec` is verl's vanilla loss as `policy_terms` computes it (the torch path's fast formula)."""
    return (spec.mode in ("vanilla", "ppo") and spec.ratio_level == "token" and spec.delta is None
            and (spec.log_ratio_min, spec.log_ratio_max) == (-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def stats_layout(mode: str, mode_stats: dict, like: Tensor) -> Tensor:
    """The five policy stats in the kernels' order (POLICY_STATS, then the mode's extra one), 0 where absent."""
    zero = like.new_zeros(())
    extra = mode_stats.get(pm.EXTRA_STAT.get(mode), zero)
    return torch.stack([mode_stats.get(k, zero) for k in POLICY_STATS] + [extra])


def stats_dict(mode: str, stats: Tensor) -> dict:
    """{name: value} of `mode`'s stats (pm.STATS) from the five in the kernels' order."""
    values = stats.unbind()
    index = {name: i for i, name in enumerate(POLICY_STATS)}
    if mode in pm.EXTRA_STAT:
        index[pm.EXTRA_STAT[mode]] = len(POLICY_STATS)
    return {name: values[index[name]] for name in pm.STATS[mode]}


def _policy_torch(logp, old_logp, advantages, mask, is_weights, selected, sampler_weights, spec, agg, need_grad):
    dtype = out_dtype(logp)
    lp, olp, adv, m = (as_dtype(t, dtype) for t in (logp, old_logp, advantages, mask))
    if fast_vanilla(spec):
        w = m if is_weights is None else m * as_dtype(is_weights, dtype)
        loss, d_logp, clipped, lower, log_ratio = policy_terms(lp, olp, adv, spec.clip_low, spec.clip_high,
                                                               spec.dual_clip, need_grad)
        terms = torch.stack([loss * w, m, m * clipped, _masked_flags(lower, m), -log_ratio * m, (olp - lp) * m])
        loss, stats, scale, finite = _agg_torch(terms, agg, lp.shape[1])
        return loss, torch.nn.functional.pad(stats, (0, 1)), (_off_mask_zero(d_logp * w, m, finite) * scale
                                                              if need_grad else None)
    cast = lambda t: None if t is None else as_dtype(t, dtype)  # noqa: E731
    x = pm.Inputs(lp, olp, adv, m, cast(is_weights), cast(sampler_weights), selected)
    loss, d_logp, flags = pm.policy_mode_terms(spec, x, token_weights(m, agg, dtype), need_grad)
    return loss, stats_layout(spec.mode, pm.mode_stats(flags, m), lp), d_logp


def _policy_fwd(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, is_weights: Tensor | None,
                selected: Tensor | None, sampler_weights: Tensor | None, mode: str, ratio_level: str,
                mode_values: list[float], agg: str, global_num_tokens: float | None, global_num_seqs: float | None,
                dp_size: int, loss_scale_factor: float | None, need_grad: bool,
                use_triton: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """[B, T] inputs -> (loss, the five stats (stats_layout), d(loss)/d(logp) [B, T] ([0] without need_grad),
    the gradient's pending factor [1] (Triton, local counts) or [0]); the mode's spec flattened
    (pm.ModeSpec.flat)."""
    spec = pm.ModeSpec.unflat(mode, ratio_level, mode_values)
    agg_ = Agg(agg, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor)
    factor = None
    if use_triton:
        from fastrlhf.kernels import ppo_loss as kernels
        from fastrlhf.kernels.policy_modes import mode_launch

        loss, stats, d_logp, factor = kernels.policy_loss_fwd(
            logp, old_logp, advantages, mask, is_weights, mode=mode_launch(spec), spec=agg_launch(agg_, logp.shape[1]),
            need_grad=need_grad, out_dtype=out_dtype(logp), selected=selected, sampler_weights=sampler_weights)
    else:
        loss, stats, d_logp = _policy_torch(logp, old_logp, advantages, mask, is_weights, selected, sampler_weights,
                                            spec, agg_, need_grad)
    return loss, stats, _empty_if_none(d_logp, stats), _empty_if_none(factor, stats, torch.float32)


def _fake_policy(logp, old_logp, advantages, mask, is_weights, selected, sampler_weights, mode, ratio_level,
                 mode_values, agg, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor, need_grad,
                 use_triton):
    pending = use_triton and (global_num_seqs if agg.startswith("seq-mean") else global_num_tokens) is None
    return _fake_sums(logp, len(POLICY_STATS) + 1, need_grad, pending and agg != "token-sum")


def _setup_policy(ctx, inputs, output):
    _setup_input_gradient(ctx, inputs, output)
    ctx.forward = _policy_fwd


_policy_loss = register("policy_loss", _policy_fwd, _fake_policy, setup_context=_setup_policy,
                        backward=_backward_input_gradient)


def policy_loss(logp, old_logp, advantages, mask, *, loss_mode="vanilla", clip_low=0.2, clip_high=None, dual_clip=None,
                is_weights=None, agg=None, global_num_tokens=None, global_num_seqs=None, dp_size=1,
                loss_scale_factor=None, sampler_weights=None, generator=None, **options):
    """The policy-loss family (docs/ops.md): verl's vanilla clipped surrogate by default, any mode of
    reference.POLICY_LOSSES by `loss_mode`.

    vanilla: ratio = exp(clamp(logp - old_logp, -20, 20));
    l = max(-A ratio, -A clamp(ratio, 1 - clip_low, 1 + clip_high)), and with dual-clip c (> 1):
    l = min(l, -A c) where A < 0; times is_weights when given. The loss is agg(l).

    Args:
        logp, old_logp, advantages: [B, T] (or [T]) float; gradients flow to `logp` only
            (old_logp and advantages are constants).
        mask: same shape, bool/int/float (a float mask weighs tokens).
        loss_mode: "vanilla" (= "ppo"), "gspo", "gspo_token", "luspo", "cispo", "sapo", "gpg" (= "reinforce"),
            "dro", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "geo_mean", "vespo": the formulas of
            reference.POLICY_LOSSES, each read from the peer that ships it.
        clip_low, clip_high: the ratio's clip range (clip_high defaults to clip_low); the DPPO modes' divergence
            thresholds; geo_mean's log-ratio clip.
        dual_clip: c > 1, or None (the clipped-surrogate modes).
        is_weights: per-token importance weights multiplying the loss before aggregation, a
            constant (verl's rollout_is_weights, OpenRLHF's train/rollout IS correction, rollout_correction's
            weights), or None; geo_mean takes their geometric mean per sequence.
        agg, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor: see `agg_loss`; agg=None is the
            mode's own default (token-mean for vanilla; gspo, gspo_token, sapo: seq-mean-token-mean; luspo:
            seq-mean-token-sum). geo_mean takes agg=None only (one loss per sequence, averaged over all B
            sequences or global_num_seqs, times dp_size).
        sampler_weights: vespo's sampler correction (it enters its gamma weight), [B, T] or None.
        generator: clip_cov's random draw (torch.randperm's generator; None: the default one, as verl).
        **options: the mode's options (the keywords of its reference function): delta, ratio_level,
            log_ratio_clamp, ratio_max, tau_pos, tau_neg, beta, ppo_kl_coef, k_pos, lambda_pos, k_neg,
            lambda_neg, clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio. clip_cov's and kl_cov's
            batch-wide selections are made here, on [B, T] in the inputs' dtype, before the fused pass (one
            host sync, as the peers').

    Returns:
        (loss, stats): loss a 0-dim float32 (float64 for float64 logp); stats, masked means over the
        local tokens (no gradient), the mode's (pm.STATS): vanilla's clipfrac, clipfrac_lower,
        approx_kl = mean(-clamp(logp - old_logp)) (verl's ppo_kl) and approx_kl_unclamped =
        mean(old_logp - logp) (OpenRLHF's ppo_kl); cispo's clipfrac_high, kl_cov's approx_kl_abs, vespo's
        phi_mean.
    """
    check_float("logp", logp)
    check_rows("logp", logp)
    check_same("logp", logp, old_logp=old_logp, advantages=advantages, is_weights=is_weights,
               sampler_weights=sampler_weights)
    check_mask(mask, logp, "logp")
    spec = resolve_mode(loss_mode, clip_low, clip_high, dual_clip, options)
    rows = lambda t: None if t is None else as_rows(t.detach())  # noqa: E731
    lp, old, adv, m = rows(logp), rows(old_logp), rows(advantages), as_rows(mask)
    agg_ = resolve_agg(spec.mode, agg, lp.shape[0], global_num_tokens, global_num_seqs, dp_size, loss_scale_factor)
    if sampler_weights is not None and spec.mode != "vespo":
        raise ValueError(f"sampler_weights is vespo's (it enters its gamma weight); loss_mode={spec.mode!r} takes "
                         f"the sampler correction as is_weights")
    selected = None
    if spec.mode in ("clip_cov", "kl_cov"):
        # made in the dtype the per-token pass computes in (float32 for bf16 / fp16 inputs): a token that pass
        # clips is never a clip_cov candidate, and kl_cov's covariances are not rounded to bf16 (and into ties)
        up = lambda t: as_dtype(t, out_dtype(logp))  # noqa: E731
        selected = pm.selection(pm.Inputs(up(lp), up(old), up(adv), m), spec, generator)
    grad = torch.is_grad_enabled() and logp.requires_grad
    loss, stats, *_ = _policy_loss(as_rows(logp), old, adv, m, rows(is_weights), selected, rows(sampler_weights),
                                   *spec.flat(), *agg_, grad, use_triton(logp), grad=grad)
    return loss, stats_dict(spec.mode, stats)


# ---------------------------------------------------------------- fastrlhf::value_loss


def _value_torch(values, old_values, returns, mask, clip, agg, need_grad):
    dtype = out_dtype(values)
    v, ov, ret, m = (as_dtype(t, dtype) for t in (values, old_values, returns, mask))
    loss, d, clipped = value_terms(v, ov, ret, clip, need_grad)
    terms = torch.stack([loss * m, m, _masked_flags(clipped, m)])
    loss, stats, scale, finite = _agg_torch(terms, agg, v.shape[1])
    return loss, stats, (_off_mask_zero(d * m, m, finite) * scale if need_grad else None)


def _value_fwd(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None, agg: str,
               global_num_tokens: float | None, global_num_seqs: float | None, dp_size: int,
               loss_scale_factor: float | None, need_grad: bool,
               use_triton: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """[B, T] inputs -> (loss, VALUE_STATS [1], d(loss)/d(values) [B, T] ([0] without need_grad), the
    gradient's pending factor [1] or [0]), as `_policy_fwd`."""
    agg_ = Agg(agg, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor)
    factor = None
    if use_triton:
        from fastrlhf.kernels import ppo_loss as kernels

        loss, stats, d_values, factor = kernels.value_loss_fwd(
            values, old_values, returns, mask, clip=clip, spec=agg_launch(agg_, values.shape[1]),
            need_grad=need_grad, out_dtype=out_dtype(values))
    else:
        loss, stats, d_values = _value_torch(values, old_values, returns, mask, clip, agg_, need_grad)
    return loss, stats, _empty_if_none(d_values, stats), _empty_if_none(factor, stats, torch.float32)


def _fake_value(values, old_values, returns, mask, clip, agg, global_num_tokens, global_num_seqs, dp_size,
                loss_scale_factor, need_grad, use_triton):
    pending = use_triton and (global_num_seqs if agg.startswith("seq-mean") else global_num_tokens) is None
    return _fake_sums(values, len(VALUE_STATS), need_grad, pending and agg != "token-sum")


def _setup_value(ctx, inputs, output):
    _setup_input_gradient(ctx, inputs, output)
    ctx.forward = _value_fwd


_value_loss = register("value_loss", _value_fwd, _fake_value, setup_context=_setup_value,
                       backward=_backward_input_gradient)


def value_loss(values, old_values, returns, mask, *, clip=0.2, agg="token-mean", global_num_tokens=None,
               global_num_seqs=None, dp_size=1, loss_scale_factor=None):
    """Clipped value loss 0.5 * agg(max((v - R)^2, (v_clipped - R)^2)) (docs/ops.md),
    v_clipped = clamp(v, old_values - clip, old_values + clip).

    Args:
        values: [B, T] (or [T]) float; the only input that gets a gradient.
        old_values, returns: same shape; constants.
        mask: same shape, bool/int/float.
        clip: >= 0, or None for no clipping.
        agg, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor: see `agg_loss`.

    Returns:
        (loss, stats): loss 0-dim float32 (float64 for float64 values); stats["clipfrac"], the
        masked fraction of tokens whose clipped term is larger.
    """
    check_float("values", values)
    check_rows("values", values)
    check_same("values", values, old_values=old_values, returns=returns)
    check_mask(mask, values, "values")
    if clip is not None:
        clip = check_number("clip", clip, nonnegative=True)
    agg_ = check_agg(agg, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor)
    grad = torch.is_grad_enabled() and values.requires_grad
    loss, stats, *_ = _value_loss(as_rows(values), as_rows(old_values.detach()), as_rows(returns.detach()),
                                  as_rows(mask), clip, *agg_, grad, use_triton(values), grad=grad)
    return loss, {"clipfrac": stats[0]}


# ---------------------------------------------------------------- fastrlhf::ppo_actor_loss


def _scale_unless_one_op(x: Tensor, g: Tensor, use_triton: bool) -> None:
    """x *= g (g one element), in place and without a host sync; the Triton kernel neither reads nor
    writes x when g == 1 (x * 1 == x exactly)."""
    if not use_triton or not x.is_contiguous():  # (inside the op the value may be read: no graph to break)
        factor = float(g)
        if factor != 1.0:
            x.mul_(factor)  # a Python float: the product in float32 (float64), rounded once to x's dtype
        return
    from fastrlhf.kernels import ppo_loss as kernels

    kernels.scale_unless_one_(x, g)


def _fake_scale_unless_one_(x, g, use_triton):
    return None


_scale_unless_one = register("scale_unless_one_", _scale_unless_one_op, _fake_scale_unless_one_, mutates_args=("x",))


def _ppo_actor_loss_op(logits: Tensor, labels: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                       token_weight: Tensor, ref_logp: Tensor | None, is_weights: Tensor | None,
                       sampler_weights: Tensor | None, temperature: float, kl_coef: float, kl_estimator: str,
                       kl_clamp: float | None, kl_straight_through: bool, entropy_coef: float, mode: str,
                       ratio_level: str, mode_values: list[float], need_grad: bool,
                       use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """logits [B, T, V], per-token [B, T] -> (loss, the policy stats (stats_layout) and ACTOR_STATS [8],
    d(loss)/d(logits) [B, T, V] contiguous, formed in the forward; [0] without need_grad); the spec flattened
    (ActorSpec.flat)."""
    spec = ActorSpec.unflat(temperature, kl_coef, kl_estimator, kl_clamp, kl_straight_through, entropy_coef, mode,
                            ratio_level, mode_values)
    dtype = out_dtype(logits)
    flat = lambda t: None if t is None else t.reshape(-1).to(dtype)  # noqa: E731
    terms = ActorTerms(flat(old_logp), flat(advantages), flat(mask), flat(token_weight), flat(ref_logp),
                       flat(is_weights), flat(sampler_weights), spec, tuple(mask.shape))
    y = labels.reshape(-1).long().contiguous() if use_triton else labels.long()
    if use_triton and fused_actor(spec):  # one kernel: both passes over the logits, the per-token gradients in between
        from fastrlhf.kernels import ppo_loss as kernels

        f32 = lambda t: None if t is None else t.float().contiguous()  # noqa: E731
        logp, entropy, d_logits = kernels.actor_loss_fwd(
            logits, y, f32(terms.old_logp), f32(terms.advantages), f32(terms.mask), f32(terms.weight),
            f32(terms.ref_logp), f32(terms.is_weights), spec=spec, need_grad=need_grad)
        loss, stats, _, _ = actor_pass(logp.to(dtype), entropy.to(dtype), terms, False, True)
    else:  # the log-prob forward, the pass over [B, T] (actor_pass), the log-prob backward
        logp, entropy, lse = logprobs_fwd(logits, y.view(labels.shape), temperature=temperature,
                                          ignore_index=IGNORE_INDEX, return_entropy=True, use_triton=use_triton)
        loss, stats, g_logp, g_ent = actor_pass(logp, entropy, terms, need_grad, use_triton)
        d_logits = None
        if need_grad:
            d_logits = logprobs_bwd(logits, y.view(labels.shape), lse, entropy, g_logp, g_ent,
                                    temperature=temperature, ignore_index=IGNORE_INDEX, inplace=False,
                                    use_triton=use_triton)
    return loss, stats, logits.new_empty(0) if d_logits is None else d_logits


def fused_actor(spec: ActorSpec) -> bool:
    """Whether the fused actor-loss kernel forms every token's gradient itself: a token-local policy-loss mode."""
    from fastrlhf.kernels.policy_modes import mode_launch

    return mode_launch(spec.policy).token_local


def _fake_ppo_actor_loss(logits, labels, old_logp, advantages, mask, token_weight, ref_logp, is_weights,
                         sampler_weights, temperature, kl_coef, kl_estimator, kl_clamp, kl_straight_through,
                         entropy_coef, mode, ratio_level, mode_values, need_grad, use_triton):
    dtype = out_dtype(logits)
    return (logits.new_empty((), dtype=dtype), logits.new_empty(N_ACTOR_STATS, dtype=dtype),
            logits.new_empty(logits.shape if need_grad else (0,)))


def _setup_actor(ctx, inputs, output):
    _, stats, d_logits = output
    ctx.mark_non_differentiable(stats, d_logits)
    ctx.set_materialize_grads(False)
    # kept as an attribute, not a saved tensor: the backward scales it in place, once
    ctx.d_logits = d_logits if inputs[-2] else None  # need_grad
    ctx.use_triton, ctx.n_inputs = inputs[-1], len(inputs)


def _backward_actor(ctx, grad_loss, *_):
    if ctx.d_logits is None:
        raise RuntimeError("ppo_actor_loss: backward through one loss twice is not supported (or the forward ran "
                           "without grad mode); its d(logits) is formed in the forward and handed over, scaled in "
                           "place, once")
    d_logits, ctx.d_logits = ctx.d_logits, None
    if grad_loss is None or not ctx.needs_input_grad[0]:
        return (None,) * ctx.n_inputs
    _scale_unless_one(d_logits, grad_loss, ctx.use_triton)
    return (d_logits,) + (None,) * (ctx.n_inputs - 1)


_ppo_actor_loss = register("ppo_actor_loss", _ppo_actor_loss_op, _fake_ppo_actor_loss, setup_context=_setup_actor,
                           backward=_backward_actor)


def actor_prologue(shape, device, what: str, old_logp, advantages, mask, ref_logp, is_weights, sampler_weights, *,
                   kl_coef, kl_estimator, kl_clamp, kl_straight_through, entropy_coef, temperature, loss_mode,
                   clip_low, clip_high, dual_clip, options, agg, global_num_tokens, global_num_seqs, dp_size,
                   loss_scale_factor):
    """The checks the two public actor ops share: the per-token arguments against `shape` (`what`: its
    name) and `device`, and the options. Returns (Agg, ActorSpec)."""
    check_float("old_logp", old_logp)  # required; ref_logp and is_weights may be None
    check_float("advantages", advantages)
    for name, x in (("old_logp", old_logp), ("advantages", advantages), ("ref_logp", ref_logp),
                    ("is_weights", is_weights), ("sampler_weights", sampler_weights)):
        if x is None:
            continue
        check_float(name, x)
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {what} = {tuple(shape)}, got {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but the logits are on {device}; expected one device")
    check_mask(mask, old_logp, "old_logp")
    policy = resolve_mode(loss_mode, clip_low, clip_high, dual_clip, options)
    if sampler_weights is not None and policy.mode != "vespo":
        raise ValueError(f"sampler_weights is vespo's (it enters its gamma weight); loss_mode={policy.mode!r} takes "
                         f"the sampler correction as is_weights")
    n_rows = as_rows(mask).shape[0]
    agg_ = resolve_agg(policy.mode, agg, n_rows, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor)
    kl_coef = check_number("kl_coef", kl_coef)
    if kl_coef != 0 and ref_logp is None:
        raise ValueError(f"kl_coef is {kl_coef} but ref_logp is None: the KL term needs the reference log-probs "
                         f"(pass ref_logp, or kl_coef=0.0 for no KL term)")
    entropy_coef = check_number("entropy_coef", entropy_coef)
    check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    kl_clamp = None if kl_clamp is None else check_number("kl_clamp", kl_clamp, positive=True)
    temperature = check_number("temperature", temperature, positive=True)
    return agg_, ActorSpec(temperature, kl_coef, KL_ESTIMATORS[kl_estimator], kl_clamp, bool(kl_straight_through),
                           entropy_coef, policy)


def actor_stats(spec: ActorSpec, stats: Tensor, has_ref: bool) -> dict:
    """{name: value} of an actor op's stats: the mode's (without approx_kl_unclamped), pg_loss, entropy and,
    with a reference, kl."""
    values = stats.unbind()
    out = {k: v for k, v in stats_dict(spec.policy.mode, stats[:len(POLICY_STATS) + 1]).items()
           if k != "approx_kl_unclamped"}
    names = ACTOR_STATS if has_ref else ACTOR_STATS[:-1]
    out.update(zip(names, values[len(POLICY_STATS) + 1:]))
    return out


def ppo_actor_loss(logits, labels, old_logp, advantages, mask, *, ref_logp=None, kl_coef=0.0, kl_estimator="k3",
                   kl_clamp=None, kl_straight_through=False, entropy_coef=0.0, temperature=1.0, loss_mode="vanilla",
                   clip_low=0.2, clip_high=None, dual_clip=None, is_weights=None, agg=None, global_num_tokens=None,
                   global_num_seqs=None, dp_size=1, loss_scale_factor=None, sampler_weights=None, **options):
    """The whole actor loss straight from logits (docs/ops.md):
    policy_loss + kl_coef * KL - entropy_coef * entropy, each aggregated with `agg`.

    For verl's vanilla loss and the other token-local modes (cispo, sapo and the clipped surrogate at the
    token level, gpg, dro, dppo_tv, dppo_kl) every term is token-local once the aggregation weights are
    known, so the forward forms d(loss)/d(logits) too (as `linear_ppo_actor_loss`): on CUDA one kernel
    reads the logits (log-prob, entropy, log-sum-exp), forms each token's policy, KL and entropy gradients,
    and reads the row again, from its end, while L2 still holds most of it, to write d(logits) once. The
    modes whose token gradients depend on their whole sequence (gspo, luspo, the sequence levels, geo_mean,
    vespo) or on the batch (clip_cov's and kl_cov's selections, made from the log-probs) run a log-prob
    forward over the logits, one pass over [B, T] (the policy-loss kernel), and a log-prob backward writing
    d(logits): the same bytes of logits read and written, never a third pass over them. The backward only
    scales d(logits) by the upstream gradient, in place: free when that is exactly 1 (`loss.backward()`),
    one more read and write of d(logits) otherwise (divide by the global token or sequence count through
    `agg` / `global_num_tokens` rather than scaling the loss). So the loss supports one backward: a second
    through the same graph raises. Between forward and backward d(logits) occupies B x T x V in the
    logits' dtype, in place of the logits, which the op does not keep.

    Args:
        logits: [B, T, V] (or [..., V]) float, any strides but the vocab one.
        labels: logits.shape[:-1] integer; -100 is ignored (logp 0, no gradient).
        old_logp, advantages, mask, ref_logp, is_weights: logits.shape[:-1]; constants (no gradient).
        kl_coef, kl_estimator, kl_clamp, kl_straight_through: the KL term against ref_logp (see
            `token_kl`: estimator, clamp, straight_through); kl_coef != 0 needs ref_logp.
        is_weights: per-token importance weights of the policy term (see `policy_loss`).
        entropy_coef, temperature: as `logprobs`.
        loss_mode, clip_low, clip_high, dual_clip, sampler_weights, **options: the policy-loss mode and its
            options, as `policy_loss` (clip_cov draws from torch's default generator, as verl).
        agg, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor: see `agg_loss` and `policy_loss`
            (agg=None: the mode's own); the KL and entropy terms are aggregated as the policy term.

    Returns:
        (loss, stats): loss 0-dim float32 (float64 for float64 logits); stats (no gradient): the mode's
        (policy_loss's, without approx_kl_unclamped), pg_loss (the aggregated policy term), entropy and,
        with ref_logp, kl (masked means).
    """
    check_float("logits", logits)
    check_int("labels", labels)
    shape = tuple(logits.shape[:-1])
    if logits.dim() < 1 or tuple(labels.shape) != shape:
        raise ValueError(f"labels must have shape logits.shape[:-1] = {shape}, got {tuple(labels.shape)}")
    agg_, spec = actor_prologue(
        shape, logits.device, "logits.shape[:-1]", old_logp, advantages, mask, ref_logp, is_weights, sampler_weights,
        kl_coef=kl_coef, kl_estimator=kl_estimator, kl_clamp=kl_clamp, kl_straight_through=kl_straight_through,
        entropy_coef=entropy_coef, temperature=temperature, loss_mode=loss_mode, clip_low=clip_low,
        clip_high=clip_high, dual_clip=dual_clip, options=options, agg=agg, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, dp_size=dp_size, loss_scale_factor=loss_scale_factor)
    x = as_3d(logits)
    B, T = x.shape[:2]
    rows = lambda t: None if t is None else t.detach().reshape(B, T)  # noqa: E731
    m = rows(mask)
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    loss, stats, *_ = _ppo_actor_loss(
        x, labels.reshape(B, T), rows(old_logp), rows(advantages), m, token_weights(m, agg_, out_dtype(logits)),
        rows(ref_logp), rows(is_weights), rows(sampler_weights), *spec.flat(), need_grad, use_triton(logits),
        grad=need_grad)
    return loss, actor_stats(spec, stats, ref_logp is not None)
