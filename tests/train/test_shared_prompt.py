"""Shared-prompt packs (fastrlhf.train.shared_prompt, --shared_prompt): a group's prompt forwarded once,
[prompt, response 1, ..., response G], gives the unshared forward's log-probs, entropy, values and
reference log-probs, the same loss and gradients after an update, and processes P + sum R_i tokens per
group; fp32 on the embedded default (Llama) and a tiny Qwen2 with GQA."""

import logging

import numpy as np
import pytest
import torch

from fastrlhf import ops
from fastrlhf.constants import IGNORE_INDEX
from fastrlhf.train import attention, heads, packing, shared_prompt
from fastrlhf.train.attention import install
from fastrlhf.train.config import PPOConfig
from fastrlhf.train.data import pack
from fastrlhf.train.heads import ActorCritic
from fastrlhf.train.models import load_causal_lm
from fastrlhf.train.recipes import ppo
from fastrlhf.train.rollout import Rollout

CPU = torch.device("cpu")
RTOL = 1e-5  # relative, fp32

pytestmark = pytest.mark.usefixtures("keep_threads_and_warnings")


def _lm(family: str):
    """The embedded default (Llama, 4 heads) or a tiny Qwen2 with GQA (4 query heads, 2 key/value heads)."""
    lm, tok = load_causal_lm("tiny", device=CPU, dtype=torch.float32)
    if family == "qwen2-gqa":
        from transformers import AutoModelForCausalLM, Qwen2Config

        config = Qwen2Config(vocab_size=lm.config.vocab_size, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128, attn_implementation="sdpa")
        lm = AutoModelForCausalLM.from_config(config)
    return lm, tok


def _grouped_rollout(tok, G: int, n_prompts: int, *, max_response: int = 12, seed: int = 0) -> Rollout:
    """n_prompts prompts of 2-9 tokens (left-padded to the longest), each answered G times by responses of
    1 to max_response tokens (EOS mid-response: the rest of the row is masked), side by side."""
    g = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(5, 30, (n,), generator=g).tolist()  # noqa: E731
    prompts = [tokens(int(n)) for n in torch.randint(2, 10, (n_prompts,), generator=g)]
    lengths = torch.randint(1, max_response + 1, (n_prompts * G,), generator=g).tolist()
    lengths[0] = max_response  # one full-width response
    batch = pack([p for p in prompts for _ in range(G)], [tokens(n) for n in lengths], tok.pad_token_id)
    B = n_prompts * G
    return Rollout(batch, [""] * B, [""] * B)


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def _assert_close(a, b, what):
    gap = _relative_gap(a, b)
    assert gap <= RTOL, f"{what}: max |shared - unshared| / max |unshared| = {gap:.2e} > {RTOL}"
    torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-6, msg=what)


