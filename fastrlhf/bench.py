"""`fastrlhf bench`: a roofline table of every op against PyTorch, torch.compile and the peers.

A case is one op at one shape and dtype, timed for one or more passes:
    fwd      the forward under torch.no_grad() (old / reference log-probs in a rollout)
    bwd      the backward alone, through a graph built once (`retain_graph=True`)
    fwd+bwd  forward with autograd, then backward (one training step's share)

Providers: "fastrlhf" (the public ops: Triton on CUDA, the torch path on CPU; the row's
`backend` says which), "torch" (`fastrlhf.reference` eager, in the input dtype, as a user
would write it), "torch.compile" (the same under `torch.compile`) and the peers (verl,
OpenRLHF, TRL, Liger) when importable; absent ones are skipped with a note.

Bytes: each input read once and each output written once, per pass (`Op.doc` lists them
per op); fwd+bwd counts both passes. A provider that materialises intermediates moves
more bytes than it is credited with, so GB/s compares providers at equal work:
    gbps     = bytes / median time
    roofline = ideal / median, ideal = fwd bytes / read-probe GB/s + bwd bytes / copy-probe GB/s
The probes (a sum and a copy of a buffer far larger than any cache) run in the same process.

Timing on CUDA: `triton.testing.do_bench` median after warm-up (it clears the L2 before each
call), inputs rotated through copies totalling >= 4x the L2; peak memory is
`torch.cuda.max_memory_allocated()` above what was allocated before the call. On CPU:
`time.perf_counter` medians (labelled CPU), peak memory null (no allocator statistics).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import inspect
import itertools
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastrlhf import ops, reference

PASSES = ("fwd", "bwd", "fwd+bwd")
PROVIDERS = ("fastrlhf", "torch", "torch.compile", "verl", "openrlhf", "trl", "liger", "matmuls")
PEERS = ("verl", "openrlhf", "trl", "liger")
GB = 1e9
GIB = 2**30
DEFAULT_L2_BYTES = 50 * 2**20  # H100; used when the device does not report its L2


class Skip(Exception):
    """A provider that cannot run this case; the message says why."""


# ---------------------------------------------------------------- cases


@dataclass
class Case:
    """One op at one shape and dtype, and the passes timed for it."""

    op: str
    dims: dict[str, int]  # e.g. {"B": 16, "T": 1024, "V": 151936}
    dtype: torch.dtype
    passes: tuple[str, ...]

    @property
    def shape(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.dims.items())

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def cases(quick: bool = False) -> list[Case]:
    """Realistic shapes (the speed targets' shapes among them); `quick` shrinks them so a
    2-core CPU runs everything in under two minutes."""
    bf16, f32 = torch.bfloat16, torch.float32
    all3, fwd_full = PASSES, ("fwd", "fwd+bwd")
    if quick:
        vocab = [({"B": 2, "T": 256, "V": 32000}, f32), ({"B": 2, "T": 128, "V": 32000}, bf16)]
        linear = [({"N": 512, "H": 256, "V": 8000}, f32)]
        bt = {"B": 64, "T": 512}
        out = [Case("logprobs", d, t, all3) for d, t in vocab]
        out += [Case("ppo_actor_loss", d, t, all3) for d, t in vocab]
        out += [Case("linear_logprobs", d, t, all3) for d, t in linear]
        out += [Case("linear_ppo_actor_loss", d, t, fwd_full) for d, t in linear]
        grids = [bt]
    else:
        out = [Case("logprobs", {"B": b, "T": 1024, "V": v}, bf16, all3)
               for b, v in [(4, 32000), (16, 128256), (16, 151936), (32, 151936)]]
        out += [Case("logprobs", {"B": b, "T": 1024, "V": v}, f32, all3)
                for b, v in [(4, 32000), (16, 151936)]]
        out += [Case("ppo_actor_loss", {"B": b, "T": 1024, "V": v}, t, all3)
                for b, v, t in [(4, 32000, bf16), (16, 151936, bf16), (4, 32000, f32)]]
        out += [Case("linear_logprobs", {"N": n, "H": 4096, "V": v}, bf16, all3)
                for n, v in [(4096, 32000), (16384, 151936)]]
        out += [Case("linear_ppo_actor_loss", {"N": 16384, "H": 4096, "V": 151936}, bf16, fwd_full)]
        grids = [{"B": 1024, "T": 4096}, {"B": 256, "T": 1024}]
    for bt in grids:
        out += [
            Case("token_kl", bt, f32, fwd_full),
            Case("kl_shaped_rewards", bt, f32, ("fwd",)),
            Case("gae", bt, f32, ("fwd",)),
            Case("policy_loss", bt, f32, all3),
            Case("value_loss", bt, f32, fwd_full),
        ]
    return out


# ---------------------------------------------------------------- inputs


def _randn(shape, device, gen, dtype=torch.float32, scale=1.0):
    return torch.randn(shape, device=device, generator=gen, dtype=dtype).mul_(scale)


def _mask(B, T, device, gen):
    """Right padding with random response lengths in [T/4, T]."""
    lengths = torch.randint(max(T // 4, 1), T + 1, (B, 1), device=device, generator=gen)
    return torch.arange(T, device=device) < lengths


def _logp(shape, device, gen):
    return -_randn(shape, device, gen).abs_().mul_(2.0)


def _logits_inputs(case: Case, device, gen) -> dict:
    B, T, V = case.dims["B"], case.dims["T"], case.dims["V"]
    return {"logits": _randn((B, T, V), device, gen, case.dtype, 2.0).requires_grad_(),
            "labels": torch.randint(0, V, (B, T), device=device, generator=gen)}


def _actor_extras(B, T, device, gen) -> dict:
    return {"old_logp": _logp((B, T), device, gen), "advantages": _randn((B, T), device, gen),
            "mask": _mask(B, T, device, gen), "ref_logp": _logp((B, T), device, gen)}


def _linear_inputs(case: Case, device, gen) -> dict:
    N, H, V = case.dims["N"], case.dims["H"], case.dims["V"]
    return {"hidden": _randn((N, H), device, gen, case.dtype).requires_grad_(),
            "weight": _randn((V, H), device, gen, case.dtype, H**-0.5).requires_grad_(),
            "labels": torch.randint(0, V, (N,), device=device, generator=gen)}


def _grid_inputs(*names, grad=None, scores=False, logp=(), mask=True):
    """[B, T] fp32 inputs named `names` (log-prob-like if in `logp`), a bool `mask` and
    `scores` [B] if asked; `grad` gets requires_grad."""

    def make(case: Case, device, gen) -> dict:
        B, T = case.dims["B"], case.dims["T"]
        out = {"scores": _randn((B,), device, gen)} if scores else {}
        for name in names:
            out[name] = _logp((B, T), device, gen) if name in logp else _randn((B, T), device, gen)
        if mask:
            out["mask"] = _mask(B, T, device, gen)
        if grad:
            out[grad].requires_grad_()
        return out

    return make


# ---------------------------------------------------------------- providers


WEIGHT_ACCUM = "fastrlhf-accum-weight"  # the linear ops with accum_dtype=weight.dtype


def _ours(name, **kw):
    """A provider loader: fastrlhf.ops.<name> with the case's keyword arguments."""

    def load(pass_):
        fn = getattr(ops, name)

        def run(**inputs):
            return fn(**inputs, **kw)

        return run

    return load


def _ours_weight_accum(name, **kw):
    """fastrlhf.ops.<name> with d(weight) accumulated in the weight's own dtype
    (`accum_dtype=weight.dtype`): no fp32 V x H buffer, one rounding per chunk."""

    def load(pass_):
        fn = getattr(ops, name)

        def run(**inputs):
            return fn(**inputs, accum_dtype=inputs["weight"].dtype, **kw)

        return run

    return load


def _ref(name, **kw):
    def load(pass_):
        fn = getattr(reference, name)

        def run(**inputs):
            return fn(**inputs, **kw)

        return run

    return load


def _import_peer(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise Skip(f"{module} not importable ({exc.__class__.__name__}: {exc})") from None


def _peer(module: str, build: Callable, *, cuda_only=False):
    """A peer loader: import `module`, then `build(module, pass_)` returns the callable."""

    def load(pass_):
        mod = _import_peer(module)
        return build(mod, pass_)

    load.cuda_only = cuda_only
    return load


def _param(fn, name) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _first(out):
    return out[0] if isinstance(out, tuple | list) else out


def _verl_logprobs(mod, pass_):
    return lambda logits, labels: mod.logprobs_from_logits(logits, labels)


def _openrlhf_logprobs(mod, pass_):
    return lambda logits, labels: mod.log_probs_from_logits(logits, labels)


def _trl_logprobs(mod, pass_):
    return lambda logits, labels: mod.selective_log_softmax(logits, labels)


def _liger_logprobs(mod, pass_):
    # Liger's cross entropy returns -logp per token (reduction="none"); with grad enabled
    # its forward also writes d(logits) into the logits' storage, so its bwd is a scale.
    def run(logits, labels):
        V = logits.shape[-1]
        nll = mod.liger_cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none")
        return -nll.view(labels.shape)

    return run


def _liger_linear_logprobs(mod, pass_):
    def run(hidden, weight, labels):
        nll = mod.liger_fused_linear_cross_entropy(hidden, weight, labels, reduction="none")
        return -nll.view(labels.shape)

    return run


def _verl_kl(mod, pass_):
    return lambda logp, ref_logp: mod.kl_penalty(logp, ref_logp, "low_var_kl")


def _openrlhf_kl(mod, pass_):
    fn = mod.compute_approx_kl
    if _param(fn, "kl_estimator"):
        return lambda logp, ref_logp: fn(logp, ref_logp, kl_estimator="k3")
    if _param(fn, "use_kl_estimator_k3"):
        return lambda logp, ref_logp: fn(logp, ref_logp, use_kl_estimator_k3=True)
    raise Skip("openrlhf compute_approx_kl has no k3 option in this version")


def _verl_gae(mod, pass_):
    return lambda rewards, values, mask: mod.compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95)


def _verl_policy_loss(mod, pass_):
    if not hasattr(mod, "compute_policy_loss"):
        raise Skip("verl core_algos has no compute_policy_loss in this version")
    return lambda logp, old_logp, advantages, mask: _first(
        mod.compute_policy_loss(old_logp, logp, advantages, mask, 0.2))


def _openrlhf_policy_loss(mod, pass_):
    loss = mod.PolicyLoss()
    return lambda logp, old_logp, advantages, mask: _first(loss(logp, old_logp, advantages, mask))


def _verl_value_loss(mod, pass_):
    return lambda values, old_values, returns, mask: _first(
        mod.compute_value_loss(values, returns, old_values, mask, 0.2))


def _openrlhf_value_loss(mod, pass_):
    loss = mod.ValueLoss(clip_eps=0.2) if _param(mod.ValueLoss, "clip_eps") else mod.ValueLoss()
    return lambda values, old_values, returns, mask: _first(loss(values, old_values, returns, mask))


def _matmuls(pass_):
    """The bare matmuls of a linear log-prob pass (the bound of issue 3): logits = h W^T
    forward; d(h) = g W and d(W) = g^T h backward (g stands in for d(logits), same shape)."""

    @torch.no_grad()
    def run(hidden, weight, labels, **_):
        h = hidden.reshape(-1, hidden.shape[-1])
        g = h @ weight.T
        if pass_ != "fwd":
            g @ weight
            g.T @ h

    return run


_matmuls.autograd = False
_matmuls.passes = ("fwd", "fwd+bwd")  # bwd alone would need d(logits) made outside the timing


# ---------------------------------------------------------------- ops


@dataclass
class Op:
    """How to make inputs, count bytes and call each provider for one op."""

    name: str
    inputs: Callable[[Case, torch.device, torch.Generator], dict]
    bytes: Callable[[Case], dict[str, int]]  # {"fwd": n, "bwd": n}; fwd+bwd is their sum
    doc: str
    providers: dict[str, Callable]
    no_compile: str | None = None  # why torch.compile is not run, if it is not
    flops: Callable[[Case], dict[str, int]] | None = None


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _logprobs_bytes(case: Case) -> dict[str, int]:
    N, V, e = case.dims["B"] * case.dims["T"], case.dims["V"], _nbytes(case.dtype)
    return {"fwd": N * V * e + N * 8 + N * 4, "bwd": N * V * e + N * 8 + N * 4 + N * V * e}


def _actor_bytes(case: Case) -> dict[str, int]:
    N, V, e = case.dims["B"] * case.dims["T"], case.dims["V"], _nbytes(case.dtype)
    side = N * (8 + 3 * 4 + 1)  # labels, old_logp, advantages, ref_logp, mask
    return {"fwd": N * V * e + side, "bwd": N * V * e + side + N * V * e}


def _linear_bytes(case: Case, actor=False) -> dict[str, int]:
    N, H, V, e = case.dims["N"], case.dims["H"], case.dims["V"], _nbytes(case.dtype)
    side = N * (8 + 3 * 4 + 1) if actor else N * (8 + 4)
    ins = N * H * e + V * H * e + side
    return {"fwd": ins, "bwd": ins + N * H * e + V * H * e}


def _linear_flops(case: Case) -> dict[str, int]:
    N, H, V = case.dims["N"], case.dims["H"], case.dims["V"]
    return {"fwd": 2 * N * H * V, "bwd": 4 * N * H * V}


def _grid_bytes(n_in: int, n_out: int, grad: bool = False, per_row: int = 0, mask: bool = True):
    """n_in fp32 [B, T] inputs (+ a bool mask, + per_row fp32 [B]) in, n_out fp32 [B, T] out;
    bwd re-reads the inputs and writes one gradient."""

    def count(case: Case) -> dict[str, int]:
        BT, B = case.dims["B"] * case.dims["T"], case.dims["B"]
        ins = BT * (4 * n_in + mask) + 4 * B * per_row
        out = {"fwd": ins + 4 * BT * n_out}
        if grad:
            out["bwd"] = ins + 4 * BT
        return out

    return count


_ACTOR_KW = {"kl_coef": 0.05, "entropy_coef": 0.01}


def _actor_inputs(case, device, gen):
    inputs = _logits_inputs(case, device, gen)
    return inputs | _actor_extras(case.dims["B"], case.dims["T"], device, gen)


def _linear_actor_inputs(case, device, gen):
    """As `_linear_inputs`, as one sequence of N tokens: hidden [1, N, H], labels [1, N]."""
    N, H, V = case.dims["N"], case.dims["H"], case.dims["V"]
    inputs = {"hidden": _randn((1, N, H), device, gen, case.dtype).requires_grad_(),
              "weight": _randn((V, H), device, gen, case.dtype, H**-0.5).requires_grad_(),
              "labels": torch.randint(0, V, (1, N), device=device, generator=gen)}
    return inputs | _actor_extras(1, N, device, gen)


def _linear_actor_ref(**kw):
    """The materialised-logits actor loss: logits = hidden W^T, then reference.ppo_actor_loss."""

    def load(pass_):
        def run(hidden, weight, labels, **rest):
            return reference.ppo_actor_loss(hidden @ weight.T, labels, **rest, **kw)

        return run

    return load


_VERL_ALGOS, _VERL_F = "verl.trainer.ppo.core_algos", "verl.utils.torch_functional"
_ORLHF_UTILS, _ORLHF_LOSS = "openrlhf.models.utils", "openrlhf.models.loss"
_LIGER_F = "liger_kernel.transformers.functional"

OPS: dict[str, Op] = {
    op.name: op
    for op in [
        Op("logprobs", _logits_inputs, _logprobs_bytes,
           "fwd: logits [B,T,V], labels int64 in, logp fp32 out; "
           "bwd: logits, labels, d(logp) in, d(logits) out",
           {"fastrlhf": _ours("logprobs"), "torch": _ref("logprobs"),
            "verl": _peer(_VERL_F, _verl_logprobs), "openrlhf": _peer(_ORLHF_UTILS, _openrlhf_logprobs),
            "trl": _peer("trl.trainer.utils", _trl_logprobs),
            "liger": _peer(_LIGER_F, _liger_logprobs, cuda_only=True)}),
        Op("ppo_actor_loss", _actor_inputs, _actor_bytes,
           "fwd: logits [B,T,V], labels int64, old_logp, advantages, ref_logp fp32, mask bool in "
           "(scalar out); bwd: the same in, d(logits) out. kl_coef=0.05, entropy_coef=0.01",
           {"fastrlhf": _ours("ppo_actor_loss", **_ACTOR_KW), "torch": _ref("ppo_actor_loss", **_ACTOR_KW)}),
        Op("linear_logprobs", _linear_inputs, _linear_bytes,
           "fwd: hidden [N,H], weight [V,H], labels int64 in, logp fp32 out; "
           "bwd: hidden, weight, labels, d(logp) in, d(hidden), d(weight) out",
           {"fastrlhf": _ours("linear_logprobs"), WEIGHT_ACCUM: _ours_weight_accum("linear_logprobs"),
            "torch": _ref("linear_logprobs"),
            "liger": _peer(_LIGER_F, _liger_linear_logprobs, cuda_only=True), "matmuls": _matmuls},
           flops=_linear_flops),
        Op("linear_ppo_actor_loss", _linear_actor_inputs, functools.partial(_linear_bytes, actor=True),
           "fwd: hidden [N,H], weight [V,H], labels, old_logp, advantages, ref_logp, mask in; "
           "bwd: the same in, d(hidden), d(weight) out. kl_coef=0.05, entropy_coef=0.01",
           {"fastrlhf": _ours("linear_ppo_actor_loss", **_ACTOR_KW),
            WEIGHT_ACCUM: _ours_weight_accum("linear_ppo_actor_loss", **_ACTOR_KW),
            "torch": _linear_actor_ref(**_ACTOR_KW), "matmuls": _matmuls},
           flops=_linear_flops),
        Op("token_kl", _grid_inputs("logp", "ref_logp", grad="logp", logp=("logp", "ref_logp"), mask=False),
           _grid_bytes(2, 1, grad=True, mask=False),
           "fwd: logp, ref_logp fp32 [B,T] in, kl out (k3); bwd: logp, ref_logp, d(kl) in, d(logp) out",
           {"fastrlhf": _ours("token_kl", estimator="k3"), "torch": _ref("token_kl", estimator="k3"),
            "verl": _peer(_VERL_ALGOS, _verl_kl), "openrlhf": _peer(_ORLHF_UTILS, _openrlhf_kl)}),
        Op("kl_shaped_rewards", _grid_inputs("logp", "ref_logp", scores=True, logp=("logp", "ref_logp")),
           _grid_bytes(2, 1, per_row=1),
           "fwd: scores [B], logp, ref_logp fp32 [B,T], mask bool in, rewards fp32 out (k1, kl_coef=0.05)",
           {"fastrlhf": _ours("kl_shaped_rewards", kl_coef=0.05),
            "torch": _ref("kl_shaped_rewards", kl_coef=0.05)},
           no_compile="the reference loops over B with a data-dependent branch per row"),
        Op("gae", _grid_inputs("rewards", "values"), _grid_bytes(2, 2),
           "fwd: rewards, values fp32 [B,T], mask bool in, advantages, returns fp32 out "
           "(gamma=1, lam=0.95, skip mode, whitened); torch = the Python loop over T",
           {"fastrlhf": _ours("gae", gamma=1.0, lam=0.95), "torch": _ref("gae", gamma=1.0, lam=0.95),
            "verl": _peer(_VERL_ALGOS, _verl_gae)},
           no_compile="the reference is a Python loop over T; compile would unroll T steps"),
        Op("policy_loss",
           _grid_inputs("logp", "old_logp", "advantages", grad="logp", logp=("logp", "old_logp")),
           _grid_bytes(3, 0, grad=True),
           "fwd: logp, old_logp, advantages fp32 [B,T], mask bool in (scalar out); bwd: the same in, "
           "d(logp) out",
           {"fastrlhf": _ours("policy_loss"), "torch": _ref("policy_loss"),
            "verl": _peer(_VERL_ALGOS, _verl_policy_loss),
            "openrlhf": _peer(_ORLHF_LOSS, _openrlhf_policy_loss)}),
        Op("value_loss", _grid_inputs("values", "old_values", "returns", grad="values"),
           _grid_bytes(3, 0, grad=True),
           "fwd: values, old_values, returns fp32 [B,T], mask bool in (scalar out); bwd: the same in, "
           "d(values) out (clip=0.2)",
           {"fastrlhf": _ours("value_loss"), "torch": _ref("value_loss"),
            "verl": _peer(_VERL_ALGOS, _verl_value_loss),
            "openrlhf": _peer(_ORLHF_LOSS, _openrlhf_value_loss)}),
    ]
}


def _backend(device: torch.device) -> str:
    """Which path fastrlhf.ops takes for tensors on `device` (mirrors its dispatch)."""
    forced = os.environ.get("FASTRLHF_BACKEND", "auto").lower()
    if forced == "triton" or (forced == "auto" and device.type == "cuda"):
        return "triton" if device.type == "cuda" else "triton (interpreter)"
    return "torch"


def load_provider(op: Op, provider: str, pass_: str, device: torch.device) -> tuple[Callable, bool]:
    """(fn(**inputs), autograd) for one provider and pass; raises Skip with the reason."""
    if provider == "torch.compile":
        if op.no_compile:
            raise Skip(f"torch.compile not run: {op.no_compile}")
        eager, _ = load_provider(op, "torch", pass_, device)
        return torch.compile(eager), True
    if provider not in op.providers:
        raise Skip(f"{provider} has no {op.name}")
    load = op.providers[provider]
    if getattr(load, "cuda_only", False) and device.type != "cuda":
        raise Skip(f"{provider} needs CUDA")
    try:
        fn = load(pass_)
    except (ImportError, NotImplementedError, AttributeError) as exc:
        raise Skip(f"{provider}: {exc.__class__.__name__}: {exc}") from None
    return fn, getattr(load, "autograd", True)


# ---------------------------------------------------------------- measurement


@dataclass
class Settings:
    device: torch.device
    rep_ms: float  # timing budget per measurement
    rotate_bytes: int  # rotate inputs through copies totalling at least this
    min_reps: int = 3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable, settings: Settings, grad_to_none=()) -> float:
    """Median time of fn() in ms (the caller has warmed it up): do_bench on CUDA, which
    syncs and clears the L2 around each timed call; perf_counter on CPU."""
    if settings.device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=max(settings.rep_ms / 4, 1), rep=settings.rep_ms,
                              grad_to_none=list(grad_to_none) or None, return_mode="median"))
    times: list[float] = []
    deadline = time.perf_counter() + settings.rep_ms / 1e3
    while len(times) < settings.min_reps or (time.perf_counter() < deadline and len(times) < 100):
        for t in grad_to_none:
            t.grad = None
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _peak_bytes(fn: Callable, device: torch.device, grad_to_none=()) -> int | None:
    """Peak allocated bytes during one fn() above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    for t in grad_to_none:
        t.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)


def make_pool(case: Case, settings: Settings, seed: int = 0) -> list[dict]:
    """Input copies for rotation: enough that together they exceed `settings.rotate_bytes`."""
    op, device = OPS[case.op], settings.device
    gen = torch.Generator(device=device).manual_seed(seed)
    first = op.inputs(case, device, gen)
    size = sum(t.nbytes for t in first.values())
    copies = max(1, min(32, math.ceil(settings.rotate_bytes / max(size, 1))))
    return [first] + [op.inputs(case, device, gen) for _ in range(copies - 1)]


def make_runner(case: Case, pass_: str, fn: Callable, autograd: bool, pool: list[dict],
                device: torch.device) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """A zero-argument callable running one pass over the next input copy, and the tensors
    whose .grad must be reset between calls."""
    grads = [t for inputs in pool for t in inputs.values() if t.requires_grad]
    copies = itertools.cycle(range(len(pool)))
    if not autograd:
        return lambda: fn(**pool[next(copies)]), []
    if pass_ == "fwd":

        def run():
            with torch.no_grad():
                fn(**pool[next(copies)])

        return run, []

    gen = torch.Generator(device=device).manual_seed(1)

    def upstream(out):  # a random upstream gradient for non-scalar outputs, never ones
        return None if out.dim() == 0 else torch.randn(out.shape, device=device, generator=gen)

    if pass_ == "fwd+bwd":
        first = _first(fn(**pool[0]))
        g = upstream(first)
        del first

        def run():
            _first(fn(**pool[next(copies)])).backward(g)

        return run, grads
    graphs = []
    for inputs in pool:
        out = _first(fn(**inputs))  # the loss of (loss, stats), the logp of (logp, entropy)
        graphs.append((out, upstream(out)))
    cycle = itertools.cycle(graphs)

    def run():
        out, g = next(cycle)
        out.backward(g, retain_graph=True)

    return run, grads


def case_bytes(case: Case) -> dict[str, int]:
    """Bytes counted per pass: each input read once, each output written once (see Op.doc);
    fwd+bwd is the sum of the two passes."""
    counted = OPS[case.op].bytes(case)
    counted["fwd+bwd"] = counted["fwd"] + counted.get("bwd", 0)
    return counted


def warmup_calls(provider: str) -> int:
    """Untimed calls before timing: torch.compile compiles the frames resumed after each
    graph break lazily, over its first few calls (measured: ~4 on the reference losses)."""
    return 6 if provider == "torch.compile" else 1


def _measure(case: Case, pass_: str, provider: str, fn: Callable, autograd: bool, pool: list[dict],
             settings: Settings) -> tuple[float, int | None]:
    """(median ms, peak bytes) of one provider and pass. The runner, and any graphs it
    retains, die with this frame, before the next provider builds its own."""
    runner, grads = make_runner(case, pass_, fn, autograd, pool, settings.device)
    for _ in range(warmup_calls(provider)):  # compiles torch.compile graphs and Triton kernels
        runner()
    sync(settings.device)
    ms = _median_ms(runner, settings, grads)
    return ms, _peak_bytes(runner, settings.device, grads)


def probes(settings: Settings, nbytes: int) -> tuple[float, float]:
    """(read GB/s, copy GB/s): a sum over, and a copy of, an fp32 buffer of `nbytes`."""
    src = torch.rand(nbytes // 4, device=settings.device)
    dst = torch.empty_like(src)
    read = src.nbytes / GB / (_median_ms(src.sum, settings) / 1e3)
    copy = 2 * src.nbytes / GB / (_median_ms(functools.partial(dst.copy_, src), settings) / 1e3)
    return read, copy


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


@dataclass
class Run:
    """What one bench run collected."""

    rows: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)

    def skip(self, provider: str, op: str, reason: str) -> None:
        """One note per provider and reason, listing the ops it covers."""
        entry = next((e for e in self.skipped if (e["provider"], e["reason"]) == (provider, reason)), None)
        if entry is None:
            self.skipped.append({"provider": provider, "reason": reason, "ops": [op]})
        elif op not in entry["ops"]:
            entry["ops"].append(op)


def bench_case(case: Case, providers: list[str], settings: Settings, read_gbps: float, copy_gbps: float,
               out: Run) -> None:
    """Time every provider and pass of one case, appending rows (or skips) to `out`."""
    op, device = OPS[case.op], settings.device
    counted = case_bytes(case)
    flops = op.flops(case) if op.flops else None
    if "torch.compile" in providers:
        torch._dynamo.reset()  # fresh compile caches: no recompile limit reached across cases
    try:
        pool = make_pool(case, settings)
    except Exception as exc:
        if not _is_oom(exc):
            raise
        out.skip("*", case.op, f"{case.shape} {case.dtype_name}: inputs do not fit in memory")
        return
    mine = [p for p in providers if p in op.providers or p == "torch.compile"]
    for provider, pass_ in itertools.product(mine, case.passes):
        if pass_ not in getattr(op.providers.get(provider), "passes", PASSES):
            continue
        try:
            fn, autograd = load_provider(op, provider, pass_, device)
        except Skip as exc:
            out.skip(provider, case.op, str(exc))
            continue
        try:
            ms, peak = _measure(case, pass_, provider, fn, autograd, pool, settings)
        except Exception as exc:
            reason = "out of memory" if _is_oom(exc) else f"{exc.__class__.__name__}: {exc}".splitlines()[0]
            if provider == "fastrlhf" and not _is_oom(exc) and not isinstance(exc, NotImplementedError):
                traceback.print_exc(file=sys.stderr)
                out.errors.append({"op": case.op, "shape": case.shape, "dtype": case.dtype_name,
                                   "pass": pass_, "error": reason})
            out.skip(provider, case.op, f"{case.shape} {case.dtype_name} {pass_}: {reason}")
            continue
        finally:
            for inputs in pool:
                for t in inputs.values():
                    t.grad = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        ideal_ms = 1e3 / GB * (counted["fwd"] / read_gbps * (pass_ != "bwd")
                               + counted.get("bwd", 0) / copy_gbps * (pass_ != "fwd"))
        row = {"op": case.op, "shape": case.shape, "dims": case.dims, "dtype": case.dtype_name,
               "pass": pass_, "provider": provider,
               "backend": _backend(device) if provider == "fastrlhf" else provider,
               "median_ms": ms, "bytes": counted[pass_], "gbps": counted[pass_] / GB / (ms / 1e3),
               "roofline": ideal_ms / ms, "peak_mem_bytes": peak}
        if flops:
            total = flops.get(pass_, flops["fwd"] + flops["bwd"])
            row["tflops"] = total / 1e12 / (ms / 1e3)
        out.rows.append(row)
    del pool
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- speed targets


def _find(rows, op, pass_, provider, dims=None, dtype=None) -> dict | None:
    """The row for (op, pass, provider) at `dims`/`dtype` if present, else the largest case."""
    match = [r for r in rows if (r["op"], r["pass"], r["provider"]) == (op, pass_, provider)]
    exact = [r for r in match if r["dims"] == dims and r["dtype"] == dtype]
    if exact:
        return exact[0]
    return max(match, key=lambda r: (r["dtype"] == dtype, math.prod(r["dims"].values())), default=None)


def _same_case(rows, row, op, pass_, provider) -> dict | None:
    return next((r for r in rows if (r["op"], r["pass"], r["provider"]) == (op, pass_, provider)
                 and r["dims"] == row["dims"] and r["dtype"] == row["dtype"]), None)


def targets(rows: list[dict], read_gbps: float, copy_gbps: float) -> list[dict]:
    """The speed targets of issues 2 and 3, from this run's rows (GPU targets; on CPU the
    figures are informative only). Each names the case it used."""
    out = []

    def add(name, goal, row, value, detail, target_dims):
        if row is None or value is None:
            why = "case not measured in this run" if row is None else "no figure for it on this device"
            out.append({"name": name, "goal": goal, "value": None, "met": None, "detail": why})
            return
        op, bound = goal.split(" ")[0], float(goal.split(" ")[1])
        met = value >= bound if op == ">=" else value <= bound
        note = "" if row["dims"] == target_dims else " (not the target shape)"
        out.append({"name": name, "goal": goal, "value": value, "met": met,
                    "case": f"{row['op']} {row['shape']} {row['dtype']}", "detail": detail + note})

    big = {"B": 16, "T": 1024, "V": 151936}
    r = _find(rows, "logprobs", "fwd", "fastrlhf", big, "bfloat16")
    add("logprobs fwd / read probe", ">= 0.9", r, r and r["gbps"] / read_gbps,
        f"{r['gbps']:.0f} / {read_gbps:.0f} GB/s" if r else "", big)
    r = _find(rows, "logprobs", "bwd", "fastrlhf", big, "bfloat16")
    add("logprobs bwd / copy probe", ">= 0.85", r, r and r["gbps"] / copy_gbps,
        f"{r['gbps']:.0f} / {copy_gbps:.0f} GB/s" if r else "", big)

    grid = {"B": 1024, "T": 4096}
    r = _find(rows, "gae", "fwd", "fastrlhf", grid, "float32")
    loop = r and _same_case(rows, r, "gae", "fwd", "torch")
    add("gae speed-up over the Python loop", ">= 100", r, loop and loop["median_ms"] / r["median_ms"],
        f"{loop['median_ms']:.3f} / {r['median_ms']:.3f} ms" if loop else "", grid)

    r = _find(rows, "ppo_actor_loss", "fwd+bwd", "fastrlhf", big, "bfloat16")
    lp = r and _same_case(rows, r, "logprobs", "fwd+bwd", "fastrlhf")
    add("ppo_actor_loss fwd+bwd / logprobs fwd+bwd", "<= 1.15", r, lp and r["median_ms"] / lp["median_ms"],
        f"{r['median_ms']:.3f} / {lp['median_ms']:.3f} ms" if lp else "", big)

    lin = {"N": 16384, "H": 4096, "V": 151936}
    r = _find(rows, "linear_logprobs", "fwd+bwd", "fastrlhf", lin, "bfloat16")
    mm = r and _same_case(rows, r, "linear_logprobs", "fwd+bwd", "matmuls")
    add("linear_logprobs fwd+bwd / 3 bare matmuls", "<= 1.10", r, mm and r["median_ms"] / mm["median_ms"],
        f"{r['median_ms']:.3f} / {mm['median_ms']:.3f} ms" if mm else "", lin)
    peak = r and r["peak_mem_bytes"]
    add("linear_logprobs fwd+bwd extra peak (GiB)", "<= 1.0", r, None if peak is None else peak / GIB,
        "torch.cuda.max_memory_allocated above the inputs (d(weight) accumulated in fp32)", lin)
    r = _find(rows, "linear_logprobs", "fwd+bwd", WEIGHT_ACCUM, lin, "bfloat16")
    peak = r and r["peak_mem_bytes"]
    add(f"linear_logprobs fwd+bwd extra peak (GiB), {WEIGHT_ACCUM}", "<= 1.0", r,
        None if peak is None else peak / GIB, "d(weight) accumulated in bf16, one rounding per chunk", lin)
    add(f"linear_logprobs fwd+bwd / 3 bare matmuls, {WEIGHT_ACCUM}", "<= 1.10", r,
        mm and r and r["median_ms"] / mm["median_ms"], "", lin)
    # the trainer's op: its forward forms the gradients, so 3 matmuls (linear_logprobs needs 4)
    for provider in ("fastrlhf", WEIGHT_ACCUM):
        r = _find(rows, "linear_ppo_actor_loss", "fwd+bwd", provider, lin, "bfloat16")
        mm = r and _same_case(rows, r, "linear_ppo_actor_loss", "fwd+bwd", "matmuls")
        peak = r and r["peak_mem_bytes"]
        add(f"linear_ppo_actor_loss fwd+bwd / 3 bare matmuls, {provider}", "<= 1.10", r,
            mm and r["median_ms"] / mm["median_ms"], "", lin)
        add(f"linear_ppo_actor_loss fwd+bwd extra peak (GiB), {provider}", "<= 1.0", r,
            None if peak is None else peak / GIB, "", lin)
    return out


# ---------------------------------------------------------------- environment


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(device: torch.device) -> dict:
    """Device, versions and source revision for the JSON record."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
           "commit": _git("rev-parse", "HEAD"), "kernels_tree": _git("rev-parse", "HEAD:kernels"),
           }
    status = _git("status", "--porcelain", "--", "kernels", "fastrlhf")
    env["dirty"] = None if status is None else bool(status)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        driver = None
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            if smi.returncode == 0 and smi.stdout.strip():
                driver = smi.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
        env |= {"device": props.name, "kind": "cuda", "driver": driver, "cuda": torch.version.cuda,
                "memory_bytes": props.total_memory, "l2_bytes": getattr(props, "L2_cache_size", None)}
    else:
        cpu = platform.processor() or platform.machine()
        env |= {"device": f"CPU: {cpu}, {torch.get_num_threads()} threads", "kind": "cpu", "driver": None,
                "cuda": None}
    return env


