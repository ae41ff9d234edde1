"""CPU peak memory of the chunked linear ops vs materialised logits (issue 3's memory figure; issue 30's
for `linear_distill_loss`, whose materialised version holds both models' logits).

Each path runs forward + backward in a fresh subprocess (so no allocator cache is shared).
The figure is the peak resident set size above what the process held once its inputs
existed: ru_maxrss after the run minus the RSS measured just before it; "extra" is that minus
the bytes of the returned gradients (d(hidden), d(weight)), which any implementation must hold.

    python bench/linear_memory.py                      # N=8192 H=256 V=32000 fp32, every op
    python bench/linear_memory.py --json out.json

The acceptance bar (issues 3 and 30): chunked / materialised extra memory <= 0.12 for logprobs and
for distill (the generalized JSD, beta 0.5, from a teacher of the same shape) forward+backward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys

PATHS = ("materialised", "chunked")
OPS = ("logprobs", "actor_loss", "distill")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(path: str, op: str, n: int, h: int, v: int, chunk_size) -> dict:
    """Run one path once in this process; return its peak RSS above the inputs."""
    import torch

    from fastrlhf import ops

    torch.manual_seed(0)
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) / h**0.5).requires_grad_()
    labels = torch.randint(0, v, (n,))
    g_logp, g_ent = torch.randn(n), torch.randn(n)
    old_logp, adv = -torch.rand(n) * 5, torch.randn(n)
    mask = torch.rand(n) > 0.2
    t_hidden, t_weight = torch.randn(n, h), torch.randn(v, h) / h**0.5  # the teacher: no gradient
    # warm up the allocator and kernels on a tiny problem so one-off costs are not counted
    ops.linear_logprobs(hidden[:8].detach(), weight[:64].detach(), labels[:8] % 64)

    base = _rss_bytes()
    if op == "logprobs":
        if path == "chunked":
            logp, ent = ops.linear_logprobs(hidden, weight, labels, return_entropy=True,
                                            chunk_size=chunk_size)
        else:
            logp, ent = ops.logprobs(hidden @ weight.T, labels, return_entropy=True)
        (logp * g_logp + ent * g_ent).sum().backward()
    elif op == "distill":
        if path == "chunked":
            loss, _ = ops.linear_distill_loss(hidden, weight, t_hidden, t_weight, mask, beta=0.5,
                                              chunk_size=chunk_size)
        else:
            loss, _ = ops.distill_loss(hidden @ weight.T, t_hidden @ t_weight.T, mask, beta=0.5)
        loss.backward()
    else:
        kw = dict(entropy_coef=0.01, ref_logp=old_logp + 0.1, kl_coef=0.05)
        if path == "chunked":
            loss, _ = ops.linear_ppo_actor_loss(hidden, weight, labels, old_logp, adv, mask,
                                                chunk_size=chunk_size, **kw)
        else:
            loss, _ = ops.ppo_actor_loss(hidden @ weight.T, labels, old_logp, adv, mask, **kw)
        loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    assert hidden.grad is not None and weight.grad is not None
    grads = hidden.grad.nbytes + weight.grad.nbytes
    return {"path": path, "op": op, "peak_above_inputs_bytes": peak - base, "grad_bytes": grads,
            "extra_peak_bytes": peak - base - grads, "inputs_rss_bytes": base}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk-size", type=int, default=None, help="default: picked from the memory budget")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", nargs=2, metavar=("PATH", "OP"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        result = _child(*args.child, args.n, args.hidden, args.vocab, args.chunk_size)
        print(json.dumps(result))
        return 0

    env = dict(os.environ, FASTRLHF_BACKEND="torch")
    rows = []
    for op in args.ops:
        res = {}
        for path in PATHS:
            cmd = [sys.executable, __file__, "--n", str(args.n), "--hidden", str(args.hidden),
                   "--vocab", str(args.vocab), "--child", path, op]
            if args.chunk_size:
                cmd += ["--chunk-size", str(args.chunk_size)]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            res[path] = json.loads(out.strip().splitlines()[-1])
        mat, chunked = res["materialised"], res["chunked"]
        rows.append({"op": op, "materialised_MiB": mat["peak_above_inputs_bytes"] / 2**20,
                     "chunked_MiB": chunked["peak_above_inputs_bytes"] / 2**20,
                     "ratio": chunked["peak_above_inputs_bytes"] / mat["peak_above_inputs_bytes"],
                     "grad_MiB": chunked["grad_bytes"] / 2**20,
                     "materialised_extra_MiB": mat["extra_peak_bytes"] / 2**20,
                     "chunked_extra_MiB": chunked["extra_peak_bytes"] / 2**20})

    print(f"N={args.n} H={args.hidden} V={args.vocab} fp32 CPU, forward+backward, peak RSS above inputs "
          "(extra: beyond the returned gradients too)")
    print(f"{'op':<12}{'materialised MiB':>18}{'chunked MiB':>14}{'ratio':>8}{'grads MiB':>11}"
          f"{'mat. extra MiB':>16}{'chunked extra MiB':>19}")
    for r in rows:
        print(f"{r['op']:<12}{r['materialised_MiB']:>18.1f}{r['chunked_MiB']:>14.1f}{r['ratio']:>8.3f}"
              f"{r['grad_MiB']:>11.1f}{r['materialised_extra_MiB']:>16.1f}{r['chunked_extra_MiB']:>19.1f}")
    if args.json:
        import torch

        with open(args.json, "w") as f:
            json.dump({"device": "cpu", "machine": platform.platform(), "torch": torch.__version__,
                       "n": args.n, "hidden": args.hidden, "vocab": args.vocab, "chunk_size": args.chunk_size,
                       "command": " ".join([sys.executable, *sys.argv]), "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
