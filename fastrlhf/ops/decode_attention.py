"""Attention of a few query positions per row over a static KV cache: `decode_attention`
(kernels: fastrlhf/kernels/decode_attention.py).

    query i of L of row b sits at position P + n - L + i (n = lengths[b], P = its group's prefix length, 0
    without one) and attends the keys at positions <= its own: prefix slots 0..P-1, then suffix slots at P + s
    out = softmax(scale q . k) v over them (fp32 math), 0 for a query that sees none

Grouped-query heads without repeat_kv (query head h reads KV head h // (H_q / H_kv)); with `prefix`, G
consecutive rows share one prompt's K / V, stored and read once per group (cascade attention). The
reduction order over KV depends only on the row itself, never on the batch (docs/ops.md, "Decode
attention"). Custom op (what torch.compile sees; eager calls run the same body without the dispatcher):
fastrlhf::decode_attention. Forward only: no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastrlhf.ops._common import check_device, check_float, check_integer, check_number, check_tensor, use_triton
from fastrlhf.ops._dispatch import eager, register

MAX_HEAD_DIM = 256  # the kernels' head-dim tile; the torch path holds to the same contract
LENGTH_DTYPES = (torch.int32, torch.int64)

# ---------------------------------------------------------------- torch path


def _attend_row(q: Tensor, parts: list[tuple[Tensor, Tensor]], scale: float, L: int, dtype: torch.dtype) -> Tensor:
    """One row: q [H_kv, G_q * L, D] (the G_q query heads of each KV head, then the L positions) against the
    key / value parts [H_kv, n_j, D] in order (prefix, suffix), their slots at consecutive positions; the L
    queries at the last L positions. -> [H_kv, G_q * L, D]."""
    scores = [torch.matmul(q, k.to(dtype).transpose(-1, -2)) for k, _ in parts]
    scores = scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)
    n = scores.shape[-1]
    if L > 1:  # query i sees positions <= n - L + i
        positions = torch.arange(n, device=q.device)
        last = n - L + torch.arange(L, device=q.device).repeat(q.shape[1] // L)
        scores.masked_fill_(positions[None, :] > last[:, None], float("-inf"))
    weights = torch.softmax(scores.mul_(scale), dim=-1)
    if n < L:
        weights.nan_to_num_(0.0)  # the queries before the first slot see nothing: 0, not softmax's NaN
    if len(parts) == 1:
        return torch.matmul(weights, parts[0][1].to(dtype))
    P = parts[0][1].shape[1]
    out = torch.matmul(weights[..., :P], parts[0][1].to(dtype))
    return out.add_(torch.matmul(weights[..., P:], parts[1][1].to(dtype)))


def _decode_attention_torch(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scale: float,
                            k_prefix: Tensor | None, v_prefix: Tensor | None, prefix_lengths: Tensor | None,
                            group: int) -> Tensor:
    """Row by row, each row's scores and weights in one piece over its own written slots: every tensor shape
    follows from that row's lengths alone, so the batch, the other rows and their lengths never change
    the arithmetic of a row (no batched matmul whose blocking or split over the KV axis could depend on
    them). fp32 math (fp64 for fp64 inputs); reads the lengths on the host."""
    B, H_q, L, D = q.shape
    H_kv, T = k_cache.shape[1], k_cache.shape[2]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    n = lengths.clamp(0, T).tolist()
    P = [0] * B if k_prefix is None else prefix_lengths.clamp(0, k_prefix.shape[2]).tolist()
    for b in range(B):
        parts = []
        if k_prefix is not None and P[b // group]:
            p = P[b // group]
            parts.append((k_prefix[b // group, :, :p], v_prefix[b // group, :, :p]))
        if n[b]:
            parts.append((k_cache[b, :, :n[b]], v_cache[b, :, :n[b]]))
        if parts:
            qb = q[b].to(dtype).reshape(H_kv, H_q // H_kv * L, D)
            out[b] = _attend_row(qb, parts, scale, L, dtype).view(H_q, L, D)
    return out


# ---------------------------------------------------------------- fastrlhf::decode_attention


def _decode_attention_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scale: float,
                          k_prefix: Tensor | None, v_prefix: Tensor | None, prefix_lengths: Tensor | None, group: int,
                          use_triton: bool) -> Tensor:
    if not use_triton:
        return _decode_attention_torch(q, k_cache, v_cache, lengths, scale, k_prefix, v_prefix, prefix_lengths, group)
    from fastrlhf.kernels import decode_attention as kernels

    prefix = None if k_prefix is None else (k_prefix, v_prefix, prefix_lengths, group)
    return kernels.decode_attention_fwd(q, k_cache, v_cache, lengths, scale=scale, prefix=prefix)


def _fake(q, k_cache, v_cache, lengths, scale, k_prefix, v_prefix, prefix_lengths, group, use_triton):
    return q.new_empty(q.shape)


_decode_attention = register("decode_attention", _decode_attention_fwd, _fake)


def _check_lengths(name: str, lengths, rows: int, rows_what: str, like: Tensor) -> None:
    check_tensor(name, lengths)
    if lengths.dtype not in LENGTH_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {lengths.dtype}")
    if tuple(lengths.shape) != (rows,):
        raise ValueError(f"{name} must have shape {rows_what} = ({rows},), got {tuple(lengths.shape)}")
    check_device(name, lengths, "q", like)


def _check_kv(name: str, x, shape: tuple, what: str, q: Tensor) -> None:
    check_float(name, x)
    if x.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    if x.dim() != 4 or tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {what} = {shape}, got {tuple(x.shape)}")
    check_device(name, x, "q", q)


def _check_values(name: str, lengths: Tensor, top: int, what: str) -> None:
    """On the host only (a CPU tensor outside torch.compile): a CUDA tensor's values would cost a sync,
    and the kernels clamp them to [0, top] instead."""
    if lengths.numel() and bool(((lengths < 0) | (lengths > top)).any()):
        bad = lengths[(lengths < 0) | (lengths > top)][0].item()
        raise ValueError(f"{name} must lie in [0, {what} = {top}], got {bad}")


def _data(x: Tensor | None) -> Tensor | None:
    """x without its autograd history (the op has no gradient); itself when it has none (no dispatcher call)."""
    return x.detach() if x is not None and x.requires_grad else x


def decode_attention(q, k_cache, v_cache, lengths, *, scale, prefix=None):
    """Attention of L query positions per row over the written slots of a KV cache (docs/ops.md).

    Args:
        q: [B, H_q, L, D] bf16/fp16/fp32/fp64 queries; L = 1 to decode, more to verify drafted tokens.
        k_cache, v_cache: [B, H_kv, T, D] in q's dtype, H_q a multiple of H_kv (grouped-query heads);
            any strides.
        lengths: [B] int32/int64, slots written per row, 0 <= lengths <= T (suffix slots with a prefix).
        scale: the score scale, e.g. D ** -0.5.
        prefix: None, or (k_prefix, v_prefix, prefix_lengths, G): k_prefix, v_prefix [B / G, H_kv, P, D]
            shared by the G consecutive rows of each group, prefix_lengths [B / G] int32/int64 in [0, P].

    Returns:
        out [B, H_q, L, D] in q's dtype: query i of row b at position P_b + lengths[b] - L + i attends the
        keys at positions <= its own (the prefix first, then the row's own slots); 0 if it sees none. No
        gradient.
    """
    check_float("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must be [B, H_q, L, D], got shape {tuple(q.shape)}")
    B, H_q, L, D = q.shape
    check_float("k_cache", k_cache)
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [B, H_kv, T, D], got shape {tuple(k_cache.shape)}")
    H_kv, T = k_cache.shape[1], k_cache.shape[2]
    _check_kv("k_cache", k_cache, (B, H_kv, T, D), "[B, H_kv, T, D]", q)
    _check_kv("v_cache", v_cache, (B, H_kv, T, D), "k_cache's [B, H_kv, T, D]", q)
    if H_kv == 0 or H_q % H_kv:
        raise ValueError(f"q's heads H_q = {H_q} must be a multiple of k_cache's heads H_kv = {H_kv}")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"the head dim D = {D} must be at most {MAX_HEAD_DIM}")
    _check_lengths("lengths", lengths, B, "[B]", q)
    scale = check_number("scale", scale, positive=True)
    k_prefix = v_prefix = prefix_lengths = None
    group = 1
    if prefix is not None:
        if not isinstance(prefix, tuple | list) or len(prefix) != 4:
            got = f"{len(prefix)} items" if isinstance(prefix, tuple | list) else type(prefix).__name__
            raise TypeError(f"prefix must be (k_prefix, v_prefix, prefix_lengths, G), got {got}")
        k_prefix, v_prefix, prefix_lengths, group = prefix
        group = check_integer("prefix group G", group)
        if group < 1 or B % group:
            raise ValueError(f"the prefix group G = {group} must be >= 1 and divide the batch B = {B}")
        check_float("k_prefix", k_prefix)
        if k_prefix.dim() != 4:
            raise ValueError(f"k_prefix must be [B / G, H_kv, P, D], got shape {tuple(k_prefix.shape)}")
        shape = (B // group, H_kv, k_prefix.shape[2], D)
        _check_kv("k_prefix", k_prefix, shape, "[B / G, H_kv, P, D]", q)
        _check_kv("v_prefix", v_prefix, shape, "k_prefix's [B / G, H_kv, P, D]", q)
        _check_lengths("prefix_lengths", prefix_lengths, B // group, "[B / G]", q)
    if eager(q) and lengths.device.type == "cpu":
        _check_values("lengths", lengths, T, "k_cache's T")
        if prefix_lengths is not None:
            _check_values("prefix_lengths", prefix_lengths, k_prefix.shape[2], "k_prefix's P")
    return _decode_attention(_data(q), _data(k_cache), _data(v_cache), lengths, scale, _data(k_prefix),
                             _data(v_prefix), prefix_lengths, group, use_triton(q))
