"""fastrlhf gives the numbers of verl's `core_algos`, OpenRLHF and TRL, with the options docs/ops.md names.

The peers are not dependencies: their formulas are written out below from their released code,
read from the wheels (verl 0.9.1: verl/trainer/ppo/core_algos.py agg_loss, kl_penalty,
compute_policy_loss_vanilla, compute_value_loss, and verl/utils/torch_functional.py masked_sum /
masked_mean; OpenRLHF 0.11.2: openrlhf/models/utils.py compute_approx_kl, openrlhf/models/loss.py
PolicyLoss, and the experience maker's get_advantages_and_returns; TRL 1.16: trl/trainer/utils.py
selective_log_softmax, entropy_from_logits), kept as close to the original lines as the test allows,
and run in float64.
"""

import pytest
import torch

from fastrlhf import ops

ATOL = 1e-5

# ---------------------------------------------------------------- verl, written out


def verl_masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def verl_masked_mean(values, mask, axis=None):
    s = verl_masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


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


def verl_kl_penalty_forward(logprob, ref_logprob, kl_penalty):
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


def verl_kl_penalty(logprob, ref_logprob, kl_penalty):
    base_kl_penalty = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    forward_score = verl_kl_penalty_forward(logprob, ref_logprob, base_kl_penalty)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward_score
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                  loss_scale_factor=None):
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = loss_mask.sum()
        loss = verl_masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "token-sum":
        loss = verl_masked_sum(loss_mat, loss_mask) * dp_size
    elif loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)  # token-sum
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            global_batch_size = seq_mask.sum()
        loss = verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None:
                horizon = loss_mask.shape[-1]
                loss_scale_factor = horizon
            loss /= loss_scale_factor
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)  # per-sequence token count
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)  # token-mean
        seq_mask = (seq_mask > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            global_batch_size = seq_mask.sum()
        loss = verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return loss


def verl_compute_policy_loss_vanilla(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode,
    cliprange_low,
    cliprange_high,
    clip_ratio_c,
    rollout_is_weights=None,
    global_batch_info=None,
):
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
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
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode, **(global_batch_info or {}))
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def verl_clip_by_value(x, tensor_min, tensor_max):
    return torch.max(torch.min(x, tensor_max), tensor_min)


def verl_compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode,
                            global_batch_info=None):
    vpredclipped = verl_clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * verl_agg_loss(clipped_vf_losses, response_mask, loss_agg_mode, **(global_batch_info or {}))
    vf_clipfrac = verl_masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


# ---------------------------------------------------------------- OpenRLHF, written out


KL_IS_WEIGHT_CLIP = 10.0


def openrlhf_compute_approx_kl(log_probs, log_probs_base, log_probs_old=None, kl_estimator="k1",
                               unbiased_gradient=False):
    log_ratio = log_probs - log_probs_base  # OpenRLHF upcasts with .float(); the test runs in float64
    if kl_estimator == "k1":
        value = log_ratio
    elif kl_estimator == "k2":
        value = log_ratio**2 / 2.0
    elif kl_estimator == "k3":
        k3_log_ratio = log_ratio.clamp(min=-10)
        value = (-k3_log_ratio).exp() - 1 + k3_log_ratio
    else:
        raise ValueError(f"Unknown kl_estimator: {kl_estimator}")
    value = value.clamp(min=-10, max=10)
    if not unbiased_gradient:
        return value
    if log_probs_old is None:
        w = 1.0
    else:
        w = (log_probs - log_probs_old).exp().clamp(max=KL_IS_WEIGHT_CLIP).detach()
    grad_surrogate = w * (log_ratio**2 / 2.0)
    return value.detach() + grad_surrogate - grad_surrogate.detach()


def openrlhf_masked_mean(tensor, mask, dim=None):
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


