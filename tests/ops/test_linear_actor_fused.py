"""ops.linear_ppo_actor_loss (the actor loss from hidden states, gradients formed in the forward)
against reference.ppo_actor_loss on materialised logits in float64: loss, stats and gradients
for hidden, weight, bias and a tied embedding, on both backends; and the matmuls it runs."""

import pytest
import torch
from helpers import assert_close_to_ref, poison_outputs

from fastrlhf import ops
from fastrlhf import reference as ref
from fastrlhf.ops import linear

STATS = ("clipfrac", "clipfrac_lower", "approx_kl", "pg_loss", "entropy", "kl")
FULL = dict(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.02, temperature=0.9, clip_high=0.28, dual_clip=3.0)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Kernel and torch-path outputs start as NaN: a value the op forgets to write fails the test."""
    poison_outputs(monkeypatch, "fastrlhf.kernels.logprobs", "fastrlhf.ops.logprobs", "fastrlhf.ops.linear")


def _padded_mask(B, T):
    """Row 0 right-padded, row 1 left-padded, row 2 with gaps, row 3 all masked."""
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, T - T // 3:] = False
    mask[1, : T // 4] = False
    mask[2, ::3] = False
    mask[3] = False
    return mask


def _batch(B, T, H, V, dtype, bias=True):
    """hidden, weight, bias, labels and a draw of (old_logp, ref_logp, advantages) whose ratios
    fall on both sides of the clip range."""
    hidden = torch.randn(B, T, H).to(dtype)
    weight = (torch.randn(V, H) * 2 / H**0.5).to(dtype)  # logits of std ~2
    b = torch.randn(V).to(dtype) if bias else None
    labels = torch.randint(0, V, (B, T))
    return hidden, weight, b, labels


def _draw(hidden, weight, bias, labels):
    logp64 = ref.linear_logprobs(hidden.double(), weight.double(), labels,
                                 bias=None if bias is None else bias.double())
    old = (logp64 + 0.3 * torch.randn(logp64.shape, dtype=torch.float64)).float()
    ref_lp = (logp64 + 0.5 * torch.randn(logp64.shape, dtype=torch.float64)).float()
    return old, ref_lp, torch.randn(labels.shape)


def _run(fn, leaves_in, labels, old, adv, mask, upstream, **kw):
    """[loss, *stats, *grads of loss * upstream] for fresh leaves made from `leaves_in`."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves_in if t is not None]
    bias = leaves[2] if len(leaves) == 3 else None
    loss, stats = fn(leaves[0], leaves[1], bias, labels, old, adv, mask, **kw)
    grads = torch.autograd.grad(loss * upstream, leaves)
    return [loss.detach(), *(stats[k] for k in STATS if k in stats), *grads], loss, stats, grads


def _fused(h, w, b, labels, old, adv, mask, **kw):
    return ops.linear_ppo_actor_loss(h, w, labels, old, adv, mask, bias=b, **kw)


def _materialised(h, w, b, labels, old, adv, mask, **kw):
    kw.pop("chunk_size", None)
    logits = h @ w.T if b is None else h @ w.T + b
    return ref.ppo_actor_loss(logits, labels, old, adv, mask, **kw)


def _compare(make_batch, mask, atol, draws, **kw):
    """Fused vs float64 and same-dtype references over `draws` independent batches (hidden,
    weight, bias, labels from `make_batch()`, then old_logp, ref_logp, advantages, upstream),
    stacked: a bf16 scalar's error is one random draw, so several are checked at once."""
    use_ref = kw.pop("ref", True)
    is_weights = kw.pop("is_weights", None)
    out, r64, same = [], [], []
    for _ in range(draws):
        hidden, weight, bias, labels = make_batch()
        old, ref_lp, adv = _draw(hidden, weight, bias, labels)
        upstream = torch.randn(()).item()  # a random upstream gradient, never 1
        ref_kw = dict(kw, ref_logp=ref_lp if use_ref else None, is_weights=is_weights)
        o, loss, stats, grads = _run(_fused, (hidden, weight, bias), labels, old, adv, mask, upstream, **ref_kw)
        assert loss.dtype == torch.float32 and loss.dim() == 0
        assert all(s.dtype == torch.float32 and s.dim() == 0 and not s.requires_grad for s in stats.values())
        assert set(stats) == set(STATS if use_ref else STATS[:-1])
        assert [g.dtype for g in grads] == [hidden.dtype] * len(grads)
        out.append(o)
        ref64_kw = dict(kw, ref_logp=ref_lp.double() if use_ref else None,
                        is_weights=None if is_weights is None else is_weights.double())
        leaves64 = (hidden.double(), weight.double(), None if bias is None else bias.double())
        r64.append(_run(_materialised, leaves64, labels, old.double(), adv.double(), mask, upstream, **ref64_kw)[0])
        same.append(_run(_materialised, (hidden, weight, bias), labels, old, adv, mask, upstream, **ref_kw)[0])
    names = ["loss", *(f"stats[{k}]" for k in (STATS if use_ref else STATS[:-1])),
             "d_hidden", "d_weight", *(["d_bias"] if bias is not None else [])]
    assert len(names) == len(out[0])
    for i, name in enumerate(names):
        o, r, s = (torch.stack([run_[i].double() for run_ in runs]) for runs in (out, r64, same))
        assert_close_to_ref(o, r, s, atol=atol, name=name)


