"""Log-probs and the PPO actor loss from hidden states and the lm_head, never holding [N, V] logits.

    logits = hidden @ weight.T (+ bias),  logp = log softmax(logits / temperature)[label]

The tokens are cut into chunks of `chunk_size` rows. The forward computes each chunk's
logits (a torch matmul: cuBLAS on GPU), runs the fused log-prob/entropy kernel on them (GPU,
or FASTRLHF_BACKEND=triton) or the torch path (CPU), and keeps only logp, entropy and the
log-sum-exp per token. The backward recomputes each chunk's logits, turns them into
d(logits) in place, and accumulates
    d(hidden)[chunk] = d(logits) @ weight,   d(weight) += d(logits)^T @ hidden[chunk]  (fp32),
    d(bias) += sum_rows d(logits)  (fp32).
Extra memory is O(chunk_size x V) plus the fp32 d(weight) accumulator, never O(N x V).
Re-exported by `fastrlhf.ops`, whose helpers this module imports lazily (ops imports it).
"""

from __future__ import annotations

import torch

# Working memory one chunk may use: its logits (input dtype) plus, on the torch path, two
# fp32 [chunk, V] temporaries (log p and p). 64 MiB keeps a chunk cache-friendly on CPU and
# still gives >= 100-row matmuls at V = 151936 in bf16 on GPU.
CHUNK_BUDGET_BYTES = 64 * 2**20
CHUNK_MULTIPLE = 16  # chunk rows are a multiple of this (tensor-core friendly), unless N is smaller


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


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """[n, V] logits of one chunk in the input dtype (fp32 accumulation inside the matmul)."""
    if bias is None:
        return h @ weight.T
    return torch.addmm(bias, h, weight.T)


# ---------------------------------------------------------------- torch path for one chunk


def _chunk_fwd_torch(logits, labels, temperature, ignore_index, compute_entropy):
    """(logp, entropy or None, lse) fp32 [n] of one chunk; may overwrite `logits` (a fresh chunk)."""
    z = logits.to(_acc_dtype(logits))  # aliases an fp32 chunk: fine, the chunk is ours
    if temperature != 1.0:
        z.div_(temperature)
    lse = torch.logsumexp(z, dim=-1)
    log_p = z.sub_(lse.unsqueeze(1))
    V = z.shape[1]
    valid = (labels >= 0) & (labels < V)
    logp = log_p.gather(1, torch.where(valid, labels, 0).unsqueeze(1)).squeeze(1)
    logp = torch.where(valid, logp, float("nan"))
    logp = torch.where(labels == ignore_index, 0.0, logp)
    entropy = None
    if compute_entropy:  # -sum p log p, formed in p's buffer: no third [n, V] temporary
        entropy = -log_p.exp().mul_(log_p).sum(-1)
    return logp, entropy, lse


def _chunk_bwd_torch(logits, labels, lse, entropy, g_logp, g_ent, temperature, ignore_index):
    """d(logits) of one chunk in logits.dtype; overwrites `logits` (a fresh recomputed chunk).

    dz = g_logp (onehot - p) - g_ent p (log p + H);  d(logits) = dz / temperature
    """
    z = logits.to(_acc_dtype(logits))
    if temperature != 1.0:
        z.div_(temperature)
    log_p = z.sub_(lse.unsqueeze(1))
    p = log_p.exp()
    V = z.shape[1]
    takes_grad = (labels >= 0) & (labels < V) & (labels != ignore_index)
    g_lp = torch.zeros_like(lse) if g_logp is None else torch.where(takes_grad, g_logp, 0.0)
    if g_ent is not None:  # -p (g_lp + g_ent (log p + H))
        dz = log_p.add_(entropy.unsqueeze(1)).mul_(g_ent.unsqueeze(1)).add_(g_lp.unsqueeze(1)).mul_(p).neg_()
    else:
        dz = p.mul_(-g_lp.unsqueeze(1))
    dz.scatter_add_(1, torch.where(takes_grad, labels, 0).unsqueeze(1), g_lp.unsqueeze(1))
    if temperature != 1.0:
        dz.div_(temperature)
    if logits.dtype == dz.dtype:
        return dz
    return logits.copy_(dz)


# ---------------------------------------------------------------- autograd


