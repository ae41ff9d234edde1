"""The ops' torch path (what CPU tensors run) against the plain PyTorch expression a user would write
(`fastrlhf.reference`, in the input dtype), forward (no grad) and forward + backward, at [64 x 512] and
[4 x 64], one thread, in the same process: the ratio ops / reference per op, pass and shape (issue 23's
goal: <= 1.15 everywhere).

    python bench/torch_path.py --out bench/results/torch_path_cpu.json

Timing: the two providers alternate in blocks of calls; each provider's figure is the least median over its
blocks (robust to other work on a shared machine). fp32 inputs, a bool mask with right padding.
"""

from __future__ import annotations

import os

os.environ["FASTRLHF_BACKEND"] = "torch"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from fastrlhf import ops, reference  # noqa: E402
from fastrlhf.bench.environment import environment  # noqa: E402

SHAPES = ((64, 512), (4, 64))
GOAL = 1.15


def _inputs(B: int, T: int) -> dict:
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(B, T, generator=g) * 3
    lengths = torch.randint(max(T // 4, 1), T + 1, (B, 1), generator=g)
    noise = lambda scale: scale * torch.randn(B, T, generator=g)  # noqa: E731
    return {"logp": lp, "old": lp + noise(0.1), "ref": lp + noise(0.3),
            "adv": torch.randn(B, T, generator=g), "values": torch.randn(B, T, generator=g),
            "returns": torch.randn(B, T, generator=g), "scores": torch.randn(B, generator=g),
            "mask": torch.arange(T) < lengths}


def _cases() -> dict:
    """op -> (its fn(module, x, inputs) -> a tensor whose backward is taken, or None: forward only)."""
    return {
        "token_kl k3": lambda m, x, i: m.token_kl(x, i["ref"], estimator="k3"),
        "token_kl k1": lambda m, x, i: m.token_kl(x, i["ref"], estimator="k1"),
        "policy_loss": lambda m, x, i: m.policy_loss(x, i["old"], i["adv"], i["mask"])[0],
        "value_loss": lambda m, x, i: m.value_loss(x, i["old"], i["returns"], i["mask"])[0],
        "agg_loss": lambda m, x, i: m.agg_loss(x, i["mask"], agg="seq-mean-token-mean"),
        "kl_shaped_rewards": lambda m, x, i: m.kl_shaped_rewards(i["scores"], x, i["ref"], i["mask"], kl_coef=0.05),
        "whiten": lambda m, x, i: m.whiten(x, i["mask"]),
        "gae": lambda m, x, i: m.gae(x, i["values"], i["mask"], gamma=1.0, lam=0.95)[0],
    }


DATA_OPS = ("kl_shaped_rewards", "whiten", "gae")  # no gradient: rewards, advantages are data


def _runner(fn, module, x, inputs, backward: bool):
    if not backward:
        def run():
            with torch.no_grad():
                fn(module, x, inputs)
        return run
    xg = x.clone().requires_grad_()

    def run_bwd():
        out = fn(module, xg, inputs)
        (out if out.dim() == 0 else out.sum()).backward()
        xg.grad = None
    return run_bwd


def _race(a, b, blocks: int, calls: int) -> tuple[float, float]:
    """(a's, b's) least median over alternating blocks, in microseconds."""
    for f in (a, b):
        for _ in range(3):
            f()
    best = [float("inf"), float("inf")]
    for _ in range(blocks):
        for k, f in enumerate((a, b)):
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                f()
                times.append(time.perf_counter() - start)
            best[k] = min(best[k], statistics.median(times))
    return best[0] * 1e6, best[1] * 1e6


def measure(blocks: int = 7) -> list[dict]:
    rows = []
    for B, T in SHAPES:
        inputs = _inputs(B, T)
        calls = 30 if B * T <= 4096 else 8
        for name, fn in _cases().items():
            x = inputs["values"] if name.startswith(("value_loss", "whiten", "agg_loss")) else inputs["logp"]
            if name == "gae":
                x = inputs["adv"]
            for backward in (False, True):
                if backward and name in DATA_OPS:
                    continue
                ours, theirs = _race(_runner(fn, ops, x, inputs, backward), _runner(fn, reference, x, inputs, backward),
                                     blocks, calls)
                row = {"op": name, "shape": f"{B}x{T}", "pass": "fwd+bwd" if backward else "fwd", "ops_us": ours,
                       "reference_us": theirs, "ratio": ours / theirs}
                rows.append(row)
                print(f"{name:18s} {row['shape']:>7s} {row['pass']:7s} ops {ours:8.1f} us  reference {theirs:8.1f} us"
                      f"  ratio {row['ratio']:.2f}{'' if row['ratio'] <= GOAL else '  > ' + str(GOAL)}", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows and the environment here (JSON)")
    p.add_argument("--blocks", type=int, default=7, help="alternating blocks per provider (default 7)")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = measure(args.blocks)
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"worst: {worst['op']} {worst['shape']} {worst['pass']} {worst['ratio']:.2f} (goal <= {GOAL})")
    if args.out:
        record = {"what": __doc__.split("\n\n")[0], "command": "python bench/torch_path.py", "goal": GOAL,
                  "met": worst["ratio"] <= GOAL, "environment": environment(torch.device("cpu")), "rows": rows}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
