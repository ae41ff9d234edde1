"""fastrlhf ops inside verl (>= 0.9): `patch()` / `unpatch()`.

What `patch()` replaces (module attributes are rebound in every loaded verl module that
imported them by name, e.g. `verl.workers.utils.losses`, `verl.workers.engine.fsdp.transformer_impl`,
`verl.trainer.ppo.ray_trainer`; the other policy losses in core_algos call `agg_loss` through the
module, so they aggregate through fastrlhf too):

verl function                                 fastrlhf op               verl's own still runs for
utils.torch_functional.logprobs_from_logits   logprobs                  the torch_npu cross-entropy path
utils.torch_functional.entropy_from_logits    entropy                   -
trainer.ppo.core_algos.kl_penalty             token_kl                  "full" and unknown names (verl raises),
                                                                        broadcast shapes, low_var_kl / k3 of
                                                                        non-finite log-probs
core_algos.agg_loss                           agg_loss                  unknown modes and dp_size > 1 without the
                                                                        global count (verl raises); counts <= 0
core_algos.compute_gae_advantage_return       gae                       a non-binary (weighting) mask
  and ADV_ESTIMATOR_REGISTRY["gae"]
POLICY_LOSS_REGISTRY (every entry but          policy_loss(loss_mode=)   non-finite inputs; old_log_prob, advantages
  bypass_mode, which runs on the patched                                or weights that need a gradient; the agg
  compute_policy_loss_vanilla and rollout                               cases above; geo_mean in float64 or with a
  helper) and the core_algos functions:                                 weighting mask (verl's row means divide by
  vanilla, gspo (gspo_token), cispo, sapo,                              n + 1e-8)
  gpg, dro, dppo_tv, dppo_kl, clip_cov,
  kl_cov, geo_mean
rollout_corr_helper.compute_rollout_          rollout_correction        arguments verl rejects (it raises), float
  correction_and_rejection_mask                                         (weighting) masks, float64 on the kernels
core_algos.compute_value_loss                 value_loss                as the policy losses; seq-mean-token-mean
                                                                        where verl's mask.sum(-1) + 1e-8 != n_b
                                                                        (a float64 mask, rows of weights summing
                                                                        below ~0.2)
core_algos.compute_policy_loss_reinforce      policy_loss(loss_mode=    as the registry entries
  (bypass_mode's reinforce branch)              "reinforce")

Every agg mode (token-mean, token-sum, seq-mean-token-sum(-norm), seq-mean-token-mean), dp_size,
batch_num_tokens, global_batch_size and loss_scale_factor, the straight-through names ("k1+",
"k3+", "low_var_kl+", "abs+") and rollout_is_weights run fused. A policy-loss or rollout-correction
call that falls back to verl's own function logs why, once per (function, reason), on the
"fastrlhf.integrations" logger. Call `patch()` before verl builds its workers: the engines keep
`entropy_from_logits` in an attribute at construction time.

Conventions kept (read from verl 0.9.1): outputs in verl's dtypes (found by running verl's own
agg_loss on meta tensors; `kl_penalty` and `entropy_from_logits` in the input dtype,
`logprobs_from_logits` in the logits' dtype unless flash-attn's cross-entropy is in use, which
gives float32); without a global count an empty mask gives a NaN loss (0 / 0, zero gradients);
the seq-mean modes multiply the loss by the mask, so a non-finite value at a mask = 0 token of a
non-empty row makes the loss NaN (the token modes drop it); seq-mean-token-mean divides by
mask.sum(-1) + 1e-8 computed as verl computes it, in the mask's arithmetic (float32 for a bool
or integer mask, where it is n_b exactly; the mask's dtype for a float mask); a "+" KL is NaN
where logprob - ref_logprob is not finite; low_var_kl clamps the log-ratio in its linear term
too; GAE leaves each masked position with the advantage carried from the next response token
(and returns = that + values), whitened with verl's own `masked_whiten`; policy-loss metrics
are Python floats under verl's keys, masked means over mask.sum() + 1e-8. Non-finite policy /
value loss inputs run verl's own function, whose gradients are NaN where fastrlhf's are 0.

Not kept (fastrlhf's op conventions, docs/ops.md), so not verl's gradients or errors there:
- Exact ties of a clipped and an unclipped term: fastrlhf gives the unclipped term the whole
  gradient, where verl's torch.min / torch.max split a tie in half and its torch.clamp passes 0
  at a bound from torch 2.14 on. At ratio == clip_ratio_c with A < 0 the patched gradient is 2x
  verl's, at vpreds == values +- cliprange_value 4/3x (verl's clip_by_value splits too), and from
  torch 2.14 2x at ratio == 1 +- clip_ratio (the log-ratio clamp's +-20 bound: verl's is 0
  there). Values are equal; a tie needs inputs exactly at a bound.
- Labels of -100 give log-prob 0 and labels outside [0, V) NaN, where verl's torch path raises
  an index error; -inf logits give a finite entropy with finite gradients, where verl's
  entropy_from_logits is NaN in both. A caller's bad label is not caught.
"""