class _LinearLogProbs(torch.autograd.Function):
    """hidden [N, H], weight [V, H], bias [V] or None, labels [N] int64 -> logp [N] (, entropy [N])."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, ignore_index, return_entropy, chunk_size,
                use_triton):
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
                lp, ent, ls = kernels.logprobs_fwd(logits.unsqueeze(0), labels[s:e].unsqueeze(0),
                                                   temperature=temperature, ignore_index=ignore_index,
                                                   compute_entropy=return_entropy)
                lp, ls, ent = lp.view(-1), ls.view(-1), None if ent is None else ent.view(-1)
            else:
                lp, ent, ls = _chunk_fwd_torch(logits, labels[s:e], temperature, ignore_index, return_entropy)
            logp[s:e], lse[s:e] = lp, ls
            if return_entropy:
                entropy[s:e] = ent
            del logits
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.args = (temperature, ignore_index, chunk_size, use_triton)
        ctx.set_materialize_grads(False)
        return (logp, entropy) if return_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        temperature, ignore_index, chunk_size, use_triton = ctx.args
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_logp is None and grad_entropy is None:
            return (None,) * 9
        acc = _acc_dtype(weight)
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
            logits = _chunk_logits(h, weight, bias)
            if use_triton:  # [1, n] rows for the [B, T]-shaped launcher; d(logits) overwrites the chunk
                row = lambda x: None if x is None else x.unsqueeze(0)  # noqa: E731
                d_logits = kernels.logprobs_bwd(
                    logits.unsqueeze(0), labels[s:e].unsqueeze(0), row(lse[s:e]), row(ent), row(gl), row(ge),
                    temperature=temperature, ignore_index=ignore_index, inplace=True).squeeze(0)
            else:
                d_logits = _chunk_bwd_torch(logits, labels[s:e], lse[s:e], ent, gl, ge, temperature,
                                            ignore_index)
            if need_h:
                torch.mm(d_logits, weight, out=d_hidden[s:e])
            if need_w:
                if d_logits.dtype == acc:
                    d_weight.addmm_(d_logits.T, h)
                else:  # fp32 accumulation across chunks; each chunk's product accumulates in fp32 inside
                    d_weight.add_(d_logits.T @ h)
            if need_b:
                d_bias.add_(d_logits.sum(0, dtype=acc))
            del logits, d_logits
        d_weight = None if d_weight is None else d_weight.to(weight.dtype)
        d_bias = None if d_bias is None else d_bias.to(bias.dtype)
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


def linear_logprobs(hidden, weight, labels, *, bias=None, temperature=1.0, return_entropy=False,
                    ignore_index=-100, chunk_size=None):
    """`logprobs(hidden @ weight.T + bias, labels, ...)` without ever holding the [N, V] logits.

    hidden [..., H] bf16/fp16/fp32, weight [V, H] (the lm_head; may be tied to the embedding),
    bias [V] or None, labels [...] integer. Returns float32 logp [...] (and entropy [...]);
    gradients flow to hidden, weight and bias. `labels == ignore_index` gives 0 and no
    gradient, a label outside [0, V) gives NaN. `chunk_size` rows of logits exist at a time
    (None: picked from a memory budget).
    """
    temperature = _check_linear_inputs(hidden, weight, labels, bias, temperature, chunk_size)
    out_shape = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.stride(-1) != 1:
        h = h.contiguous()
    y = labels.reshape(-1).long().contiguous()
    use_triton = _ops()._use_triton(hidden)
    if chunk_size is None:
        chunk_size = _auto_chunk_size(h.shape[0], weight.shape[0], hidden.element_size(), use_triton)
    if h.shape[0] == 0:
        empty = (h.sum(-1) + weight.sum() * 0).to(_acc_dtype(hidden)).view(out_shape)
        return (empty, empty.clone()) if return_entropy else empty
    out = _LinearLogProbs.apply(h, weight, bias, y, temperature, int(ignore_index), bool(return_entropy),
                                int(chunk_size), use_triton)
    if return_entropy:
        return out[0].view(out_shape), out[1].view(out_shape)
    return out.view(out_shape)


def linear_ppo_actor_loss(hidden, weight, labels, old_logp, advantages, mask, *, bias=None, chunk_size=None,
                          ref_logp=None, kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0, temperature=1.0,
                          clip_low=0.2, clip_high=None, dual_clip=None, agg="token-mean",
                          global_num_tokens=None):
    """`ppo_actor_loss(hidden @ weight.T + bias, labels, ...)` without ever holding the logits:
    policy_loss + kl_coef * KL - entropy_coef * entropy, each aggregated with `agg`.

    hidden [B, T, H] (or [N, H] with [N]-shaped per-token tensors), weight [V, H].
    Returns (loss, stats) as `ppo_actor_loss`: clipfrac, clipfrac_lower, approx_kl, pg_loss,
    entropy and, with `ref_logp`, kl.
    """
    ops = _ops()
    ops._check_float("old_logp", old_logp)
    if tuple(old_logp.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"old_logp must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(old_logp.shape)}")
    logp, entropy = linear_logprobs(hidden, weight, labels, bias=bias, temperature=temperature,
                                    return_entropy=True, chunk_size=chunk_size)
    return ops.actor_loss_from_logprobs(
        logp, entropy, old_logp, advantages, mask, ref_logp=ref_logp, kl_coef=kl_coef,
        kl_estimator=kl_estimator, entropy_coef=entropy_coef, clip_low=clip_low, clip_high=clip_high,
        dual_clip=dual_clip, agg=agg, global_num_tokens=global_num_tokens)
