"""fastrlhf: fast PPO for language models (and critic-free PPO, DPO, and distillation).

The public ops (`fastrlhf.ops`) take the tensors and conventions of verl / OpenRLHF / TRL
and run fused Triton kernels on CUDA tensors, a torch path on CPU. The advantage-estimator
registry is `fastrlhf.ops.ADVANTAGES`.
"""

from fastrlhf.ops import (
    agg_loss,
    decode_attention,
    distill_loss,
    dpo_loss,
    entropy,
    gae,
    kl_shaped_rewards,
    linear_distill_loss,
    linear_dpo_loss,
    linear_logprobs,
    linear_ppo_actor_loss,
    linear_sequence_logprobs,
    logprobs,
    outcome_advantages,
    policy_loss,
    ppo_actor_loss,
    raw_moments,
    register_advantage,
    rollout_correction,
    token_kl,
    topk_distill_loss,
    value_loss,
    whiten,
)

__version__ = "0.1.0"

__all__ = [
    "agg_loss",
    "decode_attention",
    "distill_loss",
    "dpo_loss",
    "entropy",
    "gae",
    "kl_shaped_rewards",
    "linear_distill_loss",
    "linear_dpo_loss",
    "linear_logprobs",
    "linear_ppo_actor_loss",
    "linear_sequence_logprobs",
    "logprobs",
    "outcome_advantages",
    "policy_loss",
    "ppo_actor_loss",
    "raw_moments",
    "register_advantage",
    "rollout_correction",
    "token_kl",
    "topk_distill_loss",
    "value_loss",
    "whiten",
]
