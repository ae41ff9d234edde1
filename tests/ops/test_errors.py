"""Bad input gets a clear error naming the argument; edge cases give finite, empty or NaN
results as the op contract says, on both backends."""

import pytest
import torch

from fastrlhf import ops

B, T, V = 3, 7, 11


def _lp():
    return torch.randn(B, T)


def _mask():
    return torch.rand(B, T) > 0.3


# ---------------------------------------------------------------- backends


def test_triton_backend_on_cpu_tensors_without_the_interpreter(monkeypatch):
    """FASTRLHF_BACKEND=triton with CPU tensors needs the interpreter: a clear error, not Triton's
    "Pointer argument cannot be accessed from Triton (cpu tensor?)"."""
    monkeypatch.setenv("FASTRLHF_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="FASTRLHF_BACKEND=triton needs CUDA tensors, or TRITON_INTERPRET=1"):
        ops.token_kl(torch.zeros(3, device="cpu"), torch.zeros(3, device="cpu"), estimator="k3")


# ---------------------------------------------------------------- log-probs


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_logits_rejected(dtype):
    with pytest.raises(TypeError, match="logits"):
        ops.logprobs(torch.zeros(B, T, V, dtype=dtype), torch.zeros(B, T, dtype=torch.long))


def test_float_labels_rejected():
    with pytest.raises(TypeError, match="labels"):
        ops.logprobs(torch.randn(B, T, V), torch.zeros(B, T))


def test_label_shape_mismatch():
    with pytest.raises(ValueError, match="labels must have shape"):
        ops.logprobs(torch.randn(B, T, V), torch.zeros(B, T + 1, dtype=torch.long))


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_non_positive_temperature(temperature):
    with pytest.raises(ValueError, match="temperature"):
        ops.logprobs(torch.randn(B, T, V), torch.zeros(B, T, dtype=torch.long), temperature=temperature)


def test_nan_temperature():
    with pytest.raises(TypeError, match="temperature"):
        ops.logprobs(torch.randn(B, T, V), torch.zeros(B, T, dtype=torch.long), temperature=float("nan"))


def test_out_of_range_labels_give_nan(backend):
    logits = torch.randn(B, T, V)
    labels = torch.randint(0, V, (B, T))
    labels[0, 0], labels[1, 2], labels[2, 3] = V, -5, 10**9
    logp = ops.logprobs(logits, labels)
    bad = torch.zeros(B, T, dtype=torch.bool)
    bad[0, 0] = bad[1, 2] = bad[2, 3] = True
    assert torch.isnan(logp[bad]).all(), "a label outside [0, V) must give NaN"
    assert torch.isfinite(logp[~bad]).all()


def test_empty_batch_logprobs(backend):
    logp, ent = ops.logprobs(torch.randn(0, T, V), torch.zeros(0, T, dtype=torch.long), return_entropy=True)
    assert logp.shape == (0, T) and ent.shape == (0, T) and logp.dtype == torch.float32


# ---------------------------------------------------------------- KL


def test_unknown_estimator():
    with pytest.raises(ValueError, match="estimator"):
        ops.token_kl(_lp(), _lp(), estimator="k4")


def test_kl_shape_mismatch():
    with pytest.raises(ValueError, match="ref_logp"):
        ops.token_kl(_lp(), torch.randn(B, T + 1))


def test_kl_integer_input():
    with pytest.raises(TypeError, match="ref_logp"):
        ops.token_kl(_lp(), torch.zeros(B, T, dtype=torch.long))


def test_kl_negative_clamp():
    with pytest.raises(ValueError, match="clamp"):
        ops.token_kl(_lp(), _lp(), clamp=-1.0)


def test_kl_shaped_rewards_scores_shape():
    with pytest.raises(ValueError, match="scores"):
        ops.kl_shaped_rewards(torch.randn(B + 1), _lp(), _lp(), _mask(), kl_coef=0.1)


def test_kl_shaped_rewards_mask_shape():
    with pytest.raises(ValueError, match="mask"):
        ops.kl_shaped_rewards(torch.randn(B), _lp(), _lp(), torch.ones(B, T - 1), kl_coef=0.1)


# ---------------------------------------------------------------- GAE / whitening


def test_unknown_mask_mode():
    with pytest.raises(ValueError, match="mask_mode"):
        ops.gae(_lp(), _lp(), _mask(), mask_mode="drop")


def test_gae_shape_mismatch():
    with pytest.raises(ValueError, match="values"):
        ops.gae(_lp(), torch.randn(B, T + 2), _mask())
    with pytest.raises(ValueError, match="mask"):
        ops.gae(_lp(), _lp(), torch.ones(B + 1, T))


def test_gae_negative_gamma():
    with pytest.raises(ValueError, match="gamma"):
        ops.gae(_lp(), _lp(), _mask(), gamma=-0.1)


def test_all_masked_gae_is_finite(backend):
    adv, ret = ops.gae(_lp(), _lp(), torch.zeros(B, T, dtype=torch.bool))
    assert torch.equal(adv, torch.zeros(B, T)) and torch.equal(ret, torch.zeros(B, T))


def test_empty_gae(backend):
    adv, ret = ops.gae(torch.randn(0, T), torch.randn(0, T), torch.ones(0, T))
    assert adv.shape == (0, T) and ret.shape == (0, T)


def test_whiten_mask_shape():
    with pytest.raises(ValueError, match="mask"):
        ops.whiten(_lp(), torch.ones(T))


# ---------------------------------------------------------------- losses


def test_unknown_agg():
    with pytest.raises(ValueError, match="agg"):
        ops.policy_loss(_lp(), _lp(), _lp(), _mask(), agg="mean")
    with pytest.raises(ValueError, match="agg"):
        ops.value_loss(_lp(), _lp(), _lp(), _mask(), agg="sum")


@pytest.mark.parametrize("kw", [{"clip_low": -0.1}, {"clip_high": -0.2}])
def test_negative_clip_ranges(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        ops.policy_loss(_lp(), _lp(), _lp(), _mask(), **kw)


def test_negative_value_clip():
    with pytest.raises(ValueError, match="clip"):
        ops.value_loss(_lp(), _lp(), _lp(), _mask(), clip=-0.2)


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip"):
        ops.policy_loss(_lp(), _lp(), _lp(), _mask(), dual_clip=0.9)


def test_loss_shape_mismatch():
    with pytest.raises(ValueError, match="advantages"):
        ops.policy_loss(_lp(), _lp(), torch.randn(B, T + 1), _mask())
    with pytest.raises(ValueError, match="returns"):
        ops.value_loss(_lp(), _lp(), torch.randn(B + 1, T), _mask())
    with pytest.raises(ValueError, match="mask"):
        ops.policy_loss(_lp(), _lp(), _lp(), torch.ones(B, T + 1))


def test_global_num_tokens_only_with_token_mean():
    with pytest.raises(ValueError, match="global_num_tokens"):
        ops.policy_loss(_lp(), _lp(), _lp(), _mask(), agg="seq-mean-token-sum", global_num_tokens=10)


def test_actor_loss_old_logp_shape():
    with pytest.raises(ValueError, match="old_logp"):
        ops.ppo_actor_loss(torch.randn(B, T, V), torch.zeros(B, T, dtype=torch.long), torch.randn(B, T - 1),
                           _lp(), _mask())


def test_unknown_backend(monkeypatch):
    monkeypatch.setenv("FASTRLHF_BACKEND", "cuda-please")
    with pytest.raises(ValueError, match="FASTRLHF_BACKEND"):
        ops.token_kl(_lp(), _lp(), estimator="k3")


@pytest.mark.parametrize("agg", ops.AGG_MODES)
def test_all_masked_losses_are_finite(backend, agg):
    mask = torch.zeros(B, T)
    logp = _lp().requires_grad_()
    values = _lp().requires_grad_()
    pl, pstats = ops.policy_loss(logp, _lp(), _lp(), mask, agg=agg, dual_clip=3.0)
    vl, vstats = ops.value_loss(values, _lp(), _lp(), mask, agg=agg)
    (pl + vl).backward()
    for x in (pl, vl, *pstats.values(), *vstats.values(), logp.grad, values.grad):
        assert torch.isfinite(x).all()
    assert pl.item() == 0.0 and vl.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros(B, T))


def test_empty_losses(backend):
    loss, stats = ops.policy_loss(torch.randn(0, T), torch.randn(0, T), torch.randn(0, T), torch.ones(0, T))
    assert loss.item() == 0.0 and all(torch.isfinite(v) for v in stats.values())


# ---------------------------------------------------------------- review regressions


@pytest.mark.parametrize("agg", ops.AGG_MODES)
@pytest.mark.parametrize("shape", [(0, T), (B, 0)])
def test_empty_losses_every_agg(backend, agg, shape):
    x = lambda: torch.randn(shape)  # noqa: E731
    pl, pstats = ops.policy_loss(x(), x(), x(), torch.ones(shape), agg=agg)
    vl, vstats = ops.value_loss(x(), x(), x(), torch.ones(shape), agg=agg)
    assert pl.item() == 0.0 and vl.item() == 0.0
    assert all(torch.isfinite(v) for v in (*pstats.values(), *vstats.values()))


def test_mask_and_scores_on_another_device():
    meta_mask = torch.ones(B, T, device="meta")
    for call in (lambda: ops.policy_loss(_lp(), _lp(), _lp(), meta_mask),
                 lambda: ops.value_loss(_lp(), _lp(), _lp(), meta_mask),
                 lambda: ops.gae(_lp(), _lp(), meta_mask),
                 lambda: ops.whiten(_lp(), meta_mask),
                 lambda: ops.kl_shaped_rewards(torch.randn(B), _lp(), _lp(), meta_mask, kl_coef=0.1)):
        with pytest.raises(ValueError, match="mask is on meta"):
            call()
    with pytest.raises(ValueError, match="scores is on meta"):
        ops.kl_shaped_rewards(torch.randn(B, device="meta"), _lp(), _lp(), _mask(), kl_coef=0.1)


@pytest.mark.parametrize("label_dtype", [torch.int32, torch.int16, torch.uint8])
def test_any_integer_label_dtype(backend, label_dtype):
    logits = torch.randn(B, T, V)
    labels = torch.randint(0, V, (B, T))
    want = ops.logprobs(logits, labels)
    got = ops.logprobs(logits, labels.to(label_dtype))
    assert torch.equal(got, want)


def test_gae_and_whiten_masks_select_tokens(backend):
    """Any non-zero mask entry counts as 1, on both backends (a 0.5 mask is not a weight)."""
    rewards, values, mask = _lp(), _lp(), _mask()
    half = mask.float() * 0.5
    for a, b in zip(ops.gae(rewards, values, half), ops.gae(rewards, values, mask)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for mode in ("skip", "zero"):
        for a, b in zip(ops.gae(rewards, values, half, mask_mode=mode, whiten=False),
                        ops.gae(rewards, values, mask, mask_mode=mode, whiten=False)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(ops.whiten(rewards, half), ops.whiten(rewards, mask), rtol=0, atol=0)


def test_fractional_loss_mask_weights_tokens(backend):
    """Loss masks may weight tokens: the aggregation divides by the real (fractional) count."""
    from fastrlhf import reference as ref

    logp, old, adv = (torch.randn(2, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.full((2, 4), 0.1, dtype=torch.float64)
    loss, stats = ops.policy_loss(logp.float(), old.float(), adv.float(), mask.float())
    want, want_stats = ref.policy_loss(logp, old, adv, mask)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["clipfrac"].double(), want_stats["clipfrac"], rtol=1e-5, atol=1e-6)


def test_minus_inf_logits(backend):
    """A masked vocabulary (-inf logits) has a finite entropy and finite gradients: 0 log 0 = 0."""
    from fastrlhf import reference as ref

    logits = torch.randn(B, T, V, dtype=torch.float64)
    logits[..., 5:] = float("-inf")
    labels = torch.randint(0, 5, (B, T))
    x = logits.float().requires_grad_()
    logp, ent = ops.logprobs(x, labels, return_entropy=True)
    g1, g2 = torch.randn(B, T), torch.randn(B, T)
    (logp * g1 + ent * g2).sum().backward()
    want_lp, want_ent = ref.logprobs(logits, labels, return_entropy=True)
    assert torch.isfinite(want_ent).all() and torch.isfinite(x.grad).all()
    torch.testing.assert_close(ent.double(), want_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logp.double(), want_lp, rtol=1e-5, atol=1e-5)
    assert (x.grad[..., 5:] == 0).all()


def test_loss_constants_get_no_gradient(backend):
    """old_logp / advantages / old_values / returns are constants on both backends."""
    logp, old, adv = (torch.randn(B, T, requires_grad=True) for _ in range(3))
    values, old_v, ret = (torch.randn(B, T, requires_grad=True) for _ in range(3))
    pl, _ = ops.policy_loss(logp, old, adv, _mask())
    vl, _ = ops.value_loss(values, old_v, ret, _mask())
    (pl + vl).backward()
    assert logp.grad is not None and values.grad is not None
    assert old.grad is None and adv.grad is None and old_v.grad is None and ret.grad is None


# ---------------------------------------------------------------- issue 9's keywords


@pytest.mark.parametrize("kw,message", [
    (dict(dp_size=0), "dp_size must be a positive int"),
    (dict(dp_size=1.5), "dp_size must be a positive int"),
    (dict(dp_size=True), "dp_size must be a positive int"),
    (dict(dp_size=2), "needs global_num_tokens"),
    (dict(agg="seq-mean-token-mean", dp_size=2), "needs global_num_seqs"),
    (dict(global_num_seqs=4), "global_num_seqs applies to the seq-mean"),
    (dict(agg="token-sum", global_num_tokens=4), "global_num_tokens applies to agg='token-mean' only"),
    (dict(agg="seq-mean-token-sum", loss_scale_factor=8), "loss_scale_factor applies to"),
    (dict(agg="seq-mean-token-sum", global_num_seqs=0), "global_num_seqs must be > 0"),
    (dict(agg="seq-mean-token-sum-norm", loss_scale_factor=-1.0), "loss_scale_factor must be > 0"),
])
def test_bad_aggregation_keywords(kw, message):
    for call in (lambda: ops.policy_loss(_lp(), _lp(), _lp(), _mask(), **kw),
                 lambda: ops.value_loss(_lp(), _lp(), _lp(), _mask(), **kw),
                 lambda: ops.agg_loss(_lp(), _mask(), **kw),
                 lambda: ops.ppo_actor_loss(torch.randn(B, T, V), torch.zeros(B, T, dtype=torch.long), _lp(), _lp(),
                                            _mask(), **kw)):
        with pytest.raises(ValueError, match=message):
            call()


def test_agg_loss_bad_inputs():
    with pytest.raises(ValueError, match="mask must have the shape of loss_mat"):
        ops.agg_loss(_lp(), torch.ones(B, T + 1))
    with pytest.raises(ValueError, match="agg must be one of"):
        ops.agg_loss(_lp(), _mask(), agg="mean")
    with pytest.raises(TypeError, match="loss_mat must be a floating-point"):
        ops.agg_loss(torch.ones(B, T, dtype=torch.long), _mask())


def test_straight_through_kl_bad_inputs():
    with pytest.raises(ValueError, match="grad_weight applies to straight_through=True only"):
        ops.token_kl(_lp(), _lp(), grad_weight=torch.ones(B, T))
    with pytest.raises(ValueError, match="grad_weight must have the shape of logp"):
        ops.token_kl(_lp(), _lp(), straight_through=True, grad_weight=torch.ones(B, T + 1))
    with pytest.raises(TypeError, match="grad_weight must be a floating-point"):
        ops.token_kl(_lp(), _lp(), straight_through=True, grad_weight=torch.ones(B, T, dtype=torch.long))


def test_is_weights_bad_inputs():
    with pytest.raises(ValueError, match="is_weights must have the shape of logp"):
        ops.policy_loss(_lp(), _lp(), _lp(), _mask(), is_weights=torch.ones(B, T - 1))
    with pytest.raises(TypeError, match="is_weights must be a floating-point"):
        ops.policy_loss(_lp(), _lp(), _lp(), _mask(), is_weights=torch.ones(B, T, dtype=torch.bool))
    with pytest.raises(ValueError, match="is_weights must have shape"):
        ops.ppo_actor_loss(torch.randn(B, T, V), torch.zeros(B, T, dtype=torch.long), _lp(), _lp(), _mask(),
                           is_weights=torch.ones(B))
    with pytest.raises(ValueError, match="kl_clamp must be > 0"):
        ops.ppo_actor_loss(torch.randn(B, T, V), torch.zeros(B, T, dtype=torch.long), _lp(), _lp(), _mask(),
                           kl_clamp=0.0)


def test_topk_labels_bad_shapes():
    logits = torch.randn(B, T, V)
    for labels in (torch.zeros(B, T, 0, dtype=torch.long), torch.zeros(B, T + 1, 3, dtype=torch.long),
                   torch.zeros(B, T, 2, 2, dtype=torch.long), torch.zeros(B, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"labels must have shape logits.shape\[:-1\]"):
            ops.logprobs(logits, labels)


def test_entropy_bad_inputs():
    with pytest.raises(TypeError, match="logits"):
        ops.entropy(torch.zeros(B, T, V, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        ops.entropy(torch.randn(B, T, V), temperature=0.0)
    with pytest.raises(ValueError, match="logits must be"):
        ops.entropy(torch.randn(B, T, 0))


def test_empty_entropy_and_topk(backend):
    assert ops.entropy(torch.randn(0, T, V)).shape == (0, T)
    logp, ent = ops.logprobs(torch.randn(0, T, V), torch.zeros(0, T, 3, dtype=torch.long), return_entropy=True)
    assert logp.shape == (0, T, 3) and ent.shape == (0, T)


@pytest.mark.parametrize("shape", [(0, T), (B, 0)])
def test_empty_actor_loss(backend, shape):
    """An empty batch gives loss 0 and a zero-size gradient on both paths (the torch path once
    reshaped [0] labels to [0, -1])."""
    x = torch.randn(*shape, V, requires_grad=True)
    z = torch.zeros(shape)
    loss, stats = ops.ppo_actor_loss(x, torch.zeros(shape, dtype=torch.long), z, z, z.bool())
    loss.backward()
    assert loss.item() == 0.0 and x.grad.shape == x.shape
    assert all(torch.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("name", ["old_logp", "advantages"])
def test_actor_loss_requires_old_logp_and_advantages(name):
    kw = {"old_logp": _lp(), "advantages": _lp(), "mask": _mask(), name: None}
    labels = torch.zeros(B, T, dtype=torch.long)
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got NoneType"):
        ops.ppo_actor_loss(torch.randn(B, T, V), labels, **kw)
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got NoneType"):
        ops.linear_ppo_actor_loss(torch.randn(B, T, 4), torch.randn(V, 4), labels, **kw)


def test_kl_coef_without_ref_logp():
    """A KL coefficient with no reference log-probs is an error, not a run without the KL term."""
    with pytest.raises(ValueError, match="kl_coef is 0.1 but ref_logp is None"):
        ops.ppo_actor_loss(torch.randn(B, T, V), torch.zeros(B, T, dtype=torch.long), _lp(), _lp(), _mask(),
                           kl_coef=0.1)


def test_zero_dim_per_token_tensors():
    scalar = torch.tensor(0.5)
    for name, call in (("loss_mat", lambda: ops.agg_loss(scalar, torch.tensor(True))),
                       ("logp", lambda: ops.policy_loss(scalar, scalar, scalar, torch.tensor(True))),
                       ("values", lambda: ops.value_loss(scalar, scalar, scalar, torch.tensor(True))),
                       ("x", lambda: ops.whiten(scalar, torch.tensor(True)))):
        with pytest.raises(ValueError, match=f"{name} must be a per-token tensor"):
            call()


@pytest.mark.parametrize("value", ["a", -100.5, True])
def test_ignore_index_must_be_an_integer(value):
    labels = torch.zeros(B, T, dtype=torch.long)
    with pytest.raises(TypeError, match="ignore_index must be an integer"):
        ops.logprobs(torch.randn(B, T, V), labels, ignore_index=value)
    with pytest.raises(TypeError, match="ignore_index must be an integer"):
        ops.linear_logprobs(torch.randn(B, T, 4), torch.randn(V, 4), labels, ignore_index=value)
