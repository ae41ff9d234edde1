"""fastrlhf ops inside OpenRLHF (>= 0.11): `patch()` / `unpatch()`.

What `patch()` replaces (module functions are rebound in every loaded openrlhf module that
imported them by name, e.g. `openrlhf.models.actor`, `openrlhf.trainer.ray.ppo_actor`):

OpenRLHF                                      fastrlhf op               OpenRLHF's own still runs for
models.utils.log_probs_from_logits            logprobs                  -
models.utils.compute_entropy                  logprobs(return_entropy)  -
models.utils.compute_approx_kl                token_kl                  unbiased_gradient=True, unknown estimators
models.loss.PolicyLoss.forward                policy_loss               gspo, the train/rollout IS correction,
                                                                        dp_size > 1 with batch_num_tokens, the
                                                                        per-sample loss with global_batch_size,
                                                                        action_mask=None
models.loss.ValueLoss.forward                 value_loss                the same aggregation cases
trainer.ppo_utils.experience_maker            gae                       -
  .RemoteExperienceMaker.get_advantages_and_returns

Not replaced: `models.utils.compute_reward` (it takes an already computed KL and is one
elementwise pass; fastrlhf's kl_shaped_rewards zeroes the KL term off the mask and gives
an empty row no score, where OpenRLHF keeps -kl_coef * kl there and puts the score on the
last position), `models.loss.aggregate_loss` (needs a public fastrlhf agg_loss).

Conventions kept (read from OpenRLHF 0.11.2): `compute_approx_kl` computes in float32
whatever the input dtype and clamps every estimator to +-10; `log_probs_from_logits`
divides the logits in place by a temperature != 1, as the original does; log-probs and
entropy come back in the logits' dtype (float32 from flash-attn's cross-entropy when it is
installed, for float32/float64 logits); the losses divide by the local count without
global numbers, so an empty mask gives NaN (and NaN gradients) as in OpenRLHF; GAE runs
through masked positions with rewards and values zeroed there, and keeps the values it
produces off the mask.
"""

from __future__ import annotations

import importlib.util

import torch

import fastrlhf
from fastrlhf.integrations import Patcher, logger, peer_version

SUPPORTED = "OpenRLHF >= 0.11"
_PATCHER = Patcher("openrlhf", "openrlhf")

_KL_CLAMP = 10.0  # OpenRLHF clamps every KL estimator's value to +-10


def patch() -> None:
    """Replace OpenRLHF's log-prob, entropy, KL, GAE and PPO-loss code paths with fastrlhf's
    ops (table in the module docstring). Idempotent."""
    if _PATCHER.active:
        return
    peer_version("openrlhf", supported=SUPPORTED, minimum="0.11")
    import openrlhf.models.loss as loss
    import openrlhf.models.utils as utils

    try:
        p = _PATCHER
        p.function(utils, "log_probs_from_logits", _log_probs_from_logits(_flash_ce_available()))
        p.function(utils, "compute_entropy", _compute_entropy)
        p.function(utils, "compute_approx_kl", _compute_approx_kl(utils.compute_approx_kl))
        p.attribute(loss.PolicyLoss, "forward", _policy_loss_forward(loss.PolicyLoss.forward, utils.masked_mean))
        p.attribute(loss.ValueLoss, "forward", _value_loss_forward(loss.ValueLoss.forward))
        try:  # imports ray and vllm-facing modules: present in a real OpenRLHF install
            from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
        except ImportError as e:
            logger.warning("fastrlhf: OpenRLHF's experience maker could not be imported (%s); its GAE is not patched",
                           e)
        else:
            p.attribute(RemoteExperienceMaker, "get_advantages_and_returns", _get_advantages_and_returns)
    except BaseException:  # never leave a half-patched peer behind
        _PATCHER.undo()
        raise


def unpatch() -> None:
    """Put every original OpenRLHF function back. Idempotent."""
    _PATCHER.undo()


# ---------------------------------------------------------------- helpers


def _flash_ce_available() -> bool:
    """Whether OpenRLHF's log_probs_from_logits would use flash-attn's cross-entropy."""
    try:
        return importlib.util.find_spec("flash_attn.ops.triton.cross_entropy") is not None
    except (ImportError, ValueError):
        return False


