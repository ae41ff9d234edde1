"""ops.ppo_actor_loss (the whole actor loss from logits) against reference.ppo_actor_loss in
float64, forward (loss and stats) and backward (d(logits)), on both backends."""

import math

import pytest
import torch
from helpers import assert_close_to_ref, poison_outputs

from fastrlhf import ops
from fastrlhf import reference as ref

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-3), (torch.float16, 1e-3)]  # (dtype, atol)
STATS = ("clipfrac", "clipfrac_lower", "approx_kl", "pg_loss", "entropy", "kl")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Kernel and torch-path outputs start as NaN: a value the op forgets to write fails the test."""
    poison_outputs(monkeypatch, "fastrlhf.kernels.logprobs", "fastrlhf.ops.logprobs", "fastrlhf.ops.losses")


def _padded_mask(B, T):
    """Row 0 right-padded, row 1 left-padded, row 2 with gaps, row 3 all masked."""
    assert B >= 4
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, T - T // 3:] = False
    mask[1, : T // 4] = False
    mask[2, 3::4] = False
    mask[3] = False
    return mask


def _batch(B, T, V, dtype):
    logits = (torch.randn(B, T, V) * 2).to(dtype)
    labels = torch.randint(0, V, (B, T))
    logp64 = ref.logprobs(logits.double(), labels)
    old_logp = (logp64 + 0.3 * torch.randn(B, T, dtype=torch.float64)).float()  # ratios on both sides of the clip
    ref_logp = (logp64 + 0.5 * torch.randn(B, T, dtype=torch.float64)).float()
    advantages = torch.randn(B, T)
    return logits, labels, old_logp, ref_logp, advantages, _padded_mask(B, T)


def _loss_and_grad(fn, logits, labels, old_logp, advantages, mask, upstream, **kw):
    x = logits.detach().clone().requires_grad_()
    loss, stats = fn(x, labels, old_logp, advantages, mask, **kw)
    (dx,) = torch.autograd.grad(loss * upstream, x)
    return loss, stats, dx


def _compare(logits, labels, old_logp, ref_logp, advantages, mask, atol, **kw):
    upstream = torch.randn(()).item()  # a random upstream gradient, not 1
    args = (labels, old_logp, advantages, mask, upstream)
    kw = dict(kw, ref_logp=ref_logp)
    out = _loss_and_grad(ops.ppo_actor_loss, logits, *args, **kw)
    kw64 = dict(kw, ref_logp=ref_logp.double())
    if kw.get("is_weights") is not None:
        kw64["is_weights"] = kw["is_weights"].double()
    r64 = _loss_and_grad(ref.ppo_actor_loss, logits.double(), labels, old_logp.double(), advantages.double(), mask,
                         upstream, **kw64)
    same = _loss_and_grad(ref.ppo_actor_loss, logits, *args, **kw)
    assert out[0].dtype == torch.float32 and out[0].dim() == 0
    assert_close_to_ref(out[0], r64[0], same[0], atol=atol, name="loss")
    for k in STATS:
        assert out[1][k].dim() == 0 and not out[1][k].requires_grad, k
        assert_close_to_ref(out[1][k], r64[1][k], same[1][k], atol=atol, name=f"stats[{k}]")
    assert out[2].dtype == logits.dtype
    assert_close_to_ref(out[2], r64[2], same[2], atol=atol, name="d_logits")
    return out


# every agg mode in fp32; the half dtypes (whose error lies in the log-prob part, not the host-side
# aggregation weights) with two modes each
CASES = [(torch.float32, 1e-5, agg) for agg in ref.AGG_MODES] + [
    (torch.bfloat16, 1e-3, "token-mean"), (torch.bfloat16, 1e-3, "seq-mean-token-mean"),
    (torch.float16, 1e-3, "seq-mean-token-sum"), (torch.float16, 1e-3, "token-sum")]


@pytest.mark.parametrize("dtype,atol,agg", CASES)
def test_actor_loss_matches_reference(backend, dtype, atol, agg):
    B, T, V = 4, 37, 1271
    batch = _batch(B, T, V, dtype)
    _compare(*batch, atol, agg=agg, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, temperature=0.9,
             clip_low=0.2, clip_high=0.28, dual_clip=3.0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "abs"])
def test_actor_loss_kl_estimators_and_no_entropy_term(backend, estimator):
    batch = _batch(4, 13, 257, torch.float32)
    _compare(*batch, 1e-5, kl_coef=0.2, kl_estimator=estimator, entropy_coef=0.0)


def test_actor_loss_non_contiguous_logits(backend):
    """logits[:, :-1] of a causal LM's [B, T+1, V] output."""
    B, T, V = 4, 21, 509
    logits, labels, old_logp, ref_logp, advantages, mask = _batch(B, T + 1, V, torch.bfloat16)
    view = logits[:, :-1]
    assert not view.is_contiguous()
    _compare(view, labels[:, :-1], old_logp[:, :-1], ref_logp[:, :-1], advantages[:, :-1], mask[:, :-1], 1e-3,
             entropy_coef=0.02, kl_coef=0.05)


