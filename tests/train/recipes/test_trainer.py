"""The training loops: Bradley-Terry loss, ops dispatch, non-finite losses, resume."""

import copy
import json
import math
import mmap
from pathlib import Path

import helpers
import pytest
import torch
from helpers import main_in_process, metric_rows

from fastrlhf import ops
from fastrlhf.train.config import PPOConfig
from fastrlhf.train.recipes.ppo import KLController
from fastrlhf.train.recipes.ppo import train as ppo_train
from fastrlhf.train.recipes.rm import bradley_terry_loss

pytestmark = pytest.mark.usefixtures("keep_threads_and_warnings")


ROOT = Path(__file__).resolve().parents[3]
TINY_PPO = dict(helpers.TINY_PPO, rollout_batch_size=8, micro_batch_size=2, eval_prompts=8, max_new_tokens=5,
                save_every=1)


def test_bradley_terry_hand_worked():
    # pair 1: margin 1 -> log(1 + e^-1) = 0.3132617; pair 2: margin 0 -> log 2 = 0.6931472
    loss = bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    assert loss.item() == pytest.approx((0.3132617 + 0.6931472) / 2, abs=1e-6)
    # large margins stay finite (log-sigmoid, not log(sigmoid))
    assert bradley_terry_loss(torch.tensor([-200.0]), torch.tensor([200.0])).item() == pytest.approx(400.0)
    chosen = torch.tensor([0.5], requires_grad=True)
    bradley_terry_loss(chosen, torch.tensor([0.0])).backward()
    assert chosen.grad.item() == pytest.approx(-1 / (1 + math.exp(0.5)), abs=1e-6)  # -sigmoid(-margin)


def test_adaptive_kl_controller():
    fixed = KLController(0.2, target=0.0, horizon=100)
    fixed.update(kl=50.0, n_sequences=10)
    assert fixed.coef == 0.2
    adaptive = KLController(0.2, target=1.0, horizon=100)
    adaptive.update(kl=3.0, n_sequences=10)  # error clipped to +0.2
    assert adaptive.coef == pytest.approx(0.2 * (1 + 0.2 * 10 / 100))


def test_ppo_calls_fastrlhf_ops(tmp_path, monkeypatch):
    calls = {}
    for name in ("linear_logprobs", "kl_shaped_rewards", "gae", "linear_ppo_actor_loss", "value_loss"):
        real = getattr(ops, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, spy)
    summary = ppo_train(PPOConfig(out=str(tmp_path), steps=2, **TINY_PPO))
    # per step: 2 log-prob passes (policy, reference); 2 epochs x 2 minibatches x 2 micro-batches of losses
    assert calls == {"linear_logprobs": 4, "kl_shaped_rewards": 2, "gae": 2, "linear_ppo_actor_loss": 16,
                     "value_loss": 16}
    assert set(summary["phase_seconds"]) == {"rollout", "reward", "logprobs", "advantages", "update"}


