"""fastrlhf.integrations.verl against the installed verl: patched == original (forward and
gradients, on both backends), the peer's conventions kept, patch()/unpatch() bookkeeping."""

import importlib.metadata
import math

import pytest
import torch
from helpers import make_mask

from .peer_checks import (
    assert_float64_as_peer,
    check_inputs_the_peer_rejects,
    check_ratio_tie_gradients,
    compare,
    grad_of,
    ratio_tie_inputs,
    unpatched,
)

pytestmark = pytest.mark.slow  # verl's own functions, patched and not, over dtypes, masks and aggregations

B, T, V = 6, 13, 37
KL_NAMES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+", "abs+", "k2+", "mse+"]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.fixture
def verl(verl_integration):
    import verl.trainer.ppo.core_algos as core_algos
    import verl.utils.torch_functional as verl_F

    originals = {
        "logprobs_from_logits": verl_F.logprobs_from_logits,
        "entropy_from_logits": verl_F.entropy_from_logits,
        "kl_penalty": core_algos.kl_penalty,
        "compute_gae_advantage_return": core_algos.compute_gae_advantage_return,
        "compute_policy_loss_vanilla": core_algos.compute_policy_loss_vanilla,
        "compute_value_loss": core_algos.compute_value_loss,
        "agg_loss": core_algos.agg_loss,
    }
    verl_integration.patch()
    patched = {"logprobs_from_logits": verl_F.logprobs_from_logits, "entropy_from_logits": verl_F.entropy_from_logits}
    patched.update({name: getattr(core_algos, name) for name in originals if name not in patched})
    for name in ("compute_policy_loss_vanilla", "compute_value_loss"):  # they call agg_loss through the module
        originals[name] = unpatched(verl_integration, originals[name])
    return originals, patched, core_algos, verl_F


def _actor_config(**overrides):
    from verl.workers.config.actor import ActorConfig

    kw = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2, clip_ratio_low=0.2,
              clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean")
    kw.update(overrides)
    return ActorConfig(**kw)


# ---------------------------------------------------------------- bookkeeping


def test_patch_rebinds_every_reference_and_unpatch_restores(verl_integration):
    import verl.trainer.ppo.core_algos as core_algos
    import verl.utils.torch_functional as verl_F
    import verl.workers.utils.losses as losses

    def refs():
        return (core_algos.kl_penalty, losses.kl_penalty, losses.compute_value_loss, verl_F.logprobs_from_logits,
                core_algos.POLICY_LOSS_REGISTRY["vanilla"], core_algos.ADV_ESTIMATOR_REGISTRY["gae"],
                core_algos.agg_loss, losses.agg_loss)

    before = refs()
    verl_integration.patch()
    verl_integration.patch()  # idempotent
    after = refs()
    assert all(a is not b for a, b in zip(after, before))
    assert losses.kl_penalty is core_algos.kl_penalty and losses.agg_loss is core_algos.agg_loss
    assert core_algos.get_policy_loss_fn("vanilla") is core_algos.compute_policy_loss_vanilla
    assert core_algos.get_adv_estimator_fn("gae") is core_algos.compute_gae_advantage_return
    assert core_algos.kl_penalty.__wrapped__ is before[0]
    verl_integration.unpatch()
    verl_integration.unpatch()
    assert all(a is b for a, b in zip(refs(), before))


def test_patch_logs_what_it_replaced(verl_integration, caplog):
    with caplog.at_level("INFO", logger="fastrlhf.integrations"):
        verl_integration.patch()
    text = caplog.text
    for name in ("logprobs_from_logits", "entropy_from_logits", "kl_penalty", "compute_gae_advantage_return",
                 "POLICY_LOSS_REGISTRY['vanilla']", "ADV_ESTIMATOR_REGISTRY['gae']", "compute_value_loss",
                 "core_algos.agg_loss"):
        assert name in text


