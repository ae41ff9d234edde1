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
grpo_trainer.GRPOTrainer._compute_loss       policy_loss(loss_mode=)   the entropy bonus (entropy_coef, adaptive
  (the method; TRL's model forward,            + token_kl / agg_loss     entropy: its controller's state is TRL's),
  _get_per_token_logps_and_entropies, the        for the KL term          the router aux loss (MoE), non-finite
  entropy and off-policy masks and the                                   log-probs / advantages / IS ratios / ref
  metrics' cross-process reductions stay                                 log-probs (TRL's loss is NaN there),
  TRL's own calls)                                                       float64 on the kernels, vespo with IS
                                                                         ratios != 1 off the mask (TRL sums their
                                                                         logs over every position), unknown
                                                                         loss_type / level (TRL raises)

Top-K indices of shape (..., K) run fused: one read of the logits for all K.

GRPO's loss (TRL 1.16 GRPOTrainer._compute_loss, every loss_type: grpo, dr_grpo, dapo, bnpo,
cispo, sapo, luspo, vespo; importance_sampling_level token or sequence): grpo / bnpo / dr_grpo /
dapo on loss_mode="vanilla" and luspo on "luspo" (the ratio at TRL's level, no log-ratio clamp,
epsilon_low / epsilon_high, TRL's two-sided `delta`), cispo on "cispo" (ratio_max=epsilon_high),
sapo on "sapo" (TRL's temperatures, rounded to float32 as its torch.where makes them), vespo on
"vespo" (the vLLM IS ratio enters its gamma weight); top_entropy_quantile's and
off_policy_mask_threshold's masks and the vLLM IS ratio (vllm_importance_sampling_correction,
every mode: TRL computes it at generation) are the loss's is_weights; each loss_type's
normalisation (per-sequence means, token means over the batch or num_items_in_batch, dr_grpo's
max_completion_length, gradient accumulation in train mode) is its agg / global count. The
returned loss and every metric TRL logs (kl, entropy, clip_ratio/*, cispo_clip_ratio,
vespo/phi_seq_mean) are TRL's: the metrics are computed from the ratio on [B, T] as TRL does, and
vespo/phi_seq_mean by TRL's own get_gamma_weights (a no-grad [B, T] pass; it is a mean over rows,
policy_loss's phi_mean one over tokens). Still TRL's own: the IS ratio itself, which TRL computes
at generation (_generate_and_score_completions; rollout_correction gives the same weights, checked
in tests/integrations/test_policy_family_peers.py, but that method is not patched). A combination
that runs TRL's own code is logged once per (function, reason) on the "fastrlhf.integrations"
logger.

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
In the GRPO loss, at an exact tie of the clipped and the unclipped term (a ratio exactly at
1 - epsilon_low / 1 + epsilon_high, or at delta) the unclipped term takes the whole gradient,
where TRL's torch.min / torch.clamp split or drop it; values are equal.
"""

from __future__ import annotations

import torch

import fastrlhf
from fastrlhf.integrations import Patcher, logger, peer_version
from fastrlhf.integrations._conventions import all_finite, float64_on_kernels, promoted, same_shape, scalar

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

    if _PATCHER.active:
        return  # importing the peer ran the FASTRLHF_PATCH hook (fastrlhf_hook), which patched it

    out_dtype = _output_dtype(utils)
    with _PATCHER.patching() as p:  # undone if any of it raises: never a half-patched peer
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
        _patch_grpo_loss(p)


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


# ---------------------------------------------------------------- GRPOTrainer's loss

GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
_CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # TRL's clipped surrogate (and its metrics)
# the inputs GRPOTrainer._compute_loss hands its model forward (TRL 1.16), besides the ids and masks
_FORWARD_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                   "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
_FALLBACKS: set = set()


def _patch_grpo_loss(p: Patcher) -> None:
    """GRPOTrainer._compute_loss: TRL's model forward, the loss and its aggregation on policy_loss."""
    try:
        from trl.trainer.grpo_trainer import GRPOTrainer
    except ImportError:  # TRL without GRPO's dependencies: nothing to patch
        return
    p.attribute(GRPOTrainer, "_compute_loss", _grpo_compute_loss(GRPOTrainer.__dict__["_compute_loss"]))


def _fallback(name: str, why: str) -> None:
    """Log once per (function, reason) that TRL's own code runs."""
    if (name, why) not in _FALLBACKS:
        _FALLBACKS.add((name, why))
        logger.info("fastrlhf: TRL's own %s runs (%s)", name, why)


def _grpo_compute_loss(original):
    def _compute_loss(self, model, inputs):
        why = _grpo_unfused_settings(self)
        if why is not None:
            _fallback("GRPOTrainer._compute_loss", why)
            return original(self, model, inputs)
        forward = _grpo_forward(self, model, inputs)
        mask = inputs["completion_mask"]
        mask = mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]
        why = _grpo_unfused_inputs(self, inputs, mask, forward[0])
        if why is not None:
            _fallback("GRPOTrainer._compute_loss", why)
            return _grpo_trl_loss(original, self, model, inputs, forward)
        return _grpo_loss(self, inputs, mask, *forward[:2])

    return _compute_loss


def _grpo_unfused_settings(self) -> str | None:
    """Why a trainer's settings run TRL's own _compute_loss, or None."""
    if self.loss_type not in GRPO_LOSS_TYPES or self.importance_sampling_level not in ("token", "sequence"):
        return "a loss_type or importance_sampling_level TRL rejects"
    if self._entropy_bonus_enabled:
        return "the entropy bonus (entropy_coef / adaptive entropy)"
    if self.aux_loss_enabled:
        return "the router auxiliary loss"
    return None


def _grpo_forward(self, model, inputs):
    """TRL's own model forward, as _compute_loss calls it: (per-token log-probs, entropies, aux loss)."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return self._get_per_token_logps_and_entropies(
        model, input_ids, attention_mask, inputs["completion_ids"].size(1), compute_entropy=True,
        compute_aux_loss=self.aux_loss_enabled, **{k: inputs.get(k) for k in _FORWARD_INPUTS})


def _grpo_unfused_inputs(self, inputs, mask, logp) -> str | None:
    """Why these inputs run TRL's own loss code, or None."""
    old = inputs.get("old_per_token_logps")
    is_ratio = inputs.get("importance_sampling_ratio")
    ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
    if float64_on_kernels(logp, old):
        return "float64 on the Triton kernels (fp32 inside)"
    if not same_shape(logp, old, mask) or inputs["advantages"].dim() > 2:
        return "inputs of unexpected shapes"
    if not bool(all_finite(logp, old, inputs["advantages"], is_ratio, ref)):
        return "non-finite inputs (TRL's loss and gradients are NaN there)"
    if self.loss_type == "vespo" and is_ratio is not None and (
            is_ratio.shape != logp.shape or bool((is_ratio[mask == 0] != 1).any())):
        return "vespo with IS ratios of another shape or != 1 off the mask (TRL sums them over every position)"
    return None


def _grpo_trl_loss(original, self, model, inputs, forward):
    """TRL's own _compute_loss on the forward already run (it is not run twice)."""
    name = "_get_per_token_logps_and_entropies"
    missing = object()
    saved = self.__dict__.get(name, missing)
    self.__dict__[name] = lambda *args, **kwargs: forward
    try:
        return original(self, model, inputs)
    finally:
        if saved is missing:
            del self.__dict__[name]
        else:
            self.__dict__[name] = saved


def _grpo_loss(self, inputs, mask, logp, entropies):
    """TRL 1.16 GRPOTrainer._compute_loss after its forward, the per-token loss and its aggregation on
    fastrlhf.policy_loss (and the KL term on token_kl / agg_loss); TRL's masks, metrics and loss."""
    mode = "train" if self.model.training else "eval"
    advantages = inputs["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old = inputs.get("old_per_token_logps")
    old = logp.detach() if old is None else old
    entropy_mask = (self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
                    if self.top_entropy_quantile < 1.0 else None)
    weights = _grpo_weights(self, inputs, mask, logp, old, advantages, entropy_mask)
    agg = _grpo_agg(self, inputs, mask, mode)
    loss_mode, options = _grpo_mode(self, inputs)
    loss, _ = fastrlhf.policy_loss(logp, old, advantages.expand_as(logp), mask, loss_mode=loss_mode,
                                   clip_low=self.epsilon_low, clip_high=self.epsilon_high, is_weights=weights,
                                   **agg, **options)
    loss = loss.to(_grpo_loss_dtype(self, inputs, logp, old, advantages, mask))
    coef_1 = _grpo_ratio(self, logp, old, mask)
    metrics = _grpo_metrics(self, mode, mask)
    if self.beta != 0.0:
        kl = fastrlhf.token_kl(logp, inputs["ref_per_token_logps"], estimator="k3")
        if self.args.use_bias_correction_kl:
            kl = kl * coef_1
        loss = loss + self.beta * fastrlhf.agg_loss(kl, mask, **agg).to(loss.dtype)
        metrics("kl", kl)
    metrics("entropy", entropies)
    _grpo_ratio_metrics(self, metrics, coef_1.detach(), advantages, mask, inputs, logp, old)
    return loss


def _grpo_loss_dtype(self, inputs, logp, old, advantages, mask) -> torch.dtype:
    """The dtype of TRL's loss: its per-token terms promote the log-probs, advantages, IS ratios, the
    reference log-probs and a float mask; sapo's temperatures and vespo's gamma weights (torch.where of
    Python floats), the per-sequence / batch counts of an integer mask (clamp(min=1.0)) and dapo's
    normaliser are tensors of their own dtype (the default float dtype where TRL makes them)."""
    own = torch.get_default_dtype()
    dtypes = [promoted(logp, old, advantages)]
    if self.loss_type in ("sapo", "vespo"):
        dtypes.append(own)
    is_ratio = inputs.get("importance_sampling_ratio")
    corrected = self.use_vllm and self.vllm_importance_sampling_correction
    if is_ratio is not None and (self.loss_type == "vespo" or corrected):
        dtypes.append(is_ratio.dtype)
    if self.beta != 0.0:
        dtypes.append(inputs["ref_per_token_logps"].dtype)
    if mask.is_floating_point():
        dtypes.append(mask.dtype)
    if self.loss_type in ("grpo", "sapo", "bnpo"):
        dtypes.append(mask.dtype if mask.is_floating_point() else own)
    elif self.loss_type in ("dapo", "cispo", "vespo"):
        num = inputs["num_items_in_batch"]
        dtypes.append(num.dtype if num.is_floating_point() else own)
    out = dtypes[0]
    for dtype in dtypes[1:]:
        out = torch.promote_types(out, dtype)
    return out


def _grpo_weights(self, inputs, mask, logp, old, advantages, entropy_mask):
    """The constant per-token factors TRL multiplies the loss by: the off-policy sequence mask, the
    entropy mask and (all but vespo) the vLLM IS ratio; None when there are none."""
    factors = []
    if self.off_policy_mask_threshold is not None:
        factors.append(self.get_off_policy_mask(
            advantages=advantages, per_token_logps=logp, sampling_per_token_logps=inputs.get(
                "sampling_per_token_logps", old), mask=mask, off_policy_threshold=self.off_policy_mask_threshold))
    if entropy_mask is not None:
        factors.append(entropy_mask)
    if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo":
        factors.append(inputs["importance_sampling_ratio"])
    if not factors:
        return None
    weights = torch.ones_like(logp, dtype=promoted(logp, *(f for f in factors if f.is_floating_point())))
    for f in factors:
        weights = weights * f
    return weights.detach()


def _grpo_agg(self, inputs, mask, mode) -> dict:
    """TRL 1.16's normalisation of each loss_type as agg_loss keywords, gradient accumulation (train
    mode) folded into the global counts."""
    steps = self.current_gradient_accumulation_steps if mode == "train" else 1
    B = mask.shape[0]
    if self.loss_type in ("grpo", "sapo"):
        return dict(agg="seq-mean-token-mean", global_num_seqs=B * steps)
    if self.loss_type == "bnpo":
        return dict(agg="token-mean", global_num_tokens=max(float(mask.sum()), 1.0) * steps)
    if self.loss_type == "dr_grpo":
        return dict(agg="seq-mean-token-sum-norm", global_num_seqs=B,
                    loss_scale_factor=self.max_completion_length * steps)
    if self.loss_type == "luspo":
        return dict(agg="seq-mean-token-sum", global_num_seqs=B * steps)
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes  # cispo, dapo, vespo
    if mode == "train":
        normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
    return dict(agg="token-mean", global_num_tokens=scalar(normalizer))


def _f32(x: float) -> float:
    """A Python float rounded to float32, as TRL's torch.where of two Python floats makes it."""
    return float(torch.tensor(x, dtype=torch.float32))


def _grpo_mode(self, inputs) -> tuple[str, dict]:
    """(loss_mode, its options) of the trainer's loss_type and importance_sampling_level (TRL 1.16:
    no clamp of the log-ratio; cispo's bound is epsilon_high itself)."""
    a, level = self.args, self.importance_sampling_level
    common = dict(ratio_level=level, log_ratio_clamp=None)
    if self.loss_type == "cispo":
        return "cispo", dict(common, ratio_max=self.epsilon_high)
    if self.loss_type == "sapo":
        return "sapo", dict(common, tau_pos=_f32(a.sapo_temperature_pos), tau_neg=_f32(a.sapo_temperature_neg))
    if self.loss_type == "vespo":
        return "vespo", dict(k_pos=a.vespo_k_pos, lambda_pos=a.vespo_lambda_pos, k_neg=a.vespo_k_neg,
                             lambda_neg=a.vespo_lambda_neg, sampler_weights=inputs.get("importance_sampling_ratio"))
    return ("luspo" if self.loss_type == "luspo" else "vanilla"), dict(common, delta=a.delta)


def _grpo_ratio(self, logp, old, mask):
    """TRL's coef_1: exp of the token log-ratio, or of the row's masked mean ([B, 1]) at the sequence level."""
    log_ratio = logp - old
    if self.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return torch.exp(log_ratio)


def _grpo_metrics(self, mode, mask):
    """metrics(name, x): TRL's global masked mean of x ([B, T] over the mask, [B, 1] over the rows)
    appended to self._metrics[mode][name]."""

    def log(name, x):
        x = x.detach()
        if x.shape[1] == 1:
            local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            local_sum, local_count = (x * mask).sum(), mask.sum().float()
        totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
        self._metrics[mode][name].append((totals[0] / totals[1].clamp(min=1.0)).item())

    return log


def _grpo_ratio_metrics(self, metrics, coef_1, advantages, mask, inputs, logp, old):
    """TRL's clip / cispo / vespo metrics, under its names."""
    from trl.trainer.grpo_trainer import nanmax, nanmin

    mode = "train" if self.model.training else "eval"
    if self.loss_type in _CLIPPED_LOSS_TYPES:
        if self.args.delta is not None:
            coef_1 = torch.clamp(coef_1, max=self.args.delta)
        low = ((coef_1 < 1 - self.epsilon_low) & (advantages < 0)).float()
        high = ((coef_1 > 1 + self.epsilon_high) & (advantages > 0)).float()
        metrics("clip_ratio/low_mean", low)
        metrics("clip_ratio/high_mean", high)
        metrics("clip_ratio/region_mean", torch.maximum(low, high))

        def seq_mean(x):
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        self._metrics[mode]["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(seq_mean(low))).item())
        self._metrics[mode]["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(seq_mean(high))).item())
    elif self.loss_type == "cispo":
        metrics("cispo_clip_ratio", ((coef_1 > self.epsilon_high) & (advantages > 0)).float())
    elif self.loss_type == "vespo":
        a = self.args
        metrics("vespo/phi_seq_mean", self.get_gamma_weights(
            advantages=advantages, log_ratio_per_token=logp.detach() - old, mask=mask,
            importance_sampling_ratio=inputs.get("importance_sampling_ratio"), k_pos=a.vespo_k_pos,
            lambda_pos=a.vespo_lambda_pos, k_neg=a.vespo_k_neg, lambda_neg=a.vespo_lambda_neg))
