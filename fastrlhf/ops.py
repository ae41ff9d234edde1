"""Public fastrlhf ops: input checks, autograd Functions, dispatch.

CUDA tensors run the Triton kernels in `fastrlhf.kernels`; CPU tensors run a torch path
(fp32 math, the same conventions). `FASTRLHF_BACKEND=triton` forces the kernels (on CPU
they need `TRITON_INTERPRET=1`, which the tests set), `FASTRLHF_BACKEND=torch` forces torch.

Conventions (DESIGN.md, the op contract): verl's `core_algos` by default, OpenRLHF's and
TRL's by option. Log-probs, entropy, KL, advantages and losses come out in float32
(float64 for float64 inputs on the torch path). `mask` is bool, integer or float [B, T],
1 = the token counts.

Every PPO loss aggregates with per-row weights, so one kernel serves all of verl's modes:
    loss = sum_b scale[b] * sum_t mask[b, t] * l[b, t]
    token-mean               scale = 1 / (global_num_tokens or sum(mask))
    seq-mean-token-sum       scale = 1 / B
    seq-mean-token-mean      scale = 1 / (n_b * #rows with n_b > 0)
    seq-mean-token-sum-norm  scale = 1 / T
"""

from __future__ import annotations

import math
import numbers
import os

import torch

from fastrlhf import reference as ref

KL_ESTIMATORS = ref.KL_ESTIMATORS
AGG_MODES = ref.AGG_MODES
MASK_MODES = ref.MASK_MODES
BACKENDS = ("auto", "torch", "triton")


# ---------------------------------------------------------------- dispatch


