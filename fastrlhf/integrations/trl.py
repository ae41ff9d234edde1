"""fastrlhf ops inside TRL (>= 1.12): `patch()` / `unpatch()`.

What `patch()` replaces (rebound in every loaded trl module that imported it by name or
alias, e.g. `trl.experimental.*` trainers, and TRL 1.12's `trl.experimental.ppo.ppo_trainer`):

trl.trainer.utils                             fastrlhf op               TRL's own still runs for
selective_log_softmax                         logprobs                  an index whose shape is neither (...) nor
                                                                        (..., K >= 1) (TRL's own error)
entropy_from_logits                           entropy                   -
selective_log_softmax_and_entropy             logprobs(return_entropy)  the same
_ChunkedLogProbFunction: the fused LM head    linear_logprobs           softcapping, logit_scale != 1, outputs
  that the GRPO, RLOO, DPO, KTO and SFT                                 other than log_probs / entropy (no op
  trainers add with add_fused_lm_head                                   computes them)

trl.trainer.distillation_trainer              fastrlhf op               TRL's own still runs for
_chunked_divergence_loss: DistillationTrainer's linear_distill_loss       num_items_in_batch a number <= 0
  generalized JSD from both models' hidden        (logits_dtype=float32)
  states and lm_heads
trl.experimental.gkd.gkd_trainer (if present)
GKDTrainer.generalized_jsd_loss               distill_loss              reduction="none" (per-element output),
                                                                        teacher logits that require grad,
                                                                        float64 on the kernels

Top-K indices of shape (..., K) run fused: one read of the logits for all K.

Not replaced: TRL 1.12 PPO's `masked_whiten` (it returns whitened values off the mask too,
which fastrlhf's whiten zeroes; the trainer zeroes them right after, but the function's own
output would differ) -- the PPO trainer's vocab-sized work, `selective_log_softmax`, is
replaced.

Conventions kept (read from TRL 1.16.0): log-probs and entropy in the logits' dtype, or
float32 where TRL itself would use its Triton kernel (CUDA); `row_mask == 0` rows give 0;
`temperature <= 0` raises TRL's ValueError; `entropy_requires_grad=False` gives a detached
entropy; the fused LM head computes in the autocast dtype when autocast is on, as TRL does,
and returns float32 (log_probs, entropy or None, None, None, None).

Distillation (read from TRL 1.16.0): beta 0 = KL(teacher || student), 1 = KL(student || teacher), between
= beta KL(t || m) + (1 - beta) KL(s || m) with m = (1 - beta) s + beta t; the token mean over
`completion_mask != 0` (GKD: `labels != -100`), or the sum over num_items_in_batch; scale, softcap, then
temperature; fp32 logits from the projection (TRL's `_project`), the autocast dtype for the matmuls when
autocast is on; the returned (loss, entropy sum, valid count) of `_chunked_divergence_loss`, GKD's
reductions batchmean (a mean over the valid tokens, or over the batch's first dim without labels), sum
and mean (over tokens x vocabulary), in the logits' dtype.

Not kept (fastrlhf's op conventions, docs/ops.md): indices of -100 give log-prob 0 and indices
outside [0, V) NaN, where TRL's selective_log_softmax raises an index error; -inf logits give
a finite entropy with finite gradients, where TRL's entropy_from_logits is NaN in both. A
caller's bad index is not caught. Distillation: GKD's loss on bf16 / fp16 logits is computed in fp32
(TRL's in the logits' dtype); an lm_head bias is rounded to the compute dtype before the fp32 logits
take it (TRL adds it unrounded); the entropy sum is the op's mean entropy times the valid count.
"""

from __future__ import annotations

import torch

import fastrlhf
from fastrlhf.integrations import Patcher, peer_version
from fastrlhf.integrations._conventions import float64_on_kernels, scalar

SUPPORTED = "TRL >= 1.12"
_PATCHER = Patcher("trl", "trl")

_FUSED_OUTPUTS = {"log_probs", "entropy"}


def patch() -> None:
    """Replace TRL's log-prob / entropy helpers and its fused LM-head function with fastrlhf's
    ops (table in the module docstring). Idempotent."""
    if _PATCHER.active:
        return
    peer_version("trl", supported=SUPPORTED, minimum="1.12")
    import trl.trainer.utils as utils

    out_dtype = _output_dtype(utils)
    try:
        p = _PATCHER
        p.function(utils, "selective_log_softmax", _selective_log_softmax(utils.selective_log_softmax, out_dtype))
        p.function(utils, "entropy_from_logits", _entropy_from_logits(utils.entropy_from_logits, out_dtype))
        if hasattr(utils, "selective_log_softmax_and_entropy"):
            p.function(utils, "selective_log_softmax_and_entropy",
                       _selective_log_softmax_and_entropy(utils.selective_log_softmax_and_entropy, out_dtype))
        if hasattr(utils, "_ChunkedLogProbFunction"):
            p.function(utils, "_ChunkedLogProbFunction", _chunked_logprob(utils._ChunkedLogProbFunction))
        distillation = _optional_module("trl.trainer.distillation_trainer")
        if distillation is not None and hasattr(distillation, "_chunked_divergence_loss"):
            p.function(distillation, "_chunked_divergence_loss",
                       _chunked_divergence_loss(distillation._chunked_divergence_loss))
        gkd = _optional_module("trl.experimental.gkd.gkd_trainer")
        if gkd is not None and "generalized_jsd_loss" in vars(getattr(gkd, "GKDTrainer", object)):
            original = gkd.GKDTrainer.generalized_jsd_loss
            p.attribute(gkd.GKDTrainer, "generalized_jsd_loss", _Unbound(_generalized_jsd_loss(original)))
    except BaseException:  # never leave a half-patched peer behind
        _PATCHER.undo()
        raise


