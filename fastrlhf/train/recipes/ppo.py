"""`fastrlhf ppo`: PPO with a LoRA-disabled (or frozen-copy) reference, on a shared actor-critic
(`--advantage gae`) or critic-free (`--advantage grpo|dr_grpo|rloo|reinforce_pp|reinforce_pp_baseline`).

Each iteration, top to bottom:
  1. rollout     sample responses (KV cache, left-padded prompts, stop at EOS), num_generations
                 per prompt, a prompt's responses side by side
  2. reward      reward model at the last response token, or a rule `module:function`; every
                 score checked (count, type, finite: fastrlhf.train.rewards)
  3. logprobs    one policy forward -> old log-probs (and values with a critic); reference log-probs;
                 the update's plan: an `Experience`, the record the rest of the iteration reads
                 (critic-free with the KL in the loss, the first minibatch's old log-probs come from
                 its own forward in phase 5: `old_from_first_update`; with --old_logprobs sampler
                 they are the sampler's own, and the policy forward is for the values only)
  4. advantages  KL-shaped rewards (ops.kl_shaped_rewards; no KL there with kl_in_loss), then the
                 estimator chosen once (`advantage_estimator`): GAE (ops.gae), or one score per
                 response -> ops.outcome_advantages over each prompt's group of responses
  5. update      PPO epochs over minibatches with gradient accumulation: clipped policy loss
                 (ops.linear_ppo_actor_loss, from hidden states: no [B, T, V] logits; + kl_coef x k3
                 KL with kl_in_loss) + value loss (ops.value_loss, with a critic), gradient clipping;
                 micro-batches of padded rows or packed by tokens (fastrlhf.train.packing), one read of
                 the device per minibatch
Then the KL coefficient is updated (fixed, or adaptive as Ziegler et al. 2019), metrics are
logged and a checkpoint is written every `save_every` iterations. With `--compile` the decoder
layers of phases 3 and 5 run compiled (fastrlhf.train.models.compile_layers).

`prepare` checks the whole configuration (policy, reward, data, lengths, the run folder)
before a model loads; `train` runs it: `setup`, the loop over the five phases, `finish`.
Writes OUT/ppo/config.json, OUT/ppo/final (merged HF model + value head), OUT/ppo/checkpoints,
rows with "stage": "ppo" in OUT/metrics.jsonl, OUT/summary.json["ppo"], OUT/plots/ppo_*.png.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from datasets import Dataset

from fastrlhf import ops
from fastrlhf.constants import (
    AGG_MODES,
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    IGNORE_INDEX,
    OLD_LOGPROBS,
    PPO_PHASES,
)
from fastrlhf.ops import losses, policy_modes
from fastrlhf.ops.advantages import DEFAULT_WHITEN, GROUPED
from fastrlhf.ops.gae import mean_var
from fastrlhf.train import distributed, packing, shared_prompt, task
from fastrlhf.train.checkpoint import check_run_dir
from fastrlhf.train.config import PPOConfig, run_cli, to_dict
from fastrlhf.train.data import (
    BUILTIN,
    Batch,
    Encoder,
    auto_lengths,
    load_table,
    pad_to_width_multiple,
    truncate_prompts,
)
from fastrlhf.train.devices import autocast, resolve_device, resolve_dtype
from fastrlhf.train.heads import ActorCritic
from fastrlhf.train.metrics import PhaseTimer, log, setup_logging
from fastrlhf.train.models import (
    COMPILE_MODES,
    ModelSource,
    check_qlora,
    compile_layers,
    compile_stats,
    compile_wanted,
    empty_copy,
    load_causal_lm,
    same_encoding,
)
from fastrlhf.train.plots import plot_phases
from fastrlhf.train.rewards import check_reward_model_dir, import_rule, is_rule, load_reward, reward_encoder
from fastrlhf.train.rollout import (
    ROLLOUT_CACHES,
    ROLLOUT_ENGINES,
    ROLLOUT_SAMPLERS,
    Rollout,
    engine_generate,
    generate,
    make_engine,
    sampler_gap,
)
from fastrlhf.train.run import (
    POSITIVE,
    StageRun,
    check_common,
    describe_data,
    evaluate_true_score,
    holds_run_folder,
    resolve_data,
    stage_model,
    start_stage_dir,
    warn_if_batch_exceeds_data,
    warn_skipped,
)

if TYPE_CHECKING:
    from fastrlhf.train.engine import DecodeEngine

ADDITIVE_STATS = ("pg_loss", "value_loss")  # divided by the minibatch's global count: they sum over micro-batches
# the auto max_new_tokens with your own data: at most this (verl's data.max_response_length and TRL's GRPO
# max_completion_length default, read from verl 0.9.1 and TRL 1.16.0)
AUTO_MAX_NEW_TOKENS = 512
# aggregations over the tokens alone: a pack's loss reads its real response tokens as one row ([1, n]); the
# seq-mean ones read its sequences as rows ([n_seq, R'])
TOKEN_AGGS = ("token-mean", "token-sum")


class KLController:
    """Fixed coefficient, or adaptive (Ziegler et al. 2019):
    coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * n_sequences / horizon."""

    def __init__(self, coef: float, target: float, horizon: int):
        self.coef, self.target, self.horizon = coef, target, horizon

    def update(self, kl: float, n_sequences: int) -> None:
        if self.target > 0:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * n_sequences / self.horizon


UpdatePlan = list[tuple[list[packing.MicroBatch], tuple[float, float]]]
"""Per minibatch of phase 5: its micro-batches and its global (token, sequence) counts."""


@dataclasses.dataclass
class Experience:
    """One rollout as the update reads it: the batch and, per response token ([B, R] float32, 0
    where the response mask is 0), what phases 3 and 4 computed from it."""

    batch: Batch
    old_logp: torch.Tensor
    """Log-probs of the sampled tokens under the policy before the update (phase 3)."""
    ref_logp: torch.Tensor
    """Log-probs under the reference policy (phase 3)."""
    values: torch.Tensor | None = None
    """The critic's values (phase 3); None without a critic."""
    rewards: torch.Tensor | None = None
    """KL-shaped per-token rewards (phase 4)."""
    advantages: torch.Tensor | None = None
    """Advantages (phase 4)."""
    returns: torch.Tensor | None = None
    """Value targets (phase 4); None without a critic."""
    sampler_logp: torch.Tensor | None = None
    """The rollout engine's own log-probs of the sampled tokens, where an engine reports them."""
    is_weights: torch.Tensor | None = None
    """Importance weights pi_train / pi_sampler of the policy loss (--rollout_correction; phase 4)."""
    correction: dict[str, torch.Tensor] | None = None
    """The rollout correction's metrics (0-dim tensors, read with the iteration's metrics)."""
    lengths: packing.Lengths | None = None
    """Real prompt and response tokens per row (host, read once in phase 3): the update plans from them."""
    plan: UpdatePlan | None = None
    """Phase 5's plan (plan_update), made in phase 3; None: ppo_update makes it."""
    old_from_update: bool = False
    """The first minibatch's old log-probs are not in old_logp yet: its own update forward forms them
    (`old_from_first_update`)."""
    shared: shared_prompt.Saving | None = None
    """--shared_prompt on or auto: whether phases 3 and 5 share each group's prompt, and the tokens it saves."""


