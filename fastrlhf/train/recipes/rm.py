"""`fastrlhf rm`: a Bradley-Terry reward model on (prompt, chosen, rejected), initialised from SFT.

    loss = -mean log sigmoid(r(prompt, chosen) - r(prompt, rejected))

r is a scalar head on the SFT model's trunk, read at the last response token (EOS).
Reports the held-out pairwise accuracy: the fraction of pairs with r(chosen) > r(rejected).
Pairs whose chosen and rejected responses are equal carry no preference: they are dropped,
with a warning that counts them.

`prepare` checks the whole configuration before the model loads; `train` runs it. Writes
OUT/rm/config.json, OUT/rm/final (model + tokenizer + score head), rows with "stage": "rm"
in OUT/metrics.jsonl, OUT/summary.json["rm"] and OUT/plots/rm_curves.png. The reward
functions PPO uses (this model, or a rule) are in fastrlhf/train/rewards.py.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from datasets import Dataset

from fastrlhf import ops
from fastrlhf.ops.gae import mean_var
from fastrlhf.train import distributed, task
from fastrlhf.train.checkpoint import check_run_dir
from fastrlhf.train.config import RMConfig, run_cli, to_dict
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
from fastrlhf.train.heads import RewardModel
from fastrlhf.train.metrics import log, setup_logging
from fastrlhf.train.models import ModelSource, check_qlora, empty_copy, load_causal_lm
from fastrlhf.train.run import (
    EVAL_BATCH_SIZE,
    StageRun,
    check_common,
    describe_data,
    guarded_step,
    holds_run_folder,
    resolve_data,
    stage_model,
    start_stage_dir,
    warn_if_batch_exceeds_data,
)

NORM_PAIRS = 1024  # training pairs whose scores set the normalisation
TINY_LR = 1e-3  # a model grown from the built-in `tiny`
MODEL_LR = 9e-6  # any other model: OpenRLHF 0.11's train_rm default (--adam.lr)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-mean log sigmoid(chosen - rejected) over pairs [B] (log-sigmoid, stable for large margins)."""
    if chosen.shape != rejected.shape:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} must match")
    return -F.logsigmoid(chosen.float() - rejected.float()).mean()


def pair_batch(enc: dict, idx: list[int], pad_id: int):
    """One batch of 2B sequences: the B chosen responses, then the B rejected ones."""
    prompts = [enc["prompt"][i] for i in idx]
    responses = [enc["chosen"][i] for i in idx] + [enc["rejected"][i] for i in idx]
    return pack(prompts + prompts, responses, pad_id)


def _pair_scores(model: RewardModel, enc: dict, idx, pad_id: int, device):
    """Scores of the chosen and of the rejected responses of the pairs `idx` of `enc`."""
    batch = pair_batch(enc, idx, pad_id).to(device)
    with autocast(device):
        scores = model(batch.input_ids, batch.attention_mask, batch.position_ids)
    return scores[: len(idx)], scores[len(idx):]


def _chunks(n: int) -> list[range]:
    return [range(i, min(n, i + EVAL_BATCH_SIZE)) for i in range(0, n, EVAL_BATCH_SIZE)]


@torch.no_grad()
def accuracy(model: distributed.ShardedModel, data: Dataset, idx: list[int], pad_id: int, device) -> float:
    """Fraction of the pairs `idx` (rows of `data`) with r(chosen) > r(rejected); each rank
    scores its share."""
    rows = distributed.local_rows(data, idx)

    def hits(rm: RewardModel) -> int:
        was_training = rm.training
        rm.eval()
        n = 0
        for part in _chunks(len(rows["prompt"])):
            chosen, rejected = _pair_scores(rm, rows, part, pad_id, device)
            n += int((chosen > rejected).sum())
        rm.train(was_training)
        return n

    return distributed.all_sum(model.run(hits, gathered=True)).item() / max(1, len(idx))


@torch.no_grad()
def score_stats(model: distributed.ShardedModel, data: Dataset, idx: list[int], pad_id: int,
                device) -> tuple[float, float]:
    """Mean and standard deviation of the scores of the chosen and rejected responses of `idx`."""
    rows = distributed.local_rows(data, idx)

    def scores(rm: RewardModel) -> torch.Tensor:
        rm.eval()
        parts = [torch.cat(_pair_scores(rm, rows, part, pad_id, device)) for part in _chunks(len(rows["prompt"]))]
        return torch.cat(parts) if parts else torch.zeros(0, device=device)  # a rank may get no rows

    mean, std = mean_and_std(model.run(scores, gathered=True))
    return mean, max(std, 1e-6)


