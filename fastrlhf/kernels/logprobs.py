"""Per-token log-probs and entropy of softmax(logits / temperature), and d(logits).

    z = logits / temperature,  lse = logsumexp(z),  log p = z - lse
    logp[row] = z[label] - lse            (0 where label == ignore_index, NaN where label is outside [0, V))
    entropy   = -sum_j p_j log p_j = log d - s / d,  d = sum_j exp(z_j - m),  s = sum_j exp(z_j - m) (z_j - m)
    d(logits) = (g_logp (onehot(label) - p) - g_ent p (log p + entropy)) / temperature

Base-2 math: the kernels work on y = logits * scale with scale = log2(e) / temperature folded into
one fp32 factor, so every exponential is a bare exp2 (one FFMA and one MUFU.EX2 per logit, no
multiply by log2(e) and no range fix-ups: Triton's exp2 is `ex2.approx.ftz.f32`):
    m2 = max y,  d = sum 2^(y - m2),  s2 = sum 2^(y - m2) (y - m2)
    lse = (m2 + log2 d) ln 2,  entropy = (log2 d - s2 / d) ln 2,  logp = (y[label] - lse / ln 2) ln 2
    p = 2^t with t = y - lse / ln 2,  log p = t ln 2,
lse is kept in fp64 (per row: m2 + log2 d added and scaled in fp64; the backward reads lse / ln 2 as an fp32
pair hi + lo, t = (y - hi) - lo), so that t is -log2 d to fp32's last bits at the row max (y = m2 there), as
log_softmax's z - max(z) = 0: the row's largest p, which dominates d(logits), is then as accurate as
log_softmax's. An fp32 lse = (m2 + log2 d) ln 2, rounded three times at |m2| (~|max logit| / T), put
~|m2| ulps into every t: p of a row's top token 16 eps off, where fp32 softmax is within 4 eps (2000 rows of
N(0, 3^2) logits, T = 0.7, in the interpreter).
    d(logits) = p (a + b t) [+ g_logp / temperature at the label],
    a = -(g_logp + g_ent entropy) / temperature,  b = -g_ent ln 2 / temperature
The running max is taken of the raw logits (scale > 0, so max(x) scale == max(x scale) exactly).
Where an exp2 may meet a -inf logit next to a finite factor (t in s2 and in b t), t is first
floored at T_FLOOR, where 2^t is already exactly 0: 0 * T_FLOOR = 0, never 0 * inf = NaN.

Where it is fast: one program per row (B*T rows on grid axis 0, never more than 2^31 - 1),
the vocabulary streamed in BLOCK_V tiles with an online softmax, so the forward reads each
logit once and the backward reads each once and writes d(logits) once: memory-bound from
V of a few thousand up to 256k and beyond (the row loop has no upper limit on V).
Few rows (B*T < FEW_ROWS_WAVES per SM, e.g. a short rollout): one program per row cannot fill
the GPU, so each row's vocab is split over up to MAX_SPLITS programs on grid axis 1 (at least
SPLIT_MIN_V logits each); the forward's programs write their (m, d, s) and a combine kernel
merges them per row (a few bytes per split), the backward's programs each write their part.
Where it is not: small V (< ~1k) leaves most lanes of a program idle; there a plain torch
log_softmax is as good.
Logits may be any [B, T, V] view with stride(-1) == 1 (e.g. `logits[:, :-1]`): the row
offset is b * stride_b + t * stride_t in int64, nothing is copied.

Alignment. A row that starts off a 16-byte boundary (V % 8 != 0 in bf16, e.g. 50257; any odd row
stride) would lose the 128-bit loads if tiles began at the row's start. So each program walks the
16-byte aligned middle of its columns (offsets from the logits pointer rounded up to ALIGN = 16 /
element size) in unmasked BLOCK_V tiles, the last one masked in whole 16-byte groups, and then the
fewer than ALIGN columns before and after it in one small masked tile (`_aligned_span`,
`_ragged_ends`). The stores of d(logits) are as aligned as the loads when d(logits) has the logits'
strides (in place, or both contiguous). The sm_90 PTX of the bf16 V = 50257 launches (log-prob
forward and backward, actor loss) has ld/st.global.v4 in the loops (a one-off check, not a test);
whether that recovers the bandwidth of V = 151936 at V = 50257 is to be measured.

Tiles and warps. A tile's block-wide max and sum (shuffles, a shared-memory round trip and
barriers) are paid once per tile, so larger tiles amortise them: 8192 bf16 logits over 8 warps
are 32 per thread, four 128-bit loads in flight each. On CUDA, for V >= TUNE_MIN_V, the forward
and the (out-of-place) backward pick tile x warps with `triton.autotune` among CONFIGS, keyed on
V, the flags (entropy; which gradients) and the dtypes; the first call for a key times the four
configs on its own arguments (a few hundred ms, once per process). The bet behind the list: 4096
x 8 is the old fixed choice, 8192 x 8 and 16384 x 16 halve and quarter the per-tile overhead at
16-32 elements per thread (under ~128 registers, two programs per SM), 8192 x 16 is 8192 with
more warps to hide latency. The in-place backward (it overwrites its input, so it cannot be run
once per config) and V < TUNE_MIN_V use the fixed FIXED_BLOCK_V x 8 warps (smaller tiles for
small V). The interpreter (CPU tests) always takes the fixed config; tests also run every
config in CONFIGS through it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fastrlhf.kernels._launch import cdiv, next_power_of_2, sm_count  # noqa: F401 (sm_count: kernels.logprobs.sm_count)

FIXED_BLOCK_V = 4096  # the untuned tile: 8 KiB of bf16
TUNE_MIN_V = 16384  # from this V on, CUDA launches are autotuned over CONFIGS
FEW_ROWS_WAVES = 4  # fewer rows than this many per SM: the vocab of each row is split over several programs
SPLIT_MIN_V = 8192  # the least vocab one split takes
MAX_SPLITS = 64
CONFIGS = [triton.Config({"BLOCK_V": block_v}, num_warps=warps)
           for block_v, warps in ((4096, 8), (8192, 8), (8192, 16), (16384, 16))]
# finite start of the running max, so that exp2(m - m_new) is never exp2(-inf - -inf)
FP32_MIN = tl.constexpr(-3.4028234663852886e38)
LOG2E = 1.4426950408889634  # log2(e): y = logits * LOG2E / temperature
LN2 = tl.constexpr(0.6931471805599453)
T_FLOOR = tl.constexpr(-1000.0)  # 2^t == 0 in fp32 for t <= -150: flooring t there changes no 2^t


# ---------------------------------------------------------------- kernels


@triton.jit
def _online_tile(x, m, d, s, scale, COMPUTE_ENTROPY: tl.constexpr):
    # one tile x (fp32 raw logits, -inf on padding lanes) into the running base-2 stats:
    # m = max y, d = sum 2^(y - m), s = sum 2^(y - m) (y - m), with y = x * scale
    m_new = tl.maximum(m, tl.max(x, axis=0) * scale)
    t = x * scale - m_new
    alpha = tl.exp2(m - m_new)
    if COMPUTE_ENTROPY:
        t = tl.maximum(t, T_FLOOR)  # a -inf logit: e = 0 and e * t = 0
        e = tl.exp2(t)
        # rebase s from m to m_new: sum e'(y - m_new) = alpha * (s + (m - m_new) d)
        s = alpha * (s + (m - m_new) * d) + tl.sum(e * t, axis=0)
    else:
        e = tl.exp2(t)
    d = d * alpha + tl.sum(e, axis=0)
    return m_new, d, s


@triton.jit
def _bwd_tile(x, scale, lse2_hi, lse2_lo, a, b, HAS_GRAD_ENTROPY: tl.constexpr):
    # d(logits) = p (a + b t) without the one-hot part, p = 2^t, t = x scale - lse / ln 2 with lse / ln 2 as
    # an fp32 pair hi + lo: x scale - hi is exact near the row max (the terms that dominate the row)
    t = (x * scale - lse2_hi) - lse2_lo
    if HAS_GRAD_ENTROPY:
        t = tl.maximum(t, T_FLOOR)  # a -inf logit: p = 0 and p (a + b t) = 0
        return tl.exp2(t) * (a + b * t)
    return tl.exp2(t) * a


@triton.jit
def _aligned_span(row_off, lo, hi, ALIGN: tl.constexpr):
    # the 16-byte aligned middle of the columns [lo, hi) of a row that starts at element row_off of the
    # tensor: absolute start a (int64) and length n (int32: < V), both multiples of ALIGN (the elements
    # in 16 bytes)
    a = tl.cdiv(row_off + lo, ALIGN) * ALIGN
    n = (tl.maximum(row_off + hi - a, 0) // ALIGN * ALIGN).to(tl.int32)
    return tl.multiple_of(a, ALIGN), tl.multiple_of(n, ALIGN)


@triton.jit
def _ragged_ends(lo, hi, a_rel, n, ALIGN: tl.constexpr):
    # the columns of [lo, hi) outside its aligned middle [a_rel, a_rel + n) (row-relative): fewer than
    # ALIGN before it, fewer than ALIGN after it; (columns, mask) over 2 * ALIGN lanes
    j = tl.arange(0, 2 * ALIGN)
    head = j < ALIGN
    col = tl.where(head, lo + j, a_rel + n + j - ALIGN)
    return col, tl.where(head, col < tl.minimum(a_rel, hi), col < hi)


@triton.jit
def _finish_row(m, d, s, row, row_ptr, labels_ptr, logp_ptr, entropy_ptr, lse_ptr, V, scale, ignore_index,
                COMPUTE_ENTROPY: tl.constexpr):
    # lse (fp64), entropy and logp of one row from its base-2 stats (m, d, s): lse / ln 2 = m + log2 d in fp64,
    # so that y - lse / ln 2 is -log2 d at the row max (y = m there), as log_softmax's z - max(z) is 0
    log2_d = tl.log2(d)
    lse2 = m.to(tl.float64) + log2_d.to(tl.float64)
    tl.store(lse_ptr + row, lse2 * LN2)
    if COMPUTE_ENTROPY:
        tl.store(entropy_ptr + row, (log2_d - s / d) * LN2)
    label = tl.load(labels_ptr + row)
    valid = (label >= 0) & (label < V)
    x_label = tl.load(row_ptr + tl.where(valid, label, 0), mask=valid, other=0.0).to(tl.float32)
    y_label = (x_label * scale).to(tl.float64)  # as the K-label gather in ops
    logp = tl.where(valid, ((y_label - lse2) * LN2).to(tl.float32), float("nan"))
    logp = tl.where(label == ignore_index, 0.0, logp)
    tl.store(logp_ptr + row, logp)


@triton.jit
def _logprobs_fwd_kernel(
    # pointers
    logits_ptr,  # [B, T, V] bf16/fp16/fp32, stride(-1) == 1
    labels_ptr,  # [B * T] int64
    logp_ptr,  # [B * T] fp32
    entropy_ptr,  # [B * T] fp32, written only if COMPUTE_ENTROPY
    lse_ptr,  # [B * T] fp64, logsumexp(logits / temperature)
    partial_ptr,  # [3, splits, B * T] fp32 (m, d, s) of each vocab split, written only if SPLIT
    # shapes
    N,
    T,
    V,
    chunk_v,  # vocab elements per program (grid axis 1): V, or with SPLIT a multiple of BLOCK_V
    # strides
    stride_b,
    stride_t,
    # meta
    scale,  # fp32, log2(e) / temperature
    ignore_index,
    COMPUTE_ENTROPY: tl.constexpr,
    SPLIT: tl.constexpr,  # the row's vocab is split over grid axis 1: write partials for the combine kernel
    ALIGN: tl.constexpr,  # logits in 16 bytes
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row_off = (row // T) * stride_b + (row % T) * stride_t  # elements from logits_ptr, int64
    lo = split * chunk_v
    hi = tl.minimum(lo + chunk_v, V)

    # the row's 16-byte aligned middle in BLOCK_V tiles (128-bit loads whatever V and the row's start),
    # its last tile masked in whole 16-byte groups, then the few ragged columns at either end
    a, n = _aligned_span(row_off, lo, hi, ALIGN)
    n_full = n // BLOCK_V * BLOCK_V
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((), FP32_MIN, tl.float32)
    d = tl.zeros((), tl.float32)
    s = tl.zeros((), tl.float32)
    for k in range(0, n_full, BLOCK_V):
        x = tl.load(logits_ptr + a + k + cols).to(tl.float32)
        m, d, s = _online_tile(x, m, d, s, scale, COMPUTE_ENTROPY)
    if n_full < n:
        x_tail = tl.load(logits_ptr + a + n_full + cols, mask=n_full + cols < n, other=float("-inf"))
        m, d, s = _online_tile(x_tail.to(tl.float32), m, d, s, scale, COMPUTE_ENTROPY)
    col, ok = _ragged_ends(lo, hi, a - row_off, n, ALIGN)
    x_ends = tl.load(logits_ptr + row_off + col, mask=ok, other=float("-inf")).to(tl.float32)
    m, d, s = _online_tile(x_ends, m, d, s, scale, COMPUTE_ENTROPY)
    row_ptr = logits_ptr + row_off

    if SPLIT:
        splits = tl.num_programs(1)
        tl.store(partial_ptr + split * N + row, m)
        tl.store(partial_ptr + (splits + split) * N + row, d)
        tl.store(partial_ptr + (2 * splits + split) * N + row, s)
    else:
        _finish_row(m, d, s, row, row_ptr, labels_ptr, logp_ptr, entropy_ptr, lse_ptr, V, scale,
                    ignore_index, COMPUTE_ENTROPY)


@triton.jit
def _logprobs_combine_kernel(
    # pointers
    logits_ptr,  # [B, T, V] bf16/fp16/fp32, stride(-1) == 1 (the label's logit)
    labels_ptr,  # [B * T] int64
    partial_ptr,  # [3, splits, B * T] fp32 (m, d, s) of each vocab split
    logp_ptr,  # [B * T] fp32
    entropy_ptr,  # [B * T] fp32, written only if COMPUTE_ENTROPY
    lse_ptr,  # [B * T] fp64
    # shapes
    N,
    T,
    V,
    splits,
    # strides
    stride_b,
    stride_t,
    # meta
    scale,  # fp32, log2(e) / temperature
    ignore_index,
    COMPUTE_ENTROPY: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= splits
):
    # merge the splits' stats: M = max m_j, d = sum d_j 2^(m_j - M), s = sum 2^(m_j - M) (s_j + (m_j - M) d_j)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_S)
    ok = j < splits
    m_j = tl.load(partial_ptr + j * N + row, mask=ok, other=FP32_MIN)
    d_j = tl.load(partial_ptr + (splits + j) * N + row, mask=ok, other=0.0)
    s_j = tl.load(partial_ptr + (2 * splits + j) * N + row, mask=ok, other=0.0)
    m = tl.max(m_j, axis=0)
    alpha = tl.exp2(m_j - m)
    d = tl.sum(d_j * alpha, axis=0)
    s = tl.sum(alpha * (s_j + (m_j - m) * d_j), axis=0)
    row_ptr = logits_ptr + (row // T) * stride_b + (row % T) * stride_t
    _finish_row(m, d, s, row, row_ptr, labels_ptr, logp_ptr, entropy_ptr, lse_ptr, V, scale, ignore_index,
                COMPUTE_ENTROPY)


@triton.jit
def _logprobs_bwd_kernel(
    # pointers
    logits_ptr,  # [B, T, V] bf16/fp16/fp32, stride(-1) == 1
    labels_ptr,  # [B * T] int64
    lse_ptr,  # [B * T] fp64 (or fp32)
    entropy_ptr,  # [B * T] fp32, read only if HAS_GRAD_ENTROPY
    grad_logp_ptr,  # [B * T] fp32, read only if HAS_GRAD_LOGP
    grad_entropy_ptr,  # [B * T] fp32, read only if HAS_GRAD_ENTROPY
    dlogits_ptr,  # [B, T, V] logits dtype; may alias logits_ptr (in-place, same strides)
    # shapes
    T,
    V,
    chunk_v,  # vocab elements per program (grid axis 1: the splits of a row): V, or a multiple of BLOCK_V
    # strides
    stride_b,
    stride_t,
    dstride_b,
    dstride_t,
    # meta
    scale,  # fp32, log2(e) / temperature
    inv_temperature,  # fp32
    ignore_index,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    ONE_HOT: tl.constexpr,  # add g_logp at the label; False: the caller adds the one-hot part (K labels per row)
    SAME_LAYOUT: tl.constexpr,  # dlogits has the logits' strides (in place, or both contiguous)
    ALIGN: tl.constexpr,  # logits in 16 bytes
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_off = (row // T) * stride_b + (row % T) * stride_t  # elements from logits_ptr, int64
    drow_off = row_off
    if not SAME_LAYOUT:
        drow_off = (row // T) * dstride_b + (row % T) * dstride_t

    lse2 = tl.load(lse_ptr + row).to(tl.float64) * (1.0 / LN2)
    lse2_hi = lse2.to(tl.float32)
    lse2_lo = (lse2 - lse2_hi.to(tl.float64)).to(tl.float32)
    label = tl.load(labels_ptr + row)
    # ignored and out-of-range labels have no log-prob, hence no gradient through it
    takes_grad = (label >= 0) & (label < V) & (label != ignore_index)
    g_logp = tl.zeros((), tl.float32)
    if HAS_GRAD_LOGP:
        g_logp = tl.load(grad_logp_ptr + row)
        if ONE_HOT:
            g_logp = tl.where(takes_grad, g_logp, 0.0)
    # d(logits) = p (a + b t) [+ g_logp / temperature at the label], p = 2^t, log p = t ln 2
    a_coef = -g_logp * inv_temperature
    b_coef = tl.zeros((), tl.float32)
    if HAS_GRAD_ENTROPY:
        g_ent = tl.load(grad_entropy_ptr + row)
        a_coef -= g_ent * tl.load(entropy_ptr + row) * inv_temperature
        b_coef = -g_ent * LN2 * inv_temperature
    g_label = g_logp * inv_temperature
    # the row's 16-byte aligned middle in BLOCK_V tiles, its last tile masked in whole 16-byte groups,
    # then the few ragged columns at either end (see _logprobs_fwd_kernel); with SAME_LAYOUT the
    # stores are as aligned as the loads
    lo = tl.program_id(1) * chunk_v
    hi = tl.minimum(lo + chunk_v, V)
    a, n = _aligned_span(row_off, lo, hi, ALIGN)
    n_full = n // BLOCK_V * BLOCK_V
    src = logits_ptr + a
    dst = dlogits_ptr + (drow_off + (a - row_off))
    if SAME_LAYOUT:
        dst = dlogits_ptr + a
    # the label as an int32 column from the aligned start (-1 when it takes no gradient): one 32-bit
    # compare per logit
    label_col = tl.where(takes_grad, label - (a - row_off), -1).to(tl.int32)
    cols = tl.arange(0, BLOCK_V)
    out_ty = dlogits_ptr.dtype.element_ty
    for k in range(0, n_full, BLOCK_V):
        dz = _bwd_tile(tl.load(src + k + cols).to(tl.float32), scale, lse2_hi, lse2_lo, a_coef, b_coef,
                       HAS_GRAD_ENTROPY)
        if ONE_HOT:
            dz += tl.where(cols == label_col - k, g_label, 0.0)
        tl.store(dst + k + cols, dz.to(out_ty))
    if n_full < n:
        in_span = n_full + cols < n
        x_tail = tl.load(src + n_full + cols, mask=in_span, other=0.0).to(tl.float32)
        dz = _bwd_tile(x_tail, scale, lse2_hi, lse2_lo, a_coef, b_coef, HAS_GRAD_ENTROPY)
        if ONE_HOT:
            dz += tl.where(cols == label_col - n_full, g_label, 0.0)
        tl.store(dst + n_full + cols, dz.to(out_ty), mask=in_span)
    col, ok = _ragged_ends(lo, hi, a - row_off, n, ALIGN)
    x_ends = tl.load(logits_ptr + row_off + col, mask=ok, other=0.0).to(tl.float32)
    dz = _bwd_tile(x_ends, scale, lse2_hi, lse2_lo, a_coef, b_coef, HAS_GRAD_ENTROPY)
    if ONE_HOT:
        dz += tl.where(takes_grad & (col == label), g_label, 0.0)
    tl.store(dlogits_ptr + drow_off + col, dz.to(out_ty), mask=ok)


# autotuned launchers of the same kernels (CUDA only; see the module docstring)
_logprobs_fwd_tuned = triton.autotune(configs=CONFIGS, key=["V", "COMPUTE_ENTROPY"])(_logprobs_fwd_kernel)
_logprobs_bwd_tuned = triton.autotune(configs=CONFIGS, key=["V", "HAS_GRAD_LOGP", "HAS_GRAD_ENTROPY", "ONE_HOT"])(
    _logprobs_bwd_kernel)


# ---------------------------------------------------------------- launchers


@functools.cache
def vocab_splits(n_rows: int, V: int, device: torch.device) -> tuple[int, int]:
    """(splits, chunk_v): programs per row along the vocab, and the vocab elements each takes.
    Below FEW_ROWS_WAVES programs per SM the rows alone cannot fill the GPU, so each row's vocab
    is cut into up to that many programs' worth of splits, each at least SPLIT_MIN_V wide."""
    target = FEW_ROWS_WAVES * sm_count(device)
    block_v = fixed_config(V)["BLOCK_V"]
    if n_rows >= target or V < 2 * SPLIT_MIN_V:
        return 1, V
    splits = min(cdiv(target, n_rows), V // SPLIT_MIN_V, MAX_SPLITS)
    chunk_v = cdiv(cdiv(V, splits), block_v) * block_v
    return cdiv(V, chunk_v), chunk_v


@functools.cache
def fixed_config(V: int) -> dict:
    """The untuned launch: BLOCK_V and num_warps for a vocab of V."""
    block_v = min(FIXED_BLOCK_V, next_power_of_2(V))
    return {"BLOCK_V": block_v, "num_warps": 8 if block_v >= 2048 else 4}


def _tuned(logits: torch.Tensor) -> bool:
    """Whether a launch on these logits goes through the autotuner (compiled CUDA, large V)."""
    return logits.is_cuda and logits.shape[-1] >= TUNE_MIN_V


def _check_row_layout(logits, labels):
    if logits.dim() != 3 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be a [B, T, V] view with stride(-1) == 1, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if labels.shape != logits.shape[:2] or labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64 of shape {tuple(logits.shape[:2])}, got {labels.dtype} "
                         f"{tuple(labels.shape)}")


