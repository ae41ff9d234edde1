"""One training run of bench/e2e.py in a fresh process: fastrlhf, TRL's GRPOTrainer or TRL 1.12's
PPOTrainer, timed per iteration and per phase.

    python bench/e2e_worker.py SPEC.json      # writes the result JSON named in the spec

The spec (bench/e2e.py writes it) names the trainer, the algorithm, the configuration, the model
directory, the data and the sizes; the result holds per iteration its wall time and phases
(rollout, reward, logprobs, update, other), response tokens and the mean true score of the
rollout (the built-in task's rule: fastrlhf.train.task.true_score), and for the run its start-up time
(process start to the first iteration), peak memory over the timed iterations and the versions
it ran with. TRL 1.12 (the last TRL with PPOTrainer) is imported from its wheel file, put first on
sys.path in this process alone (zipimport: the installed TRL is not touched).

Phases are taken where each trainer does the work, through hooks that change nothing it computes:
- fastrlhf: its own phase timer (fastrlhf.train.metrics.PhaseTimer, subclassed to note the times);
  an iteration runs from the rollout's start to the update's end; `other` is the advantages
  phase and the gaps between phases.
- TRL GRPOTrainer: its methods wrapped on the instance: `_generate` (rollout), `_calculate_rewards`
  (reward), `_get_per_token_logps_and_entropies` without grad (log-probs: old and reference), and
  `_generate_and_score_completions` (the rest of it is `other`: advantages, metrics); an iteration
  runs from there to the end of its last optimizer step (a TrainerCallback); `update` is the rest.
- TRL 1.12 PPOTrainer: the module functions its `train` calls, wrapped: `batch_generation`
  (rollout), `forward` / `selective_log_softmax` / `get_reward` without grad (log-probs, values;
  `get_reward` of the reward stand-in is the reward), and the optimizer's `step`; `update` runs
  from the first forward with grad to the last optimizer step; `other` is GAE and the rest.
On CUDA every boundary synchronises the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from fastrlhf.train.checkpoint import json_safe

PHASES = ("rollout", "reward", "logprobs", "update", "other")


# ---------------------------------------------------------------- timing


class PeakMemory:
    """Peak memory from `start()` on: CUDA allocated, or (CPU, Linux) the process's peak RSS."""

    def __init__(self, device: torch.device):
        from fastrlhf.train.metrics import CPUPeakRSS

        self.device = device
        self.cpu = CPUPeakRSS() if device.type == "cpu" else None
        self.kind = "CUDA max allocated" if device.type == "cuda" else (
            "peak RSS of the process" if self.cpu.available else None)

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind:
            self.cpu.start()

    def peak(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self.cpu.peak() if self.kind else None


class Recorder:
    """Iterations of one run: each a start, phase sums, and the span of its update."""

    def __init__(self, device: torch.device, warmup: int):
        self.device, self.warmup = device, warmup
        self.iterations: list[dict] = []
        self.current: dict | None = None
        self.first_start_wall: float | None = None
        self.memory = PeakMemory(device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self) -> None:
        """Start an iteration (nothing if one is open)."""
        if self.current is not None:
            return
        self.sync()
        if len(self.iterations) == self.warmup:
            self.memory.start()
        if self.first_start_wall is None:
            self.first_start_wall = time.time()
        self.current = {"start": time.perf_counter(), "cpu_start": time.process_time(), "phases": defaultdict(float),
                        "update_start": None, "update_end": None}

    def timed(self, name: str, fn, *, when=lambda *a, **k: True):
        """fn, with its time added to phase `name` of the open iteration when `when(*args)` holds."""

        def wrapper(*args, **kwargs):
            if self.current is None or not when(*args, **kwargs):
                return fn(*args, **kwargs)
            self.sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                if self.current is not None:
                    self.current["phases"][name] += time.perf_counter() - start

        return wrapper

    def mark(self, key: str, first: bool = False) -> None:
        """Note the time now as the open iteration's `key` (`first`: only if not noted yet)."""
        if self.current is not None and not (first and self.current[key] is not None):
            self.sync()
            self.current[key] = time.perf_counter()

    def end(self, *, at: str | None = None, **extra) -> None:
        """Close the open iteration now (or at its noted time `at`). Its update is the phase `update`
        (fastrlhf), the time after `scoring` (TRL GRPO: generation, scoring and advantages come first),
        or the noted span `update_start`..`update_end` (TRL PPO); `other` is what no phase covers."""
        if self.current is None:
            return
        self.sync()
        cur, self.current = self.current, None
        seconds = (time.perf_counter() if at is None or cur[at] is None else cur[at]) - cur["start"]
        # the CPU time this process spent in the iteration (to its end, whatever `at`): on a loaded machine a
        # one-thread trainer's CPU seconds vary less than its wall seconds
        cpu_seconds = time.process_time() - cur["cpu_start"]
        phases = dict(cur["phases"])
        if "scoring" in phases:
            phases["update"] = seconds - phases.pop("scoring")
        elif cur["update_start"] is not None:
            phases["update"] = cur["update_end"] - cur["update_start"]
        phases["other"] = seconds - sum(phases.get(p, 0.0) for p in PHASES if p != "other")
        noted = {k: cur[k] for k in ("tokens", "true_score") if k in cur}
        self.iterations.append({"seconds": seconds, "cpu_seconds": cpu_seconds,
                                **{p: phases.get(p, 0.0) for p in PHASES}, **noted, **extra})


def versions(names) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


# ---------------------------------------------------------------- fastrlhf


def fastrlhf_settings(spec: dict) -> dict:
    """fastrlhf's PPOConfig keys here beyond the shared work. On CPU: --rollout_sampler inverse_cdf (the
    same distribution as torch.multinomial, whose exponential_ costs ~4x the draw there), --rollout_engine
    graph (fastrlhf's decode step over merged-LoRA fp32 weights, run eagerly, drawing by inversion) and
    --old_logprobs sampler (verl's bypass_mode: the engine's fp32 log-probs of its tokens, and with a
    critic its values, are the old ones; phase 3 scores the reference only); with spec["compile"], --compile
    on (inductor's C++ build of one decoder layer in the warm-up iteration). On CUDA the defaults (HF
    generate with the static cache, torch.multinomial, compiled layers)."""
    if spec["device"] != "cpu":
        return {"rollout_sampler": "multinomial"}
    return {"rollout_sampler": "inverse_cdf", "rollout_engine": "graph", "old_logprobs": "sampler",
            **({"compile": "on"} if spec.get("compile") else {})}


def run_fastrlhf(spec: dict, rec: Recorder, work: Path) -> dict:
    """`fastrlhf ppo` in this process (fastrlhf.train.recipes.ppo.train), GRPO (KL in the loss) or PPO with GAE."""
    from fastrlhf.train import metrics
    from fastrlhf.train.config import PPOConfig
    from fastrlhf.train.recipes import ppo

    class NotedPhases(metrics.PhaseTimer):
        """The trainer's phase timer, noting each phase's time in the recorder too."""

        @contextlib.contextmanager
        def phase(self, name):
            if name == "rollout":
                rec.begin()
            start = time.perf_counter()
            with super().phase(name):
                yield
            if rec.current is not None and name != "advantages":  # advantages are part of `other`
                rec.current["phases"][name] += time.perf_counter() - start
            if name == "update":
                rec.end()

    grpo = spec["algo"] == "grpo"
    cfg = PPOConfig(
        model=spec["model_dir"], reward="fastrlhf.train.task:true_score", data=spec["data"], out=str(work / "run"),
        steps=spec["iterations"], rollout_batch_size=spec["rollout_batch"], mini_batch_size=spec["mini_batch"],
        micro_batch_size=spec["micro_batch"], ppo_epochs=spec["epochs"], lr=spec["lr"], lora_rank=spec["lora_rank"],
        lora_alpha=spec["lora_alpha"], max_new_tokens=spec["response_len"], temperature=spec["temperature"],
        advantage="grpo" if grpo else "gae", num_generations=spec["generations"], kl_in_loss=grpo,
        kl_coef=spec["kl_coef"], vf_coef=spec["vf_coef"], eval_prompts=spec["eval_prompts"], seed=spec["seed"],
        save_every=spec["iterations"] + 1, device=spec["device"], dtype="auto", rollout_cache="auto",
        overwrite=True, **fastrlhf_settings(spec))
    ppo.PhaseTimer = NotedPhases
    summary = ppo.train(cfg)
    defaults = PPOConfig()
    command = ["fastrlhf", "ppo"] + [f"--{k}={v}" for k, v in dataclasses.asdict(cfg).items()
                                     if v != getattr(defaults, k) and k not in ("out", "overwrite")]
    rows = [r for r in metrics.read_metrics(work / "run") if r["stage"] == "ppo"]
    for it, row in zip(rec.iterations, rows):
        it["tokens"] = row["response_length"] * spec["rollout_batch"]
        it["true_score"] = row.get("true_score")
        it["compiled_graphs"] = row.get("compiled_graphs")  # torch.compile's graphs so far (None: not compiled)
    peaks = [v for row in rows[spec["warmup"]:] for k, v in row.items() if k.startswith("memory/")]
    return {"peak_memory_bytes": int(max(peaks)) if peaks else None,
            "peak_memory_kind": "max over phases of " + ("CUDA max allocated" if rec.device.type == "cuda"
                                                         else "the process's peak RSS (fastrlhf's phase timer)"),
            "settings": {"rollout_cache": summary.get("rollout_cache"), "rollout_sampler": cfg.rollout_sampler,
                         "rollout_engine": cfg.rollout_engine, "old_logprobs": cfg.old_logprobs,
                         "compile": cfg.compile, "dtype": cfg.dtype,
                         "gradient_checkpointing": cfg.gradient_checkpointing, "optimizer": "torch.optim.AdamW",
                         "max_grad_norm": cfg.max_grad_norm},
            "versions": versions(("fastrlhf", "torch", "transformers", "peft")), "command": shlex.join(command)}


# ---------------------------------------------------------------- TRL


def trl_training_args(spec: dict, matched: bool) -> dict:
    """TrainingArguments keys both TRL trainers take: as shipped, only what the run needs; matched,
    fastrlhf's settings (no gradient checkpointing, torch AdamW at a constant rate, fp32 on CPU and
    bf16 autocast on CUDA)."""
    cuda = spec["device"] == "cuda"
    args = {"output_dir": spec["out_dir"], "learning_rate": spec["lr"], "seed": spec["seed"], "report_to": "none",
            "save_strategy": "no", "disable_tqdm": True, "use_cpu": not cuda, "dataloader_num_workers": 0}
    if matched:
        args.update(gradient_checkpointing=False, optim="adamw_torch", lr_scheduler_type="constant", bf16=cuda,
                    max_grad_norm=1.0, weight_decay=0.0)
    return args


def lora_config(spec: dict):
    """fastrlhf's LoRA: every linear layer but the lm_head, no dropout (fastrlhf.train.heads.ActorCritic)."""
    from peft import LoraConfig

    return LoraConfig(r=spec["lora_rank"], lora_alpha=spec["lora_alpha"], lora_dropout=0.0,
                      target_modules="all-linear", task_type="CAUSAL_LM")


def model_dtype(spec: dict, matched: bool) -> str:
    """fastrlhf's frozen LoRA base: bfloat16 on CUDA, float32 on CPU; TRL as shipped loads float32."""
    return "bfloat16" if matched and spec["device"] == "cuda" else "float32"


def trl_grpo(spec: dict, rec: Recorder, work: Path) -> dict:
    """TRL's GRPOTrainer: 1 generation of rollout_batch sequences per iteration, reused for `epochs`
    passes (num_iterations) of rollout_batch / mini_batch optimizer steps, each mini_batch / micro_batch
    micro-batches (per_device_train_batch_size, gradient_accumulation_steps, steps_per_generation)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fastrlhf.train import task

    matched = spec["config"] == "matched"
    per_iter = spec["epochs"] * (spec["rollout_batch"] // spec["mini_batch"])  # optimizer steps per iteration
    gen = {}
    if spec.get("trl_generation") == "static":
        gen["cache_implementation"] = "static"
    elif spec.get("trl_generation") == "continuous_batching":
        gen["use_transformers_continuous_batching"] = True
    kwargs = dict(
        **trl_training_args(spec, matched), **gen,
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["mini_batch"] // spec["micro_batch"],
        steps_per_generation=spec["rollout_batch"] // spec["micro_batch"], num_iterations=spec["epochs"],
        num_generations=spec["generations"], max_completion_length=spec["response_len"],
        temperature=spec["temperature"], beta=spec["kl_coef"], max_steps=spec["iterations"] * per_iter,
        logging_steps=per_iter,
        **({"use_bias_correction_kl": False,
            "model_init_kwargs": {"dtype": model_dtype(spec, matched)}} if matched else {}))
    args = GRPOConfig(**kwargs)

    def true_score(prompts, completions, completion_ids, **kwargs):
        scores = task.true_score(prompts, completions)
        if rec.current is not None:
            rec.current["tokens"] = sum(map(len, completion_ids))
            rec.current["true_score"] = sum(scores) / len(scores)
        return scores

    prompts = read_prompts(spec)
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=true_score, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), peft_config=lora_config(spec))

    class IterationEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % per_iter == 0:
                rec.end()

    scoring = rec.timed("scoring", trainer._generate_and_score_completions)

    def begin_and_score(*args, **kwargs):  # an iteration starts with its generation
        rec.begin()
        return scoring(*args, **kwargs)

    trainer._generate_and_score_completions = begin_and_score
    trainer._generate = rec.timed("rollout", trainer._generate)
    trainer._calculate_rewards = rec.timed("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = rec.timed(
        "logprobs", trainer._get_per_token_logps_and_entropies, when=lambda *a, **k: not torch.is_grad_enabled())
    trainer.add_callback(IterationEnd())
    trainer.train()
    return {"peak_memory_bytes": rec.memory.peak(), "peak_memory_kind": rec.memory.kind,
            "settings": trl_settings(trainer.args, gen),
            "versions": versions(("trl", "accelerate", "torch", "transformers", "peft")),
            "command": trl_command("GRPOTrainer(model=MODEL_DIR, reward_funcs=true_score, train_dataset=PROMPTS, "
                                   "args=GRPOConfig(**ARGS), peft_config=LORA)", kwargs, spec)}


def trl_command(call: str, kwargs: dict, spec: dict) -> str:
    """The trainer call with its arguments spelled out (output_dir is a temporary folder)."""
    lora = {"r": spec["lora_rank"], "lora_alpha": spec["lora_alpha"], "lora_dropout": 0.0,
            "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
    args = {k: v for k, v in kwargs.items() if k != "output_dir"}
    return f"{call} with ARGS = {json.dumps(args)}, LORA = LoraConfig(**{json.dumps(lora)})"


def trl_settings(args, gen: dict) -> dict:
    return {"gradient_checkpointing": args.gradient_checkpointing, "optim": str(args.optim),
            "lr_scheduler_type": str(args.lr_scheduler_type), "bf16": args.bf16, "max_grad_norm": args.max_grad_norm,
            "generation": gen or "generate, dynamic cache (default)",
            **{k: getattr(args, k) for k in ("use_bias_correction_kl", "loss_type", "scale_rewards")
               if hasattr(args, k)}}


def read_prompts(spec: dict) -> list[str]:
    if spec["data"] == "builtin":
        from fastrlhf.train import task

        return [r["prompt"] for r in task.synthetic_prompt_rows(task.NUM_PPO_PROMPTS, spec["seed"])]
    return [json.loads(line)["prompt"] for line in Path(spec["data"]).read_text().splitlines() if line.strip()]


class RuleReward(nn.Module):
    """The built-in task's rule (fastrlhf.train.task.true_score) where TRL 1.12's PPOTrainer wants a
    sequence-classification reward model: its `get_reward` runs `model.<base_model_prefix>(...)`,
    then `model.score(hidden_states[-1])` [B, T, 1], and reads each row at its last response token.
    Here the "backbone" hands the token ids through and `score` puts each row's rule score at every
    position. `context_length` (the prompt columns) is set before each call by the wrapped get_reward."""

    base_model_prefix = "backbone"

    class _Ids(nn.Module):
        def forward(self, input_ids, attention_mask, **kwargs):
            from types import SimpleNamespace

            return SimpleNamespace(hidden_states=(input_ids * attention_mask,))

    def __init__(self, tokenizer, rec: Recorder):
        super().__init__()
        self.backbone = self._Ids()
        self.tokenizer, self.rec = tokenizer, rec
        self.context_length = 0

    def score(self, ids: torch.Tensor) -> torch.Tensor:
        from fastrlhf.train import task

        P = self.context_length
        decode = self.tokenizer.batch_decode
        prompts = decode(ids[:, :P].tolist(), skip_special_tokens=True)
        responses = decode(ids[:, P:].tolist(), skip_special_tokens=True)
        scores = task.true_score(prompts, responses)
        if self.rec.current is not None:
            self.rec.current["tokens"] = int((ids[:, P:] != self.tokenizer.pad_token_id).sum())
            self.rec.current["true_score"] = sum(scores) / len(scores)
        return torch.tensor(scores, device=ids.device)[:, None, None].expand(*ids.shape, 1)


class SharedTrunkValue(nn.Module):
    """A value model on the policy's own trunk (as fastrlhf's actor-critic): TRL 1.12's
    PolicyAndValueWrapper runs `value_model.<base_model_prefix>` and `value_model.score`; here the
    backbone is the policy's decoder stack itself (get_peft_model later puts LoRA into it in place)
    and the head a float32 [hidden -> 1] linear, initialised as fastrlhf's value head."""

    base_model_prefix = "trunk"

    def __init__(self, policy):
        super().__init__()
        self.trunk = getattr(policy, policy.base_model_prefix)
        hidden = policy.config.hidden_size
        self.score = nn.Linear(hidden, 1, dtype=torch.float32)
        nn.init.normal_(self.score.weight, std=1.0 / (hidden + 1) ** 0.5)
        nn.init.zeros_(self.score.bias)