@pytest.mark.parametrize("config", range(5), ids=lambda i: f"config{i}")
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 1e-3), (torch.float32, 1e-5)])
def test_actor_loss_cuda_configs(triton_backend, monkeypatch, config, dtype, atol):
    """The fused kernel with each tile x warps x grid its CUDA autotuner may pick (the interpreter
    takes one small config otherwise), a persistent grid included (a few programs walking all rows),
    over a vocab of two full tiles and a partial one, whose second pass walks the tiles from the
    row's end; -inf logits (p = 0, no NaN from 0 * log 0) and every gradient term."""
    from fastrlhf.kernels import ppo_loss as pk

    chosen = pk.ACTOR_CONFIGS[config]
    assert len(pk.ACTOR_CONFIGS) == 5
    monkeypatch.setattr(pk, "actor_config", lambda V, device: chosen.kwargs | {"num_warps": chosen.num_warps})
    B, T, V = 4, 3, 2 * chosen.kwargs["BLOCK_V"] + 100
    logits, labels, old_logp, ref_logp, advantages, mask = _batch(B, T, V, dtype)
    logits[0, 0, 1000:5000] = float("-inf")
    labels[0, 0] = 7
    logp64 = ref.logprobs(logits.double(), labels)
    old_logp, ref_logp = (logp64 + 0.3 * torch.randn(B, T)).float(), (logp64 + 0.5 * torch.randn(B, T)).float()
    out = _compare(logits, labels, old_logp, ref_logp, advantages, mask, atol, kl_coef=0.1, kl_estimator="k3",
                   entropy_coef=0.01, temperature=0.9, clip_high=0.28, dual_clip=3.0, is_weights=torch.rand(B, T))
    assert torch.isfinite(out[2]).all()


def test_actor_loss_hand_worked():
    """p = softmax([log 3, 0]) = [0.75, 0.25], label 0, old p = 0.5: ratio 1.5 clipped to 1.2 with A = 1,
    so the policy term is -1.2 and has no gradient; entropy H = -(0.75 ln 0.75 + 0.25 ln 0.25)."""
    logits = torch.tensor([[[math.log(3.0), 0.0]]], requires_grad=True)
    labels = torch.tensor([[0]])
    old_logp = torch.tensor([[math.log(0.5)]])
    adv, mask = torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool)
    loss, stats = ops.ppo_actor_loss(logits, labels, old_logp, adv, mask, entropy_coef=0.1)
    H = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert loss.item() == pytest.approx(-1.2 - 0.1 * H, abs=1e-6)
    assert stats["clipfrac"].item() == 1.0 and stats["clipfrac_lower"].item() == 0.0
    assert stats["approx_kl"].item() == pytest.approx(-math.log(1.5), abs=1e-6)
    assert stats["entropy"].item() == pytest.approx(H, abs=1e-6)
    loss.backward()
    # only -0.1 * H: dH/dz_j = -p_j (log p_j + H)
    p = torch.tensor([0.75, 0.25])
    expected = 0.1 * p * (p.log() + H)
    torch.testing.assert_close(logits.grad.view(-1), expected, atol=1e-6, rtol=0)


