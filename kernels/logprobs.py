"""Per-token log-probs and entropy of softmax(logits / temperature), and d(logits).

    z = logits / temperature,  lse = logsumexp(z),  log p = z - lse
    logp[row] = z[label] - lse            (0 where label == ignore_index, NaN where label is outside [0, V))
    entropy   = -sum_j p_j log p_j = log d - s / d,  d = sum_j exp(z_j - m),  s = sum_j exp(z_j - m) (z_j - m)
    d(logits) = (g_logp (onehot(label) - p) - g_ent p (log p + entropy)) / temperature

Where it is fast: one program per row (B*T rows on grid axis 0, never more than 2^31 - 1),
the vocabulary streamed in BLOCK_V tiles with an online softmax, so the forward reads each
logit once and the backward reads each once and writes d(logits) once: memory-bound from
V of a few thousand up to 256k and beyond (the row loop has no upper limit on V).
Where it is not: small V (< ~1k) leaves most lanes of a program idle, and very few rows
(B*T below the number of SMs) cannot fill the GPU; there a plain torch log_softmax is as good.
Logits may be any [B, T, V] view with stride(-1) == 1 (e.g. `logits[:, :-1]`): the row
offset is b * stride_b + t * stride_t in int64, nothing is copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_V = 4096  # vocab tile per loop iteration: 8 KiB of bf16, enough to stream at full bandwidth
# finite start of the running max, so that exp(m - m_new) is never exp(-inf - -inf)
FP32_MIN = tl.constexpr(-3.4028234663852886e38)


# ---------------------------------------------------------------- kernels


@triton.jit
def _logprobs_fwd_kernel(
    # pointers
    logits_ptr,  # [B, T, V] bf16/fp16/fp32, stride(-1) == 1
    labels_ptr,  # [B * T] int64
    logp_ptr,  # [B * T] fp32
    entropy_ptr,  # [B * T] fp32, written only if COMPUTE_ENTROPY
    lse_ptr,  # [B * T] fp32, logsumexp(logits / temperature)
    # shapes
    T,
    V,
    # strides
    stride_b,
    stride_t,
    # meta
    inv_temperature,  # fp32
    ignore_index,
    COMPUTE_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + (row // T) * stride_b + (row % T) * stride_t
    inv_t = tl.cast(inv_temperature, tl.float32)

    # online softmax over the row: running max m, d = sum exp(z - m), s = sum exp(z - m) (z - m)
    m = tl.full((), FP32_MIN, tl.float32)
    d = tl.zeros((), tl.float32)
    s = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new)  # 0 on the padding lanes and on -inf logits
        if COMPUTE_ENTROPY:
            # rebase s from m to m_new: sum e'(z - m_new) = alpha * (s + (m - m_new) d)
            s = alpha * (s + (m - m_new) * d) + tl.sum(e * tl.where(e > 0.0, z - m_new, 0.0), axis=0)
        d = d * alpha + tl.sum(e, axis=0)
        m = m_new

    log_d = tl.log(d)
    lse = m + log_d
    tl.store(lse_ptr + row, lse)
    if COMPUTE_ENTROPY:
        tl.store(entropy_ptr + row, log_d - s / d)

    label = tl.load(labels_ptr + row)
    valid = (label >= 0) & (label < V)
    z_label = tl.load(row_ptr + tl.where(valid, label, 0), mask=valid, other=0.0).to(tl.float32) * inv_t
    logp = tl.where(valid, z_label - lse, float("nan"))
    logp = tl.where(label == ignore_index, 0.0, logp)
    tl.store(logp_ptr + row, logp)


@triton.jit
def _logprobs_bwd_kernel(
    # pointers
    logits_ptr,  # [B, T, V] bf16/fp16/fp32, stride(-1) == 1
    labels_ptr,  # [B * T] int64
    lse_ptr,  # [B * T] fp32
    entropy_ptr,  # [B * T] fp32, read only if HAS_GRAD_ENTROPY
    grad_logp_ptr,  # [B * T] fp32, read only if HAS_GRAD_LOGP
    grad_entropy_ptr,  # [B * T] fp32, read only if HAS_GRAD_ENTROPY
    dlogits_ptr,  # [B, T, V] logits dtype; may alias logits_ptr (in-place, same strides)
    # shapes
    T,
    V,
    # strides
    stride_b,
    stride_t,
    dstride_b,
    dstride_t,
    # meta
    inv_temperature,  # fp32
    ignore_index,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    ONE_HOT: tl.constexpr,  # add g_logp at the label; False: the caller adds the one-hot part (K labels per row)
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    row_ptr = logits_ptr + b * stride_b + t * stride_t
    drow_ptr = dlogits_ptr + b * dstride_b + t * dstride_t
    inv_t = tl.cast(inv_temperature, tl.float32)

    lse = tl.load(lse_ptr + row)
    label = tl.load(labels_ptr + row)
    # ignored and out-of-range labels have no log-prob, hence no gradient through it
    takes_grad = (label >= 0) & (label < V) & (label != ignore_index)
    g_logp = tl.zeros((), tl.float32)
    if HAS_GRAD_LOGP:
        g_logp = tl.load(grad_logp_ptr + row)
        if ONE_HOT:
            g_logp = tl.where(takes_grad, g_logp, 0.0)
    g_ent = tl.zeros((), tl.float32)
    entropy = tl.zeros((), tl.float32)
    if HAS_GRAD_ENTROPY:
        g_ent = tl.load(grad_entropy_ptr + row)
        entropy = tl.load(entropy_ptr + row)

    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        in_row = offs < V
        log_p = tl.load(row_ptr + offs, mask=in_row, other=0.0).to(tl.float32) * inv_t - lse
        p = tl.exp(log_p)
        # d/dz logp = onehot - p
        dz = -g_logp * p
        if ONE_HOT:
            dz += tl.where(offs == label, g_logp, 0.0)
        if HAS_GRAD_ENTROPY:
            # d/dz entropy = -p (log p + entropy); 0 where p == 0 (a -inf logit)
            dz -= tl.where(p > 0.0, g_ent * p * (log_p + entropy), 0.0)
        tl.store(drow_ptr + offs, (dz * inv_t).to(dlogits_ptr.dtype.element_ty), mask=in_row)


# ---------------------------------------------------------------- launchers


def _launch_config(V):
    block_v = min(MAX_BLOCK_V, triton.next_power_of_2(V))
    num_warps = 8 if block_v >= 2048 else 4
    return block_v, num_warps


def _check_row_layout(logits, labels):
    if logits.dim() != 3 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be a [B, T, V] view with stride(-1) == 1, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if labels.shape != logits.shape[:2] or labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64 of shape {tuple(logits.shape[:2])}, got {labels.dtype} "
                         f"{tuple(labels.shape)}")


def logprobs_fwd(logits, labels, *, temperature: float, ignore_index: int, compute_entropy: bool):
    """logits [B, T, V] (any strides on B, T; stride(-1) == 1), labels [B, T] int64.

    Returns fp32 [B, T] (logp, entropy or None, lse) with lse = logsumexp(logits / temperature).
    """
    _check_row_layout(logits, labels)
    B, T, V = logits.shape
    logp = torch.empty((B, T), dtype=torch.float32, device=logits.device)
    lse = torch.empty((B, T), dtype=torch.float32, device=logits.device)
    entropy = torch.empty((B, T), dtype=torch.float32, device=logits.device) if compute_entropy else None
    if B * T == 0:
        return logp, entropy, lse
    block_v, num_warps = _launch_config(V)
    _logprobs_fwd_kernel[(B * T,)](
        logits, labels.contiguous(), logp, entropy if compute_entropy else lse, lse,
        T, V,
        logits.stride(0), logits.stride(1),
        1.0 / float(temperature), int(ignore_index),
        COMPUTE_ENTROPY=compute_entropy, BLOCK_V=block_v, num_warps=num_warps,
    )
    return logp, entropy, lse


def logprobs_bwd(logits, labels, lse, entropy, grad_logp, grad_entropy, *, temperature: float,
                 ignore_index: int, inplace: bool, one_hot: bool = True):
    """d(logits) [B, T, V] in logits.dtype from the saved lse (and entropy) and fp32 [B, T] upstream
    gradients (None = zero). inplace=True writes into the logits' own storage and returns that view.
    one_hot=False leaves out the g_logp * onehot(label) part (the caller adds it: K labels per row)."""
    _check_row_layout(logits, labels)
    if grad_entropy is not None and entropy is None:
        raise ValueError("logprobs_bwd: grad_entropy needs the forward's entropy")
    B, T, V = logits.shape
    dlogits = logits if inplace else torch.empty((B, T, V), dtype=logits.dtype, device=logits.device)
    if B * T == 0:
        return dlogits
    block_v, num_warps = _launch_config(V)
    _logprobs_bwd_kernel[(B * T,)](
        logits, labels.contiguous(), lse.contiguous(),
        entropy.contiguous() if grad_entropy is not None else lse,
        grad_logp.contiguous() if grad_logp is not None else lse,
        grad_entropy.contiguous() if grad_entropy is not None else lse,
        dlogits,
        T, V,
        logits.stride(0), logits.stride(1), dlogits.stride(0), dlogits.stride(1),
        1.0 / float(temperature), int(ignore_index),
        HAS_GRAD_LOGP=grad_logp is not None, HAS_GRAD_ENTROPY=grad_entropy is not None, ONE_HOT=one_hot,
        BLOCK_V=block_v, num_warps=num_warps,
    )
    return dlogits