def _use_triton(tensor: torch.Tensor) -> bool:
    """True when `tensor` should go through the Triton kernels."""
    backend = os.environ.get("FASTRLHF_BACKEND", "auto").lower()
    if backend not in BACKENDS:
        raise ValueError(f"FASTRLHF_BACKEND must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return tensor.is_cuda
    return backend == "triton"


def _kernels(name: str):
    """Import a kernel module on first use: CPU-only users never import triton."""
    import importlib

    return importlib.import_module(f"fastrlhf.kernels.{name}")


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _f32(x: torch.Tensor) -> torch.Tensor:
    """Upcast for the torch path (float64 stays float64)."""
    return x.to(_out_dtype(x))


# ---------------------------------------------------------------- input checks


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _check_float(name: str, x) -> None:
    _check_tensor(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (bf16/fp16/fp32/fp64), got {x.dtype}")


def _check_int(name: str, x) -> None:
    _check_tensor(name, x)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of token ids, got {x.dtype}")


def _check_mask(mask, like_tensor: torch.Tensor, like: str) -> None:
    _check_tensor("mask", mask)
    if mask.is_complex():
        raise TypeError(f"mask must be bool, integer or float, got {mask.dtype}")
    if tuple(mask.shape) != tuple(like_tensor.shape):
        raise ValueError(f"mask must have the shape of {like} {tuple(like_tensor.shape)}, got {tuple(mask.shape)}")
    if mask.device != like_tensor.device:
        raise ValueError(f"mask is on {mask.device} but {like} is on {like_tensor.device}; expected one device")


def _check_same(first: str, x: torch.Tensor, **others) -> None:
    """Every tensor in `others` has x's shape and device."""
    for name, y in others.items():
        if y is None:
            continue
        _check_tensor(name, y)
        if tuple(y.shape) != tuple(x.shape):
            raise ValueError(f"{name} must have the shape of {first} {tuple(x.shape)}, got {tuple(y.shape)}")
        if y.device != x.device:
            raise ValueError(f"{name} is on {y.device} but {first} is on {x.device}; expected one device")


def _check_number(name: str, value, *, positive=False, nonnegative=False, above=None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite real number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if nonnegative and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if above is not None and value <= above:
        raise ValueError(f"{name} must be > {above}, got {value}")
    return float(value)


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def _check_clamp(clamp):
    return None if clamp is None else _check_number("clamp", clamp, positive=True)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, T] view of a per-token tensor ([T] -> [1, T]; [...] -> [-1, T]), contiguous."""
    if x.dim() == 1:
        x = x.unsqueeze(0)
    elif x.dim() > 2:
        x = x.reshape(-1, x.shape[-1])
    return x.contiguous()


# ---------------------------------------------------------------- log-probs and entropy


def _as_3d(logits: torch.Tensor) -> torch.Tensor:
    """[B, T, V] view of logits[..., V] without copying (dims 0 and 1 may have any
    stride, e.g. logits[:, :-1]); only a non-unit vocab stride forces a copy."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if logits.dim() == 1:
        return logits.view(1, 1, -1)
    if logits.dim() == 2:
        return logits.unsqueeze(0)
    if logits.dim() == 3:
        return logits
    return logits.flatten(0, -3)


class _LogProbs(torch.autograd.Function):
    """Triton log-probs (+ entropy); the backward writes d(logits) once."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index, return_entropy, inplace_backward):
        k = _kernels("logprobs")
        x = _as_3d(logits)
        y = labels.reshape(x.shape[:2]).long().contiguous()
        logp, entropy, lse = k.logprobs_fwd(x, y, temperature=temperature, ignore_index=ignore_index,
                                            compute_entropy=return_entropy)
        ctx.save_for_backward(x, y, lse, entropy)
        ctx.args = (temperature, ignore_index, inplace_backward, logits.shape)
        ctx.set_materialize_grads(False)
        out_dtype = _out_dtype(logits)
        if return_entropy:
            return logp.view(labels.shape).to(out_dtype), entropy.view(labels.shape).to(out_dtype)
        return logp.view(labels.shape).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        temperature, ignore_index, inplace, shape = ctx.args
        x, y, lse, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return (None,) * 6
        rows = lambda g: None if g is None else g.reshape(y.shape).float().contiguous()  # noqa: E731
        dx = _kernels("logprobs").logprobs_bwd(
            x, y, lse, entropy, rows(grad_logp), rows(grad_entropy),
            temperature=temperature, ignore_index=ignore_index, inplace=inplace)
        return dx.view(shape) if dx.is_contiguous() else dx.reshape(shape), None, None, None, None, None


def _row_chunks(x: torch.Tensor, rows: int):
    """(rows [n, V] view, flat start, flat end) covering x [B, T, V] in chunks of <= `rows` rows;
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


class _LogProbsTorch(torch.autograd.Function):
    """The torch path with the kernel's algorithm: rows in chunks, the forward keeps only the
    log-sum-exp (and entropy) per row, the backward recomputes p chunk by chunk and writes
    d(logits) once. A few fp32 [chunk, V] temporaries, never an [N, V] softmax held for autograd."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index, return_entropy):
        x = _as_3d(logits)
        y = labels.reshape(x.shape[:2]).long().reshape(-1)
        acc = _out_dtype(logits)
        n = y.numel()
        logp = torch.empty(n, dtype=acc, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if return_entropy else None
        rows = _linear._auto_chunk_size(n, x.shape[-1], x.element_size(), use_triton=False)
        for block, s, e in _row_chunks(x, rows):
            # _log_softmax_torch overwrites an input already in `acc`: give it a copy
            log_p, lse[s:e] = _linear._log_softmax_torch(block.clone() if block.dtype == acc else block, temperature)
            logp[s:e] = _linear._gather_logp_torch(log_p, y[s:e], ignore_index)
            if return_entropy:
                entropy[s:e] = _linear._entropy_torch(log_p)
        ctx.save_for_backward(x, y, lse, entropy)
        ctx.args = (temperature, ignore_index, rows, logits.shape)
        ctx.set_materialize_grads(False)
        if return_entropy:
            return logp.view(labels.shape), entropy.view(labels.shape)
        return logp.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        x, y, lse, entropy = ctx.saved_tensors
        temperature, ignore_index, rows, shape = ctx.args
        if grad_logp is None and grad_entropy is None:
            return (None,) * 5
        flat = lambda g: None if g is None else g.reshape(-1).to(lse.dtype)  # noqa: E731
        g_logp, g_ent = flat(grad_logp), flat(grad_entropy)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dx_rows = dx.view(-1, x.shape[-1])
        for block, s, e in _row_chunks(x, rows):
            d_block = dx_rows[s:e]
            log_p, _ = _linear._log_softmax_torch(block.clone() if block.dtype == lse.dtype else block, temperature,
                                                  lse=lse[s:e])
            d = _linear._dlogits_torch(log_p, d_block, y[s:e], None if g_ent is None else entropy[s:e],
                                       None if g_logp is None else g_logp[s:e],
                                       None if g_ent is None else g_ent[s:e], temperature, ignore_index)
            if d.data_ptr() != d_block.data_ptr():
                d_block.copy_(d)
        return dx.view(shape), None, None, None, None


def logprobs(logits, labels, *, temperature=1.0, return_entropy=False, ignore_index=-100,
             inplace_backward=False):
    """Per-token log softmax(logits / temperature)[labels], optionally with the entropy.

    logits [..., V] bf16/fp16/fp32 (any strides but the vocab one: `logits[:, :-1]` is not
    copied); labels [...] integer. Returns float32 logp [...] (and entropy [...]).
    `labels == ignore_index` gives 0 and no gradient; a label outside [0, V) gives NaN.
    `logits` is never modified, except with `inplace_backward=True` (Triton path), where
    the backward writes d(logits) into the logits' own storage: use it only when nothing
    reads the logits after the backward.
    """
    _check_float("logits", logits)
    _check_int("labels", labels)
    if logits.dim() < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
                         f"got {tuple(labels.shape)}")
    if labels.device != logits.device:
        raise ValueError(f"labels is on {labels.device} but logits is on {logits.device}; expected one device")
    temperature = _check_number("temperature", temperature, positive=True)
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty vocab dimension, got V = 0")
    if labels.numel() == 0:
        empty = logits.sum(-1).to(_out_dtype(logits))
        return (empty, empty.clone()) if return_entropy else empty
    if _use_triton(logits):
        return _LogProbs.apply(logits, labels, temperature, int(ignore_index), bool(return_entropy),
                               bool(inplace_backward))
    return _LogProbsTorch.apply(logits, labels, temperature, int(ignore_index), bool(return_entropy))


# ---------------------------------------------------------------- KL


class _TokenKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, ref_logp, estimator, clamp):
        k = _kernels("kl")
        lp, rp = logp.contiguous(), ref_logp.contiguous()
        ctx.save_for_backward(lp, rp)
        ctx.args = (estimator, clamp)
        return k.token_kl_fwd(lp, rp, estimator=estimator, clamp=clamp).to(_out_dtype(logp))

    @staticmethod
    def backward(ctx, grad):
        lp, rp = ctx.saved_tensors
        estimator, clamp = ctx.args
        d = _kernels("kl").token_kl_bwd(lp, rp, grad.float().contiguous(), estimator=estimator, clamp=clamp)
        d_logp = d.to(lp.dtype) if ctx.needs_input_grad[0] else None
        d_ref = (-d).to(rp.dtype) if ctx.needs_input_grad[1] else None
        return d_logp, d_ref, None, None


def token_kl(logp, ref_logp, *, estimator="k1", clamp=None):
    """Per-token KL estimate, r = logp - ref_logp:
    k1 = r, k2 = r^2 / 2, k3 = exp(-r) - 1 + r (r clamped to +-20 inside exp), abs = |r|;
    aliases kl, mse, low_var_kl. `clamp` bounds the output to [-clamp, clamp]
    (verl: low_var_kl with clamp=10; OpenRLHF: clamp=10)."""
    _check_float("logp", logp)
    _check_float("ref_logp", ref_logp)
    _check_same("logp", logp, ref_logp=ref_logp)
    _check_choice("estimator", estimator, KL_ESTIMATORS)
    clamp = _check_clamp(clamp)
    name = KL_ESTIMATORS[estimator]
    if logp.numel() == 0:
        return (logp - ref_logp).to(_out_dtype(logp))
    if _use_triton(logp):
        return _TokenKL.apply(logp, ref_logp, name, clamp)
    return ref.token_kl(_f32(logp), _f32(ref_logp), estimator=name, clamp=clamp)


def kl_shaped_rewards(scores, logp, ref_logp, mask, *, kl_coef, estimator="k1", clamp=None):
    """Per-token rewards [B, T]: -kl_coef * KL on every mask=1 token, plus scores[b] on the
    last mask=1 token of row b; 0 where mask = 0. No gradient (rewards are data)."""
    _check_float("logp", logp)
    _check_float("ref_logp", ref_logp)
    _check_float("scores", scores)
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    _check_same("logp", logp, ref_logp=ref_logp)
    _check_mask(mask, logp, "logp")
    if tuple(scores.shape) != (logp.shape[0],):
        raise ValueError(f"scores must have shape [B] = ({logp.shape[0]},), got {tuple(scores.shape)}")
    if scores.device != logp.device:
        raise ValueError(f"scores is on {scores.device} but logp is on {logp.device}; expected one device")
    kl_coef = _check_number("kl_coef", kl_coef)
    _check_choice("estimator", estimator, KL_ESTIMATORS)
    clamp = _check_clamp(clamp)
    name = KL_ESTIMATORS[estimator]
    with torch.no_grad():
        if logp.numel() == 0:
            return torch.zeros(logp.shape, dtype=_out_dtype(logp), device=logp.device)
        if _use_triton(logp):
            return _kernels("kl").kl_shaped_rewards_fwd(
                scores.contiguous(), logp.contiguous(), ref_logp.contiguous(), mask.contiguous(),
                kl_coef=kl_coef, estimator=name, clamp=clamp)
        m = _f32(mask.to(logp.dtype)) if mask.dtype != torch.bool else mask.to(_out_dtype(logp))
        rewards = -kl_coef * ref.token_kl(_f32(logp), _f32(ref_logp), estimator=name, clamp=clamp) * m
        T = logp.shape[1]
        positions = torch.arange(T, device=logp.device).expand(logp.shape)
        last = torch.where(m > 0, positions, torch.full_like(positions, -1)).amax(-1)
        add = torch.where(last >= 0, scores.to(rewards.dtype), torch.zeros_like(rewards[:, 0]))
        return rewards.scatter_add(1, last.clamp(min=0).unsqueeze(1), add.unsqueeze(1))


# ---------------------------------------------------------------- whitening and GAE


def whiten(x, mask, *, unbiased=True, shift_mean=True):
    """Masked whitening (x - mean) / sqrt(var + 1e-8) over the mask=1 entries (unbiased
    variance by default); `shift_mean=False` adds the mean back. 0 where mask = 0; any
    non-zero mask entry counts as 1."""
    _check_float("x", x)
    _check_mask(mask, x, "x")
    with torch.no_grad():
        if x.numel() == 0:
            return torch.zeros(x.shape, dtype=_out_dtype(x), device=x.device)
        if _use_triton(x):
            out = _kernels("gae").whiten_fwd(_as_rows(x), _as_rows(mask != 0), unbiased=bool(unbiased),
                                             shift_mean=bool(shift_mean))
            return out.view(x.shape)
        return ref.whiten(_f32(x), mask != 0, unbiased=unbiased, shift_mean=shift_mean)


def gae(rewards, values, mask, *, gamma=1.0, lam=1.0, mask_mode="skip", whiten=True):
    """Generalised advantage estimation over [B, T]; returns (advantages, returns) float32.

    mask_mode "skip" (verl): masked tokens are skipped and the recursion carries across them;
    "zero" (OpenRLHF): rewards and values are zeroed under the mask and discounting runs
    through gaps. returns = raw advantages + values; advantages are whitened (masked,
    unbiased) when `whiten`. Both are 0 where mask = 0. No gradient. The mask selects
    tokens: any non-zero entry counts as 1 (it is not a weight).
    """
    _check_float("rewards", rewards)
    _check_float("values", values)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, T], got shape {tuple(rewards.shape)}")
    _check_same("rewards", rewards, values=values)
    _check_mask(mask, rewards, "rewards")
    gamma = _check_number("gamma", gamma, nonnegative=True)
    lam = _check_number("lam", lam, nonnegative=True)
    _check_choice("mask_mode", mask_mode, MASK_MODES)
    with torch.no_grad():
        if rewards.numel() == 0:
            empty = torch.zeros(rewards.shape, dtype=_out_dtype(rewards), device=rewards.device)
            return empty, empty.clone()
        if _use_triton(rewards):
            return _kernels("gae").gae_fwd(rewards.contiguous(), values.contiguous(), (mask != 0).contiguous(),
                                           gamma=gamma, lam=lam, mask_mode=mask_mode, whiten=bool(whiten))
        return ref.gae(_f32(rewards), _f32(values), mask != 0, gamma=gamma, lam=lam, mask_mode=mask_mode,
                       whiten=whiten)


# ---------------------------------------------------------------- PPO losses


def _row_scale(mask: torch.Tensor, agg: str, global_num_tokens) -> torch.Tensor:
    """Per-row weights [B] that turn sum_t mask * l into verl's `agg` (module docstring)."""
    m = mask.float()
    B, T = m.shape
    n_b = m.sum(-1)
    if agg == "token-mean":
        n = n_b.sum() if global_num_tokens is None else torch.tensor(float(global_num_tokens), device=m.device)
        return _safe_inverse(n).expand(B).contiguous()
    if agg == "seq-mean-token-sum":
        return torch.full((B,), 1.0 / max(B, 1), device=m.device)
    if agg == "seq-mean-token-mean":
        return _safe_inverse(n_b * (n_b > 0).sum())
    return torch.full((B,), 1.0 / max(T, 1), device=m.device)  # seq-mean-token-sum-norm


def _safe_inverse(n: torch.Tensor) -> torch.Tensor:
    """1 / n, and 0 where n == 0 (an empty mask contributes nothing), without a host sync."""
    return torch.where(n > 0, 1.0 / torch.where(n > 0, n, 1.0), 0.0)


def _check_agg(agg, global_num_tokens):
    _check_choice("agg", agg, AGG_MODES)
    if global_num_tokens is not None:
        if agg != "token-mean":
            raise ValueError(f"global_num_tokens applies to agg='token-mean' only, got agg={agg!r}")
        _check_number("global_num_tokens", global_num_tokens, positive=True)


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * m).sum() * _safe_inverse(m.sum())


class _PolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, old_logp, advantages, mask, scale, clip_low, clip_high, dual_clip):
        sums, d_logp = _kernels("ppo_loss").policy_loss_fwd(
            logp, old_logp, advantages, mask, scale, clip_low=clip_low, clip_high=clip_high,
            dual_clip=dual_clip, need_grad=ctx.needs_input_grad[0])
        ctx.save_for_backward(d_logp)
        ctx.in_dtype = logp.dtype
        return sums

    @staticmethod
    def backward(ctx, grad_sums):
        (d_logp,) = ctx.saved_tensors
        if d_logp is None or not ctx.needs_input_grad[0]:
            return (None,) * 8
        return (d_logp * grad_sums[0]).to(ctx.in_dtype), None, None, None, None, None, None, None


