"""The policy-loss family on the ops (policy_loss, ppo_actor_loss, linear_ppo_actor_loss with loss_mode=)
against reference.POLICY_LOSSES on both backends: every mode and option, in float64 (the torch path, to
float64 precision) and in each dtype by DESIGN.md's rule (error <= 2 x the same-dtype reference's + atol);
loss, every stat, and the gradients w.r.t. the log-probs, the logits and the hidden states. Edge cases:
left / right padding, a fully masked row, gaps, ratios in every clip band and past the log-ratio clamps,
IS weights on and off, two aggregations each, global counts with dp_size > 1."""

import math

import pytest
import torch
from helpers import SELECTION, assert_close_to_ref, make_mask, poison_outputs

from fastrlhf import ops
from fastrlhf import reference as R
from fastrlhf.ops import policy_modes as pm

F64 = torch.float64
B, T = 7, 37
CASES = [  # (mode, options)
    ("vanilla", {}),
    ("vanilla", dict(clip_high=0.28, dual_clip=3.0)),
    ("ppo", dict(delta=1.5, log_ratio_clamp=None)),
    ("vanilla", dict(ratio_level="sequence", dual_clip=2.0, log_ratio_clamp=None)),
    ("gspo", {}),
    ("gspo", dict(clip_high=0.28, delta=1.4, dual_clip=2.5)),
    ("gspo_token", {}),
    ("luspo", {}),
    ("cispo", dict(clip_high=0.28)),
    ("cispo", dict(ratio_max=2.0, ratio_level="sequence", log_ratio_clamp=None)),
    ("sapo", {}),
    ("sapo", dict(tau_pos=1.2, tau_neg=0.9, ratio_level="sequence", log_ratio_clamp=None)),
    ("sapo", dict(ratio_level="sequence_token")),
    ("gpg", {}),
    ("dro", dict(beta=0.3)),
    ("dppo_tv", dict(clip_high=0.28, ratio_max=3.0)),
    ("dppo_kl", dict(clip_low=0.1, clip_high=0.05)),
    ("clip_cov", dict(clip_high=0.28, **SELECTION["clip_cov"])),
    ("kl_cov", dict(ppo_kl_coef=0.1, **SELECTION["kl_cov"])),
    ("geo_mean", dict(clip_high=0.28)),
    ("vespo", {}),
    ("vespo", dict(k_pos=1.5, lambda_pos=2.0, k_neg=2.5, lambda_neg=1.0)),
]
IDS = [f"{m}-{'-'.join(f'{k}={v}' for k, v in o.items() if k not in ('clip_cov_lb', 'clip_cov_ub'))}"
       for m, o in CASES]
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-3), (torch.float16, 1e-3)]


@pytest.fixture
def poison(monkeypatch):
    poison_outputs(monkeypatch, "fastrlhf.kernels.ppo_loss", "fastrlhf.ops.losses", "fastrlhf.kernels.logprobs",
                   "fastrlhf.ops.logprobs")


def policy_inputs(B=B, T=T, outlier=29.0):
    """float64 (old_logp, logp, advantages): log-probs <= 0; log-ratios across every clip band in columns
    0-3 (below 1 - 0.2, exactly 1, past a dual clip 3, between 1.28 and 3), one at +outlier (past the +20
    clamp by default) and one past -20; the advantage of column 2 negative in even rows."""
    old = -torch.rand(B, T, dtype=F64) * 3 - 0.2
    old[:, :4] = -2.5 - torch.rand(B, 4, dtype=F64) * 0.5
    log_ratio = torch.randn(B, T, dtype=F64) * 0.25
    log_ratio[:, :4] = torch.tensor([-1.0, 0.0, 1.3, 0.5], dtype=F64)
    logp = torch.clamp(old + log_ratio, max=-1e-3)
    old[0, 5], logp[0, 5] = -1.0 - outlier, -1.0  # log-ratio +outlier (row 0 is right-padded: token 5 counts)
    old[4, 6], logp[4, 6] = -0.5, -25.0
    adv = torch.randn(B, T, dtype=F64)
    adv[:, 2] = adv[:, 2].abs() * (1 - 2 * (torch.arange(B) % 2 == 0))
    return old, logp, adv


