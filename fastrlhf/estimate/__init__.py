"""`fastrlhf estimate`: memory, FLOPs, time and cost of each RLHF stage and PPO phase, before renting GPUs.

Modules: arch (model shapes, presets, parameter counts), hardware (devices), memory (bytes per GPU:
ZeRO / FSDP2 model states, activations, log-prob buffers, KV cache), timing (time from work and
calibrated coefficients), plan (the estimate, fit per pool, advice), compare (`--compare-run`),
calibrate (the calibration points and the fit), record (record a run), measure (`--measure`), cli.
"""

from fastrlhf.estimate.arch import PRESETS, Arch, arch_from_config, format_params, parse_params, resolve_model
from fastrlhf.estimate.cli import main, parser, spec_from_args
from fastrlhf.estimate.hardware import GPUS, device
from fastrlhf.estimate.measure import TINY_LLAMA, build_tiny_model, measure, measure_states
from fastrlhf.estimate.memory import DTYPE_BYTES, state_bytes, state_table
from fastrlhf.estimate.plan import COMPONENTS, PPO_PHASES, STAGES, Spec, estimate

__all__ = ["PRESETS", "Arch", "arch_from_config", "format_params", "parse_params", "resolve_model", "main",
           "parser", "spec_from_args", "GPUS", "device", "TINY_LLAMA", "build_tiny_model", "measure",
           "measure_states", "DTYPE_BYTES", "state_bytes", "state_table", "COMPONENTS", "PPO_PHASES", "STAGES",
           "Spec", "estimate"]
