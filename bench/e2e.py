"""Side by side with TRL on the same machine: fastrlhf's GRPO and PPO iteration against TRL's
GRPOTrainer (installed, 1.16) and TRL 1.12's PPOTrainer (the last TRL with PPO), doing the same
work, in alternating runs; and how many iterations and seconds each needs to learn the built-in task.

    python bench/e2e.py --device cpu                # the CPU record -> bench/results/<date>-cpu-e2e.json (~30-60 min)
    python bench/e2e.py --device cpu --quick --out OUT.json   # every part at a small size (CI)
    python bench/e2e.py --device cuda --only grpo   # the GPU record: qwen2-0.5b, 8 prompts x 8 x 256 tokens
    python bench/e2e.py --readme                    # the README's table from the latest records
    bash bench/gpu_run.sh OUT --only e2e            # the GPU record in one call (bench/parts/e2e.sh)

Same work per iteration for every trainer: the same model directory (random weights whose EOS and pad
are unreachable in the weights, so every response is exactly R tokens: bench/e2e_model.py; for
learning, one SFT checkpoint of the built-in task with EOS reachable), the same prompts,
prompts x generations sequences per iteration, R response tokens, `epochs` passes in minibatches of
`mini_batch` sequences made of micro-batches of `micro_batch`, LoRA of the same rank on every linear
layer but the lm_head, the same dtype, temperature, learning rate and KL coefficient (GRPO: k3 in the
loss, TRL's `beta`; PPO: k1 in the reward, as both do by default), the rule reward of the built-in
task (fastrlhf.train.task.true_score) and one CPU thread on CPU.

TRL runs in two configurations:
- `trl_shipped`: TRL's defaults for how the work is done: gradient checkpointing, its optimizer
  (AdamW fused, linearly decaying rate), bf16 autocast (its default, on CPU too), GRPO's KL bias
  correction, `generate` with the dynamic cache; PPO's critic as TRL's example builds it (a separate
  sequence-classification copy of the model, every weight trained).
- `trl_matched`: fastrlhf's settings: no gradient checkpointing, torch AdamW at a constant rate,
  fp32 on CPU (on CUDA the frozen base in bf16 with bf16 autocast, as fastrlhf), no KL bias
  correction; PPO's critic a value head on the policy's own LoRA trunk, as fastrlhf's. On CUDA its
  generation is `cache_implementation="static"` (TRL keeps `disable_compile=True`); if time is
  left, transformers' continuous batching is run as `trl_matched_cb`.

Each run is a fresh process (bench/e2e_worker.py: the start-up time is its own), the trainers
take turns within each repetition, in a rotated order. Per trainer the record holds seconds per
iteration (the median over the timed iterations of every repetition), per phase (rollout, reward,
log-probs, update, other), response tokens/s, peak memory, the start-up time, the settings, the
versions and the exact commands; for learning, per seed the iteration at which the mean true score
of the iteration's samples first reaches 0.9 and the seconds of training until then. The load
average is sampled during the run: on a shared machine the record says it was measured under load.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORKER = ROOT / "bench" / "e2e_worker.py"
TRL_PPO_VERSION = "1.12.0"
# the wheel .ci/install_peers.sh and bench/gpu_wheels.sh fetch (`pip download --no-deps trl==1.12.0`)
TRL_PPO_WHEEL = ROOT / ".whl" / "trl-1.12" / f"trl-{TRL_PPO_VERSION}-py3-none-any.whl"
TARGET_SCORE = 0.9
SCHEMA = 1
README_START, README_END = "<!-- e2e-table:start -->", "<!-- e2e-table:end -->"
sys.path.insert(0, str(ROOT / "bench"))
from e2e_model import write_model, write_prompts  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Work:
    """The work of one iteration, the same for every trainer."""

    prompts: int
    generations: int
    response_len: int
    mini_batch: int
    micro_batch: int
    epochs: int = 2
    lora_rank: int = 16
    lora_alpha: float = 32.0
    kl_coef: float = 0.05
    temperature: float = 1.0
    lr: float = 5e-4
    vf_coef: float = 0.5

    @property
    def rollout_batch(self) -> int:
        return self.prompts * self.generations


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one record measures."""

    grpo_models: tuple[str, ...]
    ppo_models: tuple[str, ...]
    grpo: Work
    ppo: Work
    learning_grpo: Work
    learning_ppo: Work
    warmup: int = 1
    iterations: int = 3
    """Timed iterations per run, after `warmup`."""
    reps: int = 2
    seeds: tuple[int, ...] = (0, 1, 2)
    budget: int = 30
    """Learning: iterations per run."""
    sft_steps: int = 300
    eval_prompts: int = 16
    trl_generation: str | None = None
    """trl_matched's generation: None (generate, dynamic cache), static, continuous_batching."""
    extra_generation: str | None = None
    """Run trl_matched once more with this generation, as trl_matched_cb, if time is left."""
    learning_configs: tuple[str, ...] = ("fastrlhf", "trl_shipped", "trl_matched")
    learning_algos: tuple[str, ...] = ("grpo", "ppo")
    ppo_configs: tuple[str, ...] = ("fastrlhf", "trl_shipped", "trl_matched")
    """The PPO timing runs (GRPO's are always all of CONFIGS)."""
    run_timeout_s: int = 1200
    compiled_models: tuple[str, ...] = ()
    """Timing models fastrlhf runs with --compile on (on CUDA it compiles by default; the CPU build of a layer
    takes the warm-up iteration, and the tiny default gains nothing from it). Learning runs never: their
    seconds count from the start."""


