"""Real trainer steps through the patched path on CPU, with and without patch(): the same
losses, metrics and updated weights to tolerance.

- TRL: the current GRPOTrainer, a few steps on a tiny Llama built here (generation, reward,
  reference-model KL, the fused LM head that patch() replaces).
- verl 0.9.1: its actor update is the engine's `verl.workers.utils.losses.ppo_loss` fed by the
  engine's `logprobs_from_logits` / `entropy_from_logits` (DataParallelPPOActor is gone in
  0.9; the FSDP engine around them needs torch.distributed + FSDP and ray workers, see the
  integration note). Here: a tiny model's forward, those functions, ppo_loss with KL and
  entropy terms, backward and an optimizer step.
- OpenRLHF 0.11.2: `openrlhf.models.Actor` (log-probs and entropy) -> PolicyLoss + the KL loss
  -> backward -> step, and the experience maker's GAE; its PPOActor.training_step needs a
  DeepSpeed engine (not on CPU here).
"""

import copy

import pytest
import torch
from helpers import make_mask

from .peer_checks import ATOL, check_like_peer

pytestmark = pytest.mark.slow  # the peers' trainers stepped with and without patch()


def _tiny_llama(vocab_size, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).float()


def _assert_same_params(a, b, rtol=1e-4, atol=1e-6):
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- TRL GRPOTrainer


