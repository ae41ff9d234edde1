"""Log-probs and the PPO actor loss from hidden states and the lm_head, never holding [N, V] logits.

    logits = hidden @ weight.T (+ bias),  logp = log softmax(logits / temperature)[label]

The tokens are cut into chunks of `chunk_size` rows. Per chunk the logits are a torch matmul
(cuBLAS on GPU); log-prob, entropy and log-sum-exp come from the fused log-prob kernel (GPU, or
FASTRLHF_BACKEND=triton) or the torch path (CPU); d(logits) overwrites the chunk's logits, and
    d(hidden)[chunk] = d(logits) @ weight,  d(weight) += d(logits)^T @ hidden[chunk],
    d(bias) += sum_rows d(logits).
Extra memory is O(chunk_size x V) plus the d(weight) accumulator, never O(N x V).

`linear_logprobs` takes any upstream gradient, so its forward keeps only logp, entropy and lse
per token and its backward recomputes each chunk's logits: 4 matmuls per chunk.

`linear_ppo_actor_loss` is a scalar whose every term is token-local once the aggregation
weights w = row_scale * mask are known, and they are known before the forward:
    loss = sum_i w_i (pg(logp_i) + kl_coef KL(logp_i) - entropy_coef H_i).
So, as Liger's fused linear cross-entropy, its forward forms the gradients too, per chunk:
    1. logits = h @ W^T (+ b)                                         matmul 1
    2. logp, entropy, lse                                             kernel or torch
    3. dL/dlogp, dL/dH of the chunk's tokens                          autograd on [n] vectors
    4. d(logits) in place of the logits                               kernel or torch
    5. d(hidden)[chunk] = d(logits) @ W,  d(W) += d(logits)^T @ h     matmuls 2 and 3
and its backward only scales d(hidden), d(weight), d(bias) by the upstream scalar: 3 matmuls
per chunk instead of 4. The price: those gradients live from the forward to the backward.

d(weight) accumulates in fp32 (fp64 for fp64 inputs) whatever the weight dtype: V x H x 4
bytes (2.5 GB at V = 151936, H = 4096), on top of the V x H result in the weight's dtype.
Re-exported by `fastrlhf.ops`, whose helpers this module imports lazily (ops imports it).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from fastrlhf import reference as ref

# Working memory one chunk may use: its logits (input dtype) plus, on the torch path, two
# fp32 [chunk, V] temporaries (log p and p). 64 MiB keeps a chunk cache-friendly on CPU and
# still gives >= 100-row matmuls at V = 151936 in bf16 on GPU.
CHUNK_BUDGET_BYTES = 64 * 2**20
CHUNK_MULTIPLE = 16  # chunk rows are a multiple of this (tensor-core friendly), unless N is smaller
# per-token values the fused actor loss keeps, one row each: its loss and what its stats average
TOKEN_TERMS = ("loss", "pg", "kl", "clipped", "clipped_lower", "neg_log_ratio", "entropy")
STATS = ("clipfrac", "clipfrac_lower", "approx_kl", "pg_loss", "entropy", "kl")


def _ops():
    from fastrlhf import ops  # lazy: ops imports this module

    return ops


def _auto_chunk_size(n_rows: int, vocab: int, element_size: int, use_triton: bool) -> int:
    """Rows per chunk such that the chunk's working memory fits CHUNK_BUDGET_BYTES."""
    per_row = vocab * (element_size if use_triton else element_size + 8)
    rows = max(CHUNK_BUDGET_BYTES // per_row, 1)
    if rows >= CHUNK_MULTIPLE:
        rows -= rows % CHUNK_MULTIPLE
    return int(min(rows, max(n_rows, 1)))


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 math and outputs whatever the input dtype; float64 stays float64 (ground-truth checks)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _weight_accum_dtype(weight: torch.Tensor, accum_dtype) -> torch.dtype:
    """dtype d(weight) accumulates in across chunks: fp32 by default (fp64 for fp64 weights).
    `accum_dtype=weight.dtype` accumulates straight into the gradient (as Liger's default):
    no V x H x 4-byte buffer, one rounding to the weight's dtype per chunk (cuBLAS still sums
    each chunk's product in fp32)."""
    if accum_dtype is None:
        return _acc_dtype(weight)
    if not isinstance(accum_dtype, torch.dtype) or not accum_dtype.is_floating_point:
        raise TypeError(f"accum_dtype must be None or a floating-point torch.dtype, got {accum_dtype!r}")
    return accum_dtype


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """[n, V] logits of one chunk in the input dtype (fp32 accumulation inside the matmul)."""
    if bias is None:
        return h @ weight.T
    return torch.addmm(bias, h, weight.T)


@functools.cache
def _addmm_writes_fp32(device: torch.device, dtype: torch.dtype) -> bool:
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


def _accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, a and b in the input dtype; each product accumulates in fp32 inside the
    matmul. acc in the same dtype (accum_dtype=weight.dtype): added in place by the matmul."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.dtype == torch.float32 and _addmm_writes_fp32(acc.device, a.dtype):  # cuBLAS adds as it writes
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:  # a [V, H] temporary in the input dtype, then added
        acc.add_(a @ b)


# ---------------------------------------------------------------- one chunk: kernel or torch


def _kernel_fwd(kernels, logits, labels, temperature, ignore_index, compute_entropy):
    """(logp, entropy or None, lse) fp32 [n] of one chunk from the fused kernel ([1, n] rows)."""
    logp, entropy, lse = kernels.logprobs_fwd(logits.unsqueeze(0), labels.unsqueeze(0),
                                              temperature=temperature, ignore_index=ignore_index,
                                              compute_entropy=compute_entropy)
    return logp.view(-1), None if entropy is None else entropy.view(-1), lse.view(-1)


def _kernel_bwd(kernels, logits, labels, lse, entropy, g_logp, g_ent, temperature, ignore_index):
    """d(logits) of one chunk from the fused kernel, written over the chunk's logits."""
    row = lambda x: None if x is None else x.unsqueeze(0)  # noqa: E731
    return kernels.logprobs_bwd(logits.unsqueeze(0), labels.unsqueeze(0), row(lse), row(entropy), row(g_logp),
                                row(g_ent), temperature=temperature, ignore_index=ignore_index,
                                inplace=True).squeeze(0)


def _log_softmax_torch(logits, temperature, lse=None):
    """(log softmax(logits / temperature), lse): fp32 (fp64) [n, V] and [n]. Overwrites an fp32
    `logits` (a fresh chunk); `lse` given (the backward's recompute) skips the log-sum-exp."""
    z = logits.to(_acc_dtype(logits))
    if temperature != 1.0:
        z.div_(temperature)
    if lse is None:
        lse = torch.logsumexp(z, dim=-1)
    return z.sub_(lse.unsqueeze(1)), lse


def _gather_logp_torch(log_p, labels, ignore_index):
    """log p[label] per row: 0 where label == ignore_index, NaN where it is outside [0, V)."""
    V = log_p.shape[1]
    valid = (labels >= 0) & (labels < V)
    logp = log_p.gather(1, torch.where(valid, labels, 0).unsqueeze(1)).squeeze(1)
    logp = torch.where(valid, logp, float("nan"))
    return torch.where(labels == ignore_index, 0.0, logp)


def _entropy_torch(log_p):
    """-sum p log p per row, formed in p's buffer; 0 log 0 = 0 where a logit is -inf."""
    p = log_p.exp()
    zero = p == 0
    return -p.mul_(log_p).masked_fill_(zero, 0.0).sum(-1)


def _dlogits_torch(log_p, logits, labels, entropy, g_logp, g_ent, temperature, ignore_index):
    """d(logits) of one chunk in logits.dtype; overwrites `log_p` and, when the dtypes differ,
    writes the result into `logits` (a fresh chunk).

    dz = g_logp (onehot - p) - g_ent p (log p + H);  d(logits) = dz / temperature
    """
    p = log_p.exp()
    V = log_p.shape[1]
    takes_grad = (labels >= 0) & (labels < V) & (labels != ignore_index)
    g_lp = torch.zeros_like(p[:, 0]) if g_logp is None else torch.where(takes_grad, g_logp, 0.0)
    if g_ent is not None:  # -p (g_lp + g_ent (log p + H)); p = 0 (a -inf logit) contributes 0
        t = log_p.add_(entropy.unsqueeze(1)).masked_fill_(p == 0, 0.0)
        dz = t.mul_(g_ent.unsqueeze(1)).add_(g_lp.unsqueeze(1)).mul_(p).neg_()
    else:
        dz = p.mul_(-g_lp.unsqueeze(1))
    dz.scatter_add_(1, torch.where(takes_grad, labels, 0).unsqueeze(1), g_lp.unsqueeze(1))
    if temperature != 1.0:
        dz.div_(temperature)
    if logits.dtype == dz.dtype:
        return dz
    return logits.copy_(dz)


# ---------------------------------------------------------------- linear_logprobs


class _LinearLogProbs(torch.autograd.Function):
    """hidden [N, H], weight [V, H], bias [V] or None, labels [N] int64 -> logp [N] (, entropy [N])."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, ignore_index, return_entropy, chunk_size,
                use_triton, accum_dtype):
        N = hidden.shape[0]
        kernels = _ops()._kernels("logprobs") if use_triton else None
        out_dtype = torch.float32 if use_triton else _acc_dtype(hidden)
        logp = torch.empty(N, dtype=out_dtype, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if return_entropy else None
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            logits = _chunk_logits(hidden[s:e], weight, bias)
            if use_triton:
                lp, ent, ls = _kernel_fwd(kernels, logits, labels[s:e], temperature, ignore_index, return_entropy)
            else:
                log_p, ls = _log_softmax_torch(logits, temperature)
                lp = _gather_logp_torch(log_p, labels[s:e], ignore_index)
                ent = _entropy_torch(log_p) if return_entropy else None
                del log_p
            logp[s:e], lse[s:e] = lp, ls
            if return_entropy:
                entropy[s:e] = ent
            del logits
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.args = (temperature, ignore_index, chunk_size, use_triton, accum_dtype)
        ctx.set_materialize_grads(False)
        return (logp, entropy) if return_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        temperature, ignore_index, chunk_size, use_triton, accum_dtype = ctx.args
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_logp is None and grad_entropy is None:
            return (None,) * 10
        acc = _weight_accum_dtype(weight, accum_dtype)
        g_logp = None if grad_logp is None else grad_logp.to(lse.dtype).contiguous()
        g_ent = None if grad_entropy is None else grad_entropy.to(lse.dtype).contiguous()
        kernels = _ops()._kernels("logprobs") if use_triton else None
        N, H = hidden.shape
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        d_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            h = hidden[s:e]
            gl = None if g_logp is None else g_logp[s:e]
            ge = None if g_ent is None else g_ent[s:e]
            ent = None if ge is None else entropy[s:e]
            logits = _chunk_logits(h, weight, bias)  # the recompute: this op's 4th matmul
            if use_triton:
                d_logits = _kernel_bwd(kernels, logits, labels[s:e], lse[s:e], ent, gl, ge, temperature,
                                       ignore_index)
            else:
                log_p, _ = _log_softmax_torch(logits, temperature, lse=lse[s:e])
                d_logits = _dlogits_torch(log_p, logits, labels[s:e], ent, gl, ge, temperature, ignore_index)
                del log_p
            if need_h:
                torch.mm(d_logits, weight, out=d_hidden[s:e])
            if need_w:
                _accumulate_product(d_weight, d_logits.T, h)
            if need_b:
                d_bias.add_(d_logits.sum(0, dtype=acc))
            del logits, d_logits
        d_weight = None if d_weight is None else d_weight.to(weight.dtype)
        d_bias = None if d_bias is None else d_bias.to(bias.dtype)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None, None


# ---------------------------------------------------------------- linear_ppo_actor_loss


class _ActorArgs(NamedTuple):
    """What the fused actor loss needs besides hidden, weight, bias and labels. Per-token
    tensors are flat [N] in the math dtype (fp32, fp64 for fp64 inputs on the torch path)."""

    old_logp: torch.Tensor
    advantages: torch.Tensor
    ref_logp: torch.Tensor | None
    mask: torch.Tensor  # 1 = the token counts (a float mask weighs, as in ops.policy_loss)
    token_weight: torch.Tensor  # w = row_scale[row] * mask: the loss is sum_i w_i l_i
    temperature: float
    ignore_index: int
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    clip_low: float
    clip_high: float
    dual_clip: float | None


def _token_terms(logp, entropy, a: _ActorArgs, s: slice):
    """(l, terms): the per-token loss l = pg + kl_coef KL - entropy_coef H of tokens s, and the
    TOKEN_TERMS rows after "loss", detached. The formulas are those of ops.policy_loss and
    ops.token_kl's torch path, so autograd through them gives reference.ppo_actor_loss's
    (sub)gradients, ties of clamp and max/min included."""
    pg, clipped, lower, log_ratio = _ops()._policy_losses_torch(logp, a.old_logp[s], a.advantages[s], a.clip_low,
                                                                a.clip_high, a.dual_clip)
    loss = pg
    kl = torch.zeros_like(pg)
    if a.ref_logp is not None:
        kl = ref.token_kl(logp, a.ref_logp[s], estimator=a.kl_estimator)
        if a.kl_coef != 0.0:
            loss = loss + a.kl_coef * kl
    if a.entropy_coef != 0.0:
        loss = loss - a.entropy_coef * entropy
    terms = torch.stack([pg, kl, clipped.to(pg.dtype), lower.to(pg.dtype), -log_ratio, entropy]).detach()
    return loss, terms


def _token_grads(logp, entropy, a: _ActorArgs, s: slice, need_grad: bool):
    """(TOKEN_TERMS values [7, n], dL/dlogp [n] or None, dL/dH [n] or None) of tokens s:
    autograd on the chunk's [n] vectors, L = sum_i w_i l_i."""
    if not need_grad:
        loss, terms = _token_terms(logp, entropy, a, s)
        return torch.cat([loss.unsqueeze(0), terms]), None, None
    with torch.enable_grad():
        lp, ent = logp.detach().requires_grad_(), entropy.detach().requires_grad_()
        loss, terms = _token_terms(lp, ent, a, s)
        # allow_unused: with entropy_coef = 0 the loss does not depend on H
        g_logp, g_ent = torch.autograd.grad((a.token_weight[s] * loss).sum(), (lp, ent), allow_unused=True)
    return torch.cat([loss.detach().unsqueeze(0), terms]), g_logp, g_ent


def _actor_chunk(s: slice, hidden, weight, bias, labels, a: _ActorArgs, kernels, out):
    """Steps 1-5 of the module docstring for the tokens s; writes out["tokens"][:, s] and, where
    present, out["d_hidden"][s] and adds into out["d_weight"], out["d_bias"]."""
    h, y = hidden[s], labels[s]
    need_grad = any(out[k] is not None for k in ("d_hidden", "d_weight", "d_bias"))
    logits = _chunk_logits(h, weight, bias)  # matmul 1
    if kernels is not None:
        logp, entropy, lse = _kernel_fwd(kernels, logits, y, a.temperature, a.ignore_index, True)
    else:
        log_p, lse = _log_softmax_torch(logits, a.temperature)
        logp, entropy = _gather_logp_torch(log_p, y, a.ignore_index), _entropy_torch(log_p)
    out["tokens"][:, s], g_logp, g_ent = _token_grads(logp, entropy, a, s, need_grad)
    if not need_grad:
        return
    if kernels is not None:
        d_logits = _kernel_bwd(kernels, logits, y, lse, entropy, g_logp, g_ent, a.temperature, a.ignore_index)
    else:
        d_logits = _dlogits_torch(log_p, logits, y, entropy, g_logp, g_ent, a.temperature, a.ignore_index)
    if out["d_hidden"] is not None:
        torch.mm(d_logits, weight, out=out["d_hidden"][s])  # matmul 2
    if out["d_weight"] is not None:
        _accumulate_product(out["d_weight"], d_logits.T, h)  # matmul 3
    if out["d_bias"] is not None:
        out["d_bias"].add_(d_logits.sum(0, dtype=out["d_bias"].dtype))


def _loss_and_stats(tokens: torch.Tensor, a: _ActorArgs):
    """loss = sum_i w_i l_i and the STATS (fp32 [6]) from the per-token TOKEN_TERMS values."""
    row = dict(zip(TOKEN_TERMS, tokens))
    m = a.mask
    inv_n = _ops()._safe_inverse(m.sum())
    masked_mean = lambda name: (m * row[name]).sum() * inv_n  # noqa: E731
    stats = torch.stack([masked_mean("clipped"), masked_mean("clipped_lower"), masked_mean("neg_log_ratio"),
                         (a.token_weight * row["pg"]).sum(), masked_mean("entropy"), masked_mean("kl")])
    return (a.token_weight * row["loss"]).sum(), stats.float()


class _LinearActorLoss(torch.autograd.Function):
    """hidden [N, H], weight [V, H], bias [V] or None, labels [N] int64 -> (loss 0-dim, STATS [6]).

    The forward forms the loss's gradients for the inputs in `needs` (module docstring); the
    backward hands them over once, scaled in place by the upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, args: _ActorArgs, needs, chunk_size, use_triton, accum_dtype):
        need_h, need_w, need_b = needs
        N = hidden.shape[0]
        acc = _weight_accum_dtype(weight, accum_dtype)
        # by default d(weight) accumulates in fp32: V x H x 4 bytes (2.5 GB at V = 151936,
        # H = 4096) held through the forward, then cast to the weight's dtype
        out = {"tokens": torch.empty(len(TOKEN_TERMS), N, dtype=args.token_weight.dtype, device=hidden.device),
               "d_hidden": torch.empty_like(hidden) if need_h else None,
               "d_weight": torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None,
               "d_bias": torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None}
        kernels = _ops()._kernels("logprobs") if use_triton else None
        for start in range(0, N, chunk_size):
            _actor_chunk(slice(start, min(start + chunk_size, N)), hidden, weight, bias, labels, args, kernels, out)
        ctx.grads = (out["d_hidden"],
                     None if out["d_weight"] is None else out["d_weight"].to(weight.dtype),
                     None if out["d_bias"] is None else out["d_bias"].to(bias.dtype))
        loss, stats = _loss_and_stats(out["tokens"], args)
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, grad_stats):
        if ctx.grads is None:
            raise RuntimeError("linear_ppo_actor_loss: backward through one loss twice is not supported; its "
                               "gradients are formed in the forward and handed over, scaled in place, once")
        grads, ctx.grads = ctx.grads, None
        d_hidden, d_weight, d_bias = (None if g is None else g.mul_(grad_loss) for g in grads)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None


# ---------------------------------------------------------------- public functions


def _check_linear_inputs(hidden, weight, labels, bias, temperature, chunk_size):
    ops = _ops()
    ops._check_float("hidden", hidden)
    ops._check_float("weight", weight)
    ops._check_int("labels", labels)
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
        ops._check_float("bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [V] = ({weight.shape[0]},), got shape {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}")
    for name, x in (("weight", weight), ("labels", labels), ("bias", bias)):
        if x is not None and x.device != hidden.device:
            raise ValueError(f"{name} is on {x.device} but hidden is on {hidden.device}; expected one device")
    temperature = ops._check_number("temperature", temperature, positive=True)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    return temperature


def _flat_rows(hidden, labels):
    """hidden as [N, H] with a unit last stride, labels as contiguous int64 [N]."""
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.stride(-1) != 1:
        h = h.contiguous()
    return h, labels.reshape(-1).long().contiguous()


def linear_logprobs(hidden, weight, labels, *, bias=None, temperature=1.0, return_entropy=False,
                    ignore_index=-100, chunk_size=None, accum_dtype=None):
    """`logprobs(hidden @ weight.T + bias, labels, ...)` without ever holding the [N, V] logits.

    hidden [..., H] bf16/fp16/fp32, weight [V, H] (the lm_head; may be tied to the embedding),
    bias [V] or None, labels [...] integer. Returns float32 logp [...] (and entropy [...]);
    gradients flow to hidden, weight and bias. `labels == ignore_index` gives 0 and no
    gradient, a label outside [0, V) gives NaN. `chunk_size` rows of logits exist at a time
    (None: picked from a memory budget). d(weight) accumulates over the chunks in fp32
    (`accum_dtype=None`, V x H x 4 bytes) or in `accum_dtype` (e.g. the weight's own dtype:
    no extra buffer, one rounding per chunk).
    """
    temperature = _check_linear_inputs(hidden, weight, labels, bias, temperature, chunk_size)
    out_shape = labels.shape
    h, y = _flat_rows(hidden, labels)
    use_triton = _ops()._use_triton(hidden)
    if chunk_size is None:
        chunk_size = _auto_chunk_size(h.shape[0], weight.shape[0], hidden.element_size(), use_triton)
    if h.shape[0] == 0:
        empty = (h.sum(-1) + weight.sum() * 0).to(_acc_dtype(hidden)).view(out_shape)
        return (empty, empty.clone()) if return_entropy else empty
    out = _LinearLogProbs.apply(h, weight, bias, y, temperature, int(ignore_index), bool(return_entropy),
                                int(chunk_size), use_triton, _weight_accum_dtype(weight, accum_dtype))
    if return_entropy:
        return out[0].view(out_shape), out[1].view(out_shape)
    return out.view(out_shape)


def _check_actor_inputs(hidden, old_logp, advantages, mask, ref_logp, kl_coef, kl_estimator, entropy_coef,
                        clip_low, clip_high, dual_clip, agg, global_num_tokens):
    """The checks of ops.policy_loss and ops.actor_loss_from_logprobs, against hidden.shape[:-1];
    returns the numbers as floats (clip_high defaulted to clip_low)."""
    ops = _ops()
    shape = tuple(hidden.shape[:-1])
    for name, x in (("old_logp", old_logp), ("advantages", advantages), ("ref_logp", ref_logp)):
        if x is None:
            continue
        ops._check_float(name, x)
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape hidden.shape[:-1] = {shape}, got {tuple(x.shape)}")
        if x.device != hidden.device:
            raise ValueError(f"{name} is on {x.device} but hidden is on {hidden.device}; expected one device")
    ops._check_mask(mask, old_logp, "old_logp")
    kl_coef = ops._check_number("kl_coef", kl_coef)
    entropy_coef = ops._check_number("entropy_coef", entropy_coef)
    ops._check_choice("kl_estimator", kl_estimator, ops.KL_ESTIMATORS)
    clip_low = ops._check_number("clip_low", clip_low, nonnegative=True)
    clip_high = clip_low if clip_high is None else ops._check_number("clip_high", clip_high, nonnegative=True)
    if dual_clip is not None:
        dual_clip = ops._check_number("dual_clip", dual_clip, above=1.0)
    ops._check_agg(agg, global_num_tokens)
    return kl_coef, entropy_coef, clip_low, clip_high, dual_clip


def linear_ppo_actor_loss(hidden, weight, labels, old_logp, advantages, mask, *, bias=None, chunk_size=None,
                          ref_logp=None, kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0, temperature=1.0,
                          clip_low=0.2, clip_high=None, dual_clip=None, agg="token-mean",
                          global_num_tokens=None, accum_dtype=None):
    """`ppo_actor_loss(hidden @ weight.T + bias, labels, ...)` without ever holding the logits:
    policy_loss + kl_coef * KL - entropy_coef * entropy, each aggregated with `agg`.

    hidden [B, T, H] (or [N, H] with [N]-shaped per-token tensors), weight [V, H].
    Returns (loss, stats) as `ppo_actor_loss`: clipfrac, clipfrac_lower, approx_kl, pg_loss,
    entropy and, with `ref_logp`, kl.

    Three matmuls per chunk of tokens, not four: the forward already forms d(hidden),
    d(weight) and d(bias) (for those that require grad, and only with grad mode on) and
    the backward scales them by the upstream gradient, so the loss supports one backward
    (a second through the same graph raises). Between the two they occupy N x H + V x H
    in the inputs' dtype; during the forward d(weight) accumulates in fp32, V x H x 4 bytes
    (2.5 GB at V = 151936, H = 4096), unless `accum_dtype` says otherwise (`weight.dtype`:
    accumulated straight into the gradient, one rounding per chunk, no extra buffer).
    """
    temperature = _check_linear_inputs(hidden, weight, labels, bias, temperature, chunk_size)
    kl_coef, entropy_coef, clip_low, clip_high, dual_clip = _check_actor_inputs(
        hidden, old_logp, advantages, mask, ref_logp, kl_coef, kl_estimator, entropy_coef, clip_low, clip_high,
        dual_clip, agg, global_num_tokens)
    ops = _ops()
    h, y = _flat_rows(hidden, labels)
    use_triton = ops._use_triton(hidden)
    math_dtype = torch.float32 if use_triton else _acc_dtype(hidden)
    rows = ops._as_rows(mask).float()
    scale = ops._row_scale(rows, agg, global_num_tokens)
    flat = lambda x: None if x is None else x.reshape(-1).to(math_dtype)  # noqa: E731
    args = _ActorArgs(flat(old_logp), flat(advantages), flat(ref_logp), flat(rows),
                      flat(scale.unsqueeze(1) * rows), temperature, -100, kl_coef, ops.KL_ESTIMATORS[kl_estimator],
                      entropy_coef, clip_low, clip_high, dual_clip)
    if h.shape[0] == 0:
        loss = (h.sum() + weight.sum() * 0).to(math_dtype) * 0.0
        zero = torch.zeros((), dtype=torch.float32, device=hidden.device)
        names = STATS if ref_logp is not None else STATS[:-1]
        return loss, {k: zero.clone() for k in names}
    if chunk_size is None:
        chunk_size = _auto_chunk_size(h.shape[0], weight.shape[0], hidden.element_size(), use_triton)
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and x is not None and x.requires_grad for x in (hidden, weight, bias))
    loss, stats = _LinearActorLoss.apply(h, weight, bias, y, args, needs, int(chunk_size), use_triton,
                                         _weight_accum_dtype(weight, accum_dtype))
    stats = dict(zip(STATS, stats.unbind()))
    if ref_logp is None:
        del stats["kl"]
    return loss, stats