@pytest.mark.parametrize("dtype,atol,draws", [(torch.float32, 1e-5, 1), (torch.bfloat16, 1e-3, 3)])
@pytest.mark.parametrize("agg", ref.AGG_MODES)
def test_fused_actor_loss_matches_reference(backend, dtype, atol, draws, agg):
    """Every term (dual clip, asymmetric clip, k3 KL, entropy, temperature), bias, padded and
    all-masked rows, chunks that do not divide N = 36."""
    _compare(lambda: _batch(4, 9, 20, 389, dtype), _padded_mask(4, 9), atol, draws, agg=agg, chunk_size=16,
             **FULL)


@pytest.mark.parametrize("estimator", ["k1", "k2", "abs"])
def test_kl_estimators_without_entropy_term_or_bias(backend, estimator):
    """entropy_coef = 0: no entropy gradient reaches the kernel (dL/dH is None)."""
    _compare(lambda: _batch(4, 8, 16, 257, torch.float32, bias=False), _padded_mask(4, 8), 1e-5, 1, chunk_size=5,
             kl_coef=0.2,
             kl_estimator=estimator, entropy_coef=0.0)


def test_no_reference_policy_and_global_num_tokens(backend):
    """No ref_logp (no kl stat), token-mean over a global count larger than the local one."""
    mask = _padded_mask(4, 8)
    _compare(lambda: _batch(4, 8, 16, 257, torch.float32), mask, 1e-5, 1, chunk_size=6, ref=False, entropy_coef=0.05,
             global_num_tokens=int(mask.sum()) * 3)


def test_is_weights_straight_through_kl_and_global_counts(backend):
    """is_weights on the policy term, a clamped straight-through KL, seq-mean-token-sum with its global count."""
    mask = _padded_mask(4, 8)
    _compare(lambda: _batch(4, 8, 16, 257, torch.float32), mask, 1e-5, 1, chunk_size=6, kl_coef=0.2,
             kl_estimator="k3", kl_clamp=10.0, kl_straight_through=True, entropy_coef=0.02,
             is_weights=torch.rand(4, 8) * 2, agg="seq-mean-token-sum", global_num_seqs=7, dp_size=2)


def test_flat_tokens_and_float_mask():
    """hidden [N, H] with [N]-shaped per-token tensors (one sequence) and a 0/1 float mask."""
    def flat_batch():
        hidden, weight, bias, labels = _batch(1, 30, 12, 101, torch.float32)
        return hidden[0], weight, bias, labels[0]

    mask = (torch.rand(30) > 0.3).float()
    _compare(flat_batch, mask, 1e-5, 1, chunk_size=7, agg="seq-mean-token-mean", **FULL)


def test_all_tokens_masked(backend):
    """Nothing counts: loss 0, every gradient 0, stats 0, no NaN."""
    hidden, weight, bias, labels = _batch(2, 5, 8, 64, torch.float32)
    old, ref_lp, adv = _draw(hidden, weight, bias, labels)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    for agg in ref.AGG_MODES:
        _, loss, stats, grads = _run(_fused, (hidden, weight, bias), labels, old, adv, mask, 1.0, agg=agg,
                                     ref_logp=ref_lp, chunk_size=4, **FULL)
        assert loss.item() == 0.0 and all(s.item() == 0.0 for s in stats.values()), agg
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads), agg