def test_a_failing_patch_leaves_nothing_patched(verl_integration, monkeypatch):
    import verl.trainer.ppo.core_algos as core_algos

    from fastrlhf.integrations import is_patched

    before = core_algos.kl_penalty, core_algos.POLICY_LOSS_REGISTRY["vanilla"]

    def broken(*originals):
        raise RuntimeError("adapter construction failed")

    monkeypatch.setattr(verl_integration, "_value_loss", broken)
    with pytest.raises(RuntimeError, match="adapter construction failed"):
        verl_integration.patch()
    assert (core_algos.kl_penalty, core_algos.POLICY_LOSS_REGISTRY["vanilla"]) == before
    assert not is_patched("verl")


def test_refuses_unsupported_version(verl_integration, monkeypatch):
    from fastrlhf.integrations import UnsupportedPeerError

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.8.3" if d == "verl" else real(d))
    with pytest.raises(UnsupportedPeerError, match=r"verl >= 0\.9.*0\.8\.3"):
        verl_integration.patch()


# ---------------------------------------------------------------- log-probs and entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_from_logits(verl, backend, dtype, op_calls):
    originals, patched, _, _ = verl
    logits = (torch.randn(B, T + 1, V) * 3).to(dtype)[:, :-1]  # a non-contiguous view, as trainers slice
    labels = torch.randint(0, V, (B, T))
    compare(patched["logprobs_from_logits"], originals["logprobs_from_logits"], [logits, labels], diff=(0,))
    assert op_calls["logprobs"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_from_logits(verl, backend, dtype, op_calls):
    originals, patched, _, _ = verl
    logits = (torch.randn(B * T, V) * 3).to(dtype)
    compare(patched["entropy_from_logits"], originals["entropy_from_logits"], [logits], diff=(0,))
    assert op_calls["entropy"] == 1 and op_calls["logprobs"] == 0  # the entropy-only op: no label


def test_labels_and_logits_verl_rejects_get_fastrlhfs_answers(verl, backend):
    """Documented under "Not kept" in fastrlhf.integrations.verl."""
    originals, patched, _, _ = verl
    check_inputs_the_peer_rejects(patched["logprobs_from_logits"], originals["logprobs_from_logits"],
                                  patched["entropy_from_logits"], originals["entropy_from_logits"])


def test_logprobs_at_temperature_as_the_engine_scales(verl, backend):
    # verl's engines divide the logits by the temperature before calling logprobs_from_logits
    originals, patched, _, _ = verl
    logits = torch.randn(B, T, V) * 2 / 0.7
    labels = torch.randint(0, V, (B, T))
    compare(patched["logprobs_from_logits"], originals["logprobs_from_logits"], [logits, labels], diff=(0,))
    compare(patched["entropy_from_logits"], originals["entropy_from_logits"], [logits], diff=(0,))


# ---------------------------------------------------------------- KL


@pytest.mark.parametrize("name", KL_NAMES)
def test_kl_penalty_every_estimator(verl, backend, name, op_calls):
    originals, patched, _, _ = verl
    logp = torch.randn(B, T) * 2
    ref = logp + torch.randn(B, T) * 3
    ref[0, :4] = logp[0, :4]  # exact ties: the actor equals the reference at step 0
    ref[1, :3] = logp[1, :3] + torch.tensor([25.0, -25.0, 12.0])  # past every clamp
    compare(patched["kl_penalty"], originals["kl_penalty"], [logp, ref, name], diff=(0, 1))
    assert op_calls["token_kl"] == 1  # the "+" names too: token_kl(straight_through=True)


@pytest.mark.parametrize("name", ["k1", "abs", "k2", "low_var_kl", "k1+", "k3+", "low_var_kl+", "abs+"])
def test_kl_penalty_non_finite_log_probs_as_verl(verl, backend, name):
    """-inf / inf / NaN log-probs: verl's low_var_kl clamps the log-ratio in its linear term (+10
    at r = -inf, where fastrlhf's formula alone gives -10) and a "+" name is NaN where r is not
    finite ((b - b) + f with b = r^2 / 2 = inf); values and gradients as verl's."""
    originals, patched, _, _ = verl
    logp = torch.randn(B, T)
    ref = logp + torch.randn(B, T)
    logp[0, :5] = torch.tensor([-float("inf"), 0.0, float("nan"), -3e9, 3e9])
    ref[0, :5] = torch.tensor([-1.0, -float("inf"), 0.0, 0.0, 0.0])
    compare(patched["kl_penalty"], originals["kl_penalty"], [logp, ref, name], diff=(0, 1))


def test_kl_penalty_low_precision_input_keeps_dtype(verl, backend):
    originals, patched, _, _ = verl
    logp = torch.randn(B, T).bfloat16()
    ref = (logp.float() + torch.randn(B, T)).bfloat16()
    compare(patched["kl_penalty"], originals["kl_penalty"], [logp, ref, "low_var_kl"], diff=(0,))


def test_kl_penalty_errors_are_verls(verl):
    originals, patched, _, _ = verl
    logp, ref = torch.randn(2, 3), torch.randn(2, 3)
    for name in ("full", "nope"):
        with pytest.raises(NotImplementedError):
            originals["kl_penalty"](logp, ref, name)
        with pytest.raises(NotImplementedError):
            patched["kl_penalty"](logp, ref, name)


# ---------------------------------------------------------------- GAE


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_keeps_verls_values_off_the_mask(verl, backend, mask_dtype, gamma, lam, op_calls):
    originals, patched, _, _ = verl
    rewards, values = torch.randn(B, T), torch.randn(B, T)
    mask = make_mask(B, T).to(mask_dtype)  # right / left padding, an empty row, gaps
    got, peer = compare(patched["compute_gae_advantage_return"], originals["compute_gae_advantage_return"],
                        [rewards, values, mask, gamma, lam])
    off = ~mask.bool()
    assert got[0][off].abs().sum() > 0  # verl's advantages are not zeroed off the mask: nor are ours
    assert op_calls["gae"] == 1
    # verl rejects a bool mask (1 - mask); the patched function takes it and gives the float mask's result
    as_bool = patched["compute_gae_advantage_return"](rewards, values, mask.bool(), gamma, lam)
    assert all(torch.equal(a, b) for a, b in zip(as_bool, got))


def test_gae_tensor_hyperparameters_and_registry(verl, backend):
    originals, patched, core_algos, _ = verl
    rewards, values, mask = torch.randn(B, T), torch.randn(B, T), make_mask(B, T).float()
    fn = core_algos.get_adv_estimator_fn("gae")
    assert fn is patched["compute_gae_advantage_return"]
    compare(fn, originals["compute_gae_advantage_return"],
            [rewards, values, mask, torch.tensor(0.97), torch.tensor(0.9)])


def test_gae_non_binary_mask_and_empty_mask_behave_as_verl(verl):
    originals, patched, _, _ = verl
    rewards, values = torch.randn(B, T), torch.randn(B, T)
    weights = torch.rand(B, T)  # a weighting mask: verl interpolates the recursion with it
    a = patched["compute_gae_advantage_return"](rewards, values, weights, 0.99, 0.95)
    b = originals["compute_gae_advantage_return"](rewards, values, weights, 0.99, 0.95)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    empty = torch.zeros(B, T)
    for fn in (patched["compute_gae_advantage_return"], originals["compute_gae_advantage_return"]):
        with pytest.raises(ValueError, match="At least one element"):
            fn(rewards, values, empty, 1.0, 1.0)


# ---------------------------------------------------------------- policy and value losses


def _loss_inputs(empty=False):
    logp_old = torch.randn(B, T) - 1
    logp = logp_old + torch.randn(B, T) * 0.4
    logp[0, 0] = logp_old[0, 0] + 30.0  # a ratio past the +-20 log-ratio clamp
    adv = torch.randn(B, T)
    mask = torch.zeros(B, T, dtype=torch.bool) if empty else make_mask(B, T)
    return logp_old, logp, adv, mask


GLOBALS = [
    {},
    {"batch_num_tokens": 40},
    {"dp_size": 2, "batch_num_tokens": 90, "global_batch_size": 11},
    {"global_batch_size": 9},
    {"loss_scale_factor": 64},
]


def _info_id(d):
    return ",".join(f"{k}={v}" for k, v in d.items()) or "local"


def _float64_on_kernels(backend, cases):
    """How many (dtype, ...) cases the adapters send to the peer's own function because the
    Triton kernels compute float64 inputs in float32 (the torch path keeps float64)."""
    return sum(c[0] == torch.float64 for c in cases) if backend == "triton" else 0


# (loss dtype, mask dtype): verl's own dtype promotion differs between them (e.g. a bf16 loss with a
# bool mask stays bf16 in the token modes and becomes float32 in the seq modes)
DTYPES = [(torch.float32, torch.bool), (torch.bfloat16, torch.float32), (torch.float64, torch.int64)]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("info", GLOBALS, ids=_info_id)
def test_agg_loss_every_mode(verl, backend, mode, info, op_calls):
    originals, patched, core_algos, _ = verl
    for loss_dtype, mask_dtype in DTYPES:
        loss_mat = (torch.randn(B, T) * 2).to(loss_dtype)
        mask = make_mask(B, T).to(mask_dtype)
        compare(patched["agg_loss"], originals["agg_loss"], [loss_mat, mask, mode], kwargs=info, diff=(0,),
                upstream=torch.tensor(1.3, dtype=torch.float64))
    assert op_calls["agg_loss"] == len(DTYPES)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("info", [{}, {"dp_size": 2, "batch_num_tokens": 90, "global_batch_size": 11}], ids=_info_id)
def test_agg_loss_empty_mask_and_non_finite_values_off_the_mask(verl, backend, mode, info, op_calls):
    """Without global counts an empty mask is verl's 0 / 0 = NaN; a NaN / inf at a mask = 0 token
    makes the seq modes' loss NaN (loss_mat * mask) in a non-empty row only, and leaves the token
    modes' loss alone (masked_sum drops it); gradients stay finite either way."""
    originals, patched, _, _ = verl
    mask = make_mask(B, T)
    empty = torch.zeros(B, T, dtype=torch.bool)
    for m in (mask, empty):
        compare(patched["agg_loss"], originals["agg_loss"], [torch.randn(B, T), m, mode], kwargs=info, diff=(0,),
                upstream=torch.tensor(0.9, dtype=torch.float64))
    loss_mat = torch.randn(B, T)
    loss_mat[2, 0] = float("nan")  # row 2 is fully masked: verl drops the row
    compare(patched["agg_loss"], originals["agg_loss"], [loss_mat, mask, mode], kwargs=info, diff=(0,),
            upstream=torch.tensor(0.9, dtype=torch.float64))
    loss_mat[0, -1] = float("inf")  # row 0 is right-padded: a mask = 0 token of a non-empty row
    got, _ = compare(patched["agg_loss"], originals["agg_loss"], [loss_mat, mask, mode], kwargs=info, diff=(0,),
                     upstream=torch.tensor(0.9, dtype=torch.float64))
    assert math.isnan(got.item()) == mode.startswith("seq-mean")
    assert op_calls["agg_loss"] == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_agg_loss_seq_mean_token_mean_divides_by_n_plus_eps(verl, backend, dtype, op_calls):
    """verl's per-sequence mean divides by n_b + 1e-8: with weights summing below 1 per row, or in
    float64, that differs from dividing by n_b; patched still gives verl's number."""
    originals, patched, _, _ = verl
    loss_mat = torch.randn(B, T, dtype=dtype)
    mask = (make_mask(B, T) * torch.rand(B, T) * 1e-4).to(dtype)  # rows sum to ~1e-4 * T
    for info in ({}, {"global_batch_size": 9}):
        compare(patched["agg_loss"], originals["agg_loss"], [loss_mat, mask, "seq-mean-token-mean"], kwargs=info,
                diff=(0,), upstream=torch.tensor(1.1, dtype=torch.float64))
    assert op_calls["agg_loss"] == 2


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32, torch.float64, torch.bfloat16],
                         ids=str)
