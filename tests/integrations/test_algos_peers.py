"""Outcome advantages and DPO losses against the installed peers' own code: verl 0.9.1's
estimators, OpenRLHF 0.11.2's experience maker and DPOLoss, TRL 1.16's DPOTrainer._compute_loss.

The peers run in float64 where their code allows it, so the comparisons are tight. TRL's GRPO
and RLOO advantages sit inside a 300-line generation method; their lines are written out below
(trl/trainer/grpo_trainer.py ~2760-2810, rloo_trainer.py ~1674-1699) around TRL's own `nanstd`.
"""

import types
from collections import defaultdict

import numpy as np
import pytest
import torch

from fastrlhf import ops, reference

B, G, T = 12, 4, 9


@pytest.fixture(params=["reference", "op"])
def ref(request):
    """The float64 reference and the public op (run in float64 here), each against the peers."""
    return reference if request.param == "reference" else ops


def make_mask(B, T):
    """Right padding of random lengths (>= 2 tokens), one row with a gap, as rollouts give."""
    lengths = torch.randint(2, T + 1, (B,))
    mask = torch.arange(T) < lengths[:, None]
    mask[1, 1] = False
    return mask


def make_scores(B):
    """Random scores with one group of equal scores (rows 0..G-1) and two tied values elsewhere."""
    s = torch.randn(B, dtype=torch.float64)
    s[:G] = 0.5
    s[G + 1] = s[G + 2]
    return s


def last_token_rewards(scores, mask):
    """[B, T]: the score on each row's last mask=1 token, as verl's reward manager places it."""
    T = mask.shape[1]
    last = T - 1 - mask.long().flip(-1).argmax(-1)
    out = torch.zeros(mask.shape, dtype=scores.dtype)
    out[torch.arange(len(scores)), last] = scores
    return out


# ---------------------------------------------------------------- verl


@pytest.fixture
def core_algos():
    pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed (.ci/install_peers.sh)")
    import verl.trainer.ppo.core_algos as core_algos

    return core_algos


def verl_index(B, G):
    """verl's uid array (strings), groups of G laid out in a shuffled order, and the same
    groups as integer ids for fastrlhf."""
    perm = torch.randperm(B)
    ints = (torch.arange(B) // G)[perm]
    return np.array([f"uid-{i}" for i in ints.tolist()], dtype=object), ints


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("group", [G, 1])
def test_verl_grpo(ref, core_algos, norm_by_std, group):
    scores, mask = make_scores(B), make_mask(B, T)
    index, ids = verl_index(B, group)
    want, _ = core_algos.compute_grpo_outcome_advantage(last_token_rewards(scores, mask), mask.double(), index,
                                                         norm_adv_by_std_in_grpo=norm_by_std)
    got = ref.outcome_advantages(scores, mask, group_ids=ids, estimator="grpo" if norm_by_std else "dr_grpo")
    # a singleton's std is verl's float32 torch.tensor(1.0): 1 + eps rounds to 1 + 9.5e-7 (relative 5e-8)
    torch.testing.assert_close(got, want, rtol=1e-7 if group == 1 else 0, atol=1e-12)


@pytest.mark.parametrize("group", [G, 1])
def test_verl_grpo_vectorized(ref, core_algos, group):
    """The vectorized version computes in float32 (group_mean_std casts): compared at float32 precision."""
    scores, mask = make_scores(B), make_mask(B, T)
    index, ids = verl_index(B, group)
    want, _ = core_algos.compute_grpo_vectorized_outcome_advantage(last_token_rewards(scores, mask).float(),
                                                                    mask.float(), index)
    got = ref.outcome_advantages(scores, mask, group_ids=ids, estimator="grpo")
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [G, 3, 1])
def test_verl_rloo_both_singleton_conventions(ref, core_algos, group):
    scores, mask = make_scores(B), make_mask(B, T)
    index, ids = verl_index(B, group)
    rewards = last_token_rewards(scores, mask)
    loop, _ = core_algos.compute_rloo_outcome_advantage(rewards, mask.double(), index)
    vectorized, _ = core_algos.compute_rloo_vectorized_outcome_advantage(rewards, mask.double(), index)
    got = ref.outcome_advantages(scores, mask, group_ids=ids, estimator="rloo", singleton="score")
    torch.testing.assert_close(got, loop, rtol=0, atol=1e-12)
    got = ref.outcome_advantages(scores, mask, group_ids=ids, estimator="rloo", singleton="zero")
    torch.testing.assert_close(got, vectorized, rtol=0, atol=1e-12)


def test_verl_reinforce_plus_plus(ref, core_algos):
    """verl's masked_mean divides by n + 1e-8 (fastrlhf by n): a relative 1e-8 / n shift of the
    mean, below 1e-9 here; hence atol 1e-9 instead of 1e-12."""
    scores, mask = make_scores(B), make_mask(B, T)
    want, _ = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        last_token_rewards(scores, mask), mask.double(), config=types.SimpleNamespace(gamma=1.0))
    got = ref.outcome_advantages(scores, mask, estimator="reinforce_pp")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


