"""Log-probs and the PPO actor loss from hidden states and the lm_head, never holding [N, V] logits:
`linear_logprobs`, `linear_ppo_actor_loss` (kernels: fastrlhf/kernels/logprobs.py, through ops.logprobs).

    logits = hidden @ weight.T (+ bias),  logp = log softmax(logits / temperature)[label]

The tokens are cut into chunks of `chunk_size` rows (by default as few chunks of balanced size as
fit 640 MiB of logits on CUDA, 64 MiB on CPU). Per chunk the logits are a torch matmul
(cuBLAS on GPU); log-prob, entropy and log-sum-exp come from `ops.logprobs.logprobs_fwd` (the
fused kernel, or the torch path); d(logits) overwrites the chunk's logits, and
    d(hidden)[chunk] = d(logits) @ weight,  d(weight) += d(logits)^T @ hidden[chunk],
    d(bias) += sum_rows d(logits).
Extra memory is O(chunk_size x V) plus the d(weight) accumulator, never O(N x V).

`linear_logprobs` takes any upstream gradient, so its forward keeps only logp, entropy and lse
per token and its backward recomputes each chunk's logits: 4 matmuls per chunk. When all tokens
fit one chunk (chunk_size >= N: the logits are within the chunk budget), the forward keeps that
chunk's logits for the backward instead: 3 matmuls, as the materialised expression.

`linear_ppo_actor_loss` is a scalar whose every term is token-local once the aggregation
weights w = row_scale * mask are known, and they are known before the forward:
    loss = sum_i w_i (pg(logp_i) + kl_coef KL(logp_i) - entropy_coef H_i).
So, as Liger's fused linear cross-entropy, its forward forms the gradients too, per chunk:
    1. logits = h @ W^T (+ b)                                         matmul 1
    2. logp, entropy, lse                                             steps 2-4: one kernel on the
    3. dL/dlogp, dL/dH of the chunk's tokens                          Triton path (kernels/ppo_loss.py);
    4. d(logits) in place of the logits                               torch: ops.logprobs, actor_token_terms
    5. d(hidden)[chunk] = d(logits) @ W,  d(W) += d(logits)^T @ h     matmuls 2 and 3
and its backward only scales d(hidden), d(weight), d(bias) by the upstream scalar: 3 matmuls
per chunk instead of 4. The price: those gradients live from the forward to the backward.

d(weight) accumulates in fp32 (fp64 for fp64 inputs) whatever the weight dtype: V x H x 4
bytes (2.5 GB at V = 151936, H = 4096), on top of the V x H result in the weight's dtype.

Custom ops: fastrlhf::linear_logprobs, fastrlhf::linear_logprobs_backward,
fastrlhf::linear_ppo_actor_loss.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from fastrlhf.constants import CHUNK_BUDGET_BYTES, CHUNK_BUDGET_BYTES_CUDA, IGNORE_INDEX
from fastrlhf.ops._common import (
    as_rows,
    check_device,
    check_float,
    check_int,
    check_integer,
    check_number,
    out_dtype,
    use_triton,
)
from fastrlhf.ops._dispatch import register
from fastrlhf.ops.logprobs import logprobs_bwd, logprobs_fwd
from fastrlhf.ops.losses import (
    ACTOR_STATS,
    TOKEN_TERMS,
    ActorSpec,
    ActorTerms,
    actor_loss_and_stats,
    actor_prologue,
    actor_token_terms,
    token_weights,
)

# Logits one chunk may hold (input dtype). On CUDA, CHUNK_BUDGET_BYTES_CUDA (640 MiB): 2048-row chunks at
# V = 151936 in bf16, so 8 chunks at N = 16384. Every chunk re-reads W in two matmuls and adds its d(W) product
# into the accumulator (a read and a write of V x H in the GEMM's epilogue: 2.5 GB in bf16, ~0.75 ms on an
# H100, next to ~3.3 ms for that chunk's d(W) GEMM), so fewer, larger chunks cost less; 640 MiB keeps the
# extra peak memory (the chunk's logits, which become d(logits) in place) well under 1 GiB. Measured on an
# H100 (bench/results/experiments/2026-11-23-h100-linear_chunks.json, both ops, fp32 and bf16 d(W)):
# 2048-row chunks are within 3% of the best size (3072 or 4096 rows) in all four cases, 1024 rows 4-11%
# slower; a budget for 3072 rows balances to 2736-row chunks at N = 16384, slower than 2048 in all four.
# On CPU, CHUNK_BUDGET_BYTES (64 MiB): the torch path's float32 temporaries are per block of rows inside
# ops.logprobs.
CHUNK_MULTIPLE = 16  # chunk rows are a multiple of this (tensor-core friendly), unless N is smaller


def auto_chunk_size(n_rows: int, vocab: int, element_size: int, cuda: bool = False) -> int:
    """Rows per chunk: as few chunks as the budget (CHUNK_BUDGET_BYTES_CUDA on CUDA, else
    CHUNK_BUDGET_BYTES) allows for the chunk's logits, of balanced sizes (multiples of CHUNK_MULTIPLE)."""
    budget = CHUNK_BUDGET_BYTES_CUDA if cuda else CHUNK_BUDGET_BYTES
    n_rows = max(n_rows, 1)
    rows = max(budget // (vocab * element_size), 1)
    if rows < CHUNK_MULTIPLE:
        return int(min(rows, n_rows))
    rows -= rows % CHUNK_MULTIPLE
    n_chunks = -(-n_rows // rows)
    balanced = -(-n_rows // n_chunks)  # <= rows; rounding it up to the multiple stays <= rows
    return int(min(-(-balanced // CHUNK_MULTIPLE) * CHUNK_MULTIPLE, rows, n_rows))


def weight_accum_dtype(weight: Tensor, accum_dtype) -> torch.dtype:
    """dtype d(weight) accumulates in across chunks: fp32 by default (fp64 for fp64 weights).
    `accum_dtype=weight.dtype` accumulates straight into the gradient (as Liger's default):
    no V x H x 4-byte buffer, one rounding to the weight's dtype per chunk (cuBLAS still sums
    each chunk's product in fp32)."""
    if accum_dtype is None:
        return out_dtype(weight)
    if not isinstance(accum_dtype, torch.dtype) or not accum_dtype.is_floating_point:
        raise TypeError(f"accum_dtype must be None or a floating-point torch.dtype, got {accum_dtype!r}")
    return accum_dtype


def chunk_logits(h: Tensor, weight: Tensor, bias) -> Tensor:
    """[n, V] logits of one chunk in the input dtype (fp32 accumulation inside the matmul)."""
    if bias is None:
        return h @ weight.T
    return torch.addmm(bias, h, weight.T)


@functools.cache
def addmm_writes_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)` runs here for an fp32
    acc and `dtype` a, b. aten::addmm.dtype_out has a CUDA kernel from torch 2.8 (Liger's fused
    linear cross-entropy accumulates d(weight) with it), none on CPU; probed once per device and
    dtype on a 2 x 2 case rather than trusted from a version number."""
    if device.type != "cuda":
        return False
    acc = torch.ones(2, 2, device=device)
    a = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):  # no such overload, or no kernel (NotImplementedError)
        return False
    return bool((acc == 3).all())


def accumulate_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, a and b in the input dtype; each product accumulates in fp32 inside the
    matmul. acc in the same dtype (accum_dtype=weight.dtype): added in place by the matmul."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.dtype == torch.float32 and addmm_writes_fp32(acc.device, a.dtype):  # cuBLAS adds as it writes
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:  # a [V, H] temporary in the input dtype, then added
        acc.add_(a @ b)


def _chunk_fwd(logits, labels, temperature, ignore_index, return_entropy, triton):
    """(logp, entropy or None, lse) [n] of one chunk's logits [n, V]."""
    return logprobs_fwd(logits.unsqueeze(0), labels.unsqueeze(0), temperature=temperature,
                        ignore_index=ignore_index, return_entropy=return_entropy, use_triton=triton)


def _chunk_bwd(logits, labels, lse, entropy, g_logp, g_ent, temperature, ignore_index, triton, inplace=True):
    """d(logits) [n, V] of one chunk, written over its logits (inplace) or into a new tensor."""
    return logprobs_bwd(logits.unsqueeze(0), labels.unsqueeze(0), lse, entropy, g_logp, g_ent,
                        temperature=temperature, ignore_index=ignore_index, inplace=inplace,
                        use_triton=triton).squeeze(0)


def _add_chunk_gradients(d_logits, h, weight, s: slice, d_hidden, d_weight, d_bias):
    """d(hidden)[s] = d(logits) @ W; d(W) += d(logits)^T @ h; d(b) += sum_rows d(logits) (those not None)."""
    if d_hidden is not None:
        torch.mm(d_logits, weight, out=d_hidden[s])
    if d_weight is not None:
        accumulate_product(d_weight, d_logits.T, h)
    if d_bias is not None:
        d_bias.add_(d_logits.sum(0, dtype=d_bias.dtype))


def _or_empty(t, like: Tensor) -> Tensor:
    return like.new_empty(0) if t is None else t


# ---------------------------------------------------------------- fastrlhf::linear_logprobs


def _linear_logprobs_op(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float,
                        ignore_index: int, return_entropy: bool, chunk_size: int, accum_dtype: torch.dtype | None,
                        keep_logits: bool, use_triton: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden [N, H], weight [V, H], bias [V], labels [N] int64 -> (logp, entropy ([0] unless
    return_entropy), lse, each [N]; the logits [N, V] with keep_logits (one chunk), else [0])."""
    N = hidden.shape[0]
    logp = torch.empty(N, dtype=out_dtype(hidden), device=hidden.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if return_entropy else logp.new_empty(0)
    kept = hidden.new_empty(0)
    for s in range(0, N, chunk_size):
        e = min(s + chunk_size, N)
        logits = chunk_logits(hidden[s:e], weight, bias)
        lp, ent, ls = _chunk_fwd(logits, labels[s:e], temperature, ignore_index, return_entropy, use_triton)
        logp[s:e], lse[s:e] = lp, ls
        if return_entropy:
            entropy[s:e] = ent
        if keep_logits:
            kept = logits
        del logits  # freed before the next chunk's are made: one chunk of logits at a time
    return logp, entropy, lse, kept


def _fake_linear_logprobs(hidden, weight, bias, labels, temperature, ignore_index, return_entropy, chunk_size,
                          accum_dtype, keep_logits, use_triton):
    N, dtype = hidden.shape[0], out_dtype(hidden)
    new = lambda n: hidden.new_empty(n, dtype=dtype)  # noqa: E731
    logits = hidden.new_empty((N, weight.shape[0]) if keep_logits else (0,))
    return new(N), new(N if return_entropy else 0), new(N), logits


def _linear_logprobs_backward_op(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, lse: Tensor,
                                 entropy: Tensor, logits: Tensor, grad_logp: Tensor | None,
                                 grad_entropy: Tensor | None, temperature: float, ignore_index: int, chunk_size: int,
                                 accum_dtype: torch.dtype | None, need_hidden: bool, need_weight: bool,
                                 need_bias: bool, use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(d_hidden, d_weight, d_bias), each [0] unless asked for; recomputes each chunk's logits unless
    the forward kept them (`logits` [N, V], one chunk; [0] otherwise)."""
    acc = weight_accum_dtype(weight, accum_dtype)
    need_bias = need_bias and bias is not None
    g_logp = None if grad_logp is None else grad_logp.to(lse.dtype)
    g_ent = None if grad_entropy is None else grad_entropy.to(lse.dtype)
    d_hidden = torch.empty_like(hidden) if need_hidden else None
    d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
    d_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_bias else None
    N = hidden.shape[0]
    for s in range(0, N, chunk_size):
        e = min(s + chunk_size, N)
        kept = logits.numel() > 0
        chunk = logits if kept else chunk_logits(hidden[s:e], weight, bias)  # the recompute: a 4th matmul
        d_logits = _chunk_bwd(chunk, labels[s:e], lse[s:e], None if g_ent is None else entropy[s:e],
                              None if g_logp is None else g_logp[s:e], None if g_ent is None else g_ent[s:e],
                              temperature, ignore_index, use_triton, inplace=not kept)
        _add_chunk_gradients(d_logits, hidden[s:e], weight, slice(s, e), d_hidden, d_weight, d_bias)
        del chunk, d_logits
    return (_or_empty(d_hidden, hidden), _or_empty(None if d_weight is None else d_weight.to(weight.dtype), weight),
            _or_empty(None if d_bias is None else d_bias.to(bias.dtype), weight))


def _fake_linear_logprobs_backward(hidden, weight, bias, labels, lse, entropy, logits, grad_logp, grad_entropy,
                                   temperature, ignore_index, chunk_size, accum_dtype, need_hidden, need_weight,
                                   need_bias, use_triton):
    need_bias = need_bias and bias is not None
    return (hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)),
            weight.new_empty(bias.shape if need_bias else (0,)))


_linear_logprobs_backward = register("linear_logprobs_backward", _linear_logprobs_backward_op,
                                     _fake_linear_logprobs_backward)


def _setup_linear_logprobs(ctx, inputs, output):
    (hidden, weight, bias, labels, temperature, ignore_index, return_entropy, chunk_size, accum_dtype, _keep,
     triton) = inputs
    _, entropy, lse, logits = output
    ctx.mark_non_differentiable(lse, logits)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy, logits)
    ctx.args = (temperature, ignore_index, return_entropy, chunk_size, accum_dtype, triton)


def _backward_linear_logprobs(ctx, grad_logp, grad_entropy, _grad_lse, _grad_logits):
    hidden, weight, bias, labels, lse, entropy, logits = ctx.saved_tensors
    temperature, ignore_index, return_entropy, chunk_size, accum_dtype, triton = ctx.args
    needs = ctx.needs_input_grad[:3]
    if not return_entropy:
        grad_entropy = None
    if not any(needs) or (grad_logp is None and grad_entropy is None):
        return (None,) * 11
    grads = _linear_logprobs_backward(hidden, weight, bias, labels, lse, entropy, logits, grad_logp, grad_entropy,
                                         temperature, ignore_index, chunk_size, accum_dtype, *needs, triton)
    return (*(g if need else None for g, need in zip(grads, needs)), *(None,) * 8)


_linear_logprobs = register("linear_logprobs", _linear_logprobs_op, _fake_linear_logprobs,
                            setup_context=_setup_linear_logprobs, backward=_backward_linear_logprobs)


# ---------------------------------------------------------------- fastrlhf::linear_ppo_actor_loss


def _linear_actor_loss_op(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, old_logp: Tensor,
                          advantages: Tensor, mask: Tensor, token_weight: Tensor, ref_logp: Tensor | None,
                          is_weights: Tensor | None, temperature: float, kl_coef: float, kl_estimator: str,
                          kl_clamp: float | None, kl_straight_through: bool, entropy_coef: float, clip_low: float,
                          clip_high: float, dual_clip: float | None, chunk_size: int,
                          accum_dtype: torch.dtype | None, need_hidden: bool, need_weight: bool, need_bias: bool,
                          use_triton: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """hidden [N, H], weight [V, H], bias [V], per-token [N] -> (loss, ACTOR_STATS [6], d_hidden,
    d_weight, d_bias): the forward forms the gradients asked for (module docstring), [0] otherwise."""
    N = hidden.shape[0]
    dtype = out_dtype(hidden)
    acc = weight_accum_dtype(weight, accum_dtype)
    need_bias = need_bias and bias is not None
    need_grad = need_hidden or need_weight or need_bias
    spec = ActorSpec(temperature, kl_coef, kl_estimator, kl_clamp, kl_straight_through, entropy_coef, clip_low,
                     clip_high, dual_clip)  # rebuilt from the custom-op boundary's scalars
    terms = ActorTerms(old_logp, advantages, mask, token_weight, ref_logp, is_weights, spec)
    # by default d(weight) accumulates in fp32: V x H x 4 bytes (2.5 GB at V = 151936, H = 4096)
    # held through the forward, then cast to the weight's dtype
    d_hidden = torch.empty_like(hidden) if need_hidden else None
    d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
    d_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_bias else None
    if use_triton:  # per chunk, one fused kernel forms d(logits) over the logits (kernels/ppo_loss.py)
        from fastrlhf.kernels import ppo_loss as kernels

        f32 = lambda t: None if t is None else t.float().contiguous()  # noqa: E731
        per_token = tuple(f32(t) for t in (old_logp, advantages, mask, token_weight, ref_logp, is_weights))
        cut = lambda t, s: None if t is None else t[s]  # noqa: E731
        logp = torch.empty(N, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        for start in range(0, N, chunk_size):
            s = slice(start, min(start + chunk_size, N))
            h = hidden[s]
            logits = chunk_logits(h, weight, bias)  # matmul 1
            # d(logits) is written over `logits` and returned as that same tensor: left unbound, so that
            # `del logits` below frees the chunk before the next one is made
            logp[s], entropy[s] = kernels.actor_loss_fwd(
                logits.unsqueeze(0), labels[s], *(cut(t, s) for t in per_token), spec=spec, need_grad=need_grad,
                inplace=True)[:2]
            if need_grad:  # the logits now hold d(logits)
                _add_chunk_gradients(logits, h, weight, s, d_hidden, d_weight, d_bias)  # matmuls 2 and 3
            del logits
        rows, _, _ = actor_token_terms(logp.to(dtype), entropy.to(dtype), terms, need_grad=False)
    else:
        rows = torch.empty(len(TOKEN_TERMS), N, dtype=dtype, device=hidden.device)
        for start in range(0, N, chunk_size):
            s = slice(start, min(start + chunk_size, N))
            h, y = hidden[s], labels[s]
            logits = chunk_logits(h, weight, bias)  # matmul 1
            logp, entropy, lse = _chunk_fwd(logits, y, temperature, IGNORE_INDEX, True, use_triton)
            rows[:, s], g_logp, g_ent = actor_token_terms(logp, entropy, terms.at(s), need_grad)
            if need_grad:
                d_logits = _chunk_bwd(logits, y, lse, entropy, g_logp, g_ent, temperature, IGNORE_INDEX, use_triton)
                _add_chunk_gradients(d_logits, h, weight, s, d_hidden, d_weight, d_bias)  # matmuls 2 and 3
                del d_logits  # the chunk's logits, written over
            del logits
    loss, stats = actor_loss_and_stats(rows, mask.sum(), spec)
    return (loss, stats, _or_empty(d_hidden, hidden),
            _or_empty(None if d_weight is None else d_weight.to(weight.dtype), weight),
            _or_empty(None if d_bias is None else d_bias.to(bias.dtype), weight))


def _fake_linear_ppo_actor_loss(hidden, weight, bias, labels, old_logp, advantages, mask, token_weight, ref_logp,
                                is_weights, temperature, kl_coef, kl_estimator, kl_clamp, kl_straight_through,
                                entropy_coef, clip_low, clip_high, dual_clip, chunk_size, accum_dtype, need_hidden,
                                need_weight, need_bias, use_triton):
    dtype = out_dtype(hidden)
    need_bias = need_bias and bias is not None
    return (hidden.new_empty((), dtype=dtype), hidden.new_empty(len(ACTOR_STATS), dtype=dtype),
            hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)),
            weight.new_empty(bias.shape if need_bias else (0,)))


def _setup_linear_actor(ctx, inputs, output):
    _, stats, d_hidden, d_weight, d_bias = output
    ctx.mark_non_differentiable(stats, d_hidden, d_weight, d_bias)
    ctx.set_materialize_grads(False)
    needs = inputs[-4:-1]  # need_hidden, need_weight, need_bias
    # kept as attributes, not saved tensors: the backward scales them in place, once
    ctx.grads = tuple(g if need else None for g, need in zip((d_hidden, d_weight, d_bias), needs))
    ctx.n_inputs = len(inputs)


def _backward_linear_actor(ctx, grad_loss, *_):
    if ctx.grads is None:
        raise RuntimeError("linear_ppo_actor_loss: backward through one loss twice is not supported; its "
                           "gradients are formed in the forward and handed over, scaled in place, once")
    grads, ctx.grads = ctx.grads, None
    if grad_loss is None:
        return (None,) * ctx.n_inputs
    d_hidden, d_weight, d_bias = (None if g is None else g.mul_(grad_loss) for g in grads)
    return (d_hidden, d_weight, d_bias) + (None,) * (ctx.n_inputs - 3)


_linear_actor_loss = register("linear_ppo_actor_loss", _linear_actor_loss_op, _fake_linear_ppo_actor_loss,
                              setup_context=_setup_linear_actor, backward=_backward_linear_actor)


# ---------------------------------------------------------------- public functions


def _check_linear_inputs(hidden, weight, labels, bias, temperature, chunk_size, accum_dtype) -> float:
    check_float("hidden", hidden)
    check_float("weight", weight)
    check_int("labels", labels)
    if hidden.dim() < 1:
        raise ValueError("hidden must be [N, H] or [..., H], got a 0-dim tensor")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, "
                         f"got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must have a non-empty vocab dimension, got V = 0")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(labels.shape)}")
    if bias is not None:
        check_float("bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [V] = ({weight.shape[0]},), got shape {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}")
    for name, x in (("weight", weight), ("labels", labels), ("bias", bias)):
        if x is not None:
            check_device(name, x, "hidden", hidden)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    weight_accum_dtype(weight, accum_dtype)
    return check_number("temperature", temperature, positive=True)


def _flat_rows(hidden, labels):
    """hidden as [N, H] with a unit last stride, labels as contiguous int64 [N]."""
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.stride(-1) != 1:
        h = h.contiguous()
    return h, labels.reshape(-1).long().contiguous()


def linear_logprobs(hidden, weight, labels, *, bias=None, temperature=1.0, return_entropy=False,
                    ignore_index=IGNORE_INDEX, chunk_size=None, accum_dtype=None):
    """`logprobs(hidden @ weight.T + bias, labels, ...)` without ever holding the [N, V] logits
    (docs/ops.md).

    Args:
        hidden: [..., H] bf16/fp16/fp32/fp64.
        weight: [V, H] (the lm_head; may be tied to the embedding), hidden's dtype.
        labels: hidden.shape[:-1] integer; `ignore_index` gives logp 0 and no gradient, a label
            outside [0, V) gives NaN.
        bias: [V] or None.
        temperature, return_entropy, ignore_index: as `logprobs`.
        chunk_size: rows of logits that exist at a time (None: from a 640 MiB budget on CUDA, 64 MiB on
            CPU, in balanced chunks). When one
            chunk holds all rows, the forward keeps its logits for the backward (3 matmuls, not 4).
        accum_dtype: what d(weight) accumulates in over the chunks: None = fp32 (V x H x 4 bytes),
            or e.g. the weight's own dtype (no extra buffer, one rounding per chunk).

    Returns:
        logp [...] float32 (float64 for float64 hidden), and entropy [...] with return_entropy;
        gradients flow to hidden, weight and bias.
    """
    temperature = _check_linear_inputs(hidden, weight, labels, bias, temperature, chunk_size, accum_dtype)
    h, y = _flat_rows(hidden, labels)
    if chunk_size is None:
        chunk_size = auto_chunk_size(h.shape[0], weight.shape[0], hidden.element_size(), hidden.is_cuda)
    keep_logits = chunk_size >= h.shape[0] and torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (hidden, weight, bias))
    ignore_index = check_integer("ignore_index", ignore_index)
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    logp, entropy, *_ = _linear_logprobs(h, weight, bias, y, temperature, ignore_index, bool(return_entropy),
                                         int(chunk_size), accum_dtype, keep_logits, use_triton(hidden), grad=grad)
    if return_entropy:
        return logp.view(labels.shape), entropy.view(labels.shape)
    return logp.view(labels.shape)


def linear_ppo_actor_loss(hidden, weight, labels, old_logp, advantages, mask, *, bias=None, chunk_size=None,
                          ref_logp=None, kl_coef=0.0, kl_estimator="k3", kl_clamp=None, kl_straight_through=False,
                          entropy_coef=0.0, temperature=1.0, clip_low=0.2, clip_high=None, dual_clip=None,
                          is_weights=None, agg="token-mean", global_num_tokens=None, global_num_seqs=None, dp_size=1,
                          loss_scale_factor=None, accum_dtype=None):
    """`ppo_actor_loss(hidden @ weight.T + bias, labels, ...)` without ever holding the logits:
    policy_loss + kl_coef * KL - entropy_coef * entropy, each aggregated with `agg` (docs/ops.md).

    Args:
        hidden: [B, T, H] (or [N, H] with [N]-shaped per-token tensors); weight [V, H]; bias [V] or None.
        labels, old_logp, advantages, mask, ref_logp, is_weights: hidden.shape[:-1]; as `ppo_actor_loss`.
        chunk_size, accum_dtype: as `linear_logprobs`.
        the rest: as `ppo_actor_loss`.

    Returns:
        (loss, stats) as `ppo_actor_loss`: clipfrac, clipfrac_lower, approx_kl, pg_loss, entropy
        and, with `ref_logp`, kl.

    Three matmuls per chunk of tokens, not four: the forward already forms d(hidden), d(weight)
    and d(bias) (for those that require grad, and only with grad mode on) and the backward scales
    them by the upstream gradient, so the loss supports one backward (a second through the same
    graph raises). Between the two they occupy N x H + V x H in the inputs' dtype; during the
    forward d(weight) accumulates in fp32, V x H x 4 bytes (2.5 GB at V = 151936, H = 4096),
    unless `accum_dtype` says otherwise (`weight.dtype`: accumulated straight into the gradient,
    one rounding per chunk, no extra buffer).
    """
    _check_linear_inputs(hidden, weight, labels, bias, temperature, chunk_size, accum_dtype)
    agg_, spec = actor_prologue(
        tuple(hidden.shape[:-1]), hidden.device, "hidden.shape[:-1]", old_logp, advantages, mask, ref_logp,
        is_weights, kl_coef=kl_coef, kl_estimator=kl_estimator, kl_clamp=kl_clamp,
        kl_straight_through=kl_straight_through, entropy_coef=entropy_coef, temperature=temperature,
        clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, agg=agg, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, dp_size=dp_size, loss_scale_factor=loss_scale_factor)
    h, y = _flat_rows(hidden, labels)
    dtype = out_dtype(hidden)
    rows = as_rows(mask.detach())
    flat = lambda t: None if t is None else t.detach().reshape(-1).to(dtype)  # noqa: E731
    if chunk_size is None:
        chunk_size = auto_chunk_size(h.shape[0], weight.shape[0], hidden.element_size(), hidden.is_cuda)
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and x is not None and x.requires_grad for x in (hidden, weight, bias))
    loss, stats, *_ = _linear_actor_loss(
        h, weight, bias, y, flat(old_logp), flat(advantages), flat(rows), token_weights(rows, agg_, dtype).reshape(-1),
        flat(ref_logp), flat(is_weights), *spec, int(chunk_size), accum_dtype, *needs, use_triton(hidden),
        grad=any(needs))
    names = ACTOR_STATS if ref_logp is not None else ACTOR_STATS[:-1]
    return loss, dict(zip(names, stats.unbind()))