def test_one_kernel_forms_d_logits_in_the_forward(triton_backend, monkeypatch):
    """Triton path: the forward is one kernel, which reads the logits, forms the policy, KL and entropy
    gradients of each token and writes d(logits); no log-prob kernel runs, forward or backward. The
    backward hands that very buffer over (upstream 1: untouched; otherwise scaled in place)."""
    from fastrlhf.kernels import logprobs as lk
    from fastrlhf.kernels import ppo_loss as pk

    calls, formed = [], []

    def spy(name, real):
        def run(*args, **kw):
            calls.append(name)
            out = real(*args, **kw)
            if name == "actor_loss_fwd":
                formed.append(out[2].detach().clone())
                formed.append(out[2].data_ptr())
            return out

        return run

    for module, name in ((pk, "actor_loss_fwd"), (lk, "logprobs_fwd"), (lk, "logprobs_bwd")):
        monkeypatch.setattr(module, name, spy(name, getattr(module, name)))
    logits, labels, old_logp, ref_logp, advantages, mask = _batch(4, 9, 129, torch.float32)
    for upstream in (1.0, 2.5):
        calls.clear(), formed.clear()
        x = logits.clone().requires_grad_()
        loss, _ = ops.ppo_actor_loss(x, labels, old_logp, advantages, mask, ref_logp=ref_logp, kl_coef=0.1,
                                     entropy_coef=0.01)
        assert calls == ["actor_loss_fwd"]
        (loss * upstream).backward()
        assert calls == ["actor_loss_fwd"], "the backward runs no log-prob kernel"
        assert x.grad.data_ptr() == formed[1], "d(logits) is the buffer the forward wrote, not a copy"
        torch.testing.assert_close(x.grad, formed[0] * upstream, rtol=0, atol=0)


def test_one_backward_only(backend):
    """d(logits) is formed in the forward and handed over once: a second backward through the same
    graph raises a clear error instead of returning a gradient scaled twice."""
    logits, labels, old_logp, ref_logp, advantages, mask = _batch(4, 5, 33, torch.float32)
    x = logits.requires_grad_()
    loss, _ = ops.ppo_actor_loss(x, labels, old_logp, advantages, mask, entropy_coef=0.01)
    (loss * 3.0).backward(retain_graph=True)
    first = x.grad.clone()
    with pytest.raises(RuntimeError, match="backward through one loss twice is not supported"):
        loss.backward()
    torch.testing.assert_close(x.grad, first, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [1.0, -0.37])
def test_scale_unless_one(backend, dtype, g):
    """The backward's in-place scale (the Triton kernel: a grid-stride loop, several blocks per program
    here) is the float32 product x * g rounded once to x's dtype, and leaves x bit-for-bit unchanged
    for g == 1. (bf16: round to nearest even, as torch and the compiled kernel round; the interpreter
    truncates its float32 -> bf16 casts, so there either of the two neighbours is the one rounding.)"""
    from fastrlhf.ops.losses import _scale_unless_one_op

    x = torch.randn(3 * 4 * 4096 + 17).to(dtype)
    x[5] = float("nan")
    product = x.float() * torch.tensor(g)
    nearest = product.to(dtype)
    truncated = (product.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact in bf16
    _scale_unless_one_op(x, torch.tensor(g), backend == "triton")
    rounded_once = (x == nearest) | (torch.isnan(x) & torch.isnan(nearest))
    if dtype == torch.bfloat16 and backend == "triton":
        rounded_once |= x == truncated
    assert rounded_once.all(), f"{int((~rounded_once).sum())} elements are not x * g rounded once"
    if g == 1.0:
        assert torch.equal(x[~torch.isnan(x)], nearest[~torch.isnan(nearest)])


def test_all_masked_batch_is_finite(backend):
    B, T, V = 3, 8, 97
    logits = torch.randn(B, T, V, requires_grad=True)
    labels = torch.randint(0, V, (B, T))
    mask = torch.zeros(B, T)
    for agg in ref.AGG_MODES:
        loss, stats = ops.ppo_actor_loss(logits, labels, torch.randn(B, T), torch.randn(B, T), mask,
                                         ref_logp=torch.randn(B, T), kl_coef=0.1, entropy_coef=0.01, agg=agg)
        (dx,) = torch.autograd.grad(loss, logits)
        assert loss.item() == 0.0, agg
        assert all(torch.isfinite(v) for v in stats.values()), (agg, stats)
        assert torch.equal(dx, torch.zeros_like(dx)), agg


def test_global_num_tokens_makes_split_batches_add_up(backend):
    """token-mean with the global count: the halves' losses and gradients sum to the whole's."""
    logits, labels, old_logp, ref_logp, advantages, mask = _batch(4, 11, 83, torch.float32)
    n = int(mask.sum())
    kw = dict(ref_logp=ref_logp, kl_coef=0.1, entropy_coef=0.01)
    x = logits.clone().requires_grad_()
    whole, _ = ops.ppo_actor_loss(x, labels, old_logp, advantages, mask, **kw)
    (d_whole,) = torch.autograd.grad(whole, x)
    parts, d_parts = [], []
    for rows in (slice(0, 2), slice(2, 4)):
        xp = logits[rows].clone().requires_grad_()
        part, _ = ops.ppo_actor_loss(xp, labels[rows], old_logp[rows], advantages[rows], mask[rows],
                                     global_num_tokens=n, **dict(kw, ref_logp=ref_logp[rows]))
        parts.append(part)
        d_parts.append(torch.autograd.grad(part, xp)[0])
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.cat(d_parts), d_whole, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-3)])
@pytest.mark.parametrize("agg,agg_kw", [("token-sum", dict(dp_size=2)),
                                        ("seq-mean-token-sum-norm", dict(global_num_seqs=9, loss_scale_factor=64))])