@pytest.mark.parametrize("group", [G, 1])
def test_verl_reinforce_plus_plus_baseline(ref, core_algos, group):
    scores, mask = make_scores(B), make_mask(B, T)
    index, ids = verl_index(B, group)
    want, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        last_token_rewards(scores, mask), mask.double(), index)
    got = ref.outcome_advantages(scores, mask, group_ids=ids, estimator="reinforce_pp_baseline")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


# ---------------------------------------------------------------- OpenRLHF


@pytest.fixture
def openrlhf_maker():
    pytest.importorskip("openrlhf.trainer.ppo_utils.experience_maker", reason="OpenRLHF is not installed")
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    return RemoteExperienceMaker


def openrlhf_advantages(maker, estimator, scores, mask, n_samples):
    """OpenRLHF's compute_advantages_and_returns on two experiences holding the samples in a
    shuffled order (`index` = original positions), KL coefficient 0; returns [B, T] in the
    original order."""
    args = types.SimpleNamespace(
        algo=types.SimpleNamespace(advantage=types.SimpleNamespace(estimator=estimator, gamma=1.0, lambd=1.0,
                                                                   no_std_norm=False)),
        rollout=types.SimpleNamespace(n_samples_per_prompt=n_samples),
        reward=types.SimpleNamespace(clip_range=None),
    )
    self = types.SimpleNamespace(strategy=types.SimpleNamespace(args=args), advantage_estimator=estimator,
                                 kl_ctl=types.SimpleNamespace(value=0.0))
    self.get_cumulative_returns = types.MethodType(maker.get_cumulative_returns, self)
    order = torch.randperm(len(scores))
    experiences = []
    for part in order.chunk(2):
        experiences.append(types.SimpleNamespace(
            rewards=scores[part].clone(), index=part.tolist(), action_mask=mask[part].clone(),
            kl=torch.zeros(len(part), mask.shape[1], dtype=scores.dtype), info={}))
    maker.compute_advantages_and_returns(self, experiences)
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for exp in experiences:
        out[exp.index] = exp.advantages.double()
    return out


@pytest.mark.parametrize("estimator,ours", [
    ("group_norm", dict(estimator="grpo", eps=1e-9)),
    ("dr_grpo", dict(estimator="dr_grpo")),
    ("rloo", dict(estimator="rloo")),
    ("reinforce_baseline", dict(estimator="reinforce_pp_baseline", unbiased=False, var_eps_mode="clamp")),
])
def test_openrlhf_estimators(ref, openrlhf_maker, estimator, ours):
    """OpenRLHF leaves the score on masked positions before each row's last token; on the mask
    the numbers are the same. Its normalisation runs in float32 (`.float()`)."""
    scores, mask = make_scores(B), make_mask(B, T)
    want = openrlhf_advantages(openrlhf_maker, estimator, scores, mask, G)
    got = ref.outcome_advantages(scores, mask, group_size=G, **ours)
    atol = 1e-6 if estimator == "reinforce_baseline" else 1e-12
    torch.testing.assert_close(got, want * mask, rtol=0, atol=atol)


# ---------------------------------------------------------------- TRL GRPO and RLOO, written out


# TRL's nanstd forms Bessel's count / (count - 1) from integer counts, in float32 whatever the
# input dtype: n / (n - 1) is off by up to 6e-8 relative, its square root by 3e-8.
NANSTD_RTOL = 3e-8


@pytest.fixture
def nanstd():
    pytest.importorskip("trl.trainer.utils", reason="TRL is not installed")
    from trl.trainer.utils import nanstd

    return nanstd


def trl_grpo_advantages(rewards, num_generations, scale_rewards, nanstd):
    """grpo_trainer.py, multi_objective_aggregation == "sum_then_normalize" (the default)."""
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    elif scale_rewards == "batch":
        if rewards.numel() > 1:
            std_rewards = nanstd(rewards).expand_as(rewards)
        else:
            std_rewards = torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def trl_rloo_advantages(rewards, num_generations, normalize_advantages, nanstd):
    """rloo_trainer.py (every completion scorable)."""
    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    if num_generations > 1:
        baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
        advantages = rewards - baselines.view(-1)
    else:
        advantages = torch.zeros_like(rewards)
    if normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("group", [G, 1])
def test_trl_grpo(ref, nanstd, scale_rewards, group):
    scores, mask = make_scores(B), make_mask(B, T)
    want = trl_grpo_advantages(scores, group, scale_rewards, nanstd)
    kw = dict(estimator="dr_grpo") if scale_rewards == "none" else dict(estimator="grpo", scale=scale_rewards)
    got = ref.outcome_advantages(scores, mask, group_size=group, eps=1e-4, singleton="zero", **kw)
    torch.testing.assert_close(got, want[:, None] * mask, rtol=NANSTD_RTOL, atol=1e-12)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("group", [G, 1])
