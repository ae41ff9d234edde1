"""Reward functions for the PPO stage: `load_reward(spec)` turns `--reward` into a function
Rollout -> scores [B] float32, every score checked.

- a reward-model directory written by `fastrlhf rm` (`RewardModel`, scored at the last
  response token). It scores the policy's token ids only when both encode text the same way
  (`same_encoding`: vocabulary, special ids, chat template, BOS/EOS rule, checked on a probe).
  Otherwise it is given the texts and re-tokenizes them with its own Encoder (the rule of
  fastrlhf.train.data, with EOS after each response, its recorded chat_template setting), truncated
  as `fastrlhf rm` truncated its training texts: prompts to their last max_prompt_len tokens,
  responses to their first max_response_len, the lengths it recorded (else what fits its
  max_position_embeddings, split as the stages split it), with one warning counting them.
- a rule `module:function`, imported with the current directory on the path (so
  `--reward myreward:score` finds ./myreward.py), called as function(prompts, responses)
  with two lists of B strings. It returns one real number per response: a list/tuple of
  floats or ints (bools count as 0/1), or a 1-D numpy array or torch tensor (used detached).

Scores are checked at every call: their count, their type, finiteness and plausibility (a NaN,
an inf or a |score| above `--reward_clip_abs` is an error naming the reward and the sample).
Scores far from order 1 get one warning: PPO's KL coefficient and value targets assume rewards
of that scale (the reward model's are normalised to mean 0, std 1). Every call is bounded by
`--reward_timeout_s` (`bounded`): a reward that hangs is an error naming it, not a run that
waits forever.

The reward-model *training* stage is `fastrlhf rm` (fastrlhf/train/recipes/rm.py).
"""

from __future__ import annotations

import importlib
import logging
import numbers
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from fastrlhf.train.checkpoint import CONFIG_FILE, read_json
from fastrlhf.train.config import PPOConfig, RunError
from fastrlhf.train.data import Encoder, auto_lengths, pack
from fastrlhf.train.devices import autocast
from fastrlhf.train.heads import SCORE_HEAD_FILE, RewardModel
from fastrlhf.train.models import LINEAGE_FILE, model_source, same_encoding
from fastrlhf.train.rollout import Rollout

log = logging.getLogger("fastrlhf")

RewardFn = Callable[[Rollout], torch.Tensor]
LARGE_SCORE = 100.0  # |score| above this gets a warning about the reward's scale
WAIT_LOG_S = 60.0  # while a reward call runs, the log says this often that the run is still waiting


def is_rule(spec: str) -> bool:
    """`module:function` (and not a directory)."""
    return ":" in spec and not Path(spec).is_dir()


def import_rule(spec: str) -> Callable:
    """The callable `module:function` names, imported with the current directory on sys.path."""
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise ValueError(f"reward {spec!r}: expected 'module:function'")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward {spec!r}: cannot import {fn_name!r} from {module_name!r} ({e}; looked in "
                         f"the current directory {cwd} and on sys.path)") from None
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {fn_name!r} is a {type(fn).__name__}, not a function")
    return fn


def _sample(rollout: Rollout, i: int) -> str:
    return f"sample {i} (prompt {rollout.prompts[i]!r:.80}, response {rollout.responses[i]!r:.80})"


def check_scores(scores, rollout: Rollout, name: str, *, device,
                 clip_abs: float = PPOConfig.reward_clip_abs) -> torch.Tensor:
    """`scores` from reward `name` as a float32 tensor [B] on `device`, after checking their
    count, type, finiteness and |score| <= `clip_abs` (a clear TypeError / ValueError otherwise)."""
    n = len(rollout.prompts)
    if isinstance(scores, torch.Tensor) or type(scores).__module__ == "numpy":
        shape = tuple(scores.shape)
        if shape != (n,):
            raise ValueError(f"reward {name} returned an array of shape {shape}; expected ({n},): one score "
                             "per response")
        real = not scores.is_complex() if isinstance(scores, torch.Tensor) else scores.dtype.kind in "biuf"
        if not real:
            raise TypeError(f"reward {name} returned an array of {scores.dtype}; expected real numbers")
        values = torch.as_tensor(scores).detach().to(device=device, dtype=torch.float32)
    elif isinstance(scores, list | tuple):
        if len(scores) != n:
            raise ValueError(f"reward {name} returned {len(scores)} scores for {n} responses; expected one each")
        for i, s in enumerate(scores):
            if not isinstance(s, numbers.Real):
                raise TypeError(f"reward {name} returned {type(s).__name__} {s!r:.40} for {_sample(rollout, i)}; "
                                "expected a real number")
        values = torch.tensor([float(s) for s in scores], dtype=torch.float32, device=device)
    else:
        raise TypeError(f"reward {name} returned {type(scores).__name__}; expected a list of {n} floats "
                        "(one per response), or a 1-D array / tensor")
    finite = torch.isfinite(values)
    ok = finite & (values.abs() <= clip_abs)
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0])
        if not finite[i]:
            raise ValueError(f"reward {name} returned a non-finite score ({values[i].item()}) for "
                             f"{_sample(rollout, i)}; scores must be finite numbers")
        raise ValueError(f"reward {name} returned an implausible score ({values[i].item():.3g}) for "
                         f"{_sample(rollout, i)}; |score| must be at most --reward_clip_abs {clip_abs:g}: rescale the "
                         "reward (PPO expects scores of order 1), or raise --reward_clip_abs")
    return values


