"""`fastrlhf distill`: knowledge distillation of a teacher into a (smaller) student, the serving-cost lever
of an RLHF-tuned model (train the small model to do what the tuned one does).

    loss = mean over response tokens of D(teacher || student)      (fastrlhf.linear_distill_loss)

D is TRL's generalized JSD (`--beta`: 0 forward KL(teacher || student), 1 reverse KL(student || teacher),
between the JSD with mixture (1 - beta) student + beta teacher), from both models' hidden states and
lm_heads, never holding [N, V] logits of either. Each step, top to bottom:
  1. batch      offline: B (prompt, response) pairs of the data (the SFT format), prompts left-padded;
                on-policy: B prompts, each answered by the student (the rollout path, fastrlhf.train.rollout,
                from softmax(logits / temperature); `--rollout_engine graph`: PPO's decode engine), as TRL's
                DistillationTrainer and GKD (lambda 1)
  2. teacher    the teacher's final hidden states at the response positions (no gradient)
  3. loss       the student's hidden states; ops.linear_distill_loss over the response tokens, divided by
                their global count (TRL's num_items_in_batch)
  4. update     warm-up, gradient clipping; a non-finite loss or gradient skips the step
  5. log        loss, the student's entropy, tokens/s (on-policy on the built-in task: the samples' true
                score); checkpoint every save_every steps
The student trains every weight or LoRA adapters (`--lora_rank`); under torchrun both models are sharded
with FSDP2 under one root. On the built-in task the true score of sampled responses is measured for the
teacher and for the student before and after.

`prepare` checks the whole configuration before a model loads (both models, their shared vocabulary, the
data, lengths, the run folder); `train` runs it. Writes OUT/distill/config.json, OUT/distill/final (the
student, LoRA merged), OUT/distill/checkpoints, rows with "stage": "distill" in OUT/metrics.jsonl,
OUT/summary.json["distill"] and OUT/plots/distill_curves.png.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
from datasets import Dataset
from torch import nn

from fastrlhf import ops
from fastrlhf.train import distributed, task
from fastrlhf.train.checkpoint import check_run_dir
from fastrlhf.train.config import DistillConfig, run_cli, to_dict
from fastrlhf.train.data import (
    BUILTIN,
    Batch,
    Encoder,
    auto_lengths,
    load_table,
    pack,
    truncate_prompts,
    truncate_responses,
)
from fastrlhf.train.devices import autocast
from fastrlhf.train.heads import is_4bit, save_trained, with_lora
from fastrlhf.train.metrics import log, setup_logging
from fastrlhf.train.models import (
    ModelSource,
    check_qlora,
    empty_copy,
    hidden_states,
    lm_head,
    load_causal_lm,
    model_source,
    parameter_count,
    same_encoding,
)
from fastrlhf.train.recipes.ppo import AUTO_MAX_NEW_TOKENS
from fastrlhf.train.rollout import ROLLOUT_ENGINES, engine_generate, generate, make_engine
from fastrlhf.train.run import (
    Range,
    StageRun,
    check_common,
    describe_data,
    evaluate_true_score,
    guarded_step,
    holds_run_folder,
    resolve_data,
    start_stage_dir,
    warn_if_batch_exceeds_data,
)

MODES = ("offline", "on_policy")
TINY_LR = 3e-3  # a student grown from a built-in config (random init, < 1M parameters)
TINY_ORIGINS = ("tiny", "tiny-student")
MODEL_LR = 1e-6  # any other student, full fine-tuning: TRL 1.16's DistillationConfig default (learning_rate)
LORA_LR = 1e-4  # any other student with LoRA adapters


class Distiller(nn.Module):
    """The student (trained: every weight, or LoRA adapters) and the frozen teacher under one root, so one
    FSDP root owns both (distributed.shard_model). `policy` is the model the true score samples from: the
    student, or the teacher while `scoring_teacher`."""

    def __init__(self, student, teacher, *, lora_rank: int = 0, lora_alpha: float = 32.0):
        super().__init__()
        self.lora = lora_rank > 0
        if is_4bit(student) and not self.lora:
            raise ValueError("a 4-bit (--qlora) student trains LoRA adapters: lora_rank must be > 0")
        if self.lora:
            student = with_lora(student, lora_rank, lora_alpha)
        self.student = student
        self.teacher = teacher.eval().requires_grad_(False)
        self.scoring_teacher = False

    @property
    def policy(self) -> nn.Module:
        return self.teacher if self.scoring_teacher else self.student

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.eval()  # the teacher never trains (no dropout)
        return self

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def save_student(self, path: Path, tokenizer, lineage: dict) -> None:
        """The student as a plain HF directory (LoRA merged), loadable with `--model`."""
        save_trained(self.student, tokenizer, path, None, lineage)


def logit_transform(lm) -> tuple[float, float | None]:
    """(logit scale, final softcap) the model applies to its logits, as TRL's DistillationTrainer reads them:
    Cohere's `logit_scale`, Gemma's `final_logit_softcapping`."""
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    scale = getattr(config, "logit_scale", None)
    return (1.0 if scale is None else float(scale)), getattr(config, "final_logit_softcapping", None)


def distill_step_loss(pair: Distiller, batch: Batch, cfg: DistillConfig, device, n_tokens: torch.Tensor):
    """Steps 2-3: (loss, stats) of the response tokens of `batch`, divided by `n_tokens` (their count over
    every rank): the teacher's hidden states without gradient, the student's with, and the fused divergence."""
    P = batch.prompt_len
    args = (batch.input_ids, batch.attention_mask, batch.position_ids)
    with torch.no_grad(), autocast(device):
        t_hidden = hidden_states(pair.teacher, *args)[:, P - 1:-1]
    with autocast(device):
        s_hidden = hidden_states(pair.student, *args)[:, P - 1:-1]
    s_head, t_head = lm_head(pair.student), lm_head(pair.teacher)
    s_scale, s_cap = logit_transform(pair.student)
    t_scale, t_cap = logit_transform(pair.teacher)
    cast = lambda t, h: None if t is None else t.to(h.dtype)  # noqa: E731
    return ops.linear_distill_loss(
        s_hidden, cast(s_head.weight, s_hidden), t_hidden, cast(t_head.weight, t_hidden), batch.response_mask,
        beta=cfg.beta, temperature=cfg.temperature, student_bias=cast(s_head.bias, s_hidden),
        teacher_bias=cast(t_head.bias, t_hidden), student_logit_scale=s_scale, teacher_logit_scale=t_scale,
        student_softcap=s_cap, teacher_softcap=t_cap, global_num_tokens=n_tokens)


def sample(pair: Distiller, tokenizer, rows: dict, cfg: DistillConfig, device, engine=None) -> Batch:
    """Step 1 on-policy: one response of the student to each prompt of `rows`, from the decode engine when
    there is one (it re-forms its weights from the student first), else from `generate`."""
    if engine is not None:
        return engine_generate(engine, pair.student, tokenizer, rows["prompt_ids"], rows["prompt"]).batch
    return generate(pair.student, tokenizer, rows["prompt_ids"], rows["prompt"], max_new_tokens=cfg.max_response_len,
                    temperature=cfg.temperature, device=device).batch


def n_params(lm) -> int:
    return parameter_count(lm)


# ---------------------------------------------------------------- checks before a model loads


@dataclasses.dataclass
class DistillPlan:
    """The distillation stage, checked and resolved before its models load."""

    cfg: DistillConfig
    """The configuration with every `auto`/0 default resolved (what OUT/distill/config.json records)."""
    student: ModelSource
    teacher: ModelSource
    prompts: list[str]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]] | None
    """Offline: the responses' token ids; on-policy: None (the student samples them)."""
    eval_prompts: list[str]
    """Built-in task only: held-out prompts for the true score (empty for user data)."""
    eval_ids: list[list[int]]


