"""What every stage shares around its training loop: the checks of its configuration before
a model loads (`check_common`, `resolve_data`, `stage_model`), resume, the metrics logger,
the progress bar, checkpoints, the summary and the guarded optimizer step. The loop body
stays in the stage, top to bottom:

    run = StageRun("sft", cfg, model=lm, optimizer=optimizer)   # resumes when cfg.resume
    step = run.step
    while step < run.stop:
        ...                                                      # the stage's numbered steps
        step += 1
        run.advance(loss=f"{loss:.3f}")
        if run.due(step, cfg.log_every):
            run.log(step, stats)
        if run.due(step, cfg.save_every):
            run.save(step, weights, extra)
    if not run.finish(step):                                     # stopped early (--stop_after)
        return {"stopped_at": step}

Under torchrun every rank runs the same loop; `StageRun` reduces the logged metrics over the
ranks (fastrlhf.distributed.reduce_metrics) and only rank 0 writes files or shows progress.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import typing
import warnings
from pathlib import Path

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from fastrlhf import distributed, task
from fastrlhf.checkpoint import resume_from_checkpoint, save_checkpoint, start_run_dir
from fastrlhf.data import AUTO, BUILTIN
from fastrlhf.devices import resolve_device
from fastrlhf.metrics import LineProgress, RunLogger, progress, to_floats, update_summary
from fastrlhf.models import BUILTIN_MODELS, ModelSource, model_source
from fastrlhf.plots import plot_curves
from fastrlhf.rollout import generate

log = logging.getLogger("fastrlhf")

WARMUP_STEPS = 10  # linear learning-rate warm-up of the SFT and RM stages
EVAL_BATCH_SIZE = 256  # sequences per forward pass when evaluating (RM accuracy, PPO true score)


# ---------------------------------------------------------------- checks before a model loads


class Range(typing.NamedTuple):
    """The values a numeric key accepts: low <= value <= high (low < value with `low_open`,
    value < high with `high_open`), finite unless `inf_ok`; `note` says what a boundary value means."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    note: str = ""
    inf_ok: bool = False

    def allows(self, value) -> bool:
        if math.isnan(value) or (math.isinf(value) and not self.inf_ok):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            text = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        return f"{text} ({self.note})" if self.note else text


POSITIVE = Range(0, low_open=True)
# The numeric keys of the stages (a stage checks those it has), as the code uses them. Counts
# (steps, batch sizes, ...) are each stage's `counts`.
RANGES = {
    "lr": Range(0, note="0 = auto"),  # PPO: > 0 (its own argument to check_common)
    "max_prompt_len": Range(0, note="0 = auto"),
    "max_response_len": Range(0, note="0 = auto"),
    "max_new_tokens": Range(0, note="0 = auto"),
    "stop_after": Range(0, note="0 = run to the end"),
    "eval_fraction": Range(0, 1, low_open=True, high_open=True),
    "lora_rank": Range(0, note="0 = full fine-tuning"),
    "lora_alpha": POSITIVE,
    "temperature": POSITIVE,
    "kl_coef": Range(0),
    "kl_target": Range(0, note="0 = fixed kl_coef"),
    "gamma": Range(0, 1),
    "lam": Range(0, 1),
    "clip": POSITIVE,
    "value_clip": POSITIVE,
    "vf_coef": Range(0),
    "entropy_coef": Range(0),
    "max_grad_norm": Range(0, low_open=True, note="inf = no clipping", inf_ok=True),
}


def check_common(cfg, counts: tuple[str, ...], stage: str, key_prefix: str = "", ranges: dict | None = None) -> None:
    """What every stage's configuration needs: each key in `counts` an int >= 1, each numeric
    key of RANGES (updated with `ranges`) that `cfg` has within its range, a device that exists,
    TensorBoard installed when asked for. Errors name the key as given: `--{key_prefix}{name}`."""
    for name in counts:
        value = getattr(cfg, name)
        if value < 1:
            raise ValueError(f"{stage}: --{key_prefix}{name} must be >= 1, got {value}")
    for name, valid in {**RANGES, **(ranges or {})}.items():
        value = getattr(cfg, name, None)
        if value is not None and not valid.allows(value):
            raise ValueError(f"{stage}: --{key_prefix}{name} must be {valid}, got {value}")
    resolve_device(cfg.device)
    if cfg.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ValueError(f"{stage}: --tensorboard needs the tensorboard package: "
                             "pip install 'fastrlhf[tensorboard]'") from None