class _ScaleWarning:
    """One warning per run when scores stray far from order 1."""

    def __init__(self, name: str):
        self.name, self.warned = name, False

    def __call__(self, scores: torch.Tensor) -> None:
        top = scores.abs().max().item() if scores.numel() else 0.0
        if not self.warned and top > LARGE_SCORE:
            self.warned = True
            warnings.warn(f"reward {self.name} returns scores up to {top:.3g} in magnitude; PPO's KL coefficient and "
                          "value targets assume rewards of order 1: rescale them", stacklevel=3)


def _rule_reward(spec: str, device, clip_abs: float) -> RewardFn:
    fn = import_rule(spec)
    scale = _ScaleWarning(spec)
    said = []

    def score_with_rule(rollout: Rollout) -> torch.Tensor:
        raw = fn(list(rollout.prompts), list(rollout.responses))
        if not said:
            kinds = sorted({type(s).__name__ for s in raw}) if isinstance(raw, list | tuple) else []
            log.info("ppo: reward %s returns a %s%s; used as float32", spec, type(raw).__name__,
                     f" of {'/'.join(kinds)}" if kinds else "")
            said.append(True)
        scores = check_scores(raw, rollout, spec, device=device, clip_abs=clip_abs)
        scale(scores)
        return scores

    return score_with_rule


def check_reward_model_dir(spec: str, *, where: str = "ppo reward"):
    """The reward model's ModelSource (tokenizer, config), after checking its files."""
    if not (Path(spec) / SCORE_HEAD_FILE).is_file():
        raise ValueError(f"{where}: {spec!r} has no {SCORE_HEAD_FILE}: not a reward model written by `fastrlhf rm`")
    return model_source(spec, where=where)


RM_ENCODING_KEYS = ("max_prompt_len", "max_response_len", "chat_template")


def recorded_encoding(spec) -> dict:
    """How `fastrlhf rm` encoded the reward model's training texts ({max_prompt_len,
    max_response_len, chat_template}): from its fastrlhf.json, else from the run's config.json
    when `spec` is OUT/rm/final; {} when neither records them."""
    path = Path(spec)
    for f in (path / LINEAGE_FILE, path.parent / CONFIG_FILE if path.name == "final" else None):
        record = read_json(f, fix="fastrlhf wrote it with the reward model: restore it") if f and f.is_file() else {}
        if all(k in record for k in RM_ENCODING_KEYS):
            return {k: record[k] for k in RM_ENCODING_KEYS}
    return {}


def reward_encoder(spec, tokenizer, chat_template: bool) -> Encoder:
    """The Encoder the reward model at `spec` was trained with: its tokenizer, and its recorded
    chat_template setting (else `chat_template`, the PPO stage's)."""
    return Encoder(tokenizer, chat_template=recorded_encoding(spec).get("chat_template", chat_template))


def _fit(prompt_ids, response_ids, lengths, max_positions, name: str, warned: list):
    """Prompts cut to their last and responses to their first tokens, as the stages cut them:
    to the reward model's training `lengths` (max_prompt_len, max_response_len) when recorded, else
    to what fits `max_positions` (`auto_lengths`); one warning per run counting the cut rows."""
    if lengths is None and max_positions is None:
        return prompt_ids, response_ids
    P, R = lengths or auto_lengths(max(map(len, prompt_ids)), max(map(len, response_ids)), max_positions,
                                   max_prompt_len=0, max_response_len=0, where=f"reward {name}")
    long_p, long_r = sum(len(x) > P for x in prompt_ids), sum(len(x) > R for x in response_ids)
    if (long_p or long_r) and not warned:
        warned.append(True)
        why = "it was trained with" if lengths else f"fit its max_position_embeddings {max_positions}"
        warnings.warn(f"reward {name}: {long_p} of {len(prompt_ids)} re-tokenized prompts are longer than "
                      f"{P} tokens and {long_r} responses longer than {R} (EOS included), the lengths {why}; "
                      "keeping the prompts' last tokens and the responses' first (warned once)", stacklevel=3)
    return [x[-P:] for x in prompt_ids], [x[:R] for x in response_ids]


