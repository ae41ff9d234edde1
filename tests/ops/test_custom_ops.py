"""Every public op is a graph citizen: torch.compile(fullgraph=True) traces it with no graph break,
forward and backward, on both backends, and gives the eager numbers; the `fastrlhf::` custom ops
pass torch.library.opcheck (schema, fake impl, autograd registration, AOT dispatch) and, on the
torch path in float64, torch.autograd.gradcheck. Tiny shapes, one compile per op and backend.

The compile tests use the "aot_eager" backend: Dynamo and AOTAutograd trace the whole graph with
fake tensors exactly as for inductor (that is where graph breaks and fake-impl errors appear);
one test also runs inductor end to end.
"""

import functools

import pytest
import torch
import torch._dynamo.testing
from torch.library import opcheck

from fastrlhf import ops
from fastrlhf.ops import policy_modes as pm

B, T, V, H = 3, 5, 13, 8


def _mask():
    m = torch.rand(B, T) > 0.3
    m[0] = True
    m[2] = False  # an all-masked row
    return m


def _lp(*shape, requires_grad=False, dtype=torch.float32):
    return (-torch.rand(*shape, dtype=dtype) * 3).requires_grad_(requires_grad)


# Each case: build(dtype) -> (fn, leaves); fn(*leaves) runs the public op and returns its tensors
# (losses, stats, per-token outputs) as a list; the leaves are the inputs that get gradients.


def _logprobs(dtype, inplace=False):
    labels = torch.randint(0, V, (B, T))
    labels[0, 1] = -100

    def fn(full):
        logits = full * 1.0 if inplace else full  # the in-place backward writes into an intermediate
        return list(ops.logprobs(logits[:, :-1], labels, temperature=0.9, return_entropy=True,
                                 inplace_backward=inplace))

    return fn, [torch.randn(B, T + 1, V, dtype=dtype, requires_grad=True)]


def _entropy(dtype):
    return (lambda logits: [ops.entropy(logits, temperature=0.7)]), [torch.randn(B, T, V, dtype=dtype,
                                                                                requires_grad=True)]


def _logprobs_topk(dtype):
    labels = torch.randint(0, V, (B, T, 3))
    labels[0, 0, 1] = -100
    return (lambda logits: [ops.logprobs(logits, labels, temperature=1.3)]), [torch.randn(B, T, V, dtype=dtype,
                                                                                          requires_grad=True)]


def _agg_loss(dtype):
    mask = _mask()
    return (lambda loss_mat: [ops.agg_loss(loss_mat, mask, agg="seq-mean-token-sum-norm", global_num_seqs=7,
                                           dp_size=2, loss_scale_factor=3.0)]), \
        [torch.randn(B, T, dtype=dtype, requires_grad=True)]


def _token_kl_straight_through(dtype):
    weight = torch.rand(B, T, dtype=dtype) * 2
    return (lambda logp, ref_logp: [ops.token_kl(logp, ref_logp, estimator="k3", clamp=10.0, straight_through=True,
                                                 grad_weight=weight)]), \
        [_lp(B, T, requires_grad=True, dtype=dtype), _lp(B, T, requires_grad=True, dtype=dtype)]


def _token_kl(dtype):
    return (lambda logp, ref_logp: [ops.token_kl(logp, ref_logp, estimator="k3", clamp=10.0)]), \
        [_lp(B, T, requires_grad=True, dtype=dtype), _lp(B, T, requires_grad=True, dtype=dtype)]


def _kl_shaped_rewards(dtype):
    scores, logp, ref_logp, mask = torch.randn(B, dtype=dtype), _lp(B, T, dtype=dtype), _lp(B, T, dtype=dtype), _mask()
    return (lambda: [ops.kl_shaped_rewards(scores, logp, ref_logp, mask, kl_coef=0.1, estimator="k2")]), []


def _gae(dtype):
    rewards, values, mask = torch.randn(B, T, dtype=dtype), torch.randn(B, T, dtype=dtype), _mask()
    return (lambda: list(ops.gae(rewards, values, mask, gamma=0.99, lam=0.95))), []


