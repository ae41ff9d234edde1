"""What is measured: cases (one op at one shape and dtype), their inputs, and the bytes and
FLOPs each pass is credited with.

A case is timed for one or more passes:
    fwd      the forward under torch.no_grad() (old / reference log-probs in a rollout)
    bwd      the backward alone, through a graph built once (`retain_graph=True`)
    fwd+bwd  forward with autograd, then backward (one training step's share)

Bytes: each input read once and each output written once, per pass (`Op.doc` lists them
per op); fwd+bwd counts both passes. A provider that materialises intermediates moves more
bytes than it is credited with, so GB/s compares providers at equal work.

Case sets (`cases(name)`):
    targets  the target shapes of issues 13 and 23 (the few-rows log-prob case, the [B, T] ops at
             [1024 x 4096] and [4 x 256]): what `bench/gpu_run.sh --only ops` times
    full     the targets plus more vocab sizes, fp32 and a smaller grid (the default on CUDA)
    quick    small shapes: every op on a 2-core CPU in about a minute
    tiny     smaller still: every op, provider and pass in seconds (CI, `gpu_run.sh --dry-run`)
    decode_attention
             decode_attention alone at the Qwen2.5-0.5B and 7B head shapes, B in {64, 256}, t in {512, 2048,
             4096} written slots of T = 4608, G in {1, 8}: what `bench/gpu_run.sh --only decode_attention` times
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

PASSES = ("fwd", "bwd", "fwd+bwd")
ALL3, FWD_FULL = PASSES, ("fwd", "fwd+bwd")

# the shapes of the speed targets (issue 13)
LOGITS_TARGET = {"B": 16, "T": 1024, "V": 151936}  # 16384 tokens x Qwen2's vocab
LOGITS_TARGET_50K = {"B": 16, "T": 1024, "V": 50257}  # GPT-2's vocab: rows not a multiple of 16 elements
LOGITS_FEW_ROWS = {"B": 1, "T": 128, "V": 151936}  # under one wave of the GPU: the vocab split over programs
LINEAR_TARGET = {"N": 16384, "H": 4096, "V": 151936}
GRID_TARGET = {"B": 1024, "T": 4096}
GRID_SMALL = {"B": 4, "T": 256}  # a small micro-batch: where host time decides (issue 23)
# decode attention: the query / KV heads and head dim of Qwen2.5-0.5B and 7B, over a static cache of T slots of
# which t are written; G > 1: the first half of the written slots is a prompt shared by G consecutive rows
DECODE_HEADS = {"qwen2.5-0.5b": {"Hq": 14, "Hkv": 2, "D": 64}, "qwen2.5-7b": {"Hq": 28, "Hkv": 4, "D": 128}}
DECODE_T = 4608
DECODE_TARGET = {"B": 64, **DECODE_HEADS["qwen2.5-7b"], "T": DECODE_T, "t": 4096}


@dataclass(frozen=True)
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


def _grid_cases(bt: dict[str, int]) -> list[Case]:
    f32 = torch.float32
    return [Case("token_kl", bt, f32, FWD_FULL), Case("kl_shaped_rewards", bt, f32, ("fwd",)),
            Case("gae", bt, f32, ("fwd",)), Case("policy_loss", bt, f32, FWD_FULL),
            Case("value_loss", bt, f32, FWD_FULL)]


def _decode_cases(dims: list[dict], groups=(1, 8)) -> list[Case]:
    return [Case("decode_attention", d | {"G": g}, torch.bfloat16, ("fwd",)) for d in dims for g in groups]


def _small_cases(vocab, linear, grid) -> list[Case]:
    out = [Case("logprobs", d, t, ALL3) for d, t in vocab]
    out += [Case("ppo_actor_loss", d, t, FWD_FULL) for d, t in vocab]
    out += [Case("linear_logprobs", d, t, ALL3) for d, t in linear]
    out += [Case("linear_ppo_actor_loss", d, t, FWD_FULL) for d, t in linear]
    out += [Case("linear_distill_loss", d, t, ("fwd+bwd",)) for d, t in linear]
    return out + _grid_cases(grid)


def _target_cases() -> list[Case]:
    bf16 = torch.bfloat16
    return [Case("logprobs", LOGITS_TARGET, bf16, ALL3), Case("logprobs", LOGITS_TARGET_50K, bf16, ALL3),
            Case("logprobs", LOGITS_FEW_ROWS, bf16, ALL3),
            Case("ppo_actor_loss", LOGITS_TARGET, bf16, FWD_FULL),
            Case("linear_logprobs", LINEAR_TARGET, bf16, ALL3),
            Case("linear_ppo_actor_loss", LINEAR_TARGET, bf16, FWD_FULL),
            Case("linear_distill_loss", LINEAR_TARGET, bf16, ("fwd+bwd",)), *_grid_cases(GRID_TARGET),
            *_grid_cases(GRID_SMALL), *_decode_cases([DECODE_TARGET])]


def _full_cases() -> list[Case]:
    bf16, f32 = torch.bfloat16, torch.float32
    out = _target_cases()
    out += [Case("logprobs", {"B": b, "T": 1024, "V": v}, bf16, ALL3)
            for b, v in [(4, 32000), (16, 128256), (32, 151936)]]
    out += [Case("logprobs", {"B": b, "T": 1024, "V": v}, f32, ALL3) for b, v in [(4, 32000), (16, 151936)]]
    out += [Case("ppo_actor_loss", {"B": 4, "T": 1024, "V": 32000}, t, FWD_FULL) for t in (bf16, f32)]
    out += [Case("ppo_actor_loss", LOGITS_TARGET_50K, bf16, ("fwd+bwd",))]
    out += [Case("linear_logprobs", {"N": 4096, "H": 4096, "V": 32000}, bf16, ALL3)]
    out += _decode_cases([{"B": 256, **DECODE_HEADS["qwen2.5-0.5b"], "T": DECODE_T, "t": 2048}])
    return out + _grid_cases({"B": 256, "T": 1024})


def _quick_cases() -> list[Case]:
    vocab = [({"B": 2, "T": 256, "V": 32000}, torch.float32), ({"B": 2, "T": 128, "V": 32000}, torch.bfloat16)]
    return _small_cases(vocab, [({"N": 512, "H": 256, "V": 8000}, torch.float32)], {"B": 64, "T": 512}) + \
        _decode_cases([{"B": 16, **DECODE_HEADS["qwen2.5-0.5b"], "T": 1024, "t": 512}])


def _tiny_cases() -> list[Case]:
    vocab = [({"B": 2, "T": 32, "V": 4000}, torch.float32), ({"B": 2, "T": 16, "V": 4001}, torch.bfloat16)]
    return _small_cases(vocab, [({"N": 64, "H": 32, "V": 1000}, torch.float32)], {"B": 8, "T": 64}) + \
        _decode_cases([{"B": 4, "Hq": 4, "Hkv": 2, "D": 16, "T": 96, "t": 40}], groups=(1, 2))


def _decode_attention_cases() -> list[Case]:
    return _decode_cases([{"B": B, **heads, "T": DECODE_T, "t": t} for heads in DECODE_HEADS.values()
                          for B in (64, 256) for t in (512, 2048, 4096)])


CASE_SETS: dict[str, Callable[[], list[Case]]] = {
    "targets": _target_cases, "full": _full_cases, "quick": _quick_cases, "tiny": _tiny_cases,
    "decode_attention": _decode_attention_cases}
OP_SETS = ("decode_attention",)  # case sets of one op, named after it


def cases(name: str = "full") -> list[Case]:
    """The cases of one set (see the module docstring)."""
    if name not in CASE_SETS:
        raise ValueError(f"case set must be one of {', '.join(CASE_SETS)}, got {name!r}")
    return CASE_SETS[name]()


# ---------------------------------------------------------------- inputs


def _randn(shape, device, gen, dtype=torch.float32, scale=1.0):
    return torch.randn(shape, device=device, generator=gen, dtype=dtype).mul_(scale)


def _mask(B, T, device, gen):
    """Right padding with random response lengths in [T/4, T]."""
    lengths = torch.randint(max(T // 4, 1), T + 1, (B, 1), device=device, generator=gen)
    return torch.arange(T, device=device) < lengths


def _logp(shape, device, gen):
    return -_randn(shape, device, gen).abs_().mul_(2.0)


def _actor_extras(B, T, device, gen) -> dict:
    return {"old_logp": _logp((B, T), device, gen), "advantages": _randn((B, T), device, gen),
            "mask": _mask(B, T, device, gen), "ref_logp": _logp((B, T), device, gen)}


def _logits_inputs(case: Case, device, gen) -> dict:
    B, T, V = case.dims["B"], case.dims["T"], case.dims["V"]
    return {"logits": _randn((B, T, V), device, gen, case.dtype, 2.0).requires_grad_(),
            "labels": torch.randint(0, V, (B, T), device=device, generator=gen)}


def _actor_inputs(case: Case, device, gen) -> dict:
    return _logits_inputs(case, device, gen) | _actor_extras(case.dims["B"], case.dims["T"], device, gen)


def _linear_inputs(case: Case, device, gen) -> dict:
    N, H, V = case.dims["N"], case.dims["H"], case.dims["V"]
    return {"hidden": _randn((N, H), device, gen, case.dtype).requires_grad_(),
            "weight": _randn((V, H), device, gen, case.dtype, H**-0.5).requires_grad_(),
            "labels": torch.randint(0, V, (N,), device=device, generator=gen)}


def _linear_actor_inputs(case: Case, device, gen) -> dict:
    """As `_linear_inputs`, as one sequence of N tokens: hidden [1, N, H], labels [1, N]."""
    inputs = _linear_inputs(case, device, gen)
    N = case.dims["N"]
    inputs = {"hidden": inputs["hidden"].detach().view(1, N, -1).requires_grad_(), "weight": inputs["weight"],
              "labels": inputs["labels"].view(1, N)}
    return inputs | _actor_extras(1, N, device, gen)


def _distill_inputs(case: Case, device, gen) -> dict:
    """A student and a teacher of the same shape, [N, H] hidden and [V, H] lm_heads, and a mask of every
    row: TRL's chunked kernel projects only the mask's rows, so equal work needs them all."""
    student, teacher = _linear_inputs(case, device, gen), _linear_inputs(case, device, gen)
    return {"student_hidden": student["hidden"], "student_weight": student["weight"],
            "teacher_hidden": teacher["hidden"].detach(), "teacher_weight": teacher["weight"].detach(),
            "mask": torch.ones(case.dims["N"], dtype=torch.bool, device=device)}


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


def decode_prefix_slots(case: Case) -> int:
    """P: the written slots of a decode case that its G rows share (the first half), 0 for G = 1."""
    return case.dims["t"] // 2 if case.dims["G"] > 1 else 0


def _decode_inputs(case: Case, device, gen) -> dict:
    """One cache [B, H_kv, T, D] with t slots written per row, and views of it: `k_written` / `v_written`, the
    written slice (what a provider without a shared prefix reads); with G > 1 the prompt, its first P slots,
    as the prefix `k_prefix` = its rows 0, G, 2G, ... and the rest as the suffix cache."""
    B, H_q, H_kv, D, T, t, G = (case.dims[k] for k in ("B", "Hq", "Hkv", "D", "T", "t", "G"))
    P = decode_prefix_slots(case)
    k, v = _randn((B, H_kv, T, D), device, gen, case.dtype), _randn((B, H_kv, T, D), device, gen, case.dtype)
    full = functools.partial(torch.full, dtype=torch.int32, device=device)
    out = {"q": _randn((B, H_q, 1, D), device, gen, case.dtype), "k_written": k[:, :, :t], "v_written": v[:, :, :t],
           "written": full((B,), t), "k_cache": k[:, :, P:], "v_cache": v[:, :, P:], "lengths": full((B,), t - P)}
    if G > 1:
        out |= {"k_prefix": k[::G, :, :P], "v_prefix": v[::G, :, :P], "prefix_lengths": full((B // G,), P)}
    return out


# ---------------------------------------------------------------- bytes and FLOPs


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


def _distill_bytes(case: Case) -> dict[str, int]:
    N, H, V, e = case.dims["N"], case.dims["H"], case.dims["V"], _nbytes(case.dtype)
    ins = 2 * (N * H * e + V * H * e) + N
    return {"fwd": ins, "bwd": ins + N * H * e + V * H * e}


def _distill_flops(case: Case) -> dict[str, int]:
    """Four matmuls: both models' logits forward, d(hidden) and d(weight) of the student backward."""
    N, H, V = case.dims["N"], case.dims["H"], case.dims["V"]
    return {"fwd": 4 * N * H * V, "bwd": 4 * N * H * V}


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


