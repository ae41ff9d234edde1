"""Rollouts at the shapes RL runs (issue 42): G samples of each prompt, long-tailed response lengths.

    python bench/rollout_lengths.py --engine new --out new.json        # CUDA: qwen2-0.5b, LoRA r16, bf16,
    python bench/rollout_lengths.py --engine before --out before.json  # N 256 = 32 prompts x G 8, P 512,
    python bench/rollout_lengths.py --engine hf_cb --out cb.json       # R 4096, lengths log-normal
    python bench/rollout_lengths.py --merge OUT.json new.json before.json cb.json --command "..."
    python bench/rollout_lengths.py --engine new --dry-run --out x.json  # CPU, the tiny model, N 16, P 16, R 32

Engines, one process each (bench/parts/rollout.sh runs the three and merges them):
  new     fastrlhf's decode engine of this checkout (fastrlhf/train/engine.py): slots, buckets, refill,
          the group's prompt prefilled once, attention over the written K/V
  before  the engine of commit BEFORE (the last one before issue 42's, read with `git show` into a
          temporary module): one static batch of N rows until the longest ends, attention over the
          whole cache
  hf_cb   transformers' continuous batching (`init_continuous_batching`, one `add_request` per row with
          its own max_new_tokens), on the same model without the LoRA adapter (a merged adapter costs
          the same); where it runs
Each builds qwen2-0.5b from its config (random weights; the prompts are random token ids of the
vocabulary). Every row's length is drawn beforehand, log-normal with median MEDIAN x R and 5% at R
(sigma = ln(1 / MEDIAN) / 1.645, clipped to [1, R]), the same draw for every engine; the model never
samples EOS (an id past the vocabulary), so each row ends at its drawn length: the new engine and
transformers are given it (`limits`, `max_new_tokens`), today's engine has no per-row limit and runs
its batch to R, which is what it costs to produce the batch.

Recorded per engine: `rollout_s` (a timed rollout after a first one that compiles and captures), the
first rollout, `peak_bytes` (torch.cuda's peak allocation over the engine's build and rollouts, above
the model's), the work counts of fastrlhf's engines (decode steps, row steps, K/V slots read, prefill
rows), the full-batch decode step (a rollout of N rows stopped after a few steps at the prompt's
length: (its time - its prefill) / its steps) against its bandwidth floor (the weights, the K/V of the
N rows, the fp32 logits, over this run's copy probe), and the sampler-trainer log-prob gap of the new
engine (its log-probs against the trainer's teacher-forced scoring, on the first GAP_ROWS rows).
The merged record judges issue 42's goals, each a ratio of the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from rollout_bench import floor_bytes, timed  # bench/, this script's folder

from fastrlhf.bench.environment import environment
from fastrlhf.bench.measure import Settings, probes
from fastrlhf.train.engine import DecodeEngine
from fastrlhf.train.heads import ActorCritic
from fastrlhf.train.models import hidden_states, load_causal_lm
from fastrlhf.train.rollout import engine_generate, sampler_gap, token_logprobs

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("new", "before", "hf_cb")
BEFORE = "ca0a2cd"  # the last commit before issue 42's engine
MEDIAN = 0.2  # the log-normal's median, a fraction of R; 5% of the rows reach R
Z95 = 1.6448536269514722  # the standard normal's 95th percentile
STEP_PROBE = 8  # decode steps of the full-batch probe rollout
GAP_ROWS = 8  # rows scored teacher-forced for the sampler-trainer gap
GPU = {"model": "qwen2-0.5b", "device": "cuda", "dtype": "bfloat16", "lora_rank": 16, "rows": 256, "group": 8,
       "prompt_len": 512, "new_tokens": 4096}
DRY = {"model": "tiny", "device": "cpu", "dtype": "float32", "lora_rank": 4, "rows": 16, "group": 4,
       "prompt_len": 16, "new_tokens": 32}
TEMPERATURE = 1.0


def lengths(rows: int, new_tokens: int, seed: int = 0) -> list[int]:
    """Each row's response length: log-normal, median MEDIAN x R, 5% at R (clipped to [1, R])."""
    g = torch.Generator().manual_seed(seed)
    sigma = math.log(1 / MEDIAN) / Z95
    z = torch.randn(rows, generator=g, dtype=torch.float64)
    drawn = (MEDIAN * new_tokens * torch.exp(sigma * z)).round().clamp(1, new_tokens)
    return [int(x) for x in drawn]


