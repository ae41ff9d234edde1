"""Teacher-student divergence per token, and d(student logits), for distillation.

Per row (token), with z = softcap tanh(scale x / softcap) / T (without softcap: scale x / T) of each
model's logits x, s = softmax(z_s), t = softmax(z_t) (TRL's DistillationTrainer, GKD, Liger's JSD):

    MODE 0 (beta = 0)   D = KL(t || s) = sum t (log t - log s)           dD/dz_s = s - t
    MODE 1 (beta = 1)   D = KL(s || t) = sum s (log s - log t)           dD/dz_s = s (d - sum s d), d = z_s - z_t
    MODE 2 (else)       m = (1 - beta) s + beta t,  K = KL(s || m)
                        D = beta KL(t || m) + (1 - beta) K               dD/dz_s = (1 - beta) s (log s - log m - K)
    entropy = -sum s log s (the student's; a statistic, no gradient)
    d(student logits) = w dD/dz_s dz_s/dx_s,  dz/dx = scale (1 - tanh^2) / T (without softcap: scale / T)

w is the row's loss weight (mask / token count): the kernel writes d(sum_rows w D). A row with w = 0
is skipped: D = entropy = 0 and a zero gradient row, whatever its logits hold. 0 log 0 = 0: a token
with probability 0 under the weighting distribution adds 0 (where() before the product), one with
mass there and probability 0 under the other model makes the KL infinite, as it is.

Base-2 math as kernels/logprobs.py: a = z * log2(e), so every exponential is an exp2; log-probs in
log2 units l = a - lse2 are turned into nats (x LN2) where a divergence adds them up.

Passes over each row (one program per row, the vocabulary streamed in BLOCK_V tiles):
    1. online softmax statistics of both models (max, sum of 2^(a - max)), the student's entropy,
       and for MODE 0 / 1 the KL itself as an online sum (sum t (a_t - a_s), rescaled like the sum);
    2. MODE 0 / 1: d(student logits), written in place over the student logits when the caller
       passes them as `grad` (the linear op's chunk) or into a separate buffer;
       MODE 2: the two KLs to the mixture, which need both normalisers (log m is not an online sum);
    3. MODE 2 only: d(student logits).
So MODE 0 / 1 read both rows twice and write once, MODE 2 reads them three times. Where it is fast:
V of a few thousand and up (memory-bound, plus the transcendental work of MODE 2's log m in passes 2
and 3); the grid is one program per row (at most 2^31 - 1 rows). Where it is not: small V leaves
most lanes idle. Logits may be any [B, T, V] views with a unit vocab stride; offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # the vocab tile of large rows: 8 KiB of bf16 per model
NUM_WARPS = 8
MODES = {0.0: 0, 1.0: 1}  # beta -> MODE; any other beta in (0, 1) is MODE 2
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
FP32_MIN = tl.constexpr(-3.4028234663852886e38)  # finite start of a running max


# ---------------------------------------------------------------- kernels


@triton.jit
def _tanh(u):
    return 2.0 * tl.sigmoid(2.0 * u) - 1.0


@triton.jit
def _scaled(x, mul, inv_cap, SOFTCAP: tl.constexpr):
    # a = z log2(e) of raw logits x: mul x with mul = scale log2(e) / T; with a softcap c,
    # mul tanh(scale x / c) with mul = c log2(e) / T and inv_cap = scale / c
    if SOFTCAP:
        return mul * _tanh(x * inv_cap)
    return x * mul


@triton.jit
def _tile(row_ptr, k, cols, V, mul, inv_cap, SOFTCAP: tl.constexpr):
    # one tile of a row: (raw logits x, a = z log2(e) with -inf past the row's end, in-bounds mask)
    ok = k + cols < V
    x = tl.load(row_ptr + k + cols, mask=ok, other=0.0).to(tl.float32)
    return x, tl.where(ok, _scaled(x, mul, inv_cap, SOFTCAP), -float("inf")), ok


@triton.jit
def _online(a, m, d):
    # a tile a into the running max m and sum d = sum 2^(a - m): (m', d', 2^(m - m'), 2^(a - m'))
    m_new = tl.maximum(m, tl.max(a, axis=0))
    alpha = tl.exp2(m - m_new)
    e = tl.exp2(a - m_new)
    return m_new, d * alpha + tl.sum(e, axis=0), alpha, e


@triton.jit
def _log_mix(ls, lt, log2_1mb, log2_b):
    # log2 m = log2((1 - beta) 2^ls + beta 2^lt), stable; -inf where both are -inf
    x = ls + log2_1mb
    y = lt + log2_b
    top = tl.maximum(x, y)
    top = tl.where(top == -float("inf"), 0.0, top)
    return top + tl.log2(tl.exp2(x - top) + tl.exp2(y - top))


@triton.jit
def _distill_fwd_kernel(
    # pointers
    s_ptr,  # [B, T, V] student logits bf16/fp16/fp32, stride(-1) == 1
    t_ptr,  # [B, T, V] teacher logits bf16/fp16/fp32, stride(-1) == 1
    grad_ptr,  # [B, T, V] d(student logits), written if NEED_GRAD (may be s_ptr itself: in place)
    w_ptr,  # [B * T] fp32 loss weight of each row (0: masked)
    div_ptr,  # [B * T] fp32 divergence D
    ent_ptr,  # [B * T] fp32 entropy of the student
    # shapes
    T,
    V,
    # strides
    s_stride_b,
    s_stride_t,
    t_stride_b,
    t_stride_t,
    g_stride_b,
    g_stride_t,
    # meta
    s_mul,  # fp32: scale log2(e) / T (softcap log2(e) / T with S_SOFTCAP)
    s_inv_cap,  # fp32: scale / softcap (S_SOFTCAP only)
    s_dz,  # fp32: scale / T
    t_mul,
    t_inv_cap,
    beta,  # fp32
    MODE: tl.constexpr,
    S_SOFTCAP: tl.constexpr,
    T_SOFTCAP: tl.constexpr,
    NEED_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    s_row = s_ptr + b * s_stride_b + t * s_stride_t
    t_row = t_ptr + b * t_stride_b + t * t_stride_t
    g_row = grad_ptr + b * g_stride_b + t * g_stride_t
    cols = tl.arange(0, BLOCK_V)
    w = tl.load(w_ptr + row)
    if w == 0.0:  # a masked row: nothing of it counts, not even NaN logits
        if NEED_GRAD:
            zero = tl.zeros((BLOCK_V,), tl.float32).to(grad_ptr.dtype.element_ty)
            for k in range(0, V, BLOCK_V):
                tl.store(g_row + k + cols, zero, mask=k + cols < V)
        tl.store(div_ptr + row, 0.0)
        tl.store(ent_ptr + row, 0.0)
        return

    # 1. online statistics of both rows: maxima m, sums d = sum 2^(a - m); the student's entropy sum
    #    h = sum 2^(a - m) (a - m), rebased as its max moves; MODE 0 / 1: the KL's expectation
    #    kl = sum 2^(a_p - m_p) (a_p - a_q) under the weighting model p, rescaled as its sum
    m_s = tl.full((), FP32_MIN, tl.float32)
    m_t = tl.full((), FP32_MIN, tl.float32)
    d_s = tl.zeros((), tl.float32)
    d_t = tl.zeros((), tl.float32)
    h = tl.zeros((), tl.float32)
    kl = tl.zeros((), tl.float32)
    for k in range(0, V, BLOCK_V):
        _, a_s, _ = _tile(s_row, k, cols, V, s_mul, s_inv_cap, S_SOFTCAP)
        _, a_t, _ = _tile(t_row, k, cols, V, t_mul, t_inv_cap, T_SOFTCAP)
        m_prev, d_prev = m_s, d_s
        m_s, d_s, alpha_s, e_s = _online(a_s, m_s, d_s)
        # sum e'(a - m') over the old terms = alpha (h + (m - m') d): rebased from m to m'
        h = alpha_s * (h + (m_prev - m_s) * d_prev) + tl.sum(tl.where(e_s > 0, e_s * (a_s - m_s), 0.0), axis=0)
        m_t, d_t, alpha_t, e_t = _online(a_t, m_t, d_t)
        if MODE == 0:
            kl = kl * alpha_t + tl.sum(tl.where(e_t > 0, e_t * (a_t - a_s), 0.0), axis=0)
        elif MODE == 1:
            kl = kl * alpha_s + tl.sum(tl.where(e_s > 0, e_s * (a_s - a_t), 0.0), axis=0)
    lse_s = m_s + tl.log2(d_s)  # log2 sum 2^a: log p = a - lse, in log2 units
    lse_t = m_t + tl.log2(d_t)
    tl.store(ent_ptr + row, (tl.log2(d_s) - h / d_s) * LN2)
    k_s = tl.zeros((), tl.float32)  # MODE 2: K = KL(s || m) in nats
    if MODE == 0:
        div = (kl / d_t - lse_t + lse_s) * LN2
    elif MODE == 1:
        kl = kl / d_s  # E_s[a_s - a_t]: the gradient's d - sum s d, where the normalisers cancel exactly
        div = (kl - lse_s + lse_t) * LN2
    else:
        # 2. the two KLs to the mixture m (log m needs both normalisers: no online sum)
        log2_1mb = tl.log2(1.0 - beta)
        log2_b = tl.log2(beta)
        k_t = tl.zeros((), tl.float32)
        for k in range(0, V, BLOCK_V):
            _, a_s, _ = _tile(s_row, k, cols, V, s_mul, s_inv_cap, S_SOFTCAP)
            _, a_t, _ = _tile(t_row, k, cols, V, t_mul, t_inv_cap, T_SOFTCAP)
            ls = a_s - lse_s
            lt = a_t - lse_t
            lm = _log_mix(ls, lt, log2_1mb, log2_b)
            ps = tl.exp2(ls)
            pt = tl.exp2(lt)
            k_s += tl.sum(tl.where(ps > 0, ps * (ls - lm), 0.0), axis=0)
            k_t += tl.sum(tl.where(pt > 0, pt * (lt - lm), 0.0), axis=0)
        k_s = k_s * LN2
        div = beta * k_t * LN2 + (1.0 - beta) * k_s
    tl.store(div_ptr + row, div)

    if NEED_GRAD:
        # 3. d(student logits) = w dD/dz_s dz_s/dx_s over the row (each tile is read before this program
        #    writes it, so grad may be the student logits themselves)
        for k in range(0, V, BLOCK_V):
            xs, a_s, ok = _tile(s_row, k, cols, V, s_mul, s_inv_cap, S_SOFTCAP)
            _, a_t, _ = _tile(t_row, k, cols, V, t_mul, t_inv_cap, T_SOFTCAP)
            ls = a_s - lse_s
            lt = a_t - lse_t
            ps = tl.exp2(ls)
            if MODE == 0:
                g = ps - tl.exp2(lt)
            elif MODE == 1:
                g = tl.where(ps > 0, ps * ((a_s - a_t - kl) * LN2), 0.0)
            else:
                lm = _log_mix(ls, lt, tl.log2(1.0 - beta), tl.log2(beta))
                g = tl.where(ps > 0, (1.0 - beta) * ps * ((ls - lm) * LN2 - k_s), 0.0)
            g = g * (w * s_dz)  # dz/dx = scale / T, times 1 - tanh^2 with a softcap
            if S_SOFTCAP:
                th = _tanh(xs * s_inv_cap)
                g = g * (1.0 - th * th)
            tl.store(g_row + k + cols, g.to(grad_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------- launcher


def _block_v(V: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a vocab of V, from Python integers (no triton.next_power_of_2 per call)."""
    block = min(BLOCK_V, 1 << max(V - 1, 1).bit_length())
    return block, NUM_WARPS if block >= 2048 else 4