def _model(spec: str, default: Path, upstream: ModelSource | None, what: str, key: str, made_by: str) -> ModelSource:
    """The model of `spec`, else what the pipeline's earlier stage will write (`upstream`), else the one
    already at `default`; an error names the key to pass."""
    if spec:
        return model_source(spec, where=f"distill {what}")
    if upstream is not None:
        return upstream
    if not default.is_dir():
        raise ValueError(f"distill: no {what} given and {default} does not exist; pass {key} (a model directory or "
                         f"a built-in config), or run {made_by} with the same --out first")
    return model_source(default, where=f"distill {what}")


def check_vocabulary(student: ModelSource, teacher: ModelSource, chat_template: bool) -> None:
    """The teacher scores the student's tokens: one vocabulary, one encoding, one lm_head size."""
    vs, vt = student.config.vocab_size, teacher.config.vocab_size
    if vs != vt:
        raise ValueError(f"distill: the student {student.spec} has {vs} vocabulary rows (lm_head) and the teacher "
                         f"{teacher.spec} {vt}; distillation compares their next-token distributions token by token, "
                         "so they must share a vocabulary (resize one: model.resize_token_embeddings)")
    if not same_encoding(Encoder(student.tokenizer, chat_template=chat_template),
                         Encoder(teacher.tokenizer, chat_template=chat_template)):
        raise ValueError(f"distill: the student {student.spec} and the teacher {teacher.spec} encode text differently "
                         "(vocabulary, special tokens or chat template); the teacher must score the student's tokens")


