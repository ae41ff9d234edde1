"""`fastrlhf sft`: causal-LM fine-tuning on (prompt, response) pairs, loss on response tokens only.

    loss = -mean over response tokens of log p(token | prefix)   (fastrlhf.ops.linear_logprobs)

Writes OUT/sft/final (a Hugging Face model directory with its tokenizer), OUT/sft/checkpoints,
rows with "stage": "sft" in OUT/metrics.jsonl, OUT/summary.json["sft"] and OUT/plots/sft_loss.png.
"""

from __future__ import annotations

import torch

from fastrlhf.checkpoint import save_model_dir
from fastrlhf.config import SFTConfig, run_cli
from fastrlhf.data import encode_prompts, encode_responses, pack, read_jsonl
from fastrlhf.devices import autocast, resolve_device
from fastrlhf.metrics import log, setup_logging
from fastrlhf.models import hidden_states, load_causal_lm
from fastrlhf.rollout import token_logprobs
from fastrlhf.run import StageRun, guarded_step
from fastrlhf.task import synthetic_sft


def train(cfg: SFTConfig) -> dict:
    # 0. setup: device, model, data, optimizer; resume from the latest checkpoint if asked
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    lm, tokenizer = load_causal_lm(cfg.model, device=device, gradient_checkpointing=cfg.gradient_checkpointing)
    rows = read_jsonl(cfg.data, ("prompt", "response")) if cfg.data else synthetic_sft(cfg.num_examples, cfg.seed)
    prompt_ids = encode_prompts(tokenizer, [r["prompt"] for r in rows], cfg.max_prompt_len)
    response_ids = encode_responses(tokenizer, [r["response"] for r in rows], cfg.max_response_len)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=cfg.lr, weight_decay=0.0)
    run = StageRun("sft", cfg, model=lm, optimizer=optimizer)
    step, skipped = run.step, run.extra.get("skipped_nonfinite", 0)
    window = []
    lm.train()

    while step < run.stop:
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
        if not guarded_step(optimizer, loss, lm.parameters(), step, lr=cfg.lr):
            skipped += 1
        step += 1
        window.append(loss.item())
        run.advance(loss=f"{loss.item():.3f}")
        # 5. log and checkpoint
        if run.due(step, cfg.log_every):
            run.log(step, {"loss": sum(window) / len(window), "lr": optimizer.param_groups[0]["lr"],
                           "skipped_nonfinite": skipped})
            window = []
        if run.due(step, cfg.save_every):
            run.save(step, dict(lm.named_parameters()), {"skipped_nonfinite": skipped})

    if not run.finish(step):
        return {"stopped_at": step}
    # 6. final model, summary, plot
    save_model_dir(lm, tokenizer, run.dir / "final")
    logged = run.rows()
    summary = {"loss_final": logged[-1]["loss"] if logged else float("nan"), "steps": step,
               "skipped_nonfinite": skipped, "seconds": run.seconds, "model_dir": str(run.dir / "final")}
    run.write_summary(summary)
    run.plot(["loss"], "sft_loss.png")
    log.info("sft: done, final loss %.4f, model in %s", summary["loss_final"], run.dir / "final")
    return summary


def main(argv: list[str]) -> int:
    setup_logging()
    return run_cli(SFTConfig, argv, "fastrlhf sft", train)
