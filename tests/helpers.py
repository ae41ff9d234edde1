"""Assertions, inputs and runners shared by the tests (import as `from helpers import ...`)."""

import importlib
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import torch


def worst(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where a and b differ most, for failure messages."""
    d = (a.double() - b.double()).abs().nan_to_num(float("inf"))
    if d.numel() == 0:
        return "empty"
    i = int(d.argmax())
    idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), d.shape)) if d.dim() else ()
    got, want = a.flatten()[i].item(), b.flatten()[i].item()
    return f"worst |diff| {d.flatten()[i].item():.3e} at {idx}: {got!r} vs {want!r}"


def assert_close_to_ref(out, ref64, ref_same_dtype, *, atol, name="output", ref64_rounded=None):
    """docs/ops.md rule: |out - ref64| <= 2 * max|ref_same_dtype - ref64| + atol, plus the
    rounding of the float32 output itself (2 eps32 * |ref64|, elementwise): a float32 result
    cannot be closer than its own last bit, however lucky the same-dtype reference was. An
    output in bf16 / fp16 (a gradient in its input's dtype) is that float32 value rounded once
    more, to half an ulp of its dtype: eps / 2 * |ref64| more.

    `ref64` is reference.py in float64; `ref_same_dtype` is reference.py run in the input
    dtype. NaN must match NaN exactly.

    `ref64_rounded` (optional) is reference.py in float64 on the inputs rounded to the input dtype,
    the only inputs the op is given. Its distance to ref64 is error that no op can avoid: exact
    arithmetic on what the op sees ends there. The same-dtype reference's error is that distance
    plus its own arithmetic's rounding, which on a draw can cancel it (a bf16 result that rounds
    towards ref64, a clip decided the other way at a bound): one lucky number, and with a single
    dominant element (a scalar loss or stat, an outlier's gradient) it is the whole base. So the
    base is the larger of the two distances: an op exact on its inputs gets 1x the unavoidable
    error, within the 2x the rule grants; ref64_rounded never looks at the op's output.
    """
    if ref64_rounded is not None:
        ref64_rounded = ref64_rounded.detach().double().cpu()
    last_bit = 2 * torch.finfo(torch.float32).eps
    if out.dtype in (torch.bfloat16, torch.float16):
        last_bit += torch.finfo(out.dtype).eps / 2
    out, ref64, same = (x.detach().double().cpu() for x in (out, ref64, ref_same_dtype))
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    nan_out, nan_ref = torch.isnan(out), torch.isnan(ref64)
    assert torch.equal(nan_out, nan_ref), (
        f"{name}: NaN pattern differs ({int(nan_out.sum())} vs {int(nan_ref.sum())} NaNs)")
    ok = ~nan_ref
    if not ok.any():
        return
    diff = (out[ok] - ref64[ok]).abs()
    base = (same[ok] - ref64[ok]).abs().nan_to_num(0.0).max().item()
    if ref64_rounded is not None:
        base = max(base, (ref64_rounded[ok] - ref64[ok]).abs().nan_to_num(0.0).max().item())
    allowed = 2 * base + atol + last_bit * ref64[ok].abs()
    excess = diff - allowed
    i = int(excess.argmax())
    source = "same-dtype reference" if ref64_rounded is None else "same-dtype reference or rounded inputs"
    assert excess[i] <= 0, (
        f"{name}: err {diff[i].item():.3e} > 2 x {base:.3e} ({source}) + atol {atol:.1e} "
        f"+ the output's rounding at |ref| {ref64[ok][i].item():.3e}; "
        f"{worst(out.masked_fill(~ok, 0), ref64.masked_fill(~ok, 0))}"
    )


def make_mask(B, T):
    """Row 0 right padding, row 1 left padding, row 2 all masked, row 3 gaps, the rest random."""
    m = torch.rand(B, T) > 0.25
    m[0] = torch.arange(T) < T - 5
    if B > 1:
        m[1] = torch.arange(T) >= 7
    if B > 2:
        m[2] = False
    if B > 3:
        m[3] = torch.arange(T) % 3 != 1
    return m


# clip_cov's and kl_cov's token selections as the policy-loss tests set them (a tenth of the tokens; clip_cov's
# covariance bounds wide open)
SELECTION = dict(clip_cov=dict(clip_cov_ratio=0.1, clip_cov_lb=-5.0, clip_cov_ub=5.0), kl_cov=dict(kl_cov_ratio=0.1))


def poison_outputs(monkeypatch, *modules: str):
    """Make `torch.empty` / `torch.empty_like` in each named module (kernel launchers, op modules)
    return NaN-filled memory: every output element they allocate must then be written. Library
    code has no test hook for this; the fixture swaps the module's `torch` for a proxy. Modules
    are named, as `fastrlhf.ops.gae` the attribute is the function `gae`."""

    class _NaNTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            out = torch.empty(*args, **kwargs)
            return out.fill_(math.nan) if out.is_floating_point() else out

        @staticmethod
        def empty_like(*args, **kwargs):
            out = torch.empty_like(*args, **kwargs)
            return out.fill_(math.nan) if out.is_floating_point() else out

    for name in modules:
        monkeypatch.setattr(importlib.import_module(name), "torch", _NaNTorch())


# ---------------------------------------------------------------- the stages' tests

ROOT = Path(__file__).resolve().parents[1]
TINY_PPO = dict(model="tiny", reward="fastrlhf.train.task:true_score", rollout_batch_size=4, mini_batch_size=4,
                micro_batch_size=4, eval_prompts=4, max_new_tokens=4)  # a PPO step in well under a second
TIMING_KEYS = ("time/", "time_mean/", "memory/", "memory_mean/", "tokens_per_s")  # differ between equal runs


def run_cli(*args, timeout=300) -> subprocess.CompletedProcess:
    """`python -m fastrlhf ARGS...` from the repository root, output captured."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "fastrlhf", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def main_in_process(*args, capsys, caplog) -> subprocess.CompletedProcess:
    """`fastrlhf ARGS...` through `cli.main` in this process: the same parsing, checks and stage as `run_cli`
    without a new interpreter's imports (seconds per run). `stderr` holds what it printed there and its log
    lines (INFO and up of fastrlhf's loggers), as a process's stderr would. Tests of what only a process
    shows (its exit status under a signal, torchrun, the working directory on sys.path) use `run_cli`."""
    from fastrlhf import cli

    capsys.readouterr()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastrlhf"):
        code = cli.main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, captured.out, captured.err + caplog.text)


def metric_rows(out: Path, stage: str, *, timing: bool = True) -> list[dict]:
    """The rows a stage logged in OUT/metrics.jsonl; timing=False drops the keys that differ between runs."""
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["stage"] == stage]
    return rows if timing else [{k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)} for r in rows]
