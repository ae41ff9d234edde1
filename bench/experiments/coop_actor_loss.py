"""EXPERIMENT: the fused PPO actor loss with each logit row split over cooperating programs.

Not part of the package: a candidate for `fastrlhf.kernels.ppo_loss.actor_loss_fwd` (same arguments, same
outputs), to be timed on an H100 before anything of it moves into kernels/.

Why. `_actor_loss_fwd_kernel` runs one program per token row and reads the row twice (pass 1: lse, entropy,
logp; pass 2: d(logits)). Measured on an H100 (bf16, B=16, T=1024, V=151936) its pass 2 is not served from
L2, so it moves 3 passes of DRAM traffic, as `logprobs` forward + backward does (1.09x their time). Issue 13
asks for <= 0.75x; only 1 read + 1 write of the logits (2/3 of logprobs fwd+bwd's 3 passes) gets there.

Design. Each row is cut into S = cdiv(V, CHUNK) chunks, one program each (grid N * S, the splits of a row
adjacent: pid = row * S + split). A program
    1. loads its CHUNK columns once, into registers (CHUNK = 32 x threads: 32 fp32 per thread), and its
       token's scalars (label, the label's logit, old_logp, advantage, mask, weight, ref_logp, IS weight);
    2. computes its partial base-2 stats (m, d, s) with `_online_tile` and stores them to scratch [3, N, S];
    3. arrives on the row's int32 counter (zeroed per launch): `tl.debug_barrier()`, then
       `tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")`;
    4. polls the counter until it reads S, at most `spin_limit` times: `tl.atomic_add(counter, 0,
       sem="acquire", scope="gpu")`, which Triton (3.8, 3.9) lowers to `ld.global.gpu.acquire.b32`;
    5. merges the S partials (M = max m_j, d = sum d_j 2^(m_j - M), s = sum 2^(m_j - M) (s_j + (m_j - M) d_j)),
       forms lse, entropy, logp and the token's gradient coefficients as `_actor_loss_row` does (with its own
       jit helpers: `_policy_token`, `_kl_derivative`, `_online_tile`, `_bwd_tile`, imported, not copied);
    6. writes d(logits) = p (a + b t) [+ g_logp / temperature at the label] for its chunk, from the registers.
Split 0 stores logp and entropy. Without NEED_GRAD only split 0 waits; the others arrive and finish.
Why not a persistent grid: with N * S short programs, the SM keeps several of them resident (ptxas,
sm_90, triton 3.9: 48 registers at 2048 x 4 warps and 4096 x 8, so ~10 and ~5 per SM; 114 at 8192 x 8,
2 per SM), so while one waits on its row's counter the others' loads keep DRAM busy; a persistent program
would sit idle in its own wait unless it software-pipelined the next chunk's loads through the spin,
which is more code than this experiment needs. (A persistent grid of at most one wave
with S <= grid size is also deadlock-free: the wait of a row's earliest program is only on items of the
same row, none of them behind that row in any program's queue. It is the next thing to try if the block
scheduler's cost for ~311k programs shows in the timings.)

Memory ordering. Writer: the stores of (m, d, s), then `tl.debug_barrier()` (bar.sync: every store of
the CTA is ordered before what follows), then one thread's `atom.global.gpu.acq_rel.add`: a release at
gpu scope, cumulative over the CTA's stores the barrier ordered before it (in the sm_90 PTX the scalar
stores and the atomic are issued by the same one thread anyway). Reader: the acquire that reads S
synchronises with every writer's release (all S adds precede the value S in the counter's modification
order); Triton broadcasts a scalar atomic's or acquire load's result to the CTA through shared memory
behind a bar.sync (seen in the PTX), so the CTA takes one uniform branch, and every thread's later loads
of the partials are ordered after the acquire. The arrival is acq_rel, not
release only, because the last program to arrive reads S from its own add and must acquire there. The
partial loads use `.cg` (L2, never a stale L1 line).

Co-residency and deadlock. CUDA does not promise that the S programs of a row run at the same time; a
program that spins on a partner not yet resident holds its SM slot. In practice the block scheduler
dispatches in increasing block index, so resident programs form a window over the pids and only the last
row in the window can be partly resident: its partners start as soon as earlier rows' programs finish.
That argument is about the hardware, not a guarantee. So the spin is bounded: after `spin_limit` polls a
program computes the row's stats itself, streaming the whole row from memory (correct, one extra read of
the row), and counts the event in `timeouts` [1] int32. No program ever waits without bound, so the kernel
always finishes, whatever the scheduling (MPS, other kernels sharing the GPU, the sequential interpreter).
A fallback program's lse may differ from the merged one in the last bits (another summation order); each
program of the row writes its own chunk with its own lse, so d(logits) stays within rounding of exact.
In the interpreter (CPU tests) programs run one after another: every program of a row but the last times
out and falls back, the last takes the cooperative path, so both paths run in every test.

Alignment. The chunk loads start at row_off + split * CHUNK: 16-byte aligned and vectorised (ld.global.v4)
when the row stride and V are multiples of 8 bf16 elements (V = 151936, contiguous; Triton specialises the
int arguments divisible by 16). Misaligned rows (V = 50257) get plain masked loads, not peeled as
kernels/logprobs.py does: acceptable for this experiment, and one reason V = 50257 is timed beside 151936.
In place (d(logits) over the logits) is refused: a fallback re-reads the whole row, which other programs
of the row may already have overwritten.

PREDICTION (not measured; the GPU run decides): each logit is read once and d(logits) written once, so
the kernel moves 2 of the 3 passes of logprobs fwd+bwd: ~0.67x its time at full bandwidth. Costs on top:
the wait (an L2 atomic round trip or two, ~1-2 us per program, hidden by the other resident programs only
if enough of them are loading at any time), the block scheduling of N * S programs, and one memset of the
counters. An H100 needs ~20 KiB of loads in flight per SM (Little's law: ~3.3 TB/s x ~0.8 us over 132 SMs);
8192 x 8 has 2 programs of 16 KiB per SM, and one of them is often waiting or writing, so it likely
falls short; 4096 x 8 and 2048 x 4 keep ~5 and ~10 smaller programs per SM, at the price of 2x and 4x
as many programs (more scheduling, more counter traffic). Expected: the best config at 0.70-0.80x
logprobs fwd+bwd at V = 151936 for the kernel alone (4096 x 8 the likeliest), the 0.75 target borderline
(ops.ppo_actor_loss adds its torch glue on top: the JSON's target_ratio_estimate); worse at V = 50257,
whose scalar 2-byte loads and stores need 96-213 registers. Timeouts: expected 0 on an
idle GPU; a count above a few per launch means the co-residency argument fails there.

Run: `python bench/experiments/coop_actor_loss.py --out FILE.json` on CUDA (under 2 minutes on an H100);
`--dry-run` runs the same on CPU in the interpreter at tiny shapes.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastrlhf.kernels.kl import ESTIMATOR_IDS, _kl_derivative  # noqa: E402
from fastrlhf.kernels.logprobs import FP32_MIN, LN2, LOG2E, _bwd_tile, _online_tile  # noqa: E402
from fastrlhf.kernels.policy_modes import SURROGATE, policy_token  # noqa: E402
from fastrlhf.kernels.ppo_loss import IGNORE, LR_CLAMP  # noqa: E402

CHUNK = 8192  # columns per program on CUDA: 32 fp32 per thread at 8 warps
NUM_WARPS = 8
# polls of the row counter before a program falls back to streaming its row. A poll is one L2 round trip
# (~0.5 us); a row's programs should all have arrived within a few us (one program's load), so 2048 polls
# (~1 ms) is far past a legitimate wait, and short enough that a GPU where waits never end still finishes
# (each program then streams its row after ~1 ms: slow, bounded). Not measured.
SPIN_LIMIT = 2048
# the (CHUNK, num_warps) pairs the GPU run times
# (an sm_90 compile with triton 3.9: registers 48 / 48 / 114 / 63 / 110, so about 10 / 5 / 2 / 2 / 1 programs
# per SM; at V = 50257, whose scalar loads need more: 96 / 128 / 213 / 121 / 128)
CONFIGS = ((2048, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16))
# the REREAD variant (issue 23, "the actor loss in two passes"): (CHUNK, num_warps, TILE), V split over
# cdiv(V, CHUNK) programs (10 and 5 at V = 151936) that each stream their chunk twice, the second time from L2:
# ~2-4 programs per SM x 32-64 KiB of chunk in flight is 8-35 MB of the H100's 50 MB L2, and a row's programs
# are adjacent pids that arrive within one chunk's load of each other. PREDICTION (not measured): one DRAM read
# and one write of the logits plus short waits: 0.70-0.80x logprobs fwd+bwd at V = 151936 for the best config.
REREAD_CONFIGS = ((16384, 8, 4096), (16384, 4, 2048), (32768, 8, 4096), (32768, 16, 8192))


# ---------------------------------------------------------------- kernel


@triton.jit
def _token_coefficients(logp, entropy, label, valid, row, old_ptr, adv_ptr, mask_ptr, weight_ptr, ref_ptr,
                        is_weights_ptr, inv_temperature, ratio_low, ratio_high, dual_clip, kl_coef, kl_clamp,
                        entropy_coef, DUAL_CLIP: tl.constexpr, HAS_IS_WEIGHTS: tl.constexpr, HAS_KL: tl.constexpr,
                        KL_ESTIMATOR: tl.constexpr, HAS_KL_CLAMP: tl.constexpr, KL_STRAIGHT_THROUGH: tl.constexpr,
                        HAS_ENTROPY: tl.constexpr):
    # the token's d(logits) = p (a + b t) [+ g_label at the label], from
    # L = sum_i w_i (is_i pg_i + kl_coef kl_i - entropy_coef H_i): the middle of `_actor_loss_row`
    # (kernels/ppo_loss.py), which has no helper of its own to import. Returns (a, b, g_label, takes_grad).
    counts = tl.load(mask_ptr + row) != 0.0  # a token with mask 0 gets exactly 0, whatever its inputs
    w = tl.load(weight_ptr + row)
    # verl's vanilla loss: kernels.policy_modes' clipped surrogate, log-ratio clamped to +-20
    _, d_pg, _, _, _, _, _ = policy_token(logp, tl.load(old_ptr + row), tl.load(adv_ptr + row), 0.0, 0.0, 0.0,
                                          ratio_low, ratio_high, 0.0, 0.0, dual_clip, 0.0, -LR_CLAMP, LR_CLAMP, 0.0,
                                          0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, SURROGATE, 0, DUAL_CLIP, False, True,
                                          True, False)
    pg_w = w
    if HAS_IS_WEIGHTS:
        pg_w = w * tl.load(is_weights_ptr + row)
    g_logp = pg_w * d_pg
    if HAS_KL:
        r = logp - tl.load(ref_ptr + row)
        if KL_STRAIGHT_THROUGH:
            d_kl = r
        else:
            d_kl = _kl_derivative(r, KL_ESTIMATOR, HAS_KL_CLAMP, kl_clamp)
        g_logp += kl_coef * w * d_kl
    takes_grad = counts & valid & (label != IGNORE)  # ignored / out-of-range labels: no log-prob, no gradient
    g_logp = tl.where(takes_grad, g_logp, 0.0)
    a_coef = -g_logp * inv_temperature
    b_coef = tl.zeros((), tl.float32)
    if HAS_ENTROPY:
        g_ent = tl.where(counts, -entropy_coef * w, 0.0)
        a_coef -= g_ent * entropy * inv_temperature
        b_coef = -g_ent * LN2 * inv_temperature
    return a_coef, b_coef, g_logp * inv_temperature, takes_grad


@triton.jit
def _coop_actor_loss_kernel(
    # pointers
    logits_ptr,  # [B, T, V] bf16/fp16/fp32, stride(-1) == 1
    labels_ptr,  # [B * T] int64; IGNORE_INDEX: logp 0, no gradient through it
    old_ptr,  # [B * T] fp32, read only if NEED_GRAD
    adv_ptr,  # [B * T] fp32, read only if NEED_GRAD
    mask_ptr,  # [B * T] fp32, read only if NEED_GRAD: a token with mask 0 gets no gradient
    weight_ptr,  # [B * T] fp32 w = row_scale * mask, read only if NEED_GRAD
    ref_ptr,  # [B * T] fp32, read only if NEED_GRAD and HAS_KL
    is_weights_ptr,  # [B * T] fp32, read only if NEED_GRAD and HAS_IS_WEIGHTS
    logp_ptr,  # [B * T] fp32 out
    entropy_ptr,  # [B * T] fp32 out
    dlogits_ptr,  # [B, T, V] logits dtype out, contiguous, written only if NEED_GRAD
    partial_ptr,  # [3, B * T, S] fp32 scratch: (m, d, s) of each chunk
    counter_ptr,  # [B * T] int32, zero at launch: programs of the row arrived
    timeouts_ptr,  # [1] int32, added to: programs that gave up waiting and streamed their row
    # shapes
    N,
    T,
    V,
    S,  # programs per row, cdiv(V, CHUNK)
    # strides
    stride_b,
    stride_t,
    # meta
    spin_limit,  # int32, polls of the counter before falling back
    scale,  # fp32, log2(e) / temperature
    inv_temperature,  # fp32
    ratio_low,  # fp32, 1 - clip_low
    ratio_high,  # fp32, 1 + clip_high
    dual_clip,  # fp32, used only when DUAL_CLIP
    kl_coef,  # fp32, used only when HAS_KL
    kl_clamp,  # fp32, used only when HAS_KL_CLAMP
    entropy_coef,  # fp32, used only when HAS_ENTROPY
    DUAL_CLIP: tl.constexpr,
    HAS_IS_WEIGHTS: tl.constexpr,
    HAS_KL: tl.constexpr,  # a KL term in the gradient: ref_logp given and kl_coef != 0
    KL_ESTIMATOR: tl.constexpr,  # kernels.kl.ESTIMATOR_IDS
    HAS_KL_CLAMP: tl.constexpr,
    KL_STRAIGHT_THROUGH: tl.constexpr,  # the KL gradient is r = logp - ref_logp (that of r^2 / 2)
    HAS_ENTROPY: tl.constexpr,  # entropy_coef != 0
    NEED_GRAD: tl.constexpr,
    CHUNK: tl.constexpr,  # columns per program, a power of two
    BLOCK_S: tl.constexpr,  # next power of two >= S
    TILE: tl.constexpr,  # columns per load; < CHUNK: the chunk is re-read from memory (L2) in step 6 (REREAD)
):
    REREAD: tl.constexpr = TILE < CHUNK
    pid = tl.program_id(0)
    row = (pid // S).to(tl.int64)
    split = pid % S
    row_off = (row // T) * stride_b + (row % T) * stride_t  # elements from logits_ptr, int64
    lo = split * CHUNK
    cols = tl.arange(0, CHUNK)
    in_row = lo + cols < V

    # 1. the chunk, once, into registers (REREAD: tile by tile, asking L2 to keep it for step 6); the token's
    # scalars (before the wait: their latency overlaps it)
    tiles = tl.arange(0, TILE)
    if not REREAD:
        x = tl.load(logits_ptr + row_off + lo + cols, mask=in_row, other=float("-inf")).to(tl.float32)
    label = tl.load(labels_ptr + row)
    valid = (label >= 0) & (label < V)
    x_label = tl.load(logits_ptr + row_off + tl.where(valid, label, 0), mask=valid, other=0.0).to(tl.float32)

    # 2. this chunk's base-2 stats: m = max y, d = sum 2^(y - m), s = sum 2^(y - m) (y - m), y = x scale
    m = tl.full((), FP32_MIN, tl.float32)
    d = tl.zeros((), tl.float32)
    s = tl.zeros((), tl.float32)
    if REREAD:
        for k in range(0, CHUNK, TILE):
            x_k = tl.load(logits_ptr + row_off + lo + k + tiles, mask=lo + k + tiles < V, other=float("-inf"),
                          eviction_policy="evict_last")
            m, d, s = _online_tile(x_k.to(tl.float32), m, d, s, scale, True)
    else:
        m, d, s = _online_tile(x, m, d, s, scale, True)
    NS = N * S
    slot = row * S + split
    tl.store(partial_ptr + slot, m)
    tl.store(partial_ptr + NS + slot, d)
    tl.store(partial_ptr + 2 * NS + slot, s)

    # 3. arrive: every store of the CTA before the barrier, the barrier before the release (module docstring)
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu") + 1
    needs_row = (split == 0) | NEED_GRAD  # without gradients only split 0 (logp, entropy) needs the row

    # 4. wait, at most spin_limit polls
    waiting = needs_row & (arrived < S)
    spins = 0
    while waiting & (spins < spin_limit):
        arrived = tl.atomic_add(counter_ptr + row, 0, sem="acquire", scope="gpu")
        waiting = arrived < S
        spins += 1

    if needs_row:
        # 5. the row's stats: merged from the S partials, or (timed out) streamed from memory
        if arrived >= S:
            j = tl.arange(0, BLOCK_S)
            ok = j < S
            m_j = tl.load(partial_ptr + row * S + j, mask=ok, other=FP32_MIN, cache_modifier=".cg")
            d_j = tl.load(partial_ptr + NS + row * S + j, mask=ok, other=0.0, cache_modifier=".cg")
            s_j = tl.load(partial_ptr + 2 * NS + row * S + j, mask=ok, other=0.0, cache_modifier=".cg")
            # M = max m_j, d = sum d_j 2^(m_j - M), s = sum 2^(m_j - M) (s_j + (m_j - M) d_j)
            m = tl.max(m_j, axis=0)
            alpha = tl.exp2(m_j - m)
            d = tl.sum(d_j * alpha, axis=0)
            s = tl.sum(alpha * (s_j + (m_j - m) * d_j), axis=0)
        else:
            tl.atomic_add(timeouts_ptr, 1, sem="relaxed", scope="gpu")
            m = tl.full((), FP32_MIN, tl.float32)
            d = tl.zeros((), tl.float32)
            s = tl.zeros((), tl.float32)
            for k in range(0, V, CHUNK):
                x_k = tl.load(logits_ptr + row_off + k + cols, mask=k + cols < V, other=float("-inf"))
                m, d, s = _online_tile(x_k.to(tl.float32), m, d, s, scale, True)
            if not REREAD:  # the own chunk again, so that it need not stay live in registers through the loop above
                x = tl.load(logits_ptr + row_off + lo + cols, mask=in_row, other=float("-inf")).to(tl.float32)
        log2_d = tl.log2(d)
        lse2 = m + log2_d  # lse / ln 2
        entropy = (log2_d - s / d) * LN2
        logp = tl.where(valid, x_label * inv_temperature - lse2 * LN2, float("nan"))
        logp = tl.where(label == IGNORE, 0.0, logp)
        if split == 0:
            tl.store(logp_ptr + row, logp)
            tl.store(entropy_ptr + row, entropy)

        # 6. d(logits) of the chunk, from the registers (REREAD: tile by tile from L2, the last read first)
        if NEED_GRAD:
            a_coef, b_coef, g_label, takes_grad = _token_coefficients(
                logp, entropy, label, valid, row, old_ptr, adv_ptr, mask_ptr, weight_ptr, ref_ptr, is_weights_ptr,
                inv_temperature, ratio_low, ratio_high, dual_clip, kl_coef, kl_clamp, entropy_coef, DUAL_CLIP,
                HAS_IS_WEIGHTS, HAS_KL, KL_ESTIMATOR, HAS_KL_CLAMP, KL_STRAIGHT_THROUGH, HAS_ENTROPY)
            label_col = tl.where(takes_grad, label - lo, -1).to(tl.int32)  # -1: no column of this chunk
            out_ty = dlogits_ptr.dtype.element_ty
            if REREAD:
                for i in range(0, CHUNK // TILE):
                    k = CHUNK - TILE - i * TILE
                    in_k = lo + k + tiles < V
                    x_k = tl.load(logits_ptr + row_off + lo + k + tiles, mask=in_k, other=0.0,
                                  eviction_policy="evict_first").to(tl.float32)
                    dz = _bwd_tile(x_k, scale, lse2, 0.0, a_coef, b_coef, HAS_ENTROPY)
                    dz += tl.where(tiles == label_col - k, g_label, 0.0)
                    tl.store(dlogits_ptr + row * V + lo + k + tiles, dz.to(out_ty), mask=in_k,
                             eviction_policy="evict_first")
            else:
                dz = _bwd_tile(x, scale, lse2, 0.0, a_coef, b_coef, HAS_ENTROPY)
                dz += tl.where(cols == label_col, g_label, 0.0)
                tl.store(dlogits_ptr + row * V + lo + cols, dz.to(out_ty), mask=in_row)


# ---------------------------------------------------------------- launcher


def default_config(V: int, device: torch.device) -> tuple[int, int]:
    """(CHUNK, num_warps): CHUNK x 8 warps on CUDA (fewer columns for a small V); in the interpreter a
    small chunk, so that tiny test rows still split over several programs."""
    if device.type == "cuda":
        chunk = min(CHUNK, max(1024, triton.next_power_of_2(V)))
        return chunk, max(1, min(NUM_WARPS, chunk // 1024))
    return 64, 1


def coop_actor_loss_fwd(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor,
    ref_logp: torch.Tensor | None,
    is_weights: torch.Tensor | None,
    *,
    temperature: float,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    kl_coef: float,
    kl_estimator: str,
    kl_clamp: float | None,
    kl_straight_through: bool,
    entropy_coef: float,
    need_grad: bool,
    inplace: bool = False,
    chunk: int | None = None,
    num_warps: int | None = None,
    spin_limit: int = SPIN_LIMIT,
    timeouts: torch.Tensor | None = None,
    tile: int | None = None,
):
    """`fastrlhf.kernels.ppo_loss.actor_loss_fwd` (the same arguments and outputs: logp fp32 [B * T],
    entropy fp32 [B * T], d(logits) [B, T, V] contiguous in logits.dtype or None) by cooperating programs
    (module docstring). Extra keywords: `chunk` (a power of two) and `num_warps` (default: `default_config`),
    `spin_limit` (polls before a program streams its row itself; 0: only the last program of a row to
    arrive merges), `timeouts` (int32 [1] on the logits' device, added to: how many programs fell back),
    `tile` (a power of two below `chunk`: the REREAD variant, which loads its chunk tile by tile in pass 1
    and re-reads it from L2 in pass 2 instead of holding it in registers).
    inplace=True is refused (a fallback re-reads the row)."""
    B, T, V = logits.shape
    N = B * T
    device = logits.device
    if logits.stride(-1) != 1 or labels.shape != (N,) or labels.dtype != torch.int64:
        raise ValueError(f"coop_actor_loss_fwd: logits [B, T, V] with stride(-1) == 1 and labels int64 [B * T], "
                         f"got {tuple(logits.shape)} strides {logits.stride()}, labels {labels.dtype} "
                         f"{tuple(labels.shape)}")
    if inplace:
        raise ValueError("coop_actor_loss_fwd: inplace=True is not supported (a program that falls back re-reads "
                         "the whole row, which others may have overwritten)")
    default_chunk, default_warps = default_config(V, device)
    chunk = default_chunk if chunk is None else int(chunk)
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"coop_actor_loss_fwd: chunk must be a power of two, got {chunk}")
    tile = chunk if tile is None else int(tile)
    if tile < 1 or tile & (tile - 1) or tile > chunk:
        raise ValueError(f"coop_actor_loss_fwd: tile must be a power of two <= chunk {chunk}, got {tile}")
    if timeouts is not None and (timeouts.shape != (1,) or timeouts.dtype != torch.int32
                                 or timeouts.device != device):
        raise ValueError(f"coop_actor_loss_fwd: timeouts must be int32 [1] on {device}, got {timeouts.dtype} "
                         f"{tuple(timeouts.shape)} on {timeouts.device}")
    logp = torch.empty(N, dtype=torch.float32, device=device)
    entropy = torch.empty(N, dtype=torch.float32, device=device)
    d_logits = torch.empty((B, T, V), dtype=logits.dtype, device=device) if need_grad else None
    if N == 0:
        return logp, entropy, d_logits
    S = triton.cdiv(V, chunk)
    partials = torch.empty((3, N, S), dtype=torch.float32, device=device)
    counters = torch.zeros(N, dtype=torch.int32, device=device)
    if timeouts is None:
        timeouts = torch.zeros(1, dtype=torch.int32, device=device)
    has_kl = ref_logp is not None and kl_coef != 0.0
    _coop_actor_loss_kernel[(N * S,)](
        logits, labels, old_logp, advantages, mask, weight,
        ref_logp if has_kl else old_logp,  # never read without HAS_KL
        is_weights if is_weights is not None else old_logp,  # never read without HAS_IS_WEIGHTS
        logp, entropy,
        d_logits if need_grad else logits,  # never written without NEED_GRAD
        partials, counters, timeouts,
        N, T, V, S,
        logits.stride(0), logits.stride(1),
        int(spin_limit), LOG2E / float(temperature), 1.0 / float(temperature), 1.0 - float(clip_low),
        1.0 + float(clip_high), float(dual_clip if dual_clip is not None else 0.0), float(kl_coef),
        float(kl_clamp if kl_clamp is not None else 0.0), float(entropy_coef),
        DUAL_CLIP=dual_clip is not None, HAS_IS_WEIGHTS=is_weights is not None, HAS_KL=has_kl,
        KL_ESTIMATOR=ESTIMATOR_IDS[kl_estimator], HAS_KL_CLAMP=kl_clamp is not None,
        KL_STRAIGHT_THROUGH=bool(kl_straight_through), HAS_ENTROPY=entropy_coef != 0.0, NEED_GRAD=need_grad,
        CHUNK=chunk, BLOCK_S=triton.next_power_of_2(S), TILE=tile,
        num_warps=default_warps if num_warps is None else num_warps,
    )
    return logp, entropy, d_logits


# ---------------------------------------------------------------- GPU run: check, then time


TARGET_SHAPES = ((16, 1024, 151936), (16, 1024, 50257))  # fastrlhf.bench.cases LOGITS_TARGET, LOGITS_TARGET_50K
DRY_SHAPES = ((1, 3, 300), (1, 3, 301))
DRY_CONFIGS = ((64, 1), (128, 2, 64))  # the register variant and the REREAD one


def _inputs(B: int, T: int, V: int, device: torch.device, seed: int = 0) -> dict:
    """The bench's own ppo_actor_loss inputs (fastrlhf.bench.cases: bf16 logits x 2, right-padded mask, ...)."""
    from fastrlhf.bench.cases import OPS, Case

    gen = torch.Generator(device=device).manual_seed(seed)
    return OPS["ppo_actor_loss"].inputs(Case("ppo_actor_loss", {"B": B, "T": T, "V": V}, torch.bfloat16,
                                             ("fwd+bwd",)), device, gen)


def spec_kwargs(flags: dict) -> dict:
    """`actor_loss_fwd`'s keywords (the options as one ActorSpec, need_grad) from this experiment's flat flags."""
    from fastrlhf.ops.losses import ActorSpec
    from fastrlhf.ops.policy_modes import make_spec

    dual = {} if flags.get("dual_clip") is None else {"dual_clip": flags["dual_clip"]}
    policy = make_spec("vanilla", clip_low=flags["clip_low"], clip_high=flags["clip_high"], **dual)
    return {"spec": ActorSpec(**{k: v for k, v in flags.items() if k in ActorSpec._fields}, policy=policy),
            "need_grad": flags["need_grad"]}


def _kernel_args(inputs: dict) -> tuple[tuple, dict]:
    """(positional, keyword) arguments of actor_loss_fwd for the bench's case, as ops.ppo_actor_loss forms
    them: token-mean weights mask / n, kl_coef 0.05 (k3), entropy_coef 0.01, clip 0.2 both sides."""
    from fastrlhf.bench.providers import ACTOR_KW

    mask = inputs["mask"].reshape(-1).float()
    args = (inputs["logits"].detach(), inputs["labels"].reshape(-1), inputs["old_logp"].reshape(-1).float(),
            inputs["advantages"].reshape(-1).float(), mask, mask / mask.sum().clamp_min(1.0),
            inputs["ref_logp"].reshape(-1).float(), None)
    flags = dict(temperature=1.0, clip_low=0.2, clip_high=0.2, dual_clip=None, kl_coef=ACTOR_KW["kl_coef"],
                 kl_estimator="k3", kl_clamp=None, kl_straight_through=False, entropy_coef=ACTOR_KW["entropy_coef"],
                 need_grad=True)
    return args, flags


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor, rows: int = 512) -> float:
    """max |a - b| in fp32 over row blocks (no full-size fp32 temporaries); NaN where only one is NaN."""
    a, b = (t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t[:, None] for t in (a, b))
    worst = 0.0
    for i in range(0, a.shape[0], rows):
        x, y = a[i:i + rows].float(), b[i:i + rows].float()
        if not torch.equal(torch.isnan(x), torch.isnan(y)):
            return float("nan")
        ok = ~torch.isnan(x)
        if ok.any():
            worst = max(worst, (x[ok] - y[ok]).abs().max().item())
    return worst