def _data(cfg: DistillConfig, key_prefix: str) -> tuple[list[str], list[str] | None]:
    """(prompts, responses or None on-policy) of the data."""
    offline = cfg.mode == "offline"
    if cfg.data == BUILTIN:
        if offline:
            rows = task.synthetic_sft(cfg.num_examples, cfg.seed)
            return [r["prompt"] for r in rows], [r["response"] for r in rows]
        return [r["prompt"] for r in task.synthetic_prompt_rows(task.NUM_PPO_PROMPTS, cfg.seed)], None
    columns = {"prompt": cfg.prompt_key, **({"response": cfg.response_key} if offline else {})}
    table = load_table(cfg.data, columns, where="distill data", key_prefix=key_prefix)
    return list(table["prompt"]), list(table["response"]) if offline else None


def prepare(cfg: DistillConfig, *, student_upstream: ModelSource | None = None,
            teacher_upstream: ModelSource | None = None, key_prefix: str = "") -> DistillPlan:
    """Check the whole configuration and resolve its defaults, loading no model weights. `student_upstream` /
    `teacher_upstream`: the models a pipeline's earlier stages will have written by the time this one runs."""
    cfg = dataclasses.replace(cfg)
    check_common(cfg, ("steps", "batch_size", "log_every", "save_every", "num_examples", "eval_prompts"), "distill",
                 key_prefix, ranges={"beta": Range(0, 1, note="0 forward KL, 1 reverse KL, between the JSD")})
    if cfg.mode not in MODES:
        raise ValueError(f"distill: --{key_prefix}mode must be one of {', '.join(MODES)}, got {cfg.mode!r}")
    if cfg.rollout_engine not in ROLLOUT_ENGINES:
        raise ValueError(f"distill: --{key_prefix}rollout_engine must be one of {', '.join(ROLLOUT_ENGINES)}, got "
                         f"{cfg.rollout_engine!r}")
    distributed.check_shard(cfg.shard, "distill")
    distributed.check_global_batch("distill", batch_size=cfg.batch_size)
    out = Path(cfg.out)
    student = _model(cfg.model, out / "student" / "sft" / "final", student_upstream, "student", f"--{key_prefix}model",
                     "`fastrlhf sft --out OUT/student --model SMALL`")
    teacher = _model(cfg.teacher, out / "ppo" / "final", teacher_upstream, "teacher", f"--{key_prefix}teacher",
                     "`fastrlhf ppo`")
    cfg.model, cfg.teacher = student.spec, teacher.spec
    if cfg.qlora:
        check_qlora(student, cfg.lora_rank, "distill", key_prefix)
    check_vocabulary(student, teacher, cfg.chat_template)
    cfg.data = resolve_data(cfg.data, student, "distill", f"--{key_prefix}data")
    builtin = cfg.data == BUILTIN
    prompts, responses = _data(cfg, key_prefix)
    encoder = Encoder(student.tokenizer, chat_template=cfg.chat_template, vocab_size=student.config.vocab_size)
    where = None if builtin else f"distill data: {cfg.data}"
    prompt_ids = encoder.prompts(prompts, where=where)
    response_ids = None
    if responses is not None:
        response_ids = encoder.responses(prompts, prompt_ids, responses, warn_empty=not builtin, where=where)
    if builtin:
        cfg.max_prompt_len = cfg.max_prompt_len or task.MAX_PROMPT_LEN
        cfg.max_response_len = cfg.max_response_len or (task.MAX_RESPONSE_LEN if response_ids else task.MAX_NEW_TOKENS)
    auto_response = not cfg.max_response_len
    positions = [m for m in (student.max_positions, teacher.max_positions) if m]
    cfg.max_prompt_len, cfg.max_response_len = auto_lengths(
        max(map(len, prompt_ids)), max(map(len, response_ids)) if response_ids else None,
        min(positions) if positions else None, max_prompt_len=cfg.max_prompt_len,
        max_response_len=cfg.max_response_len, where="distill")
    if auto_response and response_ids is None:  # on-policy: a long-context model would sample 30k tokens
        cfg.max_response_len = min(cfg.max_response_len, AUTO_MAX_NEW_TOKENS)
    prompt_ids = truncate_prompts(prompt_ids, cfg.max_prompt_len)
    if response_ids is not None:
        response_ids = truncate_responses(response_ids, cfg.max_response_len)
    eval_prompts, eval_ids = [], []
    if builtin:
        eval_prompts = [r["prompt"] for r in task.synthetic_prompt_rows(cfg.eval_prompts, cfg.seed, "eval")]
        eval_ids = truncate_prompts(encoder.prompts(eval_prompts), cfg.max_prompt_len, what="evaluation prompts")
    cfg.lr = cfg.lr or (TINY_LR if student.origin in TINY_ORIGINS else LORA_LR if cfg.lora_rank else MODEL_LR)
    check_run_dir(out / "distill", to_dict(cfg), resume=cfg.resume, overwrite=cfg.overwrite,
                  defaults=to_dict(type(cfg)()), what="distill")
    log.info("distill: teacher %s -> student %s, %s, beta %g (%s); data %s; prompts <= %d tokens, responses <= %d; "
             "lr %g", teacher.spec, student.spec, cfg.mode, cfg.beta,
             {0.0: "forward KL", 1.0: "reverse KL"}.get(cfg.beta, "generalized JSD"),
             describe_data(cfg.data, len(prompts)), cfg.max_prompt_len, cfg.max_response_len, cfg.lr)
    warn_if_batch_exceeds_data("distill", cfg.batch_size, len(prompts), f"--{key_prefix}batch_size")
    return DistillPlan(cfg, student, teacher, prompts, prompt_ids, response_ids, eval_prompts, eval_ids)


