"""Per-token log-probs and entropy from logits: `logprobs`, `entropy` (kernels: fastrlhf/kernels/logprobs.py).

    z = logits / temperature,  lse = logsumexp(z),  logp = z[label] - lse,  entropy = -sum_j p_j log p_j
    d(logits) = (g_logp (onehot(label) - p) - g_entropy p (log p + entropy)) / temperature

Custom ops (torch.compile sees one node each):
    fastrlhf::logprobs                   -> (logp, entropy, lse); labels [...] or [..., K]
    fastrlhf::entropy                    -> (entropy, lse)
    fastrlhf::logprobs_backward          -> d(logits)
    fastrlhf::logprobs_backward_inplace  d(logits) written over the logits (mutates them)
`logprobs_fwd` / `logprobs_bwd` below are the ops' bodies on [B, T, V] views, also used by
`ops.losses.ppo_actor_loss` and `ops.linear`: the Triton kernels, or the torch path.

The torch path runs the kernel's algorithm a few rows at a time (blocks of BLOCK_BYTES_PER_THREAD
of float32 work per intra-op thread, near the cores' L2 caches): the forward keeps only lse
(and entropy) per row, the backward recomputes p block by block and writes d(logits) once. No
[N, V] float32 temporary is ever held, and on CPU it is faster than `log_softmax(x).gather(...)`
(docs/ops.md has the measurements).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fastrlhf.constants import IGNORE_INDEX
from fastrlhf.ops._common import (
    check_device,
    check_float,
    check_int,
    check_integer,
    check_number,
    out_dtype,
    use_triton,
)
from fastrlhf.ops._dispatch import register

# float32 (float64) work per block of rows on the torch path, per intra-op thread (a thread's share of a
# block then stays in its core's L2). Measured on a 2-core Xeon (4 MiB L2 per core), fwd + bwd with
# entropy, CPU time on 1 thread, blocks of 1 / 2 / 8 MiB against log_softmax + gather: fp32 [512, 32000]
# 97 / 110 / 113 ms vs 287 ms, bf16 [256, 32000] 33 / 41 / 44 vs 77 ms, bf16 [64, 151936] 35 / 46 / 49 vs
# 218 ms. Each op on a block is a parallel region, and a few large blocks suffer less than many small ones
# where runnable threads outnumber the cores: 2 MiB is the compromise.
BLOCK_BYTES_PER_THREAD = 2 * 2**20
# log p is floored here on the torch path: exp() of anything lower is exactly 0 in fp32 and fp64, so
# 0 * log 0 stays 0 (a -inf logit) and never becomes 0 * -inf = NaN
LOG_P_FLOOR = -1.0e4


# ---------------------------------------------------------------- layout


def as_3d(logits: Tensor) -> Tensor:
    """[B, T, V] view of logits[..., V] without copying (dims 0 and 1 may have any stride,
    e.g. logits[:, :-1]); a non-unit vocab stride forces a copy, and so does a view of 4 or more
    dims whose leading dims cannot be merged into one (e.g. x[:, :-1] of a [A, B, T, V] x)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if logits.dim() == 1:
        return logits.view(1, 1, -1)
    if logits.dim() == 2:
        return logits.unsqueeze(0)
    if logits.dim() == 3:
        return logits
    return logits.flatten(0, -3)


def writable_in_place(logits: Tensor) -> bool:
    """True when d(logits) can be written over the logits' own storage: as_3d views them without a
    copy, and no two positions share memory (an expand). From shapes and strides only (traceable)."""
    if logits.stride(-1) != 1 or any(n > 1 and st == 0 for n, st in zip(logits.shape, logits.stride())):
        return False
    if logits.dim() > 3:
        try:
            logits.view(-1, *logits.shape[-2:])
        except RuntimeError:
            return False
    return True