# ---------------------------------------------------------------- output


def _fmt_bytes(n):
    return "-" if n is None else f"{n / 2**20:.0f}"


def print_table(result: dict) -> None:
    """The rows, probes and targets as rich tables on the terminal."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 180)  # no wrapping in logs and pipes
    label = "CPU wall-clock" if result["kind"] == "cpu" else "CUDA do_bench"
    title = (f"fastrlhf bench — {result['device']} ({label}); read probe {result['peak_read_gbps']:.1f} "
             f"GB/s, copy probe {result['peak_copy_gbps']:.1f} GB/s")
    table = Table(title=title)
    numeric = ("ms", "GB/s", "roofline", "x torch", "peak MiB")
    for col in ("op", "pass", "shape", "dtype", "provider", *numeric):
        table.add_column(col, justify="right" if col in numeric else "left", no_wrap=True)
    rows = result["results"]
    for r in rows:
        base = _same_case(rows, r, r["op"], r["pass"], "torch")
        speedup = f"{base['median_ms'] / r['median_ms']:.2f}" if base else "-"
        provider = r["provider"] if r["backend"] == r["provider"] else f"{r['provider']}/{r['backend']}"
        table.add_row(r["op"], r["pass"], r["shape"], r["dtype"], provider, f"{r['median_ms']:.3f}",
                      f"{r['gbps']:.1f}", f"{r['roofline']:.2f}", speedup, _fmt_bytes(r["peak_mem_bytes"]))
    console.print(table)
    cpu_note = " (GPU targets; CPU figures are informative only)" if result["kind"] == "cpu" else ""
    tt = Table(title="speed targets" + cpu_note)
    for col in ("target", "goal", "value", "met", "case", "detail"):
        tt.add_column(col)
    for t in result["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        met = {True: "[green]yes[/]", False: "[red]no[/]", None: "-"}[t["met"]]
        tt.add_row(t["name"], t["goal"], value, met, t.get("case", "-"), t["detail"])
    console.print(tt)
    for note in result["notes"]:
        console.print(f"[dim]note: {note}[/]")
    for s in result["skipped"]:
        console.print(f"[dim]skipped {s['provider']} ({', '.join(s['ops'])}): {s['reason']}[/]")
    for e in result["errors"]:
        console.print(f"[red]fastrlhf failed: {e['op']} {e['shape']} {e['dtype']} {e['pass']}: "
                      f"{e['error']}[/]")


def plot(result: dict, path: str) -> None:
    """Horizontal bars of GB/s per case and provider, with the two probes as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    groups = list(dict.fromkeys((r["op"], r["pass"], r["shape"], r["dtype"]) for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    height = 0.8 / max(len(providers), 1)
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(groups) * max(1, len(providers) / 2) + 1.5))
    for i, provider in enumerate(providers):
        ys, xs = [], []
        for g, key in enumerate(groups):
            r = next((r for r in rows if (r["op"], r["pass"], r["shape"], r["dtype"]) == key
                      and r["provider"] == provider), None)
            if r:
                ys.append(g + i * height)
                xs.append(r["gbps"])
        ax.barh(ys, xs, height=height, label=provider)
    ax.axvline(result["peak_read_gbps"], color="k", linestyle="--", label="read probe")
    ax.axvline(result["peak_copy_gbps"], color="grey", linestyle=":", label="copy probe")
    ax.set_yticks([g + 0.4 - height / 2 for g in range(len(groups))])
    ax.set_yticklabels([f"{op} {p}  {s} {d}" for op, p, s, d in groups], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")  # the Python-loop GAE and the probes are orders of magnitude apart
    ax.set_xlabel("GB/s, log scale (bytes counted once per input and output)")
    ax.set_title(f"fastrlhf bench — {result['device']}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_table(result: dict) -> str:
    """A README table from a result JSON: fastrlhf against torch, torch.compile and the best
    peer per case, then the speed targets, then the command and revision that made it."""
    rows = result["results"]
    keys = list(dict.fromkeys((r["op"], r["pass"], r["shape"], r["dtype"]) for r in rows))
    lines = [f"Measured on {result['device']} (torch {result['torch']}, triton {result['triton']}, "
             f"driver {result.get('driver') or '-'}); read probe {result['peak_read_gbps']:.0f} GB/s, "
             f"copy probe {result['peak_copy_gbps']:.0f} GB/s.", "",
             "| op | pass | shape | dtype | fastrlhf ms | GB/s | roofline | torch ms | torch.compile ms "
             "| best peer ms | peak MiB |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def cell(r):
        return "-" if r is None else f"{r['median_ms']:.3f}"

    for key in keys:
        by = {r["provider"]: r for r in rows if (r["op"], r["pass"], r["shape"], r["dtype"]) == key}
        ours = by.get("fastrlhf")
        peers = [r for p, r in by.items() if p in PEERS]
        best = min(peers, key=lambda r: r["median_ms"], default=None)
        peer = "-" if best is None else f"{best['median_ms']:.3f} ({best['provider']})"
        gbps = "-" if ours is None else f"{ours['gbps']:.0f}"
        roofline = "-" if ours is None else f"{ours['roofline']:.2f}"
        peak = "-" if ours is None else _fmt_bytes(ours["peak_mem_bytes"])
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {cell(ours)} | {gbps} | {roofline} | "
                     f"{cell(by.get('torch'))} | {cell(by.get('torch.compile'))} | {peer} | {peak} |")
    lines += ["", "| target | goal | measured | met |", "| --- | --- | ---: | --- |"]
    for t in result["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        met = {True: "yes", False: "no", None: "-"}[t["met"]]
        lines.append(f"| {t['name']} | {t['goal']} | {value} | {met} |")
    kernels = (result.get("kernels_tree") or "-")[:12]
    lines += ["", f"Command: `{result['command']}` (commit {(result.get('commit') or '-')[:12]}, "
                  f"kernels tree {kernels})."]
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def _csv(choices: tuple[str, ...], what: str):
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad}; expected some of {', '.join(choices)}")
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastrlhf bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--quick", action="store_true", help="small shapes: a CPU run in under two minutes")
    p.add_argument("--ops", type=_csv(tuple(OPS), "op"), default=list(OPS), help="comma list of ops")
    p.add_argument("--providers", type=_csv(PROVIDERS, "provider"), default=None,
                   help=f"comma list of providers (default: all of {', '.join(PROVIDERS)}; "
                        "torch.compile is left out of CPU --quick runs unless named here)")
    p.add_argument("--rep-ms", type=float, default=None,
                   help="timing budget per measurement in ms (default 200 on CUDA, 100 with --quick)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (torch.set_num_threads); 1 avoids thread-pool stalls on a busy box")
    p.add_argument("--json", metavar="PATH", help="write the result JSON here (bench/results/ for GPU runs)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of GB/s per op and provider here")
    return p


def run_bench(args: argparse.Namespace, command: str) -> tuple[dict, Run]:
    """Probe the device, time the selected cases, and assemble the result record."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device} asked for CUDA but torch.cuda.is_available() is False")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    notes = []
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    providers = args.providers
    if providers is None:
        providers = list(PROVIDERS)
        if device.type == "cpu" and args.quick:
            providers.remove("torch.compile")
            notes.append("torch.compile left out of this CPU --quick run (compile time dominates); "
                         "pass --providers to include it")
    env = environment(device)
    if device.type == "cuda":
        l2 = env.get("l2_bytes") or DEFAULT_L2_BYTES
        settings = Settings(device, args.rep_ms or (100.0 if args.quick else 200.0), rotate_bytes=4 * l2)
        probe_bytes = 2 * GIB
    else:
        settings = Settings(device, args.rep_ms or 100.0, rotate_bytes=64 * 2**20)
        probe_bytes = 128 * 2**20
    read_gbps, copy_gbps = probes(settings, probe_bytes)
    selected = [c for c in cases(args.quick) if c.op in args.ops]
    collected = Run()
    from tqdm import tqdm

    for case in tqdm(selected, desc="bench", unit="case", file=sys.stderr):
        bench_case(case, providers, settings, read_gbps, copy_gbps, collected)
    result = {
        **env,
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "timer": ("triton.testing.do_bench median (L2 cleared before each call), inputs rotated over copies "
                  f">= {settings.rotate_bytes} bytes" if device.type == "cuda"
                  else "time.perf_counter wall-clock median (CPU)"),
        "peak_mem_source": ("torch.cuda.max_memory_allocated() above memory_allocated() before the call"
                            if device.type == "cuda" else None),
        "peak_read_gbps": read_gbps,
        "peak_copy_gbps": copy_gbps,
        "probe_bytes": probe_bytes,
        "bytes_counted": {name: OPS[name].doc for name in args.ops},
        "results": collected.rows,
        "targets": targets(collected.rows, read_gbps, copy_gbps),
        "skipped": collected.skipped,
        "errors": collected.errors,
        "notes": notes,
    }
    return result, collected


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    result, collected = run_bench(args, "fastrlhf bench " + shlex.join(argv))
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 1 if collected.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
