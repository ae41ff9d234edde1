"""`fastrlhf dpo`: direct preference optimisation on (prompt, chosen, rejected), from the SFT model.

With c, r the summed log-probs of the chosen and rejected responses under the policy, and
c_ref, r_ref under the reference (the starting model: a frozen copy, or the LoRA-disabled policy):

    loss = mean over pairs of -log sigmoid(beta ((c - c_ref) - (r - r_ref)))   (loss_type sigmoid)

Each step, top to bottom:
  1. batch      B pairs: the chosen and the rejected responses of the same prompts, one packed
                batch of 2B rows
  2. reference  the reference's per-sequence sums (no gradient), from its hidden states; with
                --shared_prompt each pair's prompt is forwarded once, [prompt, chosen, rejected]
                (fastrlhf.train.shared_prompt), in this phase and the next
  3. loss       one policy forward; ops.linear_dpo_loss: the chosen and rejected sums in one
                chunked pass over the 2B rows (no [N, V] logits), then ops.dpo_loss
  4. update     warm-up, gradient clipping; a non-finite loss or gradient skips the step
  5. log        loss, implicit-reward margin and accuracy; held-out accuracy every eval_every
                steps; checkpoint every save_every

The held-out accuracy is the fraction of held-out pairs whose implicit reward
beta (logp - logp_ref) is higher for the chosen response. On the built-in task the true score
of sampled responses is measured before and after, as in PPO.

`prepare` checks the whole configuration before a model loads; `train` runs it. Writes
OUT/dpo/config.json, OUT/dpo/final (a merged HF model directory), OUT/dpo/checkpoints, rows with
"stage": "dpo" in OUT/metrics.jsonl, OUT/summary.json["dpo"] and OUT/plots/dpo_curves.png.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset

from fastrlhf import ops
from fastrlhf.train import distributed, packing, shared_prompt, task
from fastrlhf.train.checkpoint import check_run_dir
from fastrlhf.train.config import DPOConfig, run_cli, to_dict
from fastrlhf.train.data import BUILTIN, Batch, Encoder, truncate_prompts
from fastrlhf.train.devices import autocast
from fastrlhf.train.heads import ActorCritic
from fastrlhf.train.metrics import log, setup_logging, to_floats
from fastrlhf.train.models import ModelSource, check_qlora, empty_copy, load_causal_lm
from fastrlhf.train.recipes.rm import pair_batch, prepare_pairs
from fastrlhf.train.run import (
    EVAL_BATCH_SIZE,
    StageRun,
    check_common,
    describe_data,
    evaluate_true_score,
    guarded_step,
    holds_run_folder,
    stage_model,
    start_stage_dir,
    warn_if_batch_exceeds_data,
)

TINY_LR = 1e-3  # a model grown from the built-in `tiny`
MODEL_LR = 1e-5  # any other model, full fine-tuning: OpenRLHF 0.11's train_dpo default (--adam.lr)
LORA_LR = 1e-4  # any other model with LoRA adapters


def shared_pairs(batch: Batch, mode: str, device) -> tuple[packing.MicroBatch | None, shared_prompt.Saving]:
    """The batch's pairs (rows i and B + i share their prompt) as one shared-prompt pack [prompt, chosen,
    rejected] per pair where --shared_prompt `mode` says so (None: the padded rows), and the tokens it
    saves. One read of the device (the lengths)."""
    lengths = packing.read_lengths(batch)
    B = batch.input_ids.shape[0] // 2
    pairs = [np.array([i, B + i]) for i in range(B)]
    saving = shared_prompt.decide(mode, lengths, pairs)
    if not saving.on:
        return None, saving
    (mb,), = packing.micro_batches(batch, [[packing.Units(tuple(pairs))]], lengths, packed=False, device=device)
    return mb, saving


def response_hidden(policy: ActorCritic, batch: Batch, *, reference: bool, shared: packing.MicroBatch | None = None):
    """(hidden [2B, R, H] that predict the response tokens, the lm_head) of the policy, or of
    the reference (no gradient); from the padded rows, or from the `shared` pack (its states put back in
    the rows' places: the same hidden states, 0 past each response)."""
    P = batch.prompt_len
    if shared is not None:
        fn = (lambda *x, **kw: (policy.reference_hidden(*x, **kw),)) if reference else (lambda *x, **kw: policy(
            *x, **kw)[:1])
        h, = packing.forward_responses(fn, batch, shared)
        H = h.shape[-1]
        rows = h.new_zeros(batch.response_mask.numel(), H)
        rows[shared.index.reshape(-1)] = h.reshape(-1, H)
        return rows.view(*batch.response_mask.shape, H), policy.reference_lm_head() if reference else policy.lm_head
    if reference:
        hidden = policy.reference_hidden(batch.input_ids, batch.attention_mask, batch.position_ids)
        return hidden[:, P - 1:-1], policy.reference_lm_head()
    hidden, _ = policy(batch.input_ids, batch.attention_mask, batch.position_ids)
    return hidden[:, P - 1:-1], policy.lm_head


@torch.no_grad()
def reference_sums(policy: ActorCritic, batch: Batch, device,
                   shared: packing.MicroBatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 2: the reference's summed log-probs of the chosen rows and of the rejected rows."""
    with autocast(device):
        h, head = response_hidden(policy, batch, reference=True, shared=shared)
        sums = ops.linear_sequence_logprobs(h, head.weight.to(h.dtype), batch.responses, batch.response_mask,
                                            bias=head.bias)
    B = sums.shape[0] // 2
    return sums[:B], sums[B:]


def dpo_step_loss(policy: ActorCritic, batch: Batch, cfg: DPOConfig, device,
                  shared: packing.MicroBatch | None = None):
    """Phases 2-3: (loss, stats) of one packed batch of pairs (`shared`: its shared-prompt pack)."""
    ref_chosen, ref_rejected = reference_sums(policy, batch, device, shared)
    with autocast(device):
        h, head = response_hidden(policy, batch, reference=False, shared=shared)
    return ops.linear_dpo_loss(h, head.weight.to(h.dtype), batch.responses, batch.response_mask, ref_chosen,
                               ref_rejected, bias=head.bias, beta=cfg.beta, loss_type=cfg.loss_type,
                               label_smoothing=cfg.label_smoothing, ipo_per_token=cfg.ipo_per_token)


@torch.no_grad()
def heldout_accuracy(model: distributed.ShardedModel, data: Dataset, idx: list[int], pad_id: int, device) -> float:
    """Fraction of the held-out pairs `idx` (rows of `data`) whose implicit reward is higher for
    the chosen response; each rank scores its share."""
    rows = distributed.local_rows(data, idx)

    def count(policy: ActorCritic) -> int:
        was_training = policy.training
        policy.eval()
        hits, n = 0, len(rows["prompt"])
        for i in range(0, n, EVAL_BATCH_SIZE // 2):
            part = range(i, min(n, i + EVAL_BATCH_SIZE // 2))
            batch = pair_batch(rows, part, pad_id).to(device)
            ref_chosen, ref_rejected = reference_sums(policy, batch, device)
            with autocast(device):
                h, head = response_hidden(policy, batch, reference=False)
                sums = ops.linear_sequence_logprobs(h, head.weight.to(h.dtype), batch.responses, batch.response_mask,
                                                    bias=head.bias)
            hits += int((sums[:len(part)] - ref_chosen > sums[len(part):] - ref_rejected).sum())
        policy.train(was_training)
        return hits

    return distributed.all_sum(model.run(count, gathered=True)).item() / max(1, len(idx))


@dataclasses.dataclass
class DPOPlan:
    """The DPO stage, checked and resolved before its model loads."""

    cfg: DPOConfig
    """The configuration with every `auto`/0 default resolved (what OUT/dpo/config.json records)."""
    model: ModelSource
    enc: dict[str, list[list[int]]]
    """Token ids of "prompt", "chosen" and "rejected", one entry per pair."""
    train_idx: list[int]
    eval_idx: list[int]
    eval_prompts: list[str]
    """Built-in task only: held-out prompts for the true score (empty for user data)."""
    eval_ids: list[list[int]]


def prepare(cfg: DPOConfig, *, upstream: ModelSource | None = None, key_prefix: str = "") -> DPOPlan:
    """Check the whole configuration and resolve its defaults, loading no model weights.
    `upstream`: the SFT model a pipeline will have written by the time this stage runs."""
    cfg = dataclasses.replace(cfg)
    check_common(cfg, ("steps", "batch_size", "log_every", "save_every", "eval_every", "num_pairs", "eval_prompts"),
                 "dpo", key_prefix)
    distributed.check_shard(cfg.shard, "dpo")
    distributed.check_global_batch("dpo", batch_size=cfg.batch_size)
    try:  # beta, loss_type and label_smoothing as the op checks them
        ops.dpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta=cfg.beta,
                     loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing)
    except (ValueError, TypeError) as e:
        raise type(e)(f"dpo: {e}") from None
    if cfg.ipo_per_token and cfg.loss_type != "ipo":
        raise ValueError(f"dpo: ipo_per_token applies to loss_type ipo only, got loss_type {cfg.loss_type!r}")
    if cfg.shared_prompt not in shared_prompt.MODES:
        raise ValueError(f"dpo: --{key_prefix}shared_prompt must be one of {', '.join(shared_prompt.MODES)}, got "
                         f"{cfg.shared_prompt!r}")
    model = stage_model(cfg.model, Path(cfg.out) / "sft" / "final", upstream, "dpo", "sft")
    cfg.model = model.spec
    if cfg.qlora:
        check_qlora(model, cfg.lora_rank, "dpo", key_prefix)
    enc, train_idx, eval_idx = prepare_pairs(cfg, model, "dpo", key_prefix)
    eval_prompts, eval_ids = [], []
    if cfg.data == BUILTIN:
        cfg.max_new_tokens = cfg.max_new_tokens or task.MAX_NEW_TOKENS
        eval_prompts = [r["prompt"] for r in task.synthetic_prompt_rows(cfg.eval_prompts, cfg.seed, "eval")]
        eval_ids = truncate_prompts(Encoder(model.tokenizer, chat_template=cfg.chat_template).prompts(eval_prompts),
                                    cfg.max_prompt_len, what="evaluation prompts")
    cfg.lr = cfg.lr or (TINY_LR if model.origin == "tiny" else LORA_LR if cfg.lora_rank else MODEL_LR)
    check_run_dir(Path(cfg.out) / "dpo", to_dict(cfg), resume=cfg.resume, overwrite=cfg.overwrite,
                  defaults=to_dict(type(cfg)()), what="dpo")
    log.info("dpo: model %s; data %s; prompts <= %d tokens, responses <= %d; %s loss, beta %g; lr %g; "
             "%d pairs held out", model.spec, describe_data(cfg.data, len(train_idx) + len(eval_idx)),
             cfg.max_prompt_len, cfg.max_response_len, cfg.loss_type, cfg.beta, cfg.lr, len(eval_idx))
    warn_if_batch_exceeds_data("dpo", cfg.batch_size, len(train_idx), f"--{key_prefix}batch_size")
    return DPOPlan(cfg, model, enc, train_idx, eval_idx, eval_prompts, eval_ids)


@holds_run_folder("dpo")
def train(cfg: DPOConfig, plan: DPOPlan | None = None) -> dict:
    plan = plan or prepare(cfg)
    cfg = plan.cfg
    device = distributed.setup(cfg.device, to_dict(cfg), "dpo")  # torchrun: process group, same config everywhere
    start_stage_dir(Path(cfg.out) / "dpo", to_dict(cfg), resume=cfg.resume, overwrite=cfg.overwrite)
    # 0. setup: the policy and its reference (frozen copy, or LoRA disabled; sharded under torchrun),
    #    optimizer, resume
    torch.manual_seed(cfg.seed)
    lm, tokenizer = load_causal_lm(plan.model, device=device, gradient_checkpointing=cfg.gradient_checkpointing,
                                   qlora=cfg.qlora)
    policy = ActorCritic(lm, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, value_head=False)
    model = distributed.shard_model(policy, cfg.shard, device)
    distributed.seed_per_rank(cfg.seed)  # ranks sample different responses (true score)
    data, train_idx, eval_idx = Dataset.from_dict(plan.enc), plan.train_idx, plan.eval_idx
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    run = StageRun("dpo", cfg, model=policy, optimizer=optimizer)
    step, skipped = run.step, run.extra.get("skipped_nonfinite", 0)
    builtin = bool(plan.eval_prompts)

    def true_score() -> float:  # the built-in task's score of responses sampled for held-out prompts
        return evaluate_true_score(model, tokenizer, plan.eval_ids, plan.eval_prompts,
                                   max_new_tokens=cfg.max_new_tokens, temperature=1.0, device=device)

    true_before = run.extra.get("true_before")
    if builtin and not run.resumed:
        true_before = true_score()
        log.info("dpo: true score before DPO %.3f", true_before)
    pad_id = tokenizer.pad_token_id
    policy.train()
    shared_on = None  # whether the last batch shared its prompts (the log says when it changes)

    while step < run.stop:
        # 1. batch: B pairs (rank 0's draw; each rank its share) -> 2B rows, the chosen responses
        #    first, then the rejected ones
        idx = distributed.draw(train_idx, cfg.batch_size)
        rows = distributed.local_rows(data, idx)
        batch = pair_batch(rows, range(len(rows["prompt"])), pad_id).to(device)
        # 2-3. reference sums, then the policy's sums and the DPO loss in one fused pass (a mean over
        #      this rank's equal share: FSDP's gradient average makes it the global batch's mean)
        shared, saving = shared_pairs(batch, cfg.shared_prompt, device) if cfg.shared_prompt != "off" else (None, None)
        if saving is not None and saving.on != shared_on:
            log.info("dpo: %s (--shared_prompt %s)", saving.describe(), cfg.shared_prompt)
            shared_on = saving.on
        loss, stats = model.run(dpo_step_loss, batch, cfg, device, shared)
        # 4. update (warm-up, gradient clip); a non-finite loss or gradient skips the step
        if not guarded_step(optimizer, loss, trainable, step, lr=cfg.lr):
            skipped += 1
        step += 1
        run.window.append(dict(to_floats(stats), loss=loss.item()))
        run.advance(step, skipped, loss=f"{loss.item():.3f}", margin=f"{stats['reward_margin'].item():.3f}")
        # 5. log every log_every steps, and with the held-out accuracy every eval_every steps; checkpoint
        evaluate = run.due(step, cfg.eval_every)
        if evaluate or run.due(step, cfg.log_every):
            window = run.window
            row = {k: sum(w[k] for w in window) / len(window) for k in window[0]}
            row["skipped_nonfinite"] = skipped
            if evaluate:
                row["accuracy"] = heldout_accuracy(model, data, eval_idx, pad_id, device)
            run.log(step, row)
        if run.checkpoint_due(step):
            run.save(step, policy.trainable_state(), {"skipped_nonfinite": skipped, "true_before": true_before})

    if not run.finish(step):
        return {"stopped_at": step}
    state_bytes = distributed.state_bytes_summary(policy, optimizer)  # this rank's parameters, gradients, optimizer
    # 6. final policy (LoRA merged, written by rank 0), true score after, summary, plot
    distributed.export(policy, lambda: ActorCritic(empty_copy(lm), lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                                   value_head=False),
                       lambda m: m.save_pretrained(run.dir / "final", tokenizer, lineage=plan.model.lineage(cfg.data)))
    logged = run.rows()
    summary = {"steps": step, "seconds": run.seconds, "skipped_nonfinite": skipped,
               "loss_final": logged[-1]["loss"] if logged else None,
               "accuracy": logged[-1].get("accuracy") if logged else None, "eval_pairs": len(eval_idx),
               "reward_margin_final": logged[-1]["reward_margin"] if logged else None,
               "loss_type": cfg.loss_type, "beta": cfg.beta, "lora_rank": cfg.lora_rank,
               "device": str(device), "model_dir": str(run.dir / "final"), **state_bytes}
    if builtin:
        summary["true_score_before"] = true_before
        summary["true_score_after"] = true_score()
    run.write_summary(summary)
    run.plot(["loss", "reward_margin", "accuracy"], "dpo_curves.png")
    if builtin:
        log.info("dpo: done, true score %.3f -> %.3f, held-out accuracy %.3f", summary["true_score_before"],
                 summary["true_score_after"], summary["accuracy"])
    else:
        log.info("dpo: done, held-out accuracy %.3f on %d pairs", summary["accuracy"], len(eval_idx))
    return summary


def main(argv: list[str]) -> int:
    setup_logging()
    return run_cli(DPOConfig, argv, "fastrlhf dpo", distributed.entry(train))
