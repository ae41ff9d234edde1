"""Actor-critic, reference policy, padding, generation and checkpoints on the tiny model."""

import copy
import math

import pytest
import torch

from fastrlhf import ops
from fastrlhf.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from fastrlhf.train.data import pack
from fastrlhf.train.heads import ActorCritic, RewardModel
from fastrlhf.train.models import hidden_states, load_causal_lm
from fastrlhf.train.rollout import generate, response_mask_after_eos, token_logprobs

pytestmark = pytest.mark.usefixtures("keep_threads_and_warnings")


CPU = torch.device("cpu")


@pytest.fixture
def tiny():
    lm, tok = load_causal_lm("tiny", device=CPU)
    return lm.eval(), tok


def _random_seqs(n, lo, hi, vocab, low_id=4):
    return [torch.randint(low_id, vocab, (int(torch.randint(lo, hi + 1, ())),)).tolist() for _ in range(n)]


def test_left_padded_logprobs_equal_unpadded(tiny):
    lm, tok = tiny
    prompts = _random_seqs(5, 2, 9, len(tok))
    responses = _random_seqs(5, 1, 7, len(tok))
    batch = pack(prompts, responses, tok.pad_token_id)
    with torch.no_grad():
        logp = token_logprobs(lm, batch, hidden_states(lm, batch.input_ids, batch.attention_mask, batch.position_ids))
        for b, (p, r) in enumerate(zip(prompts, responses)):
            alone = pack([p], [r], tok.pad_token_id)  # no padding at all
            assert alone.attention_mask.all()
            h = hidden_states(lm, alone.input_ids, alone.attention_mask, alone.position_ids)
            expected = token_logprobs(lm, alone, h)[0]
            torch.testing.assert_close(logp[b, :len(r)], expected, atol=1e-5, rtol=0)
            assert (logp[b, len(r):] == 0).all()  # masked response tokens give 0
    # left padding really happened: the shortest prompt sits after pad tokens
    assert (batch.attention_mask[:, :batch.prompt_len] == 0).any()


def test_lora_disabled_reference_equals_base_model(tiny):
    lm, tok = tiny
    base = copy.deepcopy(lm)
    batch = pack(_random_seqs(4, 3, 6, len(tok)), _random_seqs(4, 2, 5, len(tok)), tok.pad_token_id)
    ac = ActorCritic(lm, lora_rank=4, lora_alpha=8).eval()
    with torch.no_grad():
        for name, p in ac.named_parameters():  # move the adapter away from its identity init
            if "lora_B" in name:
                p.normal_(std=0.5)
        expected = token_logprobs(base, batch, hidden_states(base, batch.input_ids, batch.attention_mask,
                                                             batch.position_ids))
        ref = token_logprobs(ac.policy, batch, ac.reference_hidden(batch.input_ids, batch.attention_mask,
                                                                   batch.position_ids),
                             head=ac.reference_lm_head())
        policy_h, _ = ac(batch.input_ids, batch.attention_mask, batch.position_ids)
        policy = token_logprobs(ac.policy, batch, policy_h)
    torch.testing.assert_close(ref, expected, atol=1e-6, rtol=0)
    assert (policy - expected).abs().max() > 1e-3  # the adapter is active outside the reference
    assert ac.reference is None  # no second copy of the weights with LoRA