def test_seq_mean_token_mean_of_float64_losses_divides_as_verl(verl, backend, mask_dtype):
    """verl divides row b by mask.sum(-1) + 1e-8 in the MASK's arithmetic: float32 for a bool, int
    or float32 mask (where n + 1e-8 == n), float64 for a float64 mask (which keeps the 1e-8). A
    float64 loss gets verl's number to float64 precision, value and gradient, in agg_loss, the
    vanilla policy loss and the value loss (losses of one sign: nothing cancels in the means)."""
    originals, patched, _, _ = verl
    mode = "seq-mean-token-mean"
    mask = make_mask(B, T).to(mask_dtype)
    loss_mat = torch.rand(B, T, dtype=torch.float64) + 0.5
    assert_float64_as_peer(patched["agg_loss"], originals["agg_loss"], [loss_mat, mask, mode], diff=0)
    old, logp, adv, _ = (t.double() for t in _loss_inputs())
    assert_float64_as_peer(patched["compute_policy_loss_vanilla"], originals["compute_policy_loss_vanilla"],
                           [old, logp, adv.abs() + 0.1, mask, mode, _actor_config(loss_agg_mode=mode)], diff=1)
    vpreds, values, returns = (torch.randn(B, T, dtype=torch.float64) for _ in range(3))
    assert_float64_as_peer(patched["compute_value_loss"], originals["compute_value_loss"],
                           [vpreds, returns, values, mask, 0.3, mode], diff=0)


