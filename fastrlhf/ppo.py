"""`fastrlhf ppo`: PPO with a LoRA-disabled (or frozen-copy) reference, on a shared actor-critic
(`--advantage gae`) or critic-free (`--advantage grpo|dr_grpo|rloo|reinforce_pp|reinforce_pp_baseline`).

Each iteration, top to bottom:
  1. rollout     sample responses (KV cache, left-padded prompts, stop at EOS), num_generations
                 per prompt, a prompt's responses side by side
  2. reward      reward model at the last response token, or a rule `module:function`; every
                 score checked (count, type, finite: fastrlhf.rewards)
  3. logprobs    one policy forward -> old log-probs (and values with a critic); reference log-probs
  4. advantages  KL-shaped rewards (ops.kl_shaped_rewards; no KL there with kl_in_loss), then
                 GAE (ops.gae), or one score per response -> ops.outcome_advantages over each
                 prompt's group of responses
  5. update      PPO epochs over minibatches with gradient accumulation: clipped policy loss
                 (ops.linear_ppo_actor_loss, from hidden states: no [B, T, V] logits; + kl_coef x k3
                 KL with kl_in_loss) + value loss (ops.value_loss, with a critic), gradient clipping
Then the KL coefficient is updated (fixed, or adaptive as Ziegler et al. 2019), metrics are
logged and a checkpoint is written every `save_every` iterations.

`prepare` checks the whole configuration (policy, reward, data, lengths, the run folder)
before a model loads; `train` runs it. Writes OUT/ppo/config.json, OUT/ppo/final (merged HF
model + value head), OUT/ppo/checkpoints, rows with "stage": "ppo" in OUT/metrics.jsonl,
OUT/summary.json["ppo"], OUT/plots/ppo_*.png.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
from datasets import Dataset

from fastrlhf import distributed, ops, task
from fastrlhf.checkpoint import check_run_dir
from fastrlhf.config import PPOConfig, run_cli, to_dict
from fastrlhf.data import BUILTIN, Encoder, auto_lengths, load_table, truncate_prompts
from fastrlhf.devices import autocast, resolve_device, resolve_dtype
from fastrlhf.heads import ActorCritic
from fastrlhf.metrics import PPO_PHASES, PhaseTimer, log, setup_logging, to_floats
from fastrlhf.models import ModelSource, empty_copy, load_causal_lm, same_encoding
from fastrlhf.ops.advantages import GROUPED
from fastrlhf.plots import plot_phases
from fastrlhf.rewards import check_reward_model_dir, import_rule, is_rule, load_reward, reward_encoder
from fastrlhf.rollout import (
    ROLLOUT_CACHES,
    ROLLOUT_ENGINES,
    Rollout,
    engine_generate,
    generate,
    make_engine,
    sampler_gap,
    token_logprobs,
)
from fastrlhf.run import (
    POSITIVE,
    StageRun,
    check_common,
    describe_data,
    evaluate_true_score,
    finite_or_warn,
    holds_run_folder,
    resolve_data,
    stage_model,
    start_stage_dir,
    warn_if_batch_exceeds_data,
)

ADDITIVE_STATS = ("pg_loss", "value_loss")  # divided by the minibatch's token count: they sum over micro-batches
# the auto max_new_tokens with your own data: at most this (verl's data.max_response_length and TRL's GRPO
# max_completion_length default, read from verl 0.9.1 and TRL 1.16.0)
AUTO_MAX_NEW_TOKENS = 512


class KLController:
    """Fixed coefficient, or adaptive (Ziegler et al. 2019):
    coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * n_sequences / horizon."""

    def __init__(self, coef: float, target: float, horizon: int):
        self.coef, self.target, self.horizon = coef, target, horizon

    def update(self, kl: float, n_sequences: int) -> None:
        if self.target > 0:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * n_sequences / self.horizon


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over the response tokens (of every rank)."""
    _, var_r, _ = distributed.masked_moments(returns, mask)
    _, var_d, _ = distributed.masked_moments(returns - values, mask)
    return 1.0 - var_d / var_r.clamp(min=1e-8)


def group_reward_std(scores: torch.Tensor, group_size: int) -> float:
    """Mean over prompts of the standard deviation of their responses' scores (0: nothing to compare)."""
    return scores.view(-1, group_size).std(-1).mean().item()