LEARN_GRPO = Work(prompts=8, generations=8, response_len=12, mini_batch=32, micro_batch=16)
LEARN_PPO = Work(prompts=64, generations=1, response_len=12, mini_batch=32, micro_batch=16)
PLANS = {
    "cpu": Plan(grpo_models=("tiny", "llama-10m", "llama-10m-v32k"), ppo_models=("llama-10m-v32k",),
                grpo=Work(prompts=8, generations=8, response_len=32, mini_batch=32, micro_batch=16),
                ppo=Work(prompts=64, generations=1, response_len=32, mini_batch=32, micro_batch=16),
                learning_grpo=LEARN_GRPO, learning_ppo=LEARN_PPO, compiled_models=("llama-10m", "llama-10m-v32k")),
    "cuda": Plan(grpo_models=("qwen2-0.5b",), ppo_models=("qwen2-0.5b",),
                 grpo=Work(prompts=8, generations=8, response_len=256, mini_batch=32, micro_batch=16),
                 ppo=Work(prompts=64, generations=1, response_len=256, mini_batch=32, micro_batch=16),
                 learning_grpo=LEARN_GRPO, learning_ppo=LEARN_PPO, iterations=2, reps=1,
                 trl_generation="static", extra_generation="continuous_batching", run_timeout_s=300),
    "quick": Plan(grpo_models=("tiny",), ppo_models=("tiny",),
                  grpo=Work(prompts=4, generations=4, response_len=8, mini_batch=8, micro_batch=4, lora_rank=8),
                  ppo=Work(prompts=16, generations=1, response_len=8, mini_batch=8, micro_batch=4, lora_rank=8),
                  learning_grpo=Work(prompts=4, generations=4, response_len=12, mini_batch=8, micro_batch=4),
                  learning_ppo=Work(prompts=16, generations=1, response_len=12, mini_batch=8, micro_batch=4),
                  warmup=0, iterations=1, reps=1, seeds=(0,), budget=2, sft_steps=10, eval_prompts=4,
                  run_timeout_s=300, learning_configs=("fastrlhf", "trl_matched"), learning_algos=("grpo",),
                  ppo_configs=("fastrlhf", "trl_matched")),
}
PARTS = ("grpo", "ppo", "learning")
# What the peers do, read from their code (TRL 1.16.0 and 1.12.0 as installed / in the wheel), and checked where said
NOTES = [
    "TRL 1.16 GRPOTrainer scores log-probs through its own chunked fused LM head (trl.trainer.utils."
    "add_fused_lm_head: no [B, T, V] logits) and computes the entropy in every training forward "
    "(compute_entropy=True).",
    "TRL 1.16 GRPOTrainer builds its GenerationConfig with disable_compile=True: cache_implementation='static' "
    "preallocates the cache but runs the decoding step eagerly.",
    "TRL 1.16 GRPOTrainer's transformers rollout (_generate_single_turn) is the work of fastrlhf's --rollout_engine "
    "hf: generate on the PEFT model (un-merged LoRA), left-padded prompts, position ids from the mask, the "
    "dynamic cache (cache_implementation None), do_sample with top_k=0, top_p=1.0, repetition_penalty=1.0, "
    "no autocast of its own (accelerator.autocast wraps its scoring forwards only), the model's generation_config "
    "overridden for the call; each token drawn by torch.multinomial (exponential_ + argmax). On one CPU thread "
    "the draw for [64, 32000] costs ~46 ms, about a third of a llama-10m-v32k decode step: fastrlhf's CPU runs "
    "draw from the same distribution with --rollout_sampler inverse_cdf (~11 ms: one uniform per row against the "
    "float64 running sum of the probabilities; records before 2026-11-27 evening used the exponential race over "
    "uniforms, ~29 ms).",
    "TRL 1.12 PPOTrainer generates with output_scores=True (the [B, R, V] logits of the whole rollout are kept and "
    "the old log-probs taken from them), runs the critic's backbone and the policy as two forwards even when they "
    "share the trunk (PolicyAndValueWrapper.forward), calls gc.collect() every iteration and clips no gradient.",
    "TRL 1.12 PPOTrainer steps the optimizer under accelerate's gradient accumulation: once per "
    "gradient_accumulation_steps (= rollout / micro_batch) micro-batches, i.e. once per epoch over the whole rollout "
    "whatever num_mini_batches is: 2 optimizer steps per iteration here where fastrlhf takes epochs x rollout / "
    "mini_batch = 4 (counted on the wrapped optimizer). The forward and backward passes are the same in number.",
    "fastrlhf's actor-critic takes the log-probs (through the lm_head weight, fastrlhf.ops.linear_logprobs) and the "
    "values from one trunk forward; its reference is the policy with the LoRA adapter disabled, as TRL's with PEFT.",
]
CONFIGS = ("fastrlhf", "trl_shipped", "trl_matched")
PHASES = ("rollout", "reward", "logprobs", "update", "other")


