"""Bytes of parameters, gradients and optimizer states per rank, as the trainer measures them
(`state_bytes` in OUT/summary.json: the storage of this rank's tensors, FSDP padding
included), for `fastrlhf sft` on one process and on 2 ranks under each `--shard` mode.
What the planner (`fastrlhf estimate`) is checked against.

    python bench/dist_state_bytes.py                       # CPU, gloo: writes bench/results/dist_state_bytes_cpu.json
    python bench/dist_state_bytes.py --device cuda --nproc 2 --out bench/results/dist_state_bytes_cuda.json

The model is a 36M-parameter Llama built from a config (random weights, the built-in task's
char tokenizer, float32 weights), trained for 2 steps with AdamW; every figure is read after
the last optimizer step, when gradients and Adam's two moments exist.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=8, max_position_embeddings=128, tie_word_embeddings=False)
SFT_ARGS = ["--data", "builtin", "--steps", "2", "--batch_size", "4", "--num_examples", "64", "--save_every", "100",
            "--log_every", "1"]


def make_model(path: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fastrlhf.train.task import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(**CONFIG, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def run(cmd: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"failed: {shlex.join(cmd)}\n{r.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the sharded runs")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "dist_state_bytes_cpu.json"))
    args = parser.parse_args()

    import torch

    work = Path(tempfile.mkdtemp(prefix="dist_state_bytes_"))
    num_params = make_model(work / "model")
    base = ["-m", "fastrlhf", "sft", "--model", str(work / "model"), "--device", args.device, *SFT_ARGS]
    runs = {}
    commands = {"single process": [sys.executable, *base, "--out", str(work / "single")]}
    for shard in ("full", "grad_op", "none"):
        commands[f"{args.nproc} ranks, --shard {shard}"] = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc), *base,
            "--shard", shard, "--out", str(work / shard)]
    for name, cmd in commands.items():
        run(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        summary = json.loads((out / "summary.json").read_text())["sft"]
        runs[name] = {"max_over_ranks": summary["state_bytes"],
                      "mean_over_ranks": summary.get("state_bytes_mean", summary["state_bytes"]),
                      "command": shlex.join(["python", *cmd[1:]]).replace(str(work), "$WORK")}
    single = runs["single process"]["max_over_ranks"]
    for r in runs.values():
        r["per_rank_over_single_process"] = {k: r["max_over_ranks"][k] / single[k] for k in single}
    record = {
        "what": "bytes per rank of parameters, gradients and AdamW states after `fastrlhf sft` steps "
                "(summary.json state_bytes: tensor storage of this rank's shards, FSDP2 padding included), read "
                "after the last optimizer step. --shard grad_op keeps parameters sharded at that point too: FSDP2 "
                "frees the gathered parameters after backward; they are whole from forward to backward only",
        "command": shlex.join(["python", "bench/dist_state_bytes.py", *sys.argv[1:]]),
        "model": {"config": CONFIG, "num_params": num_params, "dtype": "float32", "optimizer": "AdamW",
                  "mixed_precision": "bf16 parameters gathered, fp32 reduction" if args.device == "cuda" else "none"},
        "device": args.device, "torch": torch.__version__, "python": platform.python_version(),
        "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True).stdout.strip(),
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v["per_rank_over_single_process"] for k, v in runs.items()}, indent=2))


if __name__ == "__main__":
    main()
