"""fastrlhf ops inside OpenRLHF (>= 0.11): `patch()` / `unpatch()`.

What `patch()` replaces (module functions are rebound in every loaded openrlhf module that
imported them by name, e.g. `openrlhf.models.actor`, `openrlhf.trainer.ray.ppo_actor`):

OpenRLHF                                      fastrlhf op               OpenRLHF's own still runs for
models.utils.log_probs_from_logits            logprobs                  -
models.utils.compute_entropy                  entropy                   -
models.utils.compute_approx_kl                token_kl                  unknown estimators (OpenRLHF raises),
                                                                        broadcast shapes, non-finite log-probs
                                                                        without unbiased_gradient
models.loss.aggregate_loss                    agg_loss                  counts <= 0, a non-integer dp_size,
                                                                        loss_mask=None
models.loss.PolicyLoss.forward                policy_loss (ppo, gspo)   non-finite
                                                                        inputs; old_log_probs or advantages that
                                                                        need a gradient; the agg cases above
models.loss.ValueLoss.forward                 value_loss                the same; per sample where mask.sum(-1) +
                                                                        1e-8 != n_b (a float64 mask, rows of
                                                                        weights summing below ~0.2)
trainer.ppo_utils.experience_maker            gae                       -
  .RemoteExperienceMaker.get_advantages_and_returns

Both loss aggregations with dp_size / batch_num_tokens / global_batch_size, the unbiased-gradient
KL (with its importance weight) and the train/rollout IS correction (every level, mode and
gating: its coefficient goes to the op as per-token weights) run fused.

Not replaced: `models.utils.compute_reward` (it takes an already computed KL and is one
elementwise pass; fastrlhf's kl_shaped_rewards computes the KL itself, zeroes it off the mask
and gives an empty row no score, where OpenRLHF keeps -kl_coef * kl there and puts the score on
the last position).

Conventions kept (read from OpenRLHF 0.11.2): `compute_approx_kl` computes in float32 whatever
the input dtype, clamps every estimator to +-10, clamps k3's log-ratio at -10 in both terms and,
with unbiased_gradient, is NaN where its gradient surrogate w r^2 / 2 is not finite;
`log_probs_from_logits` divides the logits in place by a temperature != 1, as the original does;
log-probs and entropy come back in the logits' dtype (float32 from flash-attn's cross-entropy
when it is installed, for float32/float64 logits); losses and metrics in OpenRLHF's dtypes (found
by running its own aggregate_loss / masked_mean on meta tensors); without global counts the
losses divide by the local count, so an empty mask gives NaN (and NaN gradients); every mode
sums loss * mask, so a non-finite value at a mask = 0 token makes the loss NaN; the per-sample
mean divides by mask.sum(-1) + 1e-8 computed as OpenRLHF computes it, in the mask's arithmetic
(float32 for a bool or integer mask, where it is n_b exactly; the mask's dtype for a float
mask); GAE runs through masked positions with rewards and values zeroed there, and keeps the
values it produces off the mask. Non-finite policy / value loss inputs run OpenRLHF's own
function, whose gradients are NaN where fastrlhf's are 0.

Not kept (fastrlhf's op conventions, docs/ops.md), so not OpenRLHF's gradients or errors there:
- Exact ties of a clipped and an unclipped term: fastrlhf gives the unclipped term the whole
  gradient, where OpenRLHF's torch.min / torch.max split a tie in half and its torch.clamp
  passes 0 at a bound from torch 2.14 on. At ratio == dual_clip with A < 0 the patched gradient
  is 2x OpenRLHF's; from torch 2.14 also at ratio == 1 +- clip_eps and at values == old_values
  +- clip_eps (the log-ratio clamp's +-20 bound: OpenRLHF's is 0 there). Values are equal; a tie
  needs inputs exactly at a bound.
- Labels of -100 give log-prob 0 and labels outside [0, V) NaN, where OpenRLHF's torch path
  raises an index error; -inf logits give a finite entropy with finite gradients, where
  compute_entropy is NaN in both. A caller's bad label is not caught.
"""

from __future__ import annotations

import importlib.util
import numbers

import torch

import fastrlhf
from fastrlhf.integrations import Patcher, logger, peer_version
from fastrlhf.integrations._conventions import (
    all_finite,
    dtypes_of,
    float64_on_kernels,
    floats,
    like,
    needs_grad,
    promoted,
    row_mean_weights,
    same_shape,
    scalar,
)