def unpatch() -> None:
    """Put every original TRL function back. Idempotent."""
    _PATCHER.undo()


def _output_dtype(utils):
    """The dtype TRL returns log-probs / entropy in: float32 where its own Triton kernel
    would run (TRL >= 1.13 on CUDA), else the logits' dtype."""
    supports = getattr(utils, "_supports_trl_loss_kernel", None)
    triton = getattr(utils, "is_triton_available", None)

    def out_dtype(logits, index=None, row_mask=None):
        if supports is not None and triton() and supports(logits, index, row_mask):
            return torch.float32
        return logits.dtype

    return out_dtype


def _check_temperature(temperature):
    if temperature <= 0:
        raise ValueError("temperature must be positive")


# ---------------------------------------------------------------- log-probs and entropy


def _fused_index(logits, index) -> bool:
    """An index fastrlhf.logprobs takes as TRL does: (...) or (..., K >= 1) over logits (..., V)."""
    if not isinstance(index, torch.Tensor) or not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        return False
    lead = logits.shape[:-1]
    return index.shape == lead or (index.dim() == logits.dim() and index.shape[:-1] == lead and index.shape[-1] > 0)


def _selective_log_softmax(original, out_dtype):
    def selective_log_softmax(logits, index, temperature=1.0, row_mask=None):
        _check_temperature(temperature)
        if not _fused_index(logits, index) or float64_on_kernels(logits):
            return original(logits, index, temperature=temperature, row_mask=row_mask)
        logp = fastrlhf.logprobs(logits, index, temperature=temperature).to(out_dtype(logits, index, row_mask))
        if row_mask is not None:
            logp = logp.masked_fill(row_mask == 0, 0.0)
        return logp

    return selective_log_softmax


def _entropy_from_logits(original, out_dtype):
    def entropy_from_logits(logits, chunk_size=128):
        if float64_on_kernels(logits):
            return original(logits, chunk_size)
        return fastrlhf.entropy(logits).to(out_dtype(logits))

    return entropy_from_logits


def _selective_log_softmax_and_entropy(original, out_dtype):
    def selective_log_softmax_and_entropy(logits, index, entropy_requires_grad=True, temperature=1.0, row_mask=None):
        _check_temperature(temperature)
        if not _fused_index(logits, index) or float64_on_kernels(logits):
            return original(logits, index, entropy_requires_grad=entropy_requires_grad, temperature=temperature,
                            row_mask=row_mask)
        logp, entropy = fastrlhf.logprobs(logits, index, temperature=temperature, return_entropy=True)
        dtype = out_dtype(logits, index, row_mask)
        logp, entropy = logp.to(dtype), entropy.to(dtype)
        if not entropy_requires_grad:
            entropy = entropy.detach()
        if row_mask is not None:
            logp = logp.masked_fill(row_mask == 0, 0.0)
            entropy = entropy.masked_fill(row_mask == 0, 0.0)
        return logp, entropy

    return selective_log_softmax_and_entropy


# ---------------------------------------------------------------- the fused LM head


def _chunked_logprob(original):
    class ChunkedLogProbFunction:
        """`apply` with the arguments and outputs of TRL's ChunkedLogProbFunction."""

        @staticmethod
        def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                  logit_scale=1.0, outputs=None):
            args = (hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale)
            wanted = set(outputs) if outputs is not None else None
            if (wanted is None or not wanted <= _FUSED_OUTPUTS or final_logit_softcapping is not None
                    or logit_scale != 1.0 or float64_on_kernels(hidden, weight, bias)):
                return original.apply(*args) if outputs is None else original.apply(*args, outputs)
            device = hidden.device.type
            if torch.is_autocast_enabled(device):  # TRL runs the projection in the autocast dtype
                dtype = torch.get_autocast_dtype(device)
                hidden, weight = hidden.to(dtype), weight.to(dtype)
                bias = None if bias is None else bias.to(dtype)
            with torch.autocast(device, enabled=False):
                out = fastrlhf.linear_logprobs(hidden, weight, targets, bias=bias, temperature=temperature,
                                               return_entropy="entropy" in wanted)
            logp, entropy = out if "entropy" in wanted else (out, None)
            return logp.float(), None if entropy is None else entropy.float(), None, None, None

    ChunkedLogProbFunction.__qualname__ = ChunkedLogProbFunction.__name__ = "ChunkedLogProbFunction"
    return ChunkedLogProbFunction