def test_seq_mean_token_mean_with_float64_as_default_dtype_divides_as_verl(verl, backend):
    """With torch's default dtype float64 a bool mask's sum + 1e-8 is float64 and keeps the 1e-8."""
    originals, patched, _, _ = verl
    loss_mat, mask = torch.rand(B, T, dtype=torch.float64) + 0.5, make_mask(B, T)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got, _ = assert_float64_as_peer(patched["agg_loss"], originals["agg_loss"],
                                        [loss_mat, mask, "seq-mean-token-mean"], diff=0)
    finally:
        torch.set_default_dtype(default)
    n = mask.sum(-1).double()
    assert got.item() != ((loss_mat * mask).sum(-1)[n > 0] / n[n > 0]).mean().item()  # the 1e-8 is visible


def test_agg_loss_bad_arguments_run_verls(verl, op_calls):
    originals, patched, _, _ = verl
    loss_mat, mask = torch.randn(B, T), make_mask(B, T)
    for fn in (originals["agg_loss"], patched["agg_loss"]):
        with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
            fn(loss_mat, mask, "seq-sum")
        with pytest.raises(ValueError, match="batch_num_tokens is required when dp_size > 1"):
            fn(loss_mat, mask, "token-mean", dp_size=2)
        with pytest.raises(ValueError, match="global_batch_size is required when dp_size > 1"):
            fn(loss_mat, mask, "seq-mean-token-mean", dp_size=2)
    # a zero global count: verl divides by it (inf); fastrlhf's agg rejects it, so verl's own runs
    got = patched["agg_loss"](loss_mat.abs(), mask, "token-mean", batch_num_tokens=0)
    assert got.item() == originals["agg_loss"](loss_mat.abs(), mask, "token-mean", batch_num_tokens=0).item()
    assert op_calls["agg_loss"] == 0


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("info", GLOBALS, ids=_info_id)
def test_policy_loss_vanilla_every_agg_mode(verl, backend, mode, info, op_calls):
    originals, patched, core_algos, _ = verl
    config = _actor_config(loss_agg_mode=mode)
    config.global_batch_info.update(info)
    old, logp, adv, mask = _loss_inputs()
    fn = core_algos.get_policy_loss_fn("vanilla")
    assert fn is patched["compute_policy_loss_vanilla"]
    compare(fn, originals["compute_policy_loss_vanilla"], [old, logp, adv, mask, mode, config],
            diff=(1,), upstream=torch.tensor(1.7, dtype=torch.float64))
    assert op_calls["policy_loss"] == 1 and op_calls["agg_loss"] == 0  # one fused op, no separate aggregation