class MaterialisedHead:
    """Test reference for TRL's fused LM head: full logits and log_softmax in the inputs' dtype,
    returned in that dtype (TRL's own head and the patched one return float32 even for float64
    inputs, so a float64 trainer would compute its loss in float32)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0, outputs=()):
        assert softcap is None and logit_scale == 1.0
        logits = hidden @ weight.T if bias is None else hidden @ weight.T + bias
        log_p = torch.log_softmax(logits / temperature, dim=-1)
        logp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
        return logp, entropy, None, None, None


def grpo_run(tmp_path, integration, use_patch, dtype=torch.float32, steps=3, head=None, **config):
    """A GRPOTrainer's `steps` steps on a tiny Llama, patched or not; `head` replaces TRL's fused LM head
    (after patch()); `config`: GRPOConfig settings over these. (logged steps, the trained model)."""
    import trl.trainer.utils as utils
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from fastrlhf.train.task import build_char_tokenizer

    if use_patch:
        integration.patch()
    else:
        integration.unpatch()
    tok = build_char_tokenizer()
    path = tmp_path / "tiny-llama"  # GRPO builds its reference model from the policy's path
    _tiny_llama(len(tok)).to(dtype).save_pretrained(path)
    prompts = Dataset.from_dict({"prompt": ["abc ", "key: d ", "hello ", "xyz "]})

    def count_a(completions, **kwargs):
        return [float(c.count("a")) + len(set(c)) / 3 for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=steps, learning_rate=5e-3, logging_steps=1, report_to=[],
                      use_cpu=True, seed=0, save_strategy="no", beta=0.04, num_iterations=2, temperature=0.9,
                      disable_tqdm=True, dataloader_num_workers=0, model_init_kwargs={"dtype": dtype},
                      **({} if dtype == torch.float32 else {"bf16": False}), **config)
    saved = utils._ChunkedLogProbFunction
    if head is not None:
        utils._ChunkedLogProbFunction = head
    try:
        trainer = GRPOTrainer(model=str(path), reward_funcs=count_a, args=args, train_dataset=prompts,
                              processing_class=tok)
        trainer.train()
    finally:
        utils._ChunkedLogProbFunction = saved
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logs, trainer.model


def _numbers(log):
    return {k: v for k, v in log.items() if isinstance(v, float) and "time" not in k and "per_second" not in k}


def test_trl_grpo_trainer_steps_match(trl_integration, tmp_path, op_calls):
    """GRPO steps (generation, rewards, reference KL, two PPO iterations per batch) with and
    without patch().

    The reference is TRL's trainer in float64 (no autocast) with a materialised-logits head
    returning float64 (TRL's own fused head, and the patched one, return float32 log-probs, so
    the loss after them would be float32 arithmetic). With that head in both, the patched run
    (its GRPO loss on fastrlhf's policy_loss) agrees with it to 1e-9 over three steps: the same
    trainer semantics end to end.

    In float32 (TRL's CPU default: bf16 autocast, which TRL's head and the patched one both
    follow) the fused head and the loss both run patched, and only the first step is compared:
    its batch is sampled from the initial weights, which neither touches, so its loss and
    metrics differ between the runs only by the head's and the loss's arithmetic, and each is
    held to DESIGN.md's rule against the float64 run: no further from it than twice TRL's own
    error, plus float32's atol and rounding (the logged metrics are float32 numbers). Later
    steps start from weights that already carry each run's rounding, and a GRPO update is mostly
    cancellation (a group's advantages sum to 0): no per-op rule bounds how those trajectories
    drift apart, so they are not compared in float32."""
    logs_p, _ = grpo_run(tmp_path / "p", trl_integration, use_patch=True, steps=1)
    assert op_calls["linear_logprobs"] > 0 and op_calls["policy_loss"] > 0  # the head and the loss ran fused
    calls = dict(op_calls)
    logs_o, _ = grpo_run(tmp_path / "o", trl_integration, use_patch=False, steps=1)
    logs_p64, model_p64 = grpo_run(tmp_path / "p64", trl_integration, use_patch=True, dtype=torch.float64,
                                   head=MaterialisedHead)
    assert op_calls["policy_loss"] > calls["policy_loss"]
    logs_t, model_t = grpo_run(tmp_path / "t", trl_integration, use_patch=False, dtype=torch.float64,
                               head=MaterialisedHead)
    assert op_calls["linear_logprobs"] == calls["linear_logprobs"]
    assert len(logs_p64) == len(logs_t) == 3 and len(logs_p) == len(logs_o) == 1
    for p, t in zip(logs_p64, logs_t):
        assert p.keys() == t.keys()
        for k, v in _numbers(t).items():
            assert p[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    _assert_same_params(model_p64, model_t, rtol=1e-9, atol=1e-12)
    (p,), (o,), t = logs_p, logs_o, logs_t[0]
    assert p.keys() == o.keys() == t.keys()
    numbers = _numbers(t)
    assert {"loss", "grad_norm", "entropy", "kl"} <= numbers.keys()
    for k, v in numbers.items():
        check_like_peer(p[k], o[k], v, atol=ATOL[torch.float32], name=k)


# ---------------------------------------------------------------- verl: the engine's actor loss


def _verl_actor_step(verl_F, losses, case, seed=1):
    """One actor update as verl 0.9's engine makes it: packed log-probs and entropy from the
    model's logits, ppo_loss (policy loss + entropy + KL), backward, optimizer step."""
    use_kl, mode, kl_type, is_weights = case
    from verl.utils import tensordict_utils as tu
    from verl.workers.config.actor import ActorConfig

    B, P, R, V = 4, 3, 6, 29
    model = _tiny_llama(V)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    input_ids = torch.randint(0, V, (B, P + R), generator=g)
    response_mask = torch.ones(B, R, dtype=torch.bool)
    response_mask[1, 4:] = False
    response_mask[3, 2:] = False
    logits = model(input_ids).logits / 0.9  # verl scales by the rollout temperature first
    labels = torch.roll(input_ids, -1, 1)
    log_probs = verl_F.logprobs_from_logits(logits.flatten(0, 1), labels.flatten())
    entropy = verl_F.entropy_from_logits(logits.flatten(0, 1))
    old = log_probs.detach().view(B, P + R)[:, P - 1:-1] + 0.05 * torch.randn(B, R, generator=g)
    data = tu.get_tensordict(
        {"prompts": input_ids[:, :P], "responses": input_ids[:, P:],
         "attention_mask": torch.ones(B, P + R, dtype=torch.long),
         "response_mask": response_mask, "old_log_probs": old, "advantages": torch.randn(B, R, generator=g),
         "ref_log_prob": old - 0.1 * torch.randn(B, R, generator=g).abs(),
         **({"rollout_is_weights": 0.5 + torch.rand(B, R, generator=g)} if is_weights else {})},
        {"dp_size": 1, "batch_num_tokens": int(response_mask.sum()), "global_batch_size": B})
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                         loss_agg_mode=mode, use_kl_loss=use_kl, kl_loss_type=kl_type, kl_loss_coef=0.1,
                         entropy_coeff=0.01)
    loss, metrics = losses.ppo_loss(config, {"log_probs": log_probs, "entropy": entropy}, data)
    loss.backward()
    opt.step()
    return loss.detach(), metrics, model


VERL_CASES = [(False, "token-mean", "low_var_kl", False), (True, "token-mean", "low_var_kl", False),
              (True, "seq-mean-token-sum-norm", "k3+", True), (True, "seq-mean-token-mean", "abs", True)]


@pytest.mark.parametrize("case", VERL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_verl_actor_update_matches(verl_integration, backend, case, op_calls):
    """(use_kl_loss, loss_agg_mode, kl_loss_type, rollout_is_weights) through the engine's ppo_loss."""
    import verl.utils.torch_functional as verl_F
    import verl.workers.utils.losses as losses

    use_kl = case[0]
    loss_o, metrics_o, model_o = _verl_actor_step(verl_F, losses, case)
    verl_integration.patch()
    loss_p, metrics_p, model_p = _verl_actor_step(verl_F, losses, case)
    # log-probs and entropy from the logits, the vanilla loss, and the entropy (and KL) terms' agg_loss
    assert op_calls["logprobs"] == 1 and op_calls["entropy"] == 1 and op_calls["policy_loss"] == 1
    assert op_calls["token_kl"] == int(use_kl) and op_calls["agg_loss"] == 1 + int(use_kl)
    torch.testing.assert_close(loss_p, loss_o, rtol=1e-5, atol=1e-6)
    assert metrics_p.keys() == metrics_o.keys()
    for k in metrics_o:
        a, b = metrics_p[k], metrics_o[k]
        a, b = (torch.as_tensor(getattr(x, "values", x)).float() for x in (a, b))  # verl Metric objects
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    _assert_same_params(model_p, model_o)


# ---------------------------------------------------------------- OpenRLHF: the actor's loss path


def _orl_actor_step(case, seed=2):
    """openrlhf.models.Actor -> PolicyLoss + KL loss (aggregate_loss) - entropy -> backward -> step,
    as PPOActor.training_step composes them."""
    kl_estimator, unbiased, is_correction = case
    from openrlhf.models import Actor, PolicyLoss, aggregate_loss
    from openrlhf.models.utils import compute_approx_kl

    B, P, R, V = 4, 3, 6, 29
    actor = Actor(_tiny_llama(V), temperature=0.8)
    actor.packing_samples = False  # Actor sets this only when it loads the model itself (OpenRLHF 0.11.2)
    opt = torch.optim.SGD(actor.parameters(), lr=0.1)
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    sequences = torch.randint(0, V, (B, P + R), generator=g)
    attention_mask = torch.ones(B, P + R, dtype=torch.long)
    action_mask = torch.ones(B, R, dtype=torch.bool)
    action_mask[0, 5:] = False
    action_mask[2, 3:] = False
    log_probs, output = actor(sequences, action_mask, attention_mask=attention_mask, return_output=True,
                              return_entropy=True)
    old = log_probs.detach() + 0.05 * torch.randn(B, R, generator=g)
    base = old - 0.1 * torch.randn(B, R, generator=g).abs()
    rollout = old + 0.1 * torch.randn(B, R, generator=g)
    loss_fn = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, is_correction_level="token" if is_correction else "off",
                         is_correction_threshold=(0.9, 1.1))
    actor_loss, clip_ratio, ppo_kl, _, _ = loss_fn(log_probs, old, torch.randn(B, R, generator=g),
                                                   action_mask=action_mask, rollout_log_probs=rollout)
    kl = compute_approx_kl(log_probs, base, log_probs_old=old, kl_estimator=kl_estimator, unbiased_gradient=unbiased)
    kl_loss = aggregate_loss(kl, action_mask)
    entropy_loss = aggregate_loss(output.entropy[:, -R:], action_mask)
    loss = actor_loss + 0.05 * kl_loss - 0.01 * entropy_loss
    loss.backward()
    opt.step()
    stats = torch.stack([actor_loss.detach(), clip_ratio, ppo_kl, kl_loss.detach(), entropy_loss.detach()])
    return stats, actor


@pytest.mark.parametrize("case", [("k1", False, False), ("k3", True, True)], ids=lambda c: "-".join(map(str, c)))
def test_openrlhf_actor_update_matches(openrlhf_integration, backend, case, op_calls):
    """(kl_estimator, unbiased_gradient, token-level IS correction) through Actor and the losses."""
    stats_o, actor_o = _orl_actor_step(case)
    openrlhf_integration.patch()
    stats_p, actor_p = _orl_actor_step(case)
    # Actor: log-probs and entropy; PolicyLoss; the KL; aggregate_loss for the KL and entropy terms
    assert op_calls["logprobs"] == 1 and op_calls["entropy"] == 1 and op_calls["policy_loss"] == 1
    assert op_calls["token_kl"] == 1 and op_calls["agg_loss"] == 2
    torch.testing.assert_close(stats_p, stats_o, rtol=1e-5, atol=1e-6)
    _assert_same_params(actor_p, actor_o)


def test_openrlhf_experience_gae_matches(openrlhf_integration, backend):
    from openrlhf.models.utils import compute_approx_kl, compute_reward
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    B, R = 5, 9
    mask = make_mask(B, R)
    logp, base, values = torch.randn(B, R), torch.randn(B, R), torch.randn(B, R)
    outs = []
    for use_patch in (False, True):
        if use_patch:
            openrlhf_integration.patch()
        kl = compute_approx_kl(logp, base, kl_estimator="k3")
        g = torch.Generator(torch.get_default_device()).manual_seed(3)
        reward = compute_reward(torch.randn(B, generator=g), 0.05, kl,
                                action_mask=mask)
        outs.append(RemoteExperienceMaker.get_advantages_and_returns(None, copy.deepcopy(values), reward, mask,
                                                                     0.99, 0.95))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
