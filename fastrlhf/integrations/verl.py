"""fastrlhf ops inside verl (>= 0.9): `patch()` / `unpatch()`.

What `patch()` replaces (module attributes are rebound in every loaded verl module that
imported them by name, e.g. `verl.workers.utils.losses`, `verl.workers.engine.fsdp.transformer_impl`):

verl function                                 fastrlhf op               verl's own still runs for
utils.torch_functional.logprobs_from_logits   logprobs                  the torch_npu cross-entropy path
utils.torch_functional.entropy_from_logits    logprobs(return_entropy)  -
trainer.ppo.core_algos.kl_penalty             token_kl                  "+" names (but k2+ / mse+), "full", unknown
                                                                        names, broadcast shapes
core_algos.compute_gae_advantage_return       gae                       a non-binary (weighting) mask
  and ADV_ESTIMATOR_REGISTRY["gae"]
core_algos.compute_policy_loss_vanilla        policy_loss               rollout_is_weights, dp_size > 1, token-sum,
  and POLICY_LOSS_REGISTRY["vanilla"]                                   seq-mean-token-sum(-norm), seq-mean modes
                                                                        with global_batch_size
core_algos.compute_value_loss                 value_loss                the same aggregation cases

Not replaced yet: `core_algos.agg_loss` (needs a public fastrlhf agg_loss).
Call `patch()` before verl builds its workers: the engines keep `entropy_from_logits` in an
attribute at construction time.

Conventions kept (read from verl 0.9.1): outputs in verl's dtypes (`kl_penalty` and
`entropy_from_logits` in the input dtype, `logprobs_from_logits` in the logits' dtype unless
flash-attn's cross-entropy is in use, which gives float32); an empty mask gives a NaN loss
(0 / 0, zero gradients) unless a global token count is given; GAE leaves each masked
position with the advantage carried from the next response token (and returns = that +
values), whitened with verl's own `masked_whiten`; policy-loss metrics are Python floats
under verl's keys.
"""

from __future__ import annotations

import os

import torch

import fastrlhf
from fastrlhf.integrations import Patcher, peer_version

SUPPORTED = "verl >= 0.9"
_PATCHER = Patcher("verl", "verl")

_KL_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
_LOW_VAR_KL_CLAMP = 10.0  # verl clamps low_var_kl / k3 to +-10


def patch() -> None:
    """Replace verl's log-prob, entropy, KL, GAE, policy-loss and value-loss functions with
    fastrlhf's ops (table in the module docstring). Idempotent."""
    if _PATCHER.active:
        return
    peer_version("verl", supported=SUPPORTED, minimum="0.9")
    import verl.trainer.ppo.core_algos as core_algos
    import verl.utils.torch_functional as verl_F

    try:
        p = _PATCHER
        p.function(verl_F, "logprobs_from_logits", _logprobs_from_logits(verl_F.logprobs_from_logits, verl_F))
        p.function(verl_F, "entropy_from_logits", _entropy_from_logits)
        p.function(core_algos, "kl_penalty", _kl_penalty(core_algos.kl_penalty))
        gae = _gae(core_algos.compute_gae_advantage_return, verl_F)
        if core_algos.ADV_ESTIMATOR_REGISTRY.get("gae") is core_algos.compute_gae_advantage_return:
            p.item(core_algos.ADV_ESTIMATOR_REGISTRY, "gae", gae, "core_algos.ADV_ESTIMATOR_REGISTRY")
        p.function(core_algos, "compute_gae_advantage_return", gae)
        vanilla = _policy_loss_vanilla(core_algos.compute_policy_loss_vanilla, core_algos)
        if core_algos.POLICY_LOSS_REGISTRY.get("vanilla") is core_algos.compute_policy_loss_vanilla:
            p.item(core_algos.POLICY_LOSS_REGISTRY, "vanilla", vanilla, "core_algos.POLICY_LOSS_REGISTRY")
        p.function(core_algos, "compute_policy_loss_vanilla", vanilla)
        p.function(core_algos, "compute_value_loss", _value_loss(core_algos.compute_value_loss))
    except BaseException:  # never leave a half-patched peer behind
        _PATCHER.undo()
        raise


def unpatch() -> None:
    """Put every original verl function back. Idempotent."""
    _PATCHER.undo()


# ---------------------------------------------------------------- helpers


