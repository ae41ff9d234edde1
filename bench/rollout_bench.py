"""Rollout timing of one sampler (issue 26), as the PPO stage runs it, against the decode floor.

    python bench/rollout_bench.py --engine graph --out rollout_graph.json    # CUDA: qwen2-0.5b, LoRA r16, bf16,
    python bench/rollout_bench.py --engine static --out rollout_static.json  # 64 prompts x 256 new tokens
    python bench/rollout_bench.py --engine dynamic --dry-run --out x.json    # CPU, the tiny model, 8 x 8

Engines: `graph` (fastrlhf's decode engine, fastrlhf/train/engine.py), `static` and `dynamic` (transformers'
generate with that KV cache: `--rollout_engine hf --rollout_cache static|dynamic`). One process per engine
(bench/parts/rollout.sh runs the three; `python bench/gpu_record.py rollout` merges them). Each builds the
model as `fastrlhf ppo --model qwen2-0.5b --lora_rank 16 --dtype bfloat16` does (random weights from the
config; the built-in task's 8-token prompts padded to its 32), samples a first rollout (compiles), then
--iterations PPO steps: a rollout, then phases 2-5 of ppo.train (rule reward, log-probs, GAE, the update),
so the LoRA weights move and the graph engine re-forms its rollout weights before each rollout.

Recorded per engine: `rollout_s` (median of the timed rollouts), `step_s` (rollout + phases 2-5, median),
`decode_ms_per_step` (graph: the engine's decode loop over its steps; hf: (rollout - one prompt forward) /
(new tokens - 1)), `floor_ms_per_step` (the bytes a decode step must move / the copy probe of this run:
the weights once, the KV cache written so far on average, the fp32 logits once),
`compile_s` and `capture_s` (graph: the engine's own; static: the first rollout minus the median one),
the sampler-trainer log-prob gap (graph: |logp_sampler - old_logp| over response tokens, per step),
and CUDA graph launches, kernel launches and kernels run per decode step (torch.profiler: graph over one
whole rollout, its prefills and polls included; static over one whole generate, dynamic over a
NEW_TOKENS_PROFILED-token one, prefill included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fastrlhf.bench.environment import environment
from fastrlhf.bench.measure import Settings, probes
from fastrlhf.train import distributed
from fastrlhf.train.config import PPOConfig
from fastrlhf.train.devices import autocast
from fastrlhf.train.engine import CHECK_EVERY, rollout_memory_bytes
from fastrlhf.train.heads import ActorCritic
from fastrlhf.train.models import hidden_states, load_causal_lm
from fastrlhf.train.recipes import ppo
from fastrlhf.train.rewards import load_reward
from fastrlhf.train.rollout import engine_generate, generate, make_engine, sampler_gap

ENGINES = ("graph", "static", "dynamic")
ITERATIONS = 3  # timed PPO steps after the first rollout
NEW_TOKENS_PROFILED = 16  # the dynamic cache's profiled rollout (its 256 tokens run 13 s without the profiler)
GPU = {"model": "qwen2-0.5b", "device": "cuda", "dtype": "bfloat16", "lora_rank": 16, "rollout_batch_size": 64,
       "mini_batch_size": 32, "micro_batch_size": 16, "max_new_tokens": 256}
DRY = {"model": "tiny", "device": "cpu", "dtype": "float32", "lora_rank": 4, "rollout_batch_size": 8,
       "mini_batch_size": 4, "micro_batch_size": 2, "max_new_tokens": 8}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def floor_bytes(config, batch: int, prompt_len: int, new_tokens: int, dtype_bytes: int) -> dict[str, float]:
    """The bytes one decode step must move at least, averaged over the rollout's steps: every weight
    once (one V x H matrix: the lm_head; the embedding gives B rows), the K/V written so far, the fp32
    logits once (issue 26's 1.13 GB per step of qwen2-0.5b at 64 x (8 + 256))."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = rollout_memory_bytes(hidden=config.hidden_size, layers=config.num_hidden_layers,
                                 heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                                 intermediate=config.intermediate_size, vocab=config.vocab_size, tied=True,
                                 head_dim=head_dim, batch=batch, max_len=prompt_len + (new_tokens - 1) / 2,
                                 dtype_bytes=dtype_bytes)
    return {"weights": sizes["weights"], "kv_cache": sizes["kv_cache"], "logits": sizes["logits"]}