def test_full_finetune_reference_is_a_frozen_copy(tiny):
    lm, tok = tiny
    ac = ActorCritic(lm, lora_rank=0)
    assert ac.reference is not None
    assert not any(p.requires_grad for p in ac.reference.parameters())
    assert all(p.requires_grad for p in ac.policy.parameters())
    batch = pack(_random_seqs(2, 3, 5, len(tok)), _random_seqs(2, 2, 4, len(tok)), tok.pad_token_id)
    before = ac.reference_hidden(batch.input_ids, batch.attention_mask, batch.position_ids)
    opt = torch.optim.SGD([p for p in ac.parameters() if p.requires_grad], lr=0.1)
    h, v = ac(batch.input_ids, batch.attention_mask, batch.position_ids)
    (h.square().mean() + v.square().mean()).backward()
    opt.step()
    after = ac.reference_hidden(batch.input_ids, batch.attention_mask, batch.position_ids)
    assert torch.equal(before, after)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_value_head_gets_gradients(tiny, lora_rank):
    lm, tok = tiny
    ac = ActorCritic(lm, lora_rank=lora_rank).train()
    batch = pack(_random_seqs(3, 3, 5, len(tok)), _random_seqs(3, 2, 4, len(tok)), tok.pad_token_id)
    hidden, values = ac(batch.input_ids, batch.attention_mask, batch.position_ids)
    P = batch.prompt_len
    v = values[:, P - 1:-1]
    returns = torch.randn_like(v)
    loss, _ = ops.value_loss(v, v.detach() + 0.1 * torch.randn_like(v), returns, batch.response_mask)
    loss.backward()
    for p in ac.value_head.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    # the value loss also reaches the shared trunk's trainable weights (LoRA B: A gets 0 while B = 0)
    trunk_grads = [p.grad for n, p in ac.named_parameters() if p.requires_grad and "value_head" not in n
                   and ("lora_B" in n or lora_rank == 0)]
    assert any(g is not None and g.abs().sum() > 0 for g in trunk_grads)