def _result_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _nan_if_empty(loss: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """verl divides by the local count: 0 / 0 = NaN (with zero gradients) for an empty mask."""
    return torch.where(count > 0, loss, torch.full_like(loss, float("nan")))


def _is_binary(mask: torch.Tensor) -> bool:
    return mask.dtype == torch.bool or bool(((mask == 0) | (mask == 1)).all())


def _fused_agg(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size):
    """(agg, global_num_tokens) when fastrlhf's aggregation equals verl's agg_loss for these
    arguments today, else None."""
    # TODO(ops: dp_size, global_num_seqs, token-sum, loss_scale_factor, fixed seq-mean-token-sum(-norm)):
    # route every mode through the fused loss once the ops take verl's full agg_loss arguments.
    if dp_size != 1:
        return None
    if loss_agg_mode == "token-mean":
        if isinstance(batch_num_tokens, torch.Tensor):
            batch_num_tokens = batch_num_tokens.item()
        if batch_num_tokens is not None and not batch_num_tokens > 0:
            return None
        return "token-mean", batch_num_tokens
    if loss_agg_mode == "seq-mean-token-mean" and global_batch_size is None:
        return "seq-mean-token-mean", None
    return None


def _local_count(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """The count verl divides by without global numbers: tokens, or non-empty sequences."""
    if agg == "token-mean":
        return mask.sum()
    return (mask.sum(-1) > 0).sum()


# ---------------------------------------------------------------- log-probs and entropy


def _logprobs_from_logits(original, verl_F):
    def logprobs_from_logits(logits, labels, inplace_backward=True):
        flash = verl_F.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE and os.environ.get("VERL_DISABLE_FLASH_ATTN_CE",
                                                                                 "0") != "1"
        if not flash and verl_F.NPU_CROSS_ENTROPY_LOSS_AVAILABLE:
            return original(logits, labels, inplace_backward)
        # verl's flash-attn path writes d(logits) into the logits when asked; do the same only then
        logp = fastrlhf.logprobs(logits, labels, inplace_backward=bool(flash and inplace_backward))
        return logp if flash else logp.to(logits.dtype)

    return logprobs_from_logits


def _entropy_from_logits(logits):
    # TODO(ops: entropy-only op): fastrlhf.entropy(logits) once it lands (one read, no label).
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    _, entropy = fastrlhf.logprobs(logits, labels, return_entropy=True)
    return entropy.to(logits.dtype)


# ---------------------------------------------------------------- KL


def _kl_penalty(original):
    def kl_penalty(logprob, ref_logprob, kl_penalty):
        name = kl_penalty
        base = name[:-1] if isinstance(name, str) and name.endswith("+") else name
        if (base not in _KL_NAMES or not isinstance(logprob, torch.Tensor) or not isinstance(ref_logprob, torch.Tensor)
                or logprob.shape != ref_logprob.shape):
            return original(logprob, ref_logprob, name)
        if name.endswith("+") and base not in ("mse", "k2"):
            # TODO(ops: straight-through KL): token_kl(..., straight_through=True)
            return original(logprob, ref_logprob, name)
        clamp = _LOW_VAR_KL_CLAMP if base in ("low_var_kl", "k3") else None
        kl = fastrlhf.token_kl(logprob, ref_logprob, estimator=base, clamp=clamp)
        return kl.to(_result_dtype(logprob, ref_logprob))

    return kl_penalty


# ---------------------------------------------------------------- GAE


def _carry_next(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's recursion leaves each masked position holding the advantage of the next
    response token after it (0 past the last one); fastrlhf writes 0 there."""
    B, T = adv.shape
    positions = torch.arange(T, device=adv.device).expand(B, T)
    at = torch.where(mask.bool(), positions, torch.full_like(positions, T))
    next_token = at.flip(-1).cummin(-1).values.flip(-1)
    return torch.cat([adv, adv.new_zeros(B, 1)], dim=-1).gather(-1, next_token)


def _gae(original, verl_F):
    def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
        if token_level_rewards.dim() != 2 or not _is_binary(response_mask):
            return original(token_level_rewards, values, response_mask, gamma, lam)
        gamma = gamma.item() if isinstance(gamma, torch.Tensor) else gamma
        lam = lam.item() if isinstance(lam, torch.Tensor) else lam
        dtype = _result_dtype(token_level_rewards, values)
        with torch.no_grad():
            adv, _ = fastrlhf.gae(token_level_rewards, values, response_mask, gamma=gamma, lam=lam,
                                  mask_mode="skip", whiten=False)
            adv = _carry_next(adv.to(dtype), response_mask)
            returns = adv + values
            advantages = verl_F.masked_whiten(adv, response_mask)
        return advantages, returns

    return compute_gae_advantage_return


# ---------------------------------------------------------------- PPO losses


def _policy_loss_vanilla(original, core_algos):
    def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                    config=None, rollout_is_weights=None):
        args = (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
        if config is None or isinstance(config, core_algos.AlgoConfig) or rollout_is_weights is not None:
            # TODO(ops: is_weights): policy_loss(..., is_weights=rollout_is_weights)
            return original(*args)
        try:
            clip = config.clip_ratio
            clip_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip
            clip_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip
            clip_c = config.get("clip_ratio_c", 3.0)
            info = dict(config.global_batch_info)
        except Exception:  # verl's own function raises its own error for this config
            return original(*args)
        fused = _fused_agg(loss_agg_mode, info.get("dp_size", 1), info.get("batch_num_tokens"),
                           info.get("global_batch_size"))
        if fused is None or clip_low is None or clip_high is None or not clip_c > 1.0:
            return original(*args)
        agg, num_tokens = fused
        loss, stats = fastrlhf.policy_loss(log_prob, old_log_prob, advantages, response_mask, clip_low=clip_low,
                                           clip_high=clip_high, dual_clip=clip_c, agg=agg,
                                           global_num_tokens=num_tokens)
        if num_tokens is None:
            loss = _nan_if_empty(loss, _local_count(response_mask, agg))
        metrics = {
            "actor/pg_clipfrac": stats["clipfrac"].item(),
            "actor/ppo_kl": stats["approx_kl"].item(),
            "actor/pg_clipfrac_lower": stats["clipfrac_lower"].item(),
        }
        return loss.to(_result_dtype(old_log_prob, log_prob, advantages)), metrics

    return compute_policy_loss_vanilla


def _value_loss(original):
    def compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode="token-mean",
                           dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
        args = (vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode, dp_size, batch_num_tokens,
                global_batch_size, loss_scale_factor)
        fused = _fused_agg(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size)
        if fused is None or cliprange_value is None:
            return original(*args)
        agg, num_tokens = fused
        loss, stats = fastrlhf.value_loss(vpreds, values, returns, response_mask, clip=cliprange_value, agg=agg,
                                          global_num_tokens=num_tokens)
        if num_tokens is None:
            loss = _nan_if_empty(loss, _local_count(response_mask, agg))
        dtype = _result_dtype(vpreds, returns, values)
        return loss.to(dtype), stats["clipfrac"]

    return compute_value_loss