def aggregations(mode):
    """Two aggregations of a mode: its own (agg=None) with local counts, and one with global counts and
    dp_size > 1 (geo_mean: its own with global_num_seqs)."""
    if mode == "geo_mean":
        return [{}, dict(global_num_seqs=11, dp_size=2)]
    return [{}, dict(agg="token-mean", global_num_tokens=300, dp_size=2) if mode != "luspo" else
            dict(agg="seq-mean-token-sum-norm", global_num_seqs=11, dp_size=2, loss_scale_factor=64)]


def reference_policy(mode, logp, old, adv, mask, options, agg_kw, is_weights, sampler):
    """reference.POLICY_LOSSES[mode] with the op's keywords: (loss, stats)."""
    kw = dict(options, is_weights=is_weights)
    fn = R.POLICY_LOSSES[mode]
    if mode == "geo_mean":
        kw.update(global_num_seqs=agg_kw.get("global_num_seqs"), dp_size=agg_kw.get("dp_size", 1))
    else:
        kw.update(agg_kw)
        if kw.get("agg") is None:
            kw.pop("agg", None)
    if mode == "vespo":
        kw["sampler_weights"] = sampler
    if "log_ratio_clamp" not in options and mode in ("vanilla", "ppo"):
        kw.pop("log_ratio_clamp", None)
    return fn(logp, old, adv, mask, **kw)


def run(fn, logp, upstream, seed=11):
    x = logp.detach().clone().requires_grad_()
    torch.manual_seed(seed)  # clip_cov's draw
    loss, stats = fn(x)
    (grad,) = torch.autograd.grad(loss * upstream, x)
    return loss.detach(), {k: v.detach() for k, v in stats.items()}, grad


def check_policy(mode, options, agg_kw, dtype, atol, with_is):
    # fp16 holds ratios up to 65504: an unclamped exp(29) is inf in the op and in the fp16 reference alike
    old64, logp64, adv64 = policy_inputs(outlier=9.0 if dtype == torch.float16 else 29.0)
    mask = make_mask(B, T)
    is64 = torch.rand(B, T, dtype=F64) * 2 if with_is else None
    sampler64 = torch.rand(B, T, dtype=F64) + 0.5 if mode == "vespo" else None
    upstream = torch.randn(()).item()
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    old, logp, adv, is_w, sampler = (cast(t) for t in (old64, logp64, adv64, is64, sampler64))

    def op(x):
        return ops.policy_loss(x, old, adv, mask, loss_mode=mode, is_weights=is_w, sampler_weights=sampler,
                               **options, **agg_kw)

    got, stats, grad = run(op, logp, upstream)
    want, want_stats, want_grad = run(
        lambda x: reference_policy(mode, x, old64, adv64, mask, options, agg_kw, is64, sampler64), logp64, upstream)
    assert set(stats) == set(want_stats) == set(pm.STATS[mode])
    assert want_grad.abs().sum() > 0 and grad.dtype == dtype
    if dtype == F64:  # the torch path computes float64 in float64
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-13)
        for k, v in want_stats.items():
            torch.testing.assert_close(stats[k], v, rtol=1e-12, atol=1e-13)
        return
    same, same_stats, same_grad = run(
        lambda x: reference_policy(mode, x, old, adv, mask, options, agg_kw, is_w, sampler), logp, upstream)
    # float64 on the rounded inputs the op is given: the error no op can avoid (assert_close_to_ref)
    up = lambda t: None if t is None else t.to(F64)  # noqa: E731
    rounded, rounded_stats, rounded_grad = run(
        lambda x: reference_policy(mode, x, up(old), up(adv), mask, options, agg_kw, up(is_w), up(sampler)),
        up(logp), upstream)
    assert got.dtype == torch.float32
    assert_close_to_ref(got, want, same, atol=atol, name="loss", ref64_rounded=rounded)
    assert_close_to_ref(grad, want_grad, same_grad, atol=atol, name="d_logp", ref64_rounded=rounded_grad)
    for k, v in want_stats.items():
        assert_close_to_ref(stats[k], v, same_stats[k], atol=atol, name=k, ref64_rounded=rounded_stats[k])
    # and on the inputs as given, the op's own arithmetic: float64 there is the truth, reference.py in float32 (what
    # the op computes in; its gradient rounded to the op's dtype) the yardstick, float32's atol. The rule above grants
    # the input rounding, which can swamp a wrong op (a clip or selection decided the other way moves whole tokens)
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    same32, same32_stats, same32_grad = run(
        lambda x: reference_policy(mode, x, f32(old), f32(adv), mask, options, agg_kw, f32(is_w), f32(sampler)),
        f32(logp), upstream)
    assert_close_to_ref(got, rounded, same32, atol=DTYPES[0][1], name="loss on its inputs")
    assert_close_to_ref(grad, rounded_grad, same32_grad.to(dtype), atol=DTYPES[0][1], name="d_logp on its inputs")
    for k, v in rounded_stats.items():
        assert_close_to_ref(stats[k], v, same32_stats[k], atol=DTYPES[0][1], name=f"{k} on its inputs")


