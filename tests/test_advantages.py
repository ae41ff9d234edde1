"""Outcome advantages (GRPO, Dr. GRPO, RLOO, REINFORCE++): hand-worked cases of the float64
reference, its conventions (groups, singletons, whitening), and finiteness at the edges.
The peers' own functions are compared in tests/integrations/test_algos_peers.py."""

import math

import pytest
import torch

from fastrlhf import reference_algos as ref

B, T = 6, 5


def full_mask(B, T):
    return torch.ones(B, T, dtype=torch.bool)


def per_sequence(adv, mask):
    """The advantage of each sequence (its value on any mask=1 token), checking it is constant
    over the sequence's tokens and 0 off the mask."""
    m = mask != 0
    assert (adv[~m] == 0).all(), "advantages must be 0 where mask = 0"
    out = []
    for b in range(adv.shape[0]):
        row = adv[b][m[b]]
        if row.numel():
            assert torch.equal(row, row[:1].expand_as(row)), f"row {b} is not constant over its tokens"
        out.append(row[0].item() if row.numel() else 0.0)
    return out


# ---------------------------------------------------------------- hand-worked cases

# one group of three scores [0, 1, 5]: mean 2, deviations [-2, -1, 3], unbiased var (4 + 1 + 9) / 2 = 7
SCORES = [0.0, 1.0, 5.0]
HAND = {
    "grpo": [d / (math.sqrt(7) + 1e-6) for d in (-2, -1, 3)],
    "dr_grpo": [-2.0, -1.0, 3.0],
    "rloo": [0 - 3.0, 1 - 2.5, 5 - 0.5],  # r minus the mean of the other two = 1.5 x deviation
}


@pytest.mark.parametrize("estimator", sorted(HAND))
def test_hand_worked_group_of_three(estimator):
    scores = torch.tensor(SCORES, dtype=torch.float64)
    adv = ref.outcome_advantages(scores, full_mask(3, 2), group_size=3, estimator=estimator)
    assert per_sequence(adv, full_mask(3, 2)) == pytest.approx(HAND[estimator], abs=1e-12)


def test_hand_worked_reinforce_pp():
    # 3 sequences x 2 tokens each carry [0, 1, 5]: token mean 2, unbiased token variance
    # 2 x 14 / (6 - 1) = 5.6, so a = deviation / sqrt(5.6 + 1e-8)
    scores = torch.tensor(SCORES, dtype=torch.float64)
    adv = ref.outcome_advantages(scores, full_mask(3, 2), estimator="reinforce_pp")
    want = [d / math.sqrt(5.6 + 1e-8) for d in (-2, -1, 3)]
    assert per_sequence(adv, full_mask(3, 2)) == pytest.approx(want, abs=1e-12)