# ---------------------------------------------------------------- distillation


def _optional_module(name: str):
    """The TRL module `name`, or None when this TRL has none (trl.experimental warns on import: silenced)."""
    import importlib
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*trl.experimental.*")
            return importlib.import_module(name)
    except ImportError:
        return None


def _non_positive(count) -> bool:
    """A divisor given as a number <= 0 (TRL divides by it: inf / NaN; the op refuses it)."""
    value = None if isinstance(count, torch.Tensor) else scalar(count)
    return value is not None and value <= 0


def _plain_lm_head(weight, bias, dtype):
    """An FSDP2 (DTensor) lm_head as one plain tensor in the hidden states' dtype, gathered once per call,
    as TRL's own function does."""
    if isinstance(weight, torch.distributed.tensor.DTensor):
        weight = weight.full_tensor().to(dtype)
        bias = None if bias is None else bias.full_tensor()
    return weight, bias


class _Unbound:
    """A staticmethod's stand-in as a class attribute: a callable object, not a function, so instances
    call it unbound (GKD calls `self.generalized_jsd_loss(...)`), and the patcher can set its __wrapped__."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = self.__qualname__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _chunked_divergence_loss(original):
    def chunked_divergence_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                                teacher_lm_head_weight, completion_mask, beta, num_items_in_batch=None,
                                student_lm_head_bias=None, teacher_lm_head_bias=None, student_logit_scale=1.0,
                                teacher_logit_scale=1.0, student_final_logit_softcapping=None,
                                teacher_final_logit_softcapping=None, temperature=1.0):
        if _non_positive(num_items_in_batch):
            return original(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                            teacher_lm_head_weight, completion_mask, beta, num_items_in_batch, student_lm_head_bias,
                            teacher_lm_head_bias, student_logit_scale, teacher_logit_scale,
                            student_final_logit_softcapping, teacher_final_logit_softcapping, temperature)
        models = []
        for hidden, weight, bias in ((student_hidden_states, student_lm_head_weight, student_lm_head_bias),
                                     (teacher_hidden_states, teacher_lm_head_weight, teacher_lm_head_bias)):
            weight, bias = _plain_lm_head(weight, bias, hidden.dtype)
            device = hidden.device.type
            # TRL projects in the autocast dtype when autocast is on, else in the hidden states' dtype
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
            models.append(tuple(None if t is None else t.to(dtype) for t in (hidden, weight, bias)))
        (hs, ws, bs), (ht, wt, bt) = models
        valid = completion_mask != 0
        with torch.autocast(hs.device.type, enabled=False):
            loss, stats = fastrlhf.linear_distill_loss(
                hs, ws, ht, wt, valid, beta=beta, temperature=temperature, student_bias=bs, teacher_bias=bt,
                student_logit_scale=student_logit_scale, teacher_logit_scale=teacher_logit_scale,
                student_softcap=student_final_logit_softcapping, teacher_softcap=teacher_final_logit_softcapping,
                global_num_tokens=num_items_in_batch, logits_dtype=torch.float32)
        n_valid = valid.sum()
        return loss.float(), (stats["entropy"] * n_valid).float(), n_valid

    return chunked_divergence_loss


def _generalized_jsd_loss(original):
    def generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0,
                             reduction="batchmean", num_items_in_batch=None):
        args = (student_logits, teacher_logits, labels, beta, temperature, reduction, num_items_in_batch)
        if ((num_items_in_batch is None and reduction not in ("batchmean", "sum", "mean"))
                or _non_positive(num_items_in_batch) or not isinstance(teacher_logits, torch.Tensor)
                or teacher_logits.requires_grad or float64_on_kernels(student_logits, teacher_logits)):
            return original(*args)
        if labels is not None:
            mask = labels != -100
        else:
            mask = torch.ones(student_logits.shape[:-1], dtype=torch.bool, device=student_logits.device)
        if num_items_in_batch is not None:  # GKD checks it before the reduction
            divisor = num_items_in_batch
        elif reduction == "batchmean":  # the valid tokens; without labels, jsd.size(0): the batch
            divisor = None if labels is not None else max(student_logits.shape[0], 1)
        elif reduction == "sum":
            divisor = 1
        else:  # "mean": over every (token, vocab) element kept
            divisor = mask.sum() * student_logits.shape[-1]
        loss, _ = fastrlhf.distill_loss(student_logits, teacher_logits, mask, beta=beta, temperature=temperature,
                                        global_num_tokens=divisor)
        return loss.to(student_logits.dtype)

    return generalized_jsd_loss
