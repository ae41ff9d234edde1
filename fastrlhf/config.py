"""One dataclass per stage; a docstring under every field; YAML file + `--key value` overrides.

    cfg = parse_args(PPOConfig, ["--config", "ppo.yaml", "--lr", "1e-5"])

Precedence: dataclass default < YAML file (`--config`) < command line. Nested dataclasses
(the pipeline's `sft`, `rm`, `ppo`) are addressed with dots: `--ppo.steps 20`, or a nested
mapping in YAML. An unknown key, in the file or on the command line, is a ValueError that
lists the valid keys. `--help` prints every key with its docstring.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass
class SFTConfig:
    """Supervised fine-tuning on (prompt, response) pairs; loss on response tokens only."""

    model: str = "tiny"
    """Local Hugging Face causal-LM directory, or a built-in config name with random weights
    (`tiny`, `qwen2-0.5b`, `llama-0.5b`); `tiny` also builds the embedded char tokenizer."""
    data: str = ""
    """JSONL file with {"prompt", "response"} per line; empty = the built-in synthetic task."""
    out: str = "runs/default"
    """Run directory: metrics.jsonl, summary.json, plots/ and the stage folder `sft/`."""
    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 32
    """Sequences per optimizer step."""
    lr: float = 3e-3
    """AdamW learning rate (constant after a short warm-up)."""
    max_prompt_len: int = 32
    """Prompt tokens kept (longer prompts are truncated from the left, with a warning)."""
    max_response_len: int = 16
    """Response tokens kept, EOS included."""
    num_examples: int = 4000
    """Synthetic task only: number of (prompt, response) pairs to make."""
    seed: int = 0
    """Seed for data, initialisation and sampling."""
    log_every: int = 10
    """Write a metrics.jsonl row every this many steps."""
    save_every: int = 50
    """Checkpoint every this many steps (and at the end)."""
    stop_after: int = 0
    """Stop (with a checkpoint) after this many steps of this invocation; 0 = run to the end.
    Used to test `--resume` and for time-boxed jobs."""
    resume: bool = False
    """Continue from the latest checkpoint in the stage folder."""
    tensorboard: bool = False
    """Also write TensorBoard event files under OUT/tb/."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    device: str = "auto"
    """`auto` (CUDA if available), `cpu` or `cuda`."""


@dataclass
class RMConfig:
    """Bradley-Terry reward model on (prompt, chosen, rejected), initialised from the SFT model."""

    model: str = ""
    """SFT model directory to start from; empty = OUT/sft/final."""
    data: str = ""
    """JSONL file with {"prompt", "chosen", "rejected"} per line; empty = the synthetic task."""
    out: str = "runs/default"
    """Run directory shared with the other stages; the stage folder is `rm/`."""
    steps: int = 400
    """Optimizer steps."""
    batch_size: int = 32
    """Preference pairs per optimizer step."""
    lr: float = 1e-3
    """AdamW learning rate."""
    max_prompt_len: int = 32
    """Prompt tokens kept (left-truncated, with a warning)."""
    max_response_len: int = 16
    """Response tokens kept, EOS included."""
    num_pairs: int = 3000
    """Synthetic task only: number of preference pairs (10% are held out for accuracy)."""
    eval_fraction: float = 0.1
    """Fraction of the pairs held out to measure pairwise accuracy."""
    eval_every: int = 50
    """Measure the held-out accuracy every this many steps (and at the end)."""
    seed: int = 0
    """Seed for data, initialisation and shuffling."""
    log_every: int = 10
    """Write a metrics.jsonl row every this many steps."""
    save_every: int = 50
    """Checkpoint every this many steps (and at the end)."""
    stop_after: int = 0
    """Stop (with a checkpoint) after this many steps of this invocation; 0 = run to the end."""
    resume: bool = False
    """Continue from the latest checkpoint in the stage folder."""
    tensorboard: bool = False
    """Also write TensorBoard event files under OUT/tb/."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    device: str = "auto"
    """`auto` (CUDA if available), `cpu` or `cuda`."""


@dataclass
class PPOConfig:
    """PPO with a shared actor-critic, a LoRA-disabled (or frozen-copy) reference and KL-shaped rewards."""

    model: str = ""
    """Policy: a local HF causal-LM directory or a built-in config name (`tiny`, `qwen2-0.5b`,
    `llama-0.5b`; random weights); empty = OUT/sft/final."""
    reward: str = ""
    """Reward: a reward-model directory written by `fastrlhf rm`, or a Python callable
    `module:function` taking (prompts, responses) -> list of floats; empty = OUT/rm/final."""
    data: str = ""
    """JSONL file with {"prompt"} per line; empty = the synthetic task's prompts."""
    out: str = "runs/default"
    """Run directory shared with the other stages; the stage folder is `ppo/`."""
    steps: int = 60
    """PPO iterations (rollout + update)."""
    rollout_batch_size: int = 64
    """Prompts (= sampled responses) per PPO iteration."""
    mini_batch_size: int = 32
    """Sequences per optimizer step inside the PPO epochs."""
    micro_batch_size: int = 32
    """Sequences per forward/backward; mini_batch_size / micro_batch_size steps of gradient accumulation."""
    ppo_epochs: int = 2
    """Passes over each rollout batch."""
    lr: float = 5e-4
    """AdamW learning rate of the trainable parameters (LoRA adapters or all weights, and the value head)."""
    lora_rank: int = 16
    """LoRA rank; 0 = full fine-tuning with a frozen reference copy."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (scale = alpha / rank)."""
    max_prompt_len: int = 32
    """Prompt tokens kept (left-truncated, with a warning)."""
    max_new_tokens: int = 12
    """Longest sampled response, EOS included."""
    temperature: float = 1.0
    """Sampling temperature, also used for the log-probs."""
    kl_coef: float = 0.2
    """Initial coefficient of the per-token KL penalty in the reward."""
    kl_target: float = 0.0
    """Adaptive KL controller (Ziegler et al. 2019) target KL per sequence; 0 = fixed kl_coef."""
    kl_horizon: int = 10000
    """Adaptive KL controller horizon, in sequences."""
    kl_estimator: str = "k1"
    """KL estimator in the reward: k1, k2, k3 (see fastrlhf.ops.token_kl)."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    clip: float = 0.2
    """PPO policy ratio clip."""
    value_clip: float = 0.2
    """Value clip around the rollout values."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    eval_prompts: int = 256
    """Synthetic task only: held-out prompts to measure the true score before and after."""
    seed: int = 0
    """Seed for data, initialisation and sampling."""
    log_every: int = 1
    """Write a metrics.jsonl row every this many iterations."""
    save_every: int = 10
    """Checkpoint every this many iterations (and at the end)."""
    stop_after: int = 0
    """Stop (with a checkpoint) after this many iterations of this invocation; 0 = run to the end."""
    resume: bool = False
    """Continue from the latest checkpoint in the stage folder."""
    tensorboard: bool = False
    """Also write TensorBoard event files under OUT/tb/."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    device: str = "auto"
    """`auto` (CUDA if available), `cpu` or `cuda`."""
    dtype: str = "auto"
    """Weight dtype: `auto` (bfloat16 frozen base on CUDA with LoRA, else float32), `float32`, `bfloat16`.
    On CUDA the forward passes also run under bf16 autocast."""


@dataclass
class PipelineConfig:
    """SFT -> reward model -> PPO in a row, all under one run directory."""

    out: str = "runs/default"
    """Run directory for every stage; overrides the stages' own `out`."""
    seed: int = 0
    """Seed for every stage; overrides the stages' own `seed`."""
    resume: bool = False
    """Skip finished stages and resume the unfinished one from its latest checkpoint."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning stage (`--sft.KEY`)."""
    rm: RMConfig = field(default_factory=RMConfig)
    """Reward-model stage (`--rm.KEY`)."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO stage (`--ppo.KEY`)."""