def global_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`ops.raw_moments` of x's mask=1 entries over every rank (an all-reduce; x's own on one process)."""
    return distributed.all_sum(ops.raw_moments(x, mask))


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over the response tokens (of every rank)."""
    _, var_r = mean_var(global_moments(returns, mask), unbiased=False)
    _, var_d = mean_var(global_moments(returns - values, mask), unbiased=False)
    return 1.0 - var_d / var_r.clamp(min=1e-8)


def group_reward_std(scores: torch.Tensor, group_size: int) -> float:
    """Mean over prompts of the standard deviation of their responses' scores (0: nothing to compare)."""
    return scores.view(-1, group_size).std(-1).mean().item()


# ---------------------------------------------------------------- micro-batches


def across_ranks(counts: list[tuple[int, int]], n_micro: list[int]) -> tuple[list[tuple[float, float]], list[int]]:
    """Per minibatch: its (token, sequence) counts summed over ranks, and the stand-in micro-batches
    this rank adds so that it runs as many as the rank with the most (FSDP: every rank must run the
    same forwards). One all-reduce of each and one read, under torchrun only."""
    if not distributed.active():
        return [(float(t), float(q)) for t, q in counts], []
    summed = distributed.all_sum(torch.tensor(counts, dtype=torch.float64).reshape(-1, 2))
    most = distributed.all_max(torch.tensor(n_micro, dtype=torch.float64))
    values = torch.cat([summed.reshape(-1), most]).tolist()
    pairs = [(values[2 * k], values[2 * k + 1]) for k in range(len(counts))]
    return pairs, [int(m) - n for m, n in zip(values[2 * len(counts):], n_micro)]


def scoring_micro_batches(batch: Batch, lengths: packing.Lengths, cfg: PPOConfig, device,
                          rows: np.ndarray | None = None, shared: bool = False) -> list[packing.MicroBatch]:
    """Phase 3's forwards over `rows` (None: all): in one padded forward, or packs of micro_batch_tokens;
    `shared`: shared-prompt packs, one of every row or of micro_batch_tokens."""
    rows = np.arange(batch.input_ids.shape[0]) if rows is None else rows
    packed = cfg.micro_batch_tokens > 0
    if shared:
        groups = [shared_packs(lengths, rows, cfg, "phase 3")]
    else:
        groups = [packing.partition(lengths.total, rows, cfg.micro_batch_tokens) if packed else [rows]]
    _, stand_ins = across_ranks([(0, 0)], [len(groups[0])]) if packed else (None, [])
    return packing.micro_batches(batch, groups, lengths, packed=packed, flat=True, device=device,
                                 stand_ins=stand_ins)[0]


def update_plan(exp: Experience, cfg: PPOConfig, device) -> UpdatePlan:
    """Phase 5's plan for `exp` (`plan_update`)."""
    return plan_update(exp.batch, exp.lengths, cfg, device, shared=exp.shared is not None and exp.shared.on)


def update_groups(lengths: packing.Lengths, cfg: PPOConfig, shared: bool = False) -> list[list[np.ndarray]]:
    """Phase 5's rows on the host, per minibatch the rows of its micro-batches: ppo_epochs passes over
    this rank's rows, each a fresh permutation cut into minibatches of mini_batch_size / ranks rows,
    each cut into micro-batches of micro_batch_size / ranks rows or packed into micro_batch_tokens.
    `shared`: the permutation is of whole groups, and the micro-batches are shared-prompt packs
    (`shared_packs`)."""
    B = len(lengths.total)
    n = distributed.world_size()
    mini, micro = cfg.mini_batch_size // n, cfg.micro_batch_size // n
    G = lengths.group_size if shared else 1
    groups = []
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B // G).numpy()  # the CPU generator: host data
        order = (order[:, None] * G + np.arange(G)).reshape(-1)  # a group's rows stay together
        for start in range(0, B, mini):
            rows = order[start:start + mini]
            if shared:
                groups.append(shared_packs(lengths, rows, cfg, "phase 5"))
            elif cfg.micro_batch_tokens > 0:
                groups.append(packing.partition(lengths.total, rows, cfg.micro_batch_tokens))
            else:
                groups.append([rows[m:m + micro] for m in range(0, len(rows), micro)])
    return groups


def shared_packs(lengths: packing.Lengths, rows: np.ndarray, cfg: PPOConfig, phase: str) -> list[packing.Units]:
    """Shared-prompt packs of `rows`: into micro_batch_tokens, or micro_batch_size / ranks rows' worth of
    groups each (phase 3: all in one); a group over the budget falls back to its rows one by one (logged)."""
    per_pack = 0 if phase == "phase 3" else cfg.micro_batch_size // distributed.world_size()
    found, fallbacks = shared_prompt.packs(lengths, rows, cfg.micro_batch_tokens, per_pack)
    if fallbacks:
        log.info("ppo: %s: %d group(s) of %d responses exceed micro_batch_tokens (%d) with their prompt shared: "
                 "their responses go unshared", phase, fallbacks, lengths.group_size, cfg.micro_batch_tokens)
    return found


def plan_update(batch: Batch, lengths: packing.Lengths, cfg: PPOConfig, device,
                groups: list[list[np.ndarray]] | None = None, shared: bool = False) -> UpdatePlan:
    """Phase 5's plan, made on the host from the rollout's lengths: the micro-batches of `groups`
    (update_groups'; drawn here when None, shared-prompt packs with `shared`), with each minibatch its
    global (token, sequence) counts, the losses' divisors. The indices reach the device in one
    transfer; nothing is read from it (under torchrun: one all-reduce and one read)."""
    groups = update_groups(lengths, cfg, shared) if groups is None else groups
    packed = cfg.micro_batch_tokens > 0
    response = lengths.response
    rows = [np.concatenate([packing.rows_of(spec) for spec in g]) for g in groups]
    counts = [(int(response[r].sum()), int((response[r] > 0).sum())) for r in rows]
    counts, stand_ins = across_ranks(counts, [len(g) for g in groups])
    micro_batches = packing.micro_batches(batch, groups, lengths, packed=packed,
                                          flat=cfg.loss_agg in TOKEN_AGGS, device=device, stand_ins=stand_ins)
    return list(zip(micro_batches, counts))


# ---------------------------------------------------------------- 3. log-probs, values, reference


def width_multiple(cfg: PPOConfig, device: torch.device) -> int:
    """What phases 3 and 5 round the padded width up to (a few more columns of prompt padding): 8 with
    compiled layers on CUDA, else 1. Inductor's lowering of SDPA with a mask on CUDA guards on whether
    the mask's width is a multiple of 8 (torch/_inductor/lowering.py, `sdpa_constraint`), so a rollout
    whose width fell on the other side of that compiled the training forward and backward again
    mid-run: 2 graphs and 23 s of a 26 s iteration on an H100 (issue 27's e2e run at 2ee9464; the
    cause read from inductor's source, and the same run at 8fb0e79 compiled nothing while timed)."""
    return 8 if device.type == "cuda" and compile_wanted(cfg.compile, device) else 1