@pytest.mark.parametrize("mode,options", CASES, ids=IDS)
@pytest.mark.parametrize("agg_index", [0, 1], ids=["own_agg", "global"])
@pytest.mark.parametrize("with_is", [False, True], ids=["no_is", "is"])
def test_policy_loss_every_mode_float32(backend, poison, mode, options, agg_index, with_is):
    check_policy(mode, options, aggregations(mode)[agg_index], torch.float32, 1e-5, with_is)


@pytest.mark.parametrize("mode,options", CASES, ids=IDS)
@pytest.mark.parametrize("dtype,atol", DTYPES[1:], ids=["bf16", "fp16"])
def test_policy_loss_every_mode_low_precision(backend, poison, mode, options, dtype, atol):
    check_policy(mode, options, aggregations(mode)[1], dtype, atol, True)


@pytest.mark.parametrize("mode,options", CASES, ids=IDS)
@pytest.mark.parametrize("agg_index", [0, 1], ids=["own_agg", "global"])
def test_policy_loss_every_mode_float64_torch_path(monkeypatch, mode, options, agg_index):
    monkeypatch.setenv("FASTRLHF_BACKEND", "torch")
    check_policy(mode, options, aggregations(mode)[agg_index], F64, 0.0, True)


@pytest.mark.parametrize("mode,options", CASES, ids=IDS)
def test_empty_mask_and_non_finite_values_off_the_mask(backend, mode, options):
    """An all-masked batch gives loss 0, zero gradients and zero stats; NaN / inf under mask = 0 change
    nothing (every mode, both backends)."""
    old, logp, adv = (t.float() for t in policy_inputs())
    mask = make_mask(B, T)
    sampler = torch.rand(B, T) + 0.5 if mode == "vespo" else None
    kw = dict(options, loss_mode=mode, sampler_weights=sampler)
    empty = torch.zeros(B, T, dtype=torch.bool)
    loss, stats, grad = run(lambda x: ops.policy_loss(x, old, adv, empty, **kw), logp, 1.0)
    assert loss.item() == 0.0 and not grad.any() and all(v.item() == 0.0 for v in stats.values())
    clean = run(lambda x: ops.policy_loss(x, old, adv, mask, **kw), logp, 1.0)
    bad_logp, bad_adv, bad_old = logp.clone(), adv.clone(), old.clone()
    bad_logp[2, 0], bad_adv[2, 1], bad_old[0, -1], bad_adv[3, 1] = math.nan, math.inf, -math.inf, math.nan
    dirty = run(lambda x: ops.policy_loss(x, bad_old, bad_adv, mask, **kw), bad_logp, 1.0)
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[2], dirty[2])
    assert all(torch.equal(clean[1][k], dirty[1][k]) for k in clean[1])