SUPPORTED = "OpenRLHF >= 0.11"
_PATCHER = Patcher("openrlhf", "openrlhf")

_KL_CLAMP = 10.0  # OpenRLHF clamps every KL estimator's value to +-10
_IS_LEVELS, _IS_MODES, _IS_GATINGS = ("token", "seq"), ("mask", "clip"), ("ratio", "binary_kl", "tv")


def patch() -> None:
    """Replace OpenRLHF's log-prob, entropy, KL, aggregation, GAE and PPO-loss code paths with
    fastrlhf's ops (table in the module docstring). Idempotent."""
    if _PATCHER.active:
        return
    peer_version("openrlhf", supported=SUPPORTED, minimum="0.11")
    import openrlhf.models.loss as loss
    import openrlhf.models.utils as utils

    if _PATCHER.active:
        return  # importing the peer ran the FASTRLHF_PATCH hook (fastrlhf_hook), which patched it

    aggregate_loss = loss.aggregate_loss
    with _PATCHER.patching() as p:  # undone if any of it raises: never a half-patched peer
        p.function(utils, "log_probs_from_logits", _log_probs_from_logits(utils.log_probs_from_logits,
                                                                          _flash_ce_available()))
        p.function(utils, "compute_entropy", _compute_entropy(utils.compute_entropy))
        p.function(utils, "compute_approx_kl", _compute_approx_kl(utils.compute_approx_kl, utils))
        p.function(loss, "aggregate_loss", _aggregate_loss(aggregate_loss))
        p.attribute(loss.PolicyLoss, "forward", _policy_loss_forward(loss.PolicyLoss.forward, aggregate_loss,
                                                                     utils.masked_mean))
        p.attribute(loss.ValueLoss, "forward", _value_loss_forward(loss.ValueLoss.forward, aggregate_loss))
        try:  # imports ray and vllm-facing modules: present in a real OpenRLHF install
            from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
        except ImportError as e:
            logger.warning("fastrlhf: OpenRLHF's experience maker could not be imported (%s); its GAE is not patched",
                           e)
        else:
            p.attribute(RemoteExperienceMaker, "get_advantages_and_returns",
                        _get_advantages_and_returns(RemoteExperienceMaker.get_advantages_and_returns))


def unpatch() -> None:
    """Put every original OpenRLHF function back. Idempotent."""
    _PATCHER.undo()