@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_vanilla_dtypes_and_weighting_masks(verl, backend, mode, op_calls):
    """bf16 and float64 inputs, int and float masks (a float mask weights tokens; verl's masked
    means then divide by mask.sum() + 1e-8), with rollout IS weights: values, dtypes, metrics."""
    originals, patched, _, _ = verl
    config = _actor_config(loss_agg_mode=mode)
    config.global_batch_info.update({"dp_size": 2, "batch_num_tokens": 90, "global_batch_size": 11})
    cases = [(torch.bfloat16, make_mask(B, T)), (torch.float64, make_mask(B, T).long()),
             (torch.float32, make_mask(B, T) * torch.rand(B, T)), (torch.float64, make_mask(B, T) * 1e-3)]
    for dtype, mask in cases:
        old, logp, adv, _ = (t.to(dtype) for t in _loss_inputs())
        weights = (torch.rand(B, T) * 2).to(dtype)
        compare(patched["compute_policy_loss_vanilla"], originals["compute_policy_loss_vanilla"],
                [old, logp, adv, mask, mode, config, weights], diff=(1,),
                upstream=torch.tensor(0.7, dtype=torch.float64))
    assert op_calls["policy_loss"] == len(cases) - _float64_on_kernels(backend, cases)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_vanilla_empty_mask(verl, backend, mode, op_calls):
    """Without global counts verl's token-mean and seq-mean losses are 0 / 0 = NaN (zero
    gradients), token-sum is 0; the metrics are 0 (masked means over mask.sum() + 1e-8)."""
    originals, patched, _, _ = verl
    config = _actor_config(loss_agg_mode=mode)
    old, logp, adv, mask = _loss_inputs(empty=True)
    got, _ = compare(patched["compute_policy_loss_vanilla"], originals["compute_policy_loss_vanilla"],
                     [old, logp, adv, mask, mode, config], diff=(1,), upstream=torch.tensor(1.0, dtype=torch.float64))
    assert math.isnan(got[0].item()) == (mode != "token-sum")
    assert op_calls["policy_loss"] == 1


