"""Host time per call of the ops on their CUDA path, measured on a CPU with every Triton launch stubbed out
(the same Python as on a GPU; `fastrlhf.bench.measure.stubbed_launches`), forward (no grad) and forward +
backward, beside the plain PyTorch expression of the same op (`fastrlhf.reference`) for scale. One thread.

    python bench/host_overhead.py --out bench/results/host_overhead_cpu.json

The GPU's host is slower than this CPU (the H100 host ran these paths 4-7x slower, PERF.md), so these are
relative figures: which op pays how much Python and how many torch calls, before and after a change.
"""

from __future__ import annotations

import os

os.environ["FASTRLHF_BACKEND"] = "triton"  # the CUDA path, on CPU tensors
os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from fastrlhf import ops  # noqa: E402
from fastrlhf.bench.environment import environment  # noqa: E402
from fastrlhf.bench.measure import stubbed_launches  # noqa: E402

CALLS = 200


def _cases(B: int, T: int, V: int) -> dict:
    """op -> (fn(leaf) -> output tensor, leaf builder): each op's bench arguments (fastrlhf.bench.cases)."""
    g = torch.Generator().manual_seed(0)
    lp = lambda: -torch.rand(B, T, generator=g) * 3  # noqa: E731
    old, adv, ref, mask, scores = lp(), torch.randn(B, T, generator=g), lp(), torch.rand(B, T, generator=g) > 0.2, \
        torch.randn(B, generator=g)
    labels = torch.randint(0, V, (1, 128), generator=g)
    actor_labels = torch.randint(0, V, (B, T), generator=g)
    return {
        "token_kl": (lambda x: ops.token_kl(x, ref, estimator="k3"), lp),
        "policy_loss": (lambda x: ops.policy_loss(x, old, adv, mask)[0], lp),
        "value_loss": (lambda x: ops.value_loss(x, old, adv, mask)[0], lp),
        "kl_shaped_rewards": (lambda x: ops.kl_shaped_rewards(scores, x, ref, mask, kl_coef=0.05), lp),
        "gae": (lambda x: ops.gae(x, adv, mask, gamma=1.0, lam=0.95)[0], lp),
        "logprobs B=1 T=128": (lambda x: ops.logprobs(x, labels), lambda: torch.randn(1, 128, V, generator=g)),
        "ppo_actor_loss": (lambda x: ops.ppo_actor_loss(x, actor_labels, old, adv, mask, ref_logp=ref, kl_coef=0.05,
                                                         entropy_coef=0.01)[0],
                           lambda: torch.randn(B, T, V, generator=g)),
    }


def _time_us(fn, blocks: int = 5) -> float:
    """The least of `blocks` medians of CALLS / blocks calls each: robust to a machine shared with other work."""
    for _ in range(5):
        fn()
    medians = []
    for _ in range(blocks):
        times = []
        for _ in range(CALLS // blocks):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return min(medians) * 1e6


def _forward(fn, x):
    def run():
        with torch.no_grad():
            fn(x)

    return run


def _forward_backward(fn, x):
    x = x.clone().requires_grad_()

    def run():
        out = fn(x)
        torch.autograd.grad(out, x, torch.ones_like(out) if out.dim() else None)

    return run


def measure(B: int, T: int, V: int) -> list[dict]:
    rows = []
    for name, (fn, leaf) in _cases(B, T, V).items():
        x = leaf()
        with stubbed_launches():
            row = {"op": name, "fwd_us": _time_us(_forward(fn, x))}
            if name not in ("kl_shaped_rewards", "gae"):  # no gradient: rewards and advantages are data
                row["fwd+bwd_us"] = _time_us(_forward_backward(fn, x))
        rows.append(row)
        print(f"{name:22s} fwd {row['fwd_us']:7.1f} us   fwd+bwd {row.get('fwd+bwd_us', float('nan')):7.1f} us",
              flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows and the environment here (JSON)")
    p.add_argument("--shape", default="4x256", help="B x T of the [B, T] ops (default 4x256)")
    p.add_argument("--vocab", type=int, default=32000, help="V of logprobs and the actor loss")
    args = p.parse_args()
    torch.set_num_threads(1)
    B, T = (int(v) for v in args.shape.split("x"))
    rows = measure(B, T, args.vocab)
    if args.out:
        record = {"what": __doc__.split("\n\n")[0], "command": f"python bench/host_overhead.py --shape {args.shape} "
                  f"--vocab {args.vocab}", "shape": {"B": B, "T": T, "V": args.vocab}, "calls": CALLS,
                  "environment": environment(torch.device("cpu")), "rows": rows}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