def _model_reward(spec: str, name: str, device, policy_tokenizer, chat_template: bool, clip_abs: float) -> RewardFn:
    model, rm_tokenizer = RewardModel.from_pretrained(spec, device=device)
    scale = _ScaleWarning(name)
    encoder = reward_encoder(spec, rm_tokenizer, chat_template)
    recorded = recorded_encoding(spec)
    lengths = (recorded["max_prompt_len"], recorded["max_response_len"]) if recorded else None
    max_positions = getattr(model.lm.config, "max_position_embeddings", None)
    retokenize = policy_tokenizer is not None and not same_encoding(
        Encoder(policy_tokenizer, chat_template=chat_template), encoder)
    if retokenize:
        limits = (f"prompts <= {lengths[0]} tokens, responses <= {lengths[1]} (as it was trained)" if lengths else
                  f"prompt + response <= {max_positions} tokens (its max_position_embeddings)" if max_positions
                  else "untruncated")
        log.info("ppo: the reward model encodes text differently from the policy (tokenizer, chat template or "
                 "BOS/EOS rule): it scores the text re-tokenized by its own tokenizer, %s, %s", limits,
                 "chat template" if encoder.uses_template else "plain prompt tokens")
    else:
        log.info("ppo: the reward model encodes text as the policy does: it scores the policy's token ids")
    warned = []

    @torch.no_grad()
    def score_with_model(rollout: Rollout) -> torch.Tensor:
        b = rollout.batch
        too_long = max_positions is not None and int(b.position_ids.max()) >= max_positions
        if retokenize or too_long:
            prompt_ids = encoder.prompts(rollout.prompts)
            response_ids = encoder.responses(rollout.prompts, prompt_ids, rollout.responses, warn_empty=False)
            prompt_ids, response_ids = _fit(prompt_ids, response_ids, lengths, max_positions, name, warned)
            b = pack(prompt_ids, response_ids, rm_tokenizer.pad_token_id).to(device)
        with autocast(device):
            scores = model(b.input_ids, b.attention_mask, b.position_ids).float()
        scores = check_scores(scores, rollout, name, device=device, clip_abs=clip_abs)
        scale(scores)
        return scores

    return score_with_model


def bounded(fn: RewardFn, name: str, timeout_s: float, device: torch.device) -> RewardFn:
    """`fn`, each call bounded by `timeout_s` seconds: it runs in a daemon thread (one that hangs
    holds up neither the run nor its exit), the log says every WAIT_LOG_S seconds that the run is
    still waiting, and past `timeout_s` it is a RunError naming the reward. What `fn` raises is
    raised here."""

    def call(rollout: Rollout) -> torch.Tensor:
        result = {}
        # the current device is per thread: the reward's thread takes the caller's, or `device`'s index
        # (set_device refuses a bare "cuda", which means the current device)
        cuda_index = None
        if device.type == "cuda":
            cuda_index = torch.cuda.current_device() if device.index is None else device.index

        def target():
            try:
                if cuda_index is not None:
                    torch.cuda.set_device(cuda_index)
                result["scores"] = fn(rollout)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                result["error"] = e

        thread = threading.Thread(target=target, name=f"reward {name}", daemon=True)
        start = time.monotonic()
        thread.start()
        while True:
            thread.join(min(WAIT_LOG_S, max(0.0, timeout_s - (time.monotonic() - start))))
            if not thread.is_alive():
                break
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise RunError(f"reward {name} did not return within --reward_timeout_s {timeout_s:g} s (called with "
                               f"{len(rollout.prompts)} responses); fix the reward, or raise --reward_timeout_s, then "
                               "continue with --resume")
            log.info("ppo: still waiting for reward %s: %.0f s so far (--reward_timeout_s %g)", name, waited, timeout_s)
        if "error" in result:
            raise result["error"]
        return result["scores"]

    return call


def load_reward(spec: str, *, device: torch.device, policy_tokenizer=None, chat_template: bool = True,
                clip_abs: float = PPOConfig.reward_clip_abs, timeout_s: float = PPOConfig.reward_timeout_s) -> RewardFn:
    """A reward function Rollout -> checked scores [B] (each call bounded by `timeout_s`): a
    reward-model directory (scored at the last response token), or a rule `module:function`
    taking (prompts, responses)."""
    if Path(spec).is_dir():
        name = f"model {spec}"
        fn = _model_reward(spec, name, device, policy_tokenizer, chat_template, clip_abs)
    elif is_rule(spec):
        name, fn = spec, _rule_reward(spec, device, clip_abs)
    else:
        raise ValueError(f"reward {spec!r}: expected a reward-model directory or a Python callable 'module:function'")
    return bounded(fn, name, timeout_s, device)