def openrlhf_policy_loss_ppo(log_probs, old_log_probs, advantages, action_mask, clip_eps_low, clip_eps_high,
                             dual_clip=None):
    """PolicyLoss.forward, policy_loss_type="ppo", is_correction_level="off", token_level_loss=True."""
    raw_policy_log_ratio = log_probs - old_log_probs
    policy_log_ratio = raw_policy_log_ratio.clamp(min=-20.0, max=20.0)
    ratio = policy_log_ratio.exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high) * advantages
    if dual_clip is None:
        loss = -torch.min(surr1, surr2)
    else:
        clip1 = torch.min(surr1, surr2)
        clip2 = torch.max(clip1, dual_clip * advantages)
        loss = -torch.where(advantages < 0, clip2, clip1)
    loss = openrlhf_masked_mean(loss, action_mask, dim=None)  # aggregate_loss, token level, no global count
    clip_ratio = openrlhf_masked_mean(torch.lt(surr2, surr1).float(), action_mask, dim=None)
    ppo_kl = openrlhf_masked_mean(-raw_policy_log_ratio.detach(), action_mask, dim=None)
    return loss, clip_ratio, ppo_kl


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


# verl's global_batch_info -> fastrlhf's keywords
VERL_TO_OURS = {"batch_num_tokens": "global_num_tokens", "global_batch_size": "global_num_seqs", "dp_size": "dp_size",
                "loss_scale_factor": "loss_scale_factor"}
AGG_CASES = [
    ("token-mean", {}),
    ("token-mean", {"dp_size": 4, "batch_num_tokens": 173}),
    ("token-sum", {}),
    ("token-sum", {"dp_size": 2}),
    ("seq-mean-token-sum", {}),
    ("seq-mean-token-sum", {"dp_size": 2, "global_batch_size": 11}),
    ("seq-mean-token-mean", {}),
    ("seq-mean-token-mean", {"dp_size": 3, "global_batch_size": 9}),
    ("seq-mean-token-sum-norm", {}),
    ("seq-mean-token-sum-norm", {"loss_scale_factor": 4096}),
    ("seq-mean-token-sum-norm", {"dp_size": 2, "global_batch_size": 10, "loss_scale_factor": 100}),
]


def _ours(info):
    return {VERL_TO_OURS[k]: v for k, v in info.items()}


def masked_rows(B, T):
    """response_mask plus a fully masked last row: verl's sequence means leave it out."""
    m = response_mask(B, T)
    m[-1] = 0.0
    return m


@pytest.mark.parametrize("agg,info", AGG_CASES)
def test_verl_agg_loss(backend, agg, info):
    B, T = 5, 13
    loss_mat = torch.randn(B, T).double()
    mask = masked_rows(B, T)
    x64 = loss_mat.clone().requires_grad_()
    want = verl_agg_loss(x64, mask, agg, **info)
    (want_grad,) = torch.autograd.grad(want, x64)
    x = loss_mat.float().requires_grad_()
    got = ops.agg_loss(x, mask, agg=agg, **_ours(info))
    (got_grad,) = torch.autograd.grad(got, x)
    assert_close("loss", got, want)
    assert_close("d_loss_mat", got_grad, want_grad)


def test_verl_agg_loss_nan_off_the_mask(backend):
    """verl's masked_sum ignores NaN where mask = 0 (token modes); fastrlhf does so in every mode."""
    B, T = 5, 13
    loss_mat = torch.randn(B, T).double()
    mask = masked_rows(B, T)
    noisy = torch.where(mask.bool(), loss_mat, float("nan"))
    for agg in ("token-mean", "token-sum"):
        assert_close(agg, ops.agg_loss(noisy.float(), mask, agg=agg), verl_agg_loss(noisy, mask, agg))
    for agg in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        got = ops.agg_loss(noisy.float(), mask, agg=agg)
        assert_close(agg, got, verl_agg_loss(loss_mat, mask, agg))  # verl gives NaN here


@pytest.mark.parametrize("estimator", ["k1+", "k2+", "k3+", "low_var_kl+", "abs+", "mse+"])
def test_verl_straight_through_kl_penalty(backend, estimator):
    """kl_penalty("k3+"): the estimator's value, the gradient of k2 (r): straight_through=True."""
    logp = -torch.rand(3, 13).double() * 5
    ref_logp = logp + torch.randn(3, 13).double() * 2
    ref_logp[0, :3] = logp[0, :3] + torch.tensor([30.0, -30.0, 12.0])  # beyond both clamps
    base = estimator[:-1]
    clamp = 10.0 if base in ("low_var_kl", "k3") else None  # verl clamps only low_var_kl / k3, to +-10
    lp64, rp64 = logp.clone().requires_grad_(), ref_logp.clone().requires_grad_()
    want = verl_kl_penalty(lp64, rp64, estimator)
    g = torch.randn(3, 13).double()
    want_grads = torch.autograd.grad(want, (lp64, rp64), g)
    lp, rp = logp.float().requires_grad_(), ref_logp.float().requires_grad_()
    got = ops.token_kl(lp, rp, estimator=base, clamp=clamp, straight_through=True)
    got_grads = torch.autograd.grad(got, (lp, rp), g.float())
    assert_close(estimator, got, want, atol=ATOL * max(1.0, want.abs().max().item()))
    for name, a, b in zip(("d_logp", "d_ref_logp"), got_grads, want_grads):
        assert_close(name, a, b, atol=ATOL * max(1.0, b.abs().max().item()))


