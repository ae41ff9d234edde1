"""Phase timer, memory tracker, JSONL / TensorBoard logging, summary, progress bars.

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
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fastrlhf.checkpoint import write_json_atomic

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