def _flash_ce_available() -> bool:
    """Whether OpenRLHF's log_probs_from_logits would use flash-attn's cross-entropy."""
    try:
        return importlib.util.find_spec("flash_attn.ops.triton.cross_entropy") is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------- aggregation (OpenRLHF's aggregate_loss arguments)


def _agg_keywords(token_level_loss, dp_size=1, batch_num_tokens=None, global_batch_size=None):
    """fastrlhf.agg_loss keywords for OpenRLHF's aggregate_loss arguments, or None where its own
    function must run (a count <= 0 or non-finite, a non-integer dp_size). Without the global count
    OpenRLHF takes the local masked mean and does not use dp_size."""
    mode, name, count = (("token-mean", "global_num_tokens", batch_num_tokens) if token_level_loss else
                         ("seq-mean-token-mean", "global_num_seqs", global_batch_size))
    if count is None:
        return {"agg": mode}
    dp, count = scalar(dp_size), scalar(count)
    if dp is None or dp < 1 or dp != int(dp) or count is None or not count > 0:
        return None
    return {"agg": mode, name: count, "dp_size": int(dp)}


def _as_openrlhf(loss: torch.Tensor, loss_mat, mask: torch.Tensor, keywords: dict) -> torch.Tensor:
    """fastrlhf's aggregated `loss` with OpenRLHF's answers where the two differ by design:
    without a global count OpenRLHF divides by the local one (tokens, or non-empty rows), so an
    empty mask gives 0 / 0 = NaN with NaN gradients (dividing by [count > 0] gives exactly that);
    every mode sums loss * mask, so a non-finite value at a mask = 0 token makes the loss NaN
    (gradients unchanged; fastrlhf ignores the token). `loss_mat` None: its values are known finite."""
    if "global_num_tokens" not in keywords and "global_num_seqs" not in keywords:
        count = mask.sum() if keywords["agg"] == "token-mean" else (mask.sum(-1) > 0).sum()
        loss = loss / (count > 0).to(loss.dtype)
    if loss_mat is not None:
        hidden = (~torch.isfinite(loss_mat.detach()) & (mask == 0)).any()
        loss = loss + torch.where(hidden, float("nan"), 0.0).to(loss.dtype)
    return loss


def _row_mean_weights(keywords: dict, loss_dtype: torch.dtype, mask: torch.Tensor):
    """OpenRLHF's per-sample mean (sum_t / (n_b + 1e-8)) as per-row weights for fastrlhf's (None: 1)."""
    return row_mean_weights(loss_dtype, mask) if keywords["agg"] == "seq-mean-token-mean" else None


def _aggregate_loss(original):
    def aggregate_loss(loss, loss_mask, token_level_loss=True, dp_size=1, batch_num_tokens=None,
                       global_batch_size=None):
        args = (loss, loss_mask, token_level_loss, dp_size, batch_num_tokens, global_batch_size)
        keywords = _agg_keywords(token_level_loss, dp_size, batch_num_tokens, global_batch_size)
        if (keywords is None or not floats(loss) or loss.dim() == 0 or not isinstance(loss_mask, torch.Tensor)
                or not same_shape(loss, loss_mask)):
            return original(*args)
        weights = _row_mean_weights(keywords, loss.dtype, loss_mask)
        out = fastrlhf.agg_loss(loss if weights is None else loss * weights, loss_mask, **keywords)
        return _as_openrlhf(out, loss, loss_mask, keywords).to(dtypes_of(original, *args))

    return aggregate_loss


# ---------------------------------------------------------------- log-probs and entropy


def _log_probs_from_logits(original, flash_ce: bool):
    def log_probs_from_logits(logits, labels, temperature=1.0):
        if float64_on_kernels(logits):
            return original(logits, labels, temperature)
        if temperature != 1.0:
            logits.div_(temperature)  # OpenRLHF scales the caller's logits in place
        logp = fastrlhf.logprobs(logits, labels)
        if flash_ce and logits.dtype in (torch.float32, torch.float64):
            return logp.float()
        return logp.to(logits.dtype)

    return log_probs_from_logits


def _compute_entropy(original):
    def compute_entropy(logits):
        if float64_on_kernels(logits):
            return original(logits)
        return fastrlhf.entropy(logits).to(logits.dtype)

    return compute_entropy


# ---------------------------------------------------------------- KL


def _compute_approx_kl(original, utils):
    def compute_approx_kl(log_probs, log_probs_base, log_probs_old=None, kl_estimator="k1",
                          unbiased_gradient=False):
        args = (log_probs, log_probs_base, log_probs_old, kl_estimator, unbiased_gradient)
        old = log_probs_old if unbiased_gradient else None
        if (kl_estimator not in ("k1", "k2", "k3") or not floats(log_probs, log_probs_base, optional=(old,))
                or not same_shape(log_probs, log_probs_base, old)
                or (not unbiased_gradient and not bool(all_finite(log_probs, log_probs_base)))):
            # torch.clamp's gradient is 0 at NaN and past its bounds (+-inf included): fastrlhf's is NaN there
            return original(*args)
        # OpenRLHF computes in float32 whatever the input dtype (float64 inputs are rounded first)
        logp, base = log_probs.float(), log_probs_base.float()
        weight = None
        if unbiased_gradient and old is not None:
            weight = (logp.detach() - old.float()).exp().clamp(max=utils.KL_IS_WEIGHT_CLIP)
        kl = fastrlhf.token_kl(logp, base, estimator=kl_estimator, clamp=_KL_CLAMP,
                               straight_through=bool(unbiased_gradient), grad_weight=weight)
        if kl_estimator == "k3":
            # OpenRLHF clamps k3's log-ratio at -10 in its linear term too (fastrlhf clamps it inside exp
            # only): for r below -(e^20 + 9), a -inf log-prob in practice, fastrlhf's value is -10, OpenRLHF's +10
            kl = kl + torch.where(kl.detach() <= -_KL_CLAMP, 2 * _KL_CLAMP, 0.0)  # the value only
        if unbiased_gradient:
            # OpenRLHF's value is (v + g) - g with g = w r^2 / 2: NaN where g is not finite
            r = logp.detach() - base.detach()
            g = r.square().div_(2) if weight is None else weight * r.square().div_(2)
            kl = kl + g.mul_(0)
        return kl

    return compute_approx_kl


# ---------------------------------------------------------------- PPO losses


def _is_correction(module, old_log_probs, rollout_log_probs, action_mask, masked_mean):
    """OpenRLHF's train/rollout importance-sampling correction (read from 0.11.2's PolicyLoss.forward)
    as (per-token coefficient, vllm_kl, is_filter_ratio): the coefficient multiplies the per-token
    loss, so it goes to the op as is_weights. No gradient flows into it (OpenRLHF's only path to one
    is through old / rollout log-probs, which the caller checked need none)."""
    low, high = module.is_correction_threshold
    seq_level = module.is_correction_level == "seq"
    is_log_ratio = (old_log_probs - rollout_log_probs).detach()  # log(pi_train / pi_rollout)
    token_is = is_log_ratio.exp()
    if module.is_correction_gating == "ratio":
        stat = masked_mean(is_log_ratio, action_mask, dim=-1).unsqueeze(-1) if seq_level else is_log_ratio
        stat = stat.exp()
    else:
        p = rollout_log_probs.exp().clamp(1e-6, 1 - 1e-6)
        q = old_log_probs.exp().clamp(1e-6, 1 - 1e-6)
        if module.is_correction_gating == "binary_kl":
            stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
        else:  # tv
            stat = (p - q).abs()
        if seq_level:
            stat = masked_mean(stat, action_mask, dim=-1).unsqueeze(-1)
    if module.is_correction_mode == "clip":
        coef = stat.clamp(min=low, max=high)
        filtered = (stat < low) | (stat > high)
    else:
        keep = (stat >= low) & (stat <= high)
        coef = torch.where(keep, token_is, 0.0)
        filtered = ~keep
    is_filter_ratio = filtered.float().mean() if seq_level else masked_mean(filtered.float(), action_mask, dim=None)
    vllm_kl = masked_mean(rollout_log_probs - old_log_probs, action_mask, dim=None)
    return coef, vllm_kl, is_filter_ratio


def _fused_is_correction(module) -> bool:
    """The IS-correction settings `_is_correction` reproduces (the ones OpenRLHF's __init__ accepts)."""
    return (module.is_correction_level in _IS_LEVELS and module.is_correction_mode in _IS_MODES
            and module.is_correction_gating in _IS_GATINGS
            and (module.is_correction_mode == "mask" or (module.is_correction_level, module.is_correction_gating)
                 == ("token", "ratio")))


def _is_clip(x, above=None) -> bool:
    return (isinstance(x, numbers.Real) and not isinstance(x, bool) and x >= 0
            and (above is None or x > above))


def _policy_loss_forward(original, aggregate_loss, masked_mean):
    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                batch_num_tokens=None, global_batch_size=None):
        args = (self, log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, dp_size, batch_num_tokens,
                global_batch_size)
        keywords = _agg_keywords(self.token_level_loss, dp_size, batch_num_tokens, global_batch_size)
        correction = self.is_correction_level != "off"
        gspo = self.policy_loss_type == "gspo"  # under correction its ratio is against the rollout's log-probs
        rollout = rollout_log_probs if correction else None
        if (keywords is None or self.policy_loss_type not in ("ppo", "gspo")
                or not isinstance(action_mask, torch.Tensor)
                or not floats(log_probs, old_log_probs, advantages, *((rollout_log_probs,) if correction else ()))
                or not same_shape(log_probs, old_log_probs, advantages, action_mask, rollout)
                or (correction and not gspo and not _fused_is_correction(self))
                or needs_grad(old_log_probs, advantages, rollout)
                or not (_is_clip(self.clip_eps_low) and _is_clip(self.clip_eps_high))
                or not (self.dual_clip is None or _is_clip(self.dual_clip, above=1.0))
                or float64_on_kernels(log_probs, old_log_probs, advantages, rollout)
                or not bool(all_finite(log_probs, old_log_probs, advantages, rollout))):
            return original(*args)  # non-finite inputs: OpenRLHF's NaN / inf conventions, gradients included
        weights = vllm_kl = is_filter_ratio = None
        if correction and not gspo:
            weights, vllm_kl, is_filter_ratio = _is_correction(self, old_log_probs, rollout_log_probs, action_mask,
                                                               masked_mean)
        base = rollout_log_probs if gspo and correction else old_log_probs  # the ratio's denominator
        loss_dtype = promoted(log_probs, old_log_probs, advantages, weights)  # OpenRLHF's per-token loss
        row_weights = _row_mean_weights(keywords, loss_dtype, action_mask)
        if row_weights is not None:
            weights = row_weights.expand_as(log_probs) if weights is None else weights * row_weights
        mode = "gspo" if gspo else "vanilla"
        loss, stats = fastrlhf.policy_loss(log_probs, base, advantages, action_mask, loss_mode=mode,
                                           clip_low=self.clip_eps_low, clip_high=self.clip_eps_high,
                                           dual_clip=self.dual_clip, is_weights=weights, **keywords)
        loss = _as_openrlhf(loss, None, action_mask, keywords)
        if base is not old_log_probs:  # OpenRLHF's ppo_kl is against old_log_probs whatever the ratio's base
            stats = dict(stats, approx_kl_unclamped=masked_mean(old_log_probs - log_probs.detach(), action_mask,
                                                                dim=None))
        # clip_ratio and ppo_kl are masked means over the local tokens: NaN for an empty mask
        empty = action_mask.sum() == 0
        clip_ratio, ppo_kl = (torch.where(empty, float("nan"), stats[k]) for k in ("clipfrac", "approx_kl_unclamped"))
        dims = log_probs.dim()
        loss = loss.to(dtypes_of(aggregate_loss, like(loss_dtype, dims), action_mask, self.token_level_loss, dp_size,
                                 batch_num_tokens, global_batch_size))
        clip_ratio = clip_ratio.to(dtypes_of(masked_mean, like(torch.float32, dims), action_mask, None))
        ppo_kl = ppo_kl.to(dtypes_of(masked_mean, like(promoted(log_probs, old_log_probs), dims), action_mask, None))
        return loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio

    return forward


