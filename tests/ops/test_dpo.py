"""DPO losses: hand-worked cases of the float64 reference, gradients (the hinge's kink), stats;
the op and the fused path from hidden states against the reference (both backends), bad input.
opcheck, gradcheck and torch.compile: tests/ops/test_custom_ops.py; TRL's DPOTrainer and OpenRLHF's
DPOLoss: tests/integrations/test_algos_peers.py."""

import math

import pytest
import torch
from helpers import assert_close_to_ref

from fastrlhf import ops
from fastrlhf import reference as ref


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


# one pair: policy chosen -5, rejected -7, reference -6 and -6: log-ratios c = 1, r = -1, d = 2;
# beta = 0.5 gives beta d = 1
PAIR = (t(-5.0), t(-7.0), t(-6.0), t(-6.0))
SOFTPLUS_M1 = math.log1p(math.exp(-1))  # -log sigmoid(1) = 0.3132616875...
SOFTPLUS_1 = math.log1p(math.e)  # -log sigmoid(-1) = 1.3132616875...


@pytest.mark.parametrize("loss_type,label_smoothing,want", [
    ("sigmoid", 0.0, SOFTPLUS_M1),
    ("sigmoid", 0.1, 0.9 * SOFTPLUS_M1 + 0.1 * SOFTPLUS_1),  # cDPO
    ("robust", 0.1, (0.9 * SOFTPLUS_M1 - 0.1 * SOFTPLUS_1) / 0.8),
    ("hinge", 0.0, 0.0),  # max(0, 1 - 1): exactly at the kink
    ("ipo", 0.0, (2 - 1 / (2 * 0.5)) ** 2),  # (d - 1 / (2 beta))^2 = 1
])
def test_hand_worked_pair(loss_type, label_smoothing, want):
    loss, stats = ref.dpo_loss(*PAIR, beta=0.5, loss_type=loss_type, label_smoothing=label_smoothing)
    assert loss.item() == pytest.approx(want, abs=1e-15)
    assert stats["reward_chosen"].item() == 0.5 and stats["reward_rejected"].item() == -0.5
    assert stats["reward_margin"].item() == 1.0 and stats["reward_accuracy"].item() == 1.0
    assert stats["logp_chosen"].item() == -5.0 and stats["logp_rejected"].item() == -7.0


def test_ipo_length_normalised():
    # c = 1 over 4 tokens, r = -1 over 2 tokens: d = 1/4 + 1/2 = 0.75; beta 0.5: (0.75 - 1)^2
    loss, _ = ref.dpo_loss(*PAIR, beta=0.5, loss_type="ipo", chosen_lengths=t(4), rejected_lengths=t(2))
    assert loss.item() == pytest.approx(0.0625, abs=1e-15)
    # a length of 0 counts as 1 (TRL clamps)
    loss, _ = ref.dpo_loss(*PAIR, beta=0.5, loss_type="ipo", chosen_lengths=t(0), rejected_lengths=t(1))
    assert loss.item() == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "hinge", "ipo"])
