"""`fastrlhf sft`: causal-LM fine-tuning on (prompt, response) pairs, loss on response tokens only.

    loss = -mean over response tokens of log p(token | prefix)   (fastrlhf.ops.linear_logprobs)

`prepare` checks the whole configuration before the model loads (model files, tokenizer,
data, lengths, the run folder); `train` runs it. Writes OUT/sft/config.json, OUT/sft/final
(a Hugging Face model directory with its tokenizer), OUT/sft/checkpoints, rows with
"stage": "sft" in OUT/metrics.jsonl, OUT/summary.json["sft"] and OUT/plots/sft_loss.png.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from datasets import Dataset

from fastrlhf.train import distributed, task
from fastrlhf.train.checkpoint import check_run_dir
from fastrlhf.train.config import SFTConfig, run_cli, to_dict
from fastrlhf.train.data import (
    BUILTIN,
    Encoder,
    auto_lengths,
    builtin_table,
    load_table,
    pack,
    truncate_prompts,
    truncate_responses,
)
from fastrlhf.train.devices import autocast
from fastrlhf.train.heads import save_trained, with_lora
from fastrlhf.train.metrics import log, setup_logging
from fastrlhf.train.models import (
    ModelSource,
    check_qlora,
    empty_copy,
    hidden_states,
    load_causal_lm,
    model_source,
)
from fastrlhf.train.rollout import token_logprobs
from fastrlhf.train.run import (
    StageRun,
    check_common,
    describe_data,
    guarded_step,
    holds_run_folder,
    resolve_data,
    start_stage_dir,
    warn_if_batch_exceeds_data,
)

TINY_LR = 3e-3  # the built-in `tiny` model (random init, 0.9M parameters)
MODEL_LR = 5e-6  # any other model: OpenRLHF 0.11's train_sft default (--adam.lr)


@dataclasses.dataclass
class SFTPlan:
    """The SFT stage, checked and resolved before its model loads."""

    cfg: SFTConfig
    """The configuration with every `auto`/0 default resolved (what OUT/sft/config.json records)."""
    model: ModelSource
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]

    @property
    def produces(self) -> ModelSource:
        """The model this stage writes (OUT/sft/final), as the next stages will see it."""
        return self.model.descendant(Path(self.cfg.out) / "sft" / "final", self.cfg.data)


def prepare(cfg: SFTConfig, *, key_prefix: str = "") -> SFTPlan:
    """Check the whole configuration and resolve its defaults, loading no model weights."""
    cfg = dataclasses.replace(cfg)
    check_common(cfg, ("steps", "batch_size", "log_every", "save_every", "num_examples"), "sft", key_prefix)
    distributed.check_shard(cfg.shard, "sft")
    distributed.check_global_batch("sft", batch_size=cfg.batch_size)
    model = model_source(cfg.model, where="sft model")
    if cfg.qlora:
        check_qlora(model, cfg.lora_rank, "sft", key_prefix)
    cfg.data = resolve_data(cfg.data, model, "sft", f"--{key_prefix}data")
    builtin = cfg.data == BUILTIN
    if builtin:
        table = builtin_table(task.synthetic_sft(cfg.num_examples, cfg.seed))
    else:
        table = load_table(cfg.data, {"prompt": cfg.prompt_key, "response": cfg.response_key}, where="sft data",
                           key_prefix=key_prefix)
    prompts, responses = list(table["prompt"]), list(table["response"])
    encoder = Encoder(model.tokenizer, chat_template=cfg.chat_template, vocab_size=model.config.vocab_size)
    where = None if builtin else f"sft data: {cfg.data}"
    prompt_ids = encoder.prompts(prompts, where=where)
    response_ids = encoder.responses(prompts, prompt_ids, responses, warn_empty=not builtin, where=where)
    if builtin:
        cfg.max_prompt_len = cfg.max_prompt_len or task.MAX_PROMPT_LEN
        cfg.max_response_len = cfg.max_response_len or task.MAX_RESPONSE_LEN
    cfg.max_prompt_len, cfg.max_response_len = auto_lengths(
        max(map(len, prompt_ids)), max(map(len, response_ids)), model.max_positions,
        max_prompt_len=cfg.max_prompt_len, max_response_len=cfg.max_response_len, where="sft")
    prompt_ids = truncate_prompts(prompt_ids, cfg.max_prompt_len)
    response_ids = truncate_responses(response_ids, cfg.max_response_len)
    cfg.lr = cfg.lr or (TINY_LR if model.origin == "tiny" else MODEL_LR)
    check_run_dir(Path(cfg.out) / "sft", to_dict(cfg), resume=cfg.resume, overwrite=cfg.overwrite,
                  defaults=to_dict(type(cfg)()), what="sft")
    log.info("sft: model %s; data %s; prompts <= %d tokens, responses <= %d; lr %g; %s", model.spec,
             describe_data(cfg.data, len(prompts)), cfg.max_prompt_len, cfg.max_response_len, cfg.lr,
             "chat template" if encoder.uses_template else "plain prompt + response tokens")
    warn_if_batch_exceeds_data("sft", cfg.batch_size, len(prompts), f"--{key_prefix}batch_size")
    return SFTPlan(cfg, model, prompt_ids, response_ids)


def response_logprobs(lm, batch, device) -> torch.Tensor:
    """Log-probs [B, R] of the response tokens, straight from the hidden states."""
    with autocast(device):
        hidden = hidden_states(lm, batch.input_ids, batch.attention_mask, batch.position_ids)
    return token_logprobs(lm, batch, hidden)


@holds_run_folder("sft")
def train(cfg: SFTConfig, plan: SFTPlan | None = None) -> dict:
    plan = plan or prepare(cfg)
    cfg = plan.cfg
    device = distributed.setup(cfg.device, to_dict(cfg), "sft")  # torchrun: process group, same config everywhere
    stage_dir = Path(cfg.out) / "sft"
    start_stage_dir(stage_dir, to_dict(cfg), resume=cfg.resume, overwrite=cfg.overwrite)
    # 0. setup: model (sharded under torchrun), optimizer; resume from the latest checkpoint if asked
    torch.manual_seed(cfg.seed)
    lm, tokenizer = load_causal_lm(plan.model, device=device, gradient_checkpointing=cfg.gradient_checkpointing,
                                   qlora=cfg.qlora)
    lm = with_lora(lm, cfg.lora_rank, cfg.lora_alpha) if cfg.lora_rank else lm
    model = distributed.shard_model(lm, cfg.shard, device)
    data = Dataset.from_dict({"prompt_ids": plan.prompt_ids, "response_ids": plan.response_ids})
    trainable = {n: p for n, p in lm.named_parameters() if p.requires_grad}  # every weight, or the adapters
    optimizer = torch.optim.AdamW(trainable.values(), lr=cfg.lr, weight_decay=0.0)
    run = StageRun("sft", cfg, model=lm, optimizer=optimizer)
    step, skipped = run.step, run.extra.get("skipped_nonfinite", 0)
    lm.train()

    while step < run.stop:
        # 1. batch: random (prompt, response) pairs (rank 0's draw; each rank its share),
        #    prompts left-padded, responses right-padded
        idx = distributed.draw(range(len(data)), cfg.batch_size)
        rows = distributed.local_rows(data, idx)
        batch = pack(rows["prompt_ids"], rows["response_ids"], tokenizer.pad_token_id).to(device)
        # 2. forward: log-probs of the response tokens straight from the hidden states
        logp = model.run(response_logprobs, batch, device)
        # 3. loss: mean negative log-likelihood over the global batch's response tokens
        n_tokens = distributed.all_sum(batch.response_mask.sum()).to(logp.dtype)
        loss = -(logp * batch.response_mask).sum() / n_tokens
        # 4. update (warm-up, gradient clip); a non-finite loss or gradient skips the step
        if not guarded_step(optimizer, loss * distributed.loss_scale(), trainable.values(), step, lr=cfg.lr):
            skipped += 1
        step += 1
        loss_value = distributed.all_sum(loss.detach()).item()
        run.window.append(loss_value)
        run.advance(step, skipped, loss=f"{loss_value:.3f}")  # stops a diverged run; a signal ends the loop here
        # 5. log and checkpoint
        if run.due(step, cfg.log_every):
            run.log(step, {"loss": sum(run.window) / len(run.window), "lr": optimizer.param_groups[0]["lr"],
                           "skipped_nonfinite": skipped})
        if run.checkpoint_due(step):
            run.save(step, trainable, {"skipped_nonfinite": skipped})

    if not run.finish(step):
        return {"stopped_at": step}
    state_bytes = distributed.state_bytes_summary(lm, optimizer)  # this rank's parameters, gradients, optimizer
    # 6. final model (one Hugging Face directory, written by rank 0), summary, plot
    build = lambda: with_lora(empty_copy(lm), cfg.lora_rank, cfg.lora_alpha) if cfg.lora_rank else empty_copy(lm)  # noqa: E731
    distributed.export(lm, build, lambda m: save_trained(m, tokenizer, stage_dir / "final",
                                                         lineage=plan.model.lineage(cfg.data)))
    logged = run.rows()
    summary = {"loss_final": logged[-1]["loss"] if logged else None, "steps": step,
               "skipped_nonfinite": skipped, "seconds": run.seconds, "model_dir": str(stage_dir / "final"),
               **state_bytes}
    run.write_summary(summary)
    run.plot(["loss"], "sft_loss.png")
    log.info("sft: done, final loss %.4f, model in %s", summary["loss_final"] or float("nan"), stage_dir / "final")
    return summary


def main(argv: list[str]) -> int:
    setup_logging()
    return run_cli(SFTConfig, argv, "fastrlhf sft", distributed.entry(train))
