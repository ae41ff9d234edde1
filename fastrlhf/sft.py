"""`fastrlhf sft`: causal-LM fine-tuning on (prompt, response) pairs, loss on response tokens only.

    loss = -mean over response tokens of log p(token | prefix)   (fastrlhf.ops.linear_logprobs)

Writes OUT/sft/final (a Hugging Face model directory with its tokenizer), OUT/sft/checkpoints,
rows with "stage": "sft" in OUT/metrics.jsonl, OUT/summary.json["sft"] and OUT/plots/sft_loss.png.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from fastrlhf.config import SFTConfig, run_cli
from fastrlhf.data import encode_prompts, encode_responses, pack, read_jsonl, synthetic_sft
from fastrlhf.metrics import RunLogger, guarded_step, log, plot_curves, progress, setup_logging, update_summary
from fastrlhf.models import (
    autocast,
    hidden_states,
    load_causal_lm,
    resolve_device,
    resume_from_checkpoint,
    save_checkpoint,
    save_model_dir,
)
from fastrlhf.rollout import token_logprobs

WARMUP_STEPS = 10


def train(cfg: SFTConfig) -> dict:
    # 0. setup: device, model, data, optimizer; resume from the latest checkpoint if asked
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    out, stage_dir = Path(cfg.out), Path(cfg.out) / "sft"
    lm, tokenizer = load_causal_lm(cfg.model, device=device, gradient_checkpointing=cfg.gradient_checkpointing)
    rows = read_jsonl(cfg.data, ("prompt", "response")) if cfg.data else synthetic_sft(cfg.num_examples, cfg.seed)
    prompt_ids = encode_prompts(tokenizer, [r["prompt"] for r in rows], cfg.max_prompt_len)
    response_ids = encode_responses(tokenizer, [r["response"] for r in rows], cfg.max_response_len)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=cfg.lr, weight_decay=0.0)
    step, skipped = 0, 0
    resumed = resume_from_checkpoint(stage_dir, lm, optimizer, cfg.resume, "sft")
    if resumed is not None:
        step, skipped = resumed[0], resumed[1]["skipped_nonfinite"]
    logger = RunLogger(out, "sft", resume_step=step if resumed else None, tensorboard=cfg.tensorboard)
    stop = cfg.steps if cfg.stop_after <= 0 else min(cfg.steps, step + cfg.stop_after)
    bar = progress(cfg.steps, step, "sft")
    window, start = [], time.perf_counter()
    lm.train()

    while step < stop:
        # 1. batch: random (prompt, response) pairs, prompts left-padded, responses right-padded
        idx = torch.randint(len(rows), (cfg.batch_size,)).tolist()
        batch = pack([prompt_ids[i] for i in idx], [response_ids[i] for i in idx], tokenizer.pad_token_id)
        batch = batch.to(device)
        # 2. forward: log-probs of the response tokens straight from the hidden states
        with autocast(device):
            hidden = hidden_states(lm, batch.input_ids, batch.attention_mask, batch.position_ids)
        logp = token_logprobs(lm, batch, hidden)
        # 3. loss: mean negative log-likelihood over response tokens
        loss = -(logp * batch.response_mask).sum() / batch.response_mask.sum()
        # 4. update (warm-up, gradient clip); a non-finite loss or gradient skips the step
        if not guarded_step(optimizer, loss, lm.parameters(), step, lr=cfg.lr, warmup_steps=WARMUP_STEPS):
            skipped += 1
        step += 1
        window.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        # 5. log and checkpoint
        if step % cfg.log_every == 0 or step == stop:
            logger.log(step, {"loss": sum(window) / len(window), "lr": optimizer.param_groups[0]["lr"],
                              "skipped_nonfinite": skipped})
            window = []
        if step % cfg.save_every == 0 or step == stop:
            save_checkpoint(stage_dir, step, dict(lm.named_parameters()), optimizer,
                            {"skipped_nonfinite": skipped})

    bar.close()
    logger.close()
    if step < cfg.steps:
        log.info("sft: stopped after step %d of %d (resume with --resume)", step, cfg.steps)
        return {"stopped_at": step}
    # 6. final model, summary, plot
    save_model_dir(lm, tokenizer, stage_dir / "final")
    logged = logger.rows()
    summary = {"loss_final": logged[-1]["loss"] if logged else float("nan"), "steps": step,
               "skipped_nonfinite": skipped, "seconds": time.perf_counter() - start,
               "model_dir": str(stage_dir / "final")}
    update_summary(out, "sft", summary)
    plot_curves(out, "sft", ["loss"], "sft_loss.png")
    log.info("sft: done, final loss %.4f, model in %s", summary["loss_final"], stage_dir / "final")
    return summary


def main(argv: list[str]) -> int:
    setup_logging()
    return run_cli(SFTConfig, argv, "fastrlhf sft", train)
