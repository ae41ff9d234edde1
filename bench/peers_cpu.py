"""CPU timing of each peer's original function vs the fastrlhf-patched one (torch path).

Run from the repository root with the peers installed (.ci/install_peers.sh):
    PYTHONPATH=tests/integrations python bench/peers_cpu.py
(peer_stubs stands in for ray / deepspeed / vllm, which the --no-deps peer installs lack).
Prints the median wall time of forward+backward (or forward for no-grad functions) per case,
original then patched, on THREADS intra-op threads (default 1: on a shared, oversubscribed machine
a multi-threaded parallel region waits on its slowest thread, which distorts both sides).
Original and patched runs alternate (unpatch / patch between them, outside the timed region),
so load on a shared machine hits both alike.
"""

import os
import statistics
import sys
import time

import torch

os.environ.setdefault("FASTRLHF_BACKEND", "torch")
import peer_stubs  # noqa: E402

peer_stubs.install()
torch.manual_seed(0)
THREADS = int(os.environ.get("THREADS", "1"))
REPS = int(os.environ.get("REPS", "9"))
torch.set_num_threads(THREADS)


def timeit_pair(integ, make_run, get):
    """Median seconds of make_run(get()) with the peer unpatched, then patched, alternating."""
    times = {False: [], True: []}
    for rep in range(REPS + 1):
        for patched in (False, True):
            integ.patch() if patched else integ.unpatch()
            run = make_run(get())
            t = time.perf_counter()
            run()
            if rep:  # the first round warms up
                times[patched].append(time.perf_counter() - t)
    integ.unpatch()
    return statistics.median(times[False]), statistics.median(times[True])


def fwd_bwd(f, *args, grad_index=0):
    def run():
        a = [x.detach().requires_grad_(i == grad_index) if isinstance(x, torch.Tensor) and x.is_floating_point()
             else x for i, x in enumerate(args)]
        out = f(*a)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
    return run


def fwd(f, *args):
    def run():
        with torch.no_grad():
            f(*args)
    return run


def case(peer, integ, name, make_run, get):
    t_o, t_p = timeit_pair(integ, make_run, get)
    print(f"{peer:9s} {name:62s} {t_o * 1e3:9.2f} ms {t_p * 1e3:9.2f} ms  x{t_o / t_p:5.2f}", flush=True)


B, T, V = 4, 256, 32000
logits = torch.randn(B, T, V)
labels = torch.randint(0, V, (B, T))
topk = torch.randint(0, V, (B, T, 8))
BT = (64, 1024)
a, b, c = torch.randn(*BT), torch.randn(*BT) - 1, torch.randn(*BT)
mask = torch.rand(*BT) > 0.1
weights = 0.5 + torch.rand(*BT)

# ---------------------------------------------------------------- verl
import verl.trainer.ppo.core_algos as ca  # noqa: E402
import verl.utils.torch_functional as vF  # noqa: E402
from verl.workers.config.actor import ActorConfig  # noqa: E402

from fastrlhf.integrations import verl as fv  # noqa: E402

cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2)
cfg_dp = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                     loss_agg_mode="seq-mean-token-mean")
cfg_dp.global_batch_info.update(dp_size=2, batch_num_tokens=120000, global_batch_size=128)
case("verl", fv, f"logprobs_from_logits fwd+bwd [{B},{T},{V}] fp32", lambda f: fwd_bwd(f, logits, labels),
     lambda: vF.logprobs_from_logits)
case("verl", fv, f"entropy_from_logits fwd+bwd [{B},{T},{V}] fp32", lambda f: fwd_bwd(f, logits),
     lambda: vF.entropy_from_logits)
case("verl", fv, "kl_penalty low_var_kl fwd+bwd [64,1024]", lambda f: fwd_bwd(f, a, b, "low_var_kl"),
     lambda: ca.kl_penalty)
case("verl", fv, "  k3+ (straight-through)", lambda f: fwd_bwd(f, a, b, "k3+"), lambda: ca.kl_penalty)
case("verl", fv, "agg_loss seq-mean-token-mean, dp_size=2 fwd+bwd [64,1024]",
     lambda f: fwd_bwd(lambda x: f(x, mask, "seq-mean-token-mean", 2, None, 128), a), lambda: ca.agg_loss)
case("verl", fv, "compute_gae_advantage_return [64,1024]", lambda f: fwd(f, a, b, mask.float(), 0.99, 0.95),
     lambda: ca.compute_gae_advantage_return)