def test_gspo_hand_worked(backend):
    """One row, log-ratios 0.2 and 0: s = exp(0.1), A = 1, inside the clip: l = -s per token, token-mean
    loss -s, d/dlogp_t = -s / 2 (the gradient through the row's mean); past the clip (log-ratios 0.6, 0.4:
    s = exp(0.5) > 1.2): the loss is -1.2 and the gradient 0."""
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.ones(1, 2)
    for x, value, slope in ((torch.tensor([[0.2, 0.0]]), -math.exp(0.1), -math.exp(0.1) / 2),
                            (torch.tensor([[0.6, 0.4]]), -1.2, 0.0)):
        loss, _, grad = run(lambda y: ops.policy_loss(y, old, adv, mask, loss_mode="gspo", agg="token-mean"), x, 1.0)
        assert loss.item() == pytest.approx(value, rel=1e-6)
        torch.testing.assert_close(grad, torch.full((1, 2), slope), rtol=1e-6, atol=1e-7)


def test_geo_mean_hand_worked(backend):
    """Two rows of two tokens, A = 1 and -1 everywhere, log-ratios (0.1, 0.3) and (-0.1, -0.5), clip 0.2:
    row 0's x~ = (0.1, 0.2) (0.3 clipped at +0.2, no gradient there), l_0 = -exp(0.15); row 1's x~ =
    (-0.1, -0.2), l_1 = +exp(-0.15); loss (l_0 + l_1) / 2; d/dlogp = l_b / 2 (row mean) / 2 (tokens)."""
    old = torch.zeros(2, 2)
    x = torch.tensor([[0.1, 0.3], [-0.1, -0.5]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, stats, grad = run(lambda y: ops.policy_loss(y, old, adv, mask, loss_mode="geo_mean"), x, 1.0)
    l0, l1 = -math.exp(0.15), math.exp(-0.15)
    assert loss.item() == pytest.approx((l0 + l1) / 2, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[l0 / 4, 0.0], [l1 / 4, 0.0]]), rtol=1e-6, atol=1e-7)
    assert stats["clipfrac"].item() == 0.25 and stats["clipfrac_lower"].item() == 0.25


def test_clip_cov_generator_draws_reproducibly(backend):
    old, logp, adv = (t.float() for t in policy_inputs())
    mask = make_mask(B, T)
    kw = dict(loss_mode="clip_cov", **SELECTION["clip_cov"])
    draws = [ops.policy_loss(logp, old, adv, mask, generator=torch.Generator().manual_seed(5), **kw)
             for _ in range(2)]
    assert torch.equal(draws[0][0], draws[1][0]) and draws[0][1]["clipfrac"] > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clip_cov_candidates_are_the_tokens_the_loss_leaves_unclipped(backend, dtype):
    """One row, A = 1, log-ratios 0.25 and 0 (exact in bf16 / fp16): exp(0.25) = 1.284 is past the clip
    1 + 0.28, so token 0 is clipped and token 1, the only candidate, is the one token dropped, whatever the
    draw: loss (-1.28 + 0) / 2, no gradient. (In bf16 arithmetic exp(0.25) and 1.28 both round to 1.28125:
    a selection made there counts token 0 as a candidate and drops it on about half the draws.)"""
    old = torch.full((1, 2), -1.0, dtype=dtype)
    logp = torch.tensor([[-0.75, -1.0]], dtype=dtype)
    adv, mask = torch.ones(1, 2, dtype=dtype), torch.ones(1, 2, dtype=torch.bool)
    kw = dict(loss_mode="clip_cov", clip_high=0.28, agg="token-mean", **SELECTION["clip_cov"])
    for seed in range(8):
        generator = torch.Generator().manual_seed(seed)
        loss, stats, grad = run(lambda x, g=generator: ops.policy_loss(x, old, adv, mask, generator=g, **kw), logp, 1.0)
        assert loss.item() == pytest.approx(-0.64, rel=1e-6) and not grad.any(), seed
        assert stats["clipfrac"].item() == 0.5