def rest_of_step(model, ac, optimizer, reward_fn, rollout, cfg: PPOConfig, device, step: int) -> dict:
    """Phases 2-5 of ppo.train on `rollout`: reward, log-probs (and the sampler gap), GAE, the update."""
    scores = reward_fn(rollout)
    exp = model.run(ppo.experience, rollout._replace(scores=scores), cfg, device)
    gap = {} if exp.sampler_logp is None else sampler_gap(exp.sampler_logp, exp.old_logp, exp.batch.response_mask)
    exp = ppo.with_advantages(exp, scores, cfg.kl_coef, cfg, ppo.advantage_estimator(cfg))
    ppo.ppo_update(model, optimizer, exp, cfg, device, step)
    optimizer.zero_grad(set_to_none=True)
    return gap


def launches(fn, device, steps) -> dict | None:
    """Per decode step: CUDA graph launches, kernel launches (host API calls) and kernels run on the device
    (graph-launched ones included), over one call of `fn` (`steps` steps: an int, or a function read after
    the call) under torch.profiler. None on CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    steps = steps() if callable(steps) else steps
    graph = kernel_calls = kernels = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += not e.name.lower().startswith(("memcpy", "memset"))
        elif "GraphLaunch" in e.name:
            graph += 1
        elif "LaunchKernel" in e.name:
            kernel_calls += 1
    return {"steps": steps, "graph_launches_per_step": graph / steps, "kernel_launches_per_step": kernel_calls / steps,
            "kernels_per_step": kernels / steps}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=ENGINES, required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="CPU, the tiny model, 8 prompts x 8 tokens")
    parser.add_argument("--iterations", type=int, default=ITERATIONS, help="timed PPO steps after the first rollout")
    args = parser.parse_args(argv)
    sizes = DRY if args.dry_run else GPU
    if sizes["device"] == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run on a CPU")
    engine_name = "graph" if args.engine == "graph" else "hf"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = PPOConfig(**sizes, reward="fastrlhf.train.task:true_score", out=tmp, eval_prompts=1,
                        rollout_engine=engine_name, rollout_cache="static" if args.engine == "static" else "dynamic")
        plan = ppo.prepare(cfg)
    cfg = plan.cfg
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    lm, tokenizer = load_causal_lm(plan.model, device=device, dtype=getattr(torch, cfg.dtype))
    ac = ActorCritic(lm, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, value_head=True)
    model = distributed.shard_model(ac, cfg.shard, device)
    optimizer = torch.optim.AdamW([p for p in ac.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    reward_fn = load_reward(cfg.reward, device=device, policy_tokenizer=tokenizer, chat_template=cfg.chat_template)
    build_s = time.perf_counter() - t0
    B, R = cfg.rollout_batch_size, cfg.max_new_tokens
    prompt_ids = [plan.prompt_ids[i % len(plan.prompt_ids)] for i in range(B)]
    prompts = [plan.prompts[i % len(plan.prompts)] for i in range(B)]
    engine = make_engine(engine_name, ac.policy, tokenizer, batch=B, prompt_len=cfg.max_prompt_len, new_tokens=R,
                         temperature=cfg.temperature, device=device)

    def rollout(new_tokens: int = R):
        if engine is not None:
            return engine_generate(engine, ac.policy, tokenizer, prompt_ids, prompts)
        return generate(ac.policy, tokenizer, prompt_ids, prompts, max_new_tokens=new_tokens,
                        temperature=cfg.temperature, device=device, cache=args.engine)

    record = {"experiment": "rollout", "engine": args.engine,
              "command": "python bench/rollout_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": environment(device), "sizes": sizes, "prompt_len": cfg.max_prompt_len,
              "longest_prompt": max(map(len, prompt_ids)), "build_s": build_s, "check_every": CHECK_EVERY}
    probe = probes(Settings(device, rep_ms=200.0 if device.type == "cuda" else 5.0, rotate_bytes=0, min_reps=10),
                   2**30 if device.type == "cuda" else 2**24)
    dtype_bytes = 2 if device.type == "cuda" else 4
    floor = floor_bytes(lm.config, B, max(map(len, prompt_ids)), R, dtype_bytes)
    record |= {"probe": probe, "floor_bytes_per_step": floor,
               "floor_ms_per_step": sum(floor.values()) / (probe["copy_gbps"] * 1e9) * 1e3}

    first, first_s = timed(rollout, device)
    compile_s = engine.stats["compile_s"] if engine else None
    print(f"{args.engine}: first rollout {first_s:.2f} s ({first.batch.response_mask.sum(-1).mean():.0f} tokens/row)",
          flush=True)
    steps = []
    for step in range(args.iterations):
        out, rollout_s = timed(rollout, device)
        gap, rest_s = timed(lambda out=out, step=step: rest_of_step(model, ac, optimizer, reward_fn, out, cfg, device,
                                                                    step), device)
        row = {"rollout_s": rollout_s, "rest_s": rest_s, "step_s": rollout_s + rest_s,
               "tokens_per_row": out.batch.response_mask.sum(-1).mean().item(), "columns": out.batch.responses.shape[1],
               **gap}
        if engine is not None:
            row |= {"decode_s": engine.stats["decode_s"], "decode_steps": engine.stats["decode_steps"],
                    "prefill_s": engine.stats["prefill_s"], "refresh_s": engine.stats["refresh_s"]}
        steps.append(row)
        print(f"{args.engine}: step {step + 1}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)

    def median(key):
        return statistics.median(s[key] for s in steps)

    rollout_s = median("rollout_s")
    if engine is not None:
        decode_ms = statistics.median(s["decode_s"] / s["decode_steps"] for s in steps) * 1e3
        capture_s = engine.stats["capture_s"]
        record["engine_memory_bytes"] = engine.memory_bytes()
    else:
        b = first.batch
        P = b.prompt_len
        with torch.no_grad(), autocast(device):
            _, prefill_s = timed(lambda: hidden_states(ac.policy, b.input_ids[:, :P], b.attention_mask[:, :P],
                                                       b.position_ids[:, :P]), device)
        decode_ms = (rollout_s - prefill_s) / (R - 1) * 1e3
        compile_s = max(0.0, first_s - rollout_s) if args.engine == "static" else 0.0
        capture_s = None
        record["prefill_s"] = prefill_s
    if engine is not None:  # one whole rollout (its prefills and polls included) over its decode steps
        counts = launches(rollout, device, lambda: engine.stats["decode_steps"])
    else:  # a whole generate (its prefill included) over its decode steps
        profiled = R if args.engine == "static" else min(R, NEW_TOKENS_PROFILED)
        counts = launches(lambda: rollout(profiled), device, profiled - 1)
    record |= {
        "decode_ms_per_step": decode_ms, "rollout_s": rollout_s, "step_s": median("step_s"),
        "rest_of_step_s": median("rest_s"), "first_rollout_s": first_s, "compile_s": compile_s,
        "capture_s": capture_s, "decode_over_floor": decode_ms / record["floor_ms_per_step"], "steps": steps,
        "launches": counts,
    }
    if engine is not None:
        record["logp_gap"] = {"mean": statistics.mean(s["rollout/logp_gap_mean"] for s in steps),
                              "max": max(s["rollout/logp_gap_max"] for s in steps)}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"{args.engine}: rollout {rollout_s:.3f} s, step {record['step_s']:.3f} s, decode {decode_ms:.3f} ms/step "
          f"= {record['decode_over_floor']:.1f}x the floor {record['floor_ms_per_step']:.3f} ms; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
