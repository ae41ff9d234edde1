"""`fastrlhf estimate --compare-run OUT`: a fastrlhf run's measured PPO phases beside the planner's.

Reads what the trainer writes (fastrlhf/train/recipes/ppo.py, fastrlhf/train/metrics.py):
- OUT/metrics.jsonl rows with "stage": "ppo": `time/<phase>` (seconds of that phase in that
  iteration) and `memory/<phase>` (peak bytes: `torch.cuda.max_memory_allocated` on CUDA, the
  process's peak RSS on CPU), phases rollout, reward, logprobs, advantages, update;
- OUT/config.json (written by `fastrlhf pipeline`; its "ppo" section) or, for a stand-alone
  `fastrlhf ppo`, the command's own arguments;
- OUT/summary.json["ppo"]["device"].

The first logged iteration is a warm-up (allocator, kernel caches) and is left out of the medians
when there are at least three.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastrlhf.estimate.phases import PPO_PHASES


@dataclass
class RunRecord:
    """What one PPO run measured, and the configuration it ran with."""

    out: str
    config: dict
    device: str
    prompt_len: int
    rows: list[dict] = field(default_factory=list)
    model_config: dict = field(default_factory=dict)  # the policy's Hugging Face config
    reward_config: dict | None = None  # the reward model's config; None = a rule reward
    device_name: str = ""  # torch.cuda.get_device_name when recorded on CUDA
    cpu_threads: int | None = None  # OMP_NUM_THREADS the run was started with (None: the trainer's rule)

    def phase_seconds(self, stat: str = "median", key: str = "time") -> dict[str, float]:
        """Seconds per iteration of each phase over the iterations after the warm-up one (from 3 rows on):
        their median or minimum, of the wall time (`time/<phase>`, what the trainer logs) or of the
        process's CPU time (`cpu/<phase>`, added by `record --cpu-time`)."""
        rows = self.rows[1:] if len(self.rows) >= 3 else self.rows
        reduce = {"median": statistics.median, "min": min}[stat]
        return {ph: reduce([r[f"{key}/{ph}"] for r in rows]) for ph in PPO_PHASES
                if rows and all(f"{key}/{ph}" in r for r in rows)}

    def has_cpu_time(self) -> bool:
        return bool(self.rows) and all(f"cpu/{ph}" in r for r in self.rows for ph in PPO_PHASES)

    def phase_seconds_spread(self) -> dict[str, tuple[float, float]]:
        rows = self.rows[1:] if len(self.rows) >= 3 else self.rows
        return {ph: (min(r[f"time/{ph}"] for r in rows), max(r[f"time/{ph}"] for r in rows))
                for ph in PPO_PHASES if rows and all(f"time/{ph}" in r for r in rows)}

    def phase_peak_bytes(self) -> dict[str, int]:
        return {ph: int(max(r[f"memory/{ph}"] for r in self.rows)) for ph in PPO_PHASES
                if self.rows and all(f"memory/{ph}" in r for r in self.rows)}

    def mean_response_length(self) -> float:
        return statistics.fmean(r["response_length"] for r in self.rows if "response_length" in r)

    def mean_response_width(self) -> float | None:
        """The batch's response columns (its longest response) averaged over the rows; None for a record
        made before the trainer logged them."""
        widths = [r["response_width"] for r in self.rows if "response_width" in r]
        return statistics.fmean(widths) if widths else None

    def to_json(self) -> dict:
        out = asdict(self)
        out["rows"] = [{k: v for k, v in r.items() if k.startswith(("time/", "memory/", "cpu/")) or k in
                        ("step", "response_length", "response_width", "tokens_per_s")} for r in self.rows]
        out["median_phase_seconds"] = self.phase_seconds()
        out["min_phase_seconds"] = self.phase_seconds("min")
        out["peak_phase_bytes"] = self.phase_peak_bytes()
        out["mean_response_length"] = self.mean_response_length() if self.rows else None
        return out

    @classmethod
    def from_json(cls, data: dict) -> RunRecord:
        return cls(out=data["out"], config=data["config"], device=data["device"], prompt_len=data["prompt_len"],
                   rows=data["rows"], model_config=data.get("model_config", {}),
                   reward_config=data.get("reward_config"), device_name=data.get("device_name", ""),
                   cpu_threads=_int_or_none((data.get("machine") or {}).get("omp_num_threads")))


