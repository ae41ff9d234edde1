"""fastrlhf.rollout_correction against reference.rollout_correction: every level, mode, gate and
rejection criterion, in float64 (to float64 precision, every metric), in fp32 / bf16 / fp16 (the
DESIGN.md rule: error <= 2 x the same-dtype reference's error + atol), masked rows, gaps, NaN sampler
log-probs, non-contiguous views; bad arguments name themselves. The peers' own functions are checked
against the reference in tests/integrations/test_policy_family_peers.py."""

import math

import pytest
import torch
from helpers import assert_close_to_ref, make_mask

import fastrlhf
from fastrlhf import reference as R
from fastrlhf.ops.correction import metric_names

B, T = 7, 13
F64 = torch.float64
REJECT = {"token_k1": (0.6, 1.5), "token_k2": 0.1, "token_k3": 0.2, "seq_sum_k1": 2.0, "seq_sum_k2": 1.0,
          "seq_sum_k3": 0.4, "seq_mean_k1": (0.8, 1.2), "seq_mean_k2": 0.03, "seq_mean_k3": 0.05, "seq_max_k2": 0.3,
          "seq_max_k3": 0.5}

SETTINGS = [
    dict(level="token", mode="truncate", high=2.0),
    dict(level="sequence", mode="truncate", high=2.0, batch_normalize=True),
    dict(level="geometric", mode="truncate", low=0.8, high=1.25),
    dict(level="token", mode="mask", low=0.5, high=2.0, batch_normalize=True),
    dict(level="sequence", mode="mask", low=0.5, high=3.0),
    dict(level="geometric", mode="mask", low=0.8, high=1.25, weight="token", log_ratio_clamp=None),
    dict(level="token", mode="mask", low=0.0, high=0.02, gate="binary_kl", log_ratio_clamp=None),
    dict(level="geometric", mode="mask", low=0.0, high=0.05, gate="tv", weight="token", log_ratio_clamp=None),
    dict(level="sequence", mode="mask", low=0.0, high=0.5, gate="binary_kl"),
    dict(level="token", mode="truncate", low=0.5, high=None, log_ratio_clamp=(-5.0, 1.0)),
    dict(level=None, reject=REJECT),
    dict(level="token", mode="truncate", high=2.0, reject={"seq_mean_k1": 1.3, "token_k3": 0.2}),
    dict(level="sequence", mode="mask", high=4.0, missing="ignore", log_ratio_clamp=None),
]


def inputs(dtype=F64):
    old = -torch.rand(B, T, dtype=F64) * 3 - 0.2
    rollout = torch.clamp(old + torch.randn(B, T, dtype=F64) * 0.3, max=-1e-3)
    rollout[4] = torch.clamp(old[4] + torch.randn(T, dtype=F64) * 1.5, max=-1e-3)  # one row far off
    return old.to(dtype), rollout.to(dtype), make_mask(B, T)


def _id(s):
    return "-".join(f"{k}={v}" for k, v in s.items() if k != "reject") + ("-reject" if "reject" in s else "")


@pytest.mark.parametrize("settings", SETTINGS, ids=_id)
def test_float64_equals_the_reference(settings):
    old, rollout, mask = inputs()
    want_w, want_keep, want = R.rollout_correction(old, rollout, mask, **settings)
    got_w, got_keep, got = fastrlhf.rollout_correction(old, rollout, mask, **settings)
    assert (got_w is None) == (want_w is None)
    if want_w is not None:
        torch.testing.assert_close(got_w, want_w, rtol=1e-13, atol=1e-14)
        assert got_w.dtype == F64
    assert torch.equal(got_keep, want_keep) and got_keep.dtype == torch.bool
    assert list(got) == list(metric_names_of(settings))
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-13, atol=1e-14, msg=lambda m, k=k: f"{k}: {m}")


def metric_names_of(settings):
    """The op's metric names for these settings, from one call (they depend on the settings only)."""
    old, rollout, mask = inputs()
    return fastrlhf.rollout_correction(old, rollout, mask, **settings)[2].keys()


@pytest.mark.parametrize("settings", SETTINGS[:6] + SETTINGS[-3:-1], ids=_id)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-3), (torch.float16, 1e-3)])
def test_low_precision_inputs_within_twice_the_reference_error(settings, dtype, atol):
    old64, rollout64, mask = inputs()
    old, rollout = old64.to(dtype), rollout64.to(dtype)
    got_w, got_keep, got = fastrlhf.rollout_correction(old, rollout, mask, **settings)
    ref64 = R.rollout_correction(old.double(), rollout.double(), mask, **settings)  # the same (rounded) inputs
    same = R.rollout_correction(old.float(), rollout.float(), mask, **settings)  # plain torch in float32
    if got_w is not None:
        assert got_w.dtype == torch.float32
        assert_close_to_ref(got_w, ref64[0], same[0], atol=atol, name="weights")
    assert torch.equal(got_keep, ref64[1])
    for k, v in ref64[2].items():
        assert_close_to_ref(got[k], v, same[2][k], atol=atol, name=k)


def test_empty_rows_gaps_and_padding_give_zero_weights_off_the_mask():
    old, rollout, mask = inputs()
    weights, keep, _ = fastrlhf.rollout_correction(old, rollout, mask, level="sequence", mode="truncate", high=2.0)
    assert bool((weights[~mask] == 0).all()) and bool((weights[mask] > 0).all())
    assert not keep[2].any() and torch.equal(keep, mask)


