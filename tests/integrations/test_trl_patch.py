"""fastrlhf.integrations.trl against the installed TRL: patched == original (forward and
gradients, both backends), TRL's conventions kept, patch()/unpatch() bookkeeping."""

import importlib.metadata

import pytest
import torch

from .peer_checks import check_inputs_the_peer_rejects, compare, unpatched

B, T, V, H = 4, 11, 37, 16


@pytest.fixture
def trl(trl_integration):
    import trl.trainer.utils as utils

    names = ("selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy",
             "_ChunkedLogProbFunction")
    originals = {n: getattr(utils, n) for n in names}
    # TRL's torch path calls selective_log_softmax and entropy_from_logits through the module
    originals["selective_log_softmax_and_entropy"] = unpatched(trl_integration,
                                                               originals["selective_log_softmax_and_entropy"])
    trl_integration.patch()
    return originals, {n: getattr(utils, n) for n in names}, utils


def test_indices_and_logits_trl_rejects_get_fastrlhfs_answers(trl, backend):
    """Documented under "Not kept" in fastrlhf.integrations.trl."""
    originals, patched, _ = trl
    check_inputs_the_peer_rejects(patched["selective_log_softmax"], originals["selective_log_softmax"],
                                  patched["entropy_from_logits"], originals["entropy_from_logits"])


@pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")
def test_patch_rebinds_every_reference_and_unpatch_restores(trl_integration):
    import trl.experimental.cpo.cpo_trainer as cpo  # imports selective_log_softmax by name
    import trl.kernels as kernels
    import trl.trainer.utils as utils

    def refs():
        return (utils.selective_log_softmax, cpo.selective_log_softmax, utils.entropy_from_logits,
                utils.selective_log_softmax_and_entropy, utils._ChunkedLogProbFunction, kernels.ChunkedLogProbFunction)

    before = refs()
    trl_integration.patch()
    trl_integration.patch()
    after = refs()
    assert all(a is not b for a, b in zip(after, before))
    assert cpo.selective_log_softmax is utils.selective_log_softmax
    trl_integration.unpatch()
    trl_integration.unpatch()
    assert all(a is b for a, b in zip(refs(), before))


def test_refuses_unsupported_version(trl_integration, monkeypatch):
    from fastrlhf.integrations import UnsupportedPeerError

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "1.11.0" if d == "trl" else real(d))
    with pytest.raises(UnsupportedPeerError, match=r"TRL >= 1\.12.*1\.11\.0"):
        trl_integration.patch()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_log_softmax(trl, backend, dtype, temperature, op_calls):
    originals, patched, _ = trl
    logits = (torch.randn(B, T, V) * 3).to(dtype)
    index = torch.randint(0, V, (B, T))
    row_mask = torch.rand(B, T) > 0.3
    compare(patched["selective_log_softmax"], originals["selective_log_softmax"], [logits, index, temperature],
            diff=(0,))
    compare(patched["selective_log_softmax"], originals["selective_log_softmax"],
            [logits, index, temperature, row_mask], diff=(0,))
    assert op_calls["logprobs"] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_log_softmax_top_k_index(trl, backend, dtype, temperature, op_calls):
    """An index of shape (..., K) (top-K log-probs): K labels per position from one read of the logits."""
    originals, patched, _ = trl
    logits = (torch.randn(B, T, V) * 3).to(dtype)
    index = torch.randint(0, V, (B, T, 3))
    index[0, 0] = torch.tensor([5, 5, 6])  # a repeated label
    row_mask = torch.rand(B, T, 3) > 0.3
    compare(patched["selective_log_softmax"], originals["selective_log_softmax"], [logits, index, temperature],
            diff=(0,))
    compare(patched["selective_log_softmax"], originals["selective_log_softmax"],
            [logits, index, temperature, row_mask], diff=(0,))
    compare(patched["selective_log_softmax"], originals["selective_log_softmax"],
            [logits.flatten(0, 1), index.flatten(0, 1)[:, :1], temperature], diff=(0,))  # K = 1 on [N, V]
    assert op_calls["logprobs"] == 3


def test_selective_log_softmax_and_entropy_top_k_index(trl, backend, op_calls):
    originals, patched, _ = trl
    logits, index = torch.randn(B, T, V) * 3, torch.randint(0, V, (B, T, 4))
    got, _ = compare(patched["selective_log_softmax_and_entropy"], originals["selective_log_softmax_and_entropy"],
                     [logits, index, True, 0.9], diff=(0,))
    assert got[0].shape == (B, T, 4) and got[1].shape == (B, T)
    assert op_calls["logprobs"] == 1