def _result_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _nan_if_empty(x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """OpenRLHF's masked_mean is sum / count: 0 / 0 = NaN for an empty mask, with NaN
    gradients. Dividing by (count > 0) gives exactly that, and x itself otherwise."""
    return x / (count > 0).to(x.dtype)


def _fused_agg(token_level_loss, dp_size, batch_num_tokens, global_batch_size):
    """(agg, global_num_tokens) when fastrlhf's aggregation equals OpenRLHF's aggregate_loss
    for these arguments today, else None."""
    if token_level_loss:
        if batch_num_tokens is None:  # masked_mean over the local tokens; dp_size is not used
            return "token-mean", None
        # TODO(ops: dp_size): token-mean with global_num_tokens and dp_size
        if dp_size != 1:
            return None
        if isinstance(batch_num_tokens, torch.Tensor):
            batch_num_tokens = batch_num_tokens.item()
        return ("token-mean", batch_num_tokens) if batch_num_tokens > 0 else None
    # TODO(ops: global_num_seqs, dp_size): seq-mean-token-mean over a global sample count
    if global_batch_size is None:
        return "seq-mean-token-mean", None
    return None


def _local_count(mask: torch.Tensor, agg: str) -> torch.Tensor:
    if agg == "token-mean":
        return mask.sum()
    return (mask.sum(-1) > 0).sum()


# ---------------------------------------------------------------- log-probs and entropy


def _log_probs_from_logits(flash_ce: bool):
    def log_probs_from_logits(logits, labels, temperature=1.0):
        if temperature != 1.0:
            logits.div_(temperature)  # OpenRLHF scales the caller's logits in place
        logp = fastrlhf.logprobs(logits, labels)
        if flash_ce and logits.dtype in (torch.float32, torch.float64):
            return logp.float()
        return logp.to(logits.dtype)

    return log_probs_from_logits


def _compute_entropy(logits):
    # TODO(ops: entropy-only op): fastrlhf.entropy(logits) once it lands (one read, no label).
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    _, entropy = fastrlhf.logprobs(logits, labels, return_entropy=True)
    return entropy.to(logits.dtype)


# ---------------------------------------------------------------- KL


def _compute_approx_kl(original):
    def compute_approx_kl(log_probs, log_probs_base, log_probs_old=None, kl_estimator="k1",
                          unbiased_gradient=False):
        if unbiased_gradient or kl_estimator not in ("k1", "k2", "k3") or log_probs.shape != log_probs_base.shape:
            # TODO(ops: straight-through KL with grad_weight): token_kl(..., straight_through=True,
            # grad_weight=clamp(exp(log_probs - log_probs_old), max=KL_IS_WEIGHT_CLIP))
            return original(log_probs, log_probs_base, log_probs_old=log_probs_old, kl_estimator=kl_estimator,
                            unbiased_gradient=unbiased_gradient)
        return fastrlhf.token_kl(log_probs, log_probs_base, estimator=kl_estimator, clamp=_KL_CLAMP).float()

    return compute_approx_kl


# ---------------------------------------------------------------- PPO losses


def _policy_loss_forward(original, masked_mean):
    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                batch_num_tokens=None, global_batch_size=None):
        args = (self, log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, dp_size, batch_num_tokens,
                global_batch_size)
        fused = _fused_agg(self.token_level_loss, dp_size, batch_num_tokens, global_batch_size)
        # TODO(ops: is_weights): the train/rollout IS correction as policy_loss(..., is_weights=coef)
        if (fused is None or self.policy_loss_type != "ppo" or self.is_correction_level != "off"
                or action_mask is None):
            return original(*args)
        agg, num_tokens = fused
        loss, stats = fastrlhf.policy_loss(log_probs, old_log_probs, advantages, action_mask,
                                           clip_low=self.clip_eps_low, clip_high=self.clip_eps_high,
                                           dual_clip=self.dual_clip, agg=agg, global_num_tokens=num_tokens)
        if num_tokens is None:
            loss = _nan_if_empty(loss, _local_count(action_mask, agg))
        dtype = _result_dtype(log_probs, old_log_probs, advantages)
        clip_ratio = _nan_if_empty(stats["clipfrac"], action_mask.sum())
        # OpenRLHF's ppo_kl is the mean of the unclamped -log-ratio (fastrlhf's approx_kl clamps it to +-20)
        # TODO(ops: unclamped ppo_kl stat): take it from the policy_loss stats
        neg_log_ratio = fastrlhf.token_kl(old_log_probs.detach(), log_probs.detach(), estimator="k1")
        ppo_kl = masked_mean(neg_log_ratio.to(_result_dtype(log_probs, old_log_probs)), action_mask, dim=None)
        return loss.to(dtype), clip_ratio, ppo_kl, None, None

    return forward


def _value_loss_forward(original):
    def forward(self, values, old_values, returns, action_mask=None, dp_size=1, batch_num_tokens=None,
                global_batch_size=None):
        args = (self, values, old_values, returns, action_mask, dp_size, batch_num_tokens, global_batch_size)
        fused = _fused_agg(self.token_level_loss, dp_size, batch_num_tokens, global_batch_size)
        if fused is None or action_mask is None:
            return original(*args)
        agg, num_tokens = fused
        loss, _ = fastrlhf.value_loss(values, old_values, returns, action_mask, clip=self.clip_eps, agg=agg,
                                      global_num_tokens=num_tokens)
        if num_tokens is None:
            loss = _nan_if_empty(loss, _local_count(action_mask, agg))
        return loss.to(_result_dtype(values, old_values, returns))

    return forward


# ---------------------------------------------------------------- GAE


@torch.no_grad()
def _get_advantages_and_returns(self, values, rewards, action_mask, gamma, lambd):
    # OpenRLHF zeroes rewards and values off the mask, then runs the recursion through every
    # position and keeps what it produces there: fastrlhf's "zero" mode over an all-ones mask
    if action_mask is not None:
        values = action_mask * values
        rewards = action_mask * rewards
    dtype = _result_dtype(values, rewards)
    every = torch.ones(rewards.shape, dtype=torch.bool, device=rewards.device)
    advantages, returns = fastrlhf.gae(rewards, values, every, gamma=gamma, lam=lambd, mask_mode="zero",
                                       whiten=False)
    return advantages.to(dtype), returns.to(dtype)
