"""`fastrlhf estimate`: memory, FLOPs, time and cost of each RLHF stage and PPO phase, before renting GPUs, and the
cost of serving the tuned policy.

Modules: arch (model shapes, presets, parameter counts), hardware (devices), memory (bytes per GPU: ZeRO / FSDP2
model states, activations, log-prob buffers, KV cache), spec (the planner's inputs, one field each), work (FLOPs,
bytes, kernels and host ops of each piece), timing (time from physics and fitted efficiency factors), phases (one
function per phase, in a registry), plan (the estimate, fit per pool, advice), serve (--stage serve), compare
(`--compare-run`), calibrate (the sources, the fit, leave-one-source-out), record (record a run), measure
(`--measure`), cli.
"""

from fastrlhf.estimate.arch import PRESETS, Arch, arch_from_config, format_params, parse_params, resolve_model
from fastrlhf.estimate.cli import main, parser, spec_from_argv
from fastrlhf.estimate.hardware import GPUS, device
from fastrlhf.estimate.measure import TINY_LLAMA, build_tiny_model, measure, measure_states
from fastrlhf.estimate.memory import DTYPE_BYTES, state_bytes, state_table
from fastrlhf.estimate.plan import COMPONENTS, PPO_PHASES, STAGES, Spec, estimate, make_plan

__all__ = ["PRESETS", "Arch", "arch_from_config", "format_params", "parse_params", "resolve_model", "main",
           "parser", "spec_from_argv", "GPUS", "device", "TINY_LLAMA", "build_tiny_model", "measure",
           "measure_states", "DTYPE_BYTES", "state_bytes", "state_table", "COMPONENTS", "PPO_PHASES", "STAGES",
           "Spec", "estimate", "make_plan"]
