"""Packed token-budget micro-batches (fastrlhf.train.packing): the grouping, the same hidden states and
losses as padded rows, the padding they leave out, and the update's one device read per minibatch.
(The packed gradients against the padded ones on 1 and 2 ranks: tests/train/test_distributed.py.)"""

import collections
import re
import traceback

import numpy as np
import pytest
import torch

from fastrlhf.train import packing
from fastrlhf.train.config import PPOConfig
from fastrlhf.train.data import pack
from fastrlhf.train.heads import ActorCritic
from fastrlhf.train.models import load_causal_lm
from fastrlhf.train.recipes import ppo
from fastrlhf.train.rollout import Rollout

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("keep_threads_and_warnings")


def _rollout(tokenizer, response_lengths, prompt_lengths=None, seed=0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    B = len(response_lengths)
    prompt_lengths = prompt_lengths or [int(n) for n in torch.randint(3, 9, (B,), generator=g)]
    tokens = lambda n: torch.randint(5, 30, (n,), generator=g).tolist()  # noqa: E731
    batch = pack([tokens(n) for n in prompt_lengths], [tokens(n) for n in response_lengths], tokenizer.pad_token_id)
    return Rollout(batch, [""] * B, [""] * B)


def test_partition_holds_the_budget_longest_first():
    lengths = np.array([5, 12, 3, 9, 9, 1, 7, 4])
    groups = packing.partition(lengths, np.arange(8), 16)
    assert sorted(np.concatenate(groups).tolist()) == list(range(8))  # every row once
    assert all(lengths[g].sum() <= 16 for g in groups)
    assert [lengths[g].tolist() for g in groups] == [[12], [9], [9, 7], [5, 4, 3, 1]]  # sorted, next-fit
    with pytest.raises(ValueError, match=r"micro_batch_tokens \(8\) must hold the longest sequence \(12 tokens"):
        packing.partition(lengths, np.arange(8), 8)


@pytest.mark.parametrize("key, value, expected", [
    ("micro_batch_tokens", 20, "--micro_batch_tokens (20) must hold the longest sequence: max_prompt_len + "
                               "max_new_tokens = 32 + 12 = 44 tokens"),
    ("micro_batch_tokens", -1, "--micro_batch_tokens must be >= 0 (0 = micro_batch_size padded rows), got -1"),
    ("loss_agg", "seq-mean", "--loss_agg must be one of token-mean, token-sum, seq-mean-token-sum"),
])
def test_update_keys_are_checked_before_a_model_loads(tmp_path, key, value, expected):
    cfg = PPOConfig(out=str(tmp_path), model="tiny", reward="fastrlhf.train.task:true_score", **{key: value})
    with pytest.raises(ValueError, match=re.escape(f"ppo: {expected}")):
        ppo.prepare(cfg)
    assert not (tmp_path / "ppo").exists()
    ppo.prepare(PPOConfig(out=str(tmp_path), model="tiny", reward="fastrlhf.train.task:true_score",
                          micro_batch_tokens=44, loss_agg="seq-mean-token-mean"))


def test_a_pack_gives_the_hidden_states_of_the_padded_rows():
    """Sequences end to end, position_ids restarting: attention keeps them apart (a block-diagonal
    causal mask here, on the CPU), so each response token's hidden state is the padded row's; in
    both loss layouts (the pack's sequences as rows [n_seq, R'], or its response tokens [1, n])."""
    torch.manual_seed(0)
    lm, tok = load_causal_lm("tiny", device=CPU, dtype=torch.float64)
    ac = ActorCritic(lm, lora_rank=4)
    rollout = _rollout(tok, [7, 1, 4, 12, 2, 9])
    b = rollout.batch
    lengths = packing.read_lengths(b)
    rows = np.arange(6)
    (padded,), = packing.micro_batches(b, [[rows]], lengths, packed=False, device=CPU)
    groups = [packing.partition(lengths.total, rows, 20)]
    packs = [mb for flat in (False, True) for mb in packing.micro_batches(b, groups, lengths, packed=True, flat=flat,
                                                                          device=CPU)[0]]
    assert len(packs) > 2 and all(int(mb.tokens.numel()) <= 20 for mb in packs)
    with torch.no_grad():
        h_pad, v_pad = packing.forward_responses(ac, b, padded)  # [B, R, ...]: its rows are 0..5 in order
        for mb in packs:
            h, v = packing.forward_responses(ac, b, mb)
            mask = mb.response_mask(b).bool()
            want_h, want_v = mb.take(h_pad), mb.take(v_pad)
            torch.testing.assert_close(h[mask], want_h[mask], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(v[mask], want_v[mask], rtol=1e-6, atol=1e-6)  # the value head is float32
            assert mb.n_tokens == int(b.response_mask[mb.rows].sum())


def _processed_tokens(monkeypatch) -> list[int]:
    """The token positions of every decoder-stack forward from now on (their input_ids), appended."""
    import fastrlhf.train.heads

    seen = []
    real = fastrlhf.train.heads.hidden_states

    def spy(lm, input_ids, *args, **kwargs):
        seen.append(input_ids.numel())
        return real(lm, input_ids, *args, **kwargs)

    monkeypatch.setattr(fastrlhf.train.heads, "hidden_states", spy)
    return seen


def test_packing_processes_under_5_percent_padding_where_responses_vary_8x(monkeypatch, capsys):
    """Responses of 4 to 32 tokens (8x): padded micro-batches of 4 rows process every row at the
    longest prompt + response; packs of 96 tokens process only real tokens. Both counted from the
    update's forwards; the losses' response rows are counted too (packs read [n_seq, R'], R' their
    longest response)."""
    torch.manual_seed(0)
    lm, tok = load_causal_lm("tiny", device=CPU)
    ac = ActorCritic(lm, lora_rank=4)
    response_lengths = [4, 32, 8, 16, 28, 6, 12, 20, 24, 10, 4, 30, 14, 18, 26, 22]
    rollout = _rollout(tok, response_lengths)
    real = int(rollout.batch.attention_mask.sum())
    figures = {}
    for name, tokens in (("padded", 0), ("packed", 96)):
        cfg = PPOConfig(rollout_batch_size=16, mini_batch_size=8, micro_batch_size=4, ppo_epochs=1,
                        micro_batch_tokens=tokens)
        exp = ppo.experience(ac, rollout, cfg, CPU)
        exp.advantages = exp.returns = torch.randn_like(exp.old_logp) * rollout.batch.response_mask
        seen = _processed_tokens(monkeypatch)
        ppo.ppo_update(ac, torch.optim.SGD(ac.parameters(), lr=0.0), exp, cfg, CPU, step=0)
        plan = [mb.rows.numpy() for mbs, _ in ppo.update_plan(exp, cfg, CPU) for mb in mbs]
        assert sorted(np.concatenate(plan).tolist()) == list(range(16))
        loss = packing.padding_fraction(exp.lengths, plan, packed=bool(tokens), prompt_len=rollout.batch.prompt_len,
                                        response_len=rollout.batch.response_mask.shape[1], flat=True)["loss"]
        figures[name] = {"trunk": 1 - real / sum(seen), "loss": loss, "forwards": len(seen)}
        monkeypatch.undo()
    with capsys.disabled():
        print(f"\npadding of the processed tokens, responses 4-32: {figures}")
    assert figures["padded"]["trunk"] > 0.3  # today's count: a third and more of the positions are padding
    assert figures["packed"]["trunk"] <= 0.05 and figures["packed"]["loss"] <= 0.05


def _counting(original, name: str, reads: collections.Counter):
    """`original` (a Tensor method), counting its calls in `reads` by caller, except the one left out."""

    def read(self, *args, **kwargs):
        caller = traceback.extract_stack()[-2]
        if caller.name != "_off_mask_zero":
            reads[f"{caller.filename}:{caller.lineno} {name}"] += 1
        return original(self, *args, **kwargs)

    return read


def test_the_update_reads_the_device_once_per_minibatch(triton_backend):
    """ppo_update keeps token counts, losses, stats and the finiteness check on the device and reads
    them once at each minibatch's end: .item(), float(), bool(), int() and .tolist() of any tensor are
    counted, padded and packed, 2 epochs x 2 minibatches x 2+ micro-batches. The losses run through
    the Triton kernels, the path CUDA takes (here in the interpreter): the ops' torch path is the CPU's
    and reads its totals on the host by design (ops.losses._agg_torch)."""
    torch.manual_seed(0)
    lm, tok = load_causal_lm("tiny", device=CPU)
    ac = ActorCritic(lm, lora_rank=4)
    rollout = _rollout(tok, [6, 1, 5, 2, 6, 6, 3, 4])
    names = ("item", "tolist", "__float__", "__bool__", "__int__")
    for tokens in (0, 16):
        cfg = PPOConfig(rollout_batch_size=8, mini_batch_size=4, micro_batch_size=2, ppo_epochs=2,
                        micro_batch_tokens=tokens)
        exp = ppo.with_advantages(ppo.experience(ac, rollout, cfg, CPU), torch.randn(8), 0.1, cfg,
                                  ppo.advantage_estimator(cfg))
        optimizer = torch.optim.SGD([p for p in ac.parameters() if p.requires_grad], lr=1e-3)
        reads = collections.Counter()
        originals = {n: getattr(torch.Tensor, n) for n in names}
        try:
            for n in names:
                setattr(torch.Tensor, n, _counting(originals[n], n, reads))
            stats = ppo.ppo_update(ac, optimizer, exp, cfg, CPU, step=0)
        finally:
            for n, f in originals.items():
                setattr(torch.Tensor, n, f)
        minibatches = cfg.ppo_epochs * cfg.rollout_batch_size // cfg.mini_batch_size
        assert sum(reads.values()) <= minibatches, (tokens, reads)
        assert stats["skipped_nonfinite"] == 0 and np.isfinite(stats["pg_loss"])


def _per_sequence_sdpa(q, k, v, cu, scale):
    """Causal SDPA over each sequence of a pack ([N, heads, D] tensors, GQA by head groups)."""
    import torch.nn.functional as F

    outs = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        x = [t[start:end].transpose(0, 1) for t in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*x, is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1))
    return torch.cat(outs)


def test_a_packs_varlen_attention_gives_the_block_mask_attention(monkeypatch):
    """On CUDA a pack's attention is a varlen kernel over cu_seqlens (flash-attn's, or PyTorch's
    varlen_attn); the code around it (layouts, GQA, the causal flag, the scale) runs here on the CPU
    with stand-ins of both kernels (their signatures, per-sequence SDPA inside), and gives what the
    CPU path (SDPA with the block-diagonal causal mask) gives. The kernels themselves run only on a
    GPU (bench/gpu_run.sh --only update checks packed against padded there)."""
    import sys
    import types

    from fastrlhf.train import attention

    def torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                     enable_gqa=False):
        assert window_size == (-1, 0) and enable_gqa and cu_q is cu_k and max_q == max_k == 5
        return _per_sequence_sdpa(q, k, v, cu_q, scale)

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale=None, causal=False):
        assert causal and dropout_p == 0.0 and cu_q is cu_k and max_q == max_k == 5
        return _per_sequence_sdpa(q, k, v, cu_q, softmax_scale)

    torch.manual_seed(0)
    cu = torch.tensor([0, 3, 7, 12, 14], dtype=torch.int32)
    sequence = torch.repeat_interleave(torch.arange(4), cu.diff())
    q, k, v = torch.randn(1, 4, 14, 8), torch.randn(1, 2, 14, 8), torch.randn(1, 2, 14, 8)
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True)
    plan = dict(fastrlhf_planned=True, cu_seq_lens_q=cu, max_length_q=5)
    masked, _ = attention.attention(module, q, k, v, None, scaling=0.3, **plan,
                                    fastrlhf_mask=attention.block_causal_mask(sequence))
    fakes = {"flash_attn": types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func),
             "torch.nn.attention.varlen": types.SimpleNamespace(varlen_attn=torch_varlen)}
    for installed in ("flash_attn", "torch.nn.attention.varlen"):
        with monkeypatch.context() as m:
            m.setitem(sys.modules, installed, fakes[installed])
            if installed != "flash_attn":
                m.setitem(sys.modules, "flash_attn", None)  # not installed: import fails
            attention.varlen_kernel.cache_clear()
            assert attention.varlen_kernel()[0].startswith(installed)
            varlen, _ = attention.attention(module, q, k, v, None, scaling=0.3, **plan)
        attention.varlen_kernel.cache_clear()
        assert varlen.shape == masked.shape == (1, 14, 4, 8)
        torch.testing.assert_close(varlen, masked, rtol=1e-5, atol=1e-6)