def prompts(rows: int, group: int, prompt_len: int, vocab: int, seed: int = 1) -> list[list[int]]:
    """rows / group random prompts of prompt_len ids in [3, vocab), each repeated `group` times in a row."""
    g = torch.Generator().manual_seed(seed)
    distinct = torch.randint(3, vocab, (rows // group, prompt_len), generator=g)
    return [distinct[i // group].tolist() for i in range(rows)]


def before_engine_module():
    """fastrlhf/train/engine.py of commit BEFORE, imported from a temporary file."""
    shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:fastrlhf/train/engine.py"],
                           capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"--engine before: commit {BEFORE} is not in {ROOT}'s git history (a shallow clone?): "
                         f"{shown.stderr.strip()}")
    source = shown.stdout
    path = Path(tempfile.mkdtemp(prefix="engine_before_")) / "engine_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("engine_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_before"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_engine(args, sizes, save) -> dict:
    """The engine's record; `save(record)` after each phase, so a run cut short keeps what it measured."""
    device = torch.device(sizes["device"])
    dtype = getattr(torch, sizes["dtype"])
    N, G, P, R = sizes["rows"], sizes["group"], sizes["prompt_len"], sizes["new_tokens"]
    torch.manual_seed(0)
    lm, tokenizer = load_causal_lm(sizes["model"], device=device, dtype=dtype)
    vocab = lm.config.vocab_size
    ids = prompts(N, G, P, vocab)
    limits = lengths(N, R)
    eos = vocab + 1  # never sampled
    record = {"engine": args.engine, "sizes": sizes, "lengths": {"sum": sum(limits), "max": max(limits),
              "median": sorted(limits)[N // 2], "at_R": sum(x == R for x in limits)},
              "command": "python bench/rollout_lengths.py " + " ".join(args.argv)}
    probe = probes(Settings(device, rep_ms=100.0 if device.type == "cuda" else 5.0, rotate_bytes=0, min_reps=5),
                   2**30 if device.type == "cuda" else 2**24)
    record |= {"probe": probe, "environment": environment(device)}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    if args.engine == "hf_cb":
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0, max_new_tokens=R,
                                  eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)

        # its paged cache takes most free memory unless told: on a CPU that is seconds of zeroed pages
        paged = ContinuousBatchingConfig(max_memory_percent=None if device.type == "cuda" else 0.05)
        manager = lm.init_continuous_batching(generation_config=config, continuous_batching_config=paged)
        manager.start()

        def rollout():
            for p, n in zip(ids, limits):
                manager.add_request(p, max_new_tokens=n, eos_token_id=eos)
            done: list[int] = []
            while len(done) < N:
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    done.append(len(result.generated_tokens))
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped before every row finished")
            return sum(done)

        try:
            tokens, first_s = timed(rollout, device)
            save(record | {"first_rollout_s": first_s, "tokens": tokens})
            tokens, rollout_s = timed(rollout, device)
        finally:
            manager.stop(block=True)
        record |= {"first_rollout_s": first_s, "rollout_s": rollout_s, "tokens": tokens}
    else:
        ac = ActorCritic(lm, lora_rank=sizes["lora_rank"], lora_alpha=2 * sizes["lora_rank"], value_head=False)
        cuda = device.type == "cuda"
        module = before_engine_module() if args.engine == "before" else None
        Engine = module.DecodeEngine if module else DecodeEngine
        engine = Engine(ac.policy, batch=N, prompt_len=P, new_tokens=R, temperature=TEMPERATURE, eos_id=eos,
                        pad_id=tokenizer.pad_token_id, device=device, dtype=dtype, compile=cuda, cuda_graph=cuda)

        def rollout(rows=ids, caps=limits):
            if module:  # today's engine: no per-row limit, the static batch runs to its longest (R)
                return engine.generate(ac.policy, rows)
            return engine.generate(ac.policy, rows, limits=caps)

        _, first_s = timed(rollout, device)
        save(record | {"first_rollout_s": first_s, "first_stats": dict(engine.stats)})
        out, rollout_s = timed(rollout, device)
        stats = dict(engine.stats)
        record |= {"first_rollout_s": first_s, "rollout_s": rollout_s, "stats": stats,
                   "tokens": out[2].numel() if module else stats["tokens"]}
        save(record)
        if not module:  # every row decodes STEP_PROBE tokens: all steps at the full bucket (its decode loop alone)
            rollout(caps=[STEP_PROBE] * N)
            steps = engine.stats["decode_steps"]
            step_ms = engine.stats["decode_s"] / steps * 1e3
            floor = floor_bytes(lm.config, N, P, steps + 1, 2 if dtype != torch.float32 else 4)  # K/V at P + steps / 2
            floor["ms"] = sum(floor.values()) / (probe["copy_gbps"] * 1e9) * 1e3
            record["full_batch_step"] = {"ms": step_ms, "steps": steps, "floor": floor,
                                         "over_floor": step_ms / floor["ms"]}
            save(record)
            n = min(GAP_ROWS, N)
            gap_rollout = engine_generate(engine, ac.policy, tokenizer, ids[:n], [""] * n, limits=limits[:n])
            b = gap_rollout.batch
            with torch.no_grad():
                h = hidden_states(ac.policy, b.input_ids, b.attention_mask, b.position_ids)
                scored = token_logprobs(ac.policy, b, h, temperature=TEMPERATURE)
            record["logp_gap"] = sampler_gap(gap_rollout.sampler_logp, scored, b.response_mask)
    if device.type == "cuda":
        record["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
    return record


def goal(name: str, target: str, value, met) -> dict:
    return {"name": name, "goal": target, "value": value, "met": None if value is None else met(value)}


def merge(paths: list[Path], command: str, missing: list[str]) -> dict:
    records = {}
    for path in paths:
        if path.is_file():
            r = json.loads(path.read_text())
            records[r["engine"]] = r
    records = {e: r for e, r in records.items() if "first_rollout_s" in r}
    missing = missing + [f"{e}: no record" for e in ENGINES if e not in records and not any(
        m.startswith(e + ":") for m in missing)]
    new, before, cb = (records.get(e) for e in ENGINES)
    on_gpu = bool(new and new["sizes"]["device"] == "cuda")

    def ratio(a, b, key):
        return a[key] / b[key] if a and b and a.get(key) and b.get(key) else None

    goals = [goal("new rollout / today's engine", "<= 0.3", ratio(new, before, "rollout_s"), lambda v: v <= 0.3),
             goal("new rollout / transformers' continuous batching", "<= 0.5", ratio(new, cb, "rollout_s"),
                  lambda v: v <= 0.5),
             goal("full-batch decode step / its bandwidth floor", "<= 1.5",
                  new["full_batch_step"]["over_floor"] if new and "full_batch_step" in new else None,
                  lambda v: v <= 1.5),
             goal("new peak memory / today's", "<= 0.5", ratio(new, before, "peak_bytes") if on_gpu else None,
                  lambda v: v <= 0.5)]
    if not on_gpu:
        for g in goals:
            g["met"] = None  # a dry run judges nothing
    return {"experiment": "rollout_lengths", "command": command, "engines": list(records.values()),
            "goals": goals, "missing": missing,
            "logp_gap": new.get("logp_gap") if new else None}


def summary(record: dict) -> str:
    lines = []
    for e in record["engines"]:
        timed_s = f"{e['rollout_s']:.3f} s" if "rollout_s" in e else "not timed"
        line = f"rollout {e['engine']:<7} {timed_s} (first {e['first_rollout_s']:.2f} s), {e.get('tokens', '-')} tokens"
        if not e.get("finished"):
            line += " (cut short)"
        if "stats" in e:
            s = e["stats"]
            line += f", {s['decode_steps']} steps, {s.get('row_steps', '-')} row-steps"
        if "peak_bytes" in e:
            line += f", peak {e['peak_bytes'] / 2**30:.2f} GiB"
        lines.append(line)
    for g in record["goals"]:
        value = "-" if g["value"] is None else f"{g['value']:.3g}"
        met = {True: "MET", False: "missed"}.get(g["met"], "")
        lines.append(f"  {g['name']:<50} {g['goal']:>7} {value:>8} {met}")
    lines += [f"  missing: {m}" for m in record["missing"]]
    if record.get("logp_gap"):
        lines.append(f"  sampler-trainer log-prob gap: {record['logp_gap']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=ENGINES)
    parser.add_argument("--out", type=Path, help="JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="CPU, the tiny model, N 16, P 16, R 32")
    parser.add_argument("--merge", nargs="+", type=Path, metavar=("OUT", "RECORD"),
                        help="merge the per-engine records into OUT with the goals")
    parser.add_argument("--missing", action="append", default=[], help="ENGINE: why its record is absent")
    parser.add_argument("--command", default="", help="the command that made the records (with --merge)")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.merge:
        out, *paths = args.merge
        record = merge(paths, args.command, args.missing)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(summary(record))
        return 0
    if args.engine is None or args.out is None:
        parser.error("--engine and --out are required (or --merge)")
    sizes = DRY if args.dry_run else GPU
    if sizes["device"] == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run on a CPU")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # the engine's compile log

    def save(partial):
        args.out.write_text(json.dumps(partial | {"finished": False}, indent=1) + "\n")
        done = [k for k in ("first_rollout_s", "rollout_s", "full_batch_step") if k in partial]
        print(f"{args.engine}: saved after {', '.join(done) or 'the probe'}", flush=True)

    record = run_engine(args, sizes, save) | {"finished": True}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{args.engine}: rollout {record['rollout_s']:.3f} s (first {record['first_rollout_s']:.2f} s), "
          f"{record['tokens']} tokens; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
