"""Reward functions for the PPO stage: `load_reward(spec)` turns `--reward` into a function
Rollout -> scores [B] float32.

- a reward-model directory written by `fastrlhf rm` (`RewardModel`, scored at the last
  response token);
- a rule `module:function` taking (prompts, responses) -> one float per response, e.g.
  `fastrlhf.task:true_score`.

The reward-model *training* stage is `fastrlhf rm` (fastrlhf/rm.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import torch

from fastrlhf.devices import autocast
from fastrlhf.heads import RewardModel
from fastrlhf.rollout import Rollout

RewardFn = Callable[[Rollout], torch.Tensor]


def load_reward(spec: str, *, device: torch.device) -> RewardFn:
    """A reward function Rollout -> scores [B]: a reward-model directory (scored at the last
    response token), or `module:function` taking (prompts, responses) -> list of floats."""
    if Path(spec).is_dir():
        model, _ = RewardModel.from_pretrained(spec, device=device)

        @torch.no_grad()
        def score_with_model(rollout: Rollout) -> torch.Tensor:
            b = rollout.batch
            with autocast(device):
                return model(b.input_ids, b.attention_mask, b.position_ids).float()

        return score_with_model
    if ":" in spec:
        module_name, _, fn_name = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward {spec!r}: cannot import {fn_name!r} from {module_name!r} ({e})") from None

        def score_with_rule(rollout: Rollout) -> torch.Tensor:
            scores = fn(rollout.prompts, rollout.responses)
            if len(scores) != len(rollout.prompts):
                raise ValueError(f"reward {spec!r} returned {len(scores)} scores for {len(rollout.prompts)} responses")
            return torch.tensor(scores, dtype=torch.float32, device=device)

        return score_with_rule
    raise ValueError(f"reward {spec!r}: expected a reward-model directory or a Python callable 'module:function'")