def _policy_losses_torch(logp, old_logp, advantages, clip_low, clip_high, dual_clip):
    """Per-token clipped surrogate and its stats indicators (reference.policy_loss, unreduced)."""
    log_ratio = (logp - old_logp).clamp(-ref.LOG_RATIO_CLAMP, ref.LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    losses = torch.maximum(l1, l2)
    lower = torch.zeros_like(losses, dtype=torch.bool)
    if dual_clip is not None:
        l3 = -advantages * dual_clip
        lower = (losses > l3) & (advantages < 0)
        losses = torch.where(advantages < 0, torch.minimum(losses, l3), losses)
    return losses, l2 > l1, lower, log_ratio


def policy_loss(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None, dual_clip=None,
                agg="token-mean", global_num_tokens=None):
    """verl's vanilla clipped PPO surrogate; returns (loss, stats).

    ratio = exp(clamp(logp - old_logp, -20, 20));
    l = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high)), and with dual-clip
    c (> 1): l = min(l, -A * c) where A < 0. The loss is agg(l); stats (masked means over
    the local tokens): clipfrac, clipfrac_lower, approx_kl = mean(old_logp - logp).
    Gradients flow to `logp` only: old_logp and advantages are constants (detached).
    """
    for name, x in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages)):
        _check_float(name, x)
    _check_same("logp", logp, old_logp=old_logp, advantages=advantages)
    _check_mask(mask, logp, "logp")
    clip_low = _check_number("clip_low", clip_low, nonnegative=True)
    clip_high = clip_low if clip_high is None else _check_number("clip_high", clip_high, nonnegative=True)
    if dual_clip is not None:
        dual_clip = _check_number("dual_clip", dual_clip, above=1.0)
    _check_agg(agg, global_num_tokens)
    lp, olp, adv, m = _as_rows(logp), _as_rows(old_logp.detach()), _as_rows(advantages.detach()), _as_rows(mask)
    scale = _row_scale(m, agg, global_num_tokens)
    if lp.numel() == 0:
        zero = logp.sum() * 0.0
        return zero.float(), {k: zero.detach().float() for k in ("clipfrac", "clipfrac_lower", "approx_kl")}
    if _use_triton(logp):
        sums = _PolicyLoss.apply(lp, olp, adv, m, scale, clip_low, clip_high, dual_clip)
        inv_n = _safe_inverse(sums[4].detach())
        stats = {"clipfrac": sums[1].detach() * inv_n, "clipfrac_lower": sums[2].detach() * inv_n,
                 "approx_kl": sums[3].detach() * inv_n}
        return sums[0], stats
    losses, clipped, lower, log_ratio = _policy_losses_torch(_f32(lp), _f32(olp), _f32(adv), clip_low,
                                                             clip_high, dual_clip)
    mf = m.to(losses.dtype)
    loss = (scale.to(losses.dtype).unsqueeze(1) * mf * losses).sum()
    with torch.no_grad():
        stats = {"clipfrac": _masked_mean(clipped.float(), mf.float()),
                 "clipfrac_lower": _masked_mean(lower.float(), mf.float()),
                 "approx_kl": _masked_mean(-log_ratio.float(), mf.float())}
    return loss, stats