def _transform(scale: float, softcap, temperature: float) -> tuple[float, float, float]:
    """(mul, inv_cap, dz) of one model: `_scaled`'s factors and dz/dx = scale / T (before 1 - tanh^2)."""
    if softcap is None:
        return scale * LOG2E / temperature, 0.0, scale / temperature
    return softcap * LOG2E / temperature, scale / softcap, scale / temperature


def _check_rows(name: str, x: torch.Tensor, shape) -> None:
    if x.dim() != 3 or x.stride(-1) != 1 or (shape is not None and tuple(x.shape) != tuple(shape)):
        want = "" if shape is None else f" of shape {tuple(shape)}"
        raise ValueError(f"{name} must be a [B, T, V] view with stride(-1) == 1{want}, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")


def distill_fwd(student, teacher, weight, grad, *, beta: float, temperature: float, student_scale: float,
                student_softcap, teacher_scale: float, teacher_softcap):
    """student, teacher [B, T, V] logits (any strides on B, T; stride(-1) == 1), weight [B * T] fp32 (the
    rows' loss weights), grad: [B, T, V] to write d(sum_rows weight D) / d(student) into (it may be
    `student` itself), or None for no gradient.

    Returns fp32 (divergence, entropy), each [B * T]; 0 on rows of weight 0.
    """
    _check_rows("student", student, None)
    _check_rows("teacher", teacher, student.shape)
    if grad is not None:
        _check_rows("grad", grad, student.shape)
    B, T, V = student.shape
    N = B * T
    div = torch.empty(N, dtype=torch.float32, device=student.device)
    ent = torch.empty(N, dtype=torch.float32, device=student.device)
    if N == 0:
        return div, ent
    s_mul, s_inv_cap, s_dz = _transform(student_scale, student_softcap, temperature)
    t_mul, t_inv_cap, _ = _transform(teacher_scale, teacher_softcap, temperature)
    mode = MODES.get(float(beta), 2)
    block, warps = _block_v(V)
    g = grad if grad is not None else student
    _distill_fwd_kernel[(N,)](
        student, teacher, g, weight.contiguous(), div, ent,
        T, V,
        student.stride(0), student.stride(1), teacher.stride(0), teacher.stride(1), g.stride(0), g.stride(1),
        s_mul, s_inv_cap, s_dz, t_mul, t_inv_cap, float(beta),
        MODE=mode, S_SOFTCAP=student_softcap is not None, T_SOFTCAP=teacher_softcap is not None,
        NEED_GRAD=grad is not None, BLOCK_V=block, num_warps=warps,
    )
    return div, ent