def test_mode_arguments_are_checked():
    old, logp, adv = (t.float() for t in policy_inputs())
    mask = make_mask(B, T)
    with pytest.raises(ValueError, match="loss_mode must be one of"):
        ops.policy_loss(logp, old, adv, mask, loss_mode="grpo")
    with pytest.raises(TypeError, match="takes no option"):
        ops.policy_loss(logp, old, adv, mask, loss_mode="gpg", dual_clip=3.0)
    with pytest.raises(TypeError, match="takes no option"):
        ops.policy_loss(logp, old, adv, mask, loss_mode="vanilla", tau_pos=1.0)
    with pytest.raises(ValueError, match="agg=None"):
        ops.policy_loss(logp, old, adv, mask, loss_mode="geo_mean", agg="token-mean")
    with pytest.raises(ValueError, match="sampler_weights is vespo's"):
        ops.policy_loss(logp, old, adv, mask, loss_mode="gspo", sampler_weights=torch.ones(B, T))
    with pytest.raises(ValueError, match="needs beta > 0"):
        ops.policy_loss(logp, old, adv, mask, loss_mode="dro")
    with pytest.raises(ValueError, match="sampler_weights must have the shape"):
        ops.policy_loss(logp, old, adv, mask, loss_mode="vespo", sampler_weights=torch.ones(B, T + 1))


# ---------------------------------------------------------------- from logits and from hidden states

V = 41
ACTOR_CASES = [c for c in CASES if c[0] not in ("ppo", "gpg")] + [("gpg", {})]
ACTOR_IDS = [f"{m}-{'-'.join(f'{k}={v}' for k, v in o.items() if k not in ('clip_cov_lb', 'clip_cov_ub'))}"
             for m, o in ACTOR_CASES]


def actor_batch(Bx=5, Tx=9, Vx=V, dtype=torch.float32):
    """(logits, labels, old_logp, advantages, ref_logp, mask): ratios on both sides of every clip."""
    logits = (torch.randn(Bx, Tx, Vx) * 2).to(dtype)
    labels = torch.randint(0, Vx, (Bx, Tx))
    logp = R.logprobs(logits.double(), labels)
    old = logp + 0.3 * torch.randn(Bx, Tx, dtype=F64)
    ref_logp = logp + 0.5 * torch.randn(Bx, Tx, dtype=F64)
    adv = torch.randn(Bx, Tx, dtype=F64)
    return logits, labels, old, adv, ref_logp, make_mask(Bx, Tx)


def actor_kw(mode, options, with_is, shape):
    kw = dict(options, loss_mode=mode, kl_coef=0.1, entropy_coef=0.01, temperature=0.9, kl_estimator="k3")
    if mode == "geo_mean":
        kw.update(global_num_seqs=8, dp_size=2)
    elif mode != "luspo":
        kw.update(agg="seq-mean-token-mean")
    if with_is:
        kw["is_weights"] = torch.rand(shape, dtype=F64) * 2
    if mode == "vespo":
        kw["sampler_weights"] = torch.rand(shape, dtype=F64) + 0.5
    return kw


def grads_of(fn, leaves, upstream, seed=3):
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    torch.manual_seed(seed)
    loss, stats = fn(*leaves)
    grads = torch.autograd.grad(loss * upstream, leaves)
    return loss.detach(), {k: v.detach() for k, v in stats.items()}, grads


def cast_kw(kw, dtype):
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()}


def check_actor(mode, options, dtype, atol, with_is=True):
    logits, labels, old, adv, ref_logp, mask = actor_batch(dtype=dtype)
    kw = actor_kw(mode, options, with_is, mask.shape)
    upstream = torch.randn(()).item()
    f32 = cast_kw(dict(kw, ref_logp=ref_logp), torch.float32)
    got = grads_of(lambda x: ops.ppo_actor_loss(x, labels, old.float(), adv.float(), mask, **f32), [logits], upstream)
    kw64 = cast_kw(dict(kw, ref_logp=ref_logp), F64)
    want = grads_of(lambda x: R.ppo_actor_loss(x, labels, old, adv, mask, **kw64), [logits.double()], upstream)
    kw_same = cast_kw(dict(kw, ref_logp=ref_logp), dtype)
    same = grads_of(lambda x: R.ppo_actor_loss(x, labels, old.to(dtype), adv.to(dtype), mask, **kw_same), [logits],
                    upstream)
    assert set(got[1]) == set(want[1])
    assert got[2][0].dtype == dtype
    assert_close_to_ref(got[0], want[0], same[0], atol=atol, name="loss")
    assert_close_to_ref(got[2][0], want[2][0], same[2][0], atol=atol, name="d_logits")
    for k in want[1]:
        assert_close_to_ref(got[1][k], want[1][k], same[1][k], atol=atol, name=k)