def mean_and_std(values: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased standard deviation of `values` on every rank together."""
    if not distributed.active():
        return values.mean().item(), values.std().item()
    mean, var = mean_var(distributed.all_sum(ops.raw_moments(values, torch.ones_like(values))), unbiased=True)
    return mean.item(), var.sqrt().item()


@dataclasses.dataclass
class RMPlan:
    """The RM stage, checked and resolved before its model loads."""

    cfg: RMConfig
    """The configuration with every `auto`/0 default resolved (what OUT/rm/config.json records)."""
    model: ModelSource
    enc: dict[str, list[list[int]]]
    """Token ids of "prompt", "chosen" and "rejected", one entry per pair."""
    train_idx: list[int]
    eval_idx: list[int]

    @property
    def produces(self) -> ModelSource:
        """The reward model this stage writes (OUT/rm/final)."""
        return self.model.descendant(Path(self.cfg.out) / "rm" / "final", self.cfg.data)


def prepare_pairs(cfg, model: ModelSource, stage: str, key_prefix: str = ""):
    """The preference pairs of the rm and dpo stages, checked and tokenized: resolves cfg.data and
    the lengths (cfg is changed in place). Returns (enc, train_idx, eval_idx): token ids of
    "prompt", "chosen" and "rejected" per pair, and a seeded split holding out eval_fraction
    (in (0, 1): run.check_common)."""
    cfg.data = resolve_data(cfg.data, model, stage, f"--{key_prefix}data")
    builtin = cfg.data == BUILTIN
    if builtin:
        table = builtin_table(task.synthetic_pairs(cfg.num_pairs, cfg.seed))
    else:
        columns = {"prompt": cfg.prompt_key, "chosen": cfg.chosen_key, "rejected": cfg.rejected_key}
        table = load_table(cfg.data, columns, where=f"{stage} data", key_prefix=key_prefix)
    rows = {k: list(table[k]) for k in ("prompt", "chosen", "rejected")}
    ties = [i for i, (c, r) in enumerate(zip(rows["chosen"], rows["rejected"])) if c == r]
    if ties:
        warnings.warn(f"{stage}: {len(ties)} of {len(rows['prompt'])} pairs have chosen == rejected (first: row "
                      f"{ties[0]}); they carry no preference and are dropped", stacklevel=2)
        keep = sorted(set(range(len(rows["prompt"]))) - set(ties))
        rows = {k: [v[i] for i in keep] for k, v in rows.items()}
    n = len(rows["prompt"])
    n_eval = max(1, int(n * cfg.eval_fraction))
    if n_eval >= n:
        raise ValueError(f"{stage}: eval_fraction={cfg.eval_fraction} leaves no training pairs out of {n}")
    encoder = Encoder(model.tokenizer, chat_template=cfg.chat_template, vocab_size=model.config.vocab_size)
    where = None if builtin else f"{stage} data: {cfg.data}"
    enc = {"prompt": encoder.prompts(rows["prompt"], where=where)}
    for k in ("chosen", "rejected"):
        enc[k] = encoder.responses(rows["prompt"], enc["prompt"], rows[k], what=f"{k} responses",
                                   warn_empty=not builtin, where=where)
    if builtin:
        cfg.max_prompt_len = cfg.max_prompt_len or task.MAX_PROMPT_LEN
        cfg.max_response_len = cfg.max_response_len or task.MAX_RESPONSE_LEN
    cfg.max_prompt_len, cfg.max_response_len = auto_lengths(
        max(map(len, enc["prompt"])), max(map(len, enc["chosen"] + enc["rejected"])), model.max_positions,
        max_prompt_len=cfg.max_prompt_len, max_response_len=cfg.max_response_len, where=stage)
    enc["prompt"] = truncate_prompts(enc["prompt"], cfg.max_prompt_len)
    for k in ("chosen", "rejected"):
        enc[k] = truncate_responses(enc[k], cfg.max_response_len, what=f"{k} responses")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    return enc, order[n_eval:], order[:n_eval]


def prepare(cfg: RMConfig, *, upstream: ModelSource | None = None, key_prefix: str = "") -> RMPlan:
    """Check the whole configuration and resolve its defaults, loading no model weights.
    `upstream`: the SFT model a pipeline will have written by the time this stage runs."""
    cfg = dataclasses.replace(cfg)
    check_common(cfg, ("steps", "batch_size", "log_every", "save_every", "eval_every", "num_pairs"), "rm", key_prefix)
    distributed.check_shard(cfg.shard, "rm")
    distributed.check_global_batch("rm", batch_size=cfg.batch_size)
    model = stage_model(cfg.model, Path(cfg.out) / "sft" / "final", upstream, "rm", "sft")
    cfg.model = model.spec
    if cfg.qlora:
        check_qlora(model, cfg.lora_rank, "rm", key_prefix)
    enc, train_idx, eval_idx = prepare_pairs(cfg, model, "rm", key_prefix)
    cfg.lr = cfg.lr or (TINY_LR if model.origin == "tiny" else MODEL_LR)
    check_run_dir(Path(cfg.out) / "rm", to_dict(cfg), resume=cfg.resume, overwrite=cfg.overwrite,
                  defaults=to_dict(type(cfg)()), what="rm")
    log.info("rm: model %s; data %s; prompts <= %d tokens, responses <= %d; lr %g; %d pairs held out",
             model.spec, describe_data(cfg.data, len(train_idx) + len(eval_idx)), cfg.max_prompt_len,
             cfg.max_response_len, cfg.lr, len(eval_idx))
    warn_if_batch_exceeds_data("rm", cfg.batch_size, len(train_idx), f"--{key_prefix}batch_size")
    return RMPlan(cfg, model, enc, train_idx=train_idx, eval_idx=eval_idx)


@holds_run_folder("rm")
def train(cfg: RMConfig, plan: RMPlan | None = None) -> dict:
    plan = plan or prepare(cfg)
    cfg = plan.cfg
    device = distributed.setup(cfg.device, to_dict(cfg), "rm")  # torchrun: process group, same config everywhere
    stage_dir = Path(cfg.out) / "rm"
    start_stage_dir(stage_dir, to_dict(cfg), resume=cfg.resume, overwrite=cfg.overwrite)
    # 0. setup: SFT model + score head (sharded under torchrun), optimizer, resume
    torch.manual_seed(cfg.seed)
    lm, tokenizer = load_causal_lm(plan.model, device=device, gradient_checkpointing=cfg.gradient_checkpointing,
                                   qlora=cfg.qlora)
    model = RewardModel(lm, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha)
    sharded = distributed.shard_model(model, cfg.shard, device)
    data, train_idx, eval_idx = Dataset.from_dict(plan.enc), plan.train_idx, plan.eval_idx
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}  # every weight, or adapters + head
    optimizer = torch.optim.AdamW(trainable.values(), lr=cfg.lr, weight_decay=0.0)
    run = StageRun("rm", cfg, model=model, optimizer=optimizer)
    step, skipped = run.step, run.extra.get("skipped_nonfinite", 0)
    pad_id = tokenizer.pad_token_id
    model.train()

    while step < run.stop:
        # 1. batch of pairs (rank 0's draw; each rank its share): chosen and rejected for the
        #    same prompts, scored in one forward
        idx = distributed.draw(train_idx, cfg.batch_size)
        rows = distributed.local_rows(data, idx)
        chosen, rejected = sharded.run(_pair_scores, rows, range(len(rows["prompt"])), pad_id, device)
        # 2. Bradley-Terry loss (a mean over this rank's equal share: FSDP's gradient average
        #    over ranks makes it the global batch's mean)
        loss = bradley_terry_loss(chosen, rejected)
        # 3. update (warm-up, gradient clip); a non-finite loss or gradient skips the step
        if not guarded_step(optimizer, loss, trainable.values(), step, lr=cfg.lr):
            skipped += 1
        step += 1
        run.window.append((loss.item(), (chosen > rejected).float().mean().item()))
        run.advance(step, skipped, loss=f"{loss.item():.3f}")  # stops a diverged run; a signal ends the loop here
        # 4. log every log_every steps, and with the held-out accuracy every eval_every steps; checkpoint
        evaluate = run.due(step, cfg.eval_every)
        if evaluate or run.due(step, cfg.log_every):
            window = run.window
            stats = {"loss": sum(w[0] for w in window) / len(window),
                     "train_accuracy": sum(w[1] for w in window) / len(window), "skipped_nonfinite": skipped}
            if evaluate:
                stats["accuracy"] = accuracy(sharded, data, eval_idx, pad_id, device)
            run.log(step, stats)
        if run.checkpoint_due(step):
            run.save(step, trainable, {"skipped_nonfinite": skipped})

    if not run.finish(step):
        return {"stopped_at": step}
    state_bytes = distributed.state_bytes_summary(model, optimizer)  # this rank's parameters, gradients, optimizer
    # 5. normalise the scores to mean 0, std 1 on training responses (Ziegler et al. 2019), so the
    #    PPO stage's KL coefficient and value targets have a known scale; pairwise order is unchanged
    norm_idx = train_idx[:NORM_PAIRS]
    mean, std = score_stats(sharded, data, norm_idx, pad_id, device)
    model.normalize_(mean, std)
    # 6. final model (written by rank 0), held-out accuracy, summary, plot
    build = lambda: RewardModel(empty_copy(lm), lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha)  # noqa: E731
    distributed.export(model, build, lambda m: m.save_pretrained(
        run.dir / "final", tokenizer, lineage=dict(plan.model.lineage(cfg.data), max_prompt_len=cfg.max_prompt_len,
                                                   max_response_len=cfg.max_response_len,
                                                   chat_template=cfg.chat_template)))
    logged = run.rows()
    summary = {"accuracy": logged[-1]["accuracy"], "eval_pairs": len(eval_idx),
               "loss_final": logged[-1]["loss"] if logged else None, "steps": step,
               "skipped_nonfinite": skipped, "seconds": run.seconds,
               "score_mean_before_normalisation": mean, "score_std_before_normalisation": std, **state_bytes,
               "model_dir": str(run.dir / "final")}
    run.write_summary(summary)
    run.plot(["loss", "accuracy"], "rm_curves.png")
    log.info("rm: done, held-out accuracy %.3f on %d pairs", summary["accuracy"], len(eval_idx))
    return summary


def main(argv: list[str]) -> int:
    setup_logging()
    return run_cli(RMConfig, argv, "fastrlhf rm", distributed.entry(train))