# ---------------------------------------------------------------- load average


class LoadSampler:
    """The 1-minute load average (as `uptime` prints it) every `every` seconds while running."""

    def __init__(self, every: float = 5.0):
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(round(os.getloadavg()[0], 2))
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        s = self.samples or [os.getloadavg()[0]]
        return {"min": min(s), "mean": round(statistics.fmean(s), 2), "max": max(s), "samples": len(s),
                "every_s": self.every, "cpus": os.cpu_count()}


# ---------------------------------------------------------------- runs


class Bench:
    """Runs workers, keeps the record (rewritten after every run), honours the deadline."""

    def __init__(self, args, plan: Plan, record: dict):
        self.args, self.plan, self.record = args, plan, record
        self.work = Path(args.work or tempfile.mkdtemp(prefix="e2e_"))
        for sub in ("specs", "results", "logs", "models"):
            (self.work / sub).mkdir(parents=True, exist_ok=True)
        self.deadline = time.time() + args.deadline_s if args.deadline_s else None
        self.prompts = write_prompts(self.work / "prompts.jsonl", 512, seed=0)
        self.models: dict[str, tuple[Path, dict]] = {}

    def save(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.record, indent=1) + "\n")
        tmp.replace(out)

    def left_s(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.time()

    def model(self, name: str) -> tuple[Path, dict]:
        if name not in self.models:
            path = self.work / "models" / name
            self.models[name] = path, write_model(name, path)
        return self.models[name]

    def sft_model(self) -> tuple[Path, str]:
        """The SFT checkpoint of the built-in task every learning run starts from (fastrlhf sft)."""
        out = self.work / "learn"
        cmd = [sys.executable, "-m", "fastrlhf", "sft", "--out", str(out), "--device", self.args.device,
               "--steps", str(self.plan.sft_steps), "--seed", "0", "--overwrite"]
        if not (out / "sft" / "final").is_dir():
            log = self.work / "logs" / "sft.log"
            with log.open("w") as f:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=worker_env(self.args, 1))
            if rc.returncode:
                raise SystemExit(f"the SFT checkpoint failed: {shlex.join(cmd)}\n{tail(log)}")
        return out / "sft" / "final", shlex.join(["python", *cmd[1:]])

    def run(self, name: str, spec: dict) -> dict:
        """One worker process; its result, or {"error": ...} / {"skipped": ...}. With --resume, the
        result a finished run of the same spec left in the work folder instead."""
        spec_path, result = self.work / "specs" / f"{name}.json", self.work / "results" / f"{name}.json"
        if self.args.resume and (out := finished_run(spec_path, result, spec)):
            print(f"== {name}: reused ({result})", flush=True)
            self.record["resumed_from"]["reused_runs"].append(name)
            return out
        if self.left_s() < 30:
            return {"skipped": "no time left before the deadline"}
        log = self.work / "logs" / f"{name}.log"
        spec = dict(spec, result=str(result), spawn_time=time.time())
        spec_path.write_text(json.dumps(spec, indent=1))
        cmd = [sys.executable, str(WORKER), str(spec_path)]
        timeout = min(self.plan.run_timeout_s, self.left_s() - 10)
        print(f"== {name} (limit {timeout:.0f} s)", flush=True)
        try:
            with log.open("w") as f:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                    env=worker_env(self.args, spec.get("threads", 1))).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0 or not result.is_file():
            print(f"   failed ({rc}):\n{tail(log, 15)}", flush=True)
            return {"error": f"exit {rc}", "log_tail": tail(log, 40)}
        out = json.loads(result.read_text())
        out["spec"] = run_spec(spec)
        timed = out["iterations"][spec["warmup"]:]
        if timed:
            graphs = compiled_while_timed([out], spec["warmup"])
            print(f"   {statistics.median(i['seconds'] for i in timed):.3f} s/iteration, start-up "
                  f"{out['startup_s']:.1f} s" + (f", {graphs} graph(s) compiled while timed" if graphs else ""),
                  flush=True)
        return out


