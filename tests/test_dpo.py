"""DPO losses: hand-worked cases of the float64 reference, gradients (the hinge's kink), stats.
TRL's DPOTrainer and OpenRLHF's DPOLoss are compared in tests/integrations/test_algos_peers.py."""

import math

import pytest
import torch

from fastrlhf import reference_algos as ref


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