@pytest.mark.parametrize("agg,info", AGG_CASES)
@pytest.mark.parametrize("is_weights", [False, True])
def test_verl_policy_loss_vanilla_dual_clip(backend, agg, info, is_weights):
    B, T = 5, 13
    logp = -torch.rand(B, T).double() * 3
    old_logp = logp + torch.randn(B, T).double() * 0.5
    adv = torch.randn(B, T).double()
    old_logp[:, 0] = logp[:, 0] - 1.5  # ratio e^1.5 > clip_ratio_c = 3 ...
    adv[:, 0] = -adv[:, 0].abs()  # ... with A < 0: dual-clipped
    mask = masked_rows(B, T)
    weights = torch.rand(B, T).double() * 2 if is_weights else None  # verl's rollout_is_weights
    lp64 = logp.clone().requires_grad_()
    want = verl_compute_policy_loss_vanilla(old_logp, lp64, adv, mask, agg, 0.2, 0.28, 3.0, weights, info)
    want[0].backward()
    lp = logp.float().requires_grad_()
    loss, stats = ops.policy_loss(lp, old_logp.float(), adv.float(), mask, clip_low=0.2, clip_high=0.28,
                                  dual_clip=3.0, is_weights=None if weights is None else weights.float(), agg=agg,
                                  **_ours(info))
    loss.backward()
    assert_close("pg_loss", loss, want[0])
    assert_close("d_logp", lp.grad, lp64.grad)
    assert_close("pg_clipfrac", stats["clipfrac"], want[1])
    assert_close("ppo_kl", stats["approx_kl"], want[2])
    assert_close("pg_clipfrac_lower", stats["clipfrac_lower"], want[3])
    assert want[1] > 0 and want[3] > 0  # the data exercises both clips


@pytest.mark.parametrize("agg,info", AGG_CASES)
def test_verl_value_loss(backend, agg, info):
    B, T = 5, 13
    vpreds = torch.randn(B, T).double()
    values = vpreds + torch.randn(B, T).double() * 0.4
    returns = torch.randn(B, T).double()
    mask = masked_rows(B, T)
    v64 = vpreds.clone().requires_grad_()
    want_loss, want_frac = verl_compute_value_loss(v64, returns, values, mask, 0.2, agg, info)
    want_loss.backward()
    v = vpreds.float().requires_grad_()
    loss, stats = ops.value_loss(v, values.float(), returns.float(), mask, clip=0.2, agg=agg, **_ours(info))
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
    want = openrlhf_compute_approx_kl(logp, ref_logp, kl_estimator=estimator)
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


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("weighted", [False, True])
def test_openrlhf_unbiased_gradient_kl(backend, estimator, weighted):
    """compute_approx_kl(unbiased_gradient=True): the clamped estimator's value, the gradient w * r with
    w = clamp(exp(logp - old_logp), max=10), detached."""
    logp = -torch.rand(3, 13).double() * 5
    ref_logp = logp + torch.randn(3, 13).double() * 3
    ref_logp[0, :2] = logp[0, :2] + torch.tensor([15.0, -15.0])
    old_logp = logp + torch.randn(3, 13).double()
    old_logp[1, :3] = logp[1, :3] - 4.0  # importance weight e^4 > 10: clipped
    lp64 = logp.clone().requires_grad_()
    want = openrlhf_compute_approx_kl(lp64, ref_logp, old_logp if weighted else None, estimator, True)
    g = torch.randn(3, 13).double()
    (want_grad,) = torch.autograd.grad(want, lp64, g)
    w = (logp - old_logp).exp().clamp(max=KL_IS_WEIGHT_CLIP) if weighted else None
    lp = logp.float().requires_grad_()
    got = ops.token_kl(lp, ref_logp.float(), estimator=estimator, clamp=10.0, straight_through=True,
                       grad_weight=None if w is None else w.float())
    (got_grad,) = torch.autograd.grad(got, lp, g.float())
    assert_close(estimator, got, want)
    assert_close("d_logp", got_grad, want_grad, atol=ATOL * max(1.0, want_grad.abs().max().item()))