def test_a_width_rounded_up_to_8_gives_the_same_experience_and_update(monkeypatch):
    """Compiled layers on CUDA: phases 3 and 5 run over the rollout's width rounded up to a multiple of
    8 with more prompt padding (ppo.width_multiple; inductor's SDPA lowering guards on the mask's width
    modulo 8, so a width across that line recompiled the training step). The extra columns change
    nothing: the same old and reference log-probs, and the same update, as the width the rollout had."""
    assert ppo.width_multiple(PPOConfig(compile="auto"), torch.device("cuda")) == 8
    assert ppo.width_multiple(PPOConfig(compile="off"), torch.device("cuda")) == 1
    assert ppo.width_multiple(PPOConfig(compile="on"), CPU) == 1
    cfg = PPOConfig(rollout_batch_size=8, mini_batch_size=4, micro_batch_size=2, ppo_epochs=1)
    out = {}
    for multiple in (1, 8):
        monkeypatch.setattr(ppo, "width_multiple", lambda cfg, device, m=multiple: m)
        torch.manual_seed(0)
        lm, tok = load_causal_lm("tiny", device=CPU, dtype=torch.float64)
        ac = ActorCritic(lm, lora_rank=4)
        rollout = _rollout(tok, [6, 1, 5, 2, 6, 6, 3, 4], prompt_lengths=[3, 5, 4, 5, 3, 4, 5, 5])
        assert rollout.batch.input_ids.shape[1] == 11
        exp = ppo.with_advantages(ppo.experience(ac, rollout, cfg, CPU), torch.randn(8, dtype=torch.float64), 0.1,
                                  cfg, ppo.advantage_estimator(cfg))
        optimizer = torch.optim.SGD([p for p in ac.parameters() if p.requires_grad], lr=1e-2)
        stats = ppo.ppo_update(ac, optimizer, exp, cfg, CPU, step=0)
        out[multiple] = exp, stats, [p.detach().clone() for p in ac.parameters() if p.requires_grad]
    (exp1, stats1, params1), (exp8, stats8, params8) = out[1], out[8]
    assert exp8.batch.input_ids.shape[1] == 16 and exp8.batch.prompt_len == rollout.batch.prompt_len + 5
    assert torch.equal(exp8.batch.responses, exp1.batch.responses)
    for name in ("old_logp", "ref_logp"):  # float64
        torch.testing.assert_close(getattr(exp8, name), getattr(exp1, name), rtol=1e-12, atol=1e-12, msg=name)
    for name in ("values", "advantages", "returns"):  # the float32 value head's
        torch.testing.assert_close(getattr(exp8, name), getattr(exp1, name), msg=name)
    assert stats8["pg_loss"] == pytest.approx(stats1["pg_loss"], rel=1e-6)
    for a, b in zip(params8, params1):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("tokens", [0, 16])
