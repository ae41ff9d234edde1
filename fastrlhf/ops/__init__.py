"""The public fastrlhf ops: input checks, `torch.library` custom ops (fake impls, registered
autograd), dispatch. The contract (formulas, conventions, tolerances, tie rules): docs/ops.md.

One module per op family, mirroring kernels/: logprobs, kl, gae, losses (policy, value and the
actor loss from logits), linear (from hidden states + lm_head); and two without kernels (their
work is over B sequences): advantages (critic-free outcome advantages and their registry), dpo
(the DPO losses, and the per-sequence log-prob sums from hidden states through linear); distill
(teacher-student divergences from logits or from both models' hidden states, kernels/distill.py);
correction (rollout_correction: sampler-vs-trainer importance weights and rejection),
policy_modes (the policy-loss family's per-token math, for policy_loss / ppo_actor_loss) and
decode_attention (a few query positions per row over a static KV cache, kernels/decode_attention.py). CUDA
tensors run the Triton kernels; CPU tensors a torch path with the same conventions. `FASTRLHF_BACKEND=triton` forces
the kernels (on CPU they need `TRITON_INTERPRET=1`), `FASTRLHF_BACKEND=torch` the torch path.
Every public op is one or a few `fastrlhf::*` custom ops, so torch.compile traces it whole.
"""

from fastrlhf.constants import AGG_MODES, KL_ESTIMATORS, MASK_MODES
from fastrlhf.ops.advantages import ADVANTAGES, outcome_advantages, register_advantage
from fastrlhf.ops.correction import rollout_correction
from fastrlhf.ops.decode_attention import decode_attention
from fastrlhf.ops.distill import distill_loss, linear_distill_loss, topk_distill_loss
from fastrlhf.ops.dpo import dpo_loss, linear_dpo_loss, linear_sequence_logprobs
from fastrlhf.ops.gae import gae, raw_moments, whiten
from fastrlhf.ops.kl import kl_shaped_rewards, token_kl
from fastrlhf.ops.linear import linear_logprobs, linear_ppo_actor_loss
from fastrlhf.ops.logprobs import entropy, logprobs
from fastrlhf.ops.losses import agg_loss, policy_loss, ppo_actor_loss, value_loss

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "MASK_MODES",
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