def run_spec(spec: dict) -> dict:
    """A run's spec without what differs between two runs of the same work (its result's path, its spawn time)."""
    return {k: v for k, v in spec.items() if k not in ("result", "spawn_time")}


def finished_run(spec_path: Path, result: Path, spec: dict) -> dict | None:
    """The result a finished run of exactly `spec` left (its spec file and result), or None."""
    if not (spec_path.is_file() and result.is_file()) or run_spec(json.loads(spec_path.read_text())) != spec:
        return None
    out = json.loads(result.read_text())
    return dict(out, spec=spec) if "iterations" in out else None


def resumed_from(path: Path) -> dict:
    """What a --resume record keeps of the unfinished record it continues (the runs it reuses are added)."""
    if not path.is_file():
        raise SystemExit(f"--resume: no record at {path} to continue (pass --out)")
    old = json.loads(path.read_text())
    if old.get("schema") != SCHEMA or old.get("finished"):
        raise SystemExit(f"--resume: {path} is not an unfinished e2e record of schema {SCHEMA}")
    return {"file": path.name, "date": old["date"], "commit": old["commit"], "command": old["command"],
            "uptime_start": old.get("uptime", {}).get("start"), "reused_runs": [],
            "note": "the runs named in reused_runs were made by the record this one continues (its commit, date, "
                    "command and load at its start are above) and read back from the work folder, where their "
                    "spec matched exactly; the others, the load average and the summaries are this command's"}


def start_load(uptime_line: str | None) -> float | None:
    """The 1-minute load average in an `uptime` line."""
    try:
        return float(uptime_line.split("load average:")[1].split(",")[0])
    except (AttributeError, IndexError, ValueError):
        return None


def worker_env(args, threads: int) -> dict:
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    env.setdefault("TORCH_LOGS", "recompiles")  # a recompile's guard failure goes to the run's log
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.is_file() else ""


def spec_for(bench: Bench, config: str, algo: str, work: Work, model_dir: Path, *, data: str, iterations: int,
             warmup: int, seed: int, eos_unreachable: bool, compile: bool = False) -> dict:
    plan, args = bench.plan, bench.args
    trainer, _, trl_config = config.partition("_")
    generation = None
    if trl_config.startswith("matched"):
        generation = plan.extra_generation if config.endswith("_cb") else plan.trl_generation
    return {"trainer": trainer, "algo": algo, "config": trl_config.removesuffix("_cb") or "own",
            "model_dir": str(model_dir), "data": data, "device": args.device, "threads": 1,
            "iterations": iterations, "warmup": warmup, "rollout_batch": work.rollout_batch,
            "generations": work.generations, "seed": seed, "eos_unreachable": eos_unreachable,
            "trl_generation": generation, "trl_ppo_wheel": str(args.trl_ppo_wheel),
            "compile": compile and trainer == "fastrlhf",
            "eval_prompts": plan.eval_prompts, **{f.name: getattr(work, f.name) for f in dataclasses.fields(Work)
                                                  if f.name not in ("prompts", "generations")}}


def configs_for(bench: Bench, algo: str) -> list[str]:
    configs = list(CONFIGS if algo == "grpo" else bench.plan.ppo_configs)
    if algo == "grpo" and bench.plan.extra_generation:
        configs.append("trl_matched_cb")
    return configs


def rotated(items: list, k: int) -> list:
    k %= len(items)
    return items[k:] + items[:k]


# ---------------------------------------------------------------- summaries


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def compiled_while_timed(results: list[dict], warmup: int) -> int | None:
    """Graphs torch.compile compiled from the end of the warm-up to the last timed iteration, over the runs."""
    counts = [[it.get("compiled_graphs") for it in r["iterations"]] for r in results]
    spans = [(c[warmup - 1] if warmup else 0, c[-1]) for c in counts if len(c) > warmup and None not in c]
    return sum(last - first for first, last in spans) if spans else None


