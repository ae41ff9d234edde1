"""fastrlhf gives the numbers of verl's `core_algos` and OpenRLHF, with the options DESIGN.md names.

The peers are not dependencies: their formulas are written out below from their published code
(verl: verl/trainer/ppo/core_algos.py and verl/utils/torch_functional.py; OpenRLHF:
openrlhf/models/utils.py compute_approx_kl and the experience maker's get_advantages_and_returns),
kept as close to the original lines as the test allows, and run in float64.
"""

import pytest
import torch

from fastrlhf import ops

ATOL = 1e-5

# ---------------------------------------------------------------- verl, written out


def verl_masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / (mask.sum(axis=axis) + 1e-8)


def verl_masked_var(values, mask, unbiased=True):
    mean = verl_masked_mean(values, mask)
    variance = verl_masked_mean((values - mean) ** 2, mask)
    if unbiased:
        mask_sum = mask.sum()
        variance = variance * (mask_sum / (mask_sum - 1))
    return variance


def verl_masked_whiten(values, mask, shift_mean=True):
    mean, var = verl_masked_mean(values, mask), verl_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def verl_compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    nextvalues = 0
    lastgaelam = 0
    advantages_reversed = []
    gen_len = token_level_rewards.shape[-1]
    for t in reversed(range(gen_len)):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        # skip values and TD-error on observation tokens
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    advantages = verl_masked_whiten(advantages, response_mask)
    return advantages, returns


def verl_kl_penalty(logprob, ref_logprob, kl_penalty):
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = ratio - kl - 1
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError(kl_penalty)


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode):
    if loss_agg_mode == "token-mean":
        return verl_masked_mean(loss_mat, loss_mask)
    if loss_agg_mode == "seq-mean-token-sum":
        return torch.mean(torch.sum(loss_mat * loss_mask, dim=-1))
    if loss_agg_mode == "seq-mean-token-mean":
        return torch.mean(torch.sum(loss_mat * loss_mask, dim=-1) / torch.sum(loss_mask, dim=-1))
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return torch.sum(torch.sum(loss_mat * loss_mask, dim=-1)) / loss_mask.shape[-1]
    raise ValueError(loss_agg_mode)


def verl_compute_policy_loss_vanilla(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode,
    cliprange_low,
    cliprange_high,
    clip_ratio_c,
):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def verl_clip_by_value(x, tensor_min, tensor_max):
    return torch.max(torch.min(x, tensor_max), tensor_min)


def verl_compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode):
    vpredclipped = verl_clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * verl_agg_loss(clipped_vf_losses, response_mask, loss_agg_mode)
    vf_clipfrac = verl_masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


# ---------------------------------------------------------------- OpenRLHF, written out


def openrlhf_compute_approx_kl(log_probs, log_probs_base, kl_estimator="k1"):
    log_ratio = log_probs - log_probs_base  # OpenRLHF upcasts with .float(); the test runs in float64
    if kl_estimator == "k2":
        log_ratio = log_ratio**2 / 2.0
    if kl_estimator == "k3":
        log_ratio = -log_ratio
        log_ratio = log_ratio.exp() - 1 - log_ratio
    return log_ratio.clamp(min=-10, max=10)


def openrlhf_get_advantages_and_returns(values, rewards, action_mask, gamma, lambd):
    lastgaelam = 0
    advantages_reversed = []
    response_length = rewards.size(1)
    values = action_mask * values
    rewards = action_mask * rewards
    for t in reversed(range(response_length)):
        nextvalues = values[:, t + 1] if t < response_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lambd * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return advantages, returns


# ---------------------------------------------------------------- inputs


def response_mask(B, T):
    """verl-style right-padded responses plus one observation gap; every row has a token."""
    lengths = torch.randint(T // 2, T + 1, (B,))
    m = (torch.arange(T) < lengths[:, None]).double()
    m[0, 2:4] = 0.0  # tool-output tokens inside the response (verl skips them)
    return m


def assert_close(name, got, want, atol=ATOL):
    got, want = got.detach().double(), want.detach().double()
    err = (got - want).abs().max().item()
    assert err <= atol, f"{name}: max |diff| {err:.3e} > {atol:.1e}"


# ---------------------------------------------------------------- verl


def test_verl_gae_skip_mode_with_whitening(backend):
    B, T = 4, 11
    rewards, values, mask = torch.randn(B, T).double(), torch.randn(B, T).double(), response_mask(B, T)
    want_adv, want_ret = verl_compute_gae_advantage_return(rewards, values, mask, gamma=0.99, lam=0.95)
    adv, ret = ops.gae(rewards.float(), values.float(), mask.bool(), gamma=0.99, lam=0.95)
    on = mask.bool()  # verl leaves whatever is under the mask; fastrlhf writes 0 there
    assert_close("advantages", adv[on], want_adv[on])
    assert_close("returns", ret[on], want_ret[on])


def test_verl_gae_hand_worked():
    # gamma = lam = 1, one row [1, 1, 0(gap), 1], r = [0, 0, 0, 1], V = [0.5, 0.25, 7, 0.5]:
    # A3 = 1 - 0.5 = 0.5; A1 = 0 + 0.5 - 0.25 + 0.5 = 0.75; A0 = 0 + 0.25 - 0.5 + 0.75 = 0.5
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.25, 7.0, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]], dtype=torch.float64)
    raw = verl_compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)[1] - values
    assert raw[0, [0, 1, 3]].tolist() == [0.5, 0.75, 0.5]
    adv, _ = ops.gae(rewards.float(), values.float(), mask, whiten=False)
    assert adv[0].tolist() == [0.5, 0.75, 0.0, 0.5]


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "low_var_kl"])
def test_verl_kl_penalty(backend, estimator):
    logp = -torch.rand(3, 13).double() * 5
    ref_logp = logp + torch.randn(3, 13).double() * 2
    ref_logp[0, :3] = logp[0, :3] + torch.tensor([30.0, -30.0, 12.0])  # beyond both clamps
    clamp = 10.0 if estimator == "low_var_kl" else None  # verl clamps only low_var_kl, to +-10
    got = ops.token_kl(logp.float(), ref_logp.float(), estimator=estimator, clamp=clamp)
    want = verl_kl_penalty(logp, ref_logp, estimator)
    assert_close(estimator, got, want, atol=ATOL * max(1.0, want.abs().max().item()))