def _fusable_values(values, old_values, returns, mask, keywords, loss_dtype) -> torch.Tensor:
    """(0-dim bool) fastrlhf's value_loss gives OpenRLHF's answer: finite inputs (OpenRLHF's NaN / inf
    conventions, gradients included, are its own function's) and, per sample, rows whose
    n_b + 1e-8 rounds to n_b (fastrlhf's value_loss takes no per-token weights to fold the
    difference into; a 0/1 mask in float32 always does)."""
    ok = all_finite(values, old_values, returns)
    weights = _row_mean_weights(keywords, loss_dtype, mask)
    if weights is not None:
        ok = ok & ((weights == 1) | (weights == 0)).all()
    return ok


def _value_loss_forward(original, aggregate_loss):
    def forward(self, values, old_values, returns, action_mask=None, dp_size=1, batch_num_tokens=None,
                global_batch_size=None):
        args = (self, values, old_values, returns, action_mask, dp_size, batch_num_tokens, global_batch_size)
        keywords = _agg_keywords(self.token_level_loss, dp_size, batch_num_tokens, global_batch_size)
        loss_dtype = promoted(values, returns) if self.clip_eps is None else promoted(values, old_values, returns)
        if (keywords is None or not isinstance(action_mask, torch.Tensor) or not floats(values, old_values, returns)
                or not same_shape(values, old_values, returns, action_mask) or needs_grad(old_values, returns)
                or not (self.clip_eps is None or _is_clip(self.clip_eps))
                or float64_on_kernels(values, old_values, returns)
                or not bool(_fusable_values(values, old_values, returns, action_mask, keywords, loss_dtype))):
            return original(*args)
        loss, _ = fastrlhf.value_loss(values, old_values, returns, action_mask, clip=self.clip_eps, **keywords)
        loss = _as_openrlhf(loss, None, action_mask, keywords)
        return loss.to(dtypes_of(aggregate_loss, like(loss_dtype, values.dim()), action_mask, self.token_level_loss,
                                 dp_size, batch_num_tokens, global_batch_size))

    return forward


# ---------------------------------------------------------------- GAE


def _get_advantages_and_returns(original):
    @torch.no_grad()
    def get_advantages_and_returns(self, values, rewards, action_mask, gamma, lambd):
        if float64_on_kernels(values, rewards):
            return original(self, values, rewards, action_mask, gamma, lambd)
        # OpenRLHF zeroes rewards and values off the mask, then runs the recursion through every
        # position and keeps what it produces there: fastrlhf's "zero" mode over an all-ones mask
        if action_mask is not None:
            values = action_mask * values
            rewards = action_mask * rewards
        dtype = promoted(values, rewards)
        every = torch.ones(rewards.shape, dtype=torch.bool, device=rewards.device)
        advantages, returns = fastrlhf.gae(rewards, values, every, gamma=gamma, lam=lambd, mask_mode="zero",
                                           whiten=False)
        return advantages.to(dtype), returns.to(dtype)

    return get_advantages_and_returns
