"""The PPO update (phase 5) of the 0.5B GPU config against its floor: `bench/gpu_run.sh --only update`.

    python bench/update_record.py --out update.json             # CUDA: the config below
    python bench/update_record.py --out update.json --dry-run   # CPU: the tiny model, small shapes, dynamo
                                                                # alone (backend "eager"), one timed update

The config (PERF.md, "The update: 1.43 s, why"): qwen2-0.5b with random weights (its built-in
config), LoRA r16 on every linear, bf16, a value head on the trunk; a rollout of 64 sequences of
8 prompt + 256 response tokens; minibatches of 32, micro-batches of 16 (packed: 16 x 264 tokens);
2 PPO epochs. AdamW at lr 0, so every entry updates the same weights from the same experience:
their loss and gradient norm must agree (packed against padded, compiled against eager).

Recorded in --out (rewritten after every entry, so a run cut short keeps what it measured):
- `peak_tflops`: a bf16 matmul probe (8192^3; fp32 on the CPU), and per rollout `floor_s`: the
  update's FLOPs by the planner's formula (fastrlhf.estimate.plan.estimate, its "update" phase) at
  that peak;
- `entries`: `update_s` (median of 3 after a warm-up that compiles), compile off/on x padded/
  packed on the uniform rollout (every response 256 tokens), then packed and padded on a realistic
  spread (responses 32-256 tokens, compiled); each with peak memory, the loss and gradient norm;
- `ops_per_layer`: kernels (CUDA) or aten ops (CPU) one micro-batch's forward + backward launches,
  divided by the decoder layers (the lm_head, loss and embedding included), eager and compiled;
- `goals`: the best update_s / floor_s (goal <= 5, stretch <= 3) and spread packed / padded (<= 0.6).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fastrlhf.bench.environment import environment
from fastrlhf.estimate.plan import Spec, estimate
from fastrlhf.train import packing
from fastrlhf.train.attention import packed_attention_path
from fastrlhf.train.config import PPOConfig
from fastrlhf.train.data import pack
from fastrlhf.train.heads import ActorCritic
from fastrlhf.train.models import compile_layers, compile_stats, load_causal_lm
from fastrlhf.train.recipes import ppo
from fastrlhf.train.rollout import Rollout

SEED = 3  # of every update's minibatch draw
GPU = dict(model="qwen2-0.5b", dtype=torch.bfloat16, lora_rank=16, rollout=64, prompt=8, response=256, spread=(32, 256),
           mini=32, micro=16, epochs=2, backend="inductor", gpu="h100", repeats=3)
DRY = dict(model="tiny", dtype=torch.float32, lora_rank=4, rollout=8, prompt=8, response=16, spread=(2, 16), mini=4,
           micro=2, epochs=1, backend="eager", gpu="cpu", repeats=1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """Matmul throughput: the median of 5 timed 8192^3 GEMMs (1024^3 on the CPU)."""
    n = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b
    times = []
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e12


def rollout_batch(c: dict, lengths: list[int], vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(10, vocab, (n,), generator=g).tolist()  # noqa: E731
    return pack([ids(c["prompt"]) for _ in lengths], [ids(n) for n in lengths], pad_id=0)


def floor_s(c: dict, mean_response: float, peak: float) -> tuple[float, float]:
    """(the planner's update FLOPs, their seconds at `peak`) for responses of `mean_response` tokens."""
    spec = Spec(model=c["model"], lora_rank=c["lora_rank"], rollout_batch=c["rollout"], mini_batch=c["mini"],
                micro_batch=c["micro"], seq_len=c["prompt"], gen_len=max(1, round(mean_response)),
                ppo_epochs=c["epochs"], gpu=c["gpu"], reward="rule")
    flops = estimate(spec)["stages"]["ppo"]["phases"]["update"]["flops"]
    return flops, flops / (peak * 1e12)


def ops_per_layer(ac, exp, cfg, device, layers: int) -> float:
    """Kernels (CUDA) or aten ops (CPU) of one micro-batch's forward + backward, per decoder layer."""
    from torch.profiler import ProfilerActivity, profile

    (micro_batches, counts), *_ = ppo.update_plan(exp, cfg, device)
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        loss, _ = ppo.micro_batch_losses(ac, exp, micro_batches[0], cfg, device, counts)
        loss.backward()
        sync(device)
    ac.zero_grad(set_to_none=True)
    if cuda:
        n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    else:
        n = sum(1 for e in prof.events() if e.name.startswith("aten::"))
    return n / layers


def time_update(ac, optimizer, exp, cfg, device, repeats: int) -> dict:
    """ppo_update once (warm-up: compiles), then `repeats` timed; its stats, peak memory, seconds. Every
    call draws the same minibatches (the same seed), so every entry's stats are comparable."""
    t = time.perf_counter()
    torch.manual_seed(SEED)
    stats = ppo.ppo_update(ac, optimizer, exp, cfg, device, step=0)
    sync(device)
    warmup = time.perf_counter() - t
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(repeats):
        torch.manual_seed(SEED)
        sync(device)
        t = time.perf_counter()
        stats = ppo.ppo_update(ac, optimizer, exp, cfg, device, step=0)
        sync(device)
        seconds.append(time.perf_counter() - t)
    optimizer.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"update_s": statistics.median(seconds), "update_s_all": seconds, "warmup_s": warmup,
            "peak_memory_bytes": peak, "pg_loss": stats["pg_loss"], "value_loss": stats.get("value_loss"),
            "grad_norm": stats["grad_norm"], "skipped_nonfinite": stats["skipped_nonfinite"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU, the tiny model, compile by aot_eager")
    args = p.parse_args(argv)
    c = DRY if args.dry_run else GPU
    device = torch.device("cpu" if args.dry_run else "cuda")
    out = Path(args.out)
    record = {"command": "python bench/update_record.py " + shlex.join(sys.argv[1:] if argv is None else argv),
              **environment(device), "dry_run": args.dry_run,
              "config": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in c.items()},
              "packed_attention": packed_attention_path(device), "entries": [], "finished": False}

    def save():
        out.write_text(json.dumps(record, indent=1))

    torch.manual_seed(0)
    lm, _ = load_causal_lm(c["model"], device=device, dtype=c["dtype"])
    ac = ActorCritic(lm, lora_rank=c["lora_rank"])
    layers = compile_layers(ac, enabled=False)
    optimizer = torch.optim.AdamW([q for q in ac.parameters() if q.requires_grad], lr=0.0, weight_decay=0.0)
    record["peak_tflops"] = peak_tflops(device, c["dtype"] if device.type == "cuda" else torch.float32)
    width = c["prompt"] + c["response"]
    cfg = dict(rollout_batch_size=c["rollout"], mini_batch_size=c["mini"], micro_batch_size=c["micro"],
               ppo_epochs=c["epochs"], max_new_tokens=c["response"], max_prompt_len=c["prompt"])
    budget = c["micro"] * width  # a packed micro-batch holds as many tokens as a padded one
    g = torch.Generator().manual_seed(1)
    low, high = c["spread"]
    rollouts = {"uniform": [c["response"]] * c["rollout"],
                "spread": torch.randint(low, high + 1, (c["rollout"],), generator=g).tolist()}
    experiences = {}
    for name, lengths in rollouts.items():
        batch = rollout_batch(c, lengths, lm.config.vocab_size, seed=2).to(device)
        base = PPOConfig(**cfg)
        exp = ppo.experience(ac, Rollout(batch, [""] * len(lengths), [""] * len(lengths)), base, device)
        scores = torch.randn(len(lengths), generator=g).to(device)
        experiences[name] = ppo.with_advantages(exp, scores, 0.05, base, ppo.advantage_estimator(base))
        flops, floor = floor_s(c, sum(lengths) / len(lengths), record["peak_tflops"])
        record[f"floor_{name}"] = {"flops": flops, "floor_s": floor, "mean_response": sum(lengths) / len(lengths),
                                   "padded_micro_batch_padding": packing.padding_fraction(
                                       exp.lengths, np.array_split(np.arange(len(lengths)), len(lengths) // c["micro"]),
                                       packed=False, prompt_len=batch.prompt_len,
                                       response_len=batch.response_mask.shape[1])}
    record["floor_s"] = record["floor_uniform"]["floor_s"]
    save()
    plan = [("uniform", False, False), ("uniform", False, True), ("uniform", True, False), ("uniform", True, True),
            ("spread", True, False), ("spread", True, True)]
    for rollout, compiled, packed in plan:
        compile_layers(ac, enabled=compiled, backend=c["backend"])
        run = PPOConfig(**cfg, micro_batch_tokens=budget if packed else 0)
        before = compile_stats()
        entry = {"rollout": rollout, "compile": compiled, "packed": packed,
                 "micro_batch_tokens": run.micro_batch_tokens,
                 **time_update(ac, optimizer, experiences[rollout], run, device, c["repeats"])}
        after = compile_stats()
        entry["compiled_graphs"] = after["graphs"] - before["graphs"]
        entry["compile_s"] = after["seconds"] - before["seconds"]
        entry["vs_floor"] = entry["update_s"] / record[f"floor_{rollout}"]["floor_s"]
        if rollout == "uniform" and not packed:
            entry["ops_per_layer"] = ops_per_layer(ac, experiences[rollout], run, device, layers)
        record["entries"].append(entry)
        print(f"{rollout:8} compile={compiled!s:5} packed={packed!s:5} update {entry['update_s']:.3f} s "
              f"({entry['vs_floor']:.1f}x floor), warm-up {entry['warmup_s']:.1f} s, pg_loss {entry['pg_loss']:.6g}, "
              f"grad_norm {entry['grad_norm']:.6g}", flush=True)
        save()
    by = {(e["rollout"], e["compile"], e["packed"]): e for e in record["entries"]}
    best = min(e["update_s"] for e in record["entries"] if e["rollout"] == "uniform")
    record["goals"] = {"update_vs_floor": best / record["floor_s"], "goal": 5.0, "stretch": 3.0,
                       "spread_packed_vs_padded": by["spread", True, True]["update_s"]
                       / by["spread", True, False]["update_s"], "spread_goal": 0.6}
    record["finished"] = True
    save()
    print(json.dumps(record["goals"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