def test_nonfinite_loss_skips_the_step_and_is_counted(tmp_path, monkeypatch):
    real = ops.linear_ppo_actor_loss
    state = {"n": 0}

    def first_call_nan(*args, **kwargs):
        state["n"] += 1
        loss, stats = real(*args, **kwargs)
        return (loss * float("nan"), stats) if state["n"] == 1 else (loss, stats)

    monkeypatch.setattr(ops, "linear_ppo_actor_loss", first_call_nan)
    with pytest.warns(UserWarning, match="non-finite PPO loss"):  # 1 of 8 updates: within max_skipped_frac 0.2
        summary = ppo_train(PPOConfig(out=str(tmp_path), steps=2, max_skipped_frac=0.2, **TINY_PPO))
    assert summary["skipped_nonfinite"] == 1
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_nonfinite"] for r in rows] == [1.0, 1.0]
    assert all(math.isfinite(r["value_loss"]) for r in rows)
    assert (tmp_path / "ppo" / "checkpoints" / "step_000002" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("packing", [[], ["--micro_batch_tokens", "74"]], ids=["padded", "packed"])
def test_resume_gives_the_same_metrics_as_an_uninterrupted_run(tmp_path, packing, capsys, caplog):
    """Stopped after 2 steps and resumed: the rows and the true score after are the uninterrupted run's,
    bit for bit, with padded micro-batches and with packs of 74 tokens (two of the longest sequences,
    32 + 5 tokens: the packed update plans its minibatches from the same generator). `fastrlhf ppo` in
    this process (a resume in a process of its own, after a kill or a signal: tests/train/test_faults.py)."""
    args = [f"--{k}={v}" for k, v in TINY_PPO.items()] + ["--steps", "4", "--lora_rank", "4", *packing]
    full, split = tmp_path / "full", tmp_path / "split"

    def cli(*a):
        return main_in_process("ppo", *a, capsys=capsys, caplog=caplog)

    r = cli("--out", str(full), *args)
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli("--out", str(split), *args, "--stop_after", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(metric_rows(split, "ppo", timing=False)) == 2 and not (split / "ppo" / "final").exists()
    r = cli("--out", str(split), *args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr
    expected, resumed = metric_rows(full, "ppo", timing=False), metric_rows(split, "ppo", timing=False)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed == expected  # exact: same weights, optimizer, RNG and KL coefficient after step 2
    summaries = [json.loads((d / "summary.json").read_text())["ppo"] for d in (full, split)]
    assert summaries[0]["true_score_after"] == summaries[1]["true_score_after"]


def test_gradient_accumulation_does_not_change_the_update():
    """One minibatch of 8 as one micro-batch or as four micro-batches of 2: the same step."""
    from fastrlhf.train.heads import ActorCritic
    from fastrlhf.train.models import load_causal_lm
    from fastrlhf.train.recipes.ppo import experience, ppo_update
    from fastrlhf.train.rollout import generate
    from fastrlhf.train.task import synthetic_prompt_rows

    cpu = torch.device("cpu")
    lm, tok = load_causal_lm("tiny", device=cpu)
    prompts = [r["prompt"] for r in synthetic_prompt_rows(8, seed=1)]
    ids = [tok(p)["input_ids"] for p in prompts]
    rollout = generate(lm, tok, ids, prompts, max_new_tokens=6, temperature=1.0, device=cpu)
    results = []
    for micro in (8, 2):
        torch.manual_seed(0)
        ac = ActorCritic(copy.deepcopy(lm), lora_rank=0)
        cfg = PPOConfig(rollout_batch_size=8, mini_batch_size=8, micro_batch_size=micro, ppo_epochs=1)
        exp = experience(ac, rollout, cfg, cpu)
        mask = rollout.batch.response_mask
        exp.advantages, exp.returns = torch.randn_like(mask) * mask, torch.randn_like(mask) * mask
        opt = torch.optim.SGD([p for p in ac.parameters() if p.requires_grad], lr=0.1)
        stats = ppo_update(ac, opt, exp, cfg, cpu, step=0)
        results.append((stats, {k: v.detach().clone() for k, v in ac.trainable_state().items()}))
    (stats_a, params_a), (stats_b, params_b) = results
    for k in params_a:
        torch.testing.assert_close(params_a[k], params_b[k], rtol=1e-5, atol=1e-6, msg=k)
    for k in ("pg_loss", "value_loss", "clipfrac", "approx_kl", "entropy"):
        assert stats_a[k] == pytest.approx(stats_b[k], rel=1e-4, abs=1e-6), k


def test_cpu_phase_memory_is_per_phase():
    """Each phase reports the peak RSS during that phase, not the process's lifetime peak."""
    from fastrlhf.train.metrics import PhaseTimer

    timer = PhaseTimer(torch.device("cpu"))
    if timer.memory_kind is None:
        pytest.skip("per-phase CPU memory needs Linux /proc and glibc")
    # 128 MiB of anonymous pages, faulted in 1 MiB at a time and unmapped at the end: resident only during
    # "big", whatever the allocator keeps (a tensor this size may be served from glibc's heap and stay resident
    # once freed, when an earlier test in the process has raised its mmap threshold)
    chunk = b"\1" * 2**20
    with timer.phase("big"):
        block = mmap.mmap(-1, 128 * 2**20)
        for offset in range(0, len(block), len(chunk)):
            block[offset:offset + len(chunk)] = chunk
        block.close()
    with timer.phase("small"):
        torch.ones(1024)
    stats = timer.step_stats()
    assert stats["memory/big"] - stats["memory/small"] > 100 * 2**20
    assert set(stats) == {"time/big", "time/small", "memory/big", "memory/small"}


def test_cpu_phase_memory_trims_the_heap_once_per_step(monkeypatch):
    """malloc_trim at a step's first phase only: every later phase resets the peak alone (a trim
    before every phase faulted the pages back in, ~5% of a CPU GRPO iteration)."""
    from fastrlhf.train.metrics import PhaseTimer

    timer = PhaseTimer(torch.device("cpu"))
    if timer.memory_kind is None:
        pytest.skip("per-phase CPU memory needs Linux /proc and glibc")
    trims = []
    monkeypatch.setattr(timer._cpu, "_malloc_trim", lambda pad: trims.append(pad))
    for _ in range(2):
        for name in ("rollout", "logprobs", "update"):
            with timer.phase(name):
                pass
        assert set(timer.step_stats()) >= {"memory/rollout", "memory/logprobs", "memory/update"}
    assert trims == [0, 0]
