"""Run a `fastrlhf ppo|pipeline` command and record its PPO phases as JSON (a planner calibration point).

    python -m fastrlhf.estimate.record --json bench/results/cpu_ppo_tiny.json -- \
        fastrlhf pipeline --out runs/cpu_tiny

The record holds the exact command, the machine (CPU model, cores, load average before and
after, torch version, git commit), the PPO stage's configuration, the prompt length the
rollouts were padded to, and per logged step the time and peak memory of each phase
(`time/<phase>`, `memory/<phase>` rows of OUT/metrics.jsonl). `fastrlhf estimate
--compare-run OUT` reads the same rows; `fastrlhf.estimate.calibrate` reads these records.

`--from-steps RUN.json` writes the same record from a PPO run kept in the step format of
bench/results/*-ppo-*.json (`steps`: per step `<phase>_s` and `<phase>_peak_bytes`; `steady_state_steps`):
the steady-state steps become the record's rows and the others (compilation, allocator warm-up) its
`warmup_rows`; the source file is named in the record (`source`). The GPU records of
fastrlhf/estimate/data/recorded/ were made this way.

`--cpu-time` also records the process's CPU seconds of each phase (`cpu/<phase>`): the command runs
in a Python that wraps fastrlhf.train.metrics.PhaseTimer.phase to read time.process_time() around each
phase (the trainer's files are not changed). On a machine shared with other jobs a one-thread
run's wall time grows with their load (measured here: up to 2.3x); its CPU time is what the phase
costs on a core of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from fastrlhf.estimate.compare import read_run


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# run `fastrlhf` with CPU seconds per phase added to the metrics rows (argv: the fastrlhf arguments)
CPU_TIME_BOOT = """
import contextlib, sys, time
import fastrlhf.train.metrics as metrics
_phase, _stats = metrics.PhaseTimer.phase, metrics.PhaseTimer.step_stats

@contextlib.contextmanager
def phase(self, name):
    start = time.process_time()
    with _phase(self, name):
        yield
    cpu = self.__dict__.setdefault("_cpu_seconds", {})
    cpu[name] = cpu.get(name, 0.0) + time.process_time() - start

def step_stats(self):
    stats = _stats(self)
    stats.update({f"cpu/{k}": v for k, v in self.__dict__.pop("_cpu_seconds", {}).items()})
    return stats