def test_tied_weights(backend):
    """lm_head tied to the embedding: both uses' gradients land in the one Parameter."""
    V, H, B, T = 211, 16, 4, 9
    emb = torch.nn.Embedding(V, H)
    ids, labels = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    hidden = torch.tanh(torch.nn.functional.embedding(ids, emb.weight.double()))
    old, ref_lp, adv = _draw(hidden.detach(), emb.weight.double().detach(), None, labels)
    mask = _padded_mask(B, T)
    upstream = 0.37

    def grad_of(fn, weight):
        h = torch.tanh(torch.nn.functional.embedding(ids, weight))
        loss, _ = fn(h, weight, None, labels, old.to(weight.dtype), adv.to(weight.dtype), mask,
                     ref_logp=ref_lp.to(weight.dtype), **FULL)
        return torch.autograd.grad(loss * upstream, weight)[0]

    d = grad_of(lambda *a, **kw: _fused(*a, chunk_size=5, **kw), emb.weight)
    d64 = grad_of(_materialised, emb.weight.detach().double().requires_grad_())
    d32 = grad_of(_materialised, emb.weight)
    assert_close_to_ref(d, d64, d32, atol=1e-5, name="d_embedding")
    # and through .backward() into the Parameter's .grad
    h = torch.tanh(emb(ids))
    loss, _ = ops.linear_ppo_actor_loss(h, emb.weight, labels, old, adv, mask, ref_logp=ref_lp, chunk_size=5,
                                        **FULL)
    (loss * upstream).backward()
    torch.testing.assert_close(emb.weight.grad, d, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- the matmuls


MATMULS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::baddbmm_", "aten::addmv",
           "aten::mv"}


