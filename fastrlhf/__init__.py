"""fastrlhf: fast PPO for language models.

The public ops (`fastrlhf.ops`) take the tensors and conventions of verl / OpenRLHF / TRL
and run fused Triton kernels on CUDA tensors, a torch path on CPU.
"""

from fastrlhf.ops import (
    agg_loss,
    entropy,
    gae,
    kl_shaped_rewards,
    linear_logprobs,
    linear_ppo_actor_loss,
    logprobs,
    policy_loss,
    ppo_actor_loss,
    token_kl,
    value_loss,
    whiten,
)

__version__ = "0.1.0"

__all__ = [
    "agg_loss",
    "entropy",
    "gae",
    "kl_shaped_rewards",
    "linear_logprobs",
    "linear_ppo_actor_loss",
    "logprobs",
    "policy_loss",
    "ppo_actor_loss",
    "token_kl",
    "value_loss",
    "whiten",
]