def test_response_mask_stops_after_first_eos():
    eos = 2
    responses = torch.tensor([[5, 6, 2, 7, 2], [2, 5, 5, 5, 5], [5, 5, 5, 5, 5]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    assert torch.equal(response_mask_after_eos(responses, eos), expected)


def _eos_at(lm, eos: int, steps: list[int]):
    """A forward hook on the output head: row b samples EOS at its steps[b]-th new token, for certain (every other
    logit -inf), and never before or after (its EOS logit -inf); the head runs once per new token (the prompt's
    pass makes the first). The rows' other tokens are still sampled."""
    calls = [0]

    def hook(module, args, logits):
        calls[0] += 1
        last = logits[:, -1]
        for b, step in enumerate(steps):
            if step == calls[0]:
                last[b] = torch.where(torch.arange(last.shape[-1]) == eos, 0.0, -math.inf)
            else:
                last[b, eos] = -math.inf
        return logits

    return lm.get_output_embeddings().register_forward_hook(hook)


def test_generate_masks_and_pads_after_eos(tiny):
    """Rows that sample EOS at new token 1..6 (6 = the last one) and rows that never do: the response mask keeps
    each row's tokens up to and including its EOS, padding and attention mask 0 after it, every row."""
    lm, tok = tiny
    assert tok.pad_token_id != tok.eos_token_id
    steps = [3, 1, 0, 6, 2, 0, 5, 4]  # 0: never
    prompt_ids = _random_seqs(8, 2, 6, len(tok))
    handle = _eos_at(lm, tok.eos_token_id, steps)
    try:
        r = generate(lm, tok, prompt_ids, ["x"] * 8, max_new_tokens=6, temperature=1.0, device=CPU)
    finally:
        handle.remove()
    b = r.batch
    assert b.input_ids.shape[0] == 8 and b.response_mask.shape[1] == 6
    assert b.response_mask.sum(-1).tolist() == [step or 6 for step in steps]
    for row, step in enumerate(steps):
        n = step or 6
        assert (b.responses[row, :n] == tok.eos_token_id).tolist() == [t == step - 1 for t in range(n)]
        assert (b.responses[row, n:] == tok.pad_token_id).all()
        assert b.attention_mask[row, b.prompt_len + n:].sum() == 0
    # prompts are left-padded and positions count only real tokens
    assert torch.equal(b.position_ids[b.attention_mask.bool()],
                       torch.cat([torch.arange(int(m.sum())) for m in b.attention_mask]))


def test_generation_ignores_the_models_own_generation_config(tmp_path, caplog):
    """A model folder whose generation_config.json asks for processors (repetition_penalty,
    min_new_tokens, suppress_tokens, top_k, ...) samples exactly what the same weights sample
    without them: softmax(logits / T), the distribution the log-probs score; the log names them once."""
    import json
    import logging
    import shutil

    from local_model import make_local_model

    clean = make_local_model(tmp_path / "clean")
    asks = tmp_path / "asks"
    shutil.copytree(clean, asks)
    lm, tok = load_causal_lm(clean, device=CPU)
    eos = tok.eos_token_id
    with torch.no_grad():  # make EOS likely, so that min_new_tokens (which forbids it) changes the samples
        lm.get_output_embeddings().weight[eos] += 2 * lm.get_output_embeddings().weight.norm(dim=1).max()
    lm.save_pretrained(clean)
    lm.save_pretrained(asks)
    own = json.loads((asks / "generation_config.json").read_text())
    own.update(repetition_penalty=5.0, min_new_tokens=6, no_repeat_ngram_size=1, top_k=3,
               suppress_tokens=list(range(4, len(tok), 2)))
    (asks / "generation_config.json").write_text(json.dumps(own))
    prompt_ids = _random_seqs(6, 2, 5, len(tok))
    runs = {}
    with caplog.at_level(logging.INFO, logger="fastrlhf"):
        for name in ("clean", "asks"):
            lm, tok = load_causal_lm(tmp_path / name, device=CPU)
            for _ in range(2):
                torch.manual_seed(0)
                runs[name] = generate(lm, tok, prompt_ids, ["x"] * 6, max_new_tokens=6, temperature=1.0,
                                      device=CPU).batch
    assert lm.generation_config.repetition_penalty == 5.0  # the model keeps its own config (for export)
    assert (runs["clean"].responses == eos).any()  # EOS is sampled: min_new_tokens would have forbidden it
    assert torch.equal(runs["asks"].input_ids, runs["clean"].input_ids)
    assert torch.equal(runs["asks"].response_mask, runs["clean"].response_mask)
    said = [r.getMessage() for r in caplog.records if "generation_config asks for" in r.getMessage()]
    assert len(said) == 1 and "repetition_penalty=5.0" in said[0] and "min_new_tokens=6" in said[0]
    assert "ignored" in said[0] and "softmax(logits / temperature)" in said[0]


def test_static_cache_samples_what_the_dynamic_cache_samples(tiny):
    """rollout_cache=static (preallocated KV cache; compiled decoding on CUDA) draws the same tokens
    from the same seed as the default dynamic cache, LoRA adapters included; a wrong name is refused."""
    lm, tok = tiny
    ac = ActorCritic(lm, lora_rank=4, lora_alpha=8.0, value_head=False)
    prompt_ids = _random_seqs(5, 2, 7, len(tok))
    runs = {}
    for cache in ("dynamic", "static"):
        torch.manual_seed(0)
        runs[cache] = generate(ac.policy, tok, prompt_ids, ["x"] * 5, max_new_tokens=9, temperature=0.8,
                               device=CPU, cache=cache).batch
    assert torch.equal(runs["static"].input_ids, runs["dynamic"].input_ids)
    assert torch.equal(runs["static"].response_mask, runs["dynamic"].response_mask)
    from fastrlhf.train.config import PPOConfig
    from fastrlhf.train.recipes.ppo import rollout_cache

    auto = PPOConfig(rollout_cache="auto")
    assert rollout_cache(auto, torch.device("cpu")) == "dynamic"  # nothing compiles on the CPU
    assert rollout_cache(auto, torch.device("cuda")) == "static"
    assert rollout_cache(PPOConfig(rollout_cache="dynamic"), torch.device("cuda")) == "dynamic"
    with pytest.raises(ValueError, match="cache must be one of dynamic, static, got 'paged'"):
        generate(ac.policy, tok, prompt_ids, ["x"] * 5, max_new_tokens=2, temperature=1.0, device=CPU, cache="paged")


def test_reward_model_reads_last_attended_token(tiny):
    lm, tok = tiny
    rm = RewardModel(lm).eval()
    prompts, responses = _random_seqs(3, 2, 5, len(tok)), _random_seqs(3, 1, 6, len(tok))
    batch = pack(prompts, responses, tok.pad_token_id)
    with torch.no_grad():
        scores = rm(batch.input_ids, batch.attention_mask, batch.position_ids)
        for b in range(3):
            alone = pack([prompts[b]], [responses[b]], tok.pad_token_id)
            h = hidden_states(lm, alone.input_ids, alone.attention_mask, alone.position_ids)
            assert abs(scores[b] - rm.head(h[0, -1]).squeeze()) < 1e-5


def test_checkpoint_roundtrip_restores_weights_optimizer_and_rng(tiny, tmp_path):
    lm, _ = tiny
    ac = ActorCritic(lm, lora_rank=4)
    opt = torch.optim.AdamW([p for p in ac.parameters() if p.requires_grad], lr=1e-2)
    ac.value_head.weight.sum().backward()
    opt.step()
    save_checkpoint(tmp_path, 7, ac.trainable_state(), opt, {"kl_coef": 0.3})
    expected_next = torch.rand(3)
    saved = {k: v.detach().clone() for k, v in ac.trainable_state().items()}
    with torch.no_grad():
        for p in ac.trainable_state().values():
            p.add_(1.0)
    state = load_checkpoint(latest_checkpoint(tmp_path), ac, opt)
    assert state == {"step": 7, "extra": {"kl_coef": 0.3}}
    for k, v in ac.trainable_state().items():
        assert torch.equal(v, saved[k]), k
    assert torch.equal(torch.rand(3), expected_next)  # RNG continues where the checkpoint left it
    assert len(opt.state) > 0
    assert not list(tmp_path.joinpath("checkpoints").glob(".*tmp*"))  # nothing half-written left behind


def test_inverse_cdf_picks_the_first_token_whose_running_sum_passes_its_uniform(monkeypatch):
    """InverseCDF's scores are 0 at one token and -inf elsewhere; the token is the first whose float64 running
    sum of softmax(x / T) exceeds U x the total, for the U it draws from the same seed; a token of probability 0
    is never picked, at U = 0 (the first token with p > 0) nor at U = 1 (beyond rand's range: the last with
    p > 0); a temperature <= 0 and an unknown sampler are refused."""
    from fastrlhf.train.rollout import InverseCDF, token_sampler

    x = torch.randn(5, 37) * 3
    x[:, [0, 5, 36]] = float("-inf")  # probability 0: the first, one inside, the last
    torch.manual_seed(3)
    processor = InverseCDF(0.7)
    got = processor(None, x.clone())
    torch.manual_seed(3)
    u = torch.rand(5, 1, dtype=torch.float64)
    cdf = torch.softmax(x.double() / 0.7, -1).cumsum(-1)
    want = (cdf > u * cdf[:, -1:]).double().argmax(-1)  # the first index past U x total
    pick = got.argmax(-1)
    assert torch.equal(pick, want)
    assert (got[torch.arange(5), pick] == 0).all() and torch.isneginf(got).sum() == 5 * 36
    # and keeps the log-prob of each token it drew
    want_logp = torch.log_softmax(x.double() / 0.7, -1)[torch.arange(5), pick]
    torch.testing.assert_close(processor.sampler_logprobs(1)[:, 0].double(), want_logp, rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="generate drew 2 tokens per row but called the sampler 1 times"):
        processor.sampler_logprobs(2)
    for value, expected in ((0.0, 1), (1.0, 35)):
        monkeypatch.setattr(torch, "rand", lambda shape, dtype, device, v=value: torch.full(shape, v, dtype=dtype))
        assert InverseCDF(1.0)(None, x.clone()).argmax(-1).tolist() == [expected] * 5, value
    monkeypatch.undo()
    x[2, 7] = float("nan")
    with pytest.raises(RuntimeError, match="a row's logits are not finite"):
        InverseCDF(1.0)(None, x)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        InverseCDF(0)
    with pytest.raises(ValueError, match="sampler must be one of multinomial, inverse_cdf, got 'gumbel'"):
        token_sampler("gumbel", 1.0)


@pytest.mark.parametrize("sampler", ["multinomial", "inverse_cdf"])
def test_rollout_sampler_draws_softmax_of_logits_over_temperature(tiny, sampler):
    """Each sampler's first tokens of 6000 rollouts of one prompt follow softmax(logits / T) of the model
    (LoRA policy, T = 0.7): every token's frequency within 5 standard errors + 1e-3 of its probability. The
    lm_head is scaled so that the logits are spread: sampling at T = 1 instead misses by 2.2x that bound."""
    lm, tok = tiny
    with torch.no_grad():
        lm.get_output_embeddings().weight.mul_(6)
    ac = ActorCritic(lm, lora_rank=4, lora_alpha=8.0, value_head=False)
    torch.manual_seed(0)
    prompt = torch.randint(4, len(tok), (4,)).tolist()
    n, T = 6000, 0.7
    with torch.no_grad():
        logits = ac.policy(input_ids=torch.tensor([prompt])).logits[0, -1].double()
    p = torch.softmax(logits / T, -1)
    torch.manual_seed(0)
    r = generate(ac.policy, tok, [prompt] * n, ["x"] * n, max_new_tokens=1, temperature=T, device=CPU,
                 sampler=sampler)
    freq = torch.bincount(r.batch.responses[:, 0], minlength=len(p)).double() / n
    assert (freq - p).abs().le(5 * (p * (1 - p) / n).sqrt() + 1e-3).all()


def test_inverse_cdf_rollout_carries_the_sampler_logprobs(tiny):
    """generate with sampler=inverse_cdf: the Rollout's sampler_logp are the teacher-forced log-probs of its
    tokens under the LoRA policy (fp32, T = 0.8: within 1e-5, KV cache against one forward), 0 past each
    response's EOS; with torch.multinomial there are none."""
    lm, tok = tiny
    ac = ActorCritic(lm, lora_rank=4, lora_alpha=8.0, value_head=False)
    with torch.no_grad():
        for name, p in ac.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    prompt_ids = _random_seqs(6, 2, 7, len(tok))
    torch.manual_seed(0)
    r = generate(ac.policy, tok, prompt_ids, ["x"] * 6, max_new_tokens=9, temperature=0.8, device=CPU,
                 sampler="inverse_cdf")
    b = r.batch
    with torch.no_grad():
        h = hidden_states(ac.policy, b.input_ids, b.attention_mask, b.position_ids)
        want = token_logprobs(ac.policy, b, h, temperature=0.8)
    assert r.sampler_logp.shape == b.response_mask.shape and r.sampler_logp.dtype == torch.float32
    torch.testing.assert_close(r.sampler_logp, want.float() * b.response_mask, rtol=0, atol=1e-5)
    assert (r.sampler_logp[b.response_mask == 0] == 0).all() and r.sampler_logp.sum() < -1
    assert generate(ac.policy, tok, prompt_ids, ["x"] * 6, max_new_tokens=9, temperature=0.8,
                    device=CPU).sampler_logp is None


def test_inverse_cdf_sampler_rollout_is_seeded_and_cache_independent(tiny):
    """sampler=inverse_cdf: the same seed draws the same rollout, with the dynamic and the static cache;
    another seed another one; its GenerationConfig passes transformers' strict check (a greedy pick, no
    sampling-only field set); PPO refuses an unknown --rollout_sampler."""
    from fastrlhf.train.config import PPOConfig
    from fastrlhf.train.recipes.ppo import prepare
    from fastrlhf.train.rollout import sampling_config

    lm, tok = tiny
    config = sampling_config(tok, temperature=0.8, max_new_tokens=9, sampler="inverse_cdf")
    config.validate(strict=True)
    assert config.do_sample is False
    ac = ActorCritic(lm, lora_rank=4, lora_alpha=8.0, value_head=False)
    prompt_ids = _random_seqs(5, 2, 7, len(tok))
    runs = {}
    for seed, cache in ((0, "dynamic"), (0, "static"), (1, "dynamic")):
        torch.manual_seed(seed)
        runs[seed, cache] = generate(ac.policy, tok, prompt_ids, ["x"] * 5, max_new_tokens=9, temperature=0.8,
                                     device=CPU, cache=cache, sampler="inverse_cdf").batch
    assert torch.equal(runs[0, "static"].input_ids, runs[0, "dynamic"].input_ids)
    assert not torch.equal(runs[1, "dynamic"].input_ids, runs[0, "dynamic"].input_ids)
    with pytest.raises(ValueError, match="rollout_sampler must be one of multinomial, inverse_cdf, got 'x'"):
        prepare(PPOConfig(rollout_sampler="x"))
