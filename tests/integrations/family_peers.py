"""Shared by the policy-family peer tests: inputs, the float64 comparison and how each peer's options
map onto fastrlhf.reference (what the integrations will pass the ops once they are wired).

Every comparison is float64 against float64. A value the peer computes in float32 (a `.float()` of
a comparison: its clip fractions, its filtered fractions) is its own rounding: it is held to one
float32 rounding of fastrlhf's float64 value (2^-23 relative), everything else to float64 precision
(FLOAT64_RTOL relative, FLOAT64_ATOL absolute). With FASTRLHF_FAMILY_DIFFS=<file> set, the largest
difference seen per (peer, mode, quantity) is written there as JSON when the session ends.
"""

import atexit
import inspect
import json
import os
import textwrap
import types
from collections import defaultdict

import torch

F64 = torch.float64
FLOAT64_RTOL = 1e-13
FLOAT64_ATOL = 1e-13
FLOAT32_RTOL = 2.0**-23

_DIFFS: dict = defaultdict(float)


def _write_diffs():
    path = os.environ.get("FASTRLHF_FAMILY_DIFFS")
    if path and _DIFFS:
        with open(path, "w") as f:
            json.dump({" | ".join(k): v for k, v in sorted(_DIFFS.items())}, f, indent=1)


atexit.register(_write_diffs)


def record(key, diff):
    _DIFFS[key] = max(_DIFFS[key], float(diff))


def assert_f64(ours, peer, *, key, float32=False):
    """|ours - peer| <= FLOAT64_ATOL + FLOAT64_RTOL |peer| elementwise (NaN must match NaN); with
    float32=True the peer's value is a float32 rounding of the same quantity: <= 2^-23 |ours|."""
    a = torch.as_tensor(ours, dtype=F64).detach()
    b = torch.as_tensor(peer, dtype=F64).detach()
    assert a.shape == b.shape, f"{key}: shape {tuple(a.shape)} vs the peer's {tuple(b.shape)}"
    assert torch.equal(a.isnan(), b.isnan()), f"{key}: NaN pattern differs"
    ok = ~b.isnan()
    diff = (a[ok] - b[ok]).abs()
    if diff.numel() == 0:
        return
    record(key + ("float32",) if float32 else key, diff.max())
    allowed = (FLOAT32_RTOL * a[ok].abs()) if float32 else (FLOAT64_ATOL + FLOAT64_RTOL * b[ok].abs())
    worst = int((diff - allowed).argmax())
    assert diff[worst] <= allowed[worst], (f"{key}: |{a[ok][worst].item()!r} - {b[ok][worst].item()!r}| = "
                                          f"{diff[worst].item():.3e} > {allowed[worst].item():.3e}")