from __future__ import annotations

import inspect
import os

import torch

import fastrlhf
from fastrlhf.constants import AGG_MODES
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
from fastrlhf.ops.policy_modes import make_spec

SUPPORTED = "verl >= 0.9"
_PATCHER = Patcher("verl", "verl")

_KL_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
_LOW_VAR_KL_CLAMP = 10.0  # verl clamps low_var_kl / k3 to +-10
_BATCH_INFO = {"dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor"}  # agg_loss's keywords
_POLICY_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


def patch() -> None:
    """Replace verl's log-prob, entropy, KL, aggregation, GAE, policy-loss and value-loss
    functions with fastrlhf's ops (table in the module docstring). Idempotent."""
    if _PATCHER.active:
        return
    peer_version("verl", supported=SUPPORTED, minimum="0.9")
    import verl.trainer.ppo.core_algos as core_algos
    import verl.utils.torch_functional as verl_F

    if _PATCHER.active:
        return  # importing the peer ran the FASTRLHF_PATCH hook (fastrlhf_hook), which patched it

    agg_loss = core_algos.agg_loss
    with _PATCHER.patching() as p:  # undone if any of it raises: never a half-patched peer
        p.function(verl_F, "logprobs_from_logits", _logprobs_from_logits(verl_F.logprobs_from_logits, verl_F))
        p.function(verl_F, "entropy_from_logits", _entropy_from_logits(verl_F.entropy_from_logits))
        p.function(core_algos, "kl_penalty", _kl_penalty(core_algos.kl_penalty))
        p.function(core_algos, "agg_loss", _agg_loss(agg_loss))
        gae = _gae(core_algos.compute_gae_advantage_return, verl_F)
        if core_algos.ADV_ESTIMATOR_REGISTRY.get("gae") is core_algos.compute_gae_advantage_return:
            p.item(core_algos.ADV_ESTIMATOR_REGISTRY, "gae", gae, "core_algos.ADV_ESTIMATOR_REGISTRY")
        p.function(core_algos, "compute_gae_advantage_return", gae)
        _patch_policy_losses(p, core_algos, agg_loss)
        p.function(core_algos, "compute_value_loss", _value_loss(core_algos.compute_value_loss, agg_loss, verl_F))
        _patch_rollout_correction(p)


def _patch_policy_losses(p: Patcher, core_algos, agg_loss) -> None:
    """Every fused POLICY_LOSS_REGISTRY entry, in the registry (get_policy_loss_fn reads it) and as the
    module function of the same name (bypass_mode calls compute_policy_loss_vanilla by name)."""
    registry = core_algos.POLICY_LOSS_REGISTRY
    for name in FUSED_POLICY_LOSSES:
        original = registry.get(name)
        if original is None:
            continue
        adapter = _policy_loss(name, original, core_algos, agg_loss)
        p.item(registry, name, adapter, "core_algos.POLICY_LOSS_REGISTRY")
        if getattr(core_algos, original.__name__, None) is original:
            p.function(core_algos, original.__name__, adapter)
    # not in the registry: bypass_mode's reinforce branch calls it by name
    p.function(core_algos, "compute_policy_loss_reinforce",
               _policy_loss("reinforce", core_algos.compute_policy_loss_reinforce, core_algos, agg_loss))


