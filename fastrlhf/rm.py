"""`fastrlhf rm`: a Bradley-Terry reward model on (prompt, chosen, rejected), initialised from SFT.

    loss = -mean log sigmoid(r(prompt, chosen) - r(prompt, rejected))

r is a scalar head on the SFT model's trunk, read at the last response token (EOS).
Reports the held-out pairwise accuracy: the fraction of pairs with r(chosen) > r(rejected).
Writes OUT/rm/final (model + tokenizer + score head), rows with "stage": "rm" in
OUT/metrics.jsonl, OUT/summary.json["rm"] and OUT/plots/rm_curves.png.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from fastrlhf.config import RMConfig, run_cli
from fastrlhf.data import encode_prompts, encode_responses, pack, read_jsonl
from fastrlhf.devices import autocast, resolve_device
from fastrlhf.heads import RewardModel
from fastrlhf.metrics import log, setup_logging
from fastrlhf.models import load_causal_lm
from fastrlhf.run import EVAL_BATCH_SIZE, StageRun, guarded_step
from fastrlhf.task import synthetic_pairs

NORM_PAIRS = 1024  # training pairs whose scores set the normalisation


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-mean log sigmoid(chosen - rejected) over pairs [B] (log-sigmoid, stable for large margins)."""
    if chosen.shape != rejected.shape:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} must match")
    return -F.logsigmoid(chosen.float() - rejected.float()).mean()


def _pair_batch(enc: dict, idx: list[int], pad_id: int):
    """One batch of 2B sequences: the B chosen responses, then the B rejected ones."""
    prompts = [enc["prompt"][i] for i in idx]
    responses = [enc["chosen"][i] for i in idx] + [enc["rejected"][i] for i in idx]
    return pack(prompts + prompts, responses, pad_id)


def _pair_scores(model: RewardModel, enc: dict, idx: list[int], pad_id: int, device):
    batch = _pair_batch(enc, idx, pad_id).to(device)
    with autocast(device):
        scores = model(batch.input_ids, batch.attention_mask, batch.position_ids)
    return scores[: len(idx)], scores[len(idx):]


@torch.no_grad()
def accuracy(model: RewardModel, enc: dict, idx: list[int], pad_id: int, device) -> float:
    """Fraction of pairs with r(chosen) > r(rejected)."""
    was_training = model.training
    model.eval()
    hits = 0
    for i in range(0, len(idx), EVAL_BATCH_SIZE):
        chosen, rejected = _pair_scores(model, enc, idx[i:i + EVAL_BATCH_SIZE], pad_id, device)
        hits += int((chosen > rejected).sum())
    model.train(was_training)
    return hits / max(1, len(idx))


@torch.no_grad()
def score_stats(model: RewardModel, enc: dict, idx: list[int], pad_id: int, device) -> tuple[float, float]:
    """Mean and standard deviation of the scores of the chosen and rejected responses of `idx`."""
    model.eval()
    scores = torch.cat([torch.cat(_pair_scores(model, enc, idx[i:i + EVAL_BATCH_SIZE], pad_id, device))
                        for i in range(0, len(idx), EVAL_BATCH_SIZE)])
    return scores.mean().item(), scores.std().clamp(min=1e-6).item()


def train(cfg: RMConfig) -> dict:
    # 0. setup: SFT model + score head, pairs split into train / held-out, optimizer, resume
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    lm, tokenizer = load_causal_lm(cfg.model or Path(cfg.out) / "sft" / "final", device=device,
                                   gradient_checkpointing=cfg.gradient_checkpointing)
    model = RewardModel(lm)
    keys = ("prompt", "chosen", "rejected")
    rows = read_jsonl(cfg.data, keys) if cfg.data else synthetic_pairs(cfg.num_pairs, cfg.seed)
    enc = {"prompt": encode_prompts(tokenizer, [r["prompt"] for r in rows], cfg.max_prompt_len)}
    for k in ("chosen", "rejected"):
        enc[k] = encode_responses(tokenizer, [r[k] for r in rows], cfg.max_response_len)
    n_eval = max(1, int(len(rows) * cfg.eval_fraction))
    if n_eval >= len(rows):
        raise ValueError(f"eval_fraction={cfg.eval_fraction} leaves no training pairs out of {len(rows)}")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    eval_idx, train_idx = order[:n_eval], order[n_eval:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    run = StageRun("rm", cfg, model=model, optimizer=optimizer)
    step, skipped = run.step, run.extra.get("skipped_nonfinite", 0)
    window = []
    pad_id = tokenizer.pad_token_id
    model.train()

    while step < run.stop:
        # 1. batch of pairs: chosen and rejected for the same prompts, scored in one forward
        idx = [train_idx[i] for i in torch.randint(len(train_idx), (cfg.batch_size,)).tolist()]
        chosen, rejected = _pair_scores(model, enc, idx, pad_id, device)
        # 2. Bradley-Terry loss
        loss = bradley_terry_loss(chosen, rejected)
        # 3. update (warm-up, gradient clip); a non-finite loss or gradient skips the step
        if not guarded_step(optimizer, loss, model.parameters(), step, lr=cfg.lr):
            skipped += 1
        step += 1
        window.append((loss.item(), (chosen > rejected).float().mean().item()))
        run.advance(loss=f"{loss.item():.3f}")
        # 4. log (with the held-out accuracy every eval_every steps) and checkpoint
        if run.due(step, cfg.log_every):
            stats = {"loss": sum(w[0] for w in window) / len(window),
                     "train_accuracy": sum(w[1] for w in window) / len(window), "skipped_nonfinite": skipped}
            if run.due(step, cfg.eval_every):
                stats["accuracy"] = accuracy(model, enc, eval_idx, pad_id, device)
            run.log(step, stats)
            window = []
        if run.due(step, cfg.save_every):
            run.save(step, dict(model.named_parameters()), {"skipped_nonfinite": skipped})

    if not run.finish(step):
        return {"stopped_at": step}
    # 5. normalise the scores to mean 0, std 1 on training responses (Ziegler et al. 2019), so the
    #    PPO stage's KL coefficient and value targets have a known scale; pairwise order is unchanged
    norm_idx = train_idx[:NORM_PAIRS]
    mean, std = score_stats(model, enc, norm_idx, pad_id, device)
    model.normalize_(mean, std)
    # 6. final model, held-out accuracy, summary, plot
    model.save_pretrained(run.dir / "final", tokenizer)
    logged = run.rows()
    summary = {"accuracy": logged[-1]["accuracy"], "eval_pairs": len(eval_idx),
               "loss_final": logged[-1]["loss"] if logged else float("nan"), "steps": step,
               "skipped_nonfinite": skipped, "seconds": run.seconds,
               "score_mean_before_normalisation": mean, "score_std_before_normalisation": std,
               "model_dir": str(run.dir / "final")}
    run.write_summary(summary)
    run.plot(["loss", "accuracy"], "rm_curves.png")
    log.info("rm: done, held-out accuracy %.3f on %d pairs", summary["accuracy"], len(eval_idx))
    return summary


def main(argv: list[str]) -> int:
    setup_logging()
    return run_cli(RMConfig, argv, "fastrlhf rm", train)