def _time_ms(fn, device: torch.device, grad_to_none=None) -> dict:
    """Median (p10, p90) ms: triton.testing.do_bench on CUDA (L2 flushed per call), else a few timed calls."""
    if device.type == "cuda":
        med, p10, p90 = triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none,
                                                quantiles=[0.5, 0.1, 0.9])
        return {"median_ms": med, "p10_ms": p10, "p90_ms": p90}
    fn()
    times = []
    for _ in range(3):
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(times), "p10_ms": min(times), "p90_ms": max(times)}


def run_shape(B: int, T: int, V: int, configs, device: torch.device, spin_limit: int) -> dict:
    """At one shape: coop vs actor_loss_fwd (max |diff| of logp, entropy, d(logits)) for each config, then
    the times of ops.logprobs fwd+bwd (issue 13's reference), ops.ppo_actor_loss fwd+bwd, the actor_loss_fwd
    kernel alone and the coop kernel per config, with its timeout count."""
    from fastrlhf import ops
    from fastrlhf.bench.measure import autotune_choices
    from fastrlhf.bench.providers import ACTOR_KW
    from fastrlhf.kernels.ppo_loss import actor_loss_fwd

    inputs = _inputs(B, T, V, device)
    logits = inputs["logits"]
    args, flags = _kernel_args(inputs)
    N, elem = B * T, logits.element_size()
    out = {"shape": {"B": B, "T": T, "V": V}, "dtype": "bfloat16", "flags": flags, "spin_limit": spin_limit,
           "logit_bytes": N * V * elem, "rows": []}
    with torch.no_grad(), autotune_choices() as chosen:
        want = actor_loss_fwd(*args, **spec_kwargs(flags))
    out["actor_loss_fwd_autotune"] = chosen

    # 1. correctness: coop vs the current fused kernel
    checks = []
    for chunk, warps, tile in (tuple(c) + (None,) * (3 - len(c)) for c in configs):
        timeouts = torch.zeros(1, dtype=torch.int32, device=device)
        got = coop_actor_loss_fwd(*args, **flags, chunk=chunk, num_warps=warps, spin_limit=spin_limit,
                                  timeouts=timeouts, tile=tile)
        check = {"chunk": chunk, "num_warps": warps, "tile": tile, "programs_per_row": triton.cdiv(V, chunk),
                 "max_abs_diff": {name: _max_abs_diff(g, w) for name, g, w in
                                  zip(("logp", "entropy", "d_logits"), got, want)},
                 "timeouts": int(timeouts.item())}
        checks.append(check)
        print(f"  check {chunk:>6} x {warps:>2} warps, tile {tile}: max|diff| " + ", ".join(
            f"{k} {v:.3g}" for k, v in check["max_abs_diff"].items()) + f"; timeouts {check['timeouts']}", flush=True)
        del got
    out["checks"] = checks
    del want

    # 2. times
    def row(name, timing, moved_bytes=None, **extra):
        entry = {"name": name, **timing, **extra}
        if moved_bytes:
            entry["gbps"] = moved_bytes / 1e9 / (timing["median_ms"] / 1e3)
        out["rows"].append(entry)
        print(f"  {name:<34} {timing['median_ms']:9.3f} ms" + (f"  {entry['gbps']:7.0f} GB/s" if moved_bytes else "")
              + "".join(f"  {k} {v}" for k, v in extra.items()), flush=True)
        return timing["median_ms"]

    g = torch.randn(B, T, device=device)
    labels = inputs["labels"]

    def logprobs_fwd_bwd():
        ops.logprobs(logits, labels).backward(g)

    def actor_fwd_bwd():
        ops.ppo_actor_loss(logits, labels, inputs["old_logp"], inputs["advantages"], inputs["mask"],
                           ref_logp=inputs["ref_logp"], **ACTOR_KW)[0].backward()

    three, two = 3 * N * V * elem, 2 * N * V * elem
    t_lp = row("ops.logprobs fwd+bwd", _time_ms(logprobs_fwd_bwd, device, [logits]), three)
    t_actor = row("ops.ppo_actor_loss fwd+bwd", _time_ms(actor_fwd_bwd, device, [logits]), three)
    with torch.no_grad():
        kernel_kw = spec_kwargs(flags)
        t_kernel = row("actor_loss_fwd kernel", _time_ms(lambda: actor_loss_fwd(*args, **kernel_kw), device), three)
        for chunk, warps, tile in (tuple(c) + (None,) * (3 - len(c)) for c in configs):
            timeouts = torch.zeros(1, dtype=torch.int32, device=device)
            calls = [0]

            def coop(chunk=chunk, warps=warps, tile=tile, timeouts=timeouts, calls=calls):
                calls[0] += 1
                coop_actor_loss_fwd(*args, **flags, chunk=chunk, num_warps=warps, spin_limit=spin_limit,
                                    timeouts=timeouts, tile=tile)

            timing = _time_ms(coop, device)
            name = f"coop {chunk} x {warps} warps" + ("" if tile is None else f", reread tiles of {tile}")
            t_coop = row(name, timing, two, timeouts=int(timeouts.item()), calls=calls[0])
            out["rows"][-1].update(chunk=chunk, num_warps=warps, tile=tile, over_logprobs=t_coop / t_lp,
                                   over_actor_kernel=t_coop / t_kernel,
                                   # the issue-13 ratio if ops.ppo_actor_loss launched this kernel instead
                                   target_ratio_estimate=(t_actor - t_kernel + t_coop) / t_lp)
    out["ppo_actor_loss_over_logprobs"] = t_actor / t_lp
    out["actor_kernel_over_logprobs"] = t_kernel / t_lp
    return out


