"""Outcome advantages (GRPO, Dr. GRPO, RLOO, REINFORCE++): hand-worked cases of the float64
reference and its conventions (groups, singletons, whitening); the op against the reference
(dtypes, every option), finiteness at the edges, the registry, bad input. opcheck and
torch.compile: tests/ops/test_custom_ops.py; the peers' own functions:
tests/integrations/test_algos_peers.py."""

import math

import pytest
import torch
from helpers import assert_close_to_ref

from fastrlhf import ops
from fastrlhf import reference as ref

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


# ---------------------------------------------------------------- the op against the reference


OPTIONS = [
    dict(estimator="grpo"),
    dict(estimator="grpo", scale="batch", eps=1e-4, singleton="zero"),
    dict(estimator="dr_grpo"),
    dict(estimator="rloo", singleton="zero", whiten="sequences", eps=1e-4),
    dict(estimator="rloo"),
    dict(estimator="reinforce_pp"),
    dict(estimator="reinforce_pp_baseline", unbiased=False, var_eps_mode="clamp"),
    dict(estimator="grpo", whiten="tokens"),
]


def op_inputs(dtype, B=12, T=37):
    """Scores with a group of equal values, a singleton group (ids), mask with padding on both
    sides, a gap and an empty row."""
    scores = torch.randn(B) * 2 + 0.5
    scores[:3] = 0.25
    ids = torch.tensor([5, 5, 5, 9, 2, 9, 2, 2, 9, 7, 2, 9])  # groups of 3, 4, 4 and a singleton (7)
    mask = torch.rand(B, T) > 0.2
    mask[0, :5] = False
    mask[1, -7:] = False
    mask[4] = False
    return scores.to(dtype), ids, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_op_matches_reference(dtype, options):
    scores, ids, mask = op_inputs(dtype)
    got = ops.outcome_advantages(scores, mask, group_ids=ids, **options)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want = ref.outcome_advantages(scores.double(), mask, group_ids=ids, **options)
    same = ref.outcome_advantages(scores.float() if dtype == torch.bfloat16 else scores, mask, group_ids=ids,
                                  **options)
    assert_close_to_ref(got, want, same, atol=1e-6 if dtype != torch.float64 else 1e-12)
    assert (got[~mask] == 0).all()


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_op_group_size_equals_group_ids(estimator):
    scores, mask = torch.randn(8), torch.rand(8, 5) > 0.3
    by_size = ops.outcome_advantages(scores, mask, group_size=4, estimator=estimator)
    by_ids = ops.outcome_advantages(scores, mask, group_ids=torch.tensor([3, 3, 3, 3, 1, 1, 1, 1]),
                                    estimator=estimator)
    torch.testing.assert_close(by_size, by_ids, rtol=0, atol=0)


@pytest.mark.parametrize("estimator", ref.ADVANTAGE_ESTIMATORS)
@pytest.mark.parametrize("singleton", ref.SINGLETON_MODES)
def test_op_finite_for_singletons_and_equal_scores(estimator, singleton):
    mask = torch.rand(4, 6) > 0.3
    for scores, G in ((torch.full((4,), 0.3), 2), (torch.full((4,), 0.3), 1), (torch.randn(4), 1),
                      (torch.randn(1), 1)):
        m = mask[: len(scores)]
        adv = ops.outcome_advantages(scores, m, group_size=G, estimator=estimator, singleton=singleton)
        assert torch.isfinite(adv).all() and (adv[~m] == 0).all()


def test_op_empty_batch_and_empty_mask():
    adv = ops.outcome_advantages(torch.zeros(0), torch.zeros(0, 4, dtype=torch.bool), group_size=2)
    assert adv.shape == (0, 4) and adv.dtype == torch.float32
    adv = ops.outcome_advantages(torch.randn(4), torch.zeros(4, 3), group_size=2, estimator="reinforce_pp_baseline")
    assert (adv == 0).all()