def _int_or_none(value) -> int | None:
    return int(value) if value not in (None, "") else None


def _ppo_config(out: Path, argv: list[str] | None) -> dict:
    path = out / "config.json"
    if path.is_file():
        cfg = json.loads(path.read_text())
        return cfg["ppo"] if "ppo" in cfg else cfg
    if argv is None:
        raise ValueError(f"compare-run: {path} does not exist; the run's configuration is needed "
                         "(fastrlhf pipeline writes it; for a stand-alone `fastrlhf ppo`, give its arguments "
                         "with --run-args '...')")
    from fastrlhf.train.config import PPOConfig, parse_args, to_dict

    return to_dict(parse_args(PPOConfig, argv))


def policy_dir(out: Path, config: dict) -> str:
    """The policy the run trained: `model` (a directory or a built-in name) or OUT/sft/final."""
    return config.get("model") or str(out / "sft" / "final")


def _prompt_len(out: Path, config: dict) -> int:
    """Tokens the rollouts' prompts are left-padded to: the longest prompt, cut at max_prompt_len."""
    from fastrlhf.train.data import BUILTIN, load_table
    from fastrlhf.train.task import build_char_tokenizer, synthetic_prompt_rows

    model = policy_dir(out, config)
    if Path(model).is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
    else:
        tokenizer = build_char_tokenizer()
    data = config.get("data") or "auto"
    if data in ("auto", BUILTIN):  # a run that trained on the built-in task (the trainer refuses "auto" otherwise)
        prompts = [r["prompt"] for r in synthetic_prompt_rows(4096, 0)]
    else:
        prompts = load_table(data, {"prompt": config.get("prompt_key", "prompt")}, where="compare-run data")["prompt"]
    longest = max(len(tokenizer(p, add_special_tokens=True)["input_ids"]) for p in prompts)
    cap = int(config.get("max_prompt_len") or 0)  # 0: auto, the longest prompt (within the model's positions)
    return min(longest, cap) if cap > 0 else longest


def read_run(out: str | Path, argv: list[str] | None = None) -> RunRecord:
    """The PPO stage of a fastrlhf run directory."""
    out = Path(out)
    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"compare-run: {metrics} does not exist (not a fastrlhf run directory?)")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("stage") == "ppo" and any(k.startswith("time/") for k in r)]
    if not rows:
        raise ValueError(f"compare-run: {metrics} has no PPO rows with phase times (time/rollout, ...)")
    config = _ppo_config(out, argv)
    summary = out / "summary.json"
    ppo = json.loads(summary.read_text()).get("ppo", {}) if summary.is_file() else {}
    device = ppo.get("device", "")
    # lengths and the rollout's KV cache as the stage resolved them
    config.update({k: ppo[k] for k in ("max_prompt_len", "max_new_tokens", "rollout_cache") if ppo.get(k)})
    return RunRecord(out=str(out), config=config, device=device or "unknown",
                     prompt_len=_prompt_len(out, config), rows=rows,
                     model_config=_model_config(policy_dir(out, config)),
                     reward_config=_reward_config(out, config), device_name=_device_name(device))


def _model_config(model: str) -> dict:
    path = Path(model)
    if path.is_dir():
        return json.loads((path / "config.json").read_text())
    from fastrlhf.train.models import BUILTIN_MODELS
    from fastrlhf.train.task import build_char_tokenizer

    if model not in BUILTIN_MODELS:
        raise ValueError(f"compare-run: the run's model {model!r} is neither a directory nor a built-in")
    return BUILTIN_MODELS[model](len(build_char_tokenizer())).to_dict()