def _print_table(record: dict) -> None:
    print(f"\n{'shape':<22} {'config':<16} {'ms':>9} {'/ logprobs':>11} {'/ kernel':>9} {'target est.':>12} "
          f"{'timeouts/calls':>15}")
    for case in record["cases"]:
        shape = "x".join(str(v) for v in case["shape"].values())
        for r in case["rows"]:
            if "chunk" not in r:
                continue
            tile = "" if r.get("tile") is None else f" t{r['tile']}"
            print(f"{shape:<22} {r['chunk']:>6} x {r['num_warps']:<2} w{tile:<6} {r['median_ms']:9.3f} "
                  f"{r['over_logprobs']:11.3f} {r['over_actor_kernel']:9.3f} {r['target_ratio_estimate']:12.3f} "
                  f"{r['timeouts']:>7}/{r['calls']:<7}")
        print(f"{shape:<22} {'ppo_actor_loss':<16} {'':>9} {case['ppo_actor_loss_over_logprobs']:11.3f}   "
              f"(today's issue-13 ratio; actor_loss_fwd kernel alone: {case['actor_kernel_over_logprobs']:.3f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check and time the cooperative split-row actor loss (experiment).")
    parser.add_argument("--out", help="write the JSON record here")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, in the Triton interpreter, at tiny shapes (tests the script, times nothing real)")
    parser.add_argument("--spin-limit", type=int, default=None,
                        help=f"polls before a program falls back (default {SPIN_LIMIT}; 1 with --dry-run, where "
                             "the programs run one after another and a wait can never end early)")
    args = parser.parse_args(argv)
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--dry-run needs TRITON_INTERPRET=1 before triton is imported (run this file as a script)")
        device, shapes, configs = torch.device("cpu"), DRY_SHAPES, DRY_CONFIGS
        spin_limit = 1 if args.spin_limit is None else args.spin_limit
    else:
        if not torch.cuda.is_available():
            parser.error("needs CUDA (or --dry-run)")
        device, shapes, configs = torch.device("cuda"), TARGET_SHAPES, REREAD_CONFIGS + CONFIGS
        spin_limit = SPIN_LIMIT if args.spin_limit is None else args.spin_limit
    from fastrlhf.bench.environment import environment

    record = {"experiment": "bench/experiments/coop_actor_loss.py", "command": " ".join(sys.argv),
              "dry_run": args.dry_run, "environment": environment(device), "cases": []}
    start = time.perf_counter()
    for i, (B, T, V) in enumerate(shapes):
        print(f"bf16 [{B} x {T} x {V}]", flush=True)
        record["cases"].append(run_shape(B, T, V, configs, device, spin_limit))
        record["finished"] = i == len(shapes) - 1
        record["wall_s"] = time.perf_counter() - start
        if args.out:  # after every shape: a run cut short by its time limit still leaves what it measured
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _print_table(record)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