class _ValueLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, old_values, returns, mask, scale, clip):
        sums, d_values = _kernels("ppo_loss").value_loss_fwd(
            values, old_values, returns, mask, scale, clip=clip, need_grad=ctx.needs_input_grad[0])
        ctx.save_for_backward(d_values)
        ctx.in_dtype = values.dtype
        return sums

    @staticmethod
    def backward(ctx, grad_sums):
        (d_values,) = ctx.saved_tensors
        if d_values is None or not ctx.needs_input_grad[0]:
            return (None,) * 6
        return (d_values * grad_sums[0]).to(ctx.in_dtype), None, None, None, None, None


def value_loss(values, old_values, returns, mask, *, clip=0.2, agg="token-mean", global_num_tokens=None):
    """Clipped value loss 0.5 * agg(max((v - R)^2, (v_clipped - R)^2)),
    v_clipped = clamp(v, old_values - clip, old_values + clip) (`clip=None`: no clipping).
    Returns (loss, stats) with stats `clipfrac`. Gradients flow to `values` only: old_values
    and returns are constants (detached)."""
    for name, x in (("values", values), ("old_values", old_values), ("returns", returns)):
        _check_float(name, x)
    _check_same("values", values, old_values=old_values, returns=returns)
    _check_mask(mask, values, "values")
    if clip is not None:
        clip = _check_number("clip", clip, nonnegative=True)
    _check_agg(agg, global_num_tokens)
    v, ov, ret, m = _as_rows(values), _as_rows(old_values.detach()), _as_rows(returns.detach()), _as_rows(mask)
    scale = _row_scale(m, agg, global_num_tokens)
    if v.numel() == 0:
        zero = values.sum() * 0.0
        return zero.float(), {"clipfrac": zero.detach().float()}
    if _use_triton(values):
        sums = _ValueLoss.apply(v, ov, ret, m, scale, clip)
        return sums[0], {"clipfrac": sums[1].detach() * _safe_inverse(sums[2].detach())}
    v, ov, ret = _f32(v), _f32(ov), _f32(ret)
    l1 = (v - ret) ** 2
    if clip is None:
        losses, clipped = l1, torch.zeros_like(l1, dtype=torch.bool)
    else:
        l2 = (torch.clamp(v, ov - clip, ov + clip) - ret) ** 2
        losses, clipped = torch.maximum(l1, l2), l2 > l1
    mf = m.to(losses.dtype)
    loss = 0.5 * (scale.to(losses.dtype).unsqueeze(1) * mf * losses).sum()
    return loss, {"clipfrac": _masked_mean(clipped.float(), mf.float()).detach()}