def test_the_first_minibatch_takes_its_old_logprobs_from_its_own_forward(monkeypatch, tokens):
    """Critic-free with the KL in the loss: phase 3 scores the policy only on the rows outside the
    update's first minibatch, whose forward forms their old log-probs (the policy has not moved yet).
    Against phase 3 scoring every row: the same old log-probs once the update ran, the same losses and
    stats, and the same parameters, padded and packed."""
    cfg = PPOConfig(rollout_batch_size=8, mini_batch_size=4, micro_batch_size=2, ppo_epochs=2, advantage="grpo",
                    num_generations=4, kl_in_loss=True, kl_coef=0.1, micro_batch_tokens=tokens)
    out = {}
    for skip in (False, True):
        monkeypatch.setattr(ppo, "old_from_first_update", lambda cfg, ac, skip=skip: skip)
        torch.manual_seed(0)
        lm, tok = load_causal_lm("tiny", device=CPU, dtype=torch.float64)
        ac = ActorCritic(lm, lora_rank=4, value_head=False)
        rollout = _rollout(tok, [6, 1, 5, 2, 6, 6, 3, 4])
        exp = ppo.experience(ac, rollout, cfg, CPU)
        first = torch.cat([mb.rows for mb in exp.plan[0][0]]) if not tokens else None
        if skip and first is not None:  # phase 3 left them to the update
            assert not exp.old_logp[first].any() and exp.old_logp[np.setdiff1d(np.arange(8), first.numpy())].any()
        exp = ppo.with_advantages(exp, torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 0], dtype=torch.float64), 0.1, cfg,
                                  ppo.advantage_estimator(cfg))
        optimizer = torch.optim.SGD([p for p in ac.parameters() if p.requires_grad], lr=1e-1)
        stats = ppo.ppo_update(ac, optimizer, exp, cfg, CPU, step=0)
        out[skip] = exp, stats, [p.detach().clone() for p in ac.parameters() if p.requires_grad]
    (exp0, stats0, params0), (exp1, stats1, params1) = out[False], out[True]
    torch.testing.assert_close(exp1.old_logp, exp0.old_logp, rtol=1e-12, atol=1e-12)
    assert exp1.old_logp.abs().sum() > 1
    assert stats1.keys() == stats0.keys()
    for k in stats0:  # losses, clip fractions, approx_kl, entropy, k3 KL, gradient norm
        assert stats1[k] == pytest.approx(stats0[k], rel=1e-9, abs=1e-12), k
    for a, b in zip(params1, params0):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("critic", [False, True, "sampler"])