@pytest.mark.parametrize("family", ["tiny", "qwen2-gqa"])
@pytest.mark.parametrize("G", [2, 4, 8])
def test_a_shared_prompt_pack_scores_every_response_as_unshared(family, G, monkeypatch):
    """Phase 3 with --shared_prompt on against off (padded rows): the old and reference log-probs and the
    values of every response token, and each token's entropy from the same hidden states; the forwards
    process P + sum R_i tokens per group, counted."""
    torch.manual_seed(0)
    lm, tok = _lm(family)
    ac = ActorCritic(lm, lora_rank=4)
    with torch.no_grad():  # LoRA's B starts at 0: move it, so the reference (adapters off) differs
        for name, p in ac.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    rollout = _grouped_rollout(tok, G, n_prompts=3)
    b, mask = rollout.batch, rollout.batch.response_mask.bool()
    cfg = dict(rollout_batch_size=3 * G, mini_batch_size=3 * G, micro_batch_size=G, advantage="gae",
               num_generations=G)
    off = ppo.experience(ac, rollout, PPOConfig(**cfg), CPU)
    seen, real = [], heads.hidden_states
    monkeypatch.setattr(heads, "hidden_states", lambda lm, ids, *a, **k: seen.append(ids.numel()) or real(lm, ids, *a,
                                                                                                         **k))
    on = ppo.experience(ac, rollout, PPOConfig(**cfg, shared_prompt="on"), CPU)
    monkeypatch.undo()
    lengths = on.lengths
    per_group = [int(lengths.prompt[g * G] + lengths.response[g * G:(g + 1) * G].sum()) for g in range(3)]
    assert seen == [sum(per_group)] * 2  # the policy's forward and the reference's, each P + sum R_i per group
    assert on.shared.on and on.shared.shared == sum(per_group) < on.shared.unshared == int(lengths.total.sum())
    for name in ("old_logp", "ref_logp", "values"):
        _assert_close(getattr(on, name)[mask], getattr(off, name)[mask], name)
        assert not getattr(on, name)[~mask].any()  # 0 past each response, as unshared
    assert (on.old_logp - on.ref_logp)[mask].abs().max() > 1e-3  # the two are different models
    (padded,), = packing.micro_batches(b, [[np.arange(3 * G)]], lengths, packed=False, device=CPU)
    found, _ = shared_prompt.packs(lengths, np.arange(3 * G), 0)
    (shared,), = packing.micro_batches(b, [found], lengths, packed=False, flat=True, device=CPU)
    entropy = {}
    with torch.no_grad():
        for key, mb in (("off", padded), ("on", shared)):
            h, _ = packing.forward_responses(ac, b, mb)
            labels = torch.where(mb.take(b.response_mask).bool(), mb.take(b.responses), IGNORE_INDEX)
            _, ent = ops.linear_logprobs(h, ac.lm_head.weight, labels, return_entropy=True)
            entropy[key] = ent[mb.take(b.response_mask).bool()]
    _assert_close(entropy["on"], entropy["off"], "entropy")


def _updated(family: str, lora_rank: int, shared: str, advantage: str, tokens: int, loss_agg: str, G: int = 4):
    """(the update's stats, the gradients it leaves, the old log-probs) of one update over one minibatch
    of every row, micro-batches of G rows or packs of `tokens`."""
    torch.manual_seed(0)
    lm, tok = _lm(family)
    ac = ActorCritic(lm, lora_rank=lora_rank, value_head=advantage == "gae")
    rollout = _grouped_rollout(tok, G, n_prompts=4, seed=1)
    cfg = PPOConfig(rollout_batch_size=4 * G, mini_batch_size=4 * G, micro_batch_size=G, ppo_epochs=1,
                    advantage=advantage, num_generations=G, kl_in_loss=advantage == "grpo", kl_coef=0.1,
                    entropy_coef=0.01, micro_batch_tokens=tokens, loss_agg=loss_agg, shared_prompt=shared)
    exp = ppo.experience(ac, rollout, cfg, CPU)
    scores = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 0, 1, 1, 0, 0, 1, 0, 0, 1][:4 * G])
    exp = ppo.with_advantages(exp, scores, 0.1, cfg, ppo.advantage_estimator(cfg))
    params = [p for p in ac.parameters() if p.requires_grad]
    stats = ppo.ppo_update(ac, torch.optim.SGD(params, lr=0.0), exp, cfg, CPU, step=0, kl_coef=0.1)
    return stats, [p.grad.clone() for p in params], exp


@pytest.mark.parametrize("family, lora_rank, advantage, tokens, loss_agg", [
    ("tiny", 4, "grpo", 0, "token-mean"),  # LoRA, micro-batches of rows; old log-probs from the update's forward
    ("tiny", 0, "grpo", 0, "token-mean"),  # full fine-tuning
    ("tiny", 4, "grpo", 60, "seq-mean-token-mean"),  # packs of 60 tokens; the losses' [n_seq, R'] rows
    ("qwen2-gqa", 0, "grpo", 60, "token-mean"),
    ("tiny", 4, "gae", 60, "token-mean"),  # a critic: the value loss
])
def test_an_update_through_shared_prompt_packs_gives_the_unshared_loss_and_gradients(family, lora_rank, advantage,
                                                                                     tokens, loss_agg):
    """One update (one minibatch of every row, several micro-batches) with --shared_prompt on against off:
    the same losses and stats and the same parameter gradients (the prompt's accumulating its G
    responses' through the one forward), against the unshared run padded (tokens 0) and packed."""
    on, grads_on, exp_on = _updated(family, lora_rank, "on", advantage, tokens, loss_agg)
    off, grads_off, exp_off = _updated(family, lora_rank, "off", advantage, tokens, loss_agg)
    assert exp_on.shared.on and exp_off.shared is None
    assert all(isinstance(mb.segments, torch.Tensor) for mbs, _ in exp_on.plan for mb in mbs)
    mask = exp_on.batch.response_mask.bool()
    _assert_close(exp_on.old_logp[mask], exp_off.old_logp[mask], "old_logp")
    assert on.keys() == off.keys()
    for k in off:
        if k != "skipped_nonfinite":
            assert on[k] == pytest.approx(off[k], rel=RTOL, abs=1e-7), k
    assert sum(g.abs().sum() for g in grads_off) > 0
    for i, (a, b) in enumerate(zip(grads_on, grads_off)):
        _assert_close(a, b, f"gradient {i}")