def loss_and_grad(fn, logp, *inputs, **kwargs):
    """(loss, d loss / d logp, the rest of fn's outputs) for fn(logp, ...) or fn(..., logp first)."""
    x = logp.detach().clone().requires_grad_()
    out = fn(x, *inputs, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    (grad,) = torch.autograd.grad(loss, x, allow_unused=True)
    return loss.detach(), torch.zeros_like(x) if grad is None else grad, out[1:] if isinstance(out, tuple) else ()


# ---------------------------------------------------------------- inputs


def make_mask(B, T):
    """Row 0 right padding, row 1 left padding, row 2 empty, row 3 gaps, the rest random."""
    m = torch.rand(B, T) > 0.25
    m[0] = torch.arange(T) < T - 4
    m[1] = torch.arange(T) >= 5
    m[2] = False
    m[3] = torch.arange(T) % 3 != 1
    return m


def policy_inputs(B=7, T=13, *, row_advantages=False):
    """float64 (old_logp, logp, advantages, mask): log-probs < 0 (probabilities for the DPPO modes),
    log-ratios across every clip band in columns 0-3 (far below 1 - clip_low, exactly 1, past a
    dual-clip c = 3, between 1 + clip_high and c), the advantage of column 2 negative in even rows;
    advantages per token or constant per row. test_policy_inputs_cover_every_band checks the bands."""
    old = -torch.rand(B, T, dtype=F64) * 3 - 0.2
    old[:, :4] = -2.5 - torch.rand(B, 4, dtype=F64) * 0.5  # room for a log-ratio of +1.3 below log-prob 0
    log_ratio = torch.randn(B, T, dtype=F64) * 0.25
    log_ratio[:, :4] = torch.tensor([-1.0, 0.0, 1.3, 0.5], dtype=F64)
    logp = torch.clamp(old + log_ratio, max=-1e-3)
    if row_advantages:
        adv = torch.randn(B, 1, dtype=F64).expand(B, T).clone()
    else:
        adv = torch.randn(B, T, dtype=F64)
        adv[:, 2] = adv[:, 2].abs() * (1 - 2 * (torch.arange(B) % 2 == 0))
    return old, logp, adv, make_mask(B, T)


def rollout_logprobs(old, spread=0.3):
    """Sampler log-probs near the trainer's, one row far off (IS weights past every bound)."""
    rollout = old + torch.randn(old.shape, dtype=F64) * spread
    rollout[4] = old[4] + torch.randn(old.shape[1], dtype=F64) * 1.5
    return torch.clamp(rollout, max=-1e-3)


# ---------------------------------------------------------------- TRL: its own code on given tensors


class Accelerator:
    """One process: gather / reduce / pad are the identity."""

    device = torch.device("cpu")
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def pad_across_processes(x, dim=0, pad_index=0):
        return x


def trl_trainer(logps, entropies, **settings):
    """A GRPOTrainer built without __init__ (no model, no data) with the attributes _compute_loss
    reads, its model forward (_get_per_token_logps_and_entropies) returning the given per-token
    log-probs and entropies. `settings` override the GRPOConfig defaults below."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    args = dict(delta=None, use_bias_correction_kl=True, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, steps_per_generation=1)
    attrs = dict(loss_type="dapo", importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.28, beta=0.0,
                 top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
                 vllm_importance_sampling_correction=False, vllm_importance_sampling_mode="sequence_mask",
                 vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=3.0,
                 current_gradient_accumulation_steps=1, max_completion_length=logps.shape[1], entropy_coef=0.0,
                 use_adaptive_entropy=False, aux_loss_enabled=False)
    for k, v in settings.items():
        (args if k in args else attrs)[k] = v
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.__dict__.update(attrs, args=types.SimpleNamespace(**args), accelerator=Accelerator(),
                            model=types.SimpleNamespace(training=True), _metrics={"train": defaultdict(list)})
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
    return trainer


def grpo_inputs():
    """float64 (old, logp, per-row advantages, mask, entropies, reference log-probs, sampler log-probs) of a
    GRPO loss: policy_inputs' clip bands and masked rows; row 4's advantage negative and its sampler far
    off-policy (TRL's off-policy mask drops it)."""
    old, logp, adv, mask = policy_inputs()
    B, T = mask.shape
    adv_rows = adv[:, 0].contiguous()
    entropy = torch.rand(B, T, dtype=F64) * 3
    ref = logp + torch.randn(B, T, dtype=F64) * 0.2
    sampling = rollout_logprobs(old, spread=0.2)
    adv_rows[4], sampling[4] = -adv_rows[4].abs(), logp[4] + 0.5
    return old, logp, adv_rows, mask, entropy, ref, sampling


def trl_inputs(mask, advantages_rows, old, *, ref=None, is_ratio=None, sampling=None, num_items=None):
    B, T = mask.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": advantages_rows, "old_per_token_logps": old,
              "num_items_in_batch": torch.tensor(float(mask.sum()) if num_items is None else num_items)}
    for key, value in (("ref_per_token_logps", ref), ("importance_sampling_ratio", is_ratio),
                       ("sampling_per_token_logps", sampling)):
        if value is not None:
            inputs[key] = value
    return inputs


def _method_lines(method, start, end):
    """The source lines of `method` from the line containing `start` up to (not including) the line
    containing `end`, dedented: TRL's own code, to run on given tensors."""
    lines = inspect.getsource(method).splitlines()
    first = next(i for i, line in enumerate(lines) if start in line)
    last = next(i for i in range(first + 1, len(lines)) if end in lines[i])
    return textwrap.dedent("\n".join(lines[first:last]))


def trl_vllm_importance_sampling(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's vLLM importance-sampling ratio and its sampling/* metrics, computed by TRL's own lines
    of GRPOTrainer._generate_and_score_completions (cut out of its source between the comments that
    bound them, and run here on the given tensors). Returns (ratio [B, T] or [B, 1], metrics)."""
    from trl.trainer import grpo_trainer

    method = grpo_trainer.GRPOTrainer._generate_and_score_completions
    ratio_code = _method_lines(method, "# Compute the importance sampling ratio when using vLLM",
                               "# Compute the per-token log probabilities for the reference model")
    metrics_code = _method_lines(method, "delta = torch.abs(old_per_token_logps - sampling_per_token_logps)",
                                 "output = {")
    trainer = trl_trainer(old, None, use_vllm=True, vllm_importance_sampling_correction=True,
                          vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                          vllm_importance_sampling_clip_max=clip_max)
    scope = dict(vars(grpo_trainer), self=trainer, old_per_token_logps=old, sampling_per_token_logps=sampling,
                 completion_mask=mask.long(), tool_mask=None, mode="train", device=torch.device("cpu"))
    exec(compile(ratio_code, "<trl ratio lines>", "exec"), scope)
    exec(compile(metrics_code, "<trl metric lines>", "exec"), scope)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return scope["vllm_importance_sampling_ratio"], metrics
