"""fastrlhf's decode engine (fastrlhf/train/engine.py) on CPU.

What runs here: the engine's step function eagerly (the same Python that is compiled and captured on
CUDA) for the distribution tests, and once compiled by inductor on CPU (no CUDA graph: there is no GPU)
for the compile checks. CUDA-graph capture and replay, bf16 and the speed are checked by
`bash bench/gpu_run.sh OUT --only rollout` on a GPU, not here.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from fastrlhf.train.engine import (
    SLOT_FIELDS,
    DecodeEngine,
    buckets_for,
    hash32,
    rollout_memory_bytes,
    row_keys,
    sample,
    unsupported_reason,
)
from fastrlhf.train.heads import ActorCritic
from fastrlhf.train.models import hidden_states
from fastrlhf.train.rollout import choose_engine, engine_generate, sampler_gap, token_logprobs

CPU = torch.device("cpu")
VOCAB, EOS, PAD = 13, 3, 0  # a small vocabulary: EOS (p ~ 1/13 per token) ends some rows mid-sequence
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL),
    "llama-biases-mha": lambda: LlamaConfig(**(SMALL | {"num_key_value_heads": 4}), attention_bias=True,
                                            mlp_bias=True),
    "llama3-rope": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "yarn-rope": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2-tied": lambda: Qwen2Config(**SMALL, tie_word_embeddings=True),
    "qwen2-sliding": lambda: Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen3": lambda: Qwen3Config(**SMALL, head_dim=16),
    "mistral-window": lambda: MistralConfig(**SMALL, sliding_window=6),
}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [4, 12, 1, 2, 6, 7, 8], [9], [7, 7, 2]]  # mixed lengths, left-padded
ROWS = len(PROMPTS)
TOKENIZER = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD,
                                  batch_decode=lambda ids, skip_special_tokens: [str(r) for r in ids])


def _policy(name: str, lora_rank: int = 4):
    """An ActorCritic's policy (HF + peft LoRA with non-zero B) on a random model of config `name`."""
    lm = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="sdpa")
    ac = ActorCritic(lm, lora_rank=lora_rank, value_head=False)
    with torch.no_grad():
        for n, p in ac.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    return ac


def _engine(policy, *, prompt_len=9, new_tokens=12, temperature=0.7, batch=ROWS, **kwargs):
    return DecodeEngine(policy, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, temperature=temperature,
                        eos_id=EOS, pad_id=PAD, device=CPU, **({"compile": False} | kwargs))


def _scored(policy, rollout, temperature):
    """Teacher-forced log-probs [B, R] of the rollout's tokens by the un-merged HF + peft forward."""
    b = rollout.batch
    with torch.no_grad():
        h = hidden_states(policy, b.input_ids, b.attention_mask, b.position_ids)
        return token_logprobs(policy, b, h, temperature=temperature)


def _assert_close(got, want, atol=1e-5):
    err = (got - want).abs()
    i = int(err.argmax())
    assert err.max() <= atol, f"max |diff| {err.max():.3g} at {divmod(i, got.shape[-1])}: {got.flatten()[i]} vs " \
                              f"{want.flatten()[i]}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_engine_samples_the_hf_peft_distribution(name):
    """The engine's log-probs of its own tokens equal the un-merged HF + peft model's teacher-forced
    ones within 1e-5 (fp32): left padding to a longer run-wide prompt length, mixed prompt lengths,
    LoRA with non-zero B, EOS in mid-sequence."""
    ac = _policy(name)
    engine = _engine(ac.policy)
    rollout = engine_generate(engine, ac.policy, TOKENIZER, PROMPTS, [""] * len(PROMPTS))
    b = rollout.batch
    lengths = b.response_mask.sum(-1)
    assert b.prompt_len == max(map(len, PROMPTS))  # the run-wide padding is trimmed off again
    assert lengths.min() < lengths.max(), "some row must end with EOS before another"
    assert (b.responses[b.response_mask.bool()] == EOS).sum() >= 1
    _assert_close(rollout.sampler_logp, _scored(ac.policy, rollout, 0.7) * b.response_mask)
    assert (rollout.sampler_logp[b.response_mask == 0] == 0).all()