# ---------------------------------------------------------------- the whole actor loss


def actor_loss_from_logprobs(logp, entropy, old_logp, advantages, mask, *, ref_logp=None, kl_coef=0.0,
                             kl_estimator="k3", entropy_coef=0.0, clip_low=0.2, clip_high=None,
                             dual_clip=None, agg="token-mean", global_num_tokens=None):
    """policy_loss(logp) + kl_coef * agg(KL(logp, ref_logp)) - entropy_coef * agg(entropy).

    The tail of `ppo_actor_loss` (from logits): the per-token work here is O(B T); the
    vocab-sized work is in how logp / entropy were made. `linear_ppo_actor_loss` applies the
    same per-token formulas chunk by chunk inside its fused forward (fastrlhf/_linear.py).
    """
    kl_coef = _check_number("kl_coef", kl_coef)
    entropy_coef = _check_number("entropy_coef", entropy_coef)
    _check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    if ref_logp is not None:
        _check_float("ref_logp", ref_logp)
        _check_same("old_logp", old_logp, ref_logp=ref_logp)
    pg, stats = policy_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                            dual_clip=dual_clip, agg=agg, global_num_tokens=global_num_tokens)
    m = _as_rows(mask).float()
    scale = _row_scale(m, agg, global_num_tokens).unsqueeze(1)
    ent = _as_rows(entropy)
    loss = pg
    stats = dict(stats, pg_loss=pg.detach(), entropy=_masked_mean(ent.detach().float(), m))
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * (scale * m * ent).sum()
    if ref_logp is not None:
        kl = _as_rows(token_kl(logp, ref_logp, estimator=kl_estimator))
        stats["kl"] = _masked_mean(kl.detach().float(), m)
        if kl_coef != 0.0:
            loss = loss + kl_coef * (scale * m * kl).sum()
    return loss, stats