def test_policy_loss_vanilla_non_finite_inputs_run_verls(verl, backend, op_calls):
    """verl's gradients are NaN at a token whose advantage or log-prob is NaN / inf, even off the
    mask (0 * NaN in its backward), where fastrlhf's are 0: such a call runs verl's own function."""
    originals, patched, _, _ = verl
    for mode in ("token-mean", "seq-mean-token-sum"):
        config = _actor_config(loss_agg_mode=mode)
        old, logp, adv, mask = _loss_inputs()
        adv[0, -1] = float("nan")  # off the mask (row 0 is right-padded)
        logp[3, 1] = -float("inf")  # off the mask (row 3 has gaps at t % 3 == 1)
        x = logp.clone().requires_grad_()
        (g,) = torch.autograd.grad(originals["compute_policy_loss_vanilla"](old, x, adv, mask, mode, config)[0], x)
        assert bool(g.isnan().any())  # the case this test is about
        compare(patched["compute_policy_loss_vanilla"], originals["compute_policy_loss_vanilla"],
                [old, logp, adv, mask, mode, config], diff=(1,), upstream=torch.tensor(1.0, dtype=torch.float64))
    assert op_calls["policy_loss"] == 2  # computed, then set aside for verl's own


def test_policy_loss_vanilla_with_rollout_is_weights_and_dual_clip(verl, backend, op_calls):
    originals, patched, _, _ = verl
    old, logp, adv, mask = _loss_inputs()
    weights = torch.rand(B, T) * 2
    for c in (1.5, 3.0, 10.0):
        config = _actor_config(clip_ratio_c=c, clip_ratio_low=0.1, clip_ratio_high=0.3)
        compare(patched["compute_policy_loss_vanilla"], originals["compute_policy_loss_vanilla"],
                [old, logp, adv, mask, "token-mean", config], diff=(1,),
                upstream=torch.tensor(0.6, dtype=torch.float64))
        compare(patched["compute_policy_loss_vanilla"], originals["compute_policy_loss_vanilla"],
                [old, logp, adv, mask, "token-mean", config, weights], diff=(1,),
                upstream=torch.tensor(0.6, dtype=torch.float64))
    assert op_calls["policy_loss"] == 6  # rollout_is_weights -> policy_loss(is_weights=...)


