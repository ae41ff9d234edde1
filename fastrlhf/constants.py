"""Constants with one home each. Imports nothing: `reference.py` (torch only), the kernels (torch and
triton only), the ops, the trainer and the planner (which imports no torch) may all import it."""

IGNORE_INDEX = -100  # labels equal to it get log-prob 0 and no gradient (PyTorch's cross-entropy default)
LOG_RATIO_CLAMP = 20.0  # |log-ratio| bound inside exp (policy ratio; k3 KL, both of its terms), as verl
K3_SERIES_BELOW = 0.5  # |r| below which float32 k3 = exp(-r) - 1 + r is summed as its Taylor series (no cancellation)
PPO_PHASES = ("rollout", "reward", "logprobs", "advantages", "update")  # a PPO step's phases, in order
WHITEN_EPS = 1e-8  # (x - mean) * rsqrt(var + WHITEN_EPS)
# distillation: the log-probs that enter the mixture's log m = logaddexp(...) are floored here (below the log of any
# fp64 probability > 0, >= -745): only tokens of probability 0 under both models change, and logaddexp(-inf, -inf)
# never feeds an autograd backward a NaN
LOG_MIX_FLOOR = -1.0e4

# KL estimator names users write -> the formula they select (verl's and OpenRLHF's names)
KL_ESTIMATORS = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "abs": "abs"}
# loss aggregation modes, as verl 0.9.1 core_algos.agg_loss
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
MASK_MODES = ("skip", "zero")  # GAE: verl skips masked tokens; OpenRLHF zeroes them

# Critic-free outcome advantages (fastrlhf.outcome_advantages; conventions in docs/ops.md)
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")  # the built-in ones
ADVANTAGE_EPS = 1e-6  # added to a std before dividing by it: verl's epsilon (OpenRLHF 1e-9, TRL 1e-4)
GROUP_SCALES = ("group", "batch")  # grpo's std: of the group (all peers), of the batch (TRL scale_rewards="batch")
SINGLETON_MODES = ("score", "zero")  # a group of one: baseline 0, std 1 (verl); advantage 0 (TRL)
WHITEN_MODES = ("none", "tokens", "sequences")
VAR_EPS_MODES = ("add", "clamp")  # token whitening: rsqrt(var + eps) (verl), rsqrt(max(var, eps)) (OpenRLHF)
DPO_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo")

# The policy-loss family (reference.POLICY_LOSSES, ops.policy_modes; formulas and peers in docs/ops.md)
POLICY_LOSS_MODES = ("vanilla", "ppo", "gspo", "gspo_token", "luspo", "cispo", "sapo", "gpg", "reinforce", "dro",
                     "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "geo_mean", "vespo")
RATIO_LEVELS = ("token", "sequence", "sequence_token")  # per-token ratio; GSPO's exp(row mean); GSPO-token's
GEO_MEAN_IS_EPS = 1e-10  # verl's geo_mean averages log(is_weight + 1e-10) over a sequence
DPPO_BINARY_KL_EPS = 1e-8  # verl's dppo_kl: log((1 - p_old + 1e-8) / (1 - p + 1e-8))
VESPO_LOG_W_MIN = -18.420680743952367  # log(1e-8): TRL's VESPO clamps its log weights to [log(1e-8), 20]
VESPO_LAMBDA_MIN = 1e-4  # TRL's VESPO clamps lambda to >= 1e-4
# Rollout (sampler vs trainer) correction: fastrlhf.rollout_correction
CORRECTION_LEVELS = ("token", "sequence", "geometric")  # a token's ratio; the row's product; the row's geometric mean
CORRECTION_MODES = ("truncate", "mask")  # clamp a weight into [low, high]; zero a unit outside [low, high]
OLD_LOGPROBS = ("recompute", "sampler")  # a policy forward in phase 3; the sampler's own (verl's bypass_mode)
SHARED_PROMPT_MODES = ("auto", "on", "off")  # phases 3 and 5 forward a group's prompt once (--shared_prompt)
SHARED_PROMPT_MIN_SAVING = 0.1  # auto shares from this share of the tokens saved (below it not worth a block mask)
CORRECTION_GATES = ("ratio", "binary_kl", "tv")  # the statistic a mask compares with [low, high] (OpenRLHF's gating)
CORRECTION_WEIGHTS = ("level", "token")  # what a kept unit weighs: its level's ratio, or each token its own ratio
CORRECTION_MISSING = ("propagate", "ignore")  # a NaN sampler log-prob: NaN on (verl, OpenRLHF); log-ratio 0 (TRL)
IS_ESS_EPS = 1e-8  # verl's effective sample size divides the weights by their mean + 1e-8
BATCH_NORMALIZE_MIN = 1e-8  # verl normalises the IS weights to mean 1 only when their mean exceeds this
GATE_PROB_CLAMP = 1e-6  # OpenRLHF clamps the probabilities of its divergence gates to [1e-6, 1 - 1e-6]
REJECTION_CRITERIA = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")  # verl's rollout_rs options

# Sizes the trainer uses and the planner predicts with
CHUNK_BUDGET_BYTES = 64 * 2**20  # the linear ops cut tokens into chunks whose [rows, V] logits fit this
CHUNK_BUDGET_BYTES_CUDA = 640 * 2**20  # the same on CUDA: 2048-row chunks at V = 151936 in bf16 (fewer, larger GEMMs)
SMALL_MODEL_PARAMS = 20_000_000  # below this, CPU runs use one intra-op thread (devices.cpu_threads_for)