metrics.PhaseTimer.phase, metrics.PhaseTimer.step_stats = phase, step_stats
from fastrlhf.cli import main
sys.exit(main(sys.argv[1:]))
"""


def from_steps(data: dict, *, source: str, device_name: str, rollout_cache: str | None = None) -> dict:
    """A record (the schema of `main`'s) from a PPO run in the step format of bench/results/*-ppo-*.json.
    `rollout_cache`: the KV cache the run's rollout used, when its command does not say (a run made
    before `fastrlhf ppo --rollout_cache` existed used HF's dynamic cache)."""
    from fastrlhf.estimate.compare import PPO_PHASES, RunRecord, _model_config, _prompt_len, _reward_config
    from fastrlhf.train.config import PPOConfig, parse_args, to_dict

    command = shlex.split(data["command"])
    if command[:2] != ["fastrlhf", "ppo"]:
        raise ValueError(f"from-steps: expected a `fastrlhf ppo ...` command, got {data['command']!r}")
    config = to_dict(parse_args(PPOConfig, command[2:]))
    if "--rollout_cache" not in command:
        if rollout_cache is None:
            raise ValueError("from-steps: the command does not name --rollout_cache; pass the cache the run used")
        config["rollout_cache"] = rollout_cache
    steady = set(data["steady_state_steps"])

    def row(step: dict) -> dict:
        out = {"step": step["step"], "response_length": step["response_length"], "tokens_per_s": step["tokens_per_s"]}
        if "response_width" in step:  # logged since the trainer's response_width (older step files lack it)
            out["response_width"] = step["response_width"]
        for ph in PPO_PHASES:
            out[f"time/{ph}"] = step[f"{ph}_s"]
            out[f"memory/{ph}"] = step[f"{ph}_peak_bytes"]
        return out

    out = Path(config["out"])
    run = RunRecord(out=str(out), config=config, device="cuda" if "cuda" in data["command"] else "cpu",
                    prompt_len=_prompt_len(out, config), rows=[row(s) for s in data["steps"] if s["step"] in steady],
                    model_config=_model_config(config["model"]), reward_config=_reward_config(out, config),
                    device_name=device_name)
    return {"command": data["command"], "source": source,
            "note": "steady-state steps of the source as rows; the others (compilation, warm-up) as warmup_rows",
            "git_commit": data.get("commit"), "dirty": data.get("dirty"), **run.to_json(),
            "warmup_rows": [row(s) for s in data["steps"] if s["step"] not in steady]}


def _out_dir(command: list[str]) -> Path:
    for i, token in enumerate(command):
        if token == "--out" and i + 1 < len(command):
            return Path(command[i + 1])
        if token.startswith("--out="):
            return Path(token.split("=", 1)[1])
    raise ValueError("command: pass --out DIR so the run's metrics can be found")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastrlhf.estimate.record", description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="where to write the record")
    p.add_argument("--note", default="", help="free text stored in the record")
    p.add_argument("--cpu-time", action="store_true", help="also record CPU seconds per phase (cpu/<phase>)")
    p.add_argument("--from-steps", metavar="RUN.json",
                   help="write the record from a PPO run in bench/results/*-ppo-*.json's step format instead")
    p.add_argument("--device-name", default="", help="--from-steps: the GPU's name (torch.cuda.get_device_name)")
    p.add_argument("--rollout-cache", choices=("dynamic", "static"),
                   help="--from-steps: the rollout's KV cache, when the run's command does not name it")
    p.add_argument("--keep-faster", action="store_true",
                   help="where --json already holds a record of the same command on this CPU, keep the faster of "
                        "the two (their medians' sum, CPU seconds with --cpu-time) and list each round's medians "
                        "under `rounds`: a shared machine's speed drifts, and it only ever makes a run slower")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- fastrlhf ppo|pipeline ... --out DIR")
    args = p.parse_args(argv)
    if args.from_steps:
        record = from_steps(json.loads(Path(args.from_steps).read_text()), source=args.from_steps,
                            device_name=args.device_name, rollout_cache=args.rollout_cache)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if len(command) < 2 or command[1] not in ("ppo", "pipeline"):
        raise SystemExit("record: expected `-- fastrlhf ppo|pipeline ... --out DIR`")
    out = _out_dir(command)
    import torch

    load_before = os.getloadavg()
    start = time.time()
    argv = [sys.executable, "-c", CPU_TIME_BOOT, *command[1:]] if args.cpu_time else command
    subprocess.run(argv, check=True)
    wall = time.time() - start
    load_after = os.getloadavg()
    run = read_run(out, argv=command[2:] if command[1] == "ppo" else None)
    if os.environ.get("OMP_NUM_THREADS"):
        run.cpu_threads = int(os.environ["OMP_NUM_THREADS"])
    record = {
        "command": shlex.join(command),
        "note": args.note,
        "cpu_time": "cpu/<phase>: time.process_time() around fastrlhf.train.metrics.PhaseTimer.phase "
                    "(record --cpu-time)"
        if args.cpu_time else None,
        "wall_seconds": round(wall, 2),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "load_avg_before": load_before,
                    "load_avg_after": load_after, "torch": torch.__version__, "python": platform.python_version(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "git_commit": _git_commit(),
        "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
        **run.to_json(),
    }
    if args.keep_faster:
        record = faster(record, Path(args.json))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _round(record: dict) -> dict:
    from fastrlhf.estimate.compare import RunRecord

    run = RunRecord.from_json(record)
    key = "cpu" if run.has_cpu_time() else "time"
    seconds = run.phase_seconds("median", key)
    return {"recorded": record.get("recorded"), "key": key, "median_phase_seconds": seconds,
            "total": sum(seconds.values()), "load_avg_before": record["machine"]["load_avg_before"]}


def faster(record: dict, path: Path) -> dict:
    """`record` or the one at `path` (the same command on the same CPU), whichever took less in total; the kept
    one lists every round's medians under `rounds`."""
    if not path.exists():
        return dict(record, rounds=[_round(record)])
    old = json.loads(path.read_text())
    if old.get("command") != record["command"] or old.get("machine", {}).get("cpu") != record["machine"]["cpu"]:
        raise SystemExit(f"record --keep-faster: {path} holds another command or CPU ({old.get('command')!r} on "
                         f"{old.get('machine', {}).get('cpu')!r}); remove it or write elsewhere")
    rounds = [*old.get("rounds", [_round(old)]), _round(record)]
    kept = record if rounds[-1]["total"] < min(r["total"] for r in rounds[:-1]) else old
    return dict(kept, rounds=rounds)


if __name__ == "__main__":
    raise SystemExit(main())
