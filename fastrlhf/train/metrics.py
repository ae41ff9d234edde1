"""Phase timer, memory tracker, JSONL / TensorBoard logging, summary, progress bars.

Peak memory per phase: on CUDA `torch.cuda.max_memory_allocated`, reset when the phase
starts. On CPU (Linux, glibc) the peak resident set size during the phase: when a step's
first phase starts, freed heap memory is handed back to the OS (`malloc_trim(0)`; otherwise
glibc keeps it resident and every step would report the run's high-water mark), and when
each phase starts the kernel's peak (VmHWM) is reset to the current size
(`/proc/self/clear_refs`); VmHWM when it ends is the phase's peak. So a step's largest phase
peak is the step's peak RSS, and a later phase's peak also counts the heap glibc kept from
the step's earlier phases (which it hands out again first; blocks above its mmap threshold,
32 MiB at most, go back to the OS when freed). Trimming before every phase instead cost ~5%
of a CPU GRPO iteration (llama-10m-v32k, bench/e2e.py): every page handed back is faulted in
and zeroed again. Where either is unavailable, no memory figure is reported at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fastrlhf.train.checkpoint import json_safe, read_json, temp_path, write_json_atomic, writing

log = logging.getLogger("fastrlhf")

def setup_logging() -> None:
    """INFO lines with a time stamp on stderr; Python warnings go through logging too (so they
    never land on a progress bar's line). Without a terminal, the Hugging Face libraries' own
    progress bars are switched off and the stages' progress is logged as lines (`progress`).
    Under torchrun, ranks other than 0 log errors only (rank 0 speaks for the run)."""
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s " + (f"[rank {rank}] " if rank else "") + "%(message)s",
                        datefmt="%H:%M:%S")
    logging.captureWarnings(True)
    if not sys.stderr.isatty() or rank:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read by transformers on import
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


# ---------------------------------------------------------------- time and memory per phase


class CPUPeakRSS:
    """Peak resident set size of this process during a span: `start()`, then `peak()` in bytes.
    `available` is False off Linux/glibc or when /proc/self/clear_refs is not writable."""

    def __init__(self):
        self._malloc_trim = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
            self._malloc_trim = libc.malloc_trim
        except (OSError, AttributeError, TypeError):
            pass
        self.available = self._malloc_trim is not None and self._reset_peak() and self.peak() is not None

    @staticmethod
    def _reset_peak() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
            return True
        except OSError:
            return False

    def start(self, trim: bool = True) -> None:
        """Measure from now: hand freed heap memory back to the OS first (`trim`), then reset the peak."""
        if trim:
            self._malloc_trim(0)
        self._reset_peak()

    @staticmethod
    def peak() -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None


class PhaseTimer:
    """`with timer.phase("rollout"): ...` accumulates seconds and the peak memory of each phase.

    `step_stats()` returns and clears the current step's figures; `total_seconds` and
    `total_peak` keep the sums of seconds and the max of peaks over the run. `memory_kind`
    says what the peaks measure; None (and no peaks) where nothing per phase can be measured.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.peak: dict[str, int] = defaultdict(int)
        self.total_seconds: dict[str, float] = defaultdict(float)
        self.total_peak: dict[str, int] = defaultdict(int)
        self._cpu = CPUPeakRSS() if device.type == "cpu" else None
        self._step_started = False  # a phase of the current step has started (CPU: the heap was trimmed)
        if device.type == "cuda":
            self.memory_kind = "CUDA allocated"
        elif self._cpu.available:
            self.memory_kind = "peak RSS during the phase"
        else:
            self.memory_kind = None
            log.info("per-phase CPU memory is not measurable here (needs Linux /proc and glibc); not reported")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _start_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.memory_kind is not None:
            self._cpu.start(trim=not self._step_started)
        self._step_started = True

    def _peak_memory(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self._cpu.peak() if self.memory_kind is not None else None

    @contextlib.contextmanager
    def phase(self, name: str):
        self._sync()
        self._start_memory()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            seconds = time.perf_counter() - start
            self.seconds[name] += seconds
            self.total_seconds[name] += seconds
            peak = self._peak_memory()
            if peak is not None:
                self.peak[name] = max(self.peak[name], peak)
                self.total_peak[name] = max(self.total_peak[name], peak)

    def step_stats(self) -> dict[str, float]:
        stats = {f"time/{k}": v for k, v in self.seconds.items()}
        stats.update({f"memory/{k}": float(v) for k, v in self.peak.items()})
        self.seconds.clear()
        self.peak.clear()
        self._step_started = False
        return stats


# ---------------------------------------------------------------- logging


def to_floats(stats: dict) -> dict[str, float]:
    return {k: float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in stats.items()}


class RunLogger:
    """One JSON object per logged step in OUT/metrics.jsonl, each with `"stage"` and `"step"`;
    optionally TensorBoard under OUT/tb/<stage>.

    A fresh run of a stage drops that stage's old rows; a resumed run keeps the rows up to
    the checkpoint's step, so the file reads like one uninterrupted run (a last line cut short
    by a crash is dropped, with a warning).
    """

    def __init__(self, out: Path, stage: str, *, resume_step: int | None = None, tensorboard: bool = False):
        self.path = Path(out) / "metrics.jsonl"
        self.stage = stage
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.path.exists():
            for row, line in _rows_and_lines(self.path, warn_torn=True):
                if row.get("stage") != stage or (resume_step is not None and row.get("step", 0) <= resume_step):
                    kept.append(line)
        tmp = temp_path(self.path)
        with writing(self.path):
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
        with writing(self.path), self.path.open("a") as f:
            f.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
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


def _rows_and_lines(path: Path, *, warn_torn: bool = False) -> list[tuple[dict, str]]:
    """(row, line) for each line of a metrics.jsonl. The last line, when it is cut short (a crash
    during its append), is dropped (with a warning if `warn_torn`); any other line that is not a
    JSON object is a ValueError naming the file and the line."""
    lines = path.read_bytes().split(b"\n")
    out = []
    for i, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            line = raw.decode()
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a JSON {type(row).__name__}, not an object")
        except ValueError as e:
            if i == len(lines):  # no newline after it: its append never finished
                if warn_torn:
                    log.warning("%s: line %d is cut short (%r...: a crash during its write); it is dropped", path, i,
                                raw[:40])
                break
            raise ValueError(f"{path}, line {i}, is not a metrics row ({e}); the file was changed or damaged: repair "
                             "or remove that line") from None
        out.append((row, line))
    return out


def read_metrics(out: Path) -> list[dict]:
    path = Path(out) / "metrics.jsonl"
    return [row for row, _ in _rows_and_lines(path)] if path.exists() else []


def read_summary(out: Path) -> dict:
    """OUT/summary.json ({} when there is none); one that cannot be read is an error naming it."""
    path = Path(out) / "summary.json"
    fix = "repair it, or delete it (the stages that finished then lose their entry)"
    return read_json(path, fix=fix) if path.exists() else {}


def update_summary(out: Path, stage: str, values: dict | None) -> dict:
    """Merge `values` under `stage` in OUT/summary.json (valid JSON: NaN as null, written
    atomically); `values=None` removes the stage's entry."""
    path = Path(out) / "summary.json"
    summary = read_summary(out)
    if values is None:
        summary.pop(stage, None)
    else:
        summary[stage] = values
    write_json_atomic(path, summary)
    return json_safe(summary)


class LineProgress:
    """Progress for logs without a terminal: one log line per tenth of the run (and at the
    end) instead of a redrawn bar. Same `update` / `set_postfix` / `close` as tqdm."""

    def __init__(self, total: int, initial: int, desc: str):
        self.total, self.n, self.desc = total, initial, desc
        self.every = max(1, total // 10)
        self.postfix: dict = {}
        self._start, self._start_n = time.perf_counter(), initial

    def set_postfix(self, refresh: bool = True, **values) -> None:
        self.postfix = values

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n == self.total:
            rate = (self.n - self._start_n) / max(1e-9, time.perf_counter() - self._start)
            extra = "".join(f" {k}={v}" for k, v in self.postfix.items())
            log.info("%s: %d/%d (%.0f%%)%s, %.2f it/s", self.desc, self.n, self.total,
                     100 * self.n / max(1, self.total), extra, rate)

    def close(self) -> None:
        pass


class NoProgress:
    """What ranks other than 0 get: the same methods, no output."""

    def set_postfix(self, refresh: bool = True, **values) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, initial: int, desc: str, *, show: bool = True):
    """A tqdm bar on a terminal; `LineProgress` (log lines) otherwise; nothing if not `show`."""
    if not show:
        return NoProgress()
    if sys.stderr.isatty():
        return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, mininterval=0.5)
    return LineProgress(total, initial, desc)