def test_a_group_over_the_budget_falls_back_to_its_rows_and_is_logged(caplog):
    """A group whose P + sum R_i exceeds micro_batch_tokens goes unshared, its rows one by one; the others
    stay whole groups, never split across micro-batches."""
    lengths = packing.Lengths(np.array([5] * 4 + [3] * 4), np.array([10, 10, 9, 8, 2, 1, 3, 2]), 4,
                              np.array([True, True]))
    found, fallbacks = shared_prompt.packs(lengths, np.arange(8), 20)
    units = [u.tolist() for pack_ in found for u in pack_.units]
    assert fallbacks == 1 and [4, 5, 6, 7] in units and sorted(u[0] for u in units if len(u) == 1) == [0, 1, 2, 3]
    assert all(sum(shared_prompt.unit_tokens(lengths, u) for u in p.units) <= 20 for p in found)
    assert shared_prompt.unit_tokens(lengths, np.arange(4, 8)) == 3 + 8
    cfg = PPOConfig(num_generations=4, micro_batch_tokens=20)
    with caplog.at_level(logging.INFO, logger="fastrlhf"):
        ppo.shared_packs(lengths, np.arange(8), cfg, "phase 3")
    assert "1 group(s) of 4 responses exceed micro_batch_tokens (20) with their prompt shared" in caplog.text


def test_auto_shares_where_the_saving_passes_the_threshold():
    long_prompts = packing.Lengths(np.array([40] * 8), np.array([5] * 8), 4, np.array([True, True]))
    short_prompts = packing.Lengths(np.array([2] * 8), np.array([40] * 8), 4, np.array([True, True]))
    saving = shared_prompt.decide("auto", long_prompts)
    assert saving.on and (saving.shared, saving.unshared) == (2 * 40 + 8 * 5, 8 * 45)
    assert "shared prompt on: 120 tokens per pass instead of 360 (240 fewer, 67%)" == saving.describe()
    assert not shared_prompt.decide("auto", short_prompts).on  # 6 of 336 tokens: under 10%
    assert not shared_prompt.decide("auto", packing.Lengths(np.array([40] * 8), np.array([5] * 8))).on  # G = 1
    different = packing.Lengths(np.array([40] * 8), np.array([5] * 8), 4, np.array([True, False]))
    assert shared_prompt.decide("on", different).shared == 360 - 3 * 40  # a group whose prompts differ is not shared
    with pytest.raises(ValueError, match="shared_prompt must be one of auto, on, off, got 'yes'"):
        shared_prompt.decide("yes", long_prompts)
    with pytest.raises(ValueError, match=r"ppo: --shared_prompt must be one of auto, on, off, got 'yes'"):
        ppo.check_update(PPOConfig(shared_prompt="yes"))


