"""Phase timer, memory tracker, JSONL / TensorBoard logging, summary, plots, progress bars.

Peak memory per phase: on CUDA `torch.cuda.max_memory_allocated` (reset at each phase);
on CPU the process's peak resident set size during the phase (Linux VmHWM, reset through
/proc/self/clear_refs; where that is not possible, the peak since the process started).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import resource
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fastrlhf.models import write_json_atomic

log = logging.getLogger("fastrlhf")

PPO_PHASES = ("rollout", "reward", "logprobs", "advantages", "update")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")


# ---------------------------------------------------------------- time and memory per phase


def _reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_peak_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PhaseTimer:
    """`with timer.phase("rollout"): ...` accumulates seconds and the peak memory of each phase.

    `step_stats()` returns and clears the current step's figures; `totals` keeps the sums of
    seconds and the max of peaks over the run.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.peak: dict[str, int] = defaultdict(int)
        self.total_seconds: dict[str, float] = defaultdict(float)
        self.total_peak: dict[str, int] = defaultdict(int)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_cpu_peak()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            seconds = time.perf_counter() - start
            if self.device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(self.device)
            else:
                peak = _cpu_peak_bytes()
            self.seconds[name] += seconds
            self.peak[name] = max(self.peak[name], peak)
            self.total_seconds[name] += seconds
            self.total_peak[name] = max(self.total_peak[name], peak)

    def step_stats(self) -> dict[str, float]:
        stats = {f"time/{k}": v for k, v in self.seconds.items()}
        stats.update({f"memory/{k}": float(v) for k, v in self.peak.items()})
        self.seconds.clear()
        self.peak.clear()
        return stats


# ---------------------------------------------------------------- logging


def to_floats(stats: dict) -> dict[str, float]:
    return {k: float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in stats.items()}


class RunLogger:
    """One JSON object per logged step in OUT/metrics.jsonl, each with `"stage"` and `"step"`;
    optionally TensorBoard under OUT/tb/<stage>.

    A fresh run of a stage drops that stage's old rows; a resumed run keeps the rows up to
    the checkpoint's step, so the file reads like one uninterrupted run.
    """

    def __init__(self, out: Path, stage: str, *, resume_step: int | None = None, tensorboard: bool = False):
        self.path = Path(out) / "metrics.jsonl"
        self.stage = stage
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                row = json.loads(line)
                if row.get("stage") != stage or (resume_step is not None and row.get("step", 0) <= resume_step):
                    kept.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("tensorboard=True needs the tensorboard package: "
                                  "pip install 'fastrlhf[tensorboard]'") from e

            self.writer = SummaryWriter(str(Path(out) / "tb" / stage))

    def log(self, step: int, stats: dict) -> dict:
        row = {"stage": self.stage, "step": step, **to_floats(stats)}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for k, v in row.items():
                if isinstance(v, float) and math.isfinite(v):
                    self.writer.add_scalar(f"{self.stage}/{k}", v, step)
        return row

    def rows(self) -> list[dict]:
        return [r for r in read_metrics(self.path.parent) if r["stage"] == self.stage]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(out: Path) -> list[dict]:
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def update_summary(out: Path, stage: str, values: dict) -> dict:
    """Merge `values` under `stage` in OUT/summary.json (written atomically)."""
    path = Path(out) / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary[stage] = values
    write_json_atomic(path, summary)
    return summary


def progress(total: int, initial: int, desc: str):
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, mininterval=0.5)


# ---------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(out: Path, stage: str, keys: list[str], filename: str) -> Path | None:
    """One panel per metric key over the steps of `stage`; OUT/plots/<filename>."""
    rows = [r for r in read_metrics(out) if r["stage"] == stage]
    keys = [k for k in keys if any(k in r for r in rows)]
    if not rows or not keys:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".")
        ax.set_title(f"{stage}: {key}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return _save_figure(plt, fig, out, filename)


def _save_figure(plt, fig, out: Path, filename: str) -> Path:
    """Write `fig` to OUT/plots/filename and close it."""
    fig.tight_layout()
    path = Path(out) / "plots" / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_phases(out: Path, seconds: dict[str, float], peak_bytes: dict[str, int], filename: str,
                memory_kind: str) -> Path:
    """Bar charts of the total time and the peak memory of each PPO phase."""
    plt = _pyplot()
    names = list(seconds)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax_t.bar(names, [seconds[n] for n in names], color="tab:blue")
    ax_t.set_title("PPO time per phase (s, whole run)")
    ax_m.bar(names, [peak_bytes.get(n, 0) / 2**20 for n in names], color="tab:orange")
    ax_m.set_title(f"PPO peak memory per phase (MiB, {memory_kind})")
    for ax in (ax_t, ax_m):
        ax.tick_params(axis="x", rotation=20)
        ax.grid(axis="y", alpha=0.3)
    return _save_figure(plt, fig, out, filename)


def finite_or_warn(value: torch.Tensor, what: str, step: int) -> bool:
    """True if `value` is finite; otherwise warn that this optimizer step is skipped."""
    if bool(torch.isfinite(value).all()):
        return True
    warnings.warn(f"step {step}: non-finite {what} ({value.detach().float().flatten()[:1].item()}); "
                  "skipping this optimizer step", stacklevel=2)
    return False


def guarded_step(optimizer, loss: torch.Tensor, params, step: int, *, lr: float, warmup_steps: int,
                 max_grad_norm: float = 1.0) -> bool:
    """One optimizer step with linear warm-up and gradient clipping; a non-finite loss or
    gradient norm skips it (with a warning). Returns whether the step was applied."""
    for group in optimizer.param_groups:
        group["lr"] = lr * min(1.0, (step + 1) / warmup_steps)
    optimizer.zero_grad(set_to_none=True)
    if not finite_or_warn(loss, "loss", step):
        return False
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if not finite_or_warn(grad_norm, "gradient norm", step):
        optimizer.zero_grad(set_to_none=True)
        return False
    optimizer.step()
    return True
