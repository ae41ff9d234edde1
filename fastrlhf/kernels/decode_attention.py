"""Decode attention over a static KV cache: split-KV (flash-decoding), grouped-query heads, an optional
prefix shared by G consecutive rows (cascade attention).

For query i of L of row b (position P + n - L + i, n = lengths[b] suffix slots, P = the group's prefix
length, 0 without a prefix), over the visible keys j (prefix slots j < P, suffix slots s at position P + s,
visible when their position <= the query's):

    out[b, h, i] = sum_j exp(scale q . k_j - mx) v_j / sum_j exp(scale q . k_j - mx);  0 when none is visible

Two kernels. `_decode_attention_fwd_kernel`, one program per (KV row, KV head, block of queries, split of
SPLIT slots): the H_q / H_kv query heads of the KV head times the L positions (times the G rows of a group,
for the prefix) are one tile of queries against each K / V tile, which is loaded once for all of them; the
split's running (max, sum, sum of exp(.) v) go to fp32 partial buffers. A split past its row's written
slots loads nothing and stores nothing. `_decode_attention_merge_kernel`, one program per (row, KV head,
block of queries), merges the row's written splits one after the other, prefix first, by log-sum-exp.
SPLIT depends only on the dtype, so a row's reduction order never depends on the batch, the other rows or
their lengths.

Where fast: memory-bound decode (L up to a few, H_q / H_kv up to 16); bytes and work in proportion to the
written slots; fixed grids (B, H_kv, cdiv(T, SPLIT)), int64 offsets, no host sync, so the launches can be
captured in a CUDA graph. The partial buffers add 4 (D + 2) bytes per query and split, written once and read
once by the merge: at H_q / H_kv = 7, L = 1, about 3% of the K / V bytes each way. Where not: long query
blocks (prefill), and fp32 caches (their dots run as fp32 FMAs, not tensor cores).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fastrlhf.kernels._launch import cdiv, next_power_of_2
from fastrlhf.kernels.kl import _rounded

LOG2E = 1.4426950408889634  # scores are kept in base 2: exp(x) = exp2(x log2 e)
BLOCK_N = 64  # KV slots per tile; SPLIT is a multiple of it
MERGE_CHUNK = 16  # splits per step of the merge
HALF_DTYPES = (torch.float16, torch.bfloat16)


def split_size(head_dim: int, dtype: torch.dtype) -> int:
    """KV slots per program: 256 for 2-byte caches, 128 for wider ones (the same bytes per slot and head
    dim). A function of the head dim and dtype only: the reduction order over KV follows from it."""
    return 256 if dtype in HALF_DTYPES else 128


def dots_in_fp32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel's dots take fp32 operands (IEEE): for fp32 / fp64 caches, and for bf16 ones off CUDA,
    as the interpreter's tl.dot multiplies bfloat16's bit patterns (triton-lang/triton#11584). A bf16 tile
    made fp32 keeps its products exact, so there the dots give what the tensor cores' bf16 dots give."""
    return dtype not in HALF_DTYPES or (dtype == torch.bfloat16 and device.type != "cuda")