def test_op_float_mask_selects_and_does_not_weight():
    scores, mask = torch.randn(4), torch.rand(4, 6) > 0.3
    a = ops.outcome_advantages(scores, mask, group_size=2, estimator="reinforce_pp_baseline")
    b = ops.outcome_advantages(scores, mask.float() * 0.5, group_size=2, estimator="reinforce_pp_baseline")
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_op_takes_no_gradient():
    scores = torch.randn(4, requires_grad=True)
    adv = ops.outcome_advantages(scores, torch.ones(4, 2), group_size=2)
    assert not adv.requires_grad


# ---------------------------------------------------------------- the registry


def test_registry_holds_the_estimators_and_rejects_duplicates():
    assert set(ref.ADVANTAGE_ESTIMATORS) <= set(ops.ADVANTAGES)
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        ops.register_advantage("grpo")(lambda scores, groups, **kw: scores)
    ops.register_advantage("grpo")(ops.ADVANTAGES["grpo"])  # the same function again is fine


def test_registry_takes_a_new_estimator():
    from fastrlhf.ops import advantages as module

    @ops.register_advantage("test_half_baseline")
    def half_baseline(scores, groups, *, eps, scale, unbiased, singleton):
        return scores - 0.5 * groups.mean(scores)

    try:
        adv = ops.outcome_advantages(torch.tensor([1.0, 3.0, 2.0, 0.0]), torch.ones(4, 2), group_size=2,
                                     estimator="test_half_baseline")
        assert per_sequence(adv, torch.ones(4, 2)) == [0.0, 2.0, 1.5, -0.5]
    finally:
        for table in (module.ADVANTAGES, module.DEFAULT_WHITEN, module.GROUPED):
            table.pop("test_half_baseline")


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(group_size=5), ValueError, r"group_size \(5\) must divide the batch size B = 6"),
    (dict(group_size=0), ValueError, "group_size must be a positive int"),
    (dict(group_size=2.0), ValueError, "group_size must be a positive int"),
    (dict(group_size=2, group_ids=torch.zeros(6, dtype=torch.long)), ValueError, "not both"),
    (dict(group_ids=torch.zeros(6)), TypeError, "group_ids must be an integer tensor"),
    (dict(group_ids=torch.zeros(5, dtype=torch.long)), ValueError, r"group_ids must have shape \[B\]"),
    (dict(), ValueError, "pass group_ids"),
    (dict(group_size=2, estimator="ppo"), ValueError, "estimator must be one of"),
    (dict(group_size=2, eps=0.0), ValueError, "eps must be > 0"),
    (dict(group_size=2, var_eps=-1.0), ValueError, "var_eps must be > 0"),
    (dict(group_size=2, scale="none"), ValueError, "scale must be one of"),
    (dict(group_size=2, singleton="mean"), ValueError, "singleton must be one of"),
    (dict(group_size=2, whiten="batch"), ValueError, "whiten must be one of"),
    (dict(group_size=2, var_eps_mode="max"), ValueError, "var_eps_mode must be one of"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ops.outcome_advantages(torch.randn(6), torch.ones(6, 3), **kwargs)


def test_bad_tensors():
    with pytest.raises(TypeError, match="scores must be a floating-point tensor"):
        ops.outcome_advantages(torch.ones(6, dtype=torch.long), torch.ones(6, 3), group_size=2)
    with pytest.raises(ValueError, match=r"scores must be \[B\]"):
        ops.outcome_advantages(torch.randn(6, 3), torch.ones(6, 3), group_size=2)
    with pytest.raises(ValueError, match=r"mask must be \[B, T\] with B = 6"):
        ops.outcome_advantages(torch.randn(6), torch.ones(5, 3), group_size=2)


def test_reinforce_pp_needs_no_groups():
    adv = ops.outcome_advantages(torch.randn(6), torch.ones(6, 3), estimator="reinforce_pp")
    assert adv.shape == (6, 3)