def test_reinforce_pp_whitening_is_token_weighted():
    # sequence 0 has 3 tokens, sequence 1 has 1: the token mean is (3 x 0 + 1 x 4) / 4 = 1,
    # the unbiased token variance (3 x 1 + 9) / 3 = 4: a = [(0 - 1) / 2, (4 - 1) / 2]
    scores = torch.tensor([0.0, 4.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float64)
    adv = ref.outcome_advantages(scores, mask, estimator="reinforce_pp")
    assert per_sequence(adv, mask) == pytest.approx([-1 / math.sqrt(4 + 1e-8), 3 / math.sqrt(4 + 1e-8)], abs=1e-12)


def test_reinforce_pp_baseline_subtracts_group_mean_before_whitening():
    # groups (1, 3) and (10, 14): after the group mean [-1, 1, -2, 2], token mean 0,
    # unbiased token variance over 4 tokens (1 + 1 + 4 + 4) / 3
    scores = torch.tensor([1.0, 3.0, 10.0, 14.0], dtype=torch.float64)
    adv = ref.outcome_advantages(scores, full_mask(4, 1), group_size=2, estimator="reinforce_pp_baseline")
    s = math.sqrt(10 / 3 + 1e-8)
    assert per_sequence(adv, full_mask(4, 1)) == pytest.approx([-1 / s, 1 / s, -2 / s, 2 / s], abs=1e-12)


def test_openrlhf_whitening_biased_with_variance_floor():
    # biased variance of [-2, -1, 3] over 3 tokens: 14 / 3; clamp(var, 1e-8) leaves it
    scores = torch.tensor(SCORES, dtype=torch.float64)
    adv = ref.outcome_advantages(scores, full_mask(3, 1), group_size=3, estimator="reinforce_pp_baseline",
                                 unbiased=False, var_eps_mode="clamp")
    assert per_sequence(adv, full_mask(3, 1)) == pytest.approx([d / math.sqrt(14 / 3) for d in (-2, -1, 3)],
                                                               abs=1e-12)
    # a constant batch: the floor keeps the scale finite and the advantages are 0
    adv = ref.outcome_advantages(torch.ones(3, dtype=torch.float64), full_mask(3, 1), estimator="reinforce_pp",
                                 unbiased=False, var_eps_mode="clamp")
    assert (adv == 0).all()


def test_grpo_batch_scale_uses_group_mean_and_batch_std():
    # TRL scale_rewards="batch": group means 1.5 and 4.5, std over all four scores (unbiased)
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    adv = ref.outcome_advantages(scores, full_mask(4, 1), group_size=2, estimator="grpo", scale="batch", eps=1e-4)
    s = scores.std().item()
    want = [(1 - 1.5) / (s + 1e-4), (2 - 1.5) / (s + 1e-4), (3 - 4.5) / (s + 1e-4), (6 - 4.5) / (s + 1e-4)]
    assert per_sequence(adv, full_mask(4, 1)) == pytest.approx(want, abs=1e-12)


def test_rloo_sequence_whitening():
    # TRL RLOO normalize_advantages: over the sequences, unbiased std + eps
    scores = torch.tensor([0.0, 1.0, 5.0, 2.0], dtype=torch.float64)
    adv = ref.outcome_advantages(scores, full_mask(4, 2), group_size=2, estimator="rloo", whiten="sequences",
                                 eps=1e-4)
    raw = torch.tensor([-1.0, 1.0, 3.0, -3.0], dtype=torch.float64)  # r - the other one
    want = ((raw - raw.mean()) / (raw.std() + 1e-4)).tolist()
    assert per_sequence(adv, full_mask(4, 2)) == pytest.approx(want, abs=1e-12)


# ---------------------------------------------------------------- conventions


def test_group_ids_any_order_equal_contiguous_groups():
    """verl's index (ids in any order) gives the advantages of the same groups laid out in blocks."""
    scores = torch.randn(B, dtype=torch.float64)
    mask = torch.rand(B, T) > 0.3
    blocks = ref.outcome_advantages(scores, mask, group_size=3)
    perm = torch.randperm(B)
    ids = torch.tensor([7, 7, 7, -2, -2, -2])[perm]  # arbitrary ids, shuffled
    shuffled = ref.outcome_advantages(scores[perm], mask[perm], group_ids=ids)
    torch.testing.assert_close(shuffled, blocks[perm], rtol=0, atol=1e-14)  # summation order only


def test_group_ids_of_uneven_sizes():
    scores = torch.tensor([3.0, 1.0, 4.0, 1.0, 5.0], dtype=torch.float64)
    ids = torch.tensor([0, 1, 0, 1, 1])
    adv = ref.outcome_advantages(scores, full_mask(5, 1), group_ids=ids, estimator="dr_grpo")
    # group 0 = {3, 4}: mean 3.5; group 1 = {1, 1, 5}: mean 7/3
    want = [3 - 3.5, 1 - 7 / 3, 4 - 3.5, 1 - 7 / 3, 5 - 7 / 3]
    assert per_sequence(adv, full_mask(5, 1)) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_singleton_score_is_verl(estimator):
    """verl's loop versions: a group of one has baseline 0 and std 1."""
    scores = torch.tensor([2.5, -1.0], dtype=torch.float64)
    adv = ref.outcome_advantages(scores, full_mask(2, 3), group_size=1, estimator=estimator)
    want = [2.5 / (1 + 1e-6), -1.0 / (1 + 1e-6)] if estimator == "grpo" else [2.5, -1.0]
    assert per_sequence(adv, full_mask(2, 3)) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_singleton_zero_is_trl(estimator):
    scores = torch.tensor([2.5, -1.0], dtype=torch.float64)
    adv = ref.outcome_advantages(scores, full_mask(2, 3), group_size=1, estimator=estimator, singleton="zero")
    assert (adv == 0).all()


@pytest.mark.parametrize("estimator", ref.ADVANTAGE_ESTIMATORS)
@pytest.mark.parametrize("singleton", ref.SINGLETON_MODES)
def test_equal_scores_and_singletons_are_finite(estimator, singleton):
    mask = torch.rand(B, T) > 0.3
    mask[2] = False  # a sequence without tokens
    for scores, kw in ((torch.full((B,), 0.7, dtype=torch.float64), {"group_size": 2}),
                       (torch.randn(B, dtype=torch.float64), {"group_size": 1}),
                       (torch.full((B,), -3.0, dtype=torch.float64), {"group_size": 1})):
        adv = ref.outcome_advantages(scores, mask, estimator=estimator, singleton=singleton, **kw)
        assert torch.isfinite(adv).all()
        assert (adv[~mask] == 0).all()


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_equal_scores_in_a_group_give_zero(estimator):
    # 0.75 x 3 / 3 is exact; 0.7 would leave a rounding residue in the mean, as in every peer
    scores = torch.tensor([0.75, 0.75, 0.75, 0.1, 0.9, 0.2], dtype=torch.float64)
    adv = ref.outcome_advantages(scores, full_mask(6, 2), group_size=3, estimator=estimator, whiten="none")
    assert (adv[:3] == 0).all() and (adv[3:] != 0).all()
