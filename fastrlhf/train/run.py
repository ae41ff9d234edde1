"""What every stage shares around its training loop: the checks of its configuration before
a model loads (`check_common`, `resolve_data`, `stage_model`), the run folder's lock, resume,
the metrics logger, the progress bar, checkpoints, the guards against a diverged run, signals,
the summary and the guarded optimizer step. The loop body stays in the stage, top to bottom:

    @holds_run_folder("sft")                                     # one run per OUT (a lock)
    def train(cfg, plan=None):
        ...
        run = StageRun("sft", cfg, model=lm, optimizer=optimizer)   # resumes when cfg.resume
        step = run.step
        while step < run.stop:
            ...                                                  # the stage's numbered steps
            step += 1
            run.window.append(loss)                              # what the next row averages
            run.advance(step, skipped, loss=f"{loss:.3f}")       # guards: finite parameters, skips; signals
            if run.due(step, cfg.log_every):
                run.log(step, {"loss": mean(run.window)})        # empties the window
            if run.checkpoint_due(step):
                run.save(step, weights, extra)                   # the window goes with it
        if not run.finish(step):                                 # stopped early (--stop_after)
            return {"stopped_at": step}

What a resumed run guarantees: it continues from the newest intact checkpoint (checked against
its manifest) with the weights, optimizer, RNG and logging window of that step, so its
metrics.jsonl equals an uninterrupted run's row for row. A run whose parameters turn non-finite,
or which skips more than `--max_skipped_frac` of its updates, stops with an error (`RunError`)
before it writes another checkpoint or a final model. SIGTERM or SIGINT (`StopSignals`) end the
loop after the current step and its checkpoint, with exit 143 / 130; a second one exits at once.

Under torchrun every rank runs the same loop; `StageRun` reduces the logged metrics over the
ranks (fastrlhf.train.distributed.reduce_metrics), the guards and the signals are agreed on by every
rank (one all-reduce per step), and only rank 0 writes files or shows progress.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import signal
import threading
import time
import typing
import warnings
from pathlib import Path

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from fastrlhf.train import distributed, task
from fastrlhf.train.checkpoint import resume_from_checkpoint, run_lock, save_checkpoint, start_run_dir
from fastrlhf.train.config import RunError, Stopped
from fastrlhf.train.data import AUTO, BUILTIN
from fastrlhf.train.devices import resolve_device
from fastrlhf.train.metrics import LineProgress, RunLogger, progress, read_summary, to_floats, update_summary
from fastrlhf.train.models import BUILTIN_MODELS, ModelSource, model_source
from fastrlhf.train.plots import plot_curves
from fastrlhf.train.rollout import generate

log = logging.getLogger("fastrlhf")

WARMUP_STEPS = 10  # linear learning-rate warm-up of the SFT and RM stages
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # finish the step, write a checkpoint, exit 128 + the signal
# A repeat of the first signal within this many seconds is the same one delivered twice (a terminal's Ctrl-C
# reaches torchrun's workers directly and again through torchrun), not a second request.
SIGNAL_REPEAT_S = 2.0
LOG_WINDOW = "log_window"  # the checkpoint's extra entry holding StageRun.window
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
    "max_skipped_frac": Range(0, 1, note="1 = never stop for skipped updates"),
    "dist_timeout_s": POSITIVE,
    "reward_timeout_s": POSITIVE,
    "reward_clip_abs": POSITIVE,
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
        return f"the built-in task (fastrlhf.train.task, --data builtin), {rows} rows"
    return f"{data}, {rows} rows"


def warn_if_batch_exceeds_data(stage: str, batch: int, rows: int, flag: str) -> None:
    """Batches are drawn uniformly with replacement (`distributed.draw`): one of more rows than the
    training data holds repeats rows every time. A warning, not an error (a tiny data set is a fair test)."""
    if batch > rows:
        warnings.warn(f"{stage}: each batch draws {batch} rows ({flag}) from {rows} training rows, so every batch "
                      "repeats rows (batches are drawn uniformly with replacement); give more data or a smaller "
                      "batch", stacklevel=2)


# ---------------------------------------------------------------- the run


def holds_run_folder(what: str):
    """Decorate a stage's `train(cfg, ...)` (or the pipeline's `run(cfg)`) to hold cfg.out's lock
    for the whole call (`checkpoint.run_lock`: one run per folder, rank 0 holds it), and to put
    back the signal handlers a StageRun installs, however the call ends."""

    def decorate(train):
        @functools.wraps(train)
        def locked(cfg, *args, **kwargs):
            handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
            try:
                with run_lock(Path(cfg.out), what):
                    return train(cfg, *args, **kwargs)
            finally:
                if threading.current_thread() is threading.main_thread():
                    for s, handler in handlers.items():
                        signal.signal(s, handler)

        return locked

    return decorate


def start_stage_dir(folder: Path, config: dict, *, resume: bool, overwrite: bool, **kwargs) -> None:
    """`checkpoint.start_run_dir` on rank 0 (every rank waits for it; one process: the call itself)."""
    with distributed.main_first() as main:
        if main:
            start_run_dir(folder, config, resume=resume, overwrite=overwrite, **kwargs)


class StopSignals:
    """SIGTERM and SIGINT while a stage's loop runs (handlers installed from the main thread): the
    first is recorded in `received` (the loop finishes its step, writes a checkpoint and stops);
    a second one exits at once with 128 + its number, without a checkpoint. `restore()` puts the
    previous handlers back."""

    def __init__(self, stage: str):
        self.stage, self.received, self._at = stage, None, 0.0
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received, self._at = signum, time.monotonic()
            log.warning("%s: %s received: finishing this step, then a checkpoint (a second signal exits at once)",
                        self.stage, name)
        elif signum != self.received or time.monotonic() - self._at > SIGNAL_REPEAT_S:
            log.warning("%s: a second signal (%s): exiting now, without a checkpoint", self.stage, name)
            logging.shutdown()
            os._exit(128 + signum)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def params_finite(params) -> torch.Tensor:
    """A device bool: every element of `params` (this rank's shards under FSDP) is finite; the
    largest |value| of each tensor is reduced on the device, nothing is read back here."""
    local = [(p.to_local() if hasattr(p, "to_local") else p).detach() for p in params]
    local = [p for p in local if p.numel()]
    if not local:
        return torch.tensor(True)
    return torch.stack([m.float() for m in torch._foreach_norm(local, math.inf)]).isfinite().all()


class StageRun:
    """One stage's run in OUT/<stage>/: `step` and `extra` (from the newest intact checkpoint when
    resuming, else 0 and {}), `stop` (the step this invocation ends at), `window` (what the stage
    collects between two metrics rows, saved with every checkpoint), the guards, the logger and
    the bar. `updates_per_step`: optimizer updates one step tries (PPO: epochs x minibatches), for
    --max_skipped_frac. Under torchrun every rank makes one; rank 0's writes the files."""

    def __init__(self, stage: str, cfg, *, model: torch.nn.Module, optimizer, updates_per_step: int = 1):
        self.stage, self.cfg, self.model, self.optimizer = stage, cfg, model, optimizer
        self.out = Path(cfg.out)
        self.dir = self.out / stage
        self.main = distributed.is_main()
        resumed = resume_from_checkpoint(self.dir, model, optimizer, cfg.resume, stage)
        self.resumed = resumed is not None
        self.step, self.extra = (resumed["step"], resumed["extra"]) if self.resumed else (0, {})
        self.checkpoint = resumed["path"] if self.resumed else None  # the newest checkpoint of this run
        if self.step > cfg.steps:
            raise ValueError(f"{stage}: --steps {cfg.steps}, but {self.checkpoint} holds step {self.step}: a run "
                             f"cannot resume backwards; pass --steps {self.step} or more")
        self.window: list = self.extra.pop(LOG_WINDOW, [])
        self.planned_updates = cfg.steps * updates_per_step
        self._rows: list[dict] = []  # what this rank logged (ranks other than 0 write no file)
        self.logger = None
        if self.main:
            self.logger = RunLogger(self.out, stage, resume_step=self.step if self.resumed else None,
                                    tensorboard=cfg.tensorboard)
            if not self.resumed:
                update_summary(self.out, stage, None)  # a fresh run's summary must not show an earlier run's
            else:
                read_summary(self.out)  # written when the stage ends: a damaged one is named now, not then
        self.stop = cfg.steps if cfg.stop_after <= 0 else min(cfg.steps, self.step + cfg.stop_after)
        self._context = contextlib.ExitStack()
        self.bar = progress(cfg.steps, self.step, stage, show=self.main)
        if not isinstance(self.bar, LineProgress):
            self._context.enter_context(logging_redirect_tqdm())  # log lines above the bar, not on it
        self.signals = StopSignals(stage)
        self.start = time.perf_counter()

    def due(self, step: int, every: int) -> bool:
        """Every `every` steps, and at the run's last step: the rows an uninterrupted run writes
        (logging, evaluation), whatever steps an invocation stops at."""
        return step % every == 0 or step == self.cfg.steps

    def checkpoint_due(self, step: int) -> bool:
        """Every save_every steps, and at the last step of this invocation (the end, --stop_after,
        or the step a signal came in)."""
        return step % self.cfg.save_every == 0 or step == self.stop

    def advance(self, step: int, skipped: int, **postfix) -> None:
        """Step `step` is done (`skipped`: the optimizer updates skipped so far): move the bar,
        then read the step's guards with one device read (and under torchrun one all-reduce):
        parameters that are no longer finite, or more skipped updates than --max_skipped_frac
        allows, stop the run with a RunError before it checkpoints or publishes this state; a
        signal makes this step the last of the invocation. Reading the parameters once per step
        covers each of its updates: an update never turns an inf or NaN back into a number."""
        self.bar.set_postfix(refresh=False, **postfix)
        self.bar.update(1)
        finite = params_finite([p for g in self.optimizer.param_groups for p in g["params"]])
        local = [0.0 if bool(finite) else 1.0, float(self.signals.received is not None)]
        nonfinite, signalled = distributed.all_sum(torch.tensor(local, dtype=torch.float64)).tolist()
        if nonfinite:
            self._diverged(f"the parameters are no longer finite after step {step} (NaN or inf: the run diverged; lr "
                           f"{self.cfg.lr:g})", "Lower --lr (or --max_grad_norm)")
        if skipped > self.cfg.max_skipped_frac * self.planned_updates:
            self._diverged(f"{skipped} of the run's {self.planned_updates} optimizer updates were skipped for a "
                           f"non-finite loss or gradient, more than --max_skipped_frac {self.cfg.max_skipped_frac:g} "
                           f"allows: the run is diverging (lr {self.cfg.lr:g})",
                           "Lower --lr (or find what makes the loss non-finite: the reward's scale, --temperature)")
        if signalled:
            self.stop = step

    def _diverged(self, what: str, fix: str) -> None:
        kept = (f"the last checkpoint, {self.checkpoint}, is kept" if self.checkpoint else
                "no checkpoint was written yet")
        raise RunError(f"{self.stage}: {what}; nothing is published as final and {kept}. {fix} and start over with "
                       "--overwrite")

    def log(self, step: int, stats: dict) -> dict:
        """Write a metrics row (reduced over ranks: every rank calls this at the same steps) and
        empty the window."""
        self.window = []
        stats = distributed.reduce_metrics(stats)
        if self.logger is None:
            row = {"stage": self.stage, "step": step, **to_floats(stats)}
            self._rows.append(row)
            return row
        return self.logger.log(step, stats)

    def save(self, step: int, weights: dict[str, torch.Tensor], extra: dict) -> Path:
        """A checkpoint of step `step`: `weights`, the optimizer, RNG, `extra` and the window."""
        self.checkpoint = save_checkpoint(self.dir, step, weights, self.optimizer, {**extra, LOG_WINDOW: self.window},
                                          module=self.model)
        return self.checkpoint

    def finish(self, step: int) -> bool:
        """Close the bar and the logger, put the signal handlers back. False (and a log line) when
        this invocation stopped before the last step (--stop_after); the stage then returns without
        a final model. After a signal: Stopped (exit 143 / 130)."""
        self.bar.close()
        self._context.close()
        if self.logger is not None:
            self.logger.close()
        self.signals.restore()
        if self.signals.received is not None:
            raise Stopped(f"{self.stage}: stopped at step {step}; continue with --resume "
                          f"({signal.Signals(self.signals.received).name}; checkpoint {self.checkpoint})",
                          self.signals.received)
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
    """Mean true score (the built-in task's rule, fastrlhf.train.task) of responses sampled from the
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