def trl_ppo(spec: dict, rec: Recorder, work: Path) -> dict:
    """TRL 1.12's PPOTrainer with LoRA on the policy (reference: the adapter disabled): rollout_batch
    prompts per iteration (per_device_train_batch_size = micro_batch, gradient_accumulation_steps =
    rollout / micro, num_mini_batches = rollout / mini), num_ppo_epochs = epochs. As shipped, the
    critic is TRL's example's: a separate AutoModelForSequenceClassification of the same checkpoint,
    all weights trained; matched, a value head on the policy's own LoRA trunk (SharedTrunkValue)."""
    sys.path.insert(0, spec["trl_ppo_wheel"])
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as module

    if not trl.__file__.startswith(spec["trl_ppo_wheel"]):
        raise RuntimeError(f"trl imported from {trl.__file__}, not from {spec['trl_ppo_wheel']}")
    matched = spec["config"] == "matched"
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], padding_side="left")
    dtype = getattr(torch, model_dtype(spec, matched))
    policy = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype)
    value = SharedTrunkValue(policy) if matched else AutoModelForSequenceClassification.from_pretrained(
        spec["model_dir"], num_labels=1, dtype=dtype)
    reward = RuleReward(tokenizer, rec)
    prompts = read_prompts(spec)
    data = Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in prompts]})
    B = spec["rollout_batch"]
    kwargs = dict(
        **trl_training_args(spec, matched), per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=B // spec["micro_batch"], num_mini_batches=B // spec["mini_batch"],
        num_ppo_epochs=spec["epochs"], total_episodes=spec["iterations"] * B, response_length=spec["response_len"],
        temperature=spec["temperature"], kl_coef=spec["kl_coef"], vf_coef=spec["vf_coef"],
        stop_token=None if spec["eos_unreachable"] else "eos", local_rollout_forward_batch_size=B,
        num_sample_generations=0, logging_steps=1)
    args = PPOConfig(**kwargs)
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=None, reward_model=reward,
                         train_dataset=data, value_model=value, peft_config=lora_config(spec))

    def no_grad(*args, **kwargs):
        return not torch.is_grad_enabled()

    generation = rec.timed("rollout", module.batch_generation)

    def begin_and_generate(*args, **kwargs):  # an iteration starts with its generation, ends at its last step
        rec.end(at="update_end")
        rec.begin()
        return generation(*args, **kwargs)

    forward, get_reward = module.forward, module.get_reward

    def noted_forward(model, *args, **kwargs):  # with grad: the update's forward
        if torch.is_grad_enabled():
            rec.mark("update_start", first=True)
        return forward(model, *args, **kwargs)

    def noted_get_reward(model, query_responses, pad_token_id, context_length):
        model.context_length = context_length
        return rec.timed("reward" if model is reward else "logprobs", get_reward)(
            model, query_responses, pad_token_id, context_length)

    module.batch_generation = begin_and_generate
    module.forward = rec.timed("logprobs", noted_forward, when=no_grad)
    module.selective_log_softmax = rec.timed("logprobs", module.selective_log_softmax, when=no_grad)
    module.get_reward = noted_get_reward
    step = trainer.optimizer.step

    def noted_step(*args, **kwargs):
        out = step(*args, **kwargs)
        rec.mark("update_end")
        return out

    trainer.optimizer.step = noted_step
    trainer.train()
    rec.end(at="update_end")
    return {"peak_memory_bytes": rec.memory.peak(), "peak_memory_kind": rec.memory.kind,
            "settings": {**trl_settings(trainer.args, {}), "critic": "value head on the policy's LoRA trunk"
                         if matched else "separate AutoModelForSequenceClassification, all weights trained"},
            "versions": {**versions(("accelerate", "torch", "transformers", "peft")), "trl": trl.__version__},
            "command": trl_command("PPOTrainer(args=PPOConfig(**ARGS), model=AutoModelForCausalLM(MODEL_DIR), "
                                   "ref_model=None, reward_model=RuleReward, value_model=" + (
                                       "SharedTrunkValue(model)" if matched else
                                       "AutoModelForSequenceClassification(MODEL_DIR, num_labels=1)")
                                   + ", train_dataset=PROMPTS, peft_config=LORA)", kwargs, spec)}


RUNNERS = {("fastrlhf", "grpo"): run_fastrlhf, ("fastrlhf", "ppo"): run_fastrlhf, ("trl", "grpo"): trl_grpo,
           ("trl", "ppo"): trl_ppo}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    device = torch.device(spec["device"])
    if device.type == "cpu":
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    rec = Recorder(device, spec["warmup"])
    with tempfile.TemporaryDirectory(prefix="e2e_worker_") as tmp:
        spec["out_dir"] = str(Path(tmp) / "trl_out")
        info = RUNNERS[(spec["trainer"], spec["algo"])](spec, rec, Path(tmp))
    result = {"iterations": rec.iterations,
              "startup_s": rec.first_start_wall - spec["spawn_time"] if rec.first_start_wall else None,
              "threads": torch.get_num_threads() if device.type == "cpu" else None, **info}
    Path(spec["result"]).write_text(json.dumps(json_safe(result), indent=1, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