@pytest.mark.parametrize("mode,options", ACTOR_CASES, ids=ACTOR_IDS)
def test_ppo_actor_loss_every_mode(backend, poison, mode, options):
    check_actor(mode, options, torch.float32, 1e-5)


@pytest.mark.parametrize("mode,options", [("gspo", {}), ("cispo", dict(clip_high=0.28)), ("geo_mean", {}),
                                          ("clip_cov", SELECTION["clip_cov"]), ("vespo", {})],
                         ids=["gspo", "cispo", "geo_mean", "clip_cov", "vespo"])
@pytest.mark.parametrize("dtype,atol", DTYPES[1:], ids=["bf16", "fp16"])
def test_ppo_actor_loss_low_precision(backend, poison, mode, options, dtype, atol):
    check_actor(mode, options, dtype, atol, with_is=False)


LINEAR_CASES = [("vanilla", dict(dual_clip=3.0)), ("gspo", {}), ("cispo", dict(ratio_max=2.0)),
                ("sapo", dict(ratio_level="sequence")), ("geo_mean", {}), ("kl_cov", SELECTION["kl_cov"]),
                ("vespo", {}), ("dppo_kl", {})]


@pytest.mark.parametrize("mode,options", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
@pytest.mark.parametrize("chunk_size", [7, 1000], ids=["chunks", "one_chunk"])
def test_linear_ppo_actor_loss_every_kind_of_mode(backend, poison, mode, options, chunk_size):
    """Token-local modes (fused per chunk on Triton), sequence / batch modes (two sweeps, the logits
    recomputed or, in one chunk, kept): loss, stats, d(hidden), d(weight), d(bias) against the reference
    on materialised logits."""
    Bx, Tx, H = 4, 9, 16
    _, labels, _, adv, ref_logp, mask = actor_batch(Bx, Tx)
    hidden, weight, bias = torch.randn(Bx, Tx, H), torch.randn(V, H) / H**0.5, torch.randn(V) * 0.1
    logp = R.logprobs((hidden.double() @ weight.double().T + bias.double()) / 0.9, labels)
    old = logp + 0.3 * torch.randn(Bx, Tx, dtype=F64)
    kw = actor_kw(mode, options, True, mask.shape)
    upstream = torch.randn(()).item()
    f32 = cast_kw(dict(kw, ref_logp=ref_logp), torch.float32)
    got = grads_of(lambda h, w, b: ops.linear_ppo_actor_loss(h, w, labels, old.float(), adv.float(), mask, bias=b,
                                                             chunk_size=chunk_size, **f32),
                   [hidden, weight, bias], upstream)
    kw64 = cast_kw(dict(kw, ref_logp=ref_logp), F64)

    def reference(h, w, b, dtype):
        k = cast_kw(kw64, dtype)
        return R.ppo_actor_loss(h @ w.T + b, labels, old.to(dtype), adv.to(dtype), mask, **k)

    want = grads_of(lambda h, w, b: reference(h, w, b, F64), [hidden.double(), weight.double(), bias.double()],
                    upstream)
    same = grads_of(lambda h, w, b: reference(h, w, b, torch.float32), [hidden, weight, bias], upstream)
    assert set(got[1]) == set(want[1])
    assert_close_to_ref(got[0], want[0], same[0], atol=1e-5, name="loss")
    for name, g, w_, s in zip(("d_hidden", "d_weight", "d_bias"), got[2], want[2], same[2]):
        assert_close_to_ref(g, w_, s, atol=1e-5, name=name)
    for k in want[1]:
        assert_close_to_ref(got[1][k], want[1][k], same[1][k], atol=1e-5, name=k)