@torch.no_grad()
def forward_logprobs_values(ac: ActorCritic, rollout: Rollout, *, temperature: float, device):
    """Phase 3: (old_logp, values, ref_logp), each [B, R] float32, 0 where the mask is 0;
    values is None without a critic."""
    b = rollout.batch
    with autocast(device):
        hidden, values = ac(b.input_ids, b.attention_mask, b.position_ids)
        old_logp = token_logprobs(ac.policy, b, hidden, temperature=temperature)
        ref_hidden = ac.reference_hidden(b.input_ids, b.attention_mask, b.position_ids)
        ref_logp = token_logprobs(ac.policy, b, ref_hidden, temperature=temperature, head=ac.reference_lm_head())
    P = b.prompt_len
    if values is not None:
        values = values[:, P - 1:-1].float() * b.response_mask
    return old_logp, values, ref_logp


def micro_batch_losses(ac, b, idx, old_logp, old_values, advantages, returns, cfg: PPOConfig, device,
                       num_tokens: int, ref_logp=None, kl_coef: float = 0.0):
    """Actor loss and value loss (None without a critic) of the rows `idx` of the batch `b`, each
    divided by `num_tokens` (the minibatch's token count over every rank), and their stats."""
    P = b.prompt_len
    mask, labels = b.response_mask[idx], b.labels[idx]
    with autocast(device):
        hidden, values = ac(b.input_ids[idx], b.attention_mask[idx], b.position_ids[idx])
    h = hidden[:, P - 1:-1]
    head = ac.lm_head
    # Under torchrun each rank's loss is its share of the global mean (global_num_tokens); ppo_update
    # multiplies only what it backpropagates by distributed.loss_scale() (FSDP averages gradients),
    # rather than passing the ops' dp_size, so the logged losses stay true shares that sum over ranks.
    actor_loss, stats = ops.linear_ppo_actor_loss(
        h, head.weight.to(h.dtype), labels, old_logp[idx], advantages[idx], mask, bias=head.bias,
        temperature=cfg.temperature, clip_low=cfg.clip, entropy_coef=cfg.entropy_coef,
        ref_logp=None if ref_logp is None else ref_logp[idx], kl_coef=kl_coef, kl_estimator="k3",
        global_num_tokens=num_tokens)
    v_loss = None
    if old_values is not None:
        v_loss, v_stats = ops.value_loss(values[:, P - 1:-1].float(), old_values[idx], returns[idx], mask,
                                         clip=cfg.value_clip, global_num_tokens=num_tokens)
        stats = dict(stats, value_loss=v_loss.detach(), value_clipfrac=v_stats["clipfrac"])
    return actor_loss, v_loss, stats


