"""EXPERIMENT: where a CPU decode step of this trainer's `rollout.generate` spends its host time.

Why. The planner prices a CPU decode step as (layers x 74 + 91) eager ops x the fitted CPU `op` factor. Refitted on
the AMD EPYC records of 2026-11-28 (bench/record_cpu.sh), `op` came out at 14.6 us, 9x the probed torch.add
(1.63 us), while a plain HF layer's forward costs about 4-5 us per op. This splits one decode step into the
decoder layers and the rest (HF generate's loop, its logits processors and stopping criteria, the model's
embedding, norm and lm_head) by two depths (2 and 4 layers) and two lengths (8 and 24 new tokens) of the tiny
Llama of `fastrlhf.estimate.measure`: aten ops counted with TorchDispatchMode, time in process seconds (one thread).

    OMP_NUM_THREADS=1 python bench/experiments/decode_step_host.py --json OUT.json
"""

import argparse
import json
import time

import torch

from fastrlhf.estimate.measure import TINY_LLAMA, _op_counter, build_tiny_model
from fastrlhf.train.rollout import generate
from fastrlhf.train.task import build_char_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--seconds", type=float, default=3.0, help="process seconds timed per configuration")
    args = p.parse_args()
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    prompts = ["cafe:"] * 16
    ids = [tok(x)["input_ids"] for x in prompts]
    short, long_ = 8, 24
    per_step = {}
    for depth in (2, 4):
        model = build_tiny_model(0, dict(TINY_LLAMA, num_hidden_layers=depth, vocab_size=len(tok)))
        runs = {}
        for new in (short, long_):
            kw = dict(max_new_tokens=new, temperature=1.0, device=torch.device("cpu"))
            generate(model, tok, ids, prompts, **kw)  # warm-up
            with _op_counter() as ops:
                torch.manual_seed(0)
                generate(model, tok, ids, prompts, **kw)
            start, n = time.process_time(), 0
            while time.process_time() - start < args.seconds:
                torch.manual_seed(0)
                generate(model, tok, ids, prompts, **kw)
                n += 1
            runs[new] = (ops.n, (time.process_time() - start) / n)
        steps = long_ - short
        per_step[depth] = ((runs[long_][0] - runs[short][0]) / steps, (runs[long_][1] - runs[short][1]) / steps)
    layer_ops, layer_s = ((per_step[4][i] - per_step[2][i]) / 2 for i in (0, 1))
    outside_ops, outside_s = per_step[2][0] - 2 * layer_ops, per_step[2][1] - 2 * layer_s
    out = {"command": "OMP_NUM_THREADS=1 python bench/experiments/decode_step_host.py", "torch": torch.__version__,
           "sequences": len(prompts),
           "per_layer": {"ops": layer_ops, "seconds": layer_s, "seconds_per_op": layer_s / layer_ops},
           "outside_layers": {"ops": outside_ops, "seconds": outside_s, "seconds_per_op": outside_s / outside_ops},
           "per_step": {str(d): {"ops": o, "seconds": s} for d, (o, s) in per_step.items()}}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