@torch.no_grad()
def experience(ac: ActorCritic, rollout: Rollout, cfg: PPOConfig, device) -> Experience:
    """Phase 3: one actor-critic forward (old log-probs, values; over the rows outside the update's first
    minibatch where `old_from_first_update`; with --old_logprobs sampler the old log-probs are the
    sampler's, and the forward is the trunk's for the values only, or none: without a critic, or where
    the graph engine gave the values too) and one reference forward, each over its rows in one padded
    forward or in packs of micro_batch_tokens; the update's plan; the sampler's own log-probs come along
    from the rollout (None where the sampler reports none). The Experience's batch is the rollout's, its
    width rounded up by `width_multiple` (phase 5 runs over it too)."""
    b = pad_to_width_multiple(rollout.batch, width_multiple(cfg, device), pad_id=0)  # masked columns
    lengths = packing.read_lengths(b, cfg.num_generations if cfg.shared_prompt != "off" else 1)
    saving = shared_prompt.decide(cfg.shared_prompt, lengths)
    shared = saving.on
    groups = update_groups(lengths, cfg, shared)
    from_update = old_from_first_update(cfg, ac)
    head, ref_head = ac.lm_head, ac.reference_lm_head()
    dtype = torch.float64 if head.weight.dtype == torch.float64 else torch.float32  # the ops' output dtype
    old_logp, ref_logp = (torch.zeros(b.response_mask.shape, dtype=dtype, device=device) for _ in range(2))
    values = torch.zeros_like(b.response_mask) if ac.value_head is not None else None  # the float32 value head's

    def logprobs(h, mb, lm_head):
        return ops.linear_logprobs(h, lm_head.weight.to(h.dtype), mb.take(b.labels), bias=lm_head.bias,
                                   temperature=cfg.temperature, ignore_index=IGNORE_INDEX)

    from_sampler = cfg.old_logprobs == "sampler"
    if from_sampler:
        old_logp = rollout.sampler_logp.to(dtype)  # 0 past each response, as the ops' output
        if values is not None and rollout.sampler_values is not None:  # the graph engine's, on one process
            values = rollout.sampler_values
    every = policy = scoring_micro_batches(b, lengths, cfg, device, shared=shared)
    if from_sampler and (values is None or values is rollout.sampler_values):  # nothing left to score
        policy = []
    elif from_update:  # the policy scores the rows outside the first minibatch only
        first = np.concatenate([packing.rows_of(spec) for spec in groups[0]])
        scored = np.setdiff1d(np.arange(b.input_ids.shape[0]), first)
        policy = scoring_micro_batches(b, lengths, cfg, device, scored, shared) if len(scored) else []
    for mb in policy:
        with autocast(device):
            hidden, v = packing.forward_responses(ac, b, mb)
            old = None if from_sampler else logprobs(hidden, mb, head)
        if mb.live:
            if old is not None:
                mb.put(old_logp, old)
            if values is not None:
                mb.put(values, v.float() * mb.response_mask(b))
    for mb in every:
        with autocast(device):
            ref_hidden, = packing.forward_responses(lambda *x, **kw: (ac.reference_hidden(*x, **kw),), b, mb)
            ref = logprobs(ref_hidden, mb, ref_head)
        if mb.live:
            mb.put(ref_logp, ref)
    return Experience(b, old_logp, ref_logp, values, sampler_logp=rollout.sampler_logp, lengths=lengths,
                      plan=plan_update(b, lengths, cfg, device, groups), old_from_update=from_update,
                      shared=saving if cfg.shared_prompt != "off" else None)


def old_from_first_update(cfg: PPOConfig, ac: ActorCritic) -> bool:
    """Whether phase 3 leaves the old log-probs of the update's first minibatch to that minibatch's own
    forward: until the first optimizer step the policy is the one that sampled, so the log-probs of
    that forward are the old ones (its ratios are 1; TRL 1.16's GRPOTrainer takes per_token_logps.detach()
    the same way where a generation feeds one optimizer step), and phase 3 saves the policy forward
    over those rows. Only where nothing reads them
    before the update: no critic (GAE's rewards read values), the KL in the loss or none (a KL-shaped
    reward reads them), no rollout correction (its weights do); and not where they are the sampler's."""
    return (ac.value_head is None and (cfg.kl_in_loss or cfg.kl_coef == 0) and cfg.rollout_correction == "none"
            and cfg.old_logprobs == "recompute")


# ---------------------------------------------------------------- 4. rewards, advantages, returns


