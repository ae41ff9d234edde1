"""The planner: memory per GPU, FLOPs and time of each RLHF stage and phase, fit per pool, what to change.

`make_plan(Spec(...))` returns a typed `Plan`; `estimate(Spec(...))` or `estimate(model="llama-3-8b", stage="ppo",
gpus=8, zero=3)` its `--json` schema. The phases of each stage are registered in phases.py; --stage serve is
serve.py.

Fit: a pool fits when its peak allocated bytes plus the CUDA context (`Device.context_bytes`, 1 GiB: the CUDA
context, cuBLAS workspaces and NCCL communicators, which torch.cuda.max_memory_allocated does not count) are at
most the GPU's memory; it is `tight` when what is left is under FRAGMENTATION of the GPU, the caching allocator's
reserve of freed blocks that a run may or may not get back. The evidence: DeepSpeed-Chat's step-3 log on a
V100-32G prints 19.61 GiB free of 31.75 while 10.77 GiB are allocated, 1.37 GiB (4.3%) of context and allocator
cache; a run that completed is never judged not to fit on that allowance (tests/estimate/test_calibration.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import fastrlhf.estimate.timing as timing
from fastrlhf.estimate.arch import Arch, format_params
from fastrlhf.estimate.hardware import Device, device
from fastrlhf.estimate.memory import ModelState, fill_states, largest_layer_params
from fastrlhf.estimate.phases import (
    COMPONENTS,
    PPO_PHASES,
    STAGE_MODELS,
    STAGE_PHASES,
    Context,
    Phase,
    host_engine,
)
from fastrlhf.estimate.serve import serve
from fastrlhf.estimate.spec import (
    POOLS,
    STAGES,
    Spec,
    actor_arch,
    check,
    other_arch,
    resolved,
    student_arch,
    zero_items,
    zero_of,
)

__all__ = ["COMPONENTS", "PPO_PHASES", "STAGES", "POOLS", "Spec", "Plan", "StageResult", "estimate", "make_plan",
           "resolved", "check", "host_engine", "phase_works"]

SERVE_STUDENT = "serve_student"  # --stage serve --student: the student's serving cost, beside the model's
FRAGMENTATION = 0.05  # of the GPU's memory: the allocator's cache of freed blocks (the module docstring)


# ---------------------------------------------------------------------------------------------
# Models and pools


def pool_gpus(spec: Spec) -> dict[str, int]:
    return {"all": spec.gpus} if spec.placement == "colocated" else dict(spec.pools)


def build_models(spec: Spec, arch: Arch, stage: str) -> list[ModelState]:
    """The models a stage keeps (phases.register_models), with their bytes per GPU."""
    gpus = pool_gpus(spec)
    models = []
    for role in STAGE_MODELS[stage](dataclasses.replace(spec, stage=stage), arch,
                                    lambda value, what: other_arch(value, arch, what)):
        pool = "all" if spec.placement == "colocated" else role.pool
        if pool not in gpus:
            raise ValueError(f"pools: no pool for the {role.name} ({role.pool}=N)")
        m = ModelState(role.name, role.arch, role.trainable, gpus[pool], zero_of(spec, role.name),
                       lm_head=role.lm_head, shares_base=role.name == "reference" and spec.lora_rank > 0,
                       offloaded=spec.offload_frozen and role.name in ("reference", "reward"), pool=pool)
        models.append(fill_states(m, engine=spec.engine, dtype=spec.dtype, lora_rank=spec.lora_rank,
                                  lora_targets=spec.lora_targets, qlora=spec.qlora, offload=spec.offload,
                                  reward_fp32=spec.engine == "fsdp2"))
    return models


def largest_layer(arch: Arch) -> int:
    return largest_layer_params(arch)


# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class PoolFit:
    """A pool's peak over the phases, where and what sets it, and the verdict."""

    gpus: int
    peak: int
    phase: str
    component: str
    fits: bool
    tight: bool