def _whiten(dtype):
    x, mask = torch.randn(B, T, dtype=dtype), _mask()
    return (lambda: [ops.whiten(x, mask)]), []


def _raw_moments(dtype):
    x, mask = torch.randn(B, T, dtype=dtype), _mask()
    return (lambda: [ops.raw_moments(x, mask), ops.whiten(x, mask, moments=ops.raw_moments(x, mask) * 2)]), []


# the policy-loss modes traced with fullgraph=True (clip_cov / kl_cov select tokens with a host sync, as the
# peers: they are opchecked, not traced whole)
MODE_OPTIONS = {"vanilla": dict(clip_high=0.28, dual_clip=3.0, agg="seq-mean-token-mean"),
                "gspo": dict(clip_high=0.28, delta=1.5), "geo_mean": dict(global_num_seqs=4.0),
                "cispo": dict(ratio_max=2.0, ratio_level="sequence"), "vespo": dict(k_pos=1.5), "dppo_kl": {}}


def _policy_loss(dtype, mode="vanilla"):
    old, adv, mask = _lp(B, T, dtype=dtype), torch.randn(B, T, dtype=dtype), _mask()

    is_weights = torch.rand(B, T, dtype=dtype) + 0.5

    def fn(logp):
        loss, stats = ops.policy_loss(logp, old, adv, mask, loss_mode=mode, is_weights=is_weights,
                                      **MODE_OPTIONS[mode])
        return [loss, *stats.values()]

    return fn, [_lp(B, T, requires_grad=True, dtype=dtype)]


def _value_loss(dtype):
    values = torch.randn(B, T, dtype=dtype)
    old, ret, mask = values + 0.3 * torch.randn(B, T, dtype=dtype), torch.randn(B, T, dtype=dtype), _mask()

    def fn(v):
        loss, stats = ops.value_loss(v, old, ret, mask, clip=0.2)
        return [loss, *stats.values()]

    return fn, [values.requires_grad_()]


def _ppo_actor_loss(dtype, mode="vanilla"):
    labels = torch.randint(0, V, (B, T))
    old, adv, ref_logp, mask = _lp(B, T, dtype=dtype), torch.randn(B, T, dtype=dtype), _lp(B, T, dtype=dtype), _mask()
    options = dict(dual_clip=3.0, agg="token-sum") if mode == "vanilla" else MODE_OPTIONS[mode]

    def fn(logits):
        loss, stats = ops.ppo_actor_loss(logits, labels, old, adv, mask, ref_logp=ref_logp, kl_coef=0.1,
                                         kl_clamp=10.0, entropy_coef=0.01, temperature=0.8, loss_mode=mode, **options)
        return [loss, *stats.values()]

    return fn, [torch.randn(B, T, V, dtype=dtype, requires_grad=True)]


def _linear_leaves(dtype):
    return [torch.randn(B, T, H, dtype=dtype).requires_grad_(),
            (torch.randn(V, H, dtype=dtype) / H**0.5).requires_grad_(), torch.randn(V, dtype=dtype).requires_grad_()]


def _linear_logprobs(dtype):
    labels = torch.randint(0, V, (B, T))

    def fn(hidden, weight, bias):
        return list(ops.linear_logprobs(hidden, weight, labels, bias=bias, return_entropy=True, chunk_size=4,
                                        temperature=1.1))

    return fn, _linear_leaves(dtype)


def _linear_ppo_actor_loss(dtype, kl_straight_through=True, mode="vanilla"):
    labels = torch.randint(0, V, (B, T))
    old, adv, ref_logp, mask = _lp(B, T, dtype=dtype), torch.randn(B, T, dtype=dtype), _lp(B, T, dtype=dtype), _mask()
    is_weights = torch.rand(B, T, dtype=dtype) + 0.5
    options = dict(agg="seq-mean-token-sum") if mode == "vanilla" else MODE_OPTIONS[mode]

    def fn(hidden, weight, bias):
        loss, stats = ops.linear_ppo_actor_loss(hidden, weight, labels, old, adv, mask, bias=bias, chunk_size=4,
                                                ref_logp=ref_logp, kl_coef=0.1, kl_straight_through=kl_straight_through,
                                                entropy_coef=0.01, is_weights=is_weights, loss_mode=mode, **options)
        return [loss, *stats.values()]

    return fn, _linear_leaves(dtype)