def _patch_rollout_correction(p: Patcher) -> None:
    """rollout_corr_helper.compute_rollout_correction_and_rejection_mask (what bypass_mode and
    compute_rollout_correction_and_add_to_batch call) on fastrlhf.rollout_correction."""
    import verl.trainer.ppo.rollout_corr_helper as helper

    original = helper.compute_rollout_correction_and_rejection_mask
    p.function(helper, "compute_rollout_correction_and_rejection_mask", _rollout_correction(original))


def unpatch() -> None:
    """Put every original verl function back. Idempotent."""
    _PATCHER.undo()


# ---------------------------------------------------------------- aggregation (verl's agg_loss arguments)


def _agg_keywords(mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    """fastrlhf.agg_loss keywords for verl's agg_loss arguments, or None where verl's own function
    must run: an unknown mode or dp_size > 1 without the global count (verl raises its own
    ValueError), or a count fastrlhf does not take (<= 0, non-finite, a non-integer dp_size).
    verl passes all of `global_batch_info` to every mode; each mode reads only its own."""
    if mode not in AGG_MODES:
        return None
    dp = scalar(dp_size)
    if dp is None or dp < 1 or dp != int(dp):
        return None
    keywords = {"agg": mode, "dp_size": int(dp)}
    if mode == "token-sum":
        return keywords
    name, count = ("global_num_tokens", batch_num_tokens) if mode == "token-mean" else \
        ("global_num_seqs", global_batch_size)
    if count is None:
        if dp > 1:
            return None
    else:
        count = scalar(count)
        if count is None or not count > 0:
            return None
        keywords[name] = count
    if mode == "seq-mean-token-sum-norm" and loss_scale_factor is not None:
        factor = scalar(loss_scale_factor)
        if factor is None or not factor > 0:
            return None
        keywords["loss_scale_factor"] = factor
    return keywords


def _nan_if_empty(loss: torch.Tensor, mask: torch.Tensor, keywords: dict) -> torch.Tensor:
    """Without a global count verl divides by the local one: an empty mask gives 0 / 0 = NaN
    (with zero gradients) where fastrlhf gives 0."""
    mode = keywords["agg"]
    if mode == "token-mean" and "global_num_tokens" not in keywords:
        empty = ~(mask.sum() > 0)
    elif mode.startswith("seq-mean") and "global_num_seqs" not in keywords:
        empty = ~(mask.sum(-1) > 0).any()
    else:
        return loss
    return torch.where(empty, torch.full_like(loss, float("nan")), loss)


def _nan_if_hidden(loss: torch.Tensor, loss_mat: torch.Tensor, mask: torch.Tensor, keywords: dict) -> torch.Tensor:
    """verl's seq-mean modes sum loss_mat * mask per row: a non-finite value at a mask = 0 token
    of a non-empty row makes the loss NaN (gradients unchanged). fastrlhf, like verl's token
    modes, ignores it."""
    if not keywords["agg"].startswith("seq-mean"):
        return loss
    hidden = (~torch.isfinite(loss_mat.detach()) & (mask == 0)).any(-1) & (mask.sum(-1) > 0)
    return loss + torch.where(hidden.any(), float("nan"), 0.0).to(loss.dtype)


def _row_mean_weights(mode: str, loss_dtype: torch.dtype, mask: torch.Tensor):
    """verl's seq-mean-token-mean as a per-row weight for fastrlhf's (None where it is 1)."""
    return row_mean_weights(loss_dtype, mask) if mode == "seq-mean-token-mean" else None


def _agg_loss(original):
    def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                 loss_scale_factor=None):
        args = (loss_mat, loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
        keywords = _agg_keywords(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
        if (keywords is None or not floats(loss_mat) or loss_mat.dim() == 0 or not isinstance(loss_mask, torch.Tensor)
                or not same_shape(loss_mat, loss_mask)):
            return original(*args)
        weights = _row_mean_weights(loss_agg_mode, loss_mat.dtype, loss_mask)
        loss = fastrlhf.agg_loss(loss_mat if weights is None else loss_mat * weights, loss_mask, **keywords)
        loss = _nan_if_hidden(_nan_if_empty(loss, loss_mask, keywords), loss_mat, loss_mask, keywords)
        return loss.to(dtypes_of(original, *args))

    return agg_loss


# ---------------------------------------------------------------- log-probs and entropy


def _logprobs_from_logits(original, verl_F):
    def logprobs_from_logits(logits, labels, inplace_backward=True):
        flash = verl_F.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE and os.environ.get("VERL_DISABLE_FLASH_ATTN_CE",
                                                                                 "0") != "1"
        if (not flash and verl_F.NPU_CROSS_ENTROPY_LOSS_AVAILABLE) or float64_on_kernels(logits):
            return original(logits, labels, inplace_backward)
        # verl's flash-attn path writes d(logits) into the logits when asked; do the same only then
        logp = fastrlhf.logprobs(logits, labels, inplace_backward=bool(flash and inplace_backward))
        return logp if flash else logp.to(logits.dtype)

    return logprobs_from_logits


def _entropy_from_logits(original):
    def entropy_from_logits(logits):
        if float64_on_kernels(logits):
            return original(logits)
        return fastrlhf.entropy(logits).to(logits.dtype)

    return entropy_from_logits


# ---------------------------------------------------------------- KL


def _kl_penalty(original):
    def kl_penalty(logprob, ref_logprob, kl_penalty):
        name = kl_penalty
        straight_through = isinstance(name, str) and name.endswith("+")
        base = name[:-1] if straight_through else name
        if (base not in _KL_NAMES or not isinstance(logprob, torch.Tensor)
                or not isinstance(ref_logprob, torch.Tensor) or logprob.shape != ref_logprob.shape
                or float64_on_kernels(logprob, ref_logprob)):
            return original(logprob, ref_logprob, name)
        straight_through = straight_through and base not in ("mse", "k2")  # k2's own gradient is already r
        clamp = _LOW_VAR_KL_CLAMP if base in ("low_var_kl", "k3") else None
        if clamp is not None and not straight_through and not bool(all_finite(logprob, ref_logprob)):
            # torch.clamp's gradient is 0 at NaN (and verl's log-ratio clamp cuts +-inf): fastrlhf's is NaN there
            return original(logprob, ref_logprob, name)
        dtype = promoted(logprob, ref_logprob)
        kl = fastrlhf.token_kl(logprob, ref_logprob, estimator=base, clamp=clamp, straight_through=straight_through)
        if clamp is not None:
            # verl clamps the log-ratio in k3's linear term too (fastrlhf only inside exp): for r below
            # -(e^20 + 9), a -inf log-prob in practice, fastrlhf's clamped value is -10 where verl's is +10
            kl = kl + torch.where(kl.detach() <= -clamp, 2 * clamp, 0.0)  # the value only
        kl = kl.to(dtype)
        if straight_through:
            # verl's value is (b - b) + f with b = (logprob - ref_logprob)^2 / 2: NaN where r is not finite
            r = logprob.detach().to(kl.dtype) - ref_logprob.detach().to(kl.dtype)
            kl = kl + r * 0
        return kl

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


def _is_binary(mask: torch.Tensor) -> bool:
    return mask.dtype == torch.bool or bool(((mask == 0) | (mask == 1)).all())


def _gae(original, verl_F):
    def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
        if (token_level_rewards.dim() != 2 or float64_on_kernels(token_level_rewards, values)
                or not _is_binary(response_mask)):
            return original(token_level_rewards, values, response_mask, gamma, lam)
        gamma = gamma.item() if isinstance(gamma, torch.Tensor) else gamma
        lam = lam.item() if isinstance(lam, torch.Tensor) else lam
        dtype = promoted(token_level_rewards, values)
        with torch.no_grad():
            adv, _ = fastrlhf.gae(token_level_rewards, values, response_mask, gamma=gamma, lam=lam,
                                  mask_mode="skip", whiten=False)
            adv = _carry_next(adv.to(dtype), response_mask)
            returns = adv + values
            advantages = verl_F.masked_whiten(adv, response_mask)
        return advantages, returns

    return compute_gae_advantage_return


# ---------------------------------------------------------------- PPO losses


def _masked_mean_factor(mask: torch.Tensor):
    """n / (n + 1e-8), n = mask.sum(): verl's masked_mean divides by n + 1e-8, fastrlhf's stats by n.
    1 exactly for a bool / int mask (the count is exact and 1e-8 is below its float32 ulp); None then."""
    if not mask.is_floating_point():
        return None
    n = mask.sum()
    return n / (n + 1e-8)


# verl's metric keys -> fastrlhf's stats, per registry entry (the metrics each of verl's functions returns)
_POLICY_METRIC_STATS = dict(zip(_POLICY_METRICS, ("clipfrac", "approx_kl", "clipfrac_lower")))
_METRICS_BY_LOSS = {"gpg": {}, "reinforce": {"actor/ppo_kl": "approx_kl_unclamped"},
                    "dro": {"actor/ppo_kl": "approx_kl"}, "kl_cov": {"actor/ppo_kl": "approx_kl_abs"},
                    "clip_cov": {"actor/pg_clipfrac": "clipfrac", "actor/ppo_kl": "approx_kl"}}
# POLICY_LOSS_REGISTRY entries that run on fastrlhf (bypass_mode runs on them through its parts)
FUSED_POLICY_LOSSES = ("vanilla", "gspo", "cispo", "sapo", "gpg", "dro", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov",
                       "geo_mean")


def _mode_of(name: str, config, clip_low: float, clip_high: float, clip_c: float) -> tuple[str, dict]:
    """(fastrlhf loss_mode, its options) for verl's registry entry `name` under `config` (read from verl
    0.9.1's functions: gspo is GSPO-token with log(s) <= 10, dppo truncates the ratio at clip_ratio_c)."""
    pl = config.policy_loss
    clips = dict(clip_low=clip_low, clip_high=clip_high)
    return {
        "vanilla": ("vanilla", dict(clips, dual_clip=clip_c)),
        "gspo": ("gspo_token", clips),
        "cispo": ("cispo", clips),
        "sapo": ("sapo", dict(tau_pos=config.tau_pos, tau_neg=config.tau_neg)),
        "gpg": ("gpg", {}),
        "reinforce": ("reinforce", {}),
        "dro": ("dro", dict(beta=pl.dro_beta)),
        "dppo_tv": ("dppo_tv", dict(clips, ratio_max=clip_c)),
        "dppo_kl": ("dppo_kl", dict(clips, ratio_max=clip_c)),
        "clip_cov": ("clip_cov", dict(clips, clip_cov_ratio=pl.clip_cov_ratio, clip_cov_lb=pl.clip_cov_lb,
                                      clip_cov_ub=pl.clip_cov_ub)),
        "kl_cov": ("kl_cov", dict(kl_cov_ratio=pl.kl_cov_ratio, ppo_kl_coef=pl.ppo_kl_coef)),
        "geo_mean": ("geo_mean", clips),
    }[name]


def _fallback(name: str, why: str) -> None:
    """Log once per (loss, reason) that verl's own function runs."""
    if (name, why) not in _FALLBACKS:
        _FALLBACKS.add((name, why))
        logger.info("fastrlhf: verl's own %s runs (%s)", name, why)


_FALLBACKS: set = set()


def _policy_loss(name, original, core_algos, agg_loss):
    """The adapter of verl's POLICY_LOSS_REGISTRY[name]: fastrlhf.policy_loss(loss_mode=...) with verl's
    options, aggregation, metric keys and dtypes; verl's own function for what it cannot answer exactly."""
    seq_mode = name == "geo_mean"  # verl's geo_mean: one loss per sequence, a mean over the B rows

    signature = inspect.signature(original)  # reinforce names its first argument rollout_log_prob

    def compute_policy_loss(*call_args, **call_kwargs):
        bound = signature.bind(*call_args, **call_kwargs)
        bound.apply_defaults()
        args = tuple(bound.arguments.values())
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights = args
        if config is None or isinstance(config, core_algos.AlgoConfig):
            return original(*args)  # verl asserts
        agg_mode = "seq-mean-token-mean" if name == "sapo" else loss_agg_mode  # verl's sapo always is
        try:
            clip = config.clip_ratio
            clip_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip
            clip_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip
            clip_c = config.get("clip_ratio_c", 3.0)
            info = dict(config.global_batch_info)
            mode, options = _mode_of(name, config, clip_low, clip_high, clip_c)
            make_spec(mode, **options)  # options fastrlhf rejects (dro_beta <= 0): verl raises its own error
        except Exception:  # verl's own function raises its own error for this config
            return original(*args)
        keywords = None if set(info) - _BATCH_INFO else _agg_keywords(agg_mode, **info)
        why = _unfusable(name, keywords, clip_low, clip_high, clip_c, log_prob, old_log_prob, advantages,
                         response_mask, rollout_is_weights)
        if why is None and _selects(mode) and not bool(
                all_finite(old_log_prob, log_prob, advantages, rollout_is_weights)):
            why = "non-finite inputs"  # checked first: the selection draws from the default generator once
        if why is not None:
            _fallback(original.__name__, why)
            return original(*args)
        loss_dtype = promoted(old_log_prob, log_prob, advantages, rollout_is_weights)  # verl's pg_losses
        weights = rollout_is_weights
        if seq_mode:
            keywords = {}
        else:
            row_weights = _row_mean_weights(agg_mode, loss_dtype, response_mask)
            if row_weights is not None:
                weights = row_weights.expand_as(log_prob) if weights is None else weights * row_weights
        loss, stats = fastrlhf.policy_loss(log_prob, old_log_prob, advantages, response_mask, loss_mode=mode,
                                           is_weights=weights, **options, **keywords)
        if not seq_mode:
            loss = _nan_if_empty(loss, response_mask, keywords)
        names = _METRICS_BY_LOSS.get(name, _POLICY_METRIC_STATS)
        metrics = torch.stack([stats[k] for k in names.values()] or [loss.detach().new_zeros(())])
        factor = _masked_mean_factor(response_mask)
        if factor is not None:
            metrics = metrics * factor
        # one host sync for the finiteness check and the metrics (verl's .item() makes one per metric)
        finite = all_finite(old_log_prob, log_prob, advantages, rollout_is_weights)
        finite, *metrics = torch.cat([finite.to(metrics.dtype).view(1), metrics.to(metrics.dtype)]).tolist()
        if not finite:  # verl's NaN / inf conventions, gradients included, are its own function's
            _fallback(original.__name__, "non-finite inputs")
            return original(*args)
        if seq_mode:
            dtype = loss_dtype
        else:
            dtype = dtypes_of(agg_loss, like(loss_dtype, log_prob.dim()), response_mask, agg_mode, **info)
        return loss.to(dtype), dict(zip(names, metrics))

    compute_policy_loss.__name__ = compute_policy_loss.__qualname__ = original.__name__
    return compute_policy_loss


def _selects(mode: str) -> bool:
    """Whether `mode` selects tokens over the batch with a random draw or a top-k (clip_cov, kl_cov)."""
    return mode in ("clip_cov", "kl_cov")


def _unfusable(name, keywords, clip_low, clip_high, clip_c, log_prob, old_log_prob, advantages, response_mask,
               weights) -> str | None:
    """Why fastrlhf cannot give verl's exact answer for this call (None: it can)."""
    if keywords is None and name != "geo_mean":
        return "an aggregation fastrlhf does not take (verl raises or divides by a count <= 0)"
    if not all(isinstance(c, (int, float)) and c >= 0 for c in (clip_low, clip_high)):
        return "clip ratios that are not numbers >= 0"
    if name in ("vanilla", "dppo_tv", "dppo_kl") and (not isinstance(clip_c, (int, float)) or not clip_c > 1.0):
        return "clip_ratio_c <= 1"
    if (not floats(log_prob, old_log_prob, advantages, optional=(weights,))
            or not isinstance(response_mask, torch.Tensor)
            or not same_shape(log_prob, old_log_prob, advantages, response_mask, weights)):
        return "inputs that are not float tensors of one shape"
    if needs_grad(old_log_prob, advantages, weights):
        return "old_log_prob, advantages or rollout_is_weights that need a gradient"
    if float64_on_kernels(log_prob, old_log_prob, advantages, weights):
        return "float64 inputs on the Triton kernels (they compute in float32)"
    if name == "geo_mean" and (promoted(log_prob, old_log_prob, advantages, weights) == torch.float64
                               or response_mask.is_floating_point()):
        return "float64 or a weighting mask: verl's row means divide by n + 1e-8"
    return None


def _fusable_values(vpreds, returns, values, mask, mode) -> torch.Tensor:
    """(0-dim bool) fastrlhf's value_loss gives verl's answer: finite inputs (verl's NaN / inf
    conventions, gradients included, are its own function's) and, in seq-mean-token-mean, rows
    whose n_b + 1e-8 rounds to n_b (fastrlhf's value_loss takes no per-token weights to fold
    the difference into; a 0/1 mask in float32 always does)."""
    ok = all_finite(vpreds, returns, values)
    weights = _row_mean_weights(mode, promoted(vpreds, returns, values), mask)
    if weights is not None:
        ok = ok & ((weights == 1) | (weights == 0)).all()
    return ok


def _value_loss(original, agg_loss, verl_F):
    def compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode="token-mean",
                           dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
        args = (vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode, dp_size, batch_num_tokens,
                global_batch_size, loss_scale_factor)
        keywords = _agg_keywords(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
        if (keywords is None or not isinstance(cliprange_value, (int, float)) or not cliprange_value >= 0
                or not floats(vpreds, returns, values) or not isinstance(response_mask, torch.Tensor)
                or not same_shape(vpreds, returns, values, response_mask)
                or needs_grad(returns, values) or float64_on_kernels(vpreds, returns, values)
                or not bool(_fusable_values(vpreds, returns, values, response_mask,
                                                                          loss_agg_mode))):
            return original(*args)
        loss, stats = fastrlhf.value_loss(vpreds, values, returns, response_mask, clip=cliprange_value, **keywords)
        loss = _nan_if_empty(loss, response_mask, keywords)
        clipfrac = stats["clipfrac"]
        factor = _masked_mean_factor(response_mask)
        if factor is not None:
            clipfrac = clipfrac * factor
        loss_dtype = dtypes_of(agg_loss, like(promoted(vpreds, returns, values), vpreds.dim()), response_mask,
                               loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
        clipfrac_dtype = dtypes_of(verl_F.masked_mean, like(torch.float32, vpreds.dim()), response_mask)
        return loss.to(loss_dtype), clipfrac.to(clipfrac_dtype)

    return compute_value_loss


# ---------------------------------------------------------------- rollout correction (rollout_corr_helper)

_OFFPOLICY_KEYS = ("training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
                   "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq")
_IS_KEYS = tuple("rollout_is_" + k for k in (
    "mean", "max", "min", "ratio_fraction_high", "ratio_fraction_low", "std", "eff_sample_size", "seq_mean", "seq_std",
    "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high", "seq_fraction_low"))
_RS_KEYS = ("mean", "max", "min", "fraction_high", "fraction_low", "std", "masked_fraction", "seq_mean", "seq_std",
            "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high", "seq_masked_fraction")


def _split(spec) -> list[str]:
    return [v.strip() for v in str(spec).split(",")]


def _bounds(spec: str) -> tuple[float, float] | float:
    """verl's "lower_upper" threshold string, or one number."""
    if "_" in spec:
        low, high = (float(v) for v in spec.split("_"))
        return low, high
    return float(spec)


def _verl_correction(rollout_is, rollout_is_threshold, batch_normalize, rollout_rs, rollout_rs_threshold):
    """(rollout_correction's keywords, verl's metric keys in its order) for verl's settings (read from
    verl 0.9.1's rollout_corr_helper: a "lower_upper" IS threshold is IcePop's mask mode, one number
    truncates; a single rejection threshold applies to every criterion; k1 criteria are two-sided)."""
    level = rollout_is if rollout_is is not None and rollout_is_threshold is not None else None
    keys, kw = [], dict(level=level, mode="truncate", low=None, high=None, batch_normalize=bool(batch_normalize))
    if level is not None:
        bounds = _bounds(str(rollout_is_threshold))
        if isinstance(bounds, tuple):
            kw.update(mode="mask", low=bounds[0], high=bounds[1])
        else:
            kw["high"] = bounds
        keys += _IS_KEYS + (("rollout_is_oob_ratio",) if kw["mode"] == "mask" else ()) + (
            ("rollout_is_batch_norm_factor",) if batch_normalize else ())
    if rollout_rs is not None:
        names, specs = _split(rollout_rs), _split(rollout_rs_threshold)
        specs = specs * len(names) if len(specs) == 1 else specs
        if len(specs) != len(names):
            raise ValueError("one rollout_rs_threshold per criterion")
        kw["reject"] = {n: _bounds(s) for n, s in zip(names, specs)}
        keys += ["rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"]
        for n in names:
            keys += [f"rollout_rs_{n}_{k}" for k in _RS_KEYS + (("seq_fraction_low",) if n.endswith("k1") else ())]
    return kw, keys + list(_OFFPOLICY_KEYS)


def _rollout_correction(original):
    def compute_rollout_correction_and_rejection_mask(old_log_prob, rollout_log_prob, response_mask, rollout_is=None,
                                                      rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                                                      rollout_rs=None, rollout_rs_threshold=None):
        args = (old_log_prob, rollout_log_prob, response_mask, rollout_is, rollout_is_threshold,
                rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold)
        why = None
        if (not floats(old_log_prob, rollout_log_prob) or not isinstance(response_mask, torch.Tensor)
                or response_mask.is_floating_point() or not same_shape(old_log_prob, rollout_log_prob, response_mask)
                or (rollout_rs is not None and rollout_rs_threshold is None) or not bool(response_mask.any())):
            why = "arguments verl rejects, a weighting mask, or inputs that are not [B, T] floats"
        elif float64_on_kernels(old_log_prob, rollout_log_prob):
            why = "float64 inputs on the Triton kernels"
        else:
            try:
                kw, keys = _verl_correction(rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs,
                                            rollout_rs_threshold)
                weights, keep, stats = fastrlhf.rollout_correction(old_log_prob, rollout_log_prob, response_mask,
                                                                   **kw)
            except (ValueError, TypeError) as e:  # verl raises its own error, or accepts what fastrlhf does not
                why = f"settings fastrlhf does not take ({e})"
        if why is None and not set(keys) <= set(stats):
            why = "a metric fastrlhf does not compute"
        if why is not None:
            _fallback("compute_rollout_correction_and_rejection_mask", why)
            return original(*args)
        from verl import DataProto

        values = torch.stack([stats[k].double() for k in keys]).tolist()  # one host sync, as verl's .item()s
        metrics = {f"rollout_corr/{k}": v for k, v in zip(keys, values)}
        proto = None
        if weights is not None:
            weights = weights.to(promoted(old_log_prob, rollout_log_prob))
            proto = DataProto.from_dict(tensors={"rollout_is_weights": weights})
        return proto, keep.to(response_mask.dtype), metrics

    return compute_rollout_correction_and_rejection_mask
