"""Regional compilation of the decoder layers (fastrlhf.train.models.compile_layers, `--compile`): the
compiled training step gives the eager gradients, and a PPO run compiles a fixed number of graphs.

Inductor on the CPU compiles C++ (gcc): each fresh compile of the tiny model's layer, forward and
backward, took 15 s with a warm inductor cache and 2-5 min cold on this project's 2 busy cores, so
these tests are marked slow."""

import json

import helpers
import numpy as np
import pytest
import torch

from fastrlhf.train import packing
from fastrlhf.train.config import PPOConfig
from fastrlhf.train.data import pack
from fastrlhf.train.heads import ActorCritic
from fastrlhf.train.models import compile_layers, compile_stats, compile_wanted, load_causal_lm
from fastrlhf.train.recipes import ppo

CPU = torch.device("cpu")
TINY_PPO = dict(helpers.TINY_PPO, rollout_batch_size=8, micro_batch_size=2, eval_prompts=8, max_new_tokens=5)

pytestmark = pytest.mark.usefixtures("keep_threads_and_warnings")


def test_compile_modes():
    assert compile_wanted("auto", torch.device("cpu")) is False
    assert compile_wanted("auto", torch.device("cuda")) is True
    assert compile_wanted("on", torch.device("cpu")) is True and compile_wanted("off", torch.device("cuda")) is False
    with pytest.raises(ValueError, match="compile must be one of auto, on, off, got 'yes'"):
        compile_wanted("yes", CPU)
    with pytest.raises(ValueError, match="ppo: --compile must be one of auto, on, off, got 'yes'"):
        ppo.check_update(PPOConfig(compile="yes"))


def _experience(tokenizer, dtype) -> ppo.Experience:
    """A fixed experience of 6 sequences (prompts 3-8 tokens, responses 1-9), old log-probs perturbed
    so some ratios clip."""
    g = torch.Generator().manual_seed(7)
    lengths = [(3, 9), (8, 1), (5, 4), (4, 7), (6, 2), (7, 6)]
    tokens = lambda n: torch.randint(5, 30, (n,), generator=g).tolist()  # noqa: E731
    batch = pack([tokens(p) for p, _ in lengths], [tokens(r) for _, r in lengths], tokenizer.pad_token_id)
    mask = batch.response_mask
    noise = lambda: (torch.randn(mask.shape, generator=g) * mask).to(dtype)  # noqa: E731
    return ppo.Experience(batch, old_logp=noise() - 2.5, ref_logp=noise() - 2.5, values=noise().float(),
                          advantages=noise(), returns=noise(), lengths=packing.read_lengths(batch))


def _gradients(dtype, compiled: bool, lora_rank: int, checkpointing: bool) -> dict[str, torch.Tensor]:
    """The gradients of one micro-batch's PPO loss (actor + value, all 6 rows) of the tiny default."""
    torch.manual_seed(0)
    lm, tok = load_causal_lm("tiny", device=CPU, dtype=dtype, gradient_checkpointing=checkpointing)
    ac = ActorCritic(lm, lora_rank=lora_rank)
    if compiled:
        assert compile_layers(ac) == 4 * (1 if lora_rank else 2)  # the policy's layers (+ the reference copy's)
    exp = _experience(tok, dtype)
    (mb,), = packing.micro_batches(exp.batch, [[np.arange(6)]], exp.lengths, packed=False, device=CPU)
    cfg = PPOConfig(clip=0.1, entropy_coef=0.01)
    loss, _ = ppo.micro_batch_losses(ac, exp, mb, cfg, CPU, (float(exp.lengths.response.sum()), 6.0))
    loss.backward()
    return {n: p.grad.detach().double() for n, p in ac.named_parameters() if p.requires_grad}


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank, checkpointing", [(4, True), (0, False)], ids=["lora_checkpointing", "full"])
def test_compiled_training_step_gives_the_eager_gradients(lora_rank, checkpointing):
    """DESIGN.md's rule: the compiled float32 gradients' error against the eager float64 ones is at
    most 2x the eager float32 gradients' error, + atol; with LoRA (and gradient checkpointing) and
    with full fine-tuning."""
    ref = _gradients(torch.float64, False, lora_rank, checkpointing)
    eager = _gradients(torch.float32, False, lora_rank, checkpointing)
    graphs = compile_stats()["graphs"]
    compiled = _gradients(torch.float32, True, lora_rank, checkpointing)
    assert compile_stats()["graphs"] > graphs  # it did compile
    assert set(compiled) == set(ref) and len(ref) > 0
    scale = max(g.abs().max().item() for g in ref.values())
    assert scale > 0
    for name in ref:
        err_eager = (eager[name] - ref[name]).abs().max().item()
        err_compiled = (compiled[name] - ref[name]).abs().max().item()
        assert err_compiled <= 2 * err_eager + 1e-6 * scale, f"{name}: compiled {err_compiled:.3g}, " \
                                                             f"eager {err_eager:.3g}"


@pytest.mark.slow
def test_a_compiled_ppo_run_stops_compiling_after_its_first_step(tmp_path):
    """`--compile on` (LoRA, gradient checkpointing, packed micro-batches): the graphs compiled stay
    the same after the first step (response lengths change every step; the layer is compiled with
    dynamic shapes from its first call), and the compile time is in the summary."""
    summary = ppo.train(PPOConfig(out=str(tmp_path), steps=4, compile="on", lora_rank=4, gradient_checkpointing=True,
                                  micro_batch_tokens=48, **TINY_PPO))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    graphs = [r["compiled_graphs"] for r in rows]
    assert graphs[0] == graphs[-1] and graphs[0] > 0, graphs
    assert summary["compiled"] is True and summary["compile"]["seconds"] > 0
    assert summary["compile"]["graphs"] == graphs[-1]


@pytest.mark.slow
def test_a_new_padded_width_compiles_nothing():
    """The layer is compiled with dynamic shapes from its first call: a rollout whose padded width was
    not seen before (other prompts, other response lengths) runs the graphs already compiled, forward
    and backward. With a static first graph, the first new width compiled both again: 28 s of a 2.8 s
    iteration on an H200 (bench/results/2026-11-27-cuda-e2e.json). aot_eager: dynamo's guards and
    AOTAutograd's graphs without inductor's C++ compile."""
    torch.manual_seed(0)
    lm, _ = load_causal_lm("tiny", device=CPU, dtype=torch.float32)
    ac = ActorCritic(lm, lora_rank=4)
    compile_layers(ac, backend="aot_eager")
    graphs = []
    for width in (12, 12, 20, 7, 31):
        ids = torch.randint(5, 30, (4, width))
        ac.policy(ids, use_cache=False).logits.float().square().mean().backward()
        graphs.append(compile_stats()["graphs"])
    assert graphs[0] > 0 and graphs[-1] == graphs[0], graphs