def test_policy_loss_vanilla_ties_give_the_unclipped_gradient(verl, monkeypatch):
    """At a tie of the clipped and unclipped terms fastrlhf gives the unclipped term -A ratio the
    whole gradient (docs/ops.md, "Gradient rules at ties"; the verl module docstring says so).
    verl's torch.min / torch.max split a tie in half and its torch.clamp follows torch's gradient
    at the bound g (1 through torch 2.13, 0 from 2.14): at ratio == clip_ratio_c (A < 0) verl's
    gradient is half the unclipped one, at ratio == 1 +- eps (1 + g) / 2 of it, at the log-ratio
    clamp's -20 bound g times it. Every other token has verl's gradient. The torch path only: the
    Triton kernels' exp is not bit-for-bit torch's, so no log-ratio is known to give them a ratio
    exactly at a bound (the same rule is written the same way there)."""
    monkeypatch.setenv("FASTRLHF_BACKEND", "torch")
    originals, patched, _, _ = verl
    old, logp, adv, ratio, (clip_low, clip_high, c) = ratio_tie_inputs()
    config = _actor_config(clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=c)
    args = [old, logp, adv, torch.ones(2, 8, dtype=torch.bool), "token-sum", config]
    got = grad_of(patched["compute_policy_loss_vanilla"], args, 1)
    peer = grad_of(originals["compute_policy_loss_vanilla"], args, 1)
    unclipped = -adv * ratio  # d(-A ratio) / d(log-prob); token-sum: weight 1
    check_ratio_tie_gradients(got, peer, unclipped)


def test_policy_loss_vanilla_metric_keys_and_types(verl):
    originals, patched, _, _ = verl
    old, logp, adv, mask = _loss_inputs()
    config = _actor_config()
    _, got = patched["compute_policy_loss_vanilla"](old, logp, adv, mask, "token-mean", config)
    _, want = originals["compute_policy_loss_vanilla"](old, logp, adv, mask, "token-mean", config)
    assert list(got) == list(want) == ["actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"]
    assert all(type(v) is float for v in got.values())
    with pytest.raises(AssertionError):  # verl asserts a config is given; so does the patched loss
        patched["compute_policy_loss_vanilla"](old, logp, adv, mask, "token-mean", None)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("info", GLOBALS, ids=_info_id)