def stage_model(spec: str, default: Path, upstream: ModelSource | None, stage: str, made_by: str) -> ModelSource:
    """The model a stage starts from: `spec` when given; else `upstream` (what the previous
    stage of a pipeline will write at `default`), else the model already at `default`."""
    if spec:
        return model_source(spec, where=f"{stage} model")
    if upstream is not None:
        return upstream
    if not Path(default).is_dir():
        raise ValueError(f"{stage}: no model given and {default} does not exist; run `fastrlhf {made_by}` "
                         "with the same --out first, or pass --model")
    return model_source(default, where=f"{stage} model")


def resolve_data(data: str, model: ModelSource, stage: str, key: str = "--data") -> str:
    """`builtin`, or the user's data path. `auto` is `builtin` only when the model is a built-in
    config or was trained on the built-in task; otherwise it is an error: the built-in task is
    never a silent substitute for data the user forgot."""
    if data == BUILTIN:
        return BUILTIN
    if data != AUTO:
        return data
    builtin_model = model.trained_on is None and model.origin in BUILTIN_MODELS
    if model.trained_on == BUILTIN or builtin_model:
        return BUILTIN
    trained = f", trained on {model.trained_on}" if model.trained_on else ""
    raise ValueError(f"{stage}: no data given ({key} auto), and the model {model.spec}{trained} is neither a "
                     f"built-in config nor trained on the built-in task; pass {key} FILE (JSONL/JSON/parquet/CSV "
                     f"or a save_to_disk folder), or {key} builtin to train on the built-in task on purpose")


def describe_data(data: str, rows: int) -> str:
    if data == BUILTIN:
        return f"the built-in task (fastrlhf.task, --data builtin), {rows} rows"
    return f"{data}, {rows} rows"


def warn_if_batch_exceeds_data(stage: str, batch: int, rows: int, flag: str) -> None:
    """Batches are drawn uniformly with replacement (`distributed.draw`): one of more rows than the
    training data holds repeats rows every time. A warning, not an error (a tiny data set is a fair test)."""
    if batch > rows:
        warnings.warn(f"{stage}: each batch draws {batch} rows ({flag}) from {rows} training rows, so every batch "
                      "repeats rows (batches are drawn uniformly with replacement); give more data or a smaller "
                      "batch", stacklevel=2)


# ---------------------------------------------------------------- the run


def start_stage_dir(folder: Path, config: dict, *, resume: bool, overwrite: bool, **kwargs) -> None:
    """`checkpoint.start_run_dir` on rank 0 (every rank waits for it; one process: the call itself)."""
    with distributed.main_first() as main:
        if main:
            start_run_dir(folder, config, resume=resume, overwrite=overwrite, **kwargs)


class StageRun:
    """One stage's run in OUT/<stage>/: `step` and `extra` (from the latest checkpoint when
    resuming, else 0 and {}), `stop` (the step this invocation ends at), the logger and the bar.
    Under torchrun every rank makes one; rank 0's writes the files."""

    def __init__(self, stage: str, cfg, *, model: torch.nn.Module, optimizer):
        self.stage, self.cfg, self.model, self.optimizer = stage, cfg, model, optimizer
        self.out = Path(cfg.out)
        self.dir = self.out / stage
        self.main = distributed.is_main()
        resumed = resume_from_checkpoint(self.dir, model, optimizer, cfg.resume, stage)
        self.resumed = resumed is not None
        self.step, self.extra = resumed if self.resumed else (0, {})
        self._rows: list[dict] = []  # what this rank logged (ranks other than 0 write no file)
        self.logger = None
        if self.main:
            self.logger = RunLogger(self.out, stage, resume_step=self.step if self.resumed else None,
                                    tensorboard=cfg.tensorboard)
            if not self.resumed:
                update_summary(self.out, stage, None)  # a fresh run's summary must not show an earlier run's
        self.stop = cfg.steps if cfg.stop_after <= 0 else min(cfg.steps, self.step + cfg.stop_after)
        self._context = contextlib.ExitStack()
        self.bar = progress(cfg.steps, self.step, stage, show=self.main)
        if not isinstance(self.bar, LineProgress):
            self._context.enter_context(logging_redirect_tqdm())  # log lines above the bar, not on it
        self.start = time.perf_counter()

    def due(self, step: int, every: int) -> bool:
        """Every `every` steps, and at the last step of this invocation."""
        return step % every == 0 or step == self.stop

    def advance(self, **postfix) -> None:
        self.bar.set_postfix(refresh=False, **postfix)
        self.bar.update(1)

    def log(self, step: int, stats: dict) -> dict:
        """Write a metrics row (reduced over ranks: every rank calls this at the same steps)."""
        stats = distributed.reduce_metrics(stats)
        if self.logger is None:
            row = {"stage": self.stage, "step": step, **to_floats(stats)}
            self._rows.append(row)
            return row
        return self.logger.log(step, stats)

    def save(self, step: int, weights: dict[str, torch.Tensor], extra: dict) -> Path:
        return save_checkpoint(self.dir, step, weights, self.optimizer, extra, module=self.model)

    def finish(self, step: int) -> bool:
        """Close the bar and the logger. False (and a log line) when this invocation stopped
        before the last step; the stage then returns without a final model."""
        self.bar.close()
        self._context.close()
        if self.logger is not None:
            self.logger.close()
        if step < self.cfg.steps:
            log.info("%s: stopped after step %d of %d (resume with --resume)", self.stage, step, self.cfg.steps)
            return False
        return True

    def rows(self) -> list[dict]:
        """This stage's metrics rows, oldest first (other ranks: those of this invocation)."""
        return self.logger.rows() if self.logger is not None else list(self._rows)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def write_summary(self, summary: dict) -> dict:
        return update_summary(self.out, self.stage, summary) if self.main else summary

    def plot(self, keys: list[str], filename: str) -> Path | None:
        return plot_curves(self.rows(), self.stage, keys, self.out / "plots" / filename) if self.main else None


