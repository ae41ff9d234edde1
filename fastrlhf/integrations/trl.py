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

Not kept (fastrlhf's op conventions, docs/ops.md): indices of -100 give log-prob 0 and indices
outside [0, V) NaN, where TRL's selective_log_softmax raises an index error; -inf logits give
a finite entropy with finite gradients, where TRL's entropy_from_logits is NaN in both. A
caller's bad index is not caught.
"""

from __future__ import annotations

import torch

import fastrlhf
from fastrlhf.integrations import Patcher, peer_version
from fastrlhf.integrations._conventions import float64_on_kernels

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