# ---------------------------------------------------------------- the loop


@holds_run_folder("distill")
def train(cfg: DistillConfig, plan: DistillPlan | None = None) -> dict:
    plan = plan or prepare(cfg)
    cfg = plan.cfg
    out = Path(cfg.out)
    device = distributed.setup(cfg.device, to_dict(cfg), "distill")  # torchrun: process group, same config
    start_stage_dir(out / "distill", to_dict(cfg), resume=cfg.resume, overwrite=cfg.overwrite)
    # 0. setup: student (+ LoRA) and frozen teacher under one root (sharded under torchrun), optimizer, resume
    torch.manual_seed(cfg.seed)
    student_lm, tokenizer = load_causal_lm(plan.student, device=device,
                                           gradient_checkpointing=cfg.gradient_checkpointing, qlora=cfg.qlora)
    teacher_lm, _ = load_causal_lm(plan.teacher, device=device)
    sizes = {"student_params": n_params(student_lm), "teacher_params": n_params(teacher_lm)}
    pair = Distiller(student_lm, teacher_lm, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha)
    model = distributed.shard_model(pair, cfg.shard, device)
    distributed.seed_per_rank(cfg.seed)  # ranks sample different responses
    columns = {"prompt": plan.prompts, "prompt_ids": plan.prompt_ids}
    offline = plan.response_ids is not None
    engine = None if offline else make_engine(
        cfg.rollout_engine, pair.student, tokenizer, batch=cfg.batch_size // distributed.world_size(),
        prompt_len=cfg.max_prompt_len, new_tokens=cfg.max_response_len, temperature=cfg.temperature,
        device=device)  # None: the hf path
    data = Dataset.from_dict(dict(columns, response_ids=plan.response_ids) if offline else columns)
    trainable = [p for p in pair.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    run = StageRun("distill", cfg, model=pair, optimizer=optimizer)
    step, skipped = run.step, run.extra.get("skipped_nonfinite", 0)
    builtin = bool(plan.eval_prompts)

    def true_score(teacher: bool = False) -> float:  # the built-in task's score of sampled responses
        # on a forked random stream: the batches drawn after do not depend on how many prompts this rank sampled
        pair.scoring_teacher = teacher
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                return evaluate_true_score(model, tokenizer, plan.eval_ids, plan.eval_prompts,
                                           max_new_tokens=task.MAX_NEW_TOKENS, temperature=cfg.temperature,
                                           device=device)
        finally:
            pair.scoring_teacher = False

    scores = {k: run.extra.get(k) for k in ("true_score_teacher", "true_score_before")}
    if builtin and not run.resumed:
        scores = {"true_score_teacher": true_score(teacher=True), "true_score_before": true_score()}
        log.info("distill: true score of the teacher %.3f, of the student before %.3f",
                 scores["true_score_teacher"], scores["true_score_before"])
    pad_id = tokenizer.pad_token_id
    pair.train()

    while step < run.stop:
        t0 = time.perf_counter()
        # 1. batch: B (prompt, response) pairs, or B prompts answered by the student (rank 0's draw; each rank
        #    its share)
        idx = distributed.draw(range(len(data)), cfg.batch_size)
        rows = distributed.local_rows(data, idx)
        if offline:
            batch = pack(rows["prompt_ids"], rows["response_ids"], pad_id).to(device)
        else:
            batch = model.run(sample, tokenizer, rows, cfg, device, engine, gathered=pair.student)
        # 2-3. the teacher's and the student's hidden states, the divergence per response token over their
        #      global count
        n_tokens = distributed.all_sum(batch.response_mask.sum())
        loss, stats = model.run(distill_step_loss, batch, cfg, device, n_tokens)
        # 4. update (warm-up, gradient clip); a non-finite loss or gradient skips the step
        if not guarded_step(optimizer, loss * distributed.loss_scale(), trainable, step, lr=cfg.lr):
            skipped += 1
        step += 1
        row = {"loss": distributed.all_sum(loss.detach()).item(), "entropy": stats["entropy"].item(),
               "response_length": batch.response_mask.sum(-1).mean().item(),
               "tokens_per_s": n_tokens.item() / (time.perf_counter() - t0)}
        if builtin and not offline:  # the true score of the student's own samples
            texts = tokenizer.batch_decode(batch.responses.tolist(), skip_special_tokens=True)
            row["true_score"] = sum(task.true_score(rows["prompt"], texts)) / len(texts)
        run.window.append(row)
        run.advance(step, skipped, loss=f"{row['loss']:.4f}")  # stops a diverged run; a signal ends the loop here
        # 5. log and checkpoint
        if run.due(step, cfg.log_every):
            window = run.window
            logged = {k: sum(w[k] for w in window) / len(window) for k in window[0]}
            run.log(step, dict(logged, lr=optimizer.param_groups[0]["lr"], skipped_nonfinite=skipped))
        if run.checkpoint_due(step):
            run.save(step, pair.trainable_state(), {"skipped_nonfinite": skipped, **scores})

    if not run.finish(step):
        return {"stopped_at": step}
    state_bytes = distributed.state_bytes_summary(pair, optimizer)  # this rank's parameters, gradients, optimizer
    # 6. final student (LoRA merged, written by rank 0), true score after, summary, plot
    distributed.export(pair, lambda: Distiller(empty_copy(student_lm), empty_copy(teacher_lm), lora_rank=cfg.lora_rank,
                                               lora_alpha=cfg.lora_alpha),
                       lambda m: m.save_student(run.dir / "final", tokenizer, plan.student.lineage(cfg.data)))
    logged = run.rows()
    summary = {"steps": step, "seconds": run.seconds, "skipped_nonfinite": skipped, "mode": cfg.mode,
               "beta": cfg.beta, "temperature": cfg.temperature, "lora_rank": cfg.lora_rank,
               "rollout_engine": None if offline else "hf" if engine is None else "graph",
               "loss_first": logged[0]["loss"] if logged else None,
               "loss_final": logged[-1]["loss"] if logged else None,
               **sizes, "student_fraction": sizes["student_params"] / sizes["teacher_params"], "device": str(device),
               "model_dir": str(run.dir / "final"), **state_bytes}
    if builtin:
        summary.update(scores, true_score_after=true_score())
        gain = summary["true_score_teacher"] - summary["true_score_before"]
        summary["recovered"] = (summary["true_score_after"] - summary["true_score_before"]) / gain if gain else None
    run.write_summary(summary)
    run.plot(["loss", "entropy", "true_score"], "distill_curves.png")
    if builtin:
        log.info("distill: done, true score: teacher %.3f, student %.3f -> %.3f (%d of the teacher's %d parameters)",
                 summary["true_score_teacher"], summary["true_score_before"], summary["true_score_after"],
                 sizes["student_params"], sizes["teacher_params"])
    else:
        log.info("distill: done, loss %.4f -> %.4f, student in %s", summary["loss_first"] or float("nan"),
                 summary["loss_final"] or float("nan"), run.dir / "final")
    return summary


def main(argv: list[str]) -> int:
    setup_logging()
    return run_cli(DistillConfig, argv, "fastrlhf distill", distributed.entry(train))