def test_gradient_matches_the_formula(loss_type):
    """d loss / d logp_chosen = -d loss / d logp_rejected = -d loss / d ref_chosen, and equals
    the derivative of the per-pair loss in d, over B."""
    B, beta, e = 5, 0.3, 0.1 if loss_type == "robust" else 0.0
    c, r, rc, rr = (torch.randn(B, dtype=torch.float64) * 3 for _ in range(4))
    c.requires_grad_(), r.requires_grad_(), rc.requires_grad_()
    loss, _ = ref.dpo_loss(c, r, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=e)
    loss.backward()
    d = (c - rc - (r - rr)).detach()
    z = beta * d
    sig = torch.sigmoid
    if loss_type == "sigmoid":
        dl_dd = beta * (-(1 - e) * sig(-z) + e * sig(z))
    elif loss_type == "robust":
        dl_dd = beta * (-(1 - e) * sig(-z) - e * sig(z)) / (1 - 2 * e)
    elif loss_type == "hinge":
        dl_dd = torch.where(1 - z > 0, torch.full_like(d, -beta), torch.zeros_like(d))
    else:
        dl_dd = 2 * (d - 1 / (2 * beta))
    torch.testing.assert_close(c.grad, dl_dd / B, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(r.grad, -dl_dd / B, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(rc.grad, -dl_dd / B, rtol=1e-12, atol=1e-15)


def test_hinge_gradient_at_the_kink_is_zero():
    c = PAIR[0].clone().requires_grad_()
    loss, _ = ref.dpo_loss(c, *PAIR[1:], beta=0.5, loss_type="hinge")
    loss.backward()
    assert loss.item() == 0.0 and c.grad.item() == 0.0


def test_stats_accuracy_is_strict_and_empty_batch_is_zero():
    # pair 0: equal rewards (not counted as correct); pair 1: chosen ahead
    loss, stats = ref.dpo_loss(t(-3.0, -1.0), t(-3.0, -2.0), t(-3.0, -3.0), t(-3.0, -3.0), beta=1.0)
    assert stats["reward_accuracy"].item() == 0.5
    assert stats["reward_margin"].item() == pytest.approx((0 + 1) / 2)
    empty = torch.zeros(0, dtype=torch.float64)
    loss, stats = ref.dpo_loss(empty, empty, empty, empty)
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in stats.values())


def test_large_margins_stay_finite():
    big = t(-1e4, 1e4)
    for loss_type in ("sigmoid", "robust", "hinge", "ipo"):
        loss, stats = ref.dpo_loss(big, -big, t(0.0, 0.0), t(0.0, 0.0), beta=0.5, loss_type=loss_type,
                                   label_smoothing=0.1 if loss_type in ("sigmoid", "robust") else 0.0)
        assert math.isfinite(loss.item()), loss_type


# ---------------------------------------------------------------- the op against the reference


LOSS_CASES = [("sigmoid", 0.0), ("sigmoid", 0.2), ("robust", 0.1), ("hinge", 0.0), ("ipo", 0.0)]


def pair_inputs(B, dtype):
    """Summed log-probs of responses of ~10 tokens; the reference near the policy; some pairs
    far apart (saturated sigmoid, hinge met)."""
    c, r = -torch.rand(B) * 30, -torch.rand(B) * 30
    rc, rr = c + torch.randn(B), r + torch.randn(B)
    c[::5] += 40.0
    return tuple(x.to(dtype) for x in (c, r, rc, rr))


def run(fn, inputs, grad, **kw):
    leaves = [x.clone().requires_grad_() for x in inputs]
    loss, stats = fn(*leaves, **kw)
    loss.backward(grad.to(loss.dtype))
    return loss, stats, [x.grad for x in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss_type,label_smoothing,lengths", [(*case, False) for case in LOSS_CASES]
                         + [("ipo", 0.0, True)])
def test_op_matches_reference(dtype, loss_type, label_smoothing, lengths):
    B = 13
    inputs = pair_inputs(B, dtype)
    kw = dict(beta=0.2, loss_type=loss_type, label_smoothing=label_smoothing)
    if lengths:
        kw.update(chosen_lengths=torch.randint(0, 20, (B,)), rejected_lengths=torch.randint(1, 20, (B,)))
    grad = torch.randn(())
    loss, stats, grads = run(ops.dpo_loss, inputs, grad, **kw)
    assert loss.dtype == torch.float32 and all(g.dtype == dtype for g in grads)
    loss64, stats64, grads64 = run(ref.dpo_loss, [x.double() for x in inputs], grad, **kw)
    same = [x.float() for x in inputs] if dtype == torch.bfloat16 else inputs  # bf16 sums: the op computes in fp32
    loss_s, stats_s, grads_s = run(ref.dpo_loss, same, grad, **kw)
    assert_close_to_ref(loss, loss64, loss_s, atol=1e-6, name="loss")
    for name, g, g64, gs in zip(("d_chosen", "d_rejected", "d_ref_chosen", "d_ref_rejected"), grads, grads64,
                                grads_s):
        assert_close_in_dtype(g, g64, gs, atol=1e-6, name=name)  # gradients come back in the inputs' dtype
    for k in stats64:
        assert not stats[k].requires_grad
        assert_close_to_ref(stats[k], stats64[k], stats_s[k], atol=1e-6, name=k)


def test_op_gradient_only_where_asked_and_empty_batch():
    c, r, rc, rr = pair_inputs(4, torch.float32)
    c.requires_grad_()
    loss, _ = ops.dpo_loss(c, r, rc, rr)
    loss.backward()
    assert c.grad is not None and torch.isfinite(c.grad).all()
    empty = torch.zeros(0)
    loss, stats = ops.dpo_loss(empty, empty, empty, empty)
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in stats.values())


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(beta=0.0), ValueError, "beta must be > 0"),
    (dict(beta=-0.1), ValueError, "beta must be > 0"),
    (dict(beta=float("nan")), TypeError, "beta must be a finite real number"),
    (dict(loss_type="kto"), ValueError, "loss_type must be one of"),
    (dict(label_smoothing=0.5), ValueError, r"label_smoothing must be in \[0, 0.5\)"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing must be >= 0"),
    (dict(loss_type="hinge", label_smoothing=0.1), ValueError, "label_smoothing is used by loss_type"),
    (dict(chosen_lengths=torch.ones(3)), ValueError, "pass both chosen_lengths and rejected_lengths"),
    (dict(chosen_lengths=torch.ones(3), rejected_lengths=torch.ones(3)), ValueError, "'ipo' only"),
    (dict(loss_type="ipo", chosen_lengths=torch.ones(2), rejected_lengths=torch.ones(3)), ValueError,
     "chosen_lengths must have the shape of chosen_logp"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ops.dpo_loss(*pair_inputs(3, torch.float32), **kwargs)


def test_bad_tensors():
    c, r, rc, rr = pair_inputs(3, torch.float32)
    with pytest.raises(ValueError, match="ref_rejected_logp must have the shape of chosen_logp"):
        ops.dpo_loss(c, r, rc, rr[:2])
    with pytest.raises(TypeError, match="rejected_logp must be a floating-point tensor"):
        ops.dpo_loss(c, r.long(), rc, rr)
    with pytest.raises(ValueError, match=r"chosen_logp must be \[B\]"):
        ops.dpo_loss(c[:, None], r, rc, rr)


# ---------------------------------------------------------------- from hidden states

B2, T, H, V = 6, 9, 8, 37  # B2 = 2 x 3 pairs


def linear_inputs(dtype):
    hidden = torch.randn(B2, T, H, dtype=dtype)
    weight = (torch.randn(V, H) / H**0.5).to(dtype)
    bias = torch.randn(V, dtype=dtype)
    labels = torch.randint(0, V, (B2, T))
    mask = torch.rand(B2, T) > 0.3
    mask[1] = False  # a response without tokens
    mask[2, :4] = False  # prompt positions
    return hidden, weight, bias, labels, mask


def ref_sequence_logprobs(hidden, weight, bias, labels, mask, temperature):
    lp = ref.linear_logprobs(hidden, weight, torch.where(mask, labels, -100), bias=bias, temperature=temperature)
    return lp.sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_sequence_logprobs_matches_reference(backend, dtype):
    hidden, weight, bias, labels, mask = linear_inputs(dtype)
    grad = torch.randn(B2)

    def run_seq(fn, h, w, b, **kw):
        leaves = [x.clone().requires_grad_() for x in (h, w, b)]
        out = fn(*leaves, labels, mask, **kw)
        out.backward(grad.to(out.dtype))
        return out, [x.grad for x in leaves]

    got, grads = run_seq(lambda h, w, b, y, m: ops.linear_sequence_logprobs(h, w, y, m, bias=b, temperature=0.9,
                                                                            chunk_size=7), hidden, weight, bias)
    assert got.shape == (B2,) and got.dtype == torch.float32
    assert got[1].item() == 0.0
    want, grads64 = run_seq(lambda h, w, b, y, m: ref_sequence_logprobs(h, w, b, y, m, 0.9),
                            hidden.double(), weight.double(), bias.double())
    same, grads_s = run_seq(lambda h, w, b, y, m: ref_sequence_logprobs(h, w, b, y, m, 0.9), hidden, weight, bias)
    atol = 1e-5 if dtype == torch.float32 else 1e-3
    assert_close_to_ref(got, want, same, atol=atol, name="sums")
    for name, g, g64, gs in zip(("d_hidden", "d_weight", "d_bias"), grads, grads64, grads_s):
        assert g.dtype == dtype
        assert_close_in_dtype(g, g64, gs, atol=atol, name=name)


def assert_close_in_dtype(out, ref64, ref_same_dtype, *, atol, name):
    """assert_close_to_ref's rule with the output's own rounding counted in its dtype: a bf16
    gradient is within 2 x the same-dtype reference's error + atol + 2 bf16 epsilons x |ref64|.
    (The gradients of per-sequence sums add a row's tokens with one sign, so d_weight reaches
    |5| here, where one bf16 step is 0.03.)"""
    eps = torch.finfo(out.dtype).eps
    out, ref64, same = (x.detach().double() for x in (out, ref64, ref_same_dtype))
    base = (same - ref64).abs().max().item()
    allowed = 2 * base + atol + 2 * eps * ref64.abs()
    excess = (out - ref64).abs() - allowed
    i = int(excess.argmax())
    assert excess.flatten()[i] <= 0, (f"{name}: err {(out - ref64).abs().flatten()[i].item():.3e} > allowed "
                                      f"{allowed.flatten()[i].item():.3e} at flat index {i}")


@pytest.mark.parametrize("loss_type,ipo_per_token", [("sigmoid", False), ("ipo", True)])
def test_linear_dpo_loss_is_dpo_of_the_sums(backend, loss_type, ipo_per_token):
    hidden, weight, bias, labels, mask = linear_inputs(torch.float32)
    ref_c, ref_r = -torch.rand(B2 // 2) * 10, -torch.rand(B2 // 2) * 10
    h = hidden.clone().requires_grad_()
    loss, stats = ops.linear_dpo_loss(h, weight, labels, mask, ref_c, ref_r, bias=bias, beta=0.3,
                                      loss_type=loss_type, ipo_per_token=ipo_per_token, chunk_size=5)
    loss.backward()
    h64 = hidden.double().requires_grad_()
    sums = ref_sequence_logprobs(h64, weight.double(), bias.double(), labels, mask, 1.0)
    lengths = {}
    if ipo_per_token:
        counts = mask.sum(-1)
        lengths = dict(chosen_lengths=counts[:3], rejected_lengths=counts[3:])
    loss64, stats64 = ref.dpo_loss(sums[:3], sums[3:], ref_c.double(), ref_r.double(), beta=0.3,
                                   loss_type=loss_type, **lengths)
    loss64.backward()
    torch.testing.assert_close(loss.double(), loss64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(stats["logp_chosen"].double(), stats64["logp_chosen"], rtol=1e-5, atol=1e-5)


def test_linear_bad_input():
    hidden, weight, bias, labels, mask = linear_inputs(torch.float32)
    with pytest.raises(ValueError, match=r"hidden must be \[2B, T, H\]"):
        ops.linear_dpo_loss(hidden[:5], weight, labels[:5], mask[:5], torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match=r"labels must have shape \[B, T\]"):
        ops.linear_sequence_logprobs(hidden, weight, labels[:, :-1], mask)
    with pytest.raises(ValueError, match="ipo_per_token applies to loss_type 'ipo' only"):
        ops.linear_dpo_loss(hidden, weight, labels, mask, torch.zeros(3), torch.zeros(3), ipo_per_token=True)
