"""fastrlhf.integrations.trl's GRPOTrainer._compute_loss against TRL 1.16's own: every loss_type at
both importance_sampling_levels, with masked rows, the reference KL, top_entropy_quantile, off-policy
sequence masking and the vLLM IS correction on and off: loss, every metric TRL logs and the gradient
w.r.t. the log-probs (both backends, DESIGN.md's rule against TRL in float64); the combinations that
run TRL's own code, logged once; and a real GRPOTrainer's first step with and without patch()."""

import collections
import logging

import pytest
import torch

from .family_peers import F64, grpo_inputs, trl_inputs, trl_trainer, trl_vllm_importance_sampling
from .peer_checks import ATOL, check_like_peer

pytestmark = pytest.mark.slow  # TRL's GRPOTrainer loss and first steps, patched and not

pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is not installed")

LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]


@pytest.fixture
def grpo(trl_integration):
    """(TRL's own _compute_loss, the patched one)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    original = GRPOTrainer._compute_loss
    trl_integration.patch()
    assert GRPOTrainer._compute_loss is not original
    return original, GRPOTrainer._compute_loss


def _case(vllm_mode, extras):
    """float64 (log-probs, entropies, inputs, settings): policy_inputs' clip bands and masked rows,
    a reference model's log-probs, TRL's own vLLM IS ratio for `vllm_mode` (None: no correction)."""
    old, logp, adv_rows, mask, entropy, ref, sampling = grpo_inputs()
    B, T = mask.shape
    settings = dict(beta=0.04, current_gradient_accumulation_steps=2)
    if extras:
        settings.update(top_entropy_quantile=0.6, off_policy_mask_threshold=0.05, delta=1.5, steps_per_generation=4)
    # tool-output tokens, which TRL's loss and IS ratio leave out (mask = completion_mask * tool_mask)
    tool_mask = (torch.arange(T) % 5 != 3).expand(B, T) if extras else torch.ones(B, T, dtype=torch.bool)
    is_ratio = None
    if vllm_mode is not None:
        is_ratio, _ = trl_vllm_importance_sampling(old, sampling, mask & tool_mask, vllm_mode, 0.5, 3.0)
        settings.update(use_vllm=True, vllm_importance_sampling_correction=True)
    inputs = trl_inputs(mask, adv_rows, old, ref=ref, is_ratio=is_ratio, sampling=sampling,
                        num_items=float(mask.sum()) * 1.5)
    if extras:
        inputs["tool_mask"] = tool_mask.long()
    return logp, entropy, inputs, settings


def _cast(logp, entropy, inputs, dtype, only=None):
    """The case in `dtype` (with `only`: those inputs and the log-probs in `dtype`, the other float inputs
    in float32)."""
    cast = {k: v.to(dtype if only is None or k in only else torch.float32)
            if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    return logp.to(dtype), entropy.to(dtype), cast


def _run(compute_loss, logp, entropy, inputs, settings, dtype, only=None):
    """(loss, d loss / d logp with a random upstream factor, TRL's logged metrics) in `dtype`."""
    logp, entropy, cast = _cast(logp, entropy, inputs, dtype, only)
    x = logp.detach().clone().requires_grad_()
    trainer = trl_trainer(x, entropy, **settings)
    loss = compute_loss(trainer, None, cast)
    (grad,) = torch.autograd.grad(loss * 0.7, x)
    return loss.detach(), grad, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def test_patch_and_unpatch_the_method(trl_integration):
    from trl.trainer.grpo_trainer import GRPOTrainer

    original = GRPOTrainer._compute_loss
    trl_integration.patch()
    trl_integration.patch()
    assert GRPOTrainer._compute_loss is not original and GRPOTrainer._compute_loss.__wrapped__ is original
    trl_integration.unpatch()
    trl_integration.unpatch()
    assert GRPOTrainer._compute_loss is original


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("vllm_mode,extras", [(None, False), ("token_truncate", True), ("sequence_mask", True)],
                         ids=["plain", "is_token_truncate+masks", "is_sequence_mask+masks"])
def test_compute_loss_patched_equals_trl(grpo, backend, op_calls, loss_type, level, vllm_mode, extras):
    if loss_type == "vespo" and vllm_mode == "sequence_mask":
        pytest.skip("TRL rejects VESPO with a sequence-level vLLM IS mode")
    original, patched = grpo
    logp, entropy, inputs, settings = _case(vllm_mode, extras)
    settings.update(loss_type=loss_type, importance_sampling_level=level)
    case = _cast(logp, entropy, inputs, torch.float32)  # the float64 runs take the same rounded inputs
    got = _run(patched, *case, settings, torch.float32)
    assert op_calls["policy_loss"] == 1  # the loss ran on fastrlhf, not TRL's fallback
    peer = _run(original, *case, settings, torch.float32)
    peer64 = _run(original, *case, settings, F64)
    assert list(got[2]) == list(peer[2])  # the same metric names, logged in TRL's order
    check_like_peer(got, peer, peer64, atol=ATOL[torch.float32], name=f"{loss_type}/{level}")
    if backend == "torch":  # the torch path computes float64 in float64: TRL's own float64 numbers
        check_like_peer(_run(patched, *case, settings, F64), peer64, peer64, atol=ATOL[F64])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_compute_loss_bfloat16_log_probs(grpo, backend, loss_type):
    """bf16 log-probs (TRL's own selective_log_softmax under autocast): TRL computes its loss in bf16,
    fastrlhf in float32 then rounds; both held to DESIGN.md's rule against TRL in float64 on the same
    rounded inputs."""
    original, patched = grpo
    logp, entropy, inputs, settings = _case("token_truncate", True)
    settings.update(loss_type=loss_type)
    for only in (None, ("old_per_token_logps", "ref_per_token_logps")):  # all bf16; float32 advantages, IS ratio
        got = _run(patched, logp, entropy, inputs, settings, torch.bfloat16, only)
        peer = _run(original, logp, entropy, inputs, settings, torch.bfloat16, only)
        peer64 = _run(original, *_cast(logp, entropy, inputs, torch.bfloat16, only), settings, F64)
        check_like_peer(got, peer, peer64, atol=ATOL[torch.bfloat16], name=f"{loss_type} {only}")


def test_eval_mode_and_token_advantages(grpo, backend):
    """model.eval(): no accumulation factor; advantages given per token ([B, T], a subclass's)."""
    original, patched = grpo
    logp, entropy, inputs, settings = _case(None, False)
    inputs["advantages"] = torch.randn(logp.shape, dtype=F64)
    logp, entropy, inputs = _cast(logp, entropy, inputs, torch.float32)  # float64 runs: the same rounded inputs
    for loss_type in ("dapo", "grpo"):
        settings.update(loss_type=loss_type)

        def run(fn, dtype):
            cast = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
            x = logp.to(dtype).requires_grad_()
            t = trl_trainer(x, entropy.to(dtype), **settings)
            t.model.training = False
            t._metrics["eval"] = collections.defaultdict(list)
            loss = fn(t, None, cast)
            return loss.detach(), torch.autograd.grad(loss, x)[0], {k: v[-1] for k, v in t._metrics["eval"].items()}

        check_like_peer(run(patched, torch.float32), run(original, torch.float32), run(original, F64),
                        atol=ATOL[torch.float32], name=loss_type)


@pytest.mark.parametrize("why,settings,poison", [
    ("the entropy bonus", dict(entropy_coef=0.01), None),
    ("non-finite inputs", {}, "old_per_token_logps"),
])
def test_unfused_combinations_run_trls_code_logged_once(grpo, op_calls, caplog, why, settings, poison):
    original, patched = grpo
    logp, entropy, inputs, base = _case(None, False)
    settings = dict(base, loss_type="grpo", **settings)
    if poison:
        inputs[poison] = inputs[poison].clone()
        inputs[poison][0, 0] = float("nan")
    from fastrlhf.integrations import trl

    trl._FALLBACKS.clear()
    with caplog.at_level(logging.INFO, logger="fastrlhf.integrations"):
        got = _run(patched, logp, entropy, inputs, settings, F64)
        _run(patched, logp, entropy, inputs, settings, F64)
    peer = _run(original, logp, entropy, inputs, settings, F64)
    assert op_calls["policy_loss"] == 0
    assert [r.getMessage() for r in caplog.records].count(
        next(r.getMessage() for r in caplog.records if why in r.getMessage())) == 1
    torch.testing.assert_close(got[0], peer[0], rtol=0, atol=0, equal_nan=True)
    assert got[2].keys() == peer[2].keys()


# ---------------------------------------------------------------- a real GRPOTrainer's first step


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_trainer_first_step(trl_integration, tmp_path, op_calls, loss_type):
    """The same first-step loss and metrics with and without patch() (float64 on the torch path, TRL's
    head replaced by a float64 one in both: the loss code alone differs)."""
    from .test_trainer_steps import MaterialisedHead, grpo_run

    config = dict(dtype=F64, steps=1, head=MaterialisedHead, loss_type=loss_type,
                  importance_sampling_level="sequence" if loss_type == "luspo" else "token")
    (patched,), _ = grpo_run(tmp_path / "p", trl_integration, True, **config)
    assert op_calls["policy_loss"] > 0
    (original,), _ = grpo_run(tmp_path / "o", trl_integration, False, **config)
    assert patched.keys() == original.keys()
    for k, v in original.items():
        if isinstance(v, float) and "time" not in k and "per_second" not in k:
            assert patched[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