def _reward_config(out: Path, config: dict) -> dict | None:
    spec = config.get("reward") or str(out / "rm" / "final")
    if Path(spec).is_dir():
        return json.loads((Path(spec) / "config.json").read_text())
    if ":" in spec:
        return None
    raise ValueError(f"compare-run: the run's reward {spec!r} is neither a model directory nor module:function")


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(device)
    return ""


# ---------------------------------------------------------------------------------------------
# predicted vs measured

GPU_NAMES = {"V100": "v100-32g", "A6000": "a6000", "A100-SXM4-40GB": "a100-40g", "A100": "a100-80g",
             "A800": "a800-80g", "H100": "h100", "H200": "h200"}


def gpu_of(record: RunRecord, default: str) -> str:
    """The planner's device name for a run: cpu, or the GPU its device name says."""
    if not record.device.startswith("cuda"):
        return "cpu"
    for key, name in GPU_NAMES.items():
        if key in record.device_name:
            return name
    return default


def spec_from_run(record: RunRecord, gpu: str = "a100-80g"):
    """The planner's Spec for the configuration a fastrlhf PPO run ran with."""
    from fastrlhf.estimate.arch import arch_from_config
    from fastrlhf.estimate.plan import Spec

    c = record.config
    dev = gpu_of(record, gpu)
    on_cuda = dev != "cpu"
    dtype = "fp32" if (not on_cuda or c.get("dtype") == "float32") else "bf16"
    reward = "rule" if record.reward_config is None else arch_from_config(record.reward_config, "reward model")
    # generate stops at the longest response, and phases 2, 3 and 5 run over prompt + its columns: the logged
    # width where the record has it, else max_new_tokens (the widest it can be)
    width = record.mean_response_width()
    gen_len = int(c["max_new_tokens"]) if width is None else max(1, min(int(c["max_new_tokens"]), round(width)))
    # critic-free advantages (grpo, rloo, ...) train no value head: the planner's grpo stage, G samples per prompt
    critic_free = c.get("advantage", "gae") != "gae"
    generations = int(c.get("num_generations") or 1) if critic_free else 1
    # the sampler the run used: its decode engine with --rollout_engine graph (auto: on CUDA), else hf generate
    engine = c.get("rollout_engine") or "hf"
    gen_engine = "graph" if engine == "graph" or (engine == "auto" and on_cuda) else "hf"
    return Spec(model=arch_from_config(record.model_config, record.config.get("model") or "policy"),
                stage="grpo" if critic_free else "ppo", gpus=1, engine="fsdp2", zero=0, dtype=dtype,
                lora_rank=int(c["lora_rank"]), gradient_checkpointing=bool(c.get("gradient_checkpointing")),
                logits="linear", micro_batch=int(c["micro_batch_size"]), seq_len=record.prompt_len, gen_len=gen_len,
                mean_gen_len=max(1, min(gen_len, round(record.mean_response_length()))),
                rollout_batch=int(c["rollout_batch_size"]) // generations, num_generations=generations,
                mini_batch=int(c["mini_batch_size"]), ppo_epochs=int(c["ppo_epochs"]), critic="shared",
                reward=reward, gen_engine=gen_engine, rollout_slots=int(c.get("rollout_slots") or 0) if
                gen_engine == "graph" else 0, rollout_cache=c.get("rollout_cache") or "dynamic",
                old_logprobs=c.get("old_logprobs") or "recompute", shared_prompt=c.get("shared_prompt") or "off",
                kl_in_loss=bool(c.get("kl_in_loss")) or c.get("kl_coef") == 0, gpu=dev,
                cpu_threads=record.cpu_threads if dev == "cpu" else None)