def _decode_bytes(case: Case) -> dict[str, int]:
    """The K / V bytes the work needs (t written slots per row; the shared prompt once per group), q and out."""
    B, H_q, H_kv, D, t, G = (case.dims[k] for k in ("B", "Hq", "Hkv", "D", "t", "G"))
    P, e = decode_prefix_slots(case), _nbytes(case.dtype)
    slots = B // G * P + B * (t - P)
    return {"fwd": 2 * slots * H_kv * D * e + 2 * B * H_q * D * e}


# ---------------------------------------------------------------- ops


@dataclass(frozen=True)
class Op:
    """How to make one op's inputs and count its bytes (and FLOPs, for the matmul-bound ops)."""

    name: str
    inputs: Callable[[Case, torch.device, torch.Generator], dict]
    bytes: Callable[[Case], dict[str, int]]  # {"fwd": n, "bwd": n}; fwd+bwd is their sum
    doc: str
    flops: Callable[[Case], dict[str, int]] | None = None
    no_compile: str | None = None  # why torch.compile is not run, if it is not


OPS: dict[str, Op] = {op.name: op for op in [
    Op("logprobs", _logits_inputs, _logprobs_bytes,
       "fwd: logits [B,T,V], labels int64 in, logp fp32 out; bwd: logits, labels, d(logp) in, d(logits) out"),
    Op("ppo_actor_loss", _actor_inputs, _actor_bytes,
       "fwd: logits [B,T,V], labels int64, old_logp, advantages, ref_logp fp32, mask bool in (scalar out); "
       "bwd: the same in, d(logits) out. kl_coef=0.05, entropy_coef=0.01. No bwd alone: the loss allows one "
       "backward (d(logits) is formed in the forward)"),
    Op("linear_logprobs", _linear_inputs, _linear_bytes,
       "fwd: hidden [N,H], weight [V,H], labels int64 in, logp fp32 out; "
       "bwd: hidden, weight, labels, d(logp) in, d(hidden), d(weight) out", flops=_linear_flops),
    Op("linear_ppo_actor_loss", _linear_actor_inputs, functools.partial(_linear_bytes, actor=True),
       "fwd: hidden [N,H], weight [V,H], labels, old_logp, advantages, ref_logp, mask in; "
       "bwd: the same in, d(hidden), d(weight) out. kl_coef=0.05, entropy_coef=0.01", flops=_linear_flops),
    Op("linear_distill_loss", _distill_inputs, _distill_bytes,
       "fwd+bwd: student hidden [N,H], weight [V,H], teacher hidden [N,H], weight [V,H], mask bool in, "
       "d(student hidden), d(student weight) out; beta=0.5 (generalized JSD). No fwd or bwd alone: the loss "
       "allows one backward (the gradients are formed in the forward)", flops=_distill_flops,
       no_compile="the materialised reference holds both models' [N, V] logits and their temporaries"),
    Op("token_kl", _grid_inputs("logp", "ref_logp", grad="logp", logp=("logp", "ref_logp"), mask=False),
       _grid_bytes(2, 1, grad=True, mask=False),
       "fwd: logp, ref_logp fp32 [B,T] in, kl out (k3); bwd: logp, ref_logp, d(kl) in, d(logp) out"),
    Op("kl_shaped_rewards", _grid_inputs("logp", "ref_logp", scores=True, logp=("logp", "ref_logp")),
       _grid_bytes(2, 1, per_row=1),
       "fwd: scores [B], logp, ref_logp fp32 [B,T], mask bool in, rewards fp32 out (k1, kl_coef=0.05)",
       no_compile="the reference loops over B with a data-dependent branch per row"),
    Op("gae", _grid_inputs("rewards", "values"), _grid_bytes(2, 2),
       "fwd: rewards, values fp32 [B,T], mask bool in, advantages, returns fp32 out "
       "(gamma=1, lam=0.95, skip mode, whitened); torch = the Python loop over T",
       no_compile="the reference is a Python loop over T; compile would unroll T steps"),
    Op("policy_loss", _grid_inputs("logp", "old_logp", "advantages", grad="logp", logp=("logp", "old_logp")),
       _grid_bytes(3, 0, grad=True),
       "fwd: logp, old_logp, advantages fp32 [B,T], mask bool in (scalar out); bwd: the same in, d(logp) out. "
       "No bwd alone: d(logp) is formed in the forward, the backward scales it in place"),
    Op("value_loss", _grid_inputs("values", "old_values", "returns", grad="values"), _grid_bytes(3, 0, grad=True),
       "fwd: values, old_values, returns fp32 [B,T], mask bool in (scalar out); bwd: the same in, "
       "d(values) out (clip=0.2)"),
    Op("decode_attention", _decode_inputs, _decode_bytes,
       "fwd: q [B,Hq,1,D] bf16, K and V of t written slots per row of a [B,Hkv,T,D] cache (G > 1: the first t/2 a "
       "prompt shared by G rows, counted once per group) in, out [B,Hq,1,D] out; scale D^-0.5. Peers attend each "
       "row's t written slots (no shared prefix)"),
]}


def case_bytes(case: Case) -> dict[str, int]:
    """Bytes counted per pass: each input read once, each output written once (see Op.doc);
    fwd+bwd is the sum of the two passes."""
    counted = OPS[case.op].bytes(case)
    counted["fwd+bwd"] = counted["fwd"] + counted.get("bwd", 0)
    return counted


def case_flops(case: Case, pass_: str) -> int | None:
    """FLOPs of the matmul-bound ops for one pass, else None."""
    flops = OPS[case.op].flops
    if flops is None:
        return None
    counted = flops(case)
    return counted["fwd"] + counted["bwd"] if pass_ == "fwd+bwd" else counted[pass_]