@dataclass
class StageResult:
    stage: str
    phases: dict[str, Phase]
    models: list[ModelState]
    pools: dict[str, PoolFit]
    advice: dict | None = None

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.pools.values())

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases.values())

    def dominant_phase(self) -> str | None:
        return max(self.phases, key=lambda k: self.phases[k].seconds) if len(self.phases) > 1 else None

    def to_json(self, spec: Spec) -> dict:
        steps, seconds = spec.steps, self.seconds
        worst = max(self.phases.values(), key=lambda p: p.peak_memory().peak)
        ranges = [p.seconds_range() for p in self.phases.values()]
        gpus = sum(pool_gpus(spec).values())
        out = {
            "memory_per_gpu_bytes": worst.peak_memory().to_json(),
            "fits": self.fits,
            "tight": any(p.tight for p in self.pools.values()),
            "host_memory_per_gpu_bytes": int(max(sum(m.host_bytes for m in self.models if m.pool == pool)
                                                 for pool in pool_gpus(spec))),
            "pools": {k: dataclasses.asdict(v) for k, v in self.pools.items()},
            "flops": sum(p.flops for p in self.phases.values()) * steps,
            "seconds": seconds * steps,
            "seconds_range": [sum(r[0] for r in ranges) * steps, sum(r[1] for r in ranges) * steps],
            "cost_usd": seconds * steps * gpus * spec.price / 3600,
            "dominant_phase": self.dominant_phase(),
            "models": {m.name: {"params": m.arch.params(), "trainable_params": m.trainable_params, "pool": m.pool,
                                "gpus": m.gpus, "zero": m.zero, "weights": int(m.weights),
                                "gradients": int(m.gradients), "optimizer": int(m.optimizer),
                                "buffers": int(m.buffers()), "host_bytes": int(m.host_bytes)} for m in self.models},
            "phases": {name: _phase_json(p, steps, seconds) for name, p in self.phases.items()},
        }
        if self.advice is not None:
            out["advice"] = self.advice
        return out


def _phase_json(p: Phase, steps: int, stage_seconds: float) -> dict:
    out = {"memory_per_gpu_bytes": p.peak_memory().to_json(),
           "memory_by_pool": {k: m.to_json() for k, m in p.memory.items()},
           "flops": p.flops * steps, "seconds": p.seconds * steps,
           "seconds_range": [x * steps for x in p.seconds_range()],
           "seconds_by_pool": {k: v * steps for k, v in p.seconds_by_pool().items()},
           "terms": {k: v * steps if k != "host_bound_share" else v for k, v in p.terms().items()},
           "share": p.seconds / stage_seconds if stage_seconds else 0.0, "group": p.group}
    if p.work_by_model:
        out["seconds_by_model"] = {k: float(timing.seconds(w)) * steps for k, w in p.work_by_model.items()}
    if p.engines is not None:
        out["engines"] = p.engines
    if p.optimizer_steps is not None:
        out["optimizer_steps"] = p.optimizer_steps
    return out


@dataclass
class Plan:
    spec: Spec
    arch: Arch
    dev: Device
    stages: dict[str, StageResult | object] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"params": self.arch.params(), "params_text": format_params(self.arch.params()),
                "device": self.dev.name, "stages": {k: v.to_json(self.spec) for k, v in self.stages.items()}}


# ---------------------------------------------------------------------------------------------
# Fit: which component breaks the budget, and what to change


def _limit(dev: Device) -> float:
    return dev.memory_bytes - dev.context_bytes


def pool_fit(phases: dict[str, Phase], dev: Device, gpus: dict[str, int]) -> dict[str, PoolFit]:
    """Per pool: the peak over phases, the phase and component that set it, fits (and tight) or not."""
    pools: dict[str, PoolFit] = {}
    for name, p in phases.items():
        for pool, mem in p.memory.items():
            peak = mem.peak
            if pool not in pools or peak > pools[pool].peak:
                left = _limit(dev) - peak
                pools[pool] = PoolFit(gpus[pool], peak, name, mem.largest(), left >= 0,
                                      0 <= left < FRAGMENTATION * dev.memory_bytes)
    return pools


def run_stage(spec: Spec, stage: str) -> StageResult:
    """Every registered phase of the stage, in order, and the fit of each pool."""
    arch, dev = actor_arch(spec), device(spec.gpu)
    models = build_models(spec, arch, stage)
    ctx = Context(spec, stage, arch, dev, models, pool_gpus(spec))
    phases = {name: phase for name, fn in STAGE_PHASES[stage].items() if (phase := fn(ctx)) is not None}
    return StageResult(stage, phases, models, pool_fit(phases, dev, pool_gpus(spec)))


def _peak_of(spec: Spec, stage: str) -> float:
    try:
        check(spec)
        r = run_stage(spec, stage)
    except ValueError:
        return float("inf")
    return max(p.peak for p in r.pools.values())