# ---------------------------------------------------------------- parsing


def field_docs(cls) -> dict[str, str]:
    """The string literal under each field of a dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        is_doc = isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and is_doc:
            docs[stmt.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _flat_fields(cls, prefix: str = "") -> dict[str, tuple[type, str]]:
    """{"dotted.key": (type, docstring)} over a dataclass and its nested dataclasses."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(_flat_fields(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = (tp, docs.get(f.name, ""))
    return out


def _convert(key: str, tp: type, value):
    if tp is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"config key {key!r} expects a boolean (true/false), got {value!r}")
    try:
        return tp(value)
    except (TypeError, ValueError):
        raise ValueError(f"config key {key!r} expects {tp.__name__}, got {value!r}") from None


def _set(cfg, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for name in parents:
        cfg = getattr(cfg, name)
    setattr(cfg, last, value)


def _flatten_mapping(mapping: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update(_flatten_mapping(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _unknown(keys, valid) -> ValueError:
    return ValueError(f"unknown config key(s) {sorted(keys)}; valid keys: {', '.join(sorted(valid))}")


def load_config(cls, overrides: dict | None = None, path: str | None = None):
    """Build `cls` from its defaults, then the YAML file at `path`, then `overrides` (dotted keys)."""
    fields_ = _flat_fields(cls)
    values = {}
    if path:
        if not Path(path).is_file():
            raise ValueError(f"config file {path!r} does not exist")
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path!r} must hold a mapping of keys to values")
        values.update(_flatten_mapping(loaded))
    values.update({k.replace("-", "_"): v for k, v in (overrides or {}).items()})
    unknown = set(values) - set(fields_)
    if unknown:
        raise _unknown(unknown, fields_)
    cfg = cls()
    for key, value in values.items():
        _set(cfg, key, _convert(key, fields_[key][0], value))
    return cfg


def parse_args(cls, argv: list[str], prog: str | None = None):
    """Parse `--config FILE` and `--key value` (or `--key=value`; `--flag` alone for booleans)."""
    fields_ = _flat_fields(cls)
    epilog = "\n".join(f"  --{k} ({tp.__name__}): {doc}" for k, (tp, doc) in fields_.items())
    parser = argparse.ArgumentParser(
        prog=prog, description=(cls.__doc__ or "").strip(), epilog="keys:\n" + epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file of keys (nested mappings for dotted keys)")
    args, rest = parser.parse_known_args(argv)
    overrides, i = {}, 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--"):
            raise ValueError(f"expected --key value, got {token!r}; valid keys: {', '.join(fields_)}")
        key = token[2:].replace("-", "_")
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif key in fields_ and fields_[key][0] is bool and (i + 1 == len(rest) or rest[i + 1].startswith("--")):
            value, i = True, i + 1
        elif i + 1 < len(rest):
            value, i = rest[i + 1], i + 2
        else:
            raise ValueError(f"config key --{key} needs a value")
        if key not in fields_:
            raise _unknown([key], fields_)
        overrides[key] = value
    return load_config(cls, overrides, args.config)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def run_cli(cls, argv: list[str], prog: str, train) -> int:
    """Parse `argv` into `cls` and call `train(cfg)`; bad input (ValueError/TypeError) prints
    `prog: error: ...` and returns 2 instead of a traceback."""
    import sys

    try:
        train(parse_args(cls, argv, prog=prog))
    except (ValueError, TypeError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