case("verl", fv, "compute_policy_loss_vanilla token-mean fwd+bwd [64,1024]",
     lambda f: fwd_bwd(f, b, a, c, mask, "token-mean", cfg, grad_index=1), lambda: ca.compute_policy_loss_vanilla)
case("verl", fv, "  seq-mean-token-mean, dp_size=2, rollout_is_weights",
     lambda f: fwd_bwd(f, b, a, c, mask, "seq-mean-token-mean", cfg_dp, weights, grad_index=1),
     lambda: ca.compute_policy_loss_vanilla)
case("verl", fv, "compute_value_loss token-mean fwd+bwd [64,1024]",
     lambda f: fwd_bwd(f, a, b, c, mask, 0.2, "token-mean"), lambda: ca.compute_value_loss)

# ---------------------------------------------------------------- OpenRLHF
import openrlhf.models.loss as ol  # noqa: E402
import openrlhf.models.utils as ou  # noqa: E402
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker as REM  # noqa: E402

from fastrlhf.integrations import openrlhf as fo  # noqa: E402

pl_mod, vl_mod = ol.PolicyLoss(), ol.ValueLoss(clip_eps=0.2)
pl_is = ol.PolicyLoss(is_correction_level="token", is_correction_mode="mask", is_correction_threshold=(0.5, 5.0))
rollout = b + 0.1 * torch.randn(*BT)
case("openrlhf", fo, f"log_probs_from_logits fwd+bwd [{B},{T},{V}] fp32", lambda f: fwd_bwd(f, logits, labels),
     lambda: ou.log_probs_from_logits)
case("openrlhf", fo, f"compute_entropy (torch.compile'd) fwd+bwd [{B},{T},{V}]", lambda f: fwd_bwd(f, logits),
     lambda: ou.compute_entropy)
case("openrlhf", fo, "compute_approx_kl k3 fwd+bwd [64,1024]", lambda f: fwd_bwd(f, a, b, None, "k3"),
     lambda: ou.compute_approx_kl)
case("openrlhf", fo, "  k3, unbiased_gradient=True", lambda f: fwd_bwd(f, a, b, c, "k3", True),
     lambda: ou.compute_approx_kl)
case("openrlhf", fo, "aggregate_loss per-sample, global_batch_size, dp_size=2 fwd+bwd",
     lambda f: fwd_bwd(lambda x: f(x, mask, False, 2, None, 128.0), a), lambda: ol.aggregate_loss)
case("openrlhf", fo, "PolicyLoss fwd+bwd [64,1024]", lambda f: fwd_bwd(lambda *x: f(pl_mod, *x), a, b, c, mask),
     lambda: ol.PolicyLoss.forward)
case("openrlhf", fo, "  token IS correction (mask)", lambda f: fwd_bwd(lambda *x: f(pl_is, *x), a, b, c, mask, rollout),
     lambda: ol.PolicyLoss.forward)
case("openrlhf", fo, "ValueLoss fwd+bwd [64,1024]", lambda f: fwd_bwd(lambda *x: f(vl_mod, *x), a, b, c, mask),
     lambda: ol.ValueLoss.forward)
case("openrlhf", fo, "get_advantages_and_returns [64,1024]", lambda f: fwd(f, None, a, b, mask, 0.99, 0.95),
     lambda: REM.get_advantages_and_returns)

# ---------------------------------------------------------------- TRL
import trl.trainer.utils as tu  # noqa: E402

from fastrlhf.integrations import trl as ft  # noqa: E402

case("trl", ft, f"selective_log_softmax fwd+bwd [{B},{T},{V}] fp32", lambda f: fwd_bwd(f, logits, labels),
     lambda: tu.selective_log_softmax)
case("trl", ft, "  top-K index (..., 8)", lambda f: fwd_bwd(f, logits, topk), lambda: tu.selective_log_softmax)
case("trl", ft, f"entropy_from_logits fwd+bwd [{B},{T},{V}] fp32", lambda f: fwd_bwd(f, logits),
     lambda: tu.entropy_from_logits)
H = 512
hidden, weight = torch.randn(B * T, H), torch.randn(V, H) * 0.05
case("trl", ft, f"fused LM head (GRPO) fwd+bwd N={B * T} H={H} V={V}",
     lambda cls: fwd_bwd(lambda h, w, y: cls.apply(h, w, None, y, 1.0, 32768, None, 1.0, ("log_probs", "entropy")),
                         hidden, weight, labels.flatten()), lambda: tu._ChunkedLogProbFunction)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {REPS} reps, {sys.platform}, "
      f"load average {os.getloadavg()[0]:.1f}")