def ppo_actor_loss(logits, labels, old_logp, advantages, mask, *, ref_logp=None, kl_coef=0.0,
                   kl_estimator="k3", entropy_coef=0.0, temperature=1.0, clip_low=0.2, clip_high=None,
                   dual_clip=None, agg="token-mean", global_num_tokens=None):
    """The whole actor loss straight from logits [B, T, V]:
    policy_loss + kl_coef * KL - entropy_coef * entropy, each aggregated with `agg`.

    One fused pass over the logits forward (log-prob, entropy and log-sum-exp together),
    and one backward that writes d(logits) once: the gradients of the policy, KL and
    entropy terms reach the logits through a single log-prob backward.
    Returns (loss, stats): clipfrac, clipfrac_lower, approx_kl, pg_loss, entropy, kl.
    """
    _check_float("logits", logits)
    _check_float("old_logp", old_logp)
    if tuple(old_logp.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"old_logp must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
                         f"got {tuple(old_logp.shape)}")
    logp, entropy = logprobs(logits, labels, temperature=temperature, return_entropy=True)
    return actor_loss_from_logprobs(
        logp, entropy, old_logp, advantages, mask, ref_logp=ref_logp, kl_coef=kl_coef,
        kl_estimator=kl_estimator, entropy_coef=entropy_coef, clip_low=clip_low, clip_high=clip_high,
        dual_clip=dual_clip, agg=agg, global_num_tokens=global_num_tokens)


from fastrlhf import _linear  # noqa: E402  (imports this module's helpers lazily)
from fastrlhf._linear import linear_logprobs, linear_ppo_actor_loss  # noqa: E402

__all__ = [
    "gae",
    "kl_shaped_rewards",
    "linear_logprobs",
    "linear_ppo_actor_loss",
    "logprobs",
    "policy_loss",
    "ppo_actor_loss",
    "token_kl",
    "value_loss",
    "whiten",
]
