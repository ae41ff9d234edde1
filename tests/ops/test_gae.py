"""gae and whiten against reference.py in float64, on both backends."""

import pytest
import torch
from helpers import assert_close_to_ref, make_mask, poison_outputs

from fastrlhf import ops
from fastrlhf import reference as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATOL = 1e-5


@pytest.fixture
def poison(monkeypatch):
    poison_outputs(monkeypatch, "fastrlhf.kernels.gae", "fastrlhf.ops.gae")


def check_gae(rewards, values, mask, **kw):
    adv, ret = ops.gae(rewards, values, mask, **kw)
    assert adv.dtype == ret.dtype == torch.float32
    adv64, ret64 = ref.gae(rewards.double(), values.double(), mask, **kw)
    adv_same, ret_same = ref.gae(rewards, values, mask, **kw)
    assert_close_to_ref(adv, adv64, adv_same, atol=ATOL, name="advantages")
    assert_close_to_ref(ret, ret64, ret_same, atol=ATOL, name="returns")
    off = ~mask.bool()
    assert (adv[off] == 0).all() and (ret[off] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_mode", ["skip", "zero"])
@pytest.mark.parametrize("whiten", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_matches_reference(backend, poison, dtype, mask_mode, whiten, gamma, lam):
    B, T = 5, 37
    rewards = torch.randn(B, T).to(dtype)
    values = torch.randn(B, T).to(dtype)
    check_gae(rewards, values, make_mask(B, T), gamma=gamma, lam=lam, mask_mode=mask_mode, whiten=whiten)


@pytest.mark.parametrize("mask_mode", ["skip", "zero"])
def test_gae_long_rows(backend, poison, mask_mode):
    # T = 4099 spans five 1024-token blocks plus a 3-token one: the carries cross block edges
    B, T = 2, 4099
    mask = make_mask(B, T)
    mask[1, 1020:1030] = False  # a gap across a block edge
    rewards, values = torch.randn(B, T), torch.randn(B, T)
    check_gae(rewards, values, mask, gamma=0.999, lam=0.97, mask_mode=mask_mode, whiten=True)


def test_gae_hand_worked(backend):
    # one row, tokens 0, 1 and 3 count (token 2 is a gap), gamma = 0.5, lam = 1
    r = torch.tensor([[1.0, 0.0, 5.0, 2.0]])
    v = torch.tensor([[0.5, 1.0, 9.0, 1.0]])
    mask = torch.tensor([[1, 1, 0, 1]], dtype=torch.bool)
    # skip: A3 = 2 - 1 = 1; A1 = 0 + 0.5 * 1 - 1 + 0.5 * 1 = 0; A0 = 1 + 0.5 * 1 - 0.5 + 0.5 * 0 = 1
    adv, ret = ops.gae(r, v, mask, gamma=0.5, lam=1.0, mask_mode="skip", whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 0.0, 0.0, 1.0]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.0, 0.0, 2.0]]), rtol=0, atol=1e-7)
    # zero: r2 = v2 = 0; A3 = 1; A2 = 0 + 0.5 * 1 - 0 + 0.5 * 1 = 1; A1 = 0 + 0 - 1 + 0.5 = -0.5;
    # A0 = 1 + 0.5 * 1 - 0.5 - 0.25 = 0.75
    adv, ret = ops.gae(r, v, mask, gamma=0.5, lam=1.0, mask_mode="zero", whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.75, -0.5, 0.0, 1.0]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(ret, torch.tensor([[1.25, 0.5, 0.0, 2.0]]), rtol=0, atol=1e-7)


def test_gae_all_masked_and_empty(backend, poison):
    r, v = torch.randn(3, 37), torch.randn(3, 37)
    adv, ret = ops.gae(r, v, torch.zeros(3, 37, dtype=torch.bool), whiten=True)
    assert (adv == 0).all() and (ret == 0).all()
    adv, ret = ops.gae(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.bool))
    assert adv.shape == ret.shape == (0, 5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.int64])
def test_whiten_matches_reference(backend, poison, dtype, unbiased, shift_mean, mask_dtype):
    # a large common offset: a one-pass E[x^2] - E[x]^2 would lose the variance here
    B, T = 5, 37
    x = (torch.randn(B, T) * 0.5 + 300.0).to(dtype)
    mask = make_mask(B, T).to(mask_dtype)
    kw = dict(unbiased=unbiased, shift_mean=shift_mean)
    out = ops.whiten(x, mask, **kw)
    assert out.dtype == torch.float32
    assert_close_to_ref(
        out, ref.whiten(x.double(), mask, **kw), ref.whiten(x, mask, **kw), atol=ATOL, name="whitened"
    )
    assert (out[~mask.bool()] == 0).all()


def test_whiten_degenerate_masks(backend, poison):
    x = torch.randn(2, 9)
    assert (ops.whiten(x, torch.zeros(2, 9, dtype=torch.bool)) == 0).all()
    one = torch.zeros(2, 9, dtype=torch.bool)
    one[1, 4] = True  # n = 1: the unbiased correction is skipped, var = 0, output 0
    out = ops.whiten(x, one)
    torch.testing.assert_close(out, ref.whiten(x.double(), one).float(), rtol=0, atol=0)
    assert ops.whiten(torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool)).shape == (0, 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_with_the_summed_moments_of_the_parts_is_whitening_of_the_whole(dtype, unbiased, shift_mean):
    """Data-parallel whitening: each part (a rank's share, of different token counts) whitened with
    the sum of the parts' raw_moments equals reference.whiten of the whole batch."""
    B, T = 6, 37
    x = (torch.randn(B, T) * 0.5 + 300.0).to(dtype)
    mask = make_mask(B, T)
    parts = [slice(0, 2), slice(2, 6)]
    moments = sum(ops.raw_moments(x[p], mask[p]) for p in parts)
    assert moments.dtype == torch.float64 and moments[0].item() == mask.bool().sum().item()
    kw = dict(unbiased=unbiased, shift_mean=shift_mean)
    out = torch.cat([ops.whiten(x[p], mask[p], moments=moments, **kw) for p in parts])
    assert out.dtype == torch.float32 and (out[~mask.bool()] == 0).all()
    assert_close_to_ref(out, ref.whiten(x.double(), mask, **kw), ref.whiten(x, mask, **kw), atol=ATOL,
                        name="whitened with moments")
    # a part's own moments differ from the whole's: whitening it alone gives other numbers
    assert (ops.whiten(x[:2], mask[:2], **kw) - out[:2]).abs().max() > 0.01


def test_raw_moments_hand_worked_and_degenerate():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    # n = 4, sum = 1 + 2 + 3 + 5 = 11, sum of squares = 1 + 4 + 9 + 25 = 39; the masked nan is not read
    assert ops.raw_moments(x, mask).tolist() == [4.0, 11.0, 39.0]
    empty = ops.raw_moments(x, torch.zeros(2, 3))
    assert empty.tolist() == [0.0, 0.0, 0.0]
    assert (ops.whiten(x, torch.zeros(2, 3), moments=empty) == 0).all()  # nothing selected anywhere: 0, not nan
    with pytest.raises(ValueError, match=r"moments must be \[3\]"):
        ops.whiten(x, mask, moments=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="moments"):
        ops.whiten(x, mask, moments=torch.zeros(3, dtype=torch.long))