def test_old_logprobs_from_the_sampler_leave_phase_3_the_reference_and_the_values(monkeypatch, critic):
    """--old_logprobs sampler: the Experience's old log-probs are the rollout's sampler_logp (here the
    recomputed ones + 0.01 on every response token, so that a mix-up shows), the only lm_head pass is the
    reference's, and with a critic the values are those of the recomputing run's forward, or the rollout's
    sampler_values where the engine gave them (+ 0.5), and then the reference's is the only forward."""
    base = dict(rollout_batch_size=8, mini_batch_size=4, micro_batch_size=2, kl_in_loss=True,
                rollout_sampler="inverse_cdf", **({} if critic else dict(advantage="grpo", num_generations=4)))
    lm, tok = load_causal_lm("tiny", device=CPU, dtype=torch.float64)
    ac = ActorCritic(lm, lora_rank=4, value_head=bool(critic))
    rollout = _rollout(tok, [6, 1, 5, 2, 6, 6, 3, 4])
    monkeypatch.setattr(ppo, "old_from_first_update", lambda cfg, ac: False)
    recomputed = ppo.experience(ac, rollout, PPOConfig(**base), CPU)
    mask = rollout.batch.response_mask
    rollout = rollout._replace(sampler_logp=((recomputed.old_logp + 0.01) * mask).float())
    if critic == "sampler":
        rollout = rollout._replace(sampler_values=(recomputed.values + 0.5) * mask)
    calls, forwards = [], []
    linear_logprobs, forward_responses = ppo.ops.linear_logprobs, ppo.packing.forward_responses
    monkeypatch.setattr(ppo.ops, "linear_logprobs", lambda *a, **k: calls.append(1) or linear_logprobs(*a, **k))
    monkeypatch.setattr(ppo.packing, "forward_responses", lambda *a: forwards.append(1) or forward_responses(*a))
    exp = ppo.experience(ac, rollout, PPOConfig(**base, old_logprobs="sampler"), CPU)
    assert len(calls) == 1  # the reference's one padded forward
    assert len(forwards) == (2 if critic is True else 1)  # + the trunk's for the values
    assert exp.old_logp.dtype == torch.float64 and not exp.old_from_update
    torch.testing.assert_close(exp.old_logp, rollout.sampler_logp.double(), rtol=0, atol=0)
    torch.testing.assert_close(exp.ref_logp, recomputed.ref_logp, rtol=0, atol=0)
    if critic == "sampler":
        torch.testing.assert_close(exp.values, rollout.sampler_values, rtol=0, atol=0)
    elif critic:
        torch.testing.assert_close(exp.values, recomputed.values, rtol=0, atol=0)
    else:
        assert exp.values is None


def test_old_logprobs_come_from_the_update_only_where_nothing_reads_them_before():
    lm, _ = load_causal_lm("tiny", device=CPU)
    critic_free, with_critic = ActorCritic(lm, lora_rank=0, value_head=False), ActorCritic(lm, lora_rank=0)
    grpo = dict(advantage="grpo", num_generations=4, kl_in_loss=True)
    assert ppo.old_from_first_update(PPOConfig(**grpo), critic_free)
    assert ppo.old_from_first_update(PPOConfig(**dict(grpo, kl_in_loss=False, kl_coef=0.0)), critic_free)
    assert not ppo.old_from_first_update(PPOConfig(**dict(grpo, kl_in_loss=False, kl_coef=0.05)), critic_free)
    assert not ppo.old_from_first_update(PPOConfig(**dict(grpo, rollout_correction="token")), critic_free)
    assert not ppo.old_from_first_update(PPOConfig(**dict(grpo, old_logprobs="sampler")), critic_free)
    assert not ppo.old_from_first_update(PPOConfig(kl_in_loss=True), with_critic)