def test_actor_loss_is_weights_straight_through_kl_and_global_counts(backend, dtype, atol, agg, agg_kw):
    """is_weights on the policy term, verl's clamped low_var_kl with a straight-through gradient,
    token-sum / seq-mean-token-sum-norm with their global keywords."""
    B, T, V = 4, 13, 257
    logits, labels, old_logp, ref_logp, advantages, mask = _batch(B, T, V, dtype)
    _compare(logits, labels, old_logp, ref_logp, advantages, mask, atol, kl_coef=0.2, kl_estimator="low_var_kl",
             kl_clamp=10.0, kl_straight_through=True, entropy_coef=0.01, is_weights=torch.rand(B, T) * 2,
             dual_clip=3.0, agg=agg, **agg_kw)


@pytest.mark.parametrize("V", [5, 301, 1003])
def test_actor_loss_odd_vocab_at_odd_offsets(backend, V):
    """Rows at odd element offsets (a view whose data pointer is off a 16-byte boundary, rows V + 3
    apart) and V below one 16-byte group: the aligned middle and the ragged ends cover each row once,
    labels at the first and last column."""
    B, T = 4, 5
    logits, labels, old_logp, ref_logp, advantages, mask = _batch(B, T, V, torch.bfloat16)
    labels[0, :2] = torch.tensor([0, V - 1])
    flat = torch.zeros(1 + B * T * (V + 3), dtype=torch.bfloat16)
    strided = flat[1:].as_strided((B, T, V), (T * (V + 3), V + 3, 1))
    strided.copy_(logits)
    shifted = torch.cat([torch.zeros(1, T, V, dtype=torch.bfloat16), logits])[1:]  # storage offset T V
    for view in (strided, shifted):
        _compare(view, labels, old_logp, ref_logp, advantages, mask, 1e-3, entropy_coef=0.02, kl_coef=0.05)


def test_actor_grid_fractional_programs_per_sm():
    """0 = one program per row; k per SM, a fraction included, at least 1 and at most N programs
    (the interpreter counts 2 SMs)."""
    from fastrlhf.kernels import ppo_loss as pk

    cpu = torch.device("cpu")
    assert pk._actor_grid(37, 0, cpu) == (37,)
    assert pk._actor_grid(37, 2, cpu) == (4,)
    assert pk._actor_grid(37, 0.5, cpu) == (1,)
    assert pk._actor_grid(37, 0.25, cpu) == (1,)
    assert pk._actor_grid(3, 4, cpu) == (3,)