def compare(record: RunRecord, spec=None, stat: str = "median", key: str = "time") -> dict:
    """Per phase: predicted seconds (and range) and peak bytes beside the measured ones; `ratio` =
    predicted / measured (`key` time: wall, cpu: CPU seconds; `stat` median or min over iterations)."""
    from fastrlhf.estimate.plan import estimate

    spec = spec or spec_from_run(record)
    result = estimate(spec)["stages"][spec.stage]
    medians, mins = record.phase_seconds("median"), record.phase_seconds("min")
    measured_t = record.phase_seconds(stat, key)
    cpu = record.phase_seconds("median", "cpu") if record.has_cpu_time() else {}
    measured_m = record.phase_peak_bytes()
    rows = {}
    for phase in PPO_PHASES:
        p = result["phases"][phase]
        m = measured_t.get(phase)
        rows[phase] = {"predicted_seconds": p["seconds"], "range": p["seconds_range"], "measured_seconds": m,
                       "median_seconds": medians.get(phase), "min_seconds": mins.get(phase),
                       "cpu_median_seconds": cpu.get(phase),
                       "ratio": p["seconds"] / m if m else None,
                       "predicted_peak_bytes": p["memory_per_gpu_bytes"]["peak"],
                       "measured_peak_bytes": measured_m.get(phase)}
    total_p = sum(r["predicted_seconds"] for r in rows.values())
    total_m = sum(r["measured_seconds"] or 0.0 for r in rows.values())
    iteration = {"predicted_seconds": total_p, "measured_seconds": total_m,
                 "ratio": total_p / total_m if total_m else None}
    note = ("CUDA max_memory_allocated per phase" if spec.gpu != "cpu" else
            "CPU: measured = process peak RSS (includes the Python/torch runtime), predicted = tensors")
    return {"spec_gpu": spec.gpu, "stat": stat, "key": key, "phases": rows, "iteration": iteration, "memory_note": note}


def compare_main(args, explicit: set[str], given) -> int:
    """`fastrlhf estimate --compare-run OUT [--KEY VALUE ...]`: `given` is the Spec of the command line, whose
    `explicit` keys override what is read from the run."""
    import dataclasses
    import shlex

    record = read_run(args.compare_run, argv=shlex.split(args.run_args) if args.run_args else None)
    spec = spec_from_run(record, given.gpu)
    spec = dataclasses.replace(spec, **{n: getattr(given, n) for n in explicit})
    out = compare(record, spec)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{record.out}: {len(record.rows)} PPO iterations on {record.device} {record.device_name}".rstrip()
          + f" (medians{' after the first' if len(record.rows) >= 3 else ''}); planner device {spec.gpu}")
    print(f"{'phase':<11} {'predicted s':>12} {'range':>19} {'median s':>9} {'min s':>9} {'cpu s':>9} {'pred/med':>9} "
          f"{'pred peak GB':>13} {'meas peak GB':>13}")
    nan = float("nan")
    for phase, r in out["phases"].items():
        lo, hi = r["range"]
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        mp = r["measured_peak_bytes"]
        med = r["median_seconds"] if r["median_seconds"] is not None else nan
        low = r["min_seconds"] if r["min_seconds"] is not None else nan
        cpu = r["cpu_median_seconds"] if r["cpu_median_seconds"] is not None else nan
        print(f"{phase:<11} {r['predicted_seconds']:>12.4f} {lo:>9.4f}-{hi:<9.4f} {med:>9.4f} {low:>9.4f} {cpu:>9.4f} "
              f"{ratio:>9} "
              f"{r['predicted_peak_bytes'] / 1e9:>13.3f} {mp / 1e9 if mp else nan:>13.3f}")
    it = out["iteration"]
    print(f"{'iteration':<11} {it['predicted_seconds']:>12.4f} {'':>19} {it['measured_seconds']:>9.4f} {'':>19} "
          f"{it['ratio']:>9.2f}")
    print(out["memory_note"])
    return 0