# ---------------------------------------------------------------- the built-in task's true score


@torch.no_grad()
def evaluate_true_score(model, tokenizer, prompt_ids: list[list[int]], prompts: list[str], *, max_new_tokens: int,
                        temperature: float, device: torch.device) -> float:
    """Mean true score (the built-in task's rule, fastrlhf.task) of responses sampled from the
    policy of `model` (an ActorCritic, or the ShardedModel around one) to held-out prompts,
    EVAL_BATCH_SIZE prompts per generate call (PPO and DPO, before and after). Under torchrun
    each rank samples for its share of the prompts."""
    from datasets import Dataset

    rows = distributed.local_rows(Dataset.from_dict({"prompt": prompts, "prompt_ids": prompt_ids}),
                                  list(range(len(prompts))))

    def total(ac) -> float:
        scores = []
        for i in range(0, len(rows["prompt"]), EVAL_BATCH_SIZE):
            r = generate(ac.policy, tokenizer, rows["prompt_ids"][i:i + EVAL_BATCH_SIZE],
                         rows["prompt"][i:i + EVAL_BATCH_SIZE], max_new_tokens=max_new_tokens,
                         temperature=temperature, device=device)
            scores += task.true_score(r.prompts, r.responses)
        return sum(scores)

    sharded = distributed.as_sharded(model)
    policy = sharded.module.policy  # generation gathers the policy alone, not a frozen reference copy
    return distributed.all_sum(sharded.run(total, gathered=policy)).item() / len(prompts)


# ---------------------------------------------------------------- the optimizer step


def finite_or_warn(value: torch.Tensor, what: str, step: int) -> bool:
    """True if `value` is finite (on every rank); otherwise warn that this optimizer step is skipped."""
    if distributed.all_finite(value):
        return True
    warn_skipped(what, value.detach().float().flatten()[:1].item(), step, stacklevel=3)
    return False


def warn_skipped(what: str, value: float, step: int, stacklevel: int = 2) -> None:
    """The warning of an optimizer step skipped for a non-finite `what` (its value, read already)."""
    warnings.warn(f"step {step}: non-finite {what} ({value}); skipping this optimizer step", stacklevel=stacklevel + 1)


def guarded_step(optimizer, loss: torch.Tensor, params, step: int, *, lr: float,
                 warmup_steps: int = WARMUP_STEPS, max_grad_norm: float = 1.0) -> bool:
    """One optimizer step with linear warm-up and gradient clipping; a non-finite loss or
    gradient norm skips it (with a warning). Returns whether the step was applied. Under
    torchrun every rank takes the same decision (a loss non-finite on any rank skips it)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * min(1.0, (step + 1) / warmup_steps)
    optimizer.zero_grad(set_to_none=True)
    if not finite_or_warn(loss, "loss", step):
        return False
    loss.backward()
    grad_norm = distributed.gradient_norm(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    if not finite_or_warn(grad_norm, "gradient norm", step):
        optimizer.zero_grad(set_to_none=True)
        return False
    optimizer.step()
    return True