def _row_blocks(x: Tensor, rows: int):
    """(block [n, V] view, flat start, flat end) covering x [B, T, V] in blocks of <= `rows` rows;
    flat positions index the row-major [B * T] outputs."""
    B, T, V = x.shape
    try:
        spans = [(x.view(B * T, V), 0)]
    except RuntimeError:  # e.g. logits[:, :-1]: one span per sequence, still no copy
        spans = [(x[b], b * T) for b in range(B)]
    for block, base in spans:
        for s in range(0, block.shape[0], rows):
            e = min(s + rows, block.shape[0])
            yield block[s:e], base + s, base + e


def _block_rows(vocab: int, dtype: torch.dtype) -> int:
    block_bytes = BLOCK_BYTES_PER_THREAD * torch.get_num_threads()
    return max(block_bytes // (vocab * torch.finfo(dtype).bits // 8), 1)


# ---------------------------------------------------------------- torch path


def _label_logp(z: Tensor, labels: Tensor, lse: Tensor, ignore_index: int) -> Tensor:
    """z[label] - lse for labels [.., K] of rows z [.., V]: 0 where label == ignore_index, NaN where it
    is outside [0, V)."""
    valid = (labels >= 0) & (labels < z.shape[-1])
    logp = torch.where(valid, z.gather(-1, torch.where(valid, labels, 0)) - lse.unsqueeze(-1), float("nan"))
    return torch.where(labels == ignore_index, 0.0, logp)


def _label_grads(y: Tensor, g_logp: Tensor, vocab: int, ignore_index: int, dtype: torch.dtype):
    """(g [.., K] with 0 where a label takes no gradient, index [.., K] safe to scatter into) for labels
    y [.., K] and their upstream gradient: ignored and out-of-range labels have no log-prob, hence no
    gradient through it."""
    takes_grad = (y >= 0) & (y < vocab) & (y != ignore_index)
    return torch.where(takes_grad, g_logp.reshape(y.shape).to(dtype), 0.0), torch.where(takes_grad, y, 0)


def _work_buffers(x: Tensor, dtype: torch.dtype, rows: int):
    """Two [rows, V] buffers every block reuses: a fresh buffer per step would cost more in page faults
    than the step's arithmetic."""
    shape = (min(rows, x.shape[0] * x.shape[1]), x.shape[2])
    return torch.empty(shape, dtype=dtype, device=x.device), torch.empty(shape, dtype=dtype, device=x.device)


def _load_block(block: Tensor, temperature: float, out: Tensor) -> Tensor:
    """z = block / temperature in out's dtype, written into `out` [n, V]."""
    z = out[: block.shape[0]].copy_(block)
    return z if temperature == 1.0 else z.div_(temperature)


def _forward_torch(x, y, temperature, ignore_index, return_entropy):
    B, T, V = x.shape
    dtype = out_dtype(x)
    index = y.reshape(B * T, y.shape[-1] if y.dim() == 3 else 1)  # not -1: B * T may be 0
    logp = torch.empty(index.shape, dtype=dtype, device=x.device)
    lse = torch.empty(B * T, dtype=dtype, device=x.device)
    entropy = torch.empty_like(lse) if return_entropy else None
    rows = _block_rows(V, dtype)
    buf_z, buf_w = _work_buffers(x, dtype, rows)
    for block, s, e in _row_blocks(x, rows):
        z = _load_block(block, temperature, buf_z)
        # lse = m + log sum exp(z - m), m the row max (0 for an all -inf row: lse = -inf, as logsumexp)
        m = z.amax(-1).nan_to_num_(neginf=0.0).unsqueeze(1)
        w = torch.sub(z, m, out=buf_w[: e - s])
        lse_b = w.exp_().sum(-1).log_().add_(m.squeeze(1))
        lse[s:e] = lse_b
        logp[s:e] = _label_logp(z, index[s:e], lse_b, ignore_index)
        if return_entropy:  # -sum p log p, log p floored so that 0 log 0 stays 0
            log_p = torch.sub(z, lse_b.unsqueeze(1), out=buf_w[: e - s]).clamp_(min=LOG_P_FLOOR)
            entropy[s:e] = -torch.exp(log_p, out=z).mul_(log_p).sum(-1)
    return logp.view(-1), entropy, lse


def _backward_torch(x, y, lse, entropy, g_logp, g_ent, temperature, ignore_index, inplace):
    B, T, V = x.shape
    dtype = lse.dtype
    lse = lse.reshape(-1)
    entropy = None if entropy is None else entropy.reshape(-1)
    out = x if inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_rows = None if inplace else out.view(-1, V)
    g_lp = None
    if g_logp is not None:  # [N, K]: K labels per row (K = 1 but for (..., K) labels)
        g_lp, index = _label_grads(y.reshape(B * T, y.shape[-1] if y.dim() == 3 else 1), g_logp, V, ignore_index,
                                   dtype)
        g_sum = g_lp.sum(-1)
    if g_ent is not None:
        g_ent = g_ent.reshape(-1).to(dtype)
    rows = _block_rows(V, dtype)
    buf_z, buf_p = _work_buffers(x, dtype, rows)
    for block, s, e in _row_blocks(x, rows):
        log_p = _load_block(block, temperature, buf_z).sub_(lse[s:e].unsqueeze(1))
        p = torch.exp(log_p, out=buf_p[: e - s])
        if g_ent is not None:  # dz = -p (sum_k g_k + g_ent (log p + H))
            t = log_p.clamp_(min=LOG_P_FLOOR).add_(entropy[s:e].unsqueeze(1)).mul_(g_ent[s:e].unsqueeze(1))
            if g_lp is not None:
                t.add_(g_sum[s:e].unsqueeze(1))
            dz = t.mul_(p).neg_()
        else:  # dz = -p sum_k g_k
            dz = p.mul_(g_sum[s:e].unsqueeze(1)).neg_()
        if g_lp is not None:  # + sum_k g_k onehot(label_k)
            dz.scatter_add_(1, index[s:e], g_lp[s:e])
        if temperature != 1.0:
            dz.div_(temperature)
        (block if inplace else out_rows[s:e]).copy_(dz)
    return out


# ---------------------------------------------------------------- the ops' bodies: kernel or torch


def logprobs_fwd(x: Tensor, y: Tensor, *, temperature: float, ignore_index: int, return_entropy: bool,
                 use_triton: bool):
    """x [B, T, V] (stride(-1) == 1), y [B, T] or [B, T, K] int64 -> (logp flat [y.numel()], entropy
    flat [B * T] or None, lse flat [B * T]) in out_dtype(x); the kernel's lse in fp64 (`_lse_dtype`)."""
    if not use_triton:
        return _forward_torch(x, y, temperature, ignore_index, return_entropy)
    from fastrlhf.kernels import logprobs as kernels

    per_position = y.dim() == 2
    logp, entropy, lse = kernels.logprobs_fwd(x, (y if per_position else y[..., 0]).contiguous(),
                                              temperature=temperature, ignore_index=ignore_index,
                                              compute_entropy=return_entropy)
    if not per_position:  # K labels per row: the kernel's lse, then a gather of K logits per row
        valid = (y >= 0) & (y < x.shape[-1])
        # as the kernel: y = logits * fp32(log2(e) / T), logp = (y - lse / ln 2) ln 2 in fp64 (exact at the max)
        y_label = x.gather(-1, torch.where(valid, y, 0)).float() * torch.tensor(kernels.LOG2E / temperature)
        logp = (y_label.double() - lse.unsqueeze(-1) * (1 / math.log(2))) * math.log(2)
        logp = torch.where(valid, logp.float(), float("nan"))
        logp = torch.where(y == ignore_index, 0.0, logp)
    dtype = out_dtype(x)
    flat = lambda t: None if t is None else t.reshape(-1).to(dtype)  # noqa: E731
    return flat(logp), flat(entropy), lse.reshape(-1)  # lse in fp64 (see kernels.logprobs_fwd)


def logprobs_bwd(x: Tensor, y: Tensor, lse: Tensor, entropy, g_logp, g_ent, *, temperature: float,
                 ignore_index: int, inplace: bool, use_triton: bool) -> Tensor:
    """d(logits) [B, T, V] in x.dtype from the forward's lse (and entropy, needed with g_ent) and
    upstream gradients (of logp: y's shape, of the entropy: [B, T]; None = 0); inplace=True writes it
    over x and returns x."""
    if not use_triton:
        return _backward_torch(x, y, lse, entropy, g_logp, g_ent, temperature, ignore_index, inplace)
    from fastrlhf.kernels import logprobs as kernels

    B, T, V = x.shape
    rows = lambda t: None if t is None else t.reshape(B, T).float().contiguous()  # noqa: E731
    args = (rows(lse), rows(entropy) if g_ent is not None else None)
    if y.dim() == 2:
        return kernels.logprobs_bwd(x, y.contiguous(), *args, rows(g_logp), rows(g_ent), temperature=temperature,
                                    ignore_index=ignore_index, inplace=inplace)
    # K labels per row: the kernel writes -p (sum_k g_k + g_ent (log p + H)), then the one-hot parts are added
    g, index = (None, None) if g_logp is None else _label_grads(y, g_logp, V, ignore_index, torch.float32)
    d = kernels.logprobs_bwd(x, y[..., 0].contiguous(), *args, None if g is None else g.sum(-1), rows(g_ent),
                             temperature=temperature, ignore_index=ignore_index, inplace=inplace, one_hot=False)
    if g is not None:
        d.scatter_add_(-1, index, (g * (1.0 / temperature)).to(d.dtype))
    return d


def _labels_3d(labels: Tensor, logits: Tensor, x: Tensor) -> Tensor:
    """int64 labels for x = as_3d(logits): [...] -> [B, T]; [..., K] (one more dim) -> [B, T, K]."""
    per_position = labels.dim() == logits.dim() - 1
    return labels.reshape(x.shape[:2] if per_position else (*x.shape[:2], labels.shape[-1])).long()


# ---------------------------------------------------------------- fastrlhf::logprobs


def _logprobs_op(logits: Tensor, labels: Tensor, temperature: float, ignore_index: int, return_entropy: bool,
                 inplace_backward: bool, use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(logp labels.shape, entropy logits.shape[:-1] (shape [0] unless return_entropy), lse
    logits.shape[:-1]); labels [...] or [..., K]."""
    x = as_3d(logits)
    logp, entropy, lse = logprobs_fwd(x, _labels_3d(labels, logits, x), temperature=temperature,
                                      ignore_index=ignore_index, return_entropy=return_entropy, use_triton=use_triton)
    shape = logits.shape[:-1]
    entropy = entropy.view(shape) if return_entropy else logp.new_empty(0)
    return logp.view(labels.shape), entropy, lse.view(shape)


def _lse_dtype(logits: Tensor, use_triton: bool) -> torch.dtype:
    """The kernel keeps lse in fp64 (kernels.logprobs.logprobs_fwd), the torch path in out_dtype."""
    return torch.float64 if use_triton else out_dtype(logits)


def _fake_logprobs(logits, labels, temperature, ignore_index, return_entropy, inplace_backward, use_triton):
    shape, dtype = logits.shape[:-1], out_dtype(logits)
    return (logits.new_empty(labels.shape, dtype=dtype), logits.new_empty(shape if return_entropy else (0,),
            dtype=dtype), logits.new_empty(shape, dtype=_lse_dtype(logits, use_triton)))


def logprobs_backward_op(logits: Tensor, labels: Tensor, lse: Tensor, entropy: Tensor, grad_logp: Tensor | None,
                          grad_entropy: Tensor | None, temperature: float, ignore_index: int,
                          use_triton: bool) -> Tensor:
    """d(logits), contiguous, logits.shape and dtype; a None gradient counts as 0."""
    x = as_3d(logits)
    d = logprobs_bwd(x, _labels_3d(labels, logits, x), lse, entropy, grad_logp, grad_entropy,
                     temperature=temperature, ignore_index=ignore_index, inplace=False, use_triton=use_triton)
    return d.view(logits.shape)


def _fake_logprobs_backward(logits, labels, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index,
                            use_triton):
    return logits.new_empty(logits.shape)


_logprobs_backward = register("logprobs_backward", logprobs_backward_op, _fake_logprobs_backward)


def _logprobs_backward_inplace_op(logits: Tensor, labels: Tensor, lse: Tensor, entropy: Tensor,
                                  grad_logp: Tensor | None, grad_entropy: Tensor | None, temperature: float,
                                  ignore_index: int, use_triton: bool) -> None:
    """d(logits) written over the logits (their version counter is bumped: a node that saved them
    for its own backward then raises instead of reading gradients); logits writable_in_place."""
    x = as_3d(logits)
    logprobs_bwd(x, _labels_3d(labels, logits, x), lse, entropy, grad_logp, grad_entropy,
                 temperature=temperature, ignore_index=ignore_index, inplace=True, use_triton=use_triton)


def _fake_logprobs_backward_inplace(logits, labels, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index,
                                    use_triton):
    return None


_logprobs_backward_inplace = register("logprobs_backward_inplace", _logprobs_backward_inplace_op,
                                      _fake_logprobs_backward_inplace, mutates_args=("logits",))


def _setup_context(ctx, inputs, output):
    logits, labels, temperature, ignore_index, return_entropy, inplace_backward, triton = inputs
    _, entropy, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: less work in the kernel
    ctx.save_for_backward(logits, labels, lse, entropy)
    ctx.args = (temperature, ignore_index, return_entropy, inplace_backward, triton)


def _backward(ctx, grad_logp, grad_entropy, _grad_lse):
    logits, labels, lse, entropy = ctx.saved_tensors
    temperature, ignore_index, return_entropy, inplace_backward, triton = ctx.args
    if not return_entropy:
        grad_entropy = None
    if not ctx.needs_input_grad[0] or (grad_logp is None and grad_entropy is None):
        return (None,) * 7
    args = (logits, labels, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index, triton)
    if inplace_backward and writable_in_place(logits):  # else out of place: same numbers, no saving
        _logprobs_backward_inplace(*args)
        return logits.detach(), None, None, None, None, None, None
    return _logprobs_backward(*args), None, None, None, None, None, None


_logprobs = register("logprobs", _logprobs_op, _fake_logprobs, setup_context=_setup_context, backward=_backward)


def logprobs(logits, labels, *, temperature=1.0, return_entropy=False, ignore_index=IGNORE_INDEX,
             inplace_backward=False):
    """Per-token log softmax(logits / temperature)[labels], optionally with the entropy.

    The contract (formulas, conventions, tolerances, dtypes): docs/ops.md.

    Args:
        logits: [..., V] bf16/fp16/fp32/fp64, any strides but the vocab one (`logits[:, :-1]`
            is read in place, never copied).
        labels: [...] = logits.shape[:-1], or [..., K] (K labels per position, as TRL's
            selective_log_softmax), any integer dtype. `labels == ignore_index` gives logp 0 and
            no gradient; a label outside [0, V) gives NaN.
        temperature: > 0; the softmax is of logits / temperature.
        return_entropy: also return the entropy of softmax(logits / temperature), [...].
        ignore_index: the label value that is ignored (-100, as PyTorch's cross-entropy).
        inplace_backward: the backward writes d(logits) into the logits' own storage and bumps
            their version counter; only when nothing reads the logits after the backward (any
            other node that saved them then raises instead of using wrong values). Logits that
            cannot take it (expanded, a non-unit vocab stride, a 4-d+ view whose leading dims
            do not merge) get an out-of-place backward instead.

    Returns:
        logp of labels' shape, float32 (float64 for float64 logits), and entropy [...] with
        return_entropy. `logits` is never modified, except by the backward with `inplace_backward=True`.
    """
    check_float("logits", logits)
    check_int("labels", labels)
    lead = tuple(logits.shape[:-1])
    per_position = tuple(labels.shape) == lead
    if logits.dim() < 1 or not (per_position or (labels.dim() == logits.dim() and tuple(labels.shape[:-1]) == lead
                                                 and labels.shape[-1] > 0)):
        raise ValueError(f"labels must have shape logits.shape[:-1] = {lead} or {lead + ('K',)} with K >= 1, "
                         f"got {tuple(labels.shape)}")
    check_device("labels", labels, "logits", logits)
    temperature = check_number("temperature", temperature, positive=True)
    ignore_index = check_integer("ignore_index", ignore_index)
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty vocab dimension, got V = 0")
    if labels.numel() == 0:
        zero = logits.sum() * 0
        logp = torch.zeros(labels.shape, dtype=out_dtype(logits), device=logits.device) + zero
        return (logp, torch.zeros(lead, dtype=logp.dtype, device=logits.device) + zero) if return_entropy else logp
    if not per_position and labels.shape[-1] == 1:  # K = 1: the per-position op, bit for bit
        out = logprobs(logits, labels.squeeze(-1), temperature=temperature, return_entropy=return_entropy,
                       ignore_index=ignore_index, inplace_backward=inplace_backward)
        return (out[0].unsqueeze(-1), out[1]) if return_entropy else out.unsqueeze(-1)
    logp, entropy_, _ = _logprobs(logits, labels, temperature, ignore_index, bool(return_entropy),
                                  bool(inplace_backward), use_triton(logits),
                                  grad=torch.is_grad_enabled() and logits.requires_grad)
    return (logp, entropy_) if return_entropy else logp


# ---------------------------------------------------------------- fastrlhf::entropy


def _no_labels(logits: Tensor) -> Tensor:
    """Labels that select nothing (all ignored): the entropy op runs the log-prob bodies without a label."""
    return torch.full(logits.shape[:-1], IGNORE_INDEX, dtype=torch.long, device=logits.device)


def _entropy_op(logits: Tensor, temperature: float, use_triton: bool) -> tuple[Tensor, Tensor]:
    """(entropy, lse), each logits.shape[:-1]: one read of the logits."""
    x = as_3d(logits)
    _, entropy, lse = logprobs_fwd(x, _labels_3d(_no_labels(logits), logits, x), temperature=temperature,
                                   ignore_index=IGNORE_INDEX, return_entropy=True, use_triton=use_triton)
    shape = logits.shape[:-1]
    return entropy.view(shape), lse.view(shape)


def _fake_entropy(logits, temperature, use_triton):
    shape, dtype = logits.shape[:-1], out_dtype(logits)
    return logits.new_empty(shape, dtype=dtype), logits.new_empty(shape, dtype=_lse_dtype(logits, use_triton))


def _setup_entropy(ctx, inputs, output):
    logits, temperature, triton = inputs
    entropy, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, lse, entropy)
    ctx.args = (temperature, triton)


def _backward_entropy(ctx, grad_entropy, _grad_lse):
    logits, lse, entropy = ctx.saved_tensors
    temperature, triton = ctx.args
    if not ctx.needs_input_grad[0]:
        return None, None, None
    d = _logprobs_backward(logits, _no_labels(logits), lse, entropy, None, grad_entropy, temperature, IGNORE_INDEX,
                             triton)
    return d, None, None


_entropy = register("entropy", _entropy_op, _fake_entropy, setup_context=_setup_entropy, backward=_backward_entropy)


def entropy(logits, *, temperature=1.0):
    """Entropy -sum_j p_j log p_j of p = softmax(logits / temperature), per position (docs/ops.md):
    one read of the logits, no label (TRL's / verl's entropy_from_logits, OpenRLHF's compute_entropy).

    Args:
        logits: [..., V] bf16/fp16/fp32/fp64, any strides but the vocab one.
        temperature: > 0.

    Returns:
        entropy [...] float32 (float64 for float64 logits); gradient to logits. 0 log 0 = 0 for
        -inf logits.
    """
    check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    temperature = check_number("temperature", temperature, positive=True)
    if logits.numel() == 0:
        return torch.zeros(logits.shape[:-1], dtype=out_dtype(logits), device=logits.device) + logits.sum() * 0
    return _entropy(logits, temperature, use_triton(logits), grad=torch.is_grad_enabled() and logits.requires_grad)[0]
