"""Teacher-student distillation losses: `distill_loss` on both models' logits, `linear_distill_loss`
from both models' hidden states and lm_heads without ever holding [N, V] logits of either
(kernels: fastrlhf/kernels/distill.py; formulas: reference.distill_divergence).

Per token, with s, t the student's and teacher's softmax(z), z = softcap tanh(scale x / softcap) / T:
    beta = 0  forward KL(t || s);   beta = 1  reverse KL(s || t)
    else      beta KL(t || m) + (1 - beta) KL(s || m),  m = (1 - beta) s + beta t
(TRL 1.16's DistillationTrainer / `_chunked_divergence_loss`, its GKD `generalized_jsd_loss`, Liger's
fused linear JSD: the same beta, the same directions). The loss is TRL's reduction:
    loss = sum(D m) / (global_num_tokens or sum(m))      (num_items_in_batch = global_num_tokens)
The teacher is a constant: gradients flow to the student's logits, or its hidden states, lm_head
weight and bias, only.

Both ops are a scalar whose gradient is token-local once the rows' weights w = m / count are known,
and they are known before the forward, so the forward forms the gradient (as Liger's fused linear
JSD and ops.linear's actor loss): per chunk of rows
    1. s = h_s W_s^T (+ b_s),  t = h_t W_t^T (+ b_t)                          matmuls 1 and 2
    2. D, the student's entropy, and d(s) over s                             one kernel (or the torch path)
    3. d(h_s)[chunk] = d(s) W_s,  d(W_s) += d(s)^T h_s,  d(b_s) += sum d(s)   matmuls 3 and 4
and the backward scales the gradients by the upstream scalar: four matmuls per chunk, the least
the loss needs, and one backward per graph.

`topk_distill_loss` is the divergence on a teacher's top-K support (TRL's async distillation: a teacher
that reports K candidates per position): the student's K log-probs come from ops.logprobs (one fused
read of its logits for all K), the rest is over [N, K + 1] numbers.

The call path (quack's pattern): one autograd.Function per op whose eager forward calls the op's body
directly; the registered custom ops (fastrlhf::distill_loss, fastrlhf::linear_distill_loss, with
fake implementations) are reached only under torch.compile or for fake / subclass tensors.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

from fastrlhf.constants import LOG_MIX_FLOOR
from fastrlhf.ops._common import (
    check_device,
    check_float,
    check_int,
    check_mask,
    check_number,
    out_dtype,
    safe_inverse,
    use_triton,
)
from fastrlhf.ops.linear import (
    _add_chunk_gradients,
    _or_empty,
    auto_chunk_size,
    chunk_logits,
    weight_accum_dtype,
)
from fastrlhf.ops.logprobs import BLOCK_BYTES_PER_THREAD, as_3d, logprobs

MODES = {0.0: "forward_kl", 1.0: "reverse_kl"}  # beta -> divergence; any other beta in (0, 1) is "jsd"


class DistillSpec(NamedTuple):
    """What turns two models' logits into one divergence per token (flattened at the custom ops)."""

    beta: float
    temperature: float = 1.0
    student_logit_scale: float = 1.0
    student_softcap: float | None = None
    teacher_logit_scale: float = 1.0
    teacher_softcap: float | None = None


# ---------------------------------------------------------------- torch path


def _log_probs(x: Tensor, scale: float, softcap, temperature: float, dtype: torch.dtype):
    """(z, log softmax(z), dz/dx) of a block x [n, V] in `dtype`; dz/dx is a number, or [n, V] with a
    softcap."""
    z = x.to(dtype, copy=True)
    if scale != 1.0:
        z.mul_(scale)
    dz = scale / temperature
    if softcap is not None:
        th = z.div_(softcap).tanh_()
        dz = (1.0 - th * th).mul_(dz)
        z = th.mul_(softcap)
    if temperature != 1.0:
        z.div_(temperature)
    return z, torch.log_softmax(z, dim=-1), dz


def _plogq(p: Tensor, ratio: Tensor) -> Tensor:
    """sum_j p_j ratio_j with 0 log 0 = 0; `ratio` is overwritten (0 where p = 0)."""
    return (p * ratio.masked_fill_(p == 0, 0.0)).sum(-1)