def _count(fn):
    """The matrix multiplies (any mm/addmm/bmm overload, in place or out=) that run in fn(), inside
    the custom ops too: the profiler records every aten call the dispatcher makes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.name in MATMULS for event in prof.events())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_matmuls_per_chunk(monkeypatch, dtype):
    """fwd + bwd: 3 matmuls per chunk (linear_logprobs, which recomputes the logits: 4), all in
    the forward; the backward only scales. Fewer when fewer gradients are asked for. (The matmuls
    are the same code on both backends, which differ in the log-prob part only: torch path here.)"""
    monkeypatch.setenv("FASTRLHF_BACKEND", "torch")
    hidden, weight, bias, labels = _batch(4, 10, 8, 64, dtype)
    old, ref_lp, adv = _draw(hidden, weight, bias, labels)
    mask = _padded_mask(4, 10)
    chunks = 6  # 40 tokens in chunks of 7
    kw = dict(ref_logp=ref_lp, chunk_size=7, **FULL)

    def leaves(*trainable):
        return [t.detach().clone().requires_grad_(train) for t, train in zip((hidden, weight, bias), trainable)]

    h, w, b = leaves(True, True, True)
    box = {}
    assert _count(lambda: box.update(loss=ops.linear_ppo_actor_loss(h, w, labels, old, adv, mask, bias=b,
                                                                     **kw)[0])) == 3 * chunks
    assert _count(lambda: box["loss"].backward()) == 0
    assert h.grad is not None and w.grad is not None and b.grad is not None

    h, w, b = leaves(True, True, True)
    assert _count(lambda: torch.nan_to_num(ops.linear_logprobs(h, w, labels, bias=b, chunk_size=7))
                  .sum().backward()) == 4 * chunks
    # one chunk for all tokens: linear_logprobs keeps its logits for the backward, 3 matmuls
    h, w, b = leaves(True, True, True)
    assert _count(lambda: torch.nan_to_num(ops.linear_logprobs(h, w, labels, bias=b, chunk_size=40))
                  .sum().backward()) == 3

    for trainable, per_chunk in (((True, False, False), 2), ((False, True, True), 2), ((False, False, True), 1)):
        h, w, b = leaves(*trainable)
        assert _count(lambda h=h, w=w, b=b: ops.linear_ppo_actor_loss(h, w, labels, old, adv, mask, bias=b, **kw)) \
            == per_chunk * chunks, trainable
    h, w, b = leaves(True, True, True)
    with torch.no_grad():
        assert _count(lambda: box.update(nograd=ops.linear_ppo_actor_loss(h, w, labels, old, adv, mask, bias=b,
                                                                           **kw))) == chunks
    loss, stats = box["nograd"]
    assert not loss.requires_grad
    grad_loss, grad_stats = ops.linear_ppo_actor_loss(h, w, labels, old, adv, mask, bias=b, **kw)
    assert torch.equal(loss, grad_loss.detach())  # the same numbers with or without gradients
    assert all(torch.equal(stats[k], grad_stats[k]) for k in stats)


def test_gradients_only_for_what_requires_grad(backend):
    """hidden trainable, lm_head frozen (e.g. LoRA on the trunk): d(hidden) as with everything trainable."""
    hidden, weight, bias, labels = _batch(3, 7, 10, 97, torch.float32)
    old, ref_lp, adv = _draw(hidden, weight, bias, labels)
    mask = torch.ones(3, 7, dtype=torch.bool)
    kw = dict(bias=bias, ref_logp=ref_lp, chunk_size=4, **FULL)
    h = hidden.clone().requires_grad_()
    (d_only,) = torch.autograd.grad(ops.linear_ppo_actor_loss(h, weight, labels, old, adv, mask, **kw)[0], h)
    w = weight.clone().requires_grad_()
    d_h, _ = torch.autograd.grad(ops.linear_ppo_actor_loss(h, w, labels, old, adv, mask, **kw)[0], (h, w))
    torch.testing.assert_close(d_only, d_h, atol=0, rtol=0)


def test_second_backward_raises():
    hidden, weight, _, labels = _batch(2, 5, 8, 64, torch.float32, bias=False)
    old, _, adv = _draw(hidden, weight, None, labels)
    h = hidden.requires_grad_()
    loss, _ = ops.linear_ppo_actor_loss(h, weight, labels, old, adv, torch.ones(2, 5))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through one loss twice"):
        loss.backward()


def test_weight_gradient_accumulator_on_cpu():
    """No fp32-output addmm kernel on CPU: the product is formed in bf16, then added in fp32."""
    assert not linear.addmm_writes_fp32(torch.device("cpu"), torch.bfloat16)
    acc = torch.randn(5, 3)
    a, b = torch.randn(5, 4).bfloat16(), torch.randn(4, 3).bfloat16()
    expected = acc + (a @ b).float()
    linear.accumulate_product(acc, a, b)
    torch.testing.assert_close(acc, expected, atol=0, rtol=0)


@pytest.mark.gpu
def test_weight_gradient_accumulates_in_fp32_on_gpu():
    """On CUDA (torch >= 2.8) the bf16 product is added into the fp32 accumulator as cuBLAS writes
    it: no bf16 rounding of the product, as an fp32 matmul of the (exactly upcast) operands."""
    device = torch.device("cuda")
    assert linear.addmm_writes_fp32(device, torch.bfloat16), "aten::addmm.dtype_out unavailable"
    acc = torch.randn(300, 64, device=device)
    a, b = torch.randn(300, 97, device=device).bfloat16(), torch.randn(97, 64, device=device).bfloat16()
    expected = acc + a.float() @ b.float()
    linear.accumulate_product(acc, a, b)
    torch.testing.assert_close(acc, expected, atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------- bad input


def test_bad_actor_inputs():
    h, w, y = torch.randn(2, 4, 8), torch.randn(10, 8), torch.zeros(2, 4, dtype=torch.long)
    old, adv, mask = torch.randn(2, 4), torch.randn(2, 4), torch.ones(2, 4)
    cases = [
        (ValueError, "old_logp must have shape", dict(old_logp=torch.randn(2, 5))),
        (ValueError, "advantages must have shape", dict(advantages=torch.randn(8))),
        (ValueError, "ref_logp must have shape", dict(ref_logp=torch.randn(2, 3))),
        (ValueError, "mask must have the shape", dict(mask=torch.ones(2, 5))),
        (TypeError, "advantages must be a floating-point", dict(advantages=torch.ones(2, 4, dtype=torch.long))),
        (ValueError, "agg must be one of", dict(agg="mean")),
        (ValueError, "kl_estimator must be one of", dict(kl_estimator="k9")),
        (ValueError, "dual_clip must be > 1", dict(dual_clip=0.5)),
        (ValueError, "global_num_tokens applies to agg='token-mean' only",
         dict(agg="seq-mean-token-sum", global_num_tokens=10)),
        (ValueError, "weight must be", dict(weight=torch.randn(10, 9))),
    ]
    for error, message, change in cases:
        args = dict(hidden=h, weight=w, labels=y, old_logp=old, advantages=adv, mask=mask) | change
        with pytest.raises(error, match=message):
            ops.linear_ppo_actor_loss(**args)


# ---------------------------------------------------------------- d(weight) accumulation dtype


def test_accum_dtype_fp32_is_the_default():
    N, H, V = 40, 24, 301
    hidden = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (N,))
    grads = []
    for accum in (None, torch.float32):
        logp = ops.linear_logprobs(hidden, weight, labels, chunk_size=8, accum_dtype=accum)
        grads.append(torch.autograd.grad((logp * torch.linspace(-1, 1, N)).sum(), weight)[0])
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("op", ["linear_logprobs", "linear_ppo_actor_loss"])
def test_accum_in_weight_dtype(backend, op):
    """accum_dtype=bf16 adds each chunk's product straight into the bf16 gradient: at most one
    bf16 rounding (eps/2 relative) per chunk against the fp32 accumulation."""
    N, H, V, chunk = 64, 32, 257, 16
    hidden = torch.randn(N, H).bfloat16().requires_grad_()
    weight = (torch.randn(V, H) * 0.2).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (N,))
    g, old, adv = torch.randn(N), torch.randn(N) - 5, torch.randn(N)
    out = {}
    for accum in (None, torch.bfloat16):
        if op == "linear_logprobs":
            loss = (ops.linear_logprobs(hidden, weight, labels, chunk_size=chunk, accum_dtype=accum) * g).sum()
        else:
            loss, _ = ops.linear_ppo_actor_loss(hidden, weight, labels, old, adv, torch.ones(N), chunk_size=chunk,
                                                entropy_coef=0.01, accum_dtype=accum)
        out[accum] = torch.autograd.grad(loss, weight)[0]
    assert out[torch.bfloat16].dtype == torch.bfloat16
    ref_, got = out[None].double(), out[torch.bfloat16].double()
    bound = (N // chunk) * torch.finfo(torch.bfloat16).eps / 2
    assert (got - ref_).norm() <= bound * ref_.norm(), f"{(got - ref_).norm() / ref_.norm():.2e} > {bound:.2e}"


def test_accum_dtype_must_be_a_float_dtype():
    with pytest.raises(TypeError, match="accum_dtype"):
        ops.linear_logprobs(torch.randn(4, 8), torch.randn(16, 8), torch.zeros(4, dtype=torch.long),
                            accum_dtype=torch.int32).sum()


@pytest.mark.parametrize("op", ["linear_logprobs", "linear_ppo_actor_loss"])
def test_one_chunk_of_logits_alive_at_a_time(backend, monkeypatch, op):
    """The extra memory is one chunk's logits: when a chunk's logits are made, no earlier chunk's
    logits (or the d(logits) written over them) are still referenced, in the forward or the backward.
    (On an H100 a name still bound to the previous chunk cost one chunk more: 0.58 GiB at N = 16384.)"""
    import weakref

    made = []
    chunk_logits = linear.chunk_logits

    def tracked(h, w, b):
        alive = sum(r() is not None for r in made)
        assert alive == 0, f"chunk {len(made)}: {alive} earlier chunk(s) of logits still alive"
        made.append(weakref.ref(out := chunk_logits(h, w, b)))
        return out

    monkeypatch.setattr(linear, "chunk_logits", tracked)
    N, H, V, chunk = 40, 8, 64, 7
    hidden = torch.randn(N, H).requires_grad_()
    weight = torch.randn(V, H).requires_grad_()
    labels = torch.randint(0, V, (N,))
    if op == "linear_logprobs":
        loss = ops.linear_logprobs(hidden, weight, labels, chunk_size=chunk).sum()
    else:
        loss, _ = ops.linear_ppo_actor_loss(hidden, weight, labels, torch.randn(N), torch.randn(N), torch.ones(N),
                                            chunk_size=chunk, entropy_coef=0.01)
    loss.backward()
    assert len(made) == (6 if op == "linear_ppo_actor_loss" else 12)  # 6 chunks; linear_logprobs recomputes them