def _outcome_advantages(dtype):
    scores, mask, ids = torch.randn(B, dtype=dtype), _mask(), torch.tensor([7, 7, 2])
    return (lambda: [ops.outcome_advantages(scores, mask, group_ids=ids, estimator="rloo", whiten="tokens")]), []


def _rollout_correction(dtype):
    old, rollout, mask = _lp(B, T, dtype=dtype), _lp(B, T, dtype=dtype), _mask()

    def fn():
        weights, keep, metrics = ops.rollout_correction(old, rollout, mask, level="sequence", mode="mask", low=0.5,
                                                        high=2.0, batch_normalize=True,
                                                        reject={"token_k1": (0.5, 2.0), "seq_max_k3": 1.0})
        return [weights, keep, *metrics.values()]

    return fn, []


def _pair_leaves(dtype):
    return [_lp(B, requires_grad=True, dtype=dtype) * 10 for _ in range(4)]


def _dpo_loss(dtype):
    def fn(chosen, rejected, ref_chosen, ref_rejected):
        loss, stats = ops.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.2, loss_type="robust",
                                   label_smoothing=0.1)
        return [loss, *stats.values()]

    return fn, [x.detach().requires_grad_() for x in _pair_leaves(dtype)]


def _linear_sequence_logprobs(dtype):
    labels, mask = torch.randint(0, V, (B, T)), _mask()

    def fn(hidden, weight, bias):
        return [ops.linear_sequence_logprobs(hidden, weight, labels, mask, bias=bias, chunk_size=4)]

    return fn, _linear_leaves(dtype)


def _linear_dpo_loss(dtype):
    labels, mask = torch.randint(0, V, (2 * B, T)), torch.cat([_mask(), _mask()])
    ref_chosen, ref_rejected = _lp(B, dtype=dtype) * 10, _lp(B, dtype=dtype) * 10

    def fn(hidden, weight, bias):
        loss, stats = ops.linear_dpo_loss(hidden, weight, labels, mask, ref_chosen, ref_rejected, bias=bias,
                                          loss_type="ipo", ipo_per_token=True, chunk_size=4)
        return [loss, *stats.values()]

    hidden, weight, bias = _linear_leaves(dtype)
    return fn, [torch.randn(2 * B, T, H, dtype=dtype).requires_grad_(), weight, bias]


def _distill_loss(dtype):
    teacher, mask = torch.randn(B, T + 1, V, dtype=dtype), _mask()

    def fn(student):  # logits[:, :-1] views, JSD, a softcap on the teacher, a tensor divisor (TRL's)
        loss, stats = ops.distill_loss(student[:, :-1], teacher[:, :-1], mask, beta=0.4, temperature=0.9,
                                       teacher_softcap=3.0, global_num_tokens=torch.tensor(7.0))
        return [loss, stats["entropy"]]

    return fn, [torch.randn(B, T + 1, V, dtype=dtype, requires_grad=True)]


def _linear_distill_loss(dtype):
    teacher_hidden, teacher_weight = torch.randn(B, T, H + 3, dtype=dtype), torch.randn(V, H + 3, dtype=dtype)
    mask = _mask()

    def fn(hidden, weight, bias):  # reverse KL, a wider teacher, chunks of 4 rows
        loss, stats = ops.linear_distill_loss(hidden, weight, teacher_hidden, teacher_weight, mask, beta=1.0,
                                              student_bias=bias, temperature=1.1, chunk_size=4)
        return [loss, stats["entropy"]]

    hidden, weight, bias = _linear_leaves(dtype)
    return fn, [hidden, weight, bias]


