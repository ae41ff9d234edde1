"""Peak memory of a sharded PPO run, measured by the trainer, beside the planner's prediction
for the same run; both recorded in one JSON file under bench/results/.

    python bench/dist_peak_memory.py                          # CUDA: 1 rank, NCCL, qwen2-0.5b, --shard full
    python bench/dist_peak_memory.py --nproc 2                # the same on 2 GPUs
    python bench/dist_peak_memory.py --device cpu --model tiny --steps 2   # a dry run on CPU (gloo)

The run is `torchrun --standalone --nproc-per-node N -m fastrlhf ppo` on the built-in task
with the rule reward (no reward model), full fine-tuning (lora_rank 0: a frozen reference
copy, sharded too), float32 master weights; on CUDA FSDP2 gathers bf16 parameters and reduces
gradients in fp32. Measured: per phase, the peak of `torch.cuda.max_memory_allocated` (CPU:
peak RSS) as max and mean over ranks, and the bytes of parameters, gradients and AdamW states
per rank (OUT/summary.json). Predicted: `fastrlhf estimate --compare-run` on that run (the
planner reads the run's summary and arguments and predicts each phase for its configuration;
recorded as it answers, or with its error).
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
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if check and r.returncode:
        raise SystemExit(f"failed: {shlex.join(cmd)}\n{r.stderr[-3000:]}")
    return r


def _environment(device: str) -> dict:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
           "git_commit": _run(["git", "rev-parse", "HEAD"], check=False).stdout.strip()}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        smi = _run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"], check=False)
        env["nvidia_smi"] = smi.stdout.strip()
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--nproc", type=int, default=1, help="ranks (GPUs on CUDA)")
    parser.add_argument("--model", default="qwen2-0.5b",
                        help="a built-in config (fastrlhf.train.models.BUILTIN_MODELS)")
    parser.add_argument("--shard", default="full", choices=("full", "grad_op", "none"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rollout-batch", type=int, default=64)
    parser.add_argument("--mini-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--out", default=None,
                        help="default: bench/results/dist_peak_memory_DEVICE_MODEL_SHARD_Nx.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dist_peak_memory_"))
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           "-m", "fastrlhf", "ppo", "--model", args.model, "--reward", "fastrlhf.train.task:true_score",
           "--data", "builtin",
           "--device", args.device, "--shard", args.shard, "--lora_rank", "0", "--steps", str(args.steps),
           "--rollout_batch_size", str(args.rollout_batch), "--mini_batch_size", str(args.mini_batch),
           "--micro_batch_size", str(args.micro_batch), "--ppo_epochs", "1", "--eval_prompts", str(args.rollout_batch),
           "--save_every", str(args.steps + 1), "--out", str(run_dir)]
    _run(cmd)
    summary = json.loads((run_dir / "summary.json").read_text())["ppo"]
    measured = {k: summary[k] for k in ("phase_peak_memory_bytes", "phase_peak_memory_bytes_mean", "state_bytes",
                                        "state_bytes_mean", "phase_seconds", "ranks", "shard", "device")}

    run_args = cmd[cmd.index("ppo") + 1:cmd.index("--out")]
    zero = {"full": "3", "grad_op": "2", "none": "0"}[args.shard]
    planner_cmd = [sys.executable, "-m", "fastrlhf", "estimate", "--compare-run", str(run_dir), "--run-args",
                   shlex.join(run_args), "--gpus", str(args.nproc), "--engine", "fsdp2", "--zero", zero, "--json"]
    r = _run(planner_cmd, check=False)
    try:
        predicted = json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr.strip()[-2000:]}
    except json.JSONDecodeError:
        predicted = {"error": f"not JSON: {r.stdout[:500]}"}

    record = {
        "what": "peak memory per PPO phase of a sharded run (max/mean over ranks) and per-rank bytes of parameters, "
                "gradients and AdamW states, beside the planner's prediction for the same run",
        "command": shlex.join(["python", "bench/dist_peak_memory.py", *sys.argv[1:]]),
        "run_command": shlex.join(["python", *cmd[1:]]).replace(str(work), "$WORK"),
        "planner_command": shlex.join(["python", *planner_cmd[1:]]).replace(str(work), "$WORK"),
        "environment": _environment(args.device),
        "measured": measured,
        "predicted": predicted,
    }
    out = Path(args.out or ROOT / "bench" / "results" /
               f"dist_peak_memory_{args.device}_{args.model}_{args.shard}_{args.nproc}x.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    print(json.dumps({"measured_peak_bytes": measured["phase_peak_memory_bytes"],
                      "predicted": "error" if "error" in predicted else "recorded"}, indent=2))


if __name__ == "__main__":
    main()