def summarize(results: list[dict], warmup: int) -> dict:
    """One trainer over its repetitions: medians over the timed iterations of all of them."""
    ok = [r for r in results if "iterations" in r]
    timed = [it for r in ok for it in r["iterations"][warmup:]]
    out = {"repetitions": len(results), "failed": [r for r in results if "iterations" not in r]}
    if not timed:
        return out
    out.update({
        "seconds_per_iteration": median(it["seconds"] for it in timed),
        "cpu_seconds_per_iteration": median(it.get("cpu_seconds") for it in timed),
        "phases_s": {p: median(it[p] for it in timed) for p in PHASES},
        "tokens_per_s": median(it["tokens"] / it["seconds"] for it in timed if it.get("tokens")),
        "peak_memory_bytes": max((r["peak_memory_bytes"] for r in ok if r.get("peak_memory_bytes")), default=None),
        "peak_memory_kind": ok[0].get("peak_memory_kind"),
        "startup_s": median(r["startup_s"] for r in ok),
        "first_iteration_s": median(r["iterations"][0]["seconds"] for r in ok if r["iterations"]),
        "iterations_timed": len(timed),
        # torch.compile graphs compiled during the timed iterations (a recompile shows here; None: nothing compiled)
        "graphs_compiled_while_timed": compiled_while_timed(ok, warmup),
        "seconds_per_iteration_each_repetition": [median(it["seconds"] for it in r["iterations"][warmup:])
                                                  for r in ok],
        "settings": ok[0].get("settings"), "versions": ok[0].get("versions"), "command": ok[0].get("command"),
        "worker_command": "python bench/e2e_worker.py SPEC.json", "spec": results[0].get("spec"),
        "threads": ok[0].get("threads")})
    return out


def ratios(trainers: dict) -> dict:
    """fastrlhf's figure / each TRL configuration's (below 1: fastrlhf is faster or smaller)."""
    ours = trainers.get("fastrlhf", {})
    out = {}
    for name, theirs in trainers.items():
        if name == "fastrlhf" or "seconds_per_iteration" not in theirs or "seconds_per_iteration" not in ours:
            continue
        r = {"iteration": ours["seconds_per_iteration"] / theirs["seconds_per_iteration"]}
        if ours.get("cpu_seconds_per_iteration") and theirs.get("cpu_seconds_per_iteration"):
            r["iteration_cpu"] = ours["cpu_seconds_per_iteration"] / theirs["cpu_seconds_per_iteration"]
        r.update({p: ours["phases_s"][p] / theirs["phases_s"][p] for p in ("rollout", "logprobs", "update")
                  if theirs["phases_s"][p]})
        if ours.get("peak_memory_bytes") and theirs.get("peak_memory_bytes"):
            r["peak_memory"] = ours["peak_memory_bytes"] / theirs["peak_memory_bytes"]
        out[f"fastrlhf / {name}"] = {k: round(v, 3) for k, v in r.items()}
        pairs = zip(ours["seconds_per_iteration_each_repetition"], theirs["seconds_per_iteration_each_repetition"])
        out[f"fastrlhf / {name}"]["iteration_each_repetition"] = [round(a / b, 3) for a, b in pairs]
    return out


def to_target(result: dict) -> dict:
    """The first iteration whose samples' mean true score reaches TARGET_SCORE, and the seconds of
    training (the iterations' own) until its end."""
    if "iterations" not in result:
        return {"error": result.get("error") or result.get("skipped")}
    its = result["iterations"]
    curve = [it.get("true_score") for it in its]
    hit = next((i for i, s in enumerate(curve) if s is not None and s >= TARGET_SCORE), None)
    return {"iterations": None if hit is None else hit + 1,
            "seconds": None if hit is None else sum(it["seconds"] for it in its[:hit + 1]),
            "true_score_per_iteration": [None if s is None else round(s, 4) for s in curve],
            "seconds_per_iteration": median(it["seconds"] for it in its), "startup_s": result.get("startup_s")}


# ---------------------------------------------------------------- the parts


def timing_part(bench: Bench, algo: str) -> list[dict]:
    plan = bench.plan
    work = plan.grpo if algo == "grpo" else plan.ppo
    sections = []
    for model_name in (plan.grpo_models if algo == "grpo" else plan.ppo_models):
        model_dir, info = bench.model(model_name)
        configs = configs_for(bench, algo)
        section = {"algo": algo, "model": info, "work": dataclasses.asdict(work), "trainers": {}}
        bench.record["timing"].append(section)
        results = {c: [] for c in configs}
        for rep in range(plan.reps):
            for config in rotated(configs, rep):
                spec = spec_for(bench, config, algo, work, model_dir, data=str(bench.prompts),
                                iterations=plan.warmup + plan.iterations, warmup=plan.warmup, seed=rep,
                                eos_unreachable=True, compile=model_name in plan.compiled_models)
                results[config].append(bench.run(f"{algo}-{model_name}-{config}-rep{rep}", spec))
                section["trainers"] = {c: summarize(r, plan.warmup) for c, r in results.items() if r}
                section["ratios"] = ratios(section["trainers"])
                bench.save()
        sections.append(section)
    return sections


