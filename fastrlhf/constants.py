"""The op contract's constants, one home each. Imports nothing: `reference.py` (torch only),
the kernels (torch and triton only) and the ops may all import it."""

IGNORE_INDEX = -100  # labels equal to it get log-prob 0 and no gradient (PyTorch's cross-entropy default)
LOG_RATIO_CLAMP = 20.0  # |log-ratio| bound inside exp (policy ratio, k3 KL), as verl
WHITEN_EPS = 1e-8  # (x - mean) * rsqrt(var + WHITEN_EPS)

# KL estimator names users write -> the formula they select (verl's and OpenRLHF's names)
KL_ESTIMATORS = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "abs": "abs"}
# loss aggregation modes, as verl 0.9.1 core_algos.agg_loss
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
MASK_MODES = ("skip", "zero")  # GAE: verl skips masked tokens; OpenRLHF zeroes them