def test_trl_rloo(ref, nanstd, normalize, group):
    scores, mask = make_scores(B), make_mask(B, T)
    want = trl_rloo_advantages(scores, group, normalize, nanstd)
    got = ref.outcome_advantages(scores, mask, group_size=group, estimator="rloo", singleton="zero", eps=1e-4,
                                 whiten="sequences" if normalize else "none")
    torch.testing.assert_close(got, want[:, None] * mask, rtol=NANSTD_RTOL, atol=1e-12)


# ---------------------------------------------------------------- DPO


def dpo_inputs(n):
    logp = -torch.rand(4, n, dtype=torch.float64) * 20
    logp[2:] += torch.randn(2, n, dtype=torch.float64)  # reference near the policy
    return tuple(logp)


@pytest.mark.parametrize("ipo,label_smoothing", [(False, 0.0), (False, 0.2), (True, 0.0)])
def test_openrlhf_dpo_loss(ref, ipo, label_smoothing):
    pytest.importorskip("openrlhf.models.loss", reason="OpenRLHF is not installed")
    from openrlhf.models.loss import DPOLoss

    c, r, rc, rr = dpo_inputs(16)
    want, want_c, want_r = DPOLoss(0.3, label_smoothing, ipo)(c, r, rc, rr)
    got, stats = ref.dpo_loss(c, r, rc, rr, beta=0.3, loss_type="ipo" if ipo else "sigmoid",
                              label_smoothing=label_smoothing)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(stats["reward_chosen"], want_c.mean(), rtol=0, atol=1e-12)
    torch.testing.assert_close(stats["reward_rejected"], want_r.mean(), rtol=0, atol=1e-12)
    torch.testing.assert_close(stats["reward_accuracy"], (want_c > want_r).double().mean(), rtol=0, atol=0)


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


def trl_dpo_loss(loss_type, beta, label_smoothing, per_token_logps, ref_chosen, ref_rejected, completion_mask):
    """TRL's DPOTrainer._compute_loss itself, on a trainer built without __init__ and a model stub
    that returns the given per-token log-probs (the fused LM head's `log_probs`); the reference
    sums come precomputed, as with `precompute_ref_logps=True`. Returns (loss, metrics)."""
    from trl.trainer.dpo_trainer import DPOTrainer

    class Model:
        training = True

        def __call__(self, input_ids, **kwargs):
            n, L = input_ids.shape
            return types.SimpleNamespace(log_probs=per_token_logps, entropy=torch.zeros(n, L - 1),
                                         mean_logits=torch.zeros(n, L - 1),
                                         is_top1=torch.zeros(n, L - 1, dtype=torch.bool))

    trainer = DPOTrainer.__new__(DPOTrainer)
    trainer.__dict__.update(
        model=Model(), accelerator=_Accelerator(), aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=label_smoothing, use_weighting=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1)
    n, L = completion_mask.shape
    inputs = {"input_ids": torch.zeros(n, L, dtype=torch.long), "attention_mask": torch.ones(n, L, dtype=torch.long),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type,label_smoothing", [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0),
                                                       ("robust", 0.1)])
def test_trl_dpo_trainer_compute_loss(ref, loss_type, label_smoothing):
    pytest.importorskip("trl.trainer.dpo_trainer", reason="TRL is not installed")
    n, L, beta = 6, 10, 0.2
    lengths = torch.randint(1, L - 2, (2 * n,))
    completion_mask = (torch.arange(L) >= L - 1 - lengths[:, None]).long()  # prompt first, then the completion
    per_token = -torch.rand(2 * n, L - 1, dtype=torch.float64) * 3 * completion_mask[:, 1:]
    ref_chosen = per_token[:n].sum(1) + torch.randn(n, dtype=torch.float64)
    ref_rejected = per_token[n:].sum(1) + torch.randn(n, dtype=torch.float64)
    want, metrics = trl_dpo_loss(loss_type, beta, label_smoothing, per_token, ref_chosen, ref_rejected,
                                 completion_mask)
    seq = per_token.sum(1)
    lengths_kw = {}
    if loss_type == "ipo":  # TRL normalises IPO by the completion token counts
        lengths_kw = dict(chosen_lengths=completion_mask[:n].sum(1), rejected_lengths=completion_mask[n:].sum(1))
    got, stats = ref.dpo_loss(seq[:n], seq[n:], ref_chosen, ref_rejected, beta=beta, loss_type=loss_type,
                              label_smoothing=label_smoothing, **lengths_kw)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for ours, theirs in (("reward_chosen", "rewards/chosen"), ("reward_rejected", "rewards/rejected"),
                         ("reward_margin", "rewards/margins"), ("reward_accuracy", "rewards/accuracies"),
                         ("logp_chosen", "logps/chosen"), ("logp_rejected", "logps/rejected")):
        # TRL averages the accuracy as float32 (`.float().mean()`)
        tol = 1e-7 if ours == "reward_accuracy" else 1e-12
        assert stats[ours].item() == pytest.approx(metrics[theirs], abs=tol), ours