def learning_part(bench: Bench) -> None:
    plan = bench.plan
    model_dir, sft_command = bench.sft_model()
    bench.record["learning"]["sft"] = {"command": sft_command, "steps": plan.sft_steps}
    for algo in plan.learning_algos:
        work = plan.learning_grpo if algo == "grpo" else plan.learning_ppo
        configs = list(plan.learning_configs)
        section = {"algo": algo, "work": dataclasses.asdict(work), "budget_iterations": plan.budget,
                   "target_true_score": TARGET_SCORE, "trainers": {}}
        bench.record["learning"]["sections"].append(section)
        for i, seed in enumerate(plan.seeds):
            for config in rotated(configs, i):
                spec = spec_for(bench, config, algo, work, model_dir, data="builtin", iterations=plan.budget,
                                warmup=0, seed=seed, eos_unreachable=False)
                out = to_target(bench.run(f"learn-{algo}-{config}-seed{seed}", spec))
                trainer = section["trainers"].setdefault(config, {"seeds": {}})
                trainer["seeds"][str(seed)] = out
                reached = [s for s in trainer["seeds"].values() if s.get("iterations")]
                trainer.update(reached=f"{len(reached)} of {len(trainer['seeds'])}",
                               median_iterations=median(s["iterations"] for s in reached),
                               median_seconds=median(s["seconds"] for s in reached))
                bench.save()


def goals(record: dict) -> list[dict]:
    """The issue's goals, each a ratio within one record (reported, never asserted)."""
    out = []
    device = record["device"]
    for section in record["timing"]:
        model, algo = section["model"]["name"], section["algo"]
        for name, r in section.get("ratios", {}).items():
            limit = None
            if device == "cpu" and model == "llama-10m-v32k" and name.endswith("trl_matched"):
                limit = 0.5  # GRPO vs TRL matched at V=32000; PPO vs TRL 1.12
            elif device == "cuda" and algo == "grpo" and name.endswith("trl_matched"):
                limit = 0.4
            if limit is None:
                continue
            out.append({"goal": f"{algo} {model}: {name} seconds per iteration", "limit": limit,
                        "measured": r["iteration"], "met": r["iteration"] <= limit})
            if device == "cuda":
                out.append({"goal": f"{algo} {model}: {name} peak memory", "limit": 1.0,
                            "measured": r.get("peak_memory"), "met": (r.get("peak_memory") or 2) <= 1.0})
    for section in record["learning"]["sections"]:
        ours = section["trainers"].get("fastrlhf", {}).get("median_iterations")
        for name in ("trl_matched", "trl_shipped"):
            if name not in section["trainers"]:
                continue
            theirs = section["trainers"][name].get("median_iterations")
            out.append({"goal": f"learning {section['algo']}: fastrlhf's median iterations to true score "
                                f"{TARGET_SCORE} <= {name}'s", "measured": [ours, theirs],
                        "met": None if ours is None or theirs is None else ours <= theirs})
    return out


# ---------------------------------------------------------------- README table