@triton.jit
def _decode_attention_fwd_kernel(
    # pointers
    q_ptr,  # [B, H_q, L, D] fp16/bf16/fp32/fp64, any strides
    k_ptr,  # [R, H_kv, T, D] the cache (R = B, ROWS = 1) or the shared prefix (R = B / G, ROWS = G), any strides
    v_ptr,  # [R, H_kv, T, D] like k_ptr
    kv_len_ptr,  # [R] int32/int64 slots written in each row of k_ptr / v_ptr
    len_ptr,  # [B] int32/int64 suffix slots written per row: places the queries
    max_ptr,  # [B * H_q * L, S] fp32 out: the split's max of the base-2 scores
    sum_ptr,  # [B * H_q * L, S] fp32 out: sum of exp2(score - max)
    acc_ptr,  # [B * H_q * L, S, D] fp32 out: sum of exp2(score - max) v
    count_ptr,  # [programs] int32 out: KV tiles this program loaded, written only if COUNT
    # shapes
    H_kv,
    T,  # slots of k_ptr's rows
    T_suffix,  # slots of the cache (lengths are clamped to it)
    n_splits,  # cdiv(T, SPLIT): the programs of one (row, head, query block)
    n_blocks,  # query blocks per (row, head)
    S,  # splits per query in the partial buffers (prefix splits first)
    slot0,  # this launch's first split slot
    # strides
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    # meta
    qk_scale,  # fp32: scale * log2(e)
    L: tl.constexpr,  # query positions per row
    GROUP: tl.constexpr,  # H_q // H_kv
    ROWS: tl.constexpr,  # query rows per KV row: G for the prefix, 1 for the cache
    PREFIX: tl.constexpr,  # k_ptr is the shared prefix (its slots precede every row's suffix)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HALF: tl.constexpr,  # fp16/bf16 cache: probabilities rounded to its dtype for the P @ V dot (flash attention's)
    DOT_F32: tl.constexpr,  # dots on fp32 operands, IEEE: fp32/fp64 caches, and bf16 under the interpreter
    COUNT: tl.constexpr,
):
    # query m of the block -> (row r of the group, head of the group, position i); its visible slots of this
    # part: suffix s < n - L + i + 1; prefix j < min(P, P + n - L + i + 1) (P the group's prefix length)
    pid = tl.program_id(0).to(tl.int64)
    split = pid % n_splits
    rest = pid // n_splits
    block = rest % n_blocks
    rest = rest // n_blocks
    head = rest % H_kv
    kv_row = rest // H_kv
    kv_n = tl.minimum(tl.maximum(tl.load(kv_len_ptr + kv_row).to(tl.int64), 0), T)
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, kv_n)
    # the split holds written slots, else no load and no store (the merge reads only splits below kv_n); a block,
    # not a scalar: triton 3.9's interpreter makes `block & scalar` an int32 mask that tl.load then refuses
    has_work = start + 0 * tl.arange(0, BLOCK_M) < kv_n

    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    valid_m = m < ROWS * GROUP * L
    i = m % L
    b = kv_row * ROWS + m // (GROUP * L)
    hq = head * GROUP + (m // L) % GROUP
    n = tl.minimum(tl.maximum(tl.load(len_ptr + b, mask=valid_m, other=0).to(tl.int64), 0), T_suffix)
    if PREFIX:
        visible = tl.minimum(tl.maximum(kv_n + n - L + i + 1, 0), kv_n)
    else:
        visible = tl.minimum(tl.maximum(n - L + i + 1, 0), kv_n)

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = q_ptr + b * stride_qb + hq * stride_qh + i * stride_ql
    q = tl.load(q_rows[:, None] + d[None, :] * stride_qd, mask=(valid_m & has_work)[:, None] & d_ok[None, :],
                other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_row = k_ptr + kv_row * stride_kb + head * stride_kh
    v_row = v_ptr + kv_row * stride_vb + head * stride_vh

    mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    tiles = tl.zeros([], tl.int32)
    for n0 in range(start, end, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        kv_mask = (slots < kv_n)[:, None] & d_ok[None, :]
        k = tl.load(k_row + slots[:, None] * stride_kt + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(slots[None, :] < visible[:, None], s * qk_scale, float("-inf"))
        mx_new = tl.maximum(mx, tl.max(s, 1))
        base = tl.where(mx_new == float("-inf"), 0.0, mx_new)  # a query that sees nothing yet stays (-inf, 0, 0)
        alpha = tl.exp2(mx - base)
        p = tl.exp2(s - base[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_row + slots[:, None] * stride_vt + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if HALF:
            p = _rounded(p, v.dtype)
        if DOT_F32:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v)
        acc = acc * alpha[:, None] + pv
        mx = mx_new
        tiles += 1

    query = (b * (H_kv * GROUP) + hq) * L + i  # flat (b, h_q, i)
    slot = query * S + slot0 + split
    keep = valid_m & has_work
    tl.store(max_ptr + slot, mx, mask=keep)
    tl.store(sum_ptr + slot, total, mask=keep)
    tl.store(acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], acc, mask=keep[:, None] & d_ok[None, :])
    if COUNT:
        tl.store(count_ptr + pid, tiles)


@triton.jit
def _decode_attention_merge_kernel(
    # pointers
    max_ptr,  # [B * H_q * L, S] fp32 partial maxima (base 2)
    sum_ptr,  # [B * H_q * L, S] fp32 partial sums
    acc_ptr,  # [B * H_q * L, S, D] fp32 partial outputs
    len_ptr,  # [B] int32/int64 suffix slots written
    prefix_len_ptr,  # [B / G] int32/int64 prefix slots written, read only if HAS_PREFIX
    out_ptr,  # [B, H_q, L, D] q's dtype out, contiguous
    # shapes
    H_kv,
    n_blocks,  # query blocks per (row, KV head)
    T_suffix,
    P,  # prefix slots (0 without a prefix)
    S,
    S_prefix,  # cdiv(P, SPLIT): the first suffix split's slot
    G,
    # meta
    QUERIES: tl.constexpr,  # H_q // H_kv * L: the queries of one (row, KV head), consecutive in the buffers
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # out = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp2(m_s - max_s m_s), over the row's written splits one
    # after the other (prefix, then suffix); 0 when no split saw a key
    pid = tl.program_id(0).to(tl.int64)
    block = pid % n_blocks
    row_head = pid // n_blocks  # b * H_kv + KV head
    b = row_head // H_kv
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    ok_m = m < QUERIES
    query = row_head * QUERIES + m  # flat (b, h_q, i)
    rows = query * S
    n = tl.minimum(tl.maximum(tl.load(len_ptr + b).to(tl.int64), 0), T_suffix)
    n_prefix = 0
    if HAS_PREFIX:
        p_len = tl.minimum(tl.maximum(tl.load(prefix_len_ptr + b // G).to(tl.int64), 0), P)
        n_prefix = (p_len + SPLIT - 1) // SPLIT
    n_valid = n_prefix + (n + SPLIT - 1) // SPLIT

    running = tl.full([BLOCK_M, CHUNK], float("-inf"), tl.float32)  # reduced after the loop: a max inside it
    for c in range(0, n_valid, CHUNK):  # trips an assertion of triton's thread-locality pass in some variants
        j = c + tl.arange(0, CHUNK)
        slot = tl.where(j < n_prefix, j, j - n_prefix + S_prefix)
        part = tl.load(max_ptr + rows[:, None] + slot[None, :], mask=ok_m[:, None] & (j < n_valid)[None, :],
                       other=float("-inf"))
        running = tl.maximum(running, part)
    mx = tl.max(running, 1)
    base = tl.where(mx == float("-inf"), 0.0, mx)

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(0, n_valid):
        if HAS_PREFIX:
            slot = tl.where(j < n_prefix, j, j - n_prefix + S_prefix)
        else:
            slot = j
        w = tl.exp2(tl.load(max_ptr + rows + slot, mask=ok_m, other=float("-inf")) - base)
        total += w * tl.load(sum_ptr + rows + slot, mask=ok_m, other=0.0)
        part = tl.load(acc_ptr + (rows + slot)[:, None] * HEAD_DIM + d[None, :], mask=ok_m[:, None] & d_ok[None, :],
                       other=0.0)
        acc += w[:, None] * part
    out = tl.where(total[:, None] > 0, acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
    tl.store(out_ptr + query[:, None] * HEAD_DIM + d[None, :], _rounded(out, out_ptr.dtype.element_ty),
             mask=ok_m[:, None] & d_ok[None, :])


# ---------------------------------------------------------------- launchers


@functools.cache
def _blocks(rows: int, group: int, L: int, head_dim: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, query blocks, BLOCK_D, num_warps, num_stages) for ROWS x GROUP x L queries per program. A
    block of queries holds at most 128 (64 at D > 64) fp32 accumulator rows; more queries take more blocks,
    each reading the same K / V tiles. Large blocks (a prefix group's) get 8 warps and two stages of K / V
    tiles in flight, small ones 4 warps and three."""
    block_d = max(16, next_power_of_2(head_dim))
    queries = rows * group * L
    block_m = max(16, min(next_power_of_2(queries), 128 if block_d <= 64 else 64))
    small = block_m * block_d <= 4096
    return block_m, cdiv(queries, block_m), block_d, 4 if small else 8, 3 if small else 2


def _launch_part(q, k, v, kv_lengths, lengths, maxima, sums, acc, counts, *, rows, prefix, slot0, S, T_suffix, qk_scale,
                 split, dot_f32):
    """One launch of the attention kernel over the rows of `k` / `v` (the cache or the prefix)."""
    B, H_q, L, D = q.shape
    R, H_kv, T = k.shape[:3]
    group = H_q // H_kv
    block_m, n_blocks, block_d, num_warps, num_stages = _blocks(rows, group, L, D)
    n_splits = cdiv(T, split)
    programs = R * H_kv * n_blocks * n_splits
    if programs == 0:
        return counts
    count = counts is not None
    out_counts = torch.zeros(programs if count else 1, dtype=torch.int32, device=q.device)
    _decode_attention_fwd_kernel[(programs,)](
        q, k, v, kv_lengths, lengths, maxima, sums, acc, out_counts,
        H_kv, T, T_suffix, n_splits, n_blocks, S, slot0,
        *q.stride(), *k.stride(), *v.stride(),
        qk_scale, L=L, GROUP=group, ROWS=rows, PREFIX=prefix, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m,
        BLOCK_N=BLOCK_N, SPLIT=split, HALF=k.dtype in HALF_DTYPES, DOT_F32=dot_f32, COUNT=count,
        num_warps=num_warps, num_stages=num_stages)
    return None if counts is None else counts + [out_counts]


def decode_attention_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, *,
                         scale: float, prefix=None, count_tiles: bool = False):
    """out [B, H_q, L, D] in q's dtype (fp32 math) of q [B, H_q, L, D] against the first lengths[b] slots of
    k_cache / v_cache [B, H_kv, T, D] (and, with prefix = (k_prefix, v_prefix, prefix_lengths, G), the
    prefix [B / G, H_kv, P, D] shared by G consecutive rows first). Any strides; lengths int32/int64, clamped
    to [0, T] (prefix_lengths to [0, P]). With `count_tiles`, (out, tiles): the KV tiles of BLOCK_N slots
    each program loaded, one int32 tensor of every program of every launch."""
    B, H_q, L, D = q.shape
    T = k_cache.shape[2]
    split = split_size(D, k_cache.dtype)
    dot_f32 = dots_in_fp32(k_cache.dtype, q.device)
    k_prefix = v_prefix = prefix_lengths = None
    G, P = 1, 0
    if prefix is not None:
        k_prefix, v_prefix, prefix_lengths, G = prefix
        P = k_prefix.shape[2]
    S_prefix = cdiv(P, split)
    S = S_prefix + cdiv(T, split)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    counts = [] if count_tiles else None
    if out.numel() == 0:
        return (out, torch.zeros(0, dtype=torch.int32, device=q.device)) if count_tiles else out
    queries = B * H_q * L
    maxima = torch.empty((queries, S), dtype=torch.float32, device=q.device)
    sums = torch.empty((queries, S), dtype=torch.float32, device=q.device)
    acc = torch.empty((queries, S, D), dtype=torch.float32, device=q.device)
    qk_scale = float(scale) * LOG2E
    common = dict(S=S, T_suffix=T, qk_scale=qk_scale, split=split, dot_f32=dot_f32)
    if prefix is not None:
        counts = _launch_part(q, k_prefix, v_prefix, prefix_lengths, lengths, maxima, sums, acc, counts, rows=G,
                              prefix=True, slot0=0, **common)
    counts = _launch_part(q, k_cache, v_cache, lengths, lengths, maxima, sums, acc, counts, rows=1, prefix=False,
                          slot0=S_prefix, **common)
    H_kv = k_cache.shape[1]
    group = H_q // H_kv
    block_m, n_blocks, block_d, num_warps, _ = _blocks(1, group, L, D)
    _decode_attention_merge_kernel[(B * H_kv * n_blocks,)](
        maxima, sums, acc, lengths, lengths if prefix_lengths is None else prefix_lengths, out,
        H_kv, n_blocks, T, P, S, S_prefix, G,
        QUERIES=group * L, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, SPLIT=split, HAS_PREFIX=prefix is not None,
        CHUNK=MERGE_CHUNK, num_warps=num_warps)
    if count_tiles:
        return out, torch.cat(counts) if counts else torch.zeros(0, dtype=torch.int32, device=q.device)
    return out