def _topk_distill_loss(dtype):
    ids = torch.randint(0, V, (B, T, 4))
    ids[0, 0, 3] = -1
    teacher_logprobs, mask = -torch.rand(B, T, 4, dtype=dtype) * 3, _mask()

    def fn(student):
        loss, stats = ops.topk_distill_loss(student, ids, teacher_logprobs, mask, beta=0.5, temperature=0.9)
        return [loss, stats["entropy"]]

    return fn, [torch.randn(B, T, V, dtype=dtype, requires_grad=True)]


def _decode_attention_inputs(dtype):
    """q [4, 4, 2, 16] against a [4, 2, 40, 16] cache (an empty row, one full), and a prefix shared by pairs."""
    q, k, v = torch.randn(4, 4, 2, 16, dtype=dtype), torch.randn(4, 2, 40, 16, dtype=dtype), torch.randn(4, 2, 40, 16,
                                                                                                         dtype=dtype)
    prefix = (torch.randn(2, 2, 9, 16, dtype=dtype), torch.randn(2, 2, 9, 16, dtype=dtype), torch.tensor([9, 0]), 2)
    return q, k, v, torch.tensor([0, 3, 40, 17], dtype=torch.int32), prefix


def _decode_attention(dtype):
    q, k, v, lengths, prefix = _decode_attention_inputs(dtype)
    return (lambda: [ops.decode_attention(q, k, v, lengths, scale=0.25),
                     ops.decode_attention(q, k, v, lengths, scale=0.25, prefix=prefix)]), []


CASES = {
    "decode_attention": _decode_attention,
    "logprobs": _logprobs,
    "logprobs-inplace_backward": lambda dtype: _logprobs(dtype, inplace=True),
    "logprobs-topk": _logprobs_topk,
    "entropy": _entropy,
    "agg_loss": _agg_loss,
    "token_kl": _token_kl,
    "token_kl-straight_through": _token_kl_straight_through,
    "kl_shaped_rewards": _kl_shaped_rewards,
    "gae": _gae,
    "whiten": _whiten,
    "raw_moments": _raw_moments,
    "policy_loss": _policy_loss,
    **{f"policy_loss-{m}": functools.partial(_policy_loss, mode=m) for m in MODE_OPTIONS if m != "vanilla"},
    "value_loss": _value_loss,
    "ppo_actor_loss": _ppo_actor_loss,
    "ppo_actor_loss-gspo": functools.partial(_ppo_actor_loss, mode="gspo"),
    "ppo_actor_loss-cispo": functools.partial(_ppo_actor_loss, mode="cispo"),
    "linear_logprobs": _linear_logprobs,
    "linear_ppo_actor_loss": _linear_ppo_actor_loss,
    "linear_ppo_actor_loss-geo_mean": functools.partial(_linear_ppo_actor_loss, mode="geo_mean"),
    "outcome_advantages": _outcome_advantages,
    "rollout_correction": _rollout_correction,
    "dpo_loss": _dpo_loss,
    "linear_sequence_logprobs": _linear_sequence_logprobs,
    "linear_dpo_loss": _linear_dpo_loss,
    "distill_loss": _distill_loss,
    "linear_distill_loss": _linear_distill_loss,
    "topk_distill_loss": _topk_distill_loss,
}
NOT_OPS = {"AGG_MODES", "KL_ESTIMATORS", "MASK_MODES", "ADVANTAGES", "register_advantage"}  # constants, the registry


def test_every_public_op_has_a_case():
    assert {name.split("-")[0] for name in CASES} == set(ops.__all__) - NOT_OPS


def _run(fn, leaves, upstream):
    """The op's outputs and the gradients of sum(upstream_i * output_i) (a random upstream)."""
    outs = fn(*leaves)
    grads = []
    if leaves:
        total = sum((u * o.double()).sum() for u, o in zip(upstream, outs) if o.requires_grad)
        grads = list(torch.autograd.grad(total, leaves))
    return [o.detach() for o in outs], grads