def _fmt(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def record_heading(record: dict) -> str:
    """Where and how a record was measured, in one line (with the load when it was under load)."""
    commit = record["commit"][:7]
    if "code_commit" in record:  # the device's checkout: the session's first commit + the working tree measured
        commit = f"{record['code_commit'][:7]} (the device's checkout read {commit} + changes)"
    text = f"**{record['device_name']}**, {record['date']}, commit {commit}: `{record['command']}`"
    load = record.get("load_average") or {}
    if record.get("measured_under_load"):
        text += (f"; measured under load (1-minute load average {load['mean']} mean, {load['max']} max, on "
                 f"{load['cpus']} CPUs shared with other jobs)")
    if earlier := record.get("resumed_from"):
        text += (f"; continues the record of `{earlier['command']}` (commit {earlier['commit'][:7]}, started "
                 f"{earlier['date']}, load at its start: {start_load(earlier['uptime_start'])}), of which it "
                 f"reuses {len(earlier['reused_runs'])} runs")
    return text


def timing_rows(section: dict) -> list[str]:
    m = section["model"]
    model = f"{m['name']} ({m['parameters'] / 1e6:.1f}M, V={m['vocab_size']})"
    rows = []
    for name, t in section["trainers"].items():
        if "seconds_per_iteration" not in t:
            rows.append(f"| {section['algo']} | {model} | {name} | failed |" + " |" * 8)
            continue
        peak = t.get("peak_memory_bytes")
        ratio = section["ratios"].get(f"fastrlhf / {name}", {}).get("iteration")
        cells = [_fmt(t["seconds_per_iteration"]), *(_fmt(t["phases_s"][p]) for p in PHASES if p != "reward"),
                 _fmt(t["tokens_per_s"]), "-" if peak is None else f"{peak / 2**20:.0f}", _fmt(t["startup_s"]),
                 "" if name == "fastrlhf" else _fmt(ratio)]
        rows.append(f"| {section['algo']} | {model} | {name} | " + " | ".join(cells) + " |")
    return rows


def readme_table(records: list[dict]) -> str:
    """Per record: the timing table (medians) and the learning table."""
    lines = []
    for record in records:
        lines += [record_heading(record), "",
                  "| algorithm | model | trainer | s / iteration | rollout | log-probs | update | other | tokens/s "
                  "| peak MiB | start-up s | fastrlhf / this |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for section in record["timing"]:
            lines += timing_rows(section)
        if record["learning"]["sections"]:
            lines += ["", f"| learning | trainer | iterations to true score {TARGET_SCORE} (median) "
                          "| seconds (median) | seeds that reached it |", "| --- | --- | ---: | ---: | --- |"]
            for section in record["learning"]["sections"]:
                for name, t in section["trainers"].items():
                    lines.append(f"| {section['algo']} | {name} | {_fmt(t['median_iterations'])} | "
                                 f"{_fmt(t['median_seconds'])} | {t['reached']} of budget "
                                 f"{section['budget_iterations']} iterations |")
        if record.get("goals"):
            lines += ["", "| goal (issue 27) | limit | measured | met |", "| --- | ---: | ---: | --- |"]
            for g in record["goals"]:
                m = g["measured"]
                measured = " vs ".join(map(_fmt, m)) if isinstance(m, list) else _fmt(m)
                met = {True: "yes", False: "no", None: "-"}[g["met"]]
                lines.append(f"| {g['goal']} | {g.get('limit', '')} | {measured} | {met} |")
        lines.append("")
    return "\n".join(lines)


def latest_records(results_dir: Path = RESULTS) -> list[dict]:
    """The newest finished e2e record per device (CPU first)."""
    best = {}
    for path in sorted(results_dir.glob("*-e2e.json")):
        record = json.loads(path.read_text())
        if record.get("schema") == SCHEMA and record.get("finished") and not record.get("quick"):
            if record["device"] not in best or record["date"] >= best[record["device"]]["date"]:
                best[record["device"]] = dict(record, file=path.name)
    return [best[d] for d in ("cpu", "cuda") if d in best]


def update_readme(readme: Path = ROOT / "README.md", results_dir: Path = RESULTS) -> None:
    """Rewrite the block between README_START and README_END from the latest records."""
    records = latest_records(results_dir)
    if not records:
        raise SystemExit(f"no finished e2e record in {results_dir}")
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise SystemExit(f"{readme} has no {README_START} ... {README_END} block")
    head, rest = text.split(README_START, 1)
    _, tail_ = rest.split(README_END, 1)
    files = ", ".join(r["file"] for r in records)
    note = f"<!-- generated by `python bench/e2e.py --readme` from {files} -->"
    block = f"{README_START}\n{readme_table(records)}\n{note}\n"
    readme.write_text(head + block + README_END + tail_)


# ---------------------------------------------------------------- main


def new_record(args, plan: Plan, parts: list[str]) -> dict:
    import importlib.metadata

    import torch

    from fastrlhf.bench.environment import environment
    from fastrlhf.estimate.record import cpu_model

    env = environment(torch.device(args.device))
    return {
        "schema": SCHEMA, "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": args.device,
        "device_name": env["device"] if args.device == "cuda" else f"CPU: {cpu_model()}, {os.cpu_count()} cores",
        "commit": env.get("commit") or "unknown", "environment": env, "quick": args.quick, "parts": parts,
        "command": shlex.join(["python", "bench/e2e.py", *args.argv]), "finished": False,
        "versions": {d: _version(importlib.metadata, d) for d in ("torch", "transformers", "peft", "accelerate", "trl")}
        | {"trl (PPOTrainer, from its wheel)": TRL_PPO_VERSION},
        "plan": dataclasses.asdict(plan),
        "configurations": {
            "fastrlhf": "fastrlhf.train.recipes.ppo.train (`fastrlhf ppo`): GRPO with --kl_in_loss, or PPO with GAE "
                        "and a value head on the policy's LoRA trunk; rollout_cache auto (static on one CUDA process); "
                        "on CPU --rollout_sampler inverse_cdf (softmax(logits / T) drawn by inversion, one "
                        "uniform per row: the distribution torch.multinomial draws, from fewer random numbers), "
                        "--rollout_engine graph (fastrlhf's decode step over merged-LoRA fp32 weights, run "
                        "eagerly) and --old_logprobs sampler (verl's rollout_correction.bypass_mode: the engine's "
                        "fp32 log-probs of its tokens, and PPO's values, are the old ones, within 1e-5 of a "
                        "forward's (tests/train/test_engine.py); phase 3 scores the reference only); --compile on "
                        "for the plan's compiled_models (the decoder layers; the build is in the warm-up iteration)",
            "trl_shipped": "TRL's defaults for how the work is done: gradient checkpointing, adamw_torch_fused with "
                           "a linear decay, bf16 autocast (bf16=True, on CPU too), GRPO use_bias_correction_kl=True, "
                           "generate with the dynamic cache; PPO: a separate AutoModelForSequenceClassification "
                           "critic, every weight trained (TRL's example)",
            "trl_matched": "fastrlhf's settings: no gradient checkpointing, adamw_torch at a constant rate, fp32 on "
                           "CPU (bf16 base and autocast on CUDA), GRPO use_bias_correction_kl=False; PPO: a value head "
                           "on the policy's LoRA trunk; CUDA GRPO generation: cache_implementation=static",
            "trl_matched_cb": "trl_matched with use_transformers_continuous_batching=True (CUDA only)"},
        "iteration": "from the start of the rollout to the end of the last optimizer step (each trainer's logging "
                     "after it is not counted); phases: rollout (generation and decoding), reward, logprobs (old "
                     "policy and reference log-probs, and PPO's values, without grad), update (the PPO epochs), "
                     "other (advantages and the rest); cpu_seconds: the CPU time the trainer's process spent in the "
                     "iteration (one thread: under load it varies less than the wall time; its ratio is "
                     "iteration_cpu)",
        "notes": NOTES, "timing": [], "learning": {"sections": []},
    }


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _version(metadata, name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="every part at a small size (CI)")
    parser.add_argument("--only", default=",".join(PARTS), help=f"parts, comma-separated: {', '.join(PARTS)}")
    parser.add_argument("--out", help="the record (default bench/results/<date>-<device>-e2e.json; "
                                      "--quick: WORK/e2e-quick.json)")
    parser.add_argument("--work", help="scratch folder (default: a new temporary one)")
    parser.add_argument("--trl-ppo-wheel", type=Path, default=Path(os.environ.get("FASTRLHF_TRL_PPO_WHEEL",
                                                                                  TRL_PPO_WHEEL)),
                        help=f"TRL {TRL_PPO_VERSION}'s wheel (PPOTrainer); default {TRL_PPO_WHEEL.relative_to(ROOT)}")
    parser.add_argument("--models", help="timing models instead of the plan's, comma-separated (bench/e2e_model.py)")
    parser.add_argument("--reps", type=int, help="repetitions of the timing runs instead of the plan's")
    parser.add_argument("--deadline-s", type=float, default=None, help="start no run after this many seconds")
    parser.add_argument("--resume", action="store_true",
                        help="continue the unfinished record at --out (default path included): reuse the runs "
                             "whose spec and result are in --work, run the rest")
    parser.add_argument("--readme", action="store_true", help="rewrite the README's table from the latest records")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.readme:
        update_readme()
        return 0
    parts = [p for p in args.only.split(",") if p]
    if bad := [p for p in parts if p not in PARTS]:
        parser.error(f"--only: unknown part(s) {', '.join(bad)}; parts: {', '.join(PARTS)}")
    if ("ppo" in parts or "learning" in parts) and not args.trl_ppo_wheel.is_file():
        parser.error(f"TRL {TRL_PPO_VERSION}'s wheel is not at {args.trl_ppo_wheel} (PPO runs against its "
                     f"PPOTrainer): `python -m pip download --no-deps trl=={TRL_PPO_VERSION} -d "
                     f"{args.trl_ppo_wheel.parent}`, or pass --trl-ppo-wheel, or leave ppo and learning out "
                     "(--only grpo)")
    args.trl_ppo_wheel = args.trl_ppo_wheel.resolve()
    plan = PLANS["quick" if args.quick else args.device]
    if args.models:
        models = tuple(args.models.split(","))
        plan = dataclasses.replace(plan, grpo_models=models, ppo_models=models)
    if args.reps:
        plan = dataclasses.replace(plan, reps=args.reps)
    if args.resume and not args.work:
        parser.error("--resume needs --work: the folder of the runs it continues")
    record = new_record(args, plan, parts)
    bench = Bench(args, plan, record)
    name = "e2e-quick.json" if args.quick else f"{record['date'][:10]}-{args.device}-e2e.json"
    args.out = args.out or str((bench.work if args.quick else RESULTS) / name)
    if args.resume:
        record["resumed_from"] = resumed_from(Path(args.out))
    start = time.time()
    record["uptime"] = {"start": uptime()}
    with LoadSampler() as load:
        for part in parts:
            if part == "learning":
                learning_part(bench)
            else:
                timing_part(bench, part)
    record["uptime"]["end"] = uptime()
    record["load_average"] = load.summary()
    earlier = start_load(record.get("resumed_from", {}).get("uptime_start")) or 0.0
    record["measured_under_load"] = args.device == "cpu" and max(record["load_average"]["mean"], earlier) > 1.5
    record["seconds"] = round(time.time() - start, 1)
    record["goals"] = goals(record)
    record["finished"] = True
    bench.save()
    print(readme_table([record]))
    for g in record["goals"]:
        print(f"goal: {g['goal']}: measured {g['measured']}, met {g['met']}")
    print(f"record: {args.out}; work folder {bench.work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
