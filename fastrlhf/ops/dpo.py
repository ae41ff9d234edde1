"""Direct preference optimisation: `dpo_loss` on per-sequence log-prob sums, and the fused path
from hidden states, `linear_sequence_logprobs` / `linear_dpo_loss` (formulas: reference.dpo_loss;
the peers' conventions: docs/ops.md).

With c = logp_chosen - ref_chosen, r = logp_rejected - ref_rejected, d = c - r, z = beta d:
    sigmoid  -(1 - e) log sigmoid(z) - e log sigmoid(-z)          (cDPO label smoothing e; TRL at e = 0)
    robust   (-(1 - e) log sigmoid(z) + e log sigmoid(-z)) / (1 - 2 e)               (TRL)
    hinge    max(0, 1 - z); gradient 0 at the kink z = 1                              (TRL)
    ipo      (d - 1 / (2 beta))^2, d = c / n_c - r / n_r with token counts n (TRL) or summed (OpenRLHF)
loss = mean over the B pairs.

Custom op: fastrlhf::dpo_loss -> (loss, stats [6], d loss / d c [B], d loss / d r [B]); its
registered backward scales the last two by the upstream gradient (+ to the policy, - to the
reference). No Triton kernel: everything is over B pairs. The fused path is ops.linear's
`linear_logprobs` (chunked, never [N, V] logits) summed per sequence; this module imports
ops.linear, never the reverse.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fastrlhf.constants import DPO_LOSS_TYPES, IGNORE_INDEX
from fastrlhf.ops._common import check_choice, check_device, check_float, check_mask, check_number, out_dtype
from fastrlhf.ops._dispatch import register
from fastrlhf.ops.linear import linear_logprobs

DPO_STATS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "logp_chosen", "logp_rejected")
SMOOTHED = ("sigmoid", "robust")  # the loss types that use label_smoothing


def _losses_and_grads(c: Tensor, r: Tensor, beta: float, loss_type: str, e: float, n_c, n_r):
    """Per-pair losses [B] and their derivatives in c and r."""
    if loss_type == "ipo":
        inv_c = 1 / n_c.clamp(min=1) if n_c is not None else torch.ones_like(c)
        inv_r = 1 / n_r.clamp(min=1) if n_r is not None else torch.ones_like(r)
        u = c * inv_c - r * inv_r - 1 / (2 * beta)
        return u * u, 2 * u * inv_c, -2 * u * inv_r
    z = beta * (c - r)
    if loss_type == "sigmoid":
        losses = -(1 - e) * F.logsigmoid(z) - e * F.logsigmoid(-z)
        dz = -(1 - e) * torch.sigmoid(-z) + e * torch.sigmoid(z)
    elif loss_type == "robust":
        losses = (-(1 - e) * F.logsigmoid(z) + e * F.logsigmoid(-z)) / (1 - 2 * e)
        dz = (-(1 - e) * torch.sigmoid(-z) - e * torch.sigmoid(z)) / (1 - 2 * e)
    else:  # hinge
        losses = (1 - z).clamp(min=0)
        dz = torch.where(1 - z > 0, -1.0, 0.0).to(z.dtype)
    return losses, beta * dz, -beta * dz


# ---------------------------------------------------------------- fastrlhf::dpo_loss


def _dpo_loss_op(chosen_logp: Tensor, rejected_logp: Tensor, ref_chosen_logp: Tensor, ref_rejected_logp: Tensor,
                 chosen_lengths: Tensor | None, rejected_lengths: Tensor | None, beta: float, loss_type: str,
                 label_smoothing: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dtype = out_dtype(chosen_logp)
    lp_c, lp_r = chosen_logp.to(dtype), rejected_logp.to(dtype)
    c, r = lp_c - ref_chosen_logp.to(dtype), lp_r - ref_rejected_logp.to(dtype)
    n_c = None if chosen_lengths is None else chosen_lengths.to(dtype)
    n_r = None if rejected_lengths is None else rejected_lengths.to(dtype)
    losses, d_c, d_r = _losses_and_grads(c, r, beta, loss_type, label_smoothing, n_c, n_r)
    B = c.shape[0]
    inv_b = 1.0 / B if B > 0 else 0.0
    rc, rr = beta * c, beta * r
    stats = torch.stack([rc.sum(), rr.sum(), (rc - rr).sum(), (rc > rr).to(dtype).sum(), lp_c.sum(), lp_r.sum()])
    return losses.sum() * inv_b, stats * inv_b, d_c * inv_b, d_r * inv_b


def _fake_dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_lengths, rejected_lengths,
                   beta, loss_type, label_smoothing):
    dtype = out_dtype(chosen_logp)
    B = chosen_logp.shape[0]
    return (chosen_logp.new_empty((), dtype=dtype), chosen_logp.new_empty(len(DPO_STATS), dtype=dtype),
            chosen_logp.new_empty(B, dtype=dtype), chosen_logp.new_empty(B, dtype=dtype))


def _setup_context(ctx, inputs, output):
    ctx.dtypes = tuple(x.dtype for x in inputs[:4])
    ctx.save_for_backward(output[2], output[3])
    ctx.mark_non_differentiable(output[1], output[2], output[3])


def _backward(ctx, grad_loss, grad_stats, grad_dc, grad_dr):
    d_c, d_r = ctx.saved_tensors
    g_c, g_r = grad_loss * d_c, grad_loss * d_r
    grads = [g_c, g_r, -g_c, -g_r]
    grads = [g.to(dt) if need else None for g, dt, need in zip(grads, ctx.dtypes, ctx.needs_input_grad[:4])]
    return (*grads, None, None, None, None, None)


_dpo_loss = register("dpo_loss", _dpo_loss_op, _fake_dpo_loss, setup_context=_setup_context, backward=_backward)


def dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, *, beta=0.1, loss_type="sigmoid",
             label_smoothing=0.0, chosen_lengths=None, rejected_lengths=None):
    """The DPO loss of B preference pairs from per-sequence summed log-probs (docs/ops.md).

    Args:
        chosen_logp, rejected_logp: [B] policy log-prob sums over each response's tokens.
        ref_chosen_logp, ref_rejected_logp: [B] the reference model's (usually no gradient).
        beta: > 0, the strength of the pull towards the reference (IPO's tau).
        loss_type: "sigmoid" (DPO), "robust" (TRL's robust DPO), "hinge" (SLiC), "ipo".
        label_smoothing: e in [0, 0.5): the probability that a label is flipped; "sigmoid" uses it
            as cDPO (OpenRLHF; TRL 1.16's sigmoid has none), "robust" as TRL. Other loss types
            take none.
        chosen_lengths, rejected_lengths: [B] response token counts, "ipo" only: given, the
            log-ratios are divided by them (clamped to >= 1) first (TRL); not given, summed (OpenRLHF).

    Returns:
        (loss, stats): loss float32 (float64 for float64 inputs), the mean over pairs (0 for B = 0),
        with gradients to all four log-prob inputs; stats, detached means over pairs:
        reward_chosen = beta (logp_c - ref_c), reward_rejected, reward_margin, reward_accuracy (the
        fraction with reward_chosen > reward_rejected, strictly), logp_chosen, logp_rejected.
    """
    check_float("chosen_logp", chosen_logp)
    if chosen_logp.dim() != 1:
        raise ValueError(f"chosen_logp must be [B], got shape {tuple(chosen_logp.shape)}")
    for name, x in (("rejected_logp", rejected_logp), ("ref_chosen_logp", ref_chosen_logp),
                    ("ref_rejected_logp", ref_rejected_logp)):
        check_float(name, x)
        if x.shape != chosen_logp.shape:
            raise ValueError(f"{name} must have the shape of chosen_logp {tuple(chosen_logp.shape)}, "
                             f"got {tuple(x.shape)}")
        check_device(name, x, "chosen_logp", chosen_logp)
    beta = check_number("beta", beta, positive=True)
    check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
    label_smoothing = check_number("label_smoothing", label_smoothing, nonnegative=True)
    if label_smoothing >= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type not in SMOOTHED:
        raise ValueError(f"label_smoothing is used by loss_type {SMOOTHED} only, got loss_type={loss_type!r} "
                         f"with label_smoothing={label_smoothing}")
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError("pass both chosen_lengths and rejected_lengths, or neither")
    if chosen_lengths is not None:
        if loss_type != "ipo":
            raise ValueError(f"chosen_lengths / rejected_lengths are used by loss_type 'ipo' only, got {loss_type!r}")
        for name, x in (("chosen_lengths", chosen_lengths), ("rejected_lengths", rejected_lengths)):
            if not isinstance(x, torch.Tensor) or x.is_complex() or x.dtype == torch.bool:
                raise TypeError(f"{name} must be an integer or float tensor of token counts")
            if x.shape != chosen_logp.shape:
                raise ValueError(f"{name} must have the shape of chosen_logp {tuple(chosen_logp.shape)}, "
                                 f"got {tuple(x.shape)}")
            check_device(name, x, "chosen_logp", chosen_logp)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (chosen_logp, rejected_logp, ref_chosen_logp,
                                                                     ref_rejected_logp))
    loss, stats, _, _ = _dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_lengths,
                                  rejected_lengths, beta, loss_type, label_smoothing, grad=grad)
    return loss, dict(zip(DPO_STATS, stats.unbind()))


# ---------------------------------------------------------------- from hidden states


def linear_sequence_logprobs(hidden, weight, labels, mask, *, bias=None, temperature=1.0, chunk_size=None,
                             accum_dtype=None):
    """Per-sequence sums of the response tokens' log-probs, straight from hidden states and the
    lm_head: `linear_logprobs` (chunked; never [N, V] logits) with the unmasked labels, summed.

    Args:
        hidden: [B, T, H], the states that predict `labels` (already shifted: hidden[:, t]
            predicts labels[:, t]); weight [V, H]; bias [V] or None.
        labels: [B, T] integer token ids; mask: [B, T], non-zero = a response token (the rest
            gets no logits gradient and adds nothing).
        temperature, chunk_size, accum_dtype: as `linear_logprobs`.

    Returns:
        [B] float32 (float64 for float64 hidden), gradients to hidden, weight and bias.

    Chosen and rejected responses go through one pass by stacking them along B (chosen rows
    first, as TRL and OpenRLHF concatenate them): see `linear_dpo_loss`.
    """
    check_float("hidden", hidden)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, T, H], got shape {tuple(hidden.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"labels must have shape [B, T] = {tuple(hidden.shape[:2])}, got {tuple(labels.shape)}")
    check_mask(mask, labels, "labels")
    masked = torch.where(mask != 0, labels, IGNORE_INDEX)
    logp = linear_logprobs(hidden, weight, masked, bias=bias, temperature=temperature, chunk_size=chunk_size,
                           accum_dtype=accum_dtype)
    return logp.sum(-1)


def linear_dpo_loss(hidden, weight, labels, mask, ref_chosen_logp, ref_rejected_logp, *, bias=None, beta=0.1,
                    loss_type="sigmoid", label_smoothing=0.0, ipo_per_token=False, temperature=1.0,
                    chunk_size=None, accum_dtype=None):
    """`dpo_loss` with the policy sums from hidden states: one chunked pass over the chosen and
    rejected responses, stacked along the batch.

    Args:
        hidden, labels, mask: [2B, T, H], [2B, T], [2B, T]: rows 0..B-1 the chosen responses,
            rows B..2B-1 the rejected ones (of the same prompts); as `linear_sequence_logprobs`.
        weight, bias, temperature, chunk_size, accum_dtype: as `linear_sequence_logprobs`.
        ref_chosen_logp, ref_rejected_logp: [B] reference sums (e.g. `linear_sequence_logprobs`
            of the reference under torch.no_grad()).
        beta, loss_type, label_smoothing: as `dpo_loss`.
        ipo_per_token: with loss_type="ipo", divide each log-ratio by its response's token count
            (the mask's row sums), as TRL.

    Returns:
        (loss, stats) as `dpo_loss`.
    """
    if hidden.dim() != 3 or hidden.shape[0] % 2:
        raise ValueError(f"hidden must be [2B, T, H] (chosen rows, then rejected rows), got {tuple(hidden.shape)}")
    sums = linear_sequence_logprobs(hidden, weight, labels, mask, bias=bias, temperature=temperature,
                                    chunk_size=chunk_size, accum_dtype=accum_dtype)
    B = hidden.shape[0] // 2
    lengths = {}
    if ipo_per_token:
        if loss_type != "ipo":
            raise ValueError(f"ipo_per_token applies to loss_type 'ipo' only, got {loss_type!r}")
        counts = (mask != 0).sum(-1)
        lengths = {"chosen_lengths": counts[:B], "rejected_lengths": counts[B:]}
    return dpo_loss(sums[:B], sums[B:], ref_chosen_logp, ref_rejected_logp, beta=beta, loss_type=loss_type,
                    label_smoothing=label_smoothing, **lengths)