def _block_torch(xs: Tensor, xt: Tensor, w: Tensor, spec: DistillSpec, dtype: torch.dtype, grad):
    """(D, entropy) [n] of one block of rows xs, xt [n, V]; with `grad` [n, V], d(sum_rows w D) / d(xs)
    is written into it (it may be xs itself). Rows of w = 0 give 0, whatever their logits hold."""
    beta = spec.beta
    zs, ls, dz = _log_probs(xs, spec.student_logit_scale, spec.student_softcap, spec.temperature, dtype)
    zt, lt, _ = _log_probs(xt, spec.teacher_logit_scale, spec.teacher_softcap, spec.temperature, dtype)
    ps = ls.exp()
    ent = -_plogq(ps, ls.clone())
    if beta == 0.0:  # D = sum t (lt - ls), dD/dz = s - t
        pt = lt.exp()
        div = _plogq(pt, lt - ls)
        g = ps.sub_(pt) if grad is not None else None
    elif beta == 1.0:  # D = sum s (ls - lt), dD/dz = s (ls - lt - D) = s (d - sum s d), d = zs - zt
        div = _plogq(ps, ls.sub_(lt))
        if grad is not None:  # from the logits' difference: the normalisers cancel exactly, not in rounding
            d = zs.sub_(zt).masked_fill_(ps == 0, 0.0)  # 0 log 0 = 0: no -inf - -inf
            g = d.sub_(_plogq(ps, d.clone()).unsqueeze(1)).mul_(ps)
    else:  # K_s = sum s (ls - lm), K_t = sum t (lt - lm), D = beta K_t + (1 - beta) K_s
        lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
        pt = lt.exp()
        k_t = _plogq(pt, lt.sub_(lm))
        r = ls.sub_(lm)
        k_s = _plogq(ps, r)
        div = beta * k_t + (1.0 - beta) * k_s
        g = r.sub_(k_s.unsqueeze(1)).mul_(ps).mul_(1.0 - beta) if grad is not None else None
    keep = w != 0
    if grad is not None:  # w dD/dz dz/dx, exactly 0 on rows of w = 0
        g.mul_(dz).mul_(w.to(dtype).unsqueeze(1)).masked_fill_(~keep.unsqueeze(1), 0.0)
        grad.copy_(g)
    zero = div.new_zeros(())
    return torch.where(keep, div, zero), torch.where(keep, ent, zero)


def _row_blocks(tensors: list[Tensor], rows: int):
    """(flat start, flat end, [block [n, V] of each tensor]) over [B, T, V] views of one shape, in
    blocks of <= rows rows; a block spans sequences only where every tensor merges B and T."""
    B, T, V = tensors[0].shape
    flats = []
    for x in tensors:
        try:
            flats.append(x.view(B * T, V))
        except RuntimeError:  # e.g. logits[:, :-1]: one span per sequence, still no copy
            flats = None
            break
    if flats is not None:
        for s in range(0, B * T, rows):
            e = min(s + rows, B * T)
            yield s, e, [f[s:e] for f in flats]
        return
    for b in range(B):
        for s in range(0, T, rows):
            e = min(s + rows, T)
            yield b * T + s, b * T + e, [x[b, s:e] for x in tensors]