def test_bad_index_shapes_get_trls_errors(trl, op_calls):
    originals, patched, _ = trl
    logits = torch.randn(B, T, V)
    for index in (torch.randint(0, V, (B, T - 1)), torch.randint(0, V, (B, T, 2, 2)), torch.randint(0, V, (B, T, 0))):
        outcomes = []
        for fn in (originals["selective_log_softmax"], patched["selective_log_softmax"]):
            try:
                outcomes.append(("value", fn(logits, index)))
            except Exception as e:  # noqa: BLE001 - whatever TRL raises, the patched function raises the same
                outcomes.append(("error", type(e)))
        (kind_o, out_o), (kind_p, out_p) = outcomes
        assert kind_o == kind_p
        assert out_p == out_o if kind_o == "error" else torch.equal(out_p, out_o)
    assert op_calls["logprobs"] == 0


def test_temperature_error_is_trls(trl):
    originals, patched, _ = trl
    logits, index = torch.randn(2, 3, V), torch.randint(0, V, (2, 3))
    for fn in (originals["selective_log_softmax"], patched["selective_log_softmax"],
               originals["selective_log_softmax_and_entropy"], patched["selective_log_softmax_and_entropy"]):
        with pytest.raises(ValueError, match="temperature must be positive"):
            fn(logits, index, temperature=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_from_logits(trl, backend, dtype, op_calls):
    originals, patched, _ = trl
    logits = (torch.randn(B, T, V) * 3).to(dtype)
    compare(patched["entropy_from_logits"], originals["entropy_from_logits"], [logits], diff=(0,))
    compare(patched["entropy_from_logits"], originals["entropy_from_logits"], [logits.flatten(0, 1), 5], diff=(0,))
    assert op_calls["entropy"] == 2 and op_calls["logprobs"] == 0


@pytest.mark.parametrize("entropy_requires_grad", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_selective_log_softmax_and_entropy(trl, backend, entropy_requires_grad, temperature):
    originals, patched, _ = trl
    logits = torch.randn(B, T, V) * 3
    index = torch.randint(0, V, (B, T))
    row_mask = (torch.rand(B, T) > 0.3).long()
    for args in ([logits, index, entropy_requires_grad, temperature],
                 [logits, index, entropy_requires_grad, temperature, row_mask]):
        got, _ = compare(patched["selective_log_softmax_and_entropy"], originals["selective_log_softmax_and_entropy"],
                         args, diff=(0,))
        assert got[1].requires_grad == entropy_requires_grad
    # the entropy's own gradient (through output 1)
    x = logits.clone().requires_grad_()
    y = logits.clone().requires_grad_()
    up = torch.randn(B, T)
    (gx,) = torch.autograd.grad((patched["selective_log_softmax_and_entropy"](x, index)[1] * up).sum(), x)
    (gy,) = torch.autograd.grad((originals["selective_log_softmax_and_entropy"](y, index)[1] * up).sum(), y)
    torch.testing.assert_close(gx, gy, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("outputs", [("log_probs",), ("log_probs", "entropy")])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_fused_lm_head_function(trl, backend, outputs, with_bias, temperature, op_calls):
    """The function GRPOTrainer's fused LM head calls (trl.trainer.utils.add_fused_lm_head)."""
    originals, patched, _ = trl
    hidden = torch.randn(B * T, H)
    weight = torch.randn(V, H) * 0.5
    bias = torch.randn(V) if with_bias else None
    targets = torch.randint(0, V, (B * T,))

    def run(cls):
        def fn(h, w, b, y):
            out = cls.apply(h, w, b, y, temperature, 16, None, 1.0, outputs)
            return out[0] if out[1] is None else out[0] + 0.5 * out[1]  # both outputs' gradients
        return fn

    diff = (0, 1, 2) if with_bias else (0, 1)
    compare(run(patched["_ChunkedLogProbFunction"]), run(originals["_ChunkedLogProbFunction"]),
            [hidden, weight, bias, targets], diff=diff)
    out = patched["_ChunkedLogProbFunction"].apply(hidden, weight, bias, targets, temperature, 16, None, 1.0, outputs)
    assert len(out) == 5 and out[2:] == (None, None, None)
    assert (out[1] is None) == ("entropy" not in outputs)
    assert op_calls["linear_logprobs"] == 2


def test_fused_lm_head_softcapping_runs_trls_own(trl, backend, op_calls):
    originals, patched, _ = trl
    hidden, weight, targets = torch.randn(B * T, H), torch.randn(V, H), torch.randint(0, V, (B * T,))
    for args in ((30.0, 1.0, ("log_probs",)), (None, 0.5, ("log_probs",)), (None, 1.0, ("log_probs", "is_top1"))):
        got = patched["_ChunkedLogProbFunction"].apply(hidden, weight, None, targets, 1.0, 16, *args)
        want = originals["_ChunkedLogProbFunction"].apply(hidden, weight, None, targets, 1.0, 16, *args)
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b)
    assert op_calls["linear_logprobs"] == 0