@pytest.mark.parametrize("name", ["llama", "qwen2-tied"])
def test_fp32_engine_drawing_by_inversion_samples_the_hf_peft_distribution(name):
    """inverse_cdf=True (--rollout_sampler inverse_cdf): the same check as the race's above, and another
    random stream (the tokens differ from the race's of the same seed)."""
    ac = _policy(name)
    torch.manual_seed(0)
    rollout = engine_generate(_engine(ac.policy, inverse_cdf=True), ac.policy, TOKENIZER, PROMPTS, [""] * ROWS)
    b = rollout.batch
    _assert_close(rollout.sampler_logp, _scored(ac.policy, rollout, 0.7) * b.response_mask)
    assert (rollout.sampler_logp[b.response_mask == 0] == 0).all()
    torch.manual_seed(0)
    race = engine_generate(_engine(ac.policy), ac.policy, TOKENIZER, PROMPTS, [""] * ROWS)
    assert not torch.equal(race.batch.input_ids, b.input_ids)


@pytest.mark.parametrize("name", ["llama", "qwen2-tied"])
def test_engine_given_a_value_head_reports_the_critics_values(name):
    """generate(..., value_head): the values of a critic's head on the policy's trunk at the state before
    each sampled token equal the ActorCritic forward's over the rollout (fp32: |dv| <= 1e-5 |w| |h|, by
    Cauchy-Schwarz what a relative error of 1e-5 in the hidden state allows; a value is not a log-softmax,
    which cancels the error the logits share, and here |w| |h| ~ 5), 0 past EOS;
    the tokens are those of a rollout without the head (the values take no random numbers); an engine
    captured without a head refuses one later (checked on the flag the capture sets)."""
    policy = _policy(name)
    lm = policy.policy.base_model.model if hasattr(policy.policy, "base_model") else policy.policy
    ac = ActorCritic(lm, lora_rank=0, value_head=True)  # the same LoRA model: its trunk under a critic's head
    with torch.no_grad():
        ac.value_head.bias.fill_(0.3)
    engine = _engine(policy.policy, inverse_cdf=True)
    torch.manual_seed(0)
    rollout = engine_generate(engine, policy.policy, TOKENIZER, PROMPTS, [""] * ROWS, value_head=ac.value_head)
    b = rollout.batch
    with torch.no_grad():
        h, values = ac(b.input_ids, b.attention_mask, b.position_ids)
    want = values[:, b.prompt_len - 1:-1] * b.response_mask
    scale = float(ac.value_head.weight.detach().norm() * h.norm(dim=-1).max())
    assert 2 < scale < 20
    _assert_close(rollout.sampler_values, want, atol=1e-5 * scale)
    assert (rollout.sampler_values[b.response_mask == 0] == 0).all() and rollout.sampler_values.abs().sum() > 1
    torch.manual_seed(0)
    plain = engine_generate(engine, policy.policy, TOKENIZER, PROMPTS, [""] * ROWS)
    assert torch.equal(plain.batch.input_ids, b.input_ids) and plain.sampler_values is None
    engine.graphs = {ROWS: object()}  # as after a capture without the head
    with pytest.raises(ValueError, match="the first rollout was captured without a value head"):
        engine.generate(policy.policy, PROMPTS, ac.value_head)


def test_tokens_after_eos_are_padding_and_masked():
    ac = _policy("llama")
    rollout = engine_generate(_engine(ac.policy, new_tokens=16), ac.policy, TOKENIZER, PROMPTS[:3], ["a", "b", "c"])
    b = rollout.batch
    for row, mask in zip(b.responses, b.response_mask):
        n = int(mask.sum())
        assert (row[n:] == PAD).all() and (n == row.numel() or row[n - 1] == EOS)
        assert (row[:n - 1] != EOS).all()
    assert rollout.prompts == ["a", "b", "c"] and b.input_ids.shape[0] == 3  # fewer rows than the engine's batch