def _rows_torch(student: Tensor, teacher: Tensor, w: Tensor, grad, spec: DistillSpec):
    """`kernels.distill.distill_fwd` on the torch path, in blocks of rows that stay near the L2 caches
    (BLOCK_BYTES_PER_THREAD of float work per thread, as ops.logprobs): no [N, V] temporary."""
    B, T, V = student.shape
    dtype = torch.promote_types(out_dtype(student), out_dtype(teacher))
    div = torch.empty(B * T, dtype=dtype, device=student.device)
    ent = torch.empty_like(div)
    rows = max(BLOCK_BYTES_PER_THREAD * torch.get_num_threads() // (V * torch.finfo(dtype).bits // 8), 1)
    tensors = [student, teacher] + ([grad] if grad is not None else [])
    for s, e, blocks in _row_blocks(tensors, rows):
        div[s:e], ent[s:e] = _block_torch(blocks[0], blocks[1], w[s:e], spec, dtype,
                                          blocks[2] if grad is not None else None)
    return div, ent


def distill_rows(student: Tensor, teacher: Tensor, w: Tensor, grad, spec: DistillSpec, triton: bool):
    """(D, entropy) [B * T] of [B, T, V] logits views (stride(-1) == 1) and rows' loss weights w [B * T];
    with `grad` [B, T, V] (which may be `student`), d(sum w D) / d(student) is written into it."""
    if not triton:
        return _rows_torch(student, teacher, w, grad, spec)
    from fastrlhf.kernels import distill as kernels

    return kernels.distill_fwd(student, teacher, w.float(), grad, beta=spec.beta, temperature=spec.temperature,
                               student_scale=spec.student_logit_scale, student_softcap=spec.student_softcap,
                               teacher_scale=spec.teacher_logit_scale, teacher_softcap=spec.teacher_softcap)


# ---------------------------------------------------------------- chunks of logits


@functools.cache
def _mm_writes_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.mm(a, b, out_dtype=torch.float32)` runs here for `dtype` a, b (CUDA, torch >= 2.8:
    the half-precision GEMM writes fp32); probed once per device and dtype on a 2 x 2 case."""
    if device.type != "cuda":
        return False
    a = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        return bool((torch.mm(a, a, out_dtype=torch.float32) == 2).all())
    except (RuntimeError, TypeError):
        return False


def _logits_in(h: Tensor, weight: Tensor, bias, dtype: torch.dtype) -> Tensor:
    """[n, V] logits of one chunk in `dtype`: in the inputs' dtype, ops.linear's chunk_logits; in float32
    from half-precision inputs, the GEMM's fp32 output on CUDA, else an fp32 matmul of fp32 copies (as TRL's
    and Liger's projections: no rounding of the logits to the inputs' dtype)."""
    if dtype == h.dtype:
        return chunk_logits(h, weight, bias)
    if _mm_writes_fp32(h.device, h.dtype) and dtype == torch.float32:
        out = torch.mm(h, weight.T, out_dtype=torch.float32)
    else:
        out = h.to(dtype) @ weight.to(dtype).T
    return out if bias is None else out.add_(bias.to(dtype))


# ---------------------------------------------------------------- the call path: eager bypass, custom op under compile


def _plain(args) -> bool:
    """No fake, functional or subclass tensor among `args`: the eager call may skip the dispatcher."""
    return all(type(a) in (Tensor, torch.nn.Parameter) for a in args if isinstance(a, Tensor))


def _entry(op, body):
    """`body` in eager mode; the registered custom op `op` under torch.compile and for fake, functional
    or subclass tensors (opcheck, FakeTensorMode), so compile sees one opaque node with its fake impl.
    (Local until the shared helper of issue 23 lands.)"""
    overload = op._opoverload

    def call(*args):
        if torch.compiler.is_compiling() or not _plain(args):
            return overload(*args)
        return body(*args)

    return call


def _distill_body(student_logits: Tensor, teacher_logits: Tensor, w: Tensor, beta: float, temperature: float,
                  student_scale: float, student_softcap: float | None, teacher_scale: float,
                  teacher_softcap: float | None, need_grad: bool, use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(loss [], entropy [N], d(student_logits) of its shape, or [0] without need_grad); w [N] = the
    rows' loss weights, N = student_logits.shape[:-1].numel()."""
    spec = DistillSpec(beta, temperature, student_scale, student_softcap, teacher_scale, teacher_softcap)
    x, y = as_3d(student_logits), as_3d(teacher_logits)
    grad = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_grad else None
    div, ent = distill_rows(x, y, w, grad, spec, use_triton)
    dtype = torch.promote_types(out_dtype(student_logits), out_dtype(teacher_logits))
    loss = (div * w.to(div.dtype)).sum().to(dtype)
    return loss, ent.to(dtype), grad.view(student_logits.shape) if need_grad else x.new_empty(0)


@torch.library.custom_op("fastrlhf::distill_loss", mutates_args=())
def _distill_op(student_logits: Tensor, teacher_logits: Tensor, w: Tensor, beta: float, temperature: float,
                student_scale: float, student_softcap: float | None, teacher_scale: float,
                teacher_softcap: float | None, need_grad: bool, use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _distill_body(student_logits, teacher_logits, w, beta, temperature, student_scale, student_softcap,
                         teacher_scale, teacher_softcap, need_grad, use_triton)


@_distill_op.register_fake
def _(student_logits, teacher_logits, w, beta, temperature, student_scale, student_softcap, teacher_scale,
      teacher_softcap, need_grad, use_triton):
    dtype = torch.promote_types(out_dtype(student_logits), out_dtype(teacher_logits))
    return (student_logits.new_empty((), dtype=dtype), student_logits.new_empty(w.shape, dtype=dtype),
            student_logits.new_empty(student_logits.shape if need_grad else (0,)))


def _linear_body(student_hidden: Tensor, student_weight: Tensor, student_bias: Tensor | None, teacher_hidden: Tensor,
                 teacher_weight: Tensor, teacher_bias: Tensor | None, w: Tensor, beta: float, temperature: float,
                 student_scale: float, student_softcap: float | None, teacher_scale: float,
                 teacher_softcap: float | None, chunk_size: int, accum_dtype: torch.dtype | None,
                 logits_dtype: torch.dtype | None, need_hidden: bool, need_weight: bool, need_bias: bool,
                 use_triton: bool) -> tuple[Tensor, ...]:
    """hidden [N, H_s] / [N, H_t], weights [V, H], biases [V], w [N] -> (loss [], entropy [N], d_hidden,
    d_weight, d_bias of the student, each [0] unless asked for). One chunk of each model's logits at a
    time, in logits_dtype (None: each model's own); d(student logits) is written over the student's
    chunk when that is in the student's dtype (module docstring), else into a chunk of its own."""
    spec = DistillSpec(beta, temperature, student_scale, student_softcap, teacher_scale, teacher_softcap)
    N = student_hidden.shape[0]
    acc = weight_accum_dtype(student_weight, accum_dtype)
    need_bias = need_bias and student_bias is not None
    need_grad = need_hidden or need_weight or need_bias
    # by default d(weight) accumulates in fp32: V x H x 4 bytes, held through the forward
    d_hidden = torch.empty_like(student_hidden) if need_hidden else None
    d_weight = torch.zeros(student_weight.shape, dtype=acc, device=student_weight.device) if need_weight else None
    d_bias = torch.zeros(student_bias.shape, dtype=acc, device=student_bias.device) if need_bias else None
    dtype = torch.promote_types(out_dtype(student_hidden), out_dtype(teacher_hidden))
    div = torch.empty(N, dtype=torch.float32 if use_triton else dtype, device=student_hidden.device)
    ent = torch.empty_like(div)
    s_dtype, t_dtype = logits_dtype or student_hidden.dtype, logits_dtype or teacher_hidden.dtype
    in_place = s_dtype == student_hidden.dtype
    for start in range(0, N, chunk_size):
        s = slice(start, min(start + chunk_size, N))
        h = student_hidden[s]
        logits = _logits_in(h, student_weight, student_bias, s_dtype).unsqueeze(0)  # matmul 1
        teacher = _logits_in(teacher_hidden[s], teacher_weight, teacher_bias, t_dtype).unsqueeze(0)  # matmul 2
        grad = None
        if need_grad:
            grad = logits if in_place else torch.empty(logits.shape, dtype=h.dtype, device=h.device)
        div[s], ent[s] = distill_rows(logits, teacher, w[s], grad, spec, use_triton)
        del teacher, logits
        if need_grad:
            _add_chunk_gradients(grad[0], h, student_weight, s, d_hidden, d_weight, d_bias)  # matmuls 3 and 4
        del grad  # one chunk of each model's logits at a time
    loss = (div * w.to(div.dtype)).sum().to(dtype)
    return (loss, ent.to(dtype), _or_empty(d_hidden, student_hidden),
            _or_empty(None if d_weight is None else d_weight.to(student_weight.dtype), student_weight),
            _or_empty(None if d_bias is None else d_bias.to(student_bias.dtype), student_weight))


@torch.library.custom_op("fastrlhf::linear_distill_loss", mutates_args=())
def _linear_op(student_hidden: Tensor, student_weight: Tensor, student_bias: Tensor | None, teacher_hidden: Tensor,
               teacher_weight: Tensor, teacher_bias: Tensor | None, w: Tensor, beta: float, temperature: float,
               student_scale: float, student_softcap: float | None, teacher_scale: float,
               teacher_softcap: float | None, chunk_size: int, accum_dtype: torch.dtype | None,
               logits_dtype: torch.dtype | None, need_hidden: bool, need_weight: bool, need_bias: bool,
               use_triton: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _linear_body(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                        w, beta, temperature, student_scale, student_softcap, teacher_scale, teacher_softcap,
                        chunk_size, accum_dtype, logits_dtype, need_hidden, need_weight, need_bias, use_triton)


@_linear_op.register_fake
def _(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, w, beta, temperature,
      student_scale, student_softcap, teacher_scale, teacher_softcap, chunk_size, accum_dtype, logits_dtype,
      need_hidden, need_weight, need_bias, use_triton):
    dtype = torch.promote_types(out_dtype(student_hidden), out_dtype(teacher_hidden))
    need_bias = need_bias and student_bias is not None
    return (student_hidden.new_empty((), dtype=dtype), student_hidden.new_empty(w.shape, dtype=dtype),
            student_hidden.new_empty(student_hidden.shape if need_hidden else (0,)),
            student_weight.new_empty(student_weight.shape if need_weight else (0,)),
            student_weight.new_empty(student_bias.shape if need_bias else (0,)))


_distill_entry = _entry(_distill_op, _distill_body)
_linear_entry = _entry(_linear_op, _linear_body)


# ---------------------------------------------------------------- autograd


def _scaled_once(ctx, grad_loss, n_inputs: int, n_grads: int):
    """The gradients the forward formed, scaled in place by the upstream scalar, once."""
    if ctx.used:
        raise RuntimeError("distillation loss: backward through one loss twice is not supported; its gradients "
                           "are formed in the forward and handed over, scaled in place, once")
    ctx.used = True
    grads = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * n_inputs
    scaled = tuple(g.mul_(grad_loss) if need else None for g, need in zip(grads, ctx.needs))
    return scaled + (None,) * (n_inputs - n_grads)


class _DistillLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_logits, teacher_logits, w, spec: DistillSpec, triton: bool):
        need = ctx.needs_input_grad[0]
        loss, ent, grad = _distill_entry(student_logits, teacher_logits, w, *spec, need, triton)
        ctx.mark_non_differentiable(ent)
        ctx.save_for_backward(grad)
        ctx.needs, ctx.used = (need,), False
        return loss, ent

    @staticmethod
    def backward(ctx, grad_loss, _grad_entropy):
        return _scaled_once(ctx, grad_loss, 5, 1)


class _LinearDistillLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, w,
                spec: DistillSpec, chunk_size: int, accum_dtype, logits_dtype, triton: bool):
        needs = tuple(ctx.needs_input_grad[:3])
        loss, ent, *grads = _linear_entry(student_hidden, student_weight, student_bias, teacher_hidden,
                                          teacher_weight, teacher_bias, w, *spec, chunk_size, accum_dtype,
                                          logits_dtype, *needs, triton)
        ctx.mark_non_differentiable(ent)
        ctx.save_for_backward(*grads)
        ctx.needs, ctx.used = needs, False
        return loss, ent

    @staticmethod
    def backward(ctx, grad_loss, _grad_entropy):
        return _scaled_once(ctx, grad_loss, 12, 3)


# ---------------------------------------------------------------- checks and public functions


def _check_spec(beta, temperature, student_logit_scale, teacher_logit_scale, student_softcap,
                teacher_softcap) -> DistillSpec:
    beta = check_number("beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL, between: generalized JSD), "
                         f"got {beta}")
    caps = [None if c is None else check_number(name, c, positive=True)
            for name, c in (("student_softcap", student_softcap), ("teacher_softcap", teacher_softcap))]
    return DistillSpec(beta, check_number("temperature", temperature, positive=True),
                       check_number("student_logit_scale", student_logit_scale), caps[0],
                       check_number("teacher_logit_scale", teacher_logit_scale), caps[1])


def _row_weights(mask: Tensor, global_num_tokens, dtype: torch.dtype) -> Tensor:
    """w [N] = m / (global_num_tokens or sum(m)): the loss is sum_rows w D (0 for an empty mask)."""
    m = mask.detach().reshape(-1).to(dtype)
    if global_num_tokens is None:
        return m * safe_inverse(m.sum())
    if isinstance(global_num_tokens, Tensor):  # e.g. TRL's num_items_in_batch: read on the device, no sync
        if global_num_tokens.numel() != 1:
            raise ValueError(f"global_num_tokens must be a number or a one-element tensor, got shape "
                             f"{tuple(global_num_tokens.shape)}")
        return m / global_num_tokens.detach().reshape(()).to(device=m.device, dtype=dtype)
    return m / check_number("global_num_tokens", global_num_tokens, positive=True)


def _stats(ent: Tensor, mask: Tensor) -> dict:
    m = mask.detach().reshape(-1).to(ent.dtype)
    return {"entropy": (ent * m).sum() * safe_inverse(m.sum())}


def distill_loss(student_logits, teacher_logits, mask, *, beta, temperature=1.0, student_logit_scale=1.0,
                 teacher_logit_scale=1.0, student_softcap=None, teacher_softcap=None, global_num_tokens=None):
    """Divergence of the student's next-token distribution from the teacher's, averaged over the
    mask's tokens (reference.distill_loss; TRL's `_chunked_divergence_loss` on materialised logits).

    Args:
        student_logits: [..., V] bf16/fp16/fp32/fp64, any strides but the vocab one.
        teacher_logits: [..., V] of the same shape (any float dtype); a constant: no gradient.
        mask: student_logits.shape[:-1], bool or float (a float mask weighs tokens). What lies under
            mask = 0 never matters, NaN logits included.
        beta: in [0, 1]: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), between
            the generalized JSD with mixture (1 - beta) student + beta teacher (TRL's and Liger's beta).
        temperature: > 0, applied to both models after scale and softcap (TRL's order).
        student_logit_scale, teacher_logit_scale: multipliers of each model's logits (Cohere's logit_scale).
        student_softcap, teacher_softcap: None or c > 0: c tanh(logits / c) after the scale (Gemma's
            final_logit_softcapping).
        global_num_tokens: the divisor, e.g. the token count over ranks and micro-batches (TRL's
            num_items_in_batch; a number or a one-element tensor); None: sum(mask).

    Returns:
        (loss, stats): loss float32 (float64 for float64 logits), sum(D mask) / (global_num_tokens or
        sum(mask)), 0 for an empty mask; stats {"entropy": the student's mask-weighted mean entropy}
        (detached). The forward forms d(student_logits) (one [..., V] buffer in its dtype until the
        backward), so the loss supports one backward.
    """
    check_float("student_logits", student_logits)
    check_float("teacher_logits", teacher_logits)
    if student_logits.dim() < 1 or student_logits.shape[-1] == 0:
        raise ValueError(f"student_logits must be [..., V] with V >= 1, got shape {tuple(student_logits.shape)}")
    if tuple(teacher_logits.shape) != tuple(student_logits.shape):
        raise ValueError(f"teacher_logits must have the shape of student_logits {tuple(student_logits.shape)} "
                         f"(the same vocabulary), got {tuple(teacher_logits.shape)}")
    check_device("teacher_logits", teacher_logits, "student_logits", student_logits)
    check_mask(mask, student_logits[..., 0], "student_logits.shape[:-1]")
    spec = _check_spec(beta, temperature, student_logit_scale, teacher_logit_scale, student_softcap, teacher_softcap)
    dtype = torch.promote_types(out_dtype(student_logits), out_dtype(teacher_logits))
    w = _row_weights(mask, global_num_tokens, dtype)
    loss, ent = _DistillLoss.apply(student_logits, teacher_logits.detach(), w, spec, use_triton(student_logits))
    return loss, _stats(ent, mask)


def _check_linear(prefix: str, hidden, weight, bias) -> None:
    check_float(f"{prefix}_hidden", hidden)
    check_float(f"{prefix}_weight", weight)
    if hidden.dim() < 1:
        raise ValueError(f"{prefix}_hidden must be [N, H] or [..., H], got a 0-dim tensor")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"{prefix}_weight must be [V, H] with V >= 1 and H = {prefix}_hidden.shape[-1] = "
                         f"{hidden.shape[-1]}, got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{prefix}_weight must have {prefix}_hidden's dtype {hidden.dtype}, got {weight.dtype}")
    check_device(f"{prefix}_weight", weight, f"{prefix}_hidden", hidden)
    if bias is not None:
        check_float(f"{prefix}_bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{prefix}_bias must be [V] = ({weight.shape[0]},), got shape {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"{prefix}_bias must have {prefix}_hidden's dtype {hidden.dtype}, got {bias.dtype}")
        check_device(f"{prefix}_bias", bias, f"{prefix}_hidden", hidden)


def _rows_of(hidden: Tensor) -> Tensor:
    """hidden [..., H] as [N, H] with a unit last stride."""
    h = hidden.reshape(-1, hidden.shape[-1])
    return h if h.stride(-1) == 1 else h.contiguous()


def linear_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, mask, *, beta,
                        temperature=1.0, student_bias=None, teacher_bias=None, student_logit_scale=1.0,
                        teacher_logit_scale=1.0, student_softcap=None, teacher_softcap=None, global_num_tokens=None,
                        chunk_size=None, accum_dtype=None, logits_dtype=None):
    """`distill_loss(student_hidden @ student_weight.T + student_bias, teacher_hidden @ teacher_weight.T
    + teacher_bias, mask, ...)` without ever holding [N, V] logits of either model: TRL's
    `_chunked_divergence_loss`, in four matmuls per chunk of tokens (module docstring).

    Args:
        student_hidden: [..., H_s] bf16/fp16/fp32/fp64; student_weight [V, H_s] (the lm_head) and
            student_bias [V] or None, in its dtype.
        teacher_hidden: [..., H_t] with the student's leading shape (H_t may differ from H_s);
            teacher_weight [V, H_t] (the same V), teacher_bias [V] or None, in its own dtype (may differ
            from the student's). Constants: no gradient.
        mask: student_hidden.shape[:-1]; beta, temperature, logit scales, softcaps, global_num_tokens:
            as `distill_loss`.
        chunk_size: rows of each model's logits that exist at a time (None: as ops.linear, from a 640 MiB
            budget per model's chunk on CUDA, 64 MiB on CPU, in balanced chunks).
        accum_dtype: what d(student_weight) accumulates in over the chunks (None: fp32, V x H x 4 bytes;
            e.g. the weight's dtype: no extra buffer, one rounding per chunk).
        logits_dtype: the dtype of both models' chunks of logits: None, each model's own (d(student
            logits) is written over its chunk); torch.float32 from half-precision models, the logits
            unrounded, as TRL's and Liger's projections make them (on CUDA the GEMM writes fp32), at twice
            the chunk memory and kernel traffic plus a chunk for d(student logits).

    Returns:
        (loss, stats) as `distill_loss`; gradients flow to student_hidden, student_weight and
        student_bias. The forward forms them (kept until the backward: N x H_s + V x H_s in the
        student's dtype), so the loss supports one backward.
    """
    _check_linear("student", student_hidden, student_weight, student_bias)
    _check_linear("teacher", teacher_hidden, teacher_weight, teacher_bias)
    if tuple(teacher_hidden.shape[:-1]) != tuple(student_hidden.shape[:-1]):
        raise ValueError(f"teacher_hidden must have student_hidden's leading shape {tuple(student_hidden.shape[:-1])},"
                         f" got {tuple(teacher_hidden.shape[:-1])}")
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(f"teacher_weight must have the student's vocabulary V = {student_weight.shape[0]} rows "
                         f"(the models must share a vocabulary), got {teacher_weight.shape[0]}")
    check_device("teacher_hidden", teacher_hidden, "student_hidden", student_hidden)
    check_mask(mask, student_hidden[..., 0], "student_hidden.shape[:-1]")
    spec = _check_spec(beta, temperature, student_logit_scale, teacher_logit_scale, student_softcap, teacher_softcap)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    weight_accum_dtype(student_weight, accum_dtype)
    if logits_dtype is not None and (not isinstance(logits_dtype, torch.dtype) or not logits_dtype.is_floating_point):
        raise TypeError(f"logits_dtype must be None or a floating-point torch.dtype, got {logits_dtype!r}")
    hs, ht = _rows_of(student_hidden), _rows_of(teacher_hidden.detach())
    if chunk_size is None:  # each model's chunk of logits gets the budget of one
        sizes = [x.element_size() for x in (student_hidden, teacher_hidden)]
        element = max(sizes) if logits_dtype is None else logits_dtype.itemsize
        chunk_size = auto_chunk_size(hs.shape[0], student_weight.shape[0], element, student_hidden.is_cuda)
    dtype = torch.promote_types(out_dtype(student_hidden), out_dtype(teacher_hidden))
    w = _row_weights(mask, global_num_tokens, dtype)
    tb = None if teacher_bias is None else teacher_bias.detach()
    loss, ent = _LinearDistillLoss.apply(hs, student_weight, student_bias, ht, teacher_weight.detach(), tb, w, spec,
                                         int(chunk_size), accum_dtype, logits_dtype, use_triton(student_hidden))
    return loss, _stats(ent, mask)


# ---------------------------------------------------------------- a teacher's top-K support


def _support(lp: Tensor, tail_bucket: bool) -> Tensor:
    """Log-probs [..., K] (-inf off the support) as a distribution: with the tail bucket, one more element,
    the mass left out, log(1 - sum exp) with sum exp <= exp(-1e-7) (TRL's `_add_tail_bucket`); else
    renormalised over the support."""
    total = torch.logsumexp(lp, -1, keepdim=True)
    if tail_bucket:
        return torch.cat([lp, torch.log(-torch.expm1(total.clamp(max=-1e-7)))], -1)
    return lp - total


def _kl_terms(p: Tensor, log_p: Tensor, log_q: Tensor) -> Tensor:
    """sum p (log p - log q) over the last dim, 0 where p = 0."""
    return (p * torch.where(p > 0, log_p - log_q, 0.0)).sum(-1)


def topk_distill_loss(student_logits, teacher_ids, teacher_logprobs, mask, *, beta, temperature=1.0,
                      candidate_mask=None, tail_bucket=True, global_num_tokens=None):
    """Divergence of the student from a teacher known by its top-K candidates per position (a teacher
    served elsewhere; TRL 1.16's async distillation, reference.topk_distill_loss).

    Args:
        student_logits: [..., V] bf16/fp16/fp32/fp64.
        teacher_ids: [..., K] integer candidate ids (negative: padding); teacher_logprobs [..., K] the
            teacher's log-probs of them (constants).
        mask: student_logits.shape[:-1]; beta, temperature (the student's), global_num_tokens: as `distill_loss`.
        candidate_mask: [..., K] bool, the real candidates (default teacher_ids >= 0).
        tail_bucket: True: each distribution gets a (K + 1)-th element, the mass outside the candidates
            (TRL's add_tail_bucket); False: both renormalised over the candidates.

    Returns:
        (loss, stats) as `distill_loss` (stats: the student's full-vocabulary entropy); the gradient flows
        to student_logits through the fused log-probs (any number of backwards).
    """
    check_float("student_logits", student_logits)
    check_int("teacher_ids", teacher_ids)
    check_float("teacher_logprobs", teacher_logprobs)
    lead = tuple(student_logits.shape[:-1])
    if teacher_ids.dim() != student_logits.dim() or tuple(teacher_ids.shape[:-1]) != lead or teacher_ids.shape[-1] < 1:
        raise ValueError(f"teacher_ids must have shape student_logits.shape[:-1] + (K,) = {lead + ('K',)} with K >= 1, "
                         f"got {tuple(teacher_ids.shape)}")
    if tuple(teacher_logprobs.shape) != tuple(teacher_ids.shape):
        raise ValueError(f"teacher_logprobs must have teacher_ids' shape {tuple(teacher_ids.shape)}, got "
                         f"{tuple(teacher_logprobs.shape)}")
    valid = teacher_ids >= 0
    if candidate_mask is not None:
        check_mask(candidate_mask, teacher_ids, "teacher_ids")
        valid = candidate_mask.bool()
    for name, t in (("teacher_ids", teacher_ids), ("teacher_logprobs", teacher_logprobs)):
        check_device(name, t, "student_logits", student_logits)
    check_mask(mask, student_logits[..., 0], "student_logits.shape[:-1]")
    spec = _check_spec(beta, temperature, 1.0, 1.0, None, None)
    logp, entropy = logprobs(student_logits, torch.where(valid, teacher_ids, 0), temperature=spec.temperature,
                             return_entropy=True)
    ls = _support(torch.where(valid, logp, float("-inf")), tail_bucket)
    lt = _support(torch.where(valid, teacher_logprobs.detach().to(logp.dtype), float("-inf")), tail_bucket)
    ps, pt = ls.exp(), lt.exp()
    if spec.beta == 0.0:
        div = _kl_terms(pt, lt, ls)
    elif spec.beta == 1.0:
        div = _kl_terms(ps, ls, lt)
    else:
        lm = torch.logaddexp(ls.clamp(min=LOG_MIX_FLOOR) + math.log1p(-spec.beta),
                             lt.clamp(min=LOG_MIX_FLOOR) + math.log(spec.beta))  # autograd through it: no NaN
        div = spec.beta * _kl_terms(pt, lt, lm) + (1.0 - spec.beta) * _kl_terms(ps, ls, lm)
    w = _row_weights(mask, global_num_tokens, div.dtype)
    loss = torch.where(w != 0, div.reshape(-1) * w, 0.0).sum()
    return loss, _stats(entropy.detach().reshape(-1), mask)