def test_value_loss_every_agg_mode(verl, backend, mode, info, op_calls):
    originals, patched, _, _ = verl
    vpreds, values, returns = torch.randn(B, T), torch.randn(B, T), torch.randn(B, T)
    values[0, :3] = vpreds[0, :3]  # no clipping there: max of two equal terms
    mask = make_mask(B, T).float()
    compare(patched["compute_value_loss"], originals["compute_value_loss"],
            [vpreds, returns, values, mask, 0.3], kwargs=dict(loss_agg_mode=mode, **info), diff=(0,),
            upstream=torch.tensor(0.8, dtype=torch.float64))
    assert op_calls["value_loss"] == 1 and op_calls["agg_loss"] == 0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_dtypes_weighting_masks_and_non_finite_inputs(verl, backend, mode, op_calls):
    """bf16 / float64 inputs and int / float masks in verl's dtypes; seq-mean-token-mean where
    verl's mask.sum(-1) + 1e-8 != n_b (a mask of small float32 weights; fastrlhf's value_loss takes
    no per-token weights to fold it into; an int mask's sum + 1e-8 is float32, n_b exactly, even
    for float64 values) and non-finite inputs (verl's NaN gradients) run verl's own."""
    originals, patched, _, _ = verl
    cases = [(torch.bfloat16, make_mask(B, T)), (torch.float64, make_mask(B, T).long()),
             (torch.float32, make_mask(B, T) * torch.rand(B, T) * 1e-3)]  # rows of weights summing below 0.2
    for dtype, mask in cases:
        vpreds, values, returns = (torch.randn(B, T, dtype=dtype) for _ in range(3))
        compare(patched["compute_value_loss"], originals["compute_value_loss"], [vpreds, returns, values, mask, 0.3],
                kwargs=dict(loss_agg_mode=mode, batch_num_tokens=40, global_batch_size=9), diff=(0,),
                upstream=torch.tensor(0.8, dtype=torch.float64))
    # float64 on the Triton kernels (float32 inside) and seq-mean-token-mean's n_b + 1e-8 run verl's
    expected = 3 - (mode == "seq-mean-token-mean") - (backend == "triton")
    assert op_calls["value_loss"] == expected
    vpreds, values, returns, mask = torch.randn(B, T), torch.randn(B, T), torch.randn(B, T), make_mask(B, T)
    returns[0, -1] = float("nan")  # off the mask
    x = vpreds.clone().requires_grad_()
    (g,) = torch.autograd.grad(originals["compute_value_loss"](x, returns, values, mask, 0.3, mode)[0], x)
    assert bool(g.isnan().any())  # the case this part is about
    compare(patched["compute_value_loss"], originals["compute_value_loss"], [vpreds, returns, values, mask, 0.3],
            kwargs=dict(loss_agg_mode=mode), diff=(0,), upstream=torch.tensor(0.8, dtype=torch.float64))
    assert op_calls["value_loss"] == expected


def test_value_loss_clip_tie_gives_the_unclipped_gradient(verl, backend):
    """At vpreds == values +- cliprange exactly verl's clip_by_value (a min then a max) and its
    torch.max of the two squared errors each split the gradient, so its gradient there is 3/4 of
    d(0.5 (v - R)^2); fastrlhf gives the unclipped term the whole of it (docs/ops.md, "Gradient
    rules at ties"), as the verl module docstring states. Elsewhere it is verl's gradient."""
    originals, patched, _, _ = verl
    values = torch.randint(-8, 8, (2, 5)) / 4  # quarters: every sum below is exact in float32
    vpreds = values + torch.tensor([[0.25, 0.25, 0.25, 0.05, 0.05], [-0.25, -0.25, -0.25, 0.05, 0.05]])
    returns = values + torch.tensor([3.0, -3.0, 3.0, 0.1, -0.1])
    tie = torch.zeros(2, 5, dtype=torch.bool)
    tie[:, :3] = True
    assert bool(((vpreds - values).abs()[tie] == 0.25).all())  # exact ties
    args = [vpreds, returns, values, torch.ones(2, 5), 0.25, "token-sum"]
    got = grad_of(patched["compute_value_loss"], args, 0)
    peer = grad_of(originals["compute_value_loss"], args, 0)
    unclipped = vpreds - returns  # d(0.5 (v - R)^2) / dv, token-sum: weight 1
    torch.testing.assert_close(got[~tie], peer[~tie], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[tie], unclipped[tie], rtol=1e-6, atol=0.0)
    torch.testing.assert_close(peer[tie], unclipped[tie] * 0.75, rtol=1e-6, atol=0.0)


def test_value_loss_empty_mask(verl, backend):
    originals, patched, _, _ = verl
    vpreds, values, returns = torch.randn(B, T), torch.randn(B, T), torch.randn(B, T)
    got, peer = compare(patched["compute_value_loss"], originals["compute_value_loss"],
                        [vpreds, returns, values, torch.zeros(B, T), 0.2], diff=(0,),
                        upstream=torch.tensor(1.0, dtype=torch.float64))
    assert math.isnan(got[0].item()) and math.isnan(peer[0].item())