def logprobs_fwd(logits, labels, *, temperature: float, ignore_index: int, compute_entropy: bool):
    """logits [B, T, V] (any strides on B, T; stride(-1) == 1), labels [B, T] int64.

    Returns [B, T] (logp, entropy or None: fp32; lse = logsumexp(logits / temperature): fp64, that the
    backward's and the K-label gather's y - lse / ln 2 be exact at the row max).
    """
    _check_row_layout(logits, labels)
    B, T, V = logits.shape
    logp = torch.empty((B, T), dtype=torch.float32, device=logits.device)
    lse = torch.empty((B, T), dtype=torch.float64, device=logits.device)
    entropy = torch.empty((B, T), dtype=torch.float32, device=logits.device) if compute_entropy else None
    if B * T == 0:
        return logp, entropy, lse
    splits, chunk_v = vocab_splits(B * T, V, logits.device)
    labels = labels.contiguous()
    scale = LOG2E / float(temperature)
    if splits == 1:
        kernel, config = (_logprobs_fwd_tuned, {}) if _tuned(logits) else (_logprobs_fwd_kernel, fixed_config(V))
        kernel[(B * T, 1)](
            logits, labels, logp, entropy if compute_entropy else lse, lse, lse,
            B * T, T, V, V,
            logits.stride(0), logits.stride(1),
            scale, int(ignore_index),
            COMPUTE_ENTROPY=compute_entropy, SPLIT=False, ALIGN=16 // logits.element_size(), **config,
        )
        return logp, entropy, lse
    # few rows: each row's vocab over `splits` programs, then one program per row merges their stats
    partial = torch.empty((3, splits, B * T), dtype=torch.float32, device=logits.device)
    _logprobs_fwd_kernel[(B * T, splits)](
        logits, labels, logp, lse, lse, partial,
        B * T, T, V, chunk_v,
        logits.stride(0), logits.stride(1),
        scale, int(ignore_index),
        COMPUTE_ENTROPY=compute_entropy, SPLIT=True, ALIGN=16 // logits.element_size(), **fixed_config(V),
    )
    _logprobs_combine_kernel[(B * T,)](
        logits, labels, partial, logp, entropy if compute_entropy else lse, lse,
        B * T, T, V, splits,
        logits.stride(0), logits.stride(1),
        scale, int(ignore_index),
        COMPUTE_ENTROPY=compute_entropy, BLOCK_S=next_power_of_2(splits), num_warps=1,
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
    splits, chunk_v = vocab_splits(B * T, V, logits.device)
    # the tuner runs a launch once per config: never over its own input; the few-rows split is not tuned
    tuned = _tuned(logits) and not inplace and splits == 1
    kernel, config = (_logprobs_bwd_tuned, {}) if tuned else (_logprobs_bwd_kernel, fixed_config(V))
    kernel[(B * T, splits)](
        logits, labels.contiguous(), lse.contiguous(),
        entropy.contiguous() if grad_entropy is not None else lse,
        grad_logp.contiguous() if grad_logp is not None else lse,
        grad_entropy.contiguous() if grad_entropy is not None else lse,
        dlogits,
        T, V, chunk_v,
        logits.stride(0), logits.stride(1), dlogits.stride(0), dlogits.stride(1),
        LOG2E / float(temperature), 1.0 / float(temperature), int(ignore_index),
        HAS_GRAD_LOGP=grad_logp is not None, HAS_GRAD_ENTROPY=grad_entropy is not None, ONE_HOT=one_hot,
        SAME_LAYOUT=dlogits.stride() == logits.stride(), ALIGN=16 // logits.element_size(), **config,
    )
    return dlogits