def _candidates(spec: Spec, stage: str) -> list[tuple[str, dict]]:
    """Single changes that can lower the peak: (flag text, Spec changes)."""
    dev = device(spec.gpu)
    top = max(s for _, s in zero_items(spec.zero))
    out = [(f"--zero {z}", {"zero": z}) for z in ((2, 3) if spec.engine == "fsdp2" else (1, 2, 3)) if z > top]
    if spec.lora_rank == 0 and stage != "rm":
        out.append(("--lora-rank 16", {"lora_rank": 16}))
    if spec.offload == "none" and dev.kind == "gpu":
        if spec.engine == "deepspeed":
            out.append(("--offload optimizer" + (" --zero 2" if top < 1 else ""),
                        {"offload": "optimizer", "zero": 2 if top < 1 else spec.zero}))
        out.append(("--offload params" + (" --zero 3" if top < 3 else ""),
                    {"offload": "params", "zero": 3 if top < 3 else spec.zero}))
    if not spec.offload_frozen and stage in ("ppo", "grpo", "dpo"):
        out.append(("--offload-frozen", {"offload_frozen": True}))
    if not spec.gradient_checkpointing:
        out.append(("--gradient-checkpointing", {"gradient_checkpointing": True}))
    if spec.micro_batch > 1:
        out.append(("--micro-batch 1", {"micro_batch": 1}))
    if stage in ("ppo", "grpo") or (stage == "distill" and spec.on_policy):
        per_gpu = spec.rollout_batch * spec.num_generations / max(pool_gpus(spec).values())
        if (spec.micro_rollout_batch or per_gpu) > 4:
            out.append(("--micro-rollout-batch 4", {"micro_rollout_batch": 4}))
    if spec.placement == "colocated":
        out.append((f"--gpus {2 * spec.gpus} --zero 3", {"gpus": 2 * spec.gpus, "zero": 3}))
    return out


def advice(spec: Spec, stage: str, max_steps: int = 8) -> dict:
    """What to change so it fits: each single change with its predicted peak per GPU (the worst pool), and a greedy
    path that applies the change lowering the peak most, one after another, until it fits."""
    limit = _limit(device(spec.gpu))

    def row(what: str, value: float) -> dict:
        return {"change": what, "peak_bytes": int(value), "fits": value <= limit}

    current_peak = _peak_of(spec, stage)
    singles = []
    for what, changes in _candidates(spec, stage):
        value = _peak_of(dataclasses.replace(spec, **changes), stage)
        if value < current_peak:
            singles.append(row(what, value))
    path, current = [], spec
    for _ in range(max_steps):
        if current_peak <= limit:
            break
        options = [(_peak_of(dataclasses.replace(current, **c), stage), what, c)
                   for what, c in _candidates(current, stage)]
        options = [o for o in options if o[0] < current_peak]
        if not options:
            break
        current_peak, what, changes = min(options, key=lambda o: o[0])
        current = dataclasses.replace(current, **changes)
        path.append(row(what, current_peak))
    return {"single": singles, "path": path}


# ---------------------------------------------------------------------------------------------
# The estimate


def make_plan(spec: Spec | None = None, **overrides) -> Plan:
    """Every stage the spec asks for (--stage all: sft, rm, ppo), typed."""
    spec = resolved(dataclasses.replace(spec or Spec(), **overrides))
    check(spec)
    out = Plan(spec, actor_arch(spec), device(spec.gpu))
    if spec.stage == "serve":
        out.stages["serve"] = serve(spec)
        if spec.student is not None:  # the distilled student, served the same way
            out.stages[SERVE_STUDENT] = serve(spec, student_arch(spec))
        return out
    for stage in ("sft", "rm", "ppo") if spec.stage == "all" else (spec.stage,):
        result = run_stage(spec, stage)
        if not result.fits:
            result.advice = advice(spec, stage)
        out.stages[stage] = result
    return out


def estimate(spec: Spec | None = None, **overrides) -> dict:
    """Memory per GPU, FLOPs, seconds (with ranges) and cost of each stage: the `--json` schema."""
    return make_plan(spec, **overrides).to_json()


def phase_works(spec: Spec) -> dict[str, timing.Work]:
    """The work of each PPO / GRPO phase on its slowest pool, and 'update:<model>' per trained model
    (what `python -m fastrlhf.estimate.calibrate` fits the factors to)."""
    spec = resolved(spec)
    check(spec)
    stage = spec.stage if spec.stage in ("ppo", "grpo") else "ppo"
    result = run_stage(spec, stage)
    out = {k: p.slowest_work() for k, p in result.phases.items()}
    out.update({f"update:{m}": w for m, w in result.phases["update"].work_by_model.items()})
    return out