def ppo_update(ac, optimizer, rollout: Rollout, old_logp, old_values, advantages, returns, cfg: PPOConfig,
               device, step: int, *, ref_logp=None, kl_coef: float = 0.0) -> dict:
    """Phase 5: `ppo_epochs` passes over the rollout in minibatches of `mini_batch_size`, each
    the sum of micro-batches (gradient accumulation; the losses are divided by the minibatch's
    token count, so the split does not change the gradient). With `ref_logp`, kl_coef x k3 KL
    is part of the actor loss. Without a critic (`old_values` None) there is no value loss.
    Returns mean stats.

    `ac`: the actor-critic, or the `ShardedModel` around it. Under torchrun the sizes are
    global: each rank takes its share of every minibatch and micro-batch from its own
    rollout, the losses divide by the minibatch's token count over all ranks, and the stats
    are summed over ranks."""
    model = distributed.as_sharded(ac)
    b = rollout.batch
    B = b.input_ids.shape[0]
    n = distributed.world_size()
    mini_size, micro_size = cfg.mini_batch_size // n, cfg.micro_batch_size // n
    params = [p for p in model.parameters() if p.requires_grad]
    sums, n_updates, skipped = {}, 0, 0
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B).tolist()
        for start in range(0, B, mini_size):
            mini = order[start:start + mini_size]
            num_tokens = int(distributed.all_sum(b.response_mask[mini].sum()).item())
            optimizer.zero_grad(set_to_none=True)
            finite, mini_stats = True, {}
            for m0 in range(0, len(mini), micro_size):
                idx = torch.tensor(mini[m0:m0 + micro_size], device=device)
                actor_loss, v_loss, stats = model.run(micro_batch_losses, b, idx, old_logp, old_values, advantages,
                                                      returns, cfg, device, num_tokens, ref_logp, kl_coef)
                loss = actor_loss if v_loss is None else actor_loss + cfg.vf_coef * v_loss
                if not finite_or_warn(loss, "PPO loss", step):
                    finite = False
                    break
                (loss * distributed.loss_scale()).backward()
                # losses add up over micro-batches (and ranks); per-token means are weighted by
                # their token share of the minibatch
                share = float(b.response_mask[idx].sum()) / max(1, num_tokens)
                stats = to_floats(stats)
                if "kl" in stats:  # the loss term's k3 per token; "kl" is the per-sequence k1 below
                    stats["kl_k3"] = stats.pop("kl")
                for k, v in stats.items():
                    mini_stats[k] = mini_stats.get(k, 0.0) + (v if k in ADDITIVE_STATS else v * share)
            if finite:
                grad_norm = distributed.gradient_norm(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
                finite = finite_or_warn(grad_norm, "gradient norm", step)
            if not finite:
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            n_updates += 1
            for k, v in dict(mini_stats, grad_norm=grad_norm.item()).items():
                sums[k] = sums.get(k, 0.0) + v
    per_rank = [k for k in sums if k != "grad_norm"]  # the gradient norm is global already
    totals = distributed.all_sum(torch.tensor([sums[k] for k in per_rank], dtype=torch.float64)).tolist()
    sums.update(zip(per_rank, totals))
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
    if engine is not None:
        return engine_generate(engine, ac.policy, tokenizer, rows["prompt_ids"], rows["prompt"])
    return generate(ac.policy, tokenizer, rows["prompt_ids"], rows["prompt"], max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature, device=device, cache=rollout_cache(cfg, device))


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
    if cfg.rollout_engine not in ROLLOUT_ENGINES:
        raise ValueError(f"ppo: rollout_engine must be one of {', '.join(ROLLOUT_ENGINES)}, got {cfg.rollout_engine!r}")
    check_advantage(cfg)
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
    eval_ids = truncate_prompts(encoder.prompts(eval_prompts), cfg.max_prompt_len, what="evaluation prompts")
    check_run_dir(out / "ppo", to_dict(cfg), resume=cfg.resume, overwrite=cfg.overwrite,
                  defaults=to_dict(type(cfg)()), what="ppo")
    log.info("ppo: policy %s; %s; data %s; prompts <= %d tokens, responses <= %d; %s", model.spec, reward_desc,
             describe_data(cfg.data, len(prompts)), cfg.max_prompt_len, cfg.max_new_tokens,
             "chat template" if encoder.uses_template else "plain prompt tokens")
    warn_if_batch_exceeds_data("ppo", cfg.rollout_batch_size // cfg.num_generations, len(prompts),
                               f"--{key_prefix}rollout_batch_size / --{key_prefix}num_generations prompts")
    return PPOPlan(cfg, model, prompts, prompt_ids, eval_prompts, eval_ids)


@holds_run_folder("ppo")
def train(cfg: PPOConfig, plan: PPOPlan | None = None) -> dict:
    plan = plan or prepare(cfg)
    cfg = plan.cfg
    out = Path(cfg.out)
    device = distributed.setup(cfg.device, to_dict(cfg), "ppo")  # torchrun: process group, same config everywhere
    start_stage_dir(out / "ppo", to_dict(cfg), resume=cfg.resume, overwrite=cfg.overwrite)
    # 0. setup: actor-critic (+ reference; sharded under torchrun), reward, optimizer; resume if asked
    torch.manual_seed(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, device, lora=cfg.lora_rank > 0)
    lm, tokenizer = load_causal_lm(plan.model, device=device, dtype=dtype,
                                   gradient_checkpointing=cfg.gradient_checkpointing)
    critic = cfg.advantage == "gae"
    ac = ActorCritic(lm, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, value_head=critic)
    model = distributed.shard_model(ac, cfg.shard, device)
    distributed.seed_per_rank(cfg.seed)  # ranks sample different responses
    engine = make_engine(cfg.rollout_engine, ac.policy, tokenizer,
                         batch=cfg.rollout_batch_size // distributed.world_size(),
                         prompt_len=cfg.max_prompt_len, new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                         device=device)  # None: the hf path
    reward_fn = load_reward(cfg.reward, device=device, policy_tokenizer=tokenizer, chat_template=cfg.chat_template,
                            clip_abs=cfg.reward_clip_abs, timeout_s=cfg.reward_timeout_s)
    builtin = cfg.data == BUILTIN
    data = Dataset.from_dict({"prompt": plan.prompts, "prompt_ids": plan.prompt_ids})
    trainable = [p for p in ac.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    kl_ctl = KLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    timer = PhaseTimer(device)

    def true_score() -> float:  # the built-in task's score of responses sampled for held-out prompts
        return evaluate_true_score(model, tokenizer, plan.eval_ids, plan.eval_prompts,
                                   max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, device=device)

    run = StageRun("ppo", cfg, model=ac, optimizer=optimizer,
                   updates_per_step=cfg.ppo_epochs * (cfg.rollout_batch_size // cfg.mini_batch_size))
    step, skipped, true_before = run.step, 0, None
    if run.resumed:
        extra = run.extra
        kl_ctl.coef, skipped, true_before = extra["kl_coef"], extra["skipped_nonfinite"], extra["true_before"]
        timer.total_seconds.update(extra["phase_seconds"])
        timer.total_peak.update(extra["phase_peak_memory_bytes"])
    elif builtin:
        true_before = true_score()
        log.info("ppo: true score before PPO %.3f", true_before)
    ac.train()

    held = None  # state_bytes after the last update
    while step < run.stop:
        t0 = time.perf_counter()
        # 1. rollout: num_generations responses per prompt, side by side (rank 0 draws the prompts;
        #    each rank its share, whole groups)
        with timer.phase("rollout"):
            G = cfg.num_generations
            idx = distributed.draw(range(len(data)), cfg.rollout_batch_size // G)
            rows = distributed.local_rows(data, [i for i in idx for _ in range(G)])
            rollout = model.run(sample, tokenizer, rows, cfg, device, engine, gathered=ac.policy)  # not the reference
        # 2. reward: one score per sequence
        with timer.phase("reward"):
            scores = reward_fn(rollout)
            rollout = rollout._replace(scores=scores)
        # 3. old log-probs and values (one actor-critic forward), reference log-probs
        with timer.phase("logprobs"):
            old_logp, old_values, ref_logp = model.run(forward_logprobs_values, rollout,
                                                       temperature=cfg.temperature, device=device)
            gap = {} if rollout.sampler_logp is None else sampler_gap(rollout.sampler_logp, old_logp,
                                                                      rollout.batch.response_mask)
        # 4. KL-shaped per-token rewards (the KL goes to the loss instead with kl_in_loss), then GAE,
        #    or critic-free: one score per response (verl's token_level_rewards.sum(-1)) compared
        #    within each prompt's group of G responses
        with timer.phase("advantages"):
            mask = rollout.batch.response_mask
            rewards = ops.kl_shaped_rewards(scores, old_logp, ref_logp, mask,
                                            kl_coef=0.0 if cfg.kl_in_loss else kl_ctl.coef, estimator=cfg.kl_estimator)
            if critic:  # whitened with the global batch's moments
                advantages, returns = ops.gae(rewards, old_values, mask, gamma=cfg.gamma, lam=cfg.lam, whiten=False)
                advantages = distributed.whiten(advantages, mask)
            else:
                advantages = distributed.outcome_advantages(rewards.sum(-1), mask, group_size=G,
                                                            estimator=cfg.advantage)
                returns = None
        # 5. PPO epochs: clipped policy loss (+ k3 KL with kl_in_loss) + value loss (with a critic)
        with timer.phase("update"):
            update_stats = ppo_update(model, optimizer, rollout, old_logp, old_values, advantages, returns, cfg,
                                      device, step, ref_logp=ref_logp if cfg.kl_in_loss else None,
                                      kl_coef=kl_ctl.coef if cfg.kl_in_loss else 0.0)
            held = distributed.state_bytes(ac, optimizer)  # with the gradients, for the summary
            # Free the gradients: the next rollout, reward and log-prob passes need none (full fine-tuning
            # of a 0.5B model in bf16 held 2 GB of fp32 gradients through them; the planner counts none)
            optimizer.zero_grad(set_to_none=True)
        skipped += update_stats.pop("skipped_nonfinite")
        # 6. KL controller, metrics (each rank's share; StageRun.log averages them), checkpoint
        kl = distributed.all_mean(((old_logp - ref_logp) * mask).sum(-1).mean())  # per-sequence k1 KL, global
        kl_ctl.update(kl, cfg.rollout_batch_size)
        step += 1
        n_tokens = distributed.all_sum(mask.sum()).item()
        stats = {"reward": scores.mean().item(), "kl": kl, "kl_coef": kl_ctl.coef,
                 "response_length": mask.sum(-1).mean().item(),
                 "tokens_per_s": n_tokens / (time.perf_counter() - t0),
                 "skipped_nonfinite": skipped, **gap, **update_stats, **timer.step_stats()}
        if critic:
            stats["explained_variance"] = explained_variance(old_values, returns, mask).item()
        if G > 1:
            stats["group_reward_std"] = group_reward_std(scores, G)
        if builtin:
            stats["true_score"] = sum(task.true_score(rollout.prompts, rollout.responses)) / len(rollout.prompts)
        run.advance(step, skipped, reward=f"{stats['reward']:.3f}", kl=f"{kl:.3f}")  # guards; a signal ends here
        if run.due(step, cfg.log_every):
            run.log(step, stats)
        if run.checkpoint_due(step):
            run.save(step, ac.trainable_state(),
                     {"kl_coef": kl_ctl.coef, "skipped_nonfinite": skipped, "true_before": true_before,
                      "phase_seconds": dict(timer.total_seconds),
                      "phase_peak_memory_bytes": dict(timer.total_peak)})

    if not run.finish(step):
        return {"stopped_at": step}
    # this rank's parameters, gradients (as the last update left them) and optimizer states
    state_bytes = distributed.state_bytes_summary(ac, optimizer, held)
    # 7. final policy (written by rank 0), true score after, summary, plots
    distributed.export(ac, lambda: ActorCritic(empty_copy(lm), lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                               value_head=critic),
                       lambda m: m.save_pretrained(run.dir / "final", tokenizer, lineage=plan.model.lineage(cfg.data)))
    logged = run.rows()
    phase_seconds, phase_seconds_mean = distributed.max_and_mean(
        {k: timer.total_seconds.get(k, 0.0) for k in PPO_PHASES})
    phase_peak, phase_peak_mean = distributed.max_and_mean(
        {k: timer.total_peak[k] for k in PPO_PHASES if k in timer.total_peak})
    summary = {
        "steps": step, "seconds": run.seconds, "skipped_nonfinite": skipped,
        "reward_first": logged[0]["reward"] if logged else None,
        "reward_final": logged[-1]["reward"] if logged else None,
        "kl_final": logged[-1]["kl"] if logged else None,
        "phase_seconds": phase_seconds,
        "phase_peak_memory_bytes": {k: int(v) for k, v in phase_peak.items()},
        "tokens_per_s": sum(r["tokens_per_s"] for r in logged) / max(1, len(logged)),
        "device": str(device), "lora_rank": cfg.lora_rank, "advantage": cfg.advantage,
        "num_generations": cfg.num_generations, "model_dir": str(run.dir / "final"),
        "max_prompt_len": cfg.max_prompt_len, "max_new_tokens": cfg.max_new_tokens,  # as resolved (0 = auto in config)
        "rollout_cache": rollout_cache(cfg, device),
        "rollout_engine": "hf" if engine is None else "graph",
        **({} if engine is None else {"rollout_engine_stats": dict(engine.stats, **engine.memory_bytes())}),
        **state_bytes,
    }
    if distributed.active():  # per-rank figures: max above, mean here
        summary.update(ranks=distributed.world_size(), shard=cfg.shard, phase_seconds_mean=phase_seconds_mean,
                       phase_peak_memory_bytes_mean=phase_peak_mean)
    if builtin:
        summary["true_score_before"] = true_before
        summary["true_score_after"] = true_score()
    run.write_summary(summary)
    run.plot(["reward", "true_score", "kl", "entropy"], "ppo_reward_kl.png")
    if distributed.is_main():
        plot_phases(summary["phase_seconds"], summary["phase_peak_memory_bytes"], out / "plots" / "ppo_phases.png",
                    timer.memory_kind)
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