def test_openrlhf_policy_loss_ppo_kl_unclamped(backend):
    """PolicyLoss's ppo_kl is the mean of the log-ratio before its +-20 clamp: approx_kl_unclamped."""
    B, T = 4, 13
    logp = -torch.rand(B, T).double() * 3
    old_logp = logp + torch.randn(B, T).double() * 0.5
    old_logp[0, :2] = logp[0, :2] + torch.tensor([30.0, -25.0])  # beyond the clamp: the two kl stats differ
    adv = torch.randn(B, T).double()
    mask = response_mask(B, T)
    lp64 = logp.clone().requires_grad_()
    want_loss, want_clip_ratio, want_ppo_kl = openrlhf_policy_loss_ppo(lp64, old_logp, adv, mask, 0.2, 0.28, 3.0)
    want_loss.backward()
    lp = logp.float().requires_grad_()
    loss, stats = ops.policy_loss(lp, old_logp.float(), adv.float(), mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    loss.backward()
    assert_close("loss", loss, want_loss)
    assert_close("d_logp", lp.grad, lp64.grad)
    assert_close("clip_ratio", stats["clipfrac"], want_clip_ratio)
    assert_close("ppo_kl", stats["approx_kl_unclamped"], want_ppo_kl)
    assert abs(stats["approx_kl"].item() - want_ppo_kl.item()) > 0.1  # the clamped one is verl's, not this


# ---------------------------------------------------------------- TRL


def trl_selective_log_softmax(logits, index, temperature=1.0):
    """The plain branch of trl.trainer.utils.selective_log_softmax (float32 / float64 logits)."""
    if temperature != 1.0:
        logits = logits / temperature
    squeeze = index.ndim == logits.ndim - 1
    if squeeze:
        index = index.unsqueeze(-1)
    selected_logits = torch.gather(logits, dim=-1, index=index)
    logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
    per_token_logps = selected_logits - logsumexp_values.unsqueeze(-1)
    if squeeze:
        per_token_logps = per_token_logps.squeeze(-1)
    return per_token_logps


def trl_entropy_from_logits(logits, chunk_size=128):
    original_shape = logits.shape[:-1]
    num_classes = logits.shape[-1]
    flat_logits = logits.reshape(-1, num_classes)
    entropies = []
    for chunk in flat_logits.split(chunk_size, dim=0):
        logps = torch.nn.functional.log_softmax(chunk, dim=-1)
        chunk_entropy = -(torch.exp(logps) * logps).sum(-1)
        entropies.append(chunk_entropy)
    return torch.cat(entropies, dim=0).reshape(original_shape)


@pytest.mark.parametrize("K", [None, 1, 4])
def test_trl_selective_log_softmax(backend, K):
    """labels [..., K] gather K log-probs per position (TRL's top-K form), forward and gradient."""
    B, T, V = 2, 7, 61
    logits = torch.randn(B, T, V).double() * 2
    index = torch.randint(0, V, (B, T) if K is None else (B, T, K))
    x64 = logits.clone().requires_grad_()
    want = trl_selective_log_softmax(x64, index, temperature=0.8)
    g = torch.randn(want.shape).double()
    (want_grad,) = torch.autograd.grad(want, x64, g)
    x = logits.float().requires_grad_()
    got = ops.logprobs(x, index, temperature=0.8)
    (got_grad,) = torch.autograd.grad(got, x, g.float())
    assert got.shape == want.shape
    assert_close("logps", got, want)
    assert_close("d_logits", got_grad, want_grad)


def test_trl_entropy_from_logits(backend):
    logits = torch.randn(3, 5, 71).double() * 3
    x64 = logits.clone().requires_grad_()
    want = trl_entropy_from_logits(x64)
    g = torch.randn(want.shape).double()
    (want_grad,) = torch.autograd.grad(want, x64, g)
    x = logits.float().requires_grad_()
    got = ops.entropy(x)
    (got_grad,) = torch.autograd.grad(got, x, g.float())
    assert_close("entropy", got, want)
    assert_close("d_logits", got_grad, want_grad)