def test_verl_apply_kl_penalty_rewards(backend):
    # verl: token_level_rewards = token_level_scores - beta * kld * response_mask, with the score on the
    # last response token of each (right-padded) row
    B, T = 3, 9
    logp, ref_logp = -torch.rand(B, T).double() * 3, -torch.rand(B, T).double() * 3
    mask = (torch.arange(T) < torch.tensor([[9], [5], [1]])).double()
    scores = torch.randn(B).double()
    token_level_scores = torch.zeros(B, T, dtype=torch.float64)
    token_level_scores[torch.arange(B), mask.sum(-1).long() - 1] = scores
    want = token_level_scores - 0.1 * verl_kl_penalty(logp, ref_logp, "low_var_kl") * mask
    got = ops.kl_shaped_rewards(
        scores.float(),
        logp.float(),
        ref_logp.float(),
        mask.bool(),
        kl_coef=0.1,
        estimator="low_var_kl",
        clamp=10.0,
    )
    assert_close("rewards", got, want)


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_verl_policy_loss_vanilla_dual_clip(backend, agg):
    B, T = 4, 13
    logp = -torch.rand(B, T).double() * 3
    old_logp = logp + torch.randn(B, T).double() * 0.5
    adv = torch.randn(B, T).double()
    old_logp[:, 0] = logp[:, 0] - 1.5  # ratio e^1.5 > clip_ratio_c = 3 ...
    adv[:, 0] = -adv[:, 0].abs()  # ... with A < 0: dual-clipped
    mask = response_mask(B, T)
    lp64 = logp.clone().requires_grad_()
    want = verl_compute_policy_loss_vanilla(old_logp, lp64, adv, mask, agg, 0.2, 0.28, 3.0)
    want[0].backward()
    lp = logp.float().requires_grad_()
    loss, stats = ops.policy_loss(
        lp, old_logp.float(), adv.float(), mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg=agg
    )
    loss.backward()
    assert_close("pg_loss", loss, want[0])
    assert_close("d_logp", lp.grad, lp64.grad)
    assert_close("pg_clipfrac", stats["clipfrac"], want[1])
    assert_close("ppo_kl", stats["approx_kl"], want[2])
    assert_close("pg_clipfrac_lower", stats["clipfrac_lower"], want[3])
    assert want[1] > 0 and want[3] > 0  # the data exercises both clips


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_verl_value_loss(backend, agg):
    B, T = 4, 13
    vpreds = torch.randn(B, T).double()
    values = vpreds + torch.randn(B, T).double() * 0.4
    returns = torch.randn(B, T).double()
    mask = response_mask(B, T)
    v64 = vpreds.clone().requires_grad_()
    want_loss, want_frac = verl_compute_value_loss(v64, returns, values, mask, 0.2, agg)
    want_loss.backward()
    v = vpreds.float().requires_grad_()
    loss, stats = ops.value_loss(v, values.float(), returns.float(), mask, clip=0.2, agg=agg)
    loss.backward()
    assert_close("vf_loss", loss, want_loss)
    assert_close("d_vpreds", v.grad, v64.grad)
    assert_close("vf_clipfrac", stats["clipfrac"], want_frac)
    assert want_frac > 0


# ---------------------------------------------------------------- OpenRLHF


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_openrlhf_compute_approx_kl(backend, estimator):
    logp = -torch.rand(3, 13).double() * 5
    ref_logp = logp + torch.randn(3, 13).double() * 3
    ref_logp[0, :2] = logp[0, :2] + torch.tensor([15.0, -15.0])
    want = openrlhf_compute_approx_kl(logp, ref_logp, estimator)
    got = ops.token_kl(logp.float(), ref_logp.float(), estimator=estimator, clamp=10.0)
    assert_close(estimator, got, want)
    assert (want.abs() == 10).any()  # the clamp is exercised


def test_openrlhf_gae_zero_mode(backend):
    B, T = 4, 11
    rewards, values, mask = torch.randn(B, T).double(), torch.randn(B, T).double(), response_mask(B, T)
    want_adv, want_ret = openrlhf_get_advantages_and_returns(values, rewards, mask, gamma=0.99, lambd=0.95)
    adv, ret = ops.gae(
        rewards.float(), values.float(), mask, gamma=0.99, lam=0.95, mask_mode="zero", whiten=False
    )
    on = mask.bool()
    assert_close("advantages", adv[on], want_adv[on])
    assert_close("returns", ret[on], want_ret[on])