def _chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's chi-square statistic (regularised upper incomplete gamma)."""
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(counts.numel() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


@pytest.mark.parametrize("inverse_cdf", [False, True])
def test_sampler_draws_softmax_of_logits_over_temperature(inverse_cdf):
    """125k draws of `sample` (the step's own sampler, keyed as a step keys them: B sequences at columns
    0..249; the exponential race and the inversion) against softmax(logits / T): chi-square p >= 0.001 per
    token, and for pairs of consecutive draws of a row."""
    V, B, steps, T = 40, 500, 250, 0.8
    logits = torch.linspace(-3.5, 2.0, V, dtype=torch.float64)[torch.randperm(V)]  # p from ~1e-4 to 0.1
    p = torch.softmax(logits / T, -1)
    assert p.min() * B * steps >= 5, "chi-square needs >= 5 expected draws per cell"
    scores = (logits / T).float().expand(B, V).contiguous()
    seed, seqs = torch.tensor([12345]), torch.arange(B)
    draws = torch.empty(steps, B, dtype=torch.long)
    for t in range(steps):
        draws[t], logp = sample(scores, row_keys(seed, seqs, torch.full((B,), t)), inverse_cdf)
    _assert_close(logp.double(), torch.log(p)[draws[-1]], atol=1e-5)
    counts = torch.bincount(draws.flatten(), minlength=V).double()
    assert _chi_square_p(counts, p * B * steps) >= 1e-3
    # consecutive draws of a row are independent: 4 x 4 cells of (token bin at t, token bin at t + 1)
    bins = torch.div(draws, 10, rounding_mode="floor")  # tokens 0-9, 10-19, 20-29, 30-39
    pb = p.view(4, 10).sum(-1)
    pairs = (bins[:-1] * 4 + bins[1:]).flatten()
    joint = torch.bincount(pairs, minlength=16).double()
    assert _chi_square_p(joint, torch.outer(pb, pb).flatten() * pairs.numel()) >= 1e-3
    # rows of one step are independent draws too (not one draw broadcast)
    assert len(set(draws[0].tolist())) > 3


def test_hash32_is_a_bijection_on_a_block():
    x = torch.arange(2 ** 20, dtype=torch.int64) * 4099 + 7
    h = hash32(x)
    assert h.min() >= 0 and h.max() < 2 ** 32 and h.unique().numel() == x.numel()


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_refresh_after_an_optimizer_step_samples_the_updated_model(lora_rank):
    """After an optimizer step the engine re-forms its weights in place (same addresses) and its
    log-probs are the updated model's; the trained base weights are never modified."""
    ac = _policy("qwen2-tied", lora_rank)
    engine = _engine(ac.policy)
    engine_generate(engine, ac.policy, TOKENIZER, PROMPTS, [""] * len(PROMPTS))
    frozen = {n: p.detach().clone() for n, p in ac.named_parameters() if not p.requires_grad}
    ptrs = [t.data_ptr() for t in _engine_tensors(engine)]
    before = engine.weights.layers[0].qkv.clone()

    trainable = [p for p in ac.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=5e-2)
    rollout = engine_generate(engine, ac.policy, TOKENIZER, PROMPTS, [""] * len(PROMPTS))
    b = rollout.batch
    h = hidden_states(ac.policy, b.input_ids, b.attention_mask, b.position_ids)
    (-(token_logprobs(ac.policy, b, h, temperature=0.7) * b.response_mask).sum()).backward()
    optimizer.step()

    engine.refresh(ac.policy)
    assert not torch.equal(engine.weights.layers[0].qkv, before)
    assert [t.data_ptr() for t in _engine_tensors(engine)] == ptrs
    assert all(torch.equal(p, frozen[n]) for n, p in ac.named_parameters() if not p.requires_grad)
    rollout = engine_generate(engine, ac.policy, TOKENIZER, PROMPTS, [""] * len(PROMPTS))
    _assert_close(rollout.sampler_logp, _scored(ac.policy, rollout, 0.7) * rollout.batch.response_mask)


def _engine_tensors(engine) -> list[torch.Tensor]:
    w = engine.weights
    tensors = [w.embed, w.norm, w.head, w.inv_freq] + engine.state.tensors()
    return tensors + [t for lw in w.layers for t in vars(lw).values() if t is not None]


@pytest.mark.slow  # inductor's compile of the decode step, once per bucket: two minutes on a 2-core CPU
def test_compiled_step_is_one_graph_for_every_bucket_replayed_without_recompiles():
    """inductor on CPU (no CUDA graph here): the decode step compiles to one graph, dynamic in the slot
    dimension, for both buckets, with no graph break; a second rollout recompiles nothing; inside the
    decode loop nothing runs outside the compiled regions but the prefill and the compaction to the
    smaller bucket; buffers keep their
    addresses; the compiled step draws the eager step's tokens, and its log-probs are the HF + peft
    model's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    lm = AutoModelForCausalLM.from_config(LlamaConfig(**(SMALL | {"num_hidden_layers": 1})), attn_implementation="sdpa")
    ac = ActorCritic(lm, lora_rank=4, value_head=False)
    limits = [3, 11, 3, 11, 3]  # three sequences end by the first check: the other two move to bucket 2
    engine = _engine(ac.policy, new_tokens=11, temperature=1.3, compile=True, buckets=(2, ROWS))
    eager = _engine(ac.policy, new_tokens=11, temperature=1.3, buckets=(2, ROWS))
    torch.manual_seed(1)  # a seed whose rows 1 and 3 sample no early EOS (as the check below says)
    rollout = engine_generate(engine, ac.policy, TOKENIZER, PROMPTS, [""] * ROWS, limits=limits)
    assert engine.ends.tolist() == limits
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)
    assert engine.stats["compactions"] == 1
    _assert_close(rollout.sampler_logp, _scored(ac.policy, rollout, 1.3) * rollout.batch.response_mask)
    torch.manual_seed(1)
    assert torch.equal(engine_generate(eager, ac.policy, TOKENIZER, PROMPTS, [""] * ROWS,
                                       limits=limits).batch.input_ids, rollout.batch.input_ids)
    ptrs = [t.data_ptr() for t in _engine_tensors(engine)]

    with torch.compiler.set_stance("fail_on_recompile"):
        engine.refresh(ac.policy)
        engine._reset(ROWS)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine._run(PROMPTS)
    assert [t.data_ptr() for t in _engine_tensors(engine)] == ptrs
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    top = [e.name for e in prof.events() if e.cpu_parent is None]
    regions = [n for n in top if n.startswith("Torch-Compiled Region")]
    outside = [n for n in top if not n.startswith(("Torch-Compiled Region", "TorchDynamo Cache Lookup"))]
    assert len(regions) == engine.stats["decode_steps"] == 12  # 3 checks of 4: bucket 5, then 2
    assert set(regions) == {"Torch-Compiled Region: 0/0"}
    assert outside.count("fastrlhf::prefill") == 1
    polls = {"aten::resolve_conj", "aten::resolve_neg"}  # each check's done.tolist()
    compaction = {"aten::empty", "aten::to", "aten::lift_fresh", "aten::detach_", "aten::index_select", "aten::slice",
                  "aten::copy_", "aten::fill_"}  # the order as a tensor; each cache and slot field moved; rest emptied
    assert set(outside) - {"fastrlhf::prefill"} <= polls | compaction, outside
    assert outside.count("aten::resolve_conj") == 3  # one read of the flags per check
    assert outside.count("aten::index_select") == 2 + len(SLOT_FIELDS)  # one compaction: K, V and each slot field


@pytest.mark.parametrize("name", ["llama", "mistral-window"])
def test_same_tokens_whatever_the_slots_buckets_and_prompt_sharing(name):
    """16 sequences of 4 prompts x 4 (a GRPO group each), decoded (a) in one static batch, every prompt
    prefilled per sequence, (b) compacted down buckets 2 / 4 / 8 / 16 as sequences end, each group's
    prompt prefilled once, (c) 6 slots refilled as sequences end (continuous batching): the same tokens
    (a token's random numbers are keyed by its sequence and position, not its slot), log-probs equal
    within 1e-5 and equal to the HF + peft model's; the work each did, counted. The log-probs are not
    bit-identical: CPU fp32 GEMMs round a row differently at another number of rows (issue 45's
    batch-invariant path removes that)."""
    ac = _policy(name)
    prompts = [p for p in PROMPTS[:4] for _ in range(4)]
    runs = {}
    for label, kwargs in {"static": dict(buckets=(16,), share_prompts=False), "compacted": dict(buckets=(2, 4, 8, 16)),
                          "refilled": dict(slots=6, buckets=(2, 4, 6))}.items():
        engine = _engine(ac.policy, batch=16, new_tokens=24, temperature=0.9, **kwargs)
        torch.manual_seed(0)
        runs[label] = engine_generate(engine, ac.policy, TOKENIZER, prompts, [""] * 16), dict(engine.stats)
    static, compacted, refilled = (runs[k][0] for k in ("static", "compacted", "refilled"))
    lengths = static.batch.response_mask.sum(-1)
    assert lengths.min() < 8 and lengths.max() > 16, "sequences must end at different steps"
    for other in (compacted, refilled):
        assert torch.equal(other.batch.input_ids, static.batch.input_ids)
        _assert_close(other.sampler_logp, static.sampler_logp)
    _assert_close(static.sampler_logp, _scored(ac.policy, static, 0.9) * static.batch.response_mask)
    stats = {k: v[1] for k, v in runs.items()}
    assert stats["static"]["prefill_rows"] == 16 and stats["compacted"]["prefill_rows"] == 4
    assert stats["static"]["row_steps"] == 16 * stats["static"]["decode_steps"]
    assert stats["compacted"]["compactions"] >= 1 and stats["compacted"]["row_steps"] < stats["static"]["row_steps"]
    assert stats["refilled"]["prefills"] > 1 and stats["refilled"]["kv_slots"] == 6 * (9 + 24)
    assert stats["static"]["kv_slots"] == 16 * (9 + 24)


def _long_tailed(n: int, R: int, seed: int = 0) -> list[int]:
    """n lengths min(R, LogNormal(ln 0.2 R, 0.978)), at least 1: median 0.2 R, ~5% at R (the review's model)."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 0.978) * 0.2 * R
    return draws.round().clamp(1, R).long().tolist()


def test_work_follows_the_tokens_at_long_tailed_lengths():
    """N = 64 sequences, 8 prompts x G = 8, R = 256, lengths long-tailed (forced by per-sequence limits and
    an EOS the model never samples): rows computed <= 1.1 x the tokens sampled plus what rounding up to
    a bucket adds (a power-of-two bucket holds less than twice its live rows, or is the smallest, 8);
    one prefill row per group; KV slots allocated = slots x (P + R); KV slots attended = those each live
    row needs, plus at most T per row-step of a finished row the host has not dropped yet; the same
    tokens as one static batch of 64 and as 16 slots refilled."""
    N, G, R, P = 64, 8, 256, 10
    lm = AutoModelForCausalLM.from_config(LlamaConfig(**(SMALL | {"num_hidden_layers": 1})), attn_implementation="sdpa")
    ac = ActorCritic(lm, lora_rank=0, value_head=False)
    groups = [[4 + (i + j) % 9 for j in range(3 + i)] for i in range(N // G)]  # prompts of 3 to 10 tokens
    prompts = [p for p in groups for _ in range(G)]
    limits = _long_tailed(N, R)
    assert limits.count(R) >= 1 and sorted(limits)[N // 2] < R // 3

    def run(**kwargs):
        engine = DecodeEngine(ac.policy, batch=N, prompt_len=P, new_tokens=R, temperature=1.0, eos_id=VOCAB + 1,
                              pad_id=PAD, device=CPU, compile=False, **kwargs)
        torch.manual_seed(0)
        out = engine.generate(ac.policy, prompts, limits=limits)
        return out, dict(engine.stats), engine

    (_, _, tokens, logps, _), stats, engine = run()
    assert engine.buckets == buckets_for(N) == (8, 16, 32, 64)
    assert engine.ends.tolist() == limits and stats["tokens"] == sum(limits)
    assert all((logps[i, :n] != 0).all() and (logps[i, n:] == 0).all() for i, n in enumerate(limits))
    assert stats["occupied_row_steps"] <= 1.1 * sum(limits)
    assert stats["row_steps"] <= 2 * stats["occupied_row_steps"] + 8 * stats["decode_steps"]
    assert stats["prefill_rows"] == N // G and stats["prefills"] == 1
    assert stats["kv_slots"] == N * (P + R)
    live = sum(len(p) + c for p, n in zip(prompts, limits) for c in range(1, n))  # a step at column c attends P_i + c
    assert live <= stats["kv_read"] <= live + (stats["row_steps"] - (sum(limits) - N)) * (P + R)

    (_, _, tokens_static, _, _), static, _ = run(buckets=(N,), share_prompts=False)
    assert torch.equal(tokens_static, tokens)
    assert static["row_steps"] == N * static["decode_steps"] >= N * (R - 1) and static["prefill_rows"] == N
    assert stats["row_steps"] < 0.5 * static["row_steps"]
    (_, _, tokens_pool, _, _), pool, _ = run(slots=16)
    assert torch.equal(tokens_pool, tokens)
    assert pool["kv_slots"] == 16 * (P + R) and pool["occupied_row_steps"] <= 1.1 * sum(limits)


def test_state_and_weights_keep_their_addresses_across_rollouts():
    ac = _policy("qwen3")
    engine = _engine(ac.policy)
    engine_generate(engine, ac.policy, TOKENIZER, PROMPTS, [""] * len(PROMPTS))
    ptrs = [t.data_ptr() for t in _engine_tensors(engine)]
    engine_generate(engine, ac.policy, TOKENIZER, PROMPTS[:2], ["", ""])
    assert [t.data_ptr() for t in _engine_tensors(engine)] == ptrs


def test_release_frees_the_pool_and_weights_and_the_next_rollout_reforms_them():
    """keep_memory=False (the trainer's default): after each rollout the engine holds no KV pool, state or
    weight copy (what the update gets back); the next rollout allocates them again, with the same tokens
    as an engine that kept them, from the same step function (a compiled one is not compiled again)."""
    ac = _policy("qwen2-tied")
    kept, freed = _engine(ac.policy), _engine(ac.policy, keep_memory=False)
    outs = {}
    for name, engine in (("kept", kept), ("freed", freed)):
        torch.manual_seed(3)
        outs[name] = [engine.generate(ac.policy, PROMPTS)[2] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(outs["kept"], outs["freed"]))
    held = kept.memory_bytes()
    assert held["kv_cache"] > 0 and held["weights"] > 0
    assert freed.state is None and freed.weights is None and freed.graphs == {}
    assert freed.memory_bytes() == {"weights": 0, "weights_shared": 0, "kv_cache": 0, "state": 0}
    assert freed.stats["releases"] == 2 and kept.stats["releases"] == 0
    assert freed.stats["held_bytes"] == kept.stats["held_bytes"] == held["weights"] + held["kv_cache"] + held["state"]


def test_prefill_peak_memory_stays_within_the_weights_and_the_kv_it_stores():
    """P = 2048, G = 8, N = 64 rows: the prefill runs each of the 8 distinct prompts once through SDPA's causal
    kernel (no [P, P] score matrix per row: 64 rows x 4 heads x 2048^2 fp32 would be 4.3 GB) and copies
    their K/V into the 64 slots. Its peak resident memory above what the engine holds before it (the
    weights and the allocated KV pool, touched) stays within the weights plus the KV pool: the whole stays
    within 2x of what is stored. Measured as the process's peak RSS (metrics.CPUPeakRSS: VmHWM reset,
    freed heap handed back first), after a warm-up rollout. Four layers, not two: the stored KV grows with
    the layers and the transient (one layer's activations) does not, and real models have 24 or more; at
    two layers of this toy the ratio would measure its tiny K/V width (32 floats a token) more than the
    prefill."""
    from fastrlhf.train.metrics import CPUPeakRSS

    rss = CPUPeakRSS()
    if not rss.available:
        pytest.skip("peak RSS needs Linux with glibc and a writable /proc/self/clear_refs")
    N, G, P = 64, 8, 2048
    lm = AutoModelForCausalLM.from_config(LlamaConfig(**(SMALL | {"max_position_embeddings": P + 8,
                                                                  "num_hidden_layers": 4})),
                                          attn_implementation="sdpa")
    ac = ActorCritic(lm, lora_rank=0, value_head=False)
    engine = DecodeEngine(ac.policy, batch=N, prompt_len=P, new_tokens=2, temperature=1.0, eos_id=VOCAB + 1,
                          pad_id=PAD, device=CPU, compile=False)
    prompts = [[4 + (i * 7 + j) % 9 for j in range(P - i)] for i in range(N // G) for _ in range(G)]
    engine.generate(ac.policy, prompts[:G], limits=[1] * G)  # warm-up: allocates and touches the pool, loads code
    stored = engine.memory_bytes()
    stored = stored["weights"] + stored["weights_shared"] + stored["kv_cache"]
    rss.start()
    before = CPUPeakRSS.peak()
    engine.generate(ac.policy, prompts, limits=[1] * N)
    transient = CPUPeakRSS.peak() - before
    assert engine.stats["prefill_rows"] == N // G and engine.stats["prefill_tokens"] == N // G * P
    assert stored > 60 * 2 ** 20  # the KV pool of 64 x 2050 slots dominates
    assert transient <= stored, f"prefill peak {transient / 2 ** 20:.1f} MiB above the {stored / 2 ** 20:.1f} " \
                                f"MiB stored"


def test_frozen_embedding_is_read_in_place_and_memory_is_counted():
    ac = _policy("llama")
    engine = _engine(ac.policy)
    assert engine.memory_bytes()["weights"] == 0 and engine.memory_bytes()["kv_cache"] > 0  # before a rollout
    engine.refresh(ac.policy)
    base = ac.policy.get_base_model()
    assert engine.weights.embed is base.model.embed_tokens.weight and engine.weights.head is base.lm_head.weight
    m = engine.memory_bytes()
    assert m["weights_shared"] == 2 * VOCAB * 32 * 4
    planned = rollout_memory_bytes(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=48, vocab=VOCAB,
                                   tied=False, batch=len(PROMPTS), max_len=9 + 12, dtype_bytes=4, shares_head=True)
    assert planned["weights"] == m["weights"] and planned["kv_cache"] == m["kv_cache"]  # the planner's arithmetic
    unshared = _engine(ac.policy, share_frozen=False)
    unshared.refresh(ac.policy)
    assert unshared.memory_bytes()["weights"] == m["weights"] + m["weights_shared"]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_engine_choice_and_fallback():
    ac = _policy("llama")
    assert choose_engine("hf", ac.policy, CPU)[0] == "hf"
    assert choose_engine("graph", ac.policy, CPU)[0] == "graph"
    engine, why = choose_engine("auto", ac.policy, CPU)
    assert engine == "hf" and "CUDA graphs" in why
    assert choose_engine("auto", ac.policy, torch.device("cuda"))[0] == "graph"
    from transformers import GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    engine, why = choose_engine("graph", gpt2, CPU)
    assert engine == "hf" and "'gpt2'" in why
    dynamic = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}))
    assert "dynamic" in unsupported_reason(dynamic)
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(AutoModelForCausalLM.from_config(CONFIGS["llama"]()),
                          LoraConfig(r=2, target_modules="all-linear", use_dora=True))
    assert "DoRA" in unsupported_reason(dora)
    with pytest.raises(ValueError, match="rollout_engine must be one of"):
        choose_engine("vllm", ac.policy, CPU)


def test_bad_input_is_refused():
    ac = _policy("llama")
    engine = _engine(ac.policy, batch=2)
    with pytest.raises(ValueError, match="3 prompts for an engine of batch 2"):
        engine.generate(ac.policy, PROMPTS[:3])
    with pytest.raises(ValueError, match="longer than prompt_len"):
        _engine(ac.policy, prompt_len=3).generate(ac.policy, PROMPTS)
    with pytest.raises(ValueError, match="temperature"):
        _engine(ac.policy, temperature=0.0)
    with pytest.raises(ValueError, match="new_tokens"):
        _engine(ac.policy, new_tokens=0)


def test_sampler_gap_is_mean_and_max_over_response_tokens():
    a = torch.tensor([[0.0, -1.0, -2.0], [-0.5, 0.0, 0.0]])
    b = torch.tensor([[0.1, -1.5, -9.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    gap = sampler_gap(a, b, mask)
    assert gap["rollout/logp_gap_max"] == pytest.approx(0.5)
    assert gap["rollout/logp_gap_mean"] == pytest.approx(0.6 / 3)


@pytest.mark.gpu
def test_cuda_graph_replays_sample_the_hf_peft_distribution():
    """CUDA only (prepared here, not run on CPU): the step compiled and captured as one CUDA graph per bucket, in
    fp32, gives the HF + peft model's log-probs (1e-4: CUDA's reductions), fresh draws on every replay,
    the same buffers across rollouts; in bf16 the sampler stays close to the trainer's fp32 scoring."""
    cuda = torch.device("cuda")
    ac = _policy("qwen2-tied").to(cuda)
    engine = DecodeEngine(ac.policy, batch=ROWS, prompt_len=9, new_tokens=40, temperature=0.7, eos_id=EOS,
                          pad_id=PAD, device=cuda, dtype=torch.float32)
    rollout = engine_generate(engine, ac.policy, TOKENIZER, PROMPTS, [""] * ROWS)
    assert sorted(engine.graphs) == list(engine.buckets) and engine.stats["capture_s"] > 0  # one graph per bucket
    _assert_close(rollout.sampler_logp, _scored(ac.policy, rollout, 0.7) * rollout.batch.response_mask, atol=1e-4)
    ptrs = [t.data_ptr() for t in _engine_tensors(engine)]
    again = engine_generate(engine, ac.policy, TOKENIZER, PROMPTS, [""] * ROWS)
    assert [t.data_ptr() for t in _engine_tensors(engine)] == ptrs
    assert not torch.equal(again.batch.input_ids, rollout.batch.input_ids)  # a new seed, new draws
    bf16 = DecodeEngine(ac.policy, batch=ROWS, prompt_len=9, new_tokens=40, temperature=0.7, eos_id=EOS, pad_id=PAD,
                        device=cuda)
    rollout = engine_generate(bf16, ac.policy, TOKENIZER, PROMPTS, [""] * ROWS)
    gap = sampler_gap(rollout.sampler_logp, _scored(ac.policy, rollout, 0.7), rollout.batch.response_mask)
    assert gap["rollout/logp_gap_mean"] < 0.05, gap
