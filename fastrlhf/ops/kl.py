"""Token-level KL estimates and KL-shaped rewards: `token_kl`, `kl_shaped_rewards`
(kernels: fastrlhf/kernels/kl.py).

    r = logp - ref_logp;  k1 = r,  k2 = r^2 / 2,  k3 = exp(-c) - 1 + c with c = clamp(r, -20, 20),  abs = |r|
    then, with `clamp`, kl = clamp(kl, -clamp, clamp)
(k3 near r = 0 through expm1 here, as reference.py; a Taylor series in kernels/kl.py)

Custom ops (what torch.compile sees; eager calls run the same bodies without the dispatcher, ops._dispatch):
fastrlhf::token_kl, fastrlhf::token_kl_backward (-> d(logp) = g w d(kl)/d(logp) and d(ref_logp), its
negation, in one pass), fastrlhf::kl_shaped_rewards (no gradient: rewards are data).
With straight_through the value stays the estimator's and the gradient is w * r (that of
w * r^2 / 2), as verl's "k3+" and OpenRLHF's unbiased_gradient.
Gradients at ties follow reference.py: both clamps pass the gradient at their bounds, d|r|/dr = 0 at 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastrlhf.constants import KL_ESTIMATORS, LOG_RATIO_CLAMP
from fastrlhf.ops._common import (
    as_dtype,
    check_choice,
    check_device,
    check_float,
    check_mask,
    check_number,
    check_same,
    contiguous,
    out_dtype,
    use_triton,
)
from fastrlhf.ops._dispatch import eager, register

# ---------------------------------------------------------------- torch path (also used by ops.losses, ops.linear)


def _k3(c: Tensor) -> Tensor:
    """exp(-c) - 1 + c as expm1(-c) + c, reference.py's expression: near c = 0 its relative error is
    ~1e-7 / |c| in float32 (expm1's rounding; the sum is exact), not the direct form's ~1e-7 / c^2.
    The kernels sum the series there instead (~1e-7 relative)."""
    return c.neg().expm1_().add_(c)


def _dk3_(c: Tensor) -> Tensor:
    """1 - exp(-c) = -expm1(-c), in place of c: no cancellation in any dtype."""
    return c.neg_().expm1_().neg_()


def kl_value(logp: Tensor, ref_logp: Tensor, estimator: str, clamp: float | None) -> Tensor:
    """The per-token estimate in out_dtype(logp); `estimator` is a canonical name (k1, k2, k3, abs).
    (In-place steps on fresh tensors: on CPU each new buffer of a small op costs as much as its math.)"""
    dtype = out_dtype(logp)
    r = as_dtype(logp, dtype) - as_dtype(ref_logp, dtype)
    if estimator == "k2":
        kl = r.square_().mul_(0.5)
    elif estimator == "k3":
        kl = _k3(r.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    elif estimator == "abs":
        kl = r.abs_()
    else:
        kl = r
    return kl if clamp is None else kl.clamp_(-clamp, clamp)


def kl_value_and_grad(logp: Tensor, ref_logp: Tensor, estimator: str, clamp: float | None) -> tuple[Tensor, Tensor]:
    """(the estimate, d(kl)/d(logp) = -d(kl)/d(ref_logp)) per token, formed together (k3's exp once), the
    derivative written out with the tie rules:
    dk1 = 1, dk2 = r, dk3 = (1 - exp(-r)) [|r| <= 20], dabs = sign(r) (0 at 0), times [|kl| <= clamp].
    (A clamp returns its input itself inside its bounds, so `x == clamp(x)` tests inside, bounds included.)"""
    dtype = out_dtype(logp)
    r = as_dtype(logp, dtype) - as_dtype(ref_logp, dtype)
    if estimator == "k2":
        kl, d = r.square().mul_(0.5), r
    elif estimator == "k3":
        c = r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        e = c.neg().expm1_()  # exp(-c) - 1
        kl = e + c
        d = e.neg_().mul_(r == c)  # 1 - exp(-c), 0 where r is clamped
    elif estimator == "abs":
        kl, d = r.abs(), r.sign()
    else:
        kl, d = r, torch.ones_like(r)
    if clamp is not None:
        d = d.mul_(kl.abs() <= clamp)
        kl = kl.clamp(-clamp, clamp)
    return kl, d


def kl_grad(logp: Tensor, ref_logp: Tensor, estimator: str, clamp: float | None) -> Tensor:
    """d(kl)/d(logp) per token (= -d(kl)/d(ref_logp)); see `kl_value_and_grad`."""
    return kl_value_and_grad(logp, ref_logp, estimator, clamp)[1]


class _TorchKL(torch.autograd.Function):
    """token_kl on the torch path in eager mode with grad: the estimate and its derivative formed in one
    pass (k3's exponential once), the backward one product (times the straight-through weight)."""

    @staticmethod
    def forward(ctx, logp, ref_logp, estimator, clamp, straight_through, grad_weight):
        kl, d = kl_value_and_grad(logp, ref_logp, estimator, clamp)
        if straight_through:  # the value is the estimator's, the gradient that of w * r^2 / 2: w * r
            d = kl_grad(logp, ref_logp, "k2", None)
            if grad_weight is not None:
                d = d.mul_(grad_weight)
        ctx.save_for_backward(d)
        ctx.dtypes = logp.dtype, ref_logp.dtype
        return kl

    @staticmethod
    def backward(ctx, grad):
        (d,) = ctx.saved_tensors
        d = d * grad
        need_logp, need_ref = ctx.needs_input_grad[:2]
        d_logp = as_dtype(d, ctx.dtypes[0]) if need_logp else None
        return d_logp, as_dtype(d.neg(), ctx.dtypes[1]) if need_ref else None, None, None, None, None


# ---------------------------------------------------------------- fastrlhf::token_kl


def _plain_kl(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """k1 = r and k2 = r^2 / 2 on the torch path in eager mode, unclamped: plain torch ops under torch's own
    autograd. These formulas have no tie (no clamp, no |r|), so its gradients, 1 and r (times the upstream
    gradient, -1 and -r for ref_logp), are exactly the stated ones; and a one-op estimate pays no
    autograd.Function around it."""
    dtype = out_dtype(logp)
    r = as_dtype(logp, dtype) - as_dtype(ref_logp, dtype)
    return r if estimator == "k1" else r.square().mul_(0.5)


def _token_kl_fwd(logp: Tensor, ref_logp: Tensor, estimator: str, clamp: float | None, straight_through: bool,
                  grad_weight: Tensor | None, use_triton: bool) -> Tensor:
    """The estimate; straight_through and grad_weight only change the gradient."""
    if not use_triton:
        return kl_value(logp, ref_logp, estimator, clamp)
    from fastrlhf.kernels import kl as kernels

    return kernels.token_kl_fwd(contiguous(logp), contiguous(ref_logp), estimator=estimator, clamp=clamp,
                                out_dtype=out_dtype(logp))


def _fake_kl(logp, ref_logp, estimator, clamp, straight_through, grad_weight, use_triton):
    return logp.new_empty(logp.shape, dtype=out_dtype(logp))


def _rows_view(grad: Tensor) -> Tensor:
    """[R, C] view of the upstream gradient without a copy where its strides allow (an expanded `kl.sum()`
    gradient included), else a contiguous copy."""
    if grad.dim() == 2:
        return grad
    if grad.dim() < 2:
        return grad.reshape(1, -1) if grad.dim() == 0 or grad.is_contiguous() else grad.contiguous().view(1, -1)
    try:
        return grad.view(-1, grad.shape[-1])
    except RuntimeError:
        return grad.contiguous().view(-1, grad.shape[-1])


def _token_kl_grads(logp: Tensor, ref_logp: Tensor, grad: Tensor, grad_weight: Tensor | None, estimator: str,
                    clamp: float | None, need_logp: bool, need_ref: bool, use_triton: bool) -> tuple[Tensor, Tensor]:
    """(d(logp), d(ref_logp)) = (g w dkl/dr, -g w dkl/dr) in the inputs' dtypes, [0] where not needed."""
    if use_triton:
        from fastrlhf.kernels import kl as kernels

        d_logp, d_ref = kernels.token_kl_bwd(contiguous(logp), contiguous(ref_logp), _rows_view(grad),
                                             None if grad_weight is None else contiguous(grad_weight),
                                             estimator=estimator, clamp=clamp, need_logp=need_logp, need_ref=need_ref)
    else:
        d = kl_grad(logp, ref_logp, estimator, clamp).mul_(grad)
        if grad_weight is not None:
            d = d.mul_(grad_weight)
        d_logp = as_dtype(d, logp.dtype) if need_logp else None
        d_ref = as_dtype(d.neg(), ref_logp.dtype) if need_ref else None
    return (logp.new_empty(0) if d_logp is None else d_logp, ref_logp.new_empty(0) if d_ref is None else d_ref)


def _fake_kl_grads(logp, ref_logp, grad, grad_weight, estimator, clamp, need_logp, need_ref, use_triton):
    return (logp.new_empty(logp.shape if need_logp else (0,)),
            ref_logp.new_empty(ref_logp.shape if need_ref else (0,)))


# the backward's kernel entry: one node for torch.compile; the Function's backward calls it directly in eager
_token_kl_backward = register("token_kl_backward", _token_kl_grads, _fake_kl_grads)


def _setup_context(ctx, inputs, output):
    logp, ref_logp, estimator, clamp, straight_through, grad_weight, triton = inputs
    ctx.save_for_backward(logp, ref_logp, grad_weight)
    ctx.args = (estimator, clamp, straight_through, triton)


def _backward(ctx, grad):
    logp, ref_logp, grad_weight = ctx.saved_tensors
    estimator, clamp, straight_through, triton = ctx.args
    if straight_through:  # the gradient of w * r^2 / 2: w * r, as k2's times the weight
        estimator, clamp = "k2", None
    else:
        grad_weight = None
    need_logp, need_ref = ctx.needs_input_grad[:2]
    d_logp, d_ref = _token_kl_backward(logp, ref_logp, grad, grad_weight, estimator, clamp, need_logp, need_ref,
                                       triton)
    return d_logp if need_logp else None, d_ref if need_ref else None, None, None, None, None, None


_token_kl = register("token_kl", _token_kl_fwd, _fake_kl, setup_context=_setup_context, backward=_backward)


def token_kl(logp, ref_logp, *, estimator="k1", clamp=None, straight_through=False, grad_weight=None):
    """Per-token KL estimate of the policy against a reference (docs/ops.md).

    Args:
        logp, ref_logp: [...] log-probs of the same tokens, any float dtype.
        estimator: with r = logp - ref_logp: "k1" / "kl" = r; "k2" / "mse" = r^2 / 2;
            "k3" / "low_var_kl" = exp(-r) - 1 + r (r clamped to +-20 inside exp); "abs" = |r|.
        clamp: bounds the output to [-clamp, clamp] (verl: low_var_kl with clamp=10; OpenRLHF: 10).
        straight_through: keep the estimator's value but take the gradient of w * r^2 / 2, i.e.
            d/dlogp = w * r = -d/dref_logp (verl's "k1+", "k3+", "low_var_kl+", "abs+";
            OpenRLHF's unbiased_gradient).
        grad_weight: w above, logp's shape, a constant (e.g. OpenRLHF's clamped importance
            weight exp(logp - old_logp)); None = 1. Only with straight_through.

    Returns:
        kl [...] float32 (float64 for float64 inputs); gradients to logp and ref_logp.
    """
    if estimator == "k1" and clamp is None and not straight_through and grad_weight is None:
        try:  # float32 inputs of one shape: k1 is their difference, one torch op on any device, eager or traced
            if logp.dtype is ref_logp.dtype is torch.float32 and logp.shape == ref_logp.shape:
                return logp - ref_logp
        except (AttributeError, RuntimeError):
            pass  # not tensors, or on two devices: the checks below name the argument
    check_float("logp", logp)
    check_same("logp", logp, ref_logp=ref_logp, grad_weight=grad_weight)
    check_choice("estimator", estimator, KL_ESTIMATORS)
    clamp = None if clamp is None else check_number("clamp", clamp, positive=True)
    if grad_weight is not None and not straight_through:
        raise ValueError("grad_weight applies to straight_through=True only")
    triton, name = use_triton(logp), KL_ESTIMATORS[estimator]
    grad = torch.is_grad_enabled() and (logp.requires_grad or ref_logp.requires_grad)
    if not triton and eager(logp):
        if name in ("k1", "k2") and clamp is None and not straight_through:
            return _plain_kl(logp, ref_logp, name)
        if grad:
            return _TorchKL.apply(logp, ref_logp, name, clamp, bool(straight_through),
                                  None if grad_weight is None else grad_weight.detach())
    return _token_kl(logp, ref_logp, name, clamp, bool(straight_through),
                     None if grad_weight is None else grad_weight.detach(), triton, grad=grad)


# ---------------------------------------------------------------- fastrlhf::kl_shaped_rewards


def _kl_shaped_rewards_torch(scores, logp, ref_logp, mask, kl_coef, estimator, clamp):
    m = mask.to(out_dtype(logp))
    rewards = torch.where(m != 0, kl_value(logp, ref_logp, estimator, clamp) * (-kl_coef * m), 0.0)
    T = logp.shape[1]
    positions = torch.arange(T, device=logp.device).expand(logp.shape)
    last = torch.where(m != 0, positions, -1).amax(-1)  # the last mask=1 token, -1 for an empty row
    add = torch.where(last >= 0, scores.to(rewards.dtype), 0.0)
    return rewards.scatter_add(1, last.clamp(min=0).unsqueeze(1), add.unsqueeze(1))


def _kl_shaped_rewards_fwd(scores: Tensor, logp: Tensor, ref_logp: Tensor, mask: Tensor, kl_coef: float,
                           estimator: str, clamp: float | None, use_triton: bool) -> Tensor:
    if not use_triton:
        if logp.numel() == 0:
            return torch.zeros(logp.shape, dtype=out_dtype(logp), device=logp.device)
        return _kl_shaped_rewards_torch(scores, logp, ref_logp, mask, kl_coef, estimator, clamp)
    from fastrlhf.kernels import kl as kernels

    return kernels.kl_shaped_rewards_fwd(contiguous(scores), contiguous(logp), contiguous(ref_logp),
                                         contiguous(mask), kl_coef=kl_coef, estimator=estimator, clamp=clamp,
                                         out_dtype=out_dtype(logp))


def _fake_rewards(scores, logp, ref_logp, mask, kl_coef, estimator, clamp, use_triton):
    return logp.new_empty(logp.shape, dtype=out_dtype(logp))


_kl_shaped_rewards = register("kl_shaped_rewards", _kl_shaped_rewards_fwd, _fake_rewards)


def kl_shaped_rewards(scores, logp, ref_logp, mask, *, kl_coef, estimator="k1", clamp=None):
    """Per-token rewards: -kl_coef * KL on every response token, plus the sequence score on its
    last mask=1 token (docs/ops.md).

    Args:
        scores: [B] sequence scores (e.g. a reward model's).
        logp, ref_logp: [B, T] log-probs of the policy and the reference.
        mask: [B, T] bool/int/float, non-zero = a response token.
        kl_coef, estimator, clamp: the KL penalty (see `token_kl`).

    Returns:
        rewards [B, T] float32 (float64 for float64 logp), 0 where mask = 0. No gradient
        (rewards are data).
    """
    check_float("logp", logp)
    check_float("scores", scores)
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    check_same("logp", logp, ref_logp=ref_logp)
    check_mask(mask, logp, "logp")
    if tuple(scores.shape) != (logp.shape[0],):
        raise ValueError(f"scores must have shape [B] = ({logp.shape[0]},), got {tuple(scores.shape)}")
    check_device("scores", scores, "logp", logp)
    kl_coef = check_number("kl_coef", kl_coef)
    check_choice("estimator", estimator, KL_ESTIMATORS)
    clamp = None if clamp is None else check_number("clamp", clamp, positive=True)
    return _kl_shaped_rewards(scores.detach(), logp.detach(), ref_logp.detach(), mask, kl_coef,
                              KL_ESTIMATORS[estimator], clamp, use_triton(logp))