@pytest.mark.parametrize("name", CASES)
def test_compile_fullgraph_matches_eager(backend, name):
    torch._dynamo.reset()  # one fresh compile per op and backend: dispatch depends on FASTRLHF_BACKEND
    fn, leaves = CASES[name](torch.float32)
    upstream = [torch.randn(o.shape, dtype=torch.float64) for o in fn(*leaves)]
    eager_outs, eager_grads = _run(fn, leaves, upstream)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    outs, grads = _run(torch.compile(fn, fullgraph=True, backend=counter), leaves, upstream)
    assert counter.frame_count == 1, f"{name}: {counter.frame_count} graphs"
    for got, want in zip(outs + grads, eager_outs + eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_compile_fullgraph_with_changing_hyperparameters():
    """A float keyword that changes between calls (an adaptive KL coefficient, a clip schedule) becomes
    a SymFloat on the recompile: the argument checks must trace it (math.isfinite of one broke the
    graph, an error under fullgraph). Also dynamic=True, where floats and ints are symbolic at once."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    old, adv, mask = -torch.rand(2, 3), torch.randn(2, 3), torch.rand(2, 3) > 0.3

    def actor(x, kl_coef, clip, temperature):
        return ops.ppo_actor_loss(x, y, old, adv, mask, ref_logp=old, kl_coef=kl_coef, clip_low=clip,
                                  temperature=temperature)[0]

    def log_probs(x, ignore_index, temperature):
        return ops.logprobs(x, y, ignore_index=ignore_index, temperature=temperature)

    for fn, calls in ((actor, [(0.1, 0.2, 1.0), (0.05, 0.25, 0.9), (0.02, 0.3, 0.8)]),
                      (log_probs, [(-100, 1.0), (3, 0.7)])):
        for dynamic in (None, True):
            compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)
            for args in calls:
                torch.testing.assert_close(compiled(x, *args), fn(x, *args), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_inductor_end_to_end():
    """The real compiler on the trainer's two losses in one graph: Dynamo, AOTAutograd, inductor."""
    torch._dynamo.reset()
    actor, actor_leaves = _linear_ppo_actor_loss(torch.float32)
    value, value_leaves = _value_loss(torch.float32)

    def fn(hidden, weight, bias, values):
        return [actor(hidden, weight, bias)[0] + value(values)[0]]

    leaves = actor_leaves + value_leaves
    upstream = [torch.randn((), dtype=torch.float64)]
    eager_outs, eager_grads = _run(fn, leaves, upstream)
    outs, grads = _run(torch.compile(fn, fullgraph=True), leaves, upstream)
    for got, want in zip(outs + grads, eager_outs + eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- gradcheck, float64, torch path


@pytest.mark.parametrize("name", ["logprobs", "logprobs-topk", "entropy", "agg_loss", "token_kl", "policy_loss",
                                  "policy_loss-gspo", "policy_loss-geo_mean", "value_loss", "linear_logprobs",
                                  "dpo_loss", "linear_sequence_logprobs",
                                  "linear_dpo_loss", "topk_distill_loss"])
def test_gradcheck_float64(monkeypatch, name):
    """(Straight-through KL is left out on purpose: its gradient is by definition not its value's; so are the
    modes whose gradient is a detached weight's times the log-prob's: cispo, dppo, vespo.)"""
    monkeypatch.setenv("FASTRLHF_BACKEND", "torch")
    fn, leaves = CASES[name](torch.float64)
    assert torch.autograd.gradcheck(lambda *xs: tuple(o for o in fn(*xs) if o.requires_grad), tuple(leaves))


@pytest.mark.parametrize("name", ["ppo_actor_loss", "linear_ppo_actor_loss", "ppo_actor_loss-gspo",
                                  "linear_ppo_actor_loss-geo_mean"])
def test_actor_losses_directional_derivatives_float64(monkeypatch, name):
    """gradcheck backprops twice (a reentrancy check) and these losses allow one backward (their
    gradients are formed in the forward and handed over once): the same check, written out. Central
    differences of the float64 loss along random directions equal <gradient, direction>."""
    monkeypatch.setenv("FASTRLHF_BACKEND", "torch")
    op, _, mode = name.partition("-")
    if op == "ppo_actor_loss":
        fn, leaves = _ppo_actor_loss(torch.float64, mode=mode or "vanilla")
    else:
        fn, leaves = _linear_ppo_actor_loss(torch.float64, kl_straight_through=False, mode=mode or "vanilla")
    grads = torch.autograd.grad(fn(*leaves)[0], leaves)
    eps = 1e-6
    with torch.no_grad():
        for _ in range(3):
            directions = [torch.randn_like(leaf) for leaf in leaves]
            up = fn(*(x + eps * d for x, d in zip(leaves, directions)))[0]
            down = fn(*(x - eps * d for x, d in zip(leaves, directions)))[0]
            numeric = (up - down) / (2 * eps)
            analytic = sum((g * d).sum() for g, d in zip(grads, directions))
            torch.testing.assert_close(numeric, analytic, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------- opcheck on the custom ops


def _mode(name, **options):
    """A policy-loss mode's flat spec, as the custom ops take it."""
    return pm.make_spec(name, **options).flat()


def _opcheck_samples(dtype, triton):
    """(op, args) for every fastrlhf custom op, inputs requiring grad where the op has a gradient."""
    x = torch.randn(B, T, V, dtype=dtype, requires_grad=True)
    y = torch.randint(0, V, (B, T))
    lp, ref_lp, adv = _lp(B, T, requires_grad=True, dtype=dtype), _lp(B, T, dtype=dtype), torch.randn(B, T, dtype=dtype)
    mask = _mask()
    scale = torch.rand(B, dtype=dtype)
    w = torch.rand(B, T, dtype=dtype)
    lse, ent = torch.logsumexp(x.detach(), -1), torch.rand(B, T, dtype=dtype)
    g = torch.randn(B, T, dtype=dtype)
    hidden = torch.randn(B * T, H, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, dtype=dtype, requires_grad=True)
    bias = torch.randn(V, dtype=dtype, requires_grad=True)
    flat = lambda t: t.detach().reshape(-1)  # noqa: E731
    pairs = _pair_leaves(dtype)
    lengths = torch.tensor([3, 0, 5])
    q, k, v, cache_lengths, (k_prefix, v_prefix, prefix_lengths, group) = _decode_attention_inputs(dtype)
    fl = torch.ops.fastrlhf
    return {
        "decode_attention": (fl.decode_attention, (q, k, v, cache_lengths, 0.25, None, None, None, 1, triton)),
        "decode_attention-prefix": (fl.decode_attention, (q, k, v, cache_lengths, 0.25, k_prefix, v_prefix,
                                                          prefix_lengths, group, triton)),
        "logprobs": (fl.logprobs, (x, y, 0.9, -100, True, False, triton)),
        "logprobs_backward": (fl.logprobs_backward, (x.detach(), y, lse, ent, g, g, 0.9, -100, triton)),
        "logprobs_backward_inplace": (fl.logprobs_backward_inplace,
                                      (x.detach().clone(), y, lse, ent, g, None, 0.9, -100, triton)),
        "logprobs-topk": (fl.logprobs, (x, torch.randint(0, V, (B, T, 3)), 1.0, -100, False, False, triton)),
        "entropy": (fl.entropy, (x, 0.9, triton)),
        "agg_loss": (fl.agg_loss, (lp, mask, scale)),
        "token_kl": (fl.token_kl, (lp, ref_lp, "k3", 10.0, False, None, triton)),
        "token_kl-straight_through": (fl.token_kl, (lp, ref_lp, "abs", None, True, torch.rand(B, T, dtype=dtype),
                                                    triton)),
        "token_kl_backward": (fl.token_kl_backward, (lp.detach(), ref_lp, g, None, "abs", None, True, True, triton)),
        "token_kl_backward-weighted": (fl.token_kl_backward, (lp.detach(), ref_lp, g.t().contiguous().t(), w, "k2",
                                                              None, True, False, triton)),
        "kl_shaped_rewards": (fl.kl_shaped_rewards, (g[:, 0], lp.detach(), ref_lp, mask, 0.1, "k1", None, triton)),
        "gae": (fl.gae, (g, ref_lp, mask, 0.99, 0.95, "skip", True, triton)),
        "whiten": (fl.whiten, (g, mask, True, True, triton)),
        "raw_moments": (fl.raw_moments, (g, mask)),
        "whiten_with_moments": (fl.whiten_with_moments, (g, mask, torch.tensor([7.0, 1.5, 9.0], dtype=torch.float64),
                                                         True, False)),
        "policy_loss": (fl.policy_loss, (lp, ref_lp, adv, mask, None, None, None, *_mode("vanilla", dual_clip=3.0),
                                         "seq-mean-token-mean", None, None, 1, None, True, triton)),
        "policy_loss-is_weights": (fl.policy_loss, (lp, ref_lp, adv, mask, w, None, None, *_mode("vanilla"),
                                                    "token-mean", 9.0, None, 2, None, True, triton)),
        "policy_loss-gspo": (fl.policy_loss, (lp, ref_lp, adv, mask, w, None, None, *_mode("gspo", delta=1.5),
                                              "seq-mean-token-mean", None, None, 1, None, True, triton)),
        "policy_loss-geo_mean": (fl.policy_loss, (lp, ref_lp, adv, mask, w, None, None, *_mode("geo_mean"),
                                                  "seq-mean-token-mean", None, 5.0, 2, None, True, triton)),
        "policy_loss-clip_cov": (fl.policy_loss, (lp, ref_lp, adv, mask, None, torch.rand(B, T) > 0.7, None,
                                                  *_mode("clip_cov"), "token-sum", None, None, 1, None, True, triton)),
        "policy_loss-vespo": (fl.policy_loss, (lp, ref_lp, adv, mask, None, None, w + 0.5, *_mode("vespo"),
                                               "token-mean", None, None, 1, None, True, triton)),
        "policy_loss-sapo_sequence": (fl.policy_loss, (lp, ref_lp, adv, mask, None, None, None,
                                                       *_mode("sapo", ratio_level="sequence"), "seq-mean-token-sum",
                                                       None, None, 1, None, True, triton)),
        "value_loss": (fl.value_loss, (lp, ref_lp, adv, mask, 0.2, "seq-mean-token-sum-norm", None, 4.0, 2, 3.0,
                                       True, triton)),
        "value_loss-local_count": (fl.value_loss, (lp, ref_lp, adv, mask, None, "token-mean", None, None, 1, None,
                                                   True, triton)),
        "ppo_actor_loss": (fl.ppo_actor_loss, (x, y, ref_lp, adv, mask, w, ref_lp, w, None, 0.9, 0.1, "k3", 10.0, True,
                                               0.01, *_mode("vanilla"), True, triton)),
        "ppo_actor_loss-gspo": (fl.ppo_actor_loss, (x, y, ref_lp, adv, mask, w, ref_lp, w, None, 0.9, 0.1, "k3", None,
                                                    False, 0.01, *_mode("gspo"), True, triton)),
        "ppo_actor_loss-cispo": (fl.ppo_actor_loss, (x, y, ref_lp, adv, mask, w, None, None, None, 1.0, 0.0, "k3",
                                                     None, False, 0.0, *_mode("cispo", ratio_max=2.0), True, triton)),
        "scale_unless_one_": (fl.scale_unless_one_, (torch.randn(B, T, V, dtype=dtype), torch.tensor(0.7), triton)),
        "linear_logprobs": (fl.linear_logprobs, (hidden, weight, bias, flat(y), 1.0, -100, True, 4, None, False,
                                                 triton)),
        "linear_logprobs-keep_logits": (fl.linear_logprobs, (hidden, weight, bias, flat(y), 1.0, -100, True, B * T,
                                                             None, True, triton)),
        "linear_logprobs_backward": (fl.linear_logprobs_backward,
                                     (hidden.detach(), weight.detach(), bias.detach(), flat(y), flat(lse), flat(ent),
                                      hidden.new_empty(0), flat(g), flat(g), 1.0, -100, 4, None, True, True, True,
                                      triton)),
        "linear_ppo_actor_loss": (fl.linear_ppo_actor_loss,
                                  (hidden, weight, bias, flat(y), ref_lp, adv, mask.to(dtype), w, ref_lp, None, None,
                                   1.0, 0.1, "k2", None, False, 0.01, *_mode("vanilla", dual_clip=3.0), 4, None, True,
                                   True, True, triton)),
        "linear_ppo_actor_loss-geo_mean": (fl.linear_ppo_actor_loss,
                                           (hidden, weight, bias, flat(y), ref_lp, adv, mask.to(dtype), w, None, w,
                                            None, 1.0, 0.0, "k3", None, False, 0.0, *_mode("geo_mean"), 4, None, True,
                                            True, True, triton)),
        "outcome_advantages": (fl.outcome_advantages, (g[:, 0].detach(), mask, torch.tensor([4, 1, 4]), "grpo", 1e-6,
                                                       "group", True, "score", "tokens", 1e-8, "add")),
        "rollout_correction": (fl.rollout_correction, (lp.detach(), ref_lp, mask, "sequence", "mask", 0.5, 2.0, "ratio",
                                                       "level", -20.0, 20.0, False, True, [0, 10],
                                                       [-0.7, float("nan")], [0.7, 1.0])),
        "rollout_correction-geometric_tv": (fl.rollout_correction, (lp.detach(), ref_lp, mask, "geometric", "mask", 0.0,
                                                                    0.1, "tv", "token", None, None, True, False, [],
                                                                    [], [])),
        "dpo_loss": (fl.dpo_loss, (*pairs, None, None, 0.1, "sigmoid", 0.1)),
        "dpo_loss-ipo_lengths": (fl.dpo_loss, (*pairs, lengths, lengths + 1, 0.1, "ipo", 0.0)),
        "dpo_loss-hinge": (fl.dpo_loss, (*pairs, None, None, 0.5, "hinge", 0.0)),
        # the distillation ops return their gradients (the autograd.Function around them scales them)
        "distill_loss": (fl.distill_loss, (x.detach(), torch.randn(B, T, V, dtype=dtype), flat(w), 0.5, 0.9, 1.0,
                                           None, 1.0, 3.0, True, triton)),
        "distill_loss-reverse_kl": (fl.distill_loss, (x.detach()[:, :-1], x.detach()[:, 1:], flat(w[:, 1:]), 1.0,
                                                      1.0, 1.3, 2.0, 1.0, None, False, triton)),
        "linear_distill_loss": (fl.linear_distill_loss,
                                (hidden.detach(), weight.detach(), bias.detach(),
                                 torch.randn(B * T, H + 2, dtype=dtype), torch.randn(V, H + 2, dtype=dtype), None,
                                 flat(w), 0.0, 0.8, 1.0, None, 1.0, None, 4, None, None, True, True, True, triton)),
        "linear_distill_loss-fp32_logits": (fl.linear_distill_loss,
                                            (hidden.detach().half(), weight.detach().half(), None,
                                             torch.randn(B * T, H, dtype=torch.half), weight.detach().half(), None,
                                             flat(w), 0.5, 1.0, 1.0, 2.0, 1.0, None, 5, None, torch.float32, True,
                                             False, False, triton)),
    }


def test_opcheck_covers_every_custom_op():
    registered = {name for name in dir(torch.ops.fastrlhf)
                  if isinstance(getattr(torch.ops.fastrlhf, name, None), torch._ops.OpOverloadPacket)}
    assert registered, "no fastrlhf custom op registered"
    assert {n.split("-")[0] for n in _opcheck_samples(torch.float64, False)} == registered


@pytest.mark.parametrize("name", list(_opcheck_samples(torch.float64, False)))
def test_opcheck(backend, name):
    """Torch path in float64; the Triton path computes in fp32, so it is checked with fp32 inputs."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    op, args = _opcheck_samples(dtype, backend == "triton")[name]
    # the actor losses allow one backward, which opcheck's AOT test takes several times
    skip = ("test_aot_dispatch_dynamic",) if name.split("-")[0] in ("ppo_actor_loss", "linear_ppo_actor_loss") else ()
    utils = tuple(u for u in ("test_schema", "test_autograd_registration", "test_faketensor",
                              "test_aot_dispatch_dynamic") if u not in skip)
    opcheck(op, args, test_utils=utils)