def test_the_block_mask_of_flex_attention_gives_the_4d_mask_attention():
    """On CUDA a shared-prompt pack's attention is flex attention under a BlockMask made from the tokens'
    segments (no dense [N, N] mask); run here on the CPU (compiled flex attention) against the CPU's
    path, SDPA with the 4-D mask."""
    import types

    unit = [0] * 10 + [1] * 8
    member = [0, 0, 0, 1, 1, 1, 1, 1, 2, 2] + [0, 0, 0, 0, 1, 1, 1, 2]
    segments = torch.tensor([unit, member])
    dense = attention.shared_prompt_mask(segments)[0, 0]
    assert dense[9, :3].all() and not dense[9, 3:8].any() and dense[9, 8:10].all()  # response 2: prompt + itself
    assert not dense[10:, :10].any() and not dense[17, 14:17].any()
    q, k, v = torch.randn(1, 4, 18, 8), torch.randn(1, 2, 18, 8), torch.randn(1, 2, 18, 8)
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    planned = dict(fastrlhf_planned=True, scaling=0.3)
    flex, _ = attention.attention(module, q, k, v, None, **planned,
                                  fastrlhf_block_mask=attention.shared_prompt_block_mask(segments))
    sdpa, _ = attention.attention(module, q, k, v, None, **planned, **attention.shared_prompt_plan(segments))
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-6)


def test_read_lengths_finds_the_groups_whose_prompts_match():
    lm, tok = load_causal_lm("tiny", device=CPU)
    install(lm)
    batch = _grouped_rollout(tok, 2, n_prompts=3).batch
    ids = batch.input_ids.clone()
    ids[3, batch.prompt_len - 1] = 7 if ids[3, batch.prompt_len - 1] != 7 else 8  # group 1's second prompt differs
    lengths = packing.read_lengths(batch._replace(input_ids=ids), 2)
    assert lengths.same_prompt.tolist() == [True, False, True]
    with pytest.raises(ValueError, match="6 rows are not whole groups of group_size 4"):
        packing.read_lengths(batch, 4)


@pytest.mark.parametrize("family, lora_rank", [("tiny", 4), ("qwen2-gqa", 0)])
def test_dpo_pairs_sharing_their_prompt_give_the_unshared_loss_and_gradients(family, lora_rank):
    """DPO's chosen and rejected responses of a pair share its prompt: one pack [prompt, chosen, rejected]
    per pair gives the same reference sums, loss, stats and parameter gradients as the padded rows."""
    from fastrlhf.train.config import DPOConfig
    from fastrlhf.train.recipes import dpo
    from fastrlhf.train.recipes.rm import pair_batch

    torch.manual_seed(0)
    lm, tok = _lm(family)
    policy = ActorCritic(lm, lora_rank=lora_rank, value_head=False)
    with torch.no_grad():  # the reference (adapters off, or the frozen copy) differs from the policy
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.02)
    g = torch.Generator().manual_seed(2)
    tokens = lambda n: torch.randint(5, 30, (n,), generator=g).tolist()  # noqa: E731
    enc = {"prompt": [tokens(n) for n in (3, 9, 5, 7)], "chosen": [tokens(n) for n in (4, 1, 8, 6)],
           "rejected": [tokens(n) for n in (8, 3, 2, 6)]}
    batch = pair_batch(enc, range(4), tok.pad_token_id)
    cfg = DPOConfig(beta=0.5)
    shared, saving = dpo.shared_pairs(batch, "on", CPU)
    # prompts 3 + 9 + 5 + 7 = 24 tokens, once per pair; responses 19 chosen and 19 rejected
    assert saving.on and (saving.shared, saving.unshared) == (24 + 38, 2 * 24 + 38)
    assert dpo.shared_pairs(batch, "auto", CPU)[1].on  # 24 of 86 tokens saved
    out = {}
    for key, mb in (("off", None), ("on", shared)):
        policy.zero_grad(set_to_none=True)
        loss, stats = dpo.dpo_step_loss(policy, batch, cfg, CPU, mb)
        loss.backward()
        ref = dpo.reference_sums(policy, batch, CPU, mb)
        out[key] = (loss.detach(), {k: v.detach() for k, v in stats.items()}, ref,
                    [p.grad.clone() for p in policy.parameters() if p.requires_grad])
    (loss0, stats0, ref0, grads0), (loss1, stats1, ref1, grads1) = out["off"], out["on"]
    _assert_close(loss1, loss0, "loss")
    for a, b in zip(ref1, ref0):
        _assert_close(a, b, "reference sums")
    for k in stats0:
        torch.testing.assert_close(stats1[k], stats0[k], rtol=RTOL, atol=1e-6, msg=k)
    assert sum(g.abs().sum() for g in grads0) > 0
    for i, (a, b) in enumerate(zip(grads1, grads0)):
        _assert_close(a, b, f"gradient {i}")
