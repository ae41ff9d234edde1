"""The planner's shared prompt (--shared_prompt): phases 3 and 5 count each group's prompt once, P + G R
tokens per group instead of G (P + R); auto resolves as the trainer decides (fastrlhf.train.shared_prompt)."""

import pytest

from fastrlhf import estimate as est
from fastrlhf.estimate import plan
from fastrlhf.estimate.arch import Arch
from fastrlhf.estimate.phases import Context
from fastrlhf.estimate.spec import Spec, resolved

GRPO = dict(stage="grpo", model="qwen2-0.5b", seq_len=1024, gen_len=256, num_generations=8, rollout_batch=8,
            gpu="h200", kl_in_loss=False)


def _phases(**kw) -> dict:
    return est.estimate(**{**GRPO, **kw})["stages"]["grpo"]["phases"]


def test_phases_3_and_5_count_the_prompt_once_per_group():
    spec = resolved(Spec(**GRPO, shared_prompt="on"))
    ctx = Context(spec, "grpo", plan.actor_arch(spec), None, [], {})
    groups, P, R, G = 8, 1024, 256, 8
    assert ctx.total_seqs * ctx.scored_seq == groups * (P + G * R)  # 8 x 3072 tokens, not 8 x 10240
    assert ctx.total_seqs * Context(resolved(Spec(**GRPO)), "grpo", ctx.arch, None, [], {}).scored_seq == \
        groups * G * (P + R)
    on, off = _phases(shared_prompt="on"), _phases(shared_prompt="off")
    for name in ("logprobs", "update"):
        assert on[name]["flops"] < 0.5 * off[name]["flops"], name
    for name in ("rollout", "reward"):  # generation and the reward model see every sequence whole
        assert on[name]["flops"] == off[name]["flops"], name
    assert on["update"]["memory_per_gpu_bytes"]["activations"] < off["update"]["memory_per_gpu_bytes"]["activations"]


def test_the_shared_prompts_attention_context():
    """A group's P prompt tokens attend to P / 2 keys on average, its G R response tokens to P + R / 2."""
    spec = resolved(Spec(**dict(GRPO, seq_len=4, gen_len=2, num_generations=2), shared_prompt="on"))
    ctx = Context(spec, "grpo", Arch(hidden=8, layers=1, heads=1, kv_heads=1, intermediate=8, vocab=8, tied=True),
                  None, [], {})
    assert ctx.scored_context == pytest.approx((4 * 2 + 4 * (4 + 1)) / 8)


@pytest.mark.parametrize("seq_len, gen_len, G, expected", [(1024, 256, 8, "on"), (16, 512, 2, "off"),
                                                            (1024, 256, 1, "off")])
def test_auto_shares_where_it_saves_a_tenth_of_the_tokens(seq_len, gen_len, G, expected):
    spec = resolved(Spec(**dict(GRPO, seq_len=seq_len, gen_len=gen_len, num_generations=G), shared_prompt="auto"))
    assert spec.shared_prompt == expected


def test_a_bad_shared_prompt_is_named():
    with pytest.raises(ValueError, match="shared_prompt: expected one of auto, on, off, got 'yes'"):
        est.estimate(**GRPO, shared_prompt="yes")