def whitened(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`ops.whiten` with the moments of the whole batch: all ranks' shares under torchrun."""
    return ops.whiten(x, mask, moments=global_moments(x, mask) if distributed.active() else None)


def advantage_estimator(cfg: PPOConfig) -> Callable:
    """The estimator `cfg.advantage` names, chosen once: fn(rewards, values, mask) -> (advantages,
    returns). `gae`: GAE over the KL-shaped rewards, whitened with the global batch's moments.
    Critic-free: one score per response (verl's token_level_rewards.sum(-1)) compared within each
    prompt's group of num_generations responses (each group lies on one rank), whitened over the
    global batch's tokens where the estimator says so (reinforce_pp*); no returns."""
    if cfg.advantage == "gae":
        def gae(rewards, values, mask):
            advantages, returns = ops.gae(rewards, values, mask, gamma=cfg.gamma, lam=cfg.lam, whiten=False)
            return whitened(advantages, mask), returns

        return gae
    # token whitening under torchrun needs the global batch's moments: the op without it, then `whitened`
    apart = DEFAULT_WHITEN[cfg.advantage] == "tokens" and distributed.active()

    def outcome(rewards, values, mask):
        advantages = ops.outcome_advantages(rewards.sum(-1), mask, group_size=cfg.num_generations,
                                            estimator=cfg.advantage, whiten="none" if apart else None)
        return (whitened(advantages, mask) if apart else advantages), None

    return outcome


def with_advantages(exp: Experience, scores: torch.Tensor, kl_coef: float, cfg: PPOConfig,
                    estimator: Callable) -> Experience:
    """Phase 4: KL-shaped per-token rewards (no KL there with kl_in_loss: it goes to the loss), then
    the advantages and returns of `estimator`."""
    mask = exp.batch.response_mask
    rewards = ops.kl_shaped_rewards(scores, exp.old_logp, exp.ref_logp, mask,
                                    kl_coef=0.0 if cfg.kl_in_loss else kl_coef, estimator=cfg.kl_estimator)
    advantages, returns = estimator(rewards, exp.values, mask)
    return corrected(dataclasses.replace(exp, rewards=rewards, advantages=advantages, returns=returns), cfg)


def corrected(exp: Experience, cfg: PPOConfig) -> Experience:
    """--rollout_correction: the policy loss's importance weights pi_train / pi_sampler (old log-probs
    against the sampler's own) and their metrics; the experience as it is without it."""
    if cfg.rollout_correction == "none":
        return exp
    weights, _, metrics = ops.rollout_correction(
        exp.old_logp, exp.sampler_logp, exp.batch.response_mask, level=cfg.rollout_correction,
        mode=cfg.rollout_correction_mode, low=cfg.rollout_correction_low or None, high=cfg.rollout_correction_high)
    return dataclasses.replace(exp, is_weights=weights, correction=metrics)


# ---------------------------------------------------------------- 5. the update


def loss_options(cfg: PPOConfig) -> dict:
    """--loss_options `name=value,...` as keywords: numbers as floats, `none` as None, other values as
    they are (ratio_level=sequence)."""
    out = {}
    for item in filter(None, (part.strip() for part in cfg.loss_options.split(","))):
        name, eq, value = (x.strip() for x in item.partition("="))
        if not eq or not name:
            raise ValueError(f"ppo: --loss_options takes name=value pairs separated by commas, got {item!r}")
        try:
            out[name] = float(value)
        except ValueError:
            out[name] = None if value.lower() == "none" else value
    return out


def check_loss_mode(cfg: PPOConfig, key_prefix: str = "") -> None:
    """--loss_mode and --loss_options, checked by the policy-loss registry (its own errors name what
    the mode takes)."""
    try:
        losses.resolve_mode(cfg.loss_mode, cfg.clip, None, None, loss_options(cfg))
    except (TypeError, ValueError) as e:
        raise ValueError(f"ppo: --{key_prefix}loss_mode {cfg.loss_mode!r} with --{key_prefix}loss_options "
                         f"{cfg.loss_options!r}: {e}") from None


def aggregation(cfg: PPOConfig, exp: Experience, counts: tuple[float, float]) -> dict:
    """The ops' aggregation keywords: loss_agg with the minibatch's global token count (token-mean) or
    sequence count (seq-mean-*), so a micro-batch's loss is its share of the minibatch's, however it
    is split into micro-batches, packs and ranks. A mode with one loss per sequence (geo_mean) takes
    its own mean over the minibatch's sequences."""
    if cfg.loss_mode in policy_modes.ROW_LOSS:
        return {"agg": None, "global_num_seqs": max(1.0, counts[1])}
    if cfg.loss_agg == "token-mean":
        return {"agg": "token-mean", "global_num_tokens": max(1.0, counts[0])}
    if cfg.loss_agg == "token-sum":
        return {"agg": "token-sum"}
    kwargs = {"agg": cfg.loss_agg, "global_num_seqs": max(1.0, counts[1])}
    if cfg.loss_agg == "seq-mean-token-sum-norm":  # the rollout's response width, packed or not
        kwargs["loss_scale_factor"] = float(exp.batch.response_mask.shape[1])
    return kwargs


def micro_batch_losses(ac: ActorCritic, exp: Experience, mb: packing.MicroBatch, cfg: PPOConfig, device,
                       counts: tuple[float, float], kl_coef: float = 0.0, old_from_here: bool = False):
    """(loss, stats) of one micro-batch: the actor loss (+ kl_coef x k3 KL with kl_in_loss) plus vf_coef x
    the value loss (with a critic), each aggregated by loss_agg over the minibatch whose global
    (token, sequence) `counts` are given, so the micro-batches' losses add up to the minibatch's.
    `old_from_here`: this forward's log-probs are the micro-batch's old ones (old_from_first_update);
    they are written to exp.old_logp first."""
    b = exp.batch
    mask = mb.response_mask(b)
    labels = torch.where(mask.bool(), mb.take(b.responses), IGNORE_INDEX)
    with autocast(device):
        hidden, values = packing.forward_responses(ac, b, mb)
    head = ac.lm_head
    if old_from_here and mb.live:
        with torch.no_grad():
            mb.put(exp.old_logp, ops.linear_logprobs(hidden.detach(), head.weight.to(hidden.dtype), labels,
                                                     bias=head.bias, temperature=cfg.temperature,
                                                     ignore_index=IGNORE_INDEX))
    agg = aggregation(cfg, exp, counts)
    # Under torchrun each rank's loss is its share of the global one (global counts); ppo_update multiplies
    # only what it backpropagates by distributed.loss_scale() (FSDP averages gradients), so the logged losses
    # stay true shares that sum over ranks.
    loss, stats = ops.linear_ppo_actor_loss(
        hidden, head.weight.to(hidden.dtype), labels, mb.take(exp.old_logp), mb.take(exp.advantages), mask,
        bias=head.bias, temperature=cfg.temperature, loss_mode=cfg.loss_mode, clip_low=cfg.clip,
        entropy_coef=cfg.entropy_coef,
        ref_logp=mb.take(exp.ref_logp) if cfg.kl_in_loss else None, kl_coef=kl_coef if cfg.kl_in_loss else 0.0,
        kl_estimator="k3", is_weights=None if exp.is_weights is None else mb.take(exp.is_weights), **agg,
        **loss_options(cfg))
    if "kl" in stats:  # the loss term's k3 per token; the logged "kl" is the per-sequence k1 of the rollout
        stats["kl_k3"] = stats.pop("kl")
    if exp.values is not None:
        v_loss, v_stats = ops.value_loss(values.float(), mb.take(exp.values), mb.take(exp.returns), mask,
                                         clip=cfg.value_clip, **agg)
        loss = loss + cfg.vf_coef * v_loss
        stats.update(value_loss=v_loss, value_clipfrac=v_stats["clipfrac"])
    return loss, stats


def read_minibatch(loss: torch.Tensor, stats: dict[str, torch.Tensor], grad_norm: torch.Tensor) -> dict[str, float]:
    """The minibatch's one host read: its loss and stats summed over ranks (one all-reduce) and the
    (global) gradient norm, as floats."""
    keys = list(stats)
    summed = distributed.all_sum(torch.stack([loss, *(stats[k] for k in keys)]))
    values = torch.cat([summed, grad_norm.detach().reshape(1).to(summed)]).tolist()
    return {"loss": values[0], **dict(zip(keys, values[1:-1])), "grad_norm": values[-1]}


def ppo_update(ac, optimizer, exp: Experience, cfg: PPOConfig, device, step: int, *, kl_coef: float = 0.0) -> dict:
    """Phase 5: `ppo_epochs` passes over the experience in minibatches of `mini_batch_size`, each the
    sum of micro-batches (gradient accumulation; the losses divide by the minibatch's global token or
    sequence count, so the split, padded or packed, does not change the gradient), clipped to
    max_grad_norm. Nothing is read from the device inside a minibatch: token counts, losses, stats
    and the finiteness check stay there and are read once at its end (`read_minibatch`); a minibatch
    with a non-finite loss or gradient norm is skipped (a warning) and counted. Returns the mean stats
    and `skipped_nonfinite`.

    `ac`: the actor-critic, or the `ShardedModel` around it. Under torchrun the sizes are global:
    each rank takes its share of every minibatch and micro-batch from its own rollout (packed: as
    many micro-batches on every rank, one collective per update), the losses divide by global counts
    and the stats are summed over ranks."""
    model = distributed.as_sharded(ac)
    params = [p for p in model.parameters() if p.requires_grad]
    sums, n_updates, skipped = {}, 0, 0
    plan = update_plan(exp, cfg, device) if exp.plan is None else exp.plan
    for index, (micro_batches, counts) in enumerate(plan):
        optimizer.zero_grad(set_to_none=True)
        total, acc = 0.0, {}
        old_from_here = exp.old_from_update and index == 0
        for mb in micro_batches:
            loss, stats = model.run(micro_batch_losses, exp, mb, cfg, device, counts, kl_coef, old_from_here)
            (loss * distributed.loss_scale()).backward()
            total = total + loss.detach().double()
            share = mb.n_tokens / max(1.0, counts[0])  # per-token means weigh by their token share of the minibatch
            for k, v in stats.items():  # float64 sums on the device, read at the minibatch's end
                v = v.detach().double()
                acc[k] = acc.get(k, 0.0) + (v if k in ADDITIVE_STATS else v * share)
        grad_norm = distributed.gradient_norm(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        read = read_minibatch(total, acc, grad_norm)
        bad = [(what, read[k]) for what, k in (("PPO loss", "loss"), ("gradient norm", "grad_norm"))
               if not math.isfinite(read[k])]
        if bad:
            warn_skipped(*bad[0], step)
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
            continue
        optimizer.step()
        n_updates += 1
        del read["loss"]
        for k, v in read.items():
            sums[k] = sums.get(k, 0.0) + v
    means = {k: v / max(1, n_updates) for k, v in sums.items()}
    return dict(means, skipped_nonfinite=skipped)


def rollout_cache(cfg: PPOConfig, device: torch.device) -> str:
    """cfg.rollout_cache with `auto` resolved: static on one CUDA process, else dynamic."""
    if cfg.rollout_cache != "auto":
        return cfg.rollout_cache
    return "static" if device.type == "cuda" and not distributed.active() else "dynamic"


def sample(ac: ActorCritic, tokenizer, rows: dict[str, list], cfg: PPOConfig, device, engine=None) -> Rollout:
    """Phase 1: one response per prompt of `rows` ({"prompt": texts, "prompt_ids": token ids}), by the
    decode engine when there is one (it re-forms its weights from the policy first), else by `generate`."""
    if engine is not None:  # with --old_logprobs sampler on one process, the critic's values come along
        values_too = cfg.old_logprobs == "sampler" and not distributed.active()
        return engine_generate(engine, ac.policy, tokenizer, rows["prompt_ids"], rows["prompt"],
                               value_head=ac.value_head if values_too else None)
    return generate(ac.policy, tokenizer, rows["prompt_ids"], rows["prompt"], max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature, device=device, cache=rollout_cache(cfg, device),
                    sampler=cfg.rollout_sampler)


@dataclasses.dataclass
class PPOPlan:
    """The PPO stage, checked and resolved before its models load."""

    cfg: PPOConfig
    """The configuration with every `auto`/0 default resolved (what OUT/ppo/config.json records)."""
    model: ModelSource
    prompts: list[str]
    prompt_ids: list[list[int]]
    eval_prompts: list[str]
    """Built-in task only: held-out prompts for the true score (empty for user data)."""
    eval_ids: list[list[int]]


def check_advantage(cfg: PPOConfig) -> None:
    """The advantage estimator exists and the rollout can feed it."""
    names = ("gae", *ops.ADVANTAGES)
    if cfg.advantage not in names:
        raise ValueError(f"ppo: advantage must be one of {', '.join(names)}, got {cfg.advantage!r}")
    if cfg.num_generations < 1 or cfg.rollout_batch_size % cfg.num_generations:
        raise ValueError(f"ppo: num_generations ({cfg.num_generations}) must be >= 1 and divide rollout_batch_size "
                         f"({cfg.rollout_batch_size})")
    if cfg.advantage != "gae" and GROUPED[cfg.advantage] and cfg.num_generations < 2:
        raise ValueError(f"ppo: advantage {cfg.advantage!r} compares the responses to one prompt: pass "
                         "--num_generations 2 or more")
    if cfg.advantage != "gae" and DEFAULT_WHITEN[cfg.advantage] == "sequences" and distributed.world_size() > 1:
        raise ValueError(f"ppo: advantage {cfg.advantage!r} whitens over the batch's sequences, whose statistics are "
                         "not gathered over ranks; under torchrun use an estimator that whitens over the tokens")


def check_update(cfg: PPOConfig, key_prefix: str = "") -> None:
    """The update's own keys: compile mode, loss aggregation, the packing budget (against the longest
    sequence once the lengths are resolved: `prepare`)."""
    for name, value, choices in (("compile", cfg.compile, COMPILE_MODES), ("loss_agg", cfg.loss_agg, AGG_MODES),
                                 ("shared_prompt", cfg.shared_prompt, shared_prompt.MODES)):
        if value not in choices:
            raise ValueError(f"ppo: --{key_prefix}{name} must be one of {', '.join(choices)}, got {value!r}")
    if cfg.micro_batch_tokens < 0:
        raise ValueError(f"ppo: --{key_prefix}micro_batch_tokens must be >= 0 (0 = micro_batch_size padded rows), "
                         f"got {cfg.micro_batch_tokens}")


def sampler_logprobs_reader(cfg: PPOConfig, key_prefix: str = "") -> str | None:
    """The option that reads the sampler's own log-probs (--rollout_correction, --old_logprobs sampler), or None."""
    if cfg.rollout_correction != "none":
        return f"--{key_prefix}rollout_correction {cfg.rollout_correction}"
    if cfg.old_logprobs == "sampler":
        return f"--{key_prefix}old_logprobs sampler"
    return None


def check_correction(cfg: PPOConfig, key_prefix: str = "") -> None:
    """--rollout_correction's and --old_logprobs' keys, and a sampler that reports its log-probs where
    one of them reads them."""
    k = f"--{key_prefix}rollout_correction"
    for name, value, choices in (("rollout_correction", cfg.rollout_correction, ("none", *CORRECTION_LEVELS)),
                                 ("rollout_correction_mode", cfg.rollout_correction_mode, CORRECTION_MODES),
                                 ("old_logprobs", cfg.old_logprobs, OLD_LOGPROBS)):
        if value not in choices:
            raise ValueError(f"ppo: --{key_prefix}{name} must be one of {', '.join(choices)}, got {value!r}")
    if not 0 <= cfg.rollout_correction_low < cfg.rollout_correction_high:
        raise ValueError(f"ppo: {k}_low ({cfg.rollout_correction_low}) must be >= 0 and below {k}_high "
                         f"({cfg.rollout_correction_high})")
    if cfg.rollout_correction != "none" and cfg.old_logprobs == "sampler":
        raise ValueError(f"ppo: {k} {cfg.rollout_correction} weighs by old / sampler log-probs, and "
                         f"--{key_prefix}old_logprobs sampler makes them the same (every weight 1): drop one")
    reader = sampler_logprobs_reader(cfg, key_prefix)
    if reader and cfg.rollout_engine == "hf" and cfg.rollout_sampler != "inverse_cdf":
        raise ValueError(f"ppo: {reader} reads the sampler's own log-probs, which transformers' torch.multinomial "
                         f"draw does not report: pass --{key_prefix}rollout_sampler inverse_cdf or "
                         f"--{key_prefix}rollout_engine graph")


def prepare(cfg: PPOConfig, *, upstream: ModelSource | None = None, reward_upstream: ModelSource | None = None,
            key_prefix: str = "") -> PPOPlan:
    """Check the whole configuration and resolve its defaults, loading no model weights.
    `upstream` / `reward_upstream`: the SFT model and reward model a pipeline will have written
    by the time this stage runs."""
    cfg = dataclasses.replace(cfg)
    check_common(cfg, ("steps", "rollout_batch_size", "mini_batch_size", "micro_batch_size", "ppo_epochs",
                       "kl_horizon", "log_every", "save_every", "eval_prompts"), "ppo", key_prefix,
                 ranges={"lr": POSITIVE})
    distributed.check_shard(cfg.shard, "ppo")
    distributed.check_global_batch("ppo", rollout_batch_size=cfg.rollout_batch_size,
                                   mini_batch_size=cfg.mini_batch_size, micro_batch_size=cfg.micro_batch_size)
    if cfg.rollout_batch_size % cfg.mini_batch_size or cfg.mini_batch_size % cfg.micro_batch_size:
        raise ValueError(f"ppo: rollout_batch_size ({cfg.rollout_batch_size}) must be a multiple of mini_batch_size "
                         f"({cfg.mini_batch_size}), itself a multiple of micro_batch_size ({cfg.micro_batch_size})")
    if cfg.rollout_cache not in ("auto", *ROLLOUT_CACHES):
        raise ValueError(f"ppo: rollout_cache must be one of auto, {', '.join(ROLLOUT_CACHES)}, "
                         f"got {cfg.rollout_cache!r}")
    if cfg.rollout_sampler not in ROLLOUT_SAMPLERS:
        raise ValueError(f"ppo: rollout_sampler must be one of {', '.join(ROLLOUT_SAMPLERS)}, "
                         f"got {cfg.rollout_sampler!r}")
    if not isinstance(cfg.rollout_slots, int) or cfg.rollout_slots < 0:
        raise ValueError(f"ppo: rollout_slots must be an int >= 0 (0 = every row at once), got {cfg.rollout_slots!r}")
    if cfg.rollout_engine not in ROLLOUT_ENGINES:
        raise ValueError(f"ppo: rollout_engine must be one of {', '.join(ROLLOUT_ENGINES)}, got {cfg.rollout_engine!r}")
    check_advantage(cfg)
    check_loss_mode(cfg, key_prefix)
    check_update(cfg, key_prefix)
    check_correction(cfg, key_prefix)
    if cfg.num_generations >= 1 and (cfg.rollout_batch_size // cfg.num_generations) % distributed.world_size():
        raise ValueError(f"ppo: the rollout's {cfg.rollout_batch_size // cfg.num_generations} prompts "
                         f"(rollout_batch_size {cfg.rollout_batch_size} / num_generations {cfg.num_generations}) must "
                         f"divide evenly over the {distributed.world_size()} ranks: each rank keeps all the responses "
                         "to its prompts")
    resolve_dtype(cfg.dtype, resolve_device(cfg.device), lora=cfg.lora_rank > 0)
    try:
        ops.token_kl(torch.zeros(1), torch.zeros(1), estimator=cfg.kl_estimator)
    except ValueError as e:
        raise ValueError(f"ppo: kl_estimator {cfg.kl_estimator!r}: {e}") from None
    out = Path(cfg.out)
    model = stage_model(cfg.model, out / "sft" / "final", upstream, "ppo", "sft")
    cfg.model = model.spec
    if cfg.qlora:
        check_qlora(model, cfg.lora_rank, "ppo", key_prefix)
    cfg.reward = cfg.reward or str(out / "rm" / "final")
    if is_rule(cfg.reward):
        import_rule(cfg.reward)
        reward_desc = f"rule {cfg.reward}"
    elif reward_upstream is not None and cfg.reward == str(reward_upstream.spec):
        reward_desc = f"reward model {cfg.reward} (trained by the pipeline's rm stage)"
    elif Path(cfg.reward).is_dir():
        rm_source = check_reward_model_dir(cfg.reward)
        same = same_encoding(Encoder(model.tokenizer, chat_template=cfg.chat_template),
                             reward_encoder(cfg.reward, rm_source.tokenizer, cfg.chat_template))
        reward_desc = f"reward model {cfg.reward}" + ("" if same else " (it encodes text differently: it re-tokenizes "
                                                      "the text)")
    else:
        raise ValueError(f"ppo: reward {cfg.reward!r} is neither a reward-model directory (train one with "
                         "`fastrlhf rm`) nor a rule 'module:function'")
    cfg.data = resolve_data(cfg.data, model, "ppo", f"--{key_prefix}data")
    builtin = cfg.data == BUILTIN
    if builtin:
        prompts = [r["prompt"] for r in task.synthetic_prompt_rows(task.NUM_PPO_PROMPTS, cfg.seed)]
        eval_prompts = [r["prompt"] for r in task.synthetic_prompt_rows(cfg.eval_prompts, cfg.seed, "eval")]
        cfg.max_prompt_len = cfg.max_prompt_len or task.MAX_PROMPT_LEN
        cfg.max_new_tokens = cfg.max_new_tokens or task.MAX_NEW_TOKENS
    else:
        prompts = list(load_table(cfg.data, {"prompt": cfg.prompt_key}, where="ppo data",
                                        key_prefix=key_prefix)["prompt"])
        eval_prompts = []
    encoder = Encoder(model.tokenizer, chat_template=cfg.chat_template, vocab_size=model.config.vocab_size)
    prompt_ids = encoder.prompts(prompts, where=None if builtin else f"ppo data: {cfg.data}")
    auto_new_tokens = not cfg.max_new_tokens
    cfg.max_prompt_len, cfg.max_new_tokens = auto_lengths(
        max(map(len, prompt_ids)), None, model.max_positions, max_prompt_len=cfg.max_prompt_len,
        max_response_len=cfg.max_new_tokens, where="ppo")
    if auto_new_tokens:  # what the prompt leaves of a long-context model would be a rollout of 30k tokens
        cfg.max_new_tokens = min(cfg.max_new_tokens, AUTO_MAX_NEW_TOKENS)
    prompt_ids = truncate_prompts(prompt_ids, cfg.max_prompt_len)
    longest = cfg.max_prompt_len + cfg.max_new_tokens
    if 0 < cfg.micro_batch_tokens < longest:
        raise ValueError(f"ppo: --{key_prefix}micro_batch_tokens ({cfg.micro_batch_tokens}) must hold the longest "
                         f"sequence: max_prompt_len + max_new_tokens = {cfg.max_prompt_len} + {cfg.max_new_tokens} = "
                         f"{longest} tokens")
    eval_ids = truncate_prompts(encoder.prompts(eval_prompts), cfg.max_prompt_len, what="evaluation prompts")
    check_run_dir(out / "ppo", to_dict(cfg), resume=cfg.resume, overwrite=cfg.overwrite,
                  defaults=to_dict(type(cfg)()), what="ppo")
    log.info("ppo: policy %s; %s; data %s; prompts <= %d tokens, responses <= %d; %s", model.spec, reward_desc,
             describe_data(cfg.data, len(prompts)), cfg.max_prompt_len, cfg.max_new_tokens,
             "chat template" if encoder.uses_template else "plain prompt tokens")
    warn_if_batch_exceeds_data("ppo", cfg.rollout_batch_size // cfg.num_generations, len(prompts),
                               f"--{key_prefix}rollout_batch_size / --{key_prefix}num_generations prompts")
    return PPOPlan(cfg, model, prompts, prompt_ids, eval_prompts, eval_ids)


@dataclasses.dataclass
class PPORun:
    """What `setup` builds and the loop of `train` reads and advances (a plain record; `true_score`
    samples the held-out prompts)."""

    cfg: PPOConfig
    plan: PPOPlan
    device: torch.device
    lm: torch.nn.Module
    tokenizer: object
    ac: ActorCritic
    model: distributed.ShardedModel
    reward_fn: Callable
    estimator: Callable
    """The advantage estimator (`advantage_estimator`), chosen once."""
    optimizer: torch.optim.Optimizer
    kl_ctl: KLController
    timer: PhaseTimer
    run: StageRun
    engine: DecodeEngine | None
    """The decode engine of `--rollout_engine graph` (None: transformers' generate)."""
    data: Dataset
    compiled: bool
    step: int = 0
    skipped: int = 0
    true_before: float | None = None
    held: dict | None = None
    """state_bytes after the last update (with the gradients), for the summary."""
    shared_on: bool | None = None
    """Whether the last rollout shared its prompts (--shared_prompt; None: not yet): the log says when it changes."""

    def true_score(self) -> float:
        """The built-in task's score of responses sampled for the held-out prompts."""
        return evaluate_true_score(self.model, self.tokenizer, self.plan.eval_ids, self.plan.eval_prompts,
                                   max_new_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature,
                                   device=self.device)


def setup(cfg: PPOConfig, plan: PPOPlan | None = None) -> PPORun:
    """Everything before the first iteration: the process group, the run folder, the actor-critic
    (+ reference; compiled layers; sharded under torchrun), the reward, the optimizer, the advantage
    estimator, resume, and the true score before."""
    plan = plan or prepare(cfg)
    cfg = plan.cfg
    device = distributed.setup(cfg.device, to_dict(cfg), "ppo")  # torchrun: process group, same config everywhere
    start_stage_dir(Path(cfg.out) / "ppo", to_dict(cfg), resume=cfg.resume, overwrite=cfg.overwrite)
    torch.manual_seed(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, device, lora=cfg.lora_rank > 0)
    lm, tokenizer = load_causal_lm(plan.model, device=device, dtype=dtype,
                                   gradient_checkpointing=cfg.gradient_checkpointing, qlora=cfg.qlora)
    ac = ActorCritic(lm, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, value_head=cfg.advantage == "gae")
    compiled = compile_wanted(cfg.compile, device)
    if compiled:
        log.info("ppo: %d decoder layers compiled (one compile serves them all; generation stays eager)",
                 compile_layers(ac))
    model = distributed.shard_model(ac, cfg.shard, device)
    distributed.seed_per_rank(cfg.seed)  # ranks sample different responses
    engine = make_engine(cfg.rollout_engine, ac.policy, tokenizer,
                         batch=cfg.rollout_batch_size // distributed.world_size(),
                         prompt_len=cfg.max_prompt_len, new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                         device=device, sampler=cfg.rollout_sampler, slots=cfg.rollout_slots,
                         keep_memory=cfg.rollout_keep_memory)  # None: the hf path
    reader = sampler_logprobs_reader(cfg)
    if engine is None and reader and cfg.rollout_sampler != "inverse_cdf":
        raise ValueError(f"ppo: {reader} needs the sampler's log-probs, and the decode engine cannot run this "
                         f"model (the log says why): pass --rollout_sampler inverse_cdf")
    reward_fn = load_reward(cfg.reward, device=device, policy_tokenizer=tokenizer, chat_template=cfg.chat_template,
                            clip_abs=cfg.reward_clip_abs, timeout_s=cfg.reward_timeout_s)
    optimizer = torch.optim.AdamW([p for p in ac.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    run = StageRun("ppo", cfg, model=ac, optimizer=optimizer,
                   updates_per_step=cfg.ppo_epochs * (cfg.rollout_batch_size // cfg.mini_batch_size))
    s = PPORun(cfg, plan, device, lm, tokenizer, ac, model, reward_fn, advantage_estimator(cfg), optimizer,
               KLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon), PhaseTimer(device), run, engine,
               Dataset.from_dict({"prompt": plan.prompts, "prompt_ids": plan.prompt_ids}), compiled)
    s.step = s.run.step
    if s.run.resumed:
        extra = s.run.extra
        s.kl_ctl.coef, s.skipped, s.true_before = extra["kl_coef"], extra["skipped_nonfinite"], extra["true_before"]
        s.timer.total_seconds.update(extra["phase_seconds"])
        s.timer.total_peak.update(extra["phase_peak_memory_bytes"])
    elif cfg.data == BUILTIN:
        s.true_before = s.true_score()
        log.info("ppo: true score before PPO %.3f", s.true_before)
    ac.train()
    return s


@holds_run_folder("ppo")
def train(cfg: PPOConfig, plan: PPOPlan | None = None) -> dict:
    s = setup(cfg, plan)
    cfg, device, model = s.cfg, s.device, s.model
    while s.step < s.run.stop:
        t0 = time.perf_counter()
        # 1. rollout: num_generations responses per prompt, side by side (rank 0 draws the prompts; each
        #    rank its share, whole groups); generation gathers the policy, not a frozen reference copy
        with s.timer.phase("rollout"):
            rollout = model.run(sample, s.tokenizer, draw_prompts(s), cfg, device, s.engine,
                                gathered=s.ac.policy)  # not the reference
        # 2. reward: one score per sequence
        with s.timer.phase("reward"):
            rollout = rollout._replace(scores=s.reward_fn(rollout))
        # 3. old log-probs and values (one actor-critic forward), reference log-probs
        with s.timer.phase("logprobs"):
            exp = model.run(experience, rollout, cfg, device)
        # 4. KL-shaped per-token rewards, then advantages and returns (the estimator chosen in setup)
        with s.timer.phase("advantages"):
            exp = with_advantages(exp, rollout.scores, s.kl_ctl.coef, cfg, s.estimator)
        # 5. PPO epochs: clipped policy loss (+ k3 KL with kl_in_loss) + value loss (with a critic)
        with s.timer.phase("update"):
            update_stats = ppo_update(model, s.optimizer, exp, cfg, device, s.step, kl_coef=s.kl_ctl.coef)
            s.held = distributed.state_bytes(s.ac, s.optimizer)  # with the gradients, for the summary
            # Free the gradients: the next rollout, reward and log-prob passes need none (full fine-tuning
            # of a 0.5B model in bf16 held 2 GB of fp32 gradients through them; the planner counts none)
            s.optimizer.zero_grad(set_to_none=True)
        # 6. KL controller, metrics, checkpoint
        end_iteration(s, rollout, exp, update_stats, time.perf_counter() - t0)
    return finish(s)


def draw_prompts(s: PPORun) -> dict[str, list]:
    """This rank's prompts of the next rollout, each num_generations times side by side (rank 0 draws)."""
    G = s.cfg.num_generations
    idx = distributed.draw(range(len(s.data)), s.cfg.rollout_batch_size // G)
    return distributed.local_rows(s.data, [i for i in idx for _ in range(G)])


def end_iteration(s: PPORun, rollout: Rollout, exp: Experience, update_stats: dict, seconds: float) -> None:
    """6. The KL controller, this iteration's metrics (each rank's share; StageRun.log averages them),
    the progress bar and a checkpoint when due."""
    cfg, mask = s.cfg, exp.batch.response_mask
    s.skipped += update_stats.pop("skipped_nonfinite")
    kl = distributed.all_mean(((exp.old_logp - exp.ref_logp) * mask).sum(-1).mean())  # per-sequence k1 KL, global
    s.kl_ctl.update(kl, cfg.rollout_batch_size)
    s.step += 1
    compiled = compile_stats() if s.compiled else None
    if compiled and s.step == s.run.step + 1:
        log.info("ppo: compiling the decoder layers took %.1f s (%d graphs) in the first iteration",
                 compiled["seconds"], compiled["graphs"])
    stats = {"reward": rollout.scores.mean().item(), "kl": kl, "kl_coef": s.kl_ctl.coef,
             "response_length": mask.sum(-1).mean().item(),
             "response_width": mask.shape[1],  # the longest response: phases 2, 3 and 5 run over prompt + this
             "tokens_per_s": distributed.all_sum(mask.sum()).item() / seconds,
             "skipped_nonfinite": s.skipped, **update_stats, **s.timer.step_stats()}
    if exp.sampler_logp is not None and cfg.old_logprobs == "recompute":  # how far the sampled distribution
        # is from the one trained (with --old_logprobs sampler they are the same tensor)
        stats.update(sampler_gap(exp.sampler_logp, exp.old_logp, mask))
    if exp.correction is not None:  # one read of the correction's metrics
        names = list(exp.correction)
        stats.update(zip((f"rollout_corr/{k}" for k in names),
                         torch.stack([exp.correction[k].double() for k in names]).tolist()))
    if exp.shared is not None:
        saved = exp.shared.unshared - exp.shared.shared if exp.shared.on else 0
        stats.update(shared_prompt=float(exp.shared.on), shared_prompt_tokens_saved=saved)
        if exp.shared.on != s.shared_on:
            log.info("ppo: %s (--shared_prompt %s)", exp.shared.describe(), cfg.shared_prompt)
            s.shared_on = exp.shared.on
    if compiled:  # graphs compiled so far: a recompile per step would show here
        stats["compiled_graphs"] = compiled["graphs"]
    if exp.values is not None:
        stats["explained_variance"] = explained_variance(exp.values, exp.returns, mask).item()
    if cfg.num_generations > 1:
        stats["group_reward_std"] = group_reward_std(rollout.scores, cfg.num_generations)
    if cfg.data == BUILTIN:
        stats["true_score"] = sum(task.true_score(rollout.prompts, rollout.responses)) / len(rollout.prompts)
    s.run.advance(s.step, s.skipped, reward=f"{stats['reward']:.3f}", kl=f"{kl:.3f}")  # guards; a signal ends here
    if s.run.due(s.step, cfg.log_every):
        s.run.log(s.step, stats)
    if s.run.checkpoint_due(s.step):
        s.run.save(s.step, s.ac.trainable_state(),
                   {"kl_coef": s.kl_ctl.coef, "skipped_nonfinite": s.skipped, "true_before": s.true_before,
                    "phase_seconds": dict(s.timer.total_seconds),
                    "phase_peak_memory_bytes": dict(s.timer.total_peak)})


def finish(s: PPORun) -> dict:
    """7. The final policy (written by rank 0), the true score after, the summary and the plots."""
    cfg, run, timer, device = s.cfg, s.run, s.timer, s.device
    if not run.finish(s.step):
        return {"stopped_at": s.step}
    # this rank's parameters, gradients (as the last update left them) and optimizer states
    state_bytes = distributed.state_bytes_summary(s.ac, s.optimizer, s.held)
    lineage = s.plan.model.lineage(cfg.data)
    distributed.export(s.ac, lambda: ActorCritic(empty_copy(s.lm), lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                                 value_head=cfg.advantage == "gae"),
                       lambda m: m.save_pretrained(run.dir / "final", s.tokenizer, lineage=lineage))
    logged = run.rows()
    phase_seconds, phase_seconds_mean = distributed.max_and_mean(
        {k: timer.total_seconds.get(k, 0.0) for k in PPO_PHASES})
    phase_peak, phase_peak_mean = distributed.max_and_mean(
        {k: timer.total_peak[k] for k in PPO_PHASES if k in timer.total_peak})
    summary = {
        "steps": s.step, "seconds": run.seconds, "skipped_nonfinite": s.skipped,
        "reward_first": logged[0]["reward"] if logged else None,
        "reward_final": logged[-1]["reward"] if logged else None,
        "kl_final": logged[-1]["kl"] if logged else None,
        "phase_seconds": phase_seconds,
        "phase_peak_memory_bytes": {k: int(v) for k, v in phase_peak.items()},
        "tokens_per_s": sum(r["tokens_per_s"] for r in logged) / max(1, len(logged)),
        "device": str(device), "lora_rank": cfg.lora_rank, "advantage": cfg.advantage,
        "num_generations": cfg.num_generations, "model_dir": str(run.dir / "final"),
        "max_prompt_len": cfg.max_prompt_len, "max_new_tokens": cfg.max_new_tokens,  # as resolved (0 = auto in config)
        "rollout_cache": rollout_cache(cfg, device), "micro_batch_tokens": cfg.micro_batch_tokens,
        "compiled": s.compiled, **({"compile": compile_stats()} if s.compiled else {}),
        "rollout_engine": "hf" if s.engine is None else "graph",
        **({"rollout_sampler": cfg.rollout_sampler} if s.engine is None else {}),
        **({} if s.engine is None else {"rollout_engine_stats": dict(s.engine.stats, **s.engine.memory_bytes())}),
        **state_bytes,
    }
    if distributed.active():  # per-rank figures: max above, mean here
        summary.update(ranks=distributed.world_size(), shard=cfg.shard, phase_seconds_mean=phase_seconds_mean,
                       phase_peak_memory_bytes_mean=phase_peak_mean)
    builtin = cfg.data == BUILTIN
    if builtin:
        summary["true_score_before"] = s.true_before
        summary["true_score_after"] = s.true_score()
    run.write_summary(summary)
    run.plot(["reward", "true_score", "kl", "entropy"], "ppo_reward_kl.png")
    if distributed.is_main():
        plot_phases(summary["phase_seconds"], summary["phase_peak_memory_bytes"], Path(cfg.out) / "plots" /
                    "ppo_phases.png", timer.memory_kind)
    if builtin:
        log.info("ppo: done, true score %.3f -> %.3f, final KL %.3f", summary["true_score_before"],
                 summary["true_score_after"], summary["kl_final"])
    else:
        log.info("ppo: done, reward %.3f (first step) -> %.3f (last step), final KL %.3f", summary["reward_first"],
                 summary["reward_final"], summary["kl_final"])
    return summary


def main(argv: list[str]) -> int:
    setup_logging()
    return run_cli(PPOConfig, argv, "fastrlhf ppo", distributed.entry(train))