def test_empty_mask_gives_zeros_not_nan():
    old, rollout, _ = inputs()
    empty = torch.zeros(B, T, dtype=torch.bool)
    weights, keep, metrics = fastrlhf.rollout_correction(old, rollout, empty, level="token", mode="mask", low=0.5,
                                                         high=2.0, reject={"seq_max_k3": 0.5, "token_k1": 2.0})
    assert not weights.any() and not keep.any()
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["rollout_is_eff_sample_size"] == 0 and metrics["rollout_is_mean"] == 0


def test_non_finite_values_off_the_mask_change_nothing():
    old, rollout, mask = inputs()
    bad_old, bad_rollout = old.clone(), rollout.clone()
    bad_old[0, -1], bad_rollout[2, 3], bad_rollout[3, 1] = float("nan"), -float("inf"), float("nan")
    for settings in SETTINGS:
        a = fastrlhf.rollout_correction(old, rollout, mask, **settings)
        b = fastrlhf.rollout_correction(bad_old, bad_rollout, mask, **settings)
        if a[0] is not None:
            assert torch.equal(a[0], b[0])
        assert torch.equal(a[1], b[1])
        for k in a[2]:
            assert torch.equal(a[2][k], b[2][k]), (settings, k)


def test_missing_sampler_logprobs_count_as_no_evidence():
    """missing="ignore": a NaN sampler log-prob on the mask is a log-ratio of 0 (TRL); "propagate": NaN."""
    old, rollout, mask = inputs()
    rollout[0, 1] = float("nan")
    w, _, m = fastrlhf.rollout_correction(old, rollout, mask, level="token", high=2.0, missing="ignore")
    assert w[0, 1] == 1.0 and math.isfinite(m["rollout_is_mean"])
    w, _, _ = fastrlhf.rollout_correction(old, rollout, mask, level="token", high=2.0)
    assert math.isnan(w[0, 1])


def test_non_contiguous_views_and_integer_masks():
    old, rollout, mask = inputs(torch.float32)
    wide = torch.randn(B, 2 * T)
    wide[:, ::2] = old
    got = fastrlhf.rollout_correction(wide[:, ::2], rollout, mask.long(), level="sequence", high=2.0)
    want = fastrlhf.rollout_correction(old, rollout, mask, level="sequence", high=2.0)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert all(torch.equal(got[2][k], want[2][k]) for k in want[2])


def test_metric_names_follow_the_settings():
    old, rollout, mask = inputs()
    _, _, metrics = fastrlhf.rollout_correction(old, rollout, mask, level="token", mode="mask", high=2.0,
                                                batch_normalize=True, reject={"token_k1": 2.0, "seq_max_k2": 0.1})
    assert {"rollout_is_oob_ratio", "rollout_is_batch_norm_factor", "rollout_rs_token_k1_seq_fraction_low",
            "rollout_rs_seq_max_k2_masked_fraction", "is_filtered_fraction", "chi2_seq"} <= set(metrics)
    assert "rollout_rs_seq_max_k2_seq_fraction_low" not in metrics
    _, _, metrics = fastrlhf.rollout_correction(old, rollout, mask, level=None)
    assert not any(k.startswith(("rollout_is", "rollout_rs")) for k in metrics)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(level="row"), ValueError, "level must be one of"),
    (dict(mode="clip"), ValueError, "mode must be one of"),
    (dict(gate="kl"), ValueError, "gate must be one of"),
    (dict(weight="seq"), ValueError, "weight must be one of"),
    (dict(missing="zero"), ValueError, "missing must be one of"),
    (dict(low=2.0, high=1.0), ValueError, r"low \(2.0\) must be <= high"),
    (dict(high=None), ValueError, "needs low or high"),
    (dict(high=-1.0), ValueError, "high must be > 0"),
    (dict(gate="tv"), ValueError, "apply to mode='mask' only"),
    (dict(reject={"seq_max_k1": 2.0}), ValueError, "reject criterion must be one of"),
    (dict(reject={"token_k1": (2.0, 1.0)}), ValueError, "lower 2.0 > upper 1.0"),
    (dict(reject={"token_k2": (0.1, 0.2)}), TypeError, r"reject\['token_k2'\] must be a finite real number"),
    (dict(log_ratio_clamp="20"), ValueError, "log_ratio_clamp must be"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
    old, rollout, mask = inputs(torch.float32)
    with pytest.raises(error, match=match):
        fastrlhf.rollout_correction(old, rollout, mask, **kwargs)


def test_bad_tensors_name_themselves():
    old, rollout, mask = inputs(torch.float32)
    with pytest.raises(ValueError, match=r"old_logp must be \[B, T\]"):
        fastrlhf.rollout_correction(old[0], rollout[0], mask[0])
    with pytest.raises(ValueError, match="rollout_logp must have the shape of old_logp"):
        fastrlhf.rollout_correction(old, rollout[:, 1:], mask)
    with pytest.raises(TypeError, match="rollout_logp must be a floating-point tensor"):
        fastrlhf.rollout_correction(old, rollout.long(), mask)
    with pytest.raises(ValueError, match="mask must have the shape of old_logp"):
        fastrlhf.rollout_correction(old, rollout, mask[:, 1:])


def test_metric_names_helper_matches_the_settings_order():
    from fastrlhf.ops.correction import Correction

    c = Correction("token", "mask", 0.5, 2.0, "ratio", "level", -20.0, 20.0, False, True,
                   (("token_k1", math.log(0.5), math.log(2.0)), ("seq_max_k3", None, 0.5)))
    old, rollout, mask = inputs()
    _, _, metrics = fastrlhf.rollout_correction(old, rollout, mask, level="token", mode="mask", low=0.5, high=2.0,
                                                batch_normalize=True, reject={"token_k1": (0.5, 2.0),
                                                                              "seq_max_k3": 0.5})
    assert tuple(metrics) == metric_names(c)
