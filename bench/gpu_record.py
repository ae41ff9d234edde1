"""The records `bench/gpu_run.sh` writes besides the bench JSON, and its closing summary.

    python bench/gpu_record.py ppo RUN_DIR OUT.json --command "fastrlhf ppo ..."
    python bench/gpu_record.py rollout OUT.json ENGINE.json... --command "bash bench/gpu_run.sh ..."
    python bench/gpu_record.py status STEPS.tsv ENV.json OUT.json [--dry-run]
    python bench/gpu_record.py summary OUT_DIR

`ppo`: the PPO timing run's summary (time, peak memory per phase) and its per-step rows from
metrics.jsonl, with the steady-state mean per phase over the steps after the first (the first
compiles kernels and warms the allocator). Written even when the run was stopped before its
end: then `summary` is null and the rows say how far it got.
`rollout`: the per-engine records of bench/rollout_bench.py (graph, static, dynamic) in one, with
issue 26's goals as ratios of this run; an engine whose process left no record is named with
its missing file.
`status`: every step of gpu_run.sh (rc, seconds, limit, timed out) with the environment and
source revision. `summary`: a short text of both, the bench targets, bench/decode_attention.py's goals
(OUT/decode_attention.json) and bench/e2e.py's figures (OUT/e2e.json), printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PHASES = ("rollout", "reward", "logprobs", "advantages", "update")
ROLLOUT_KEYS = ("engine", "decode_ms_per_step", "floor_ms_per_step", "decode_over_floor", "rollout_s", "step_s",
                "rest_of_step_s", "compile_s", "capture_s", "first_rollout_s", "logp_gap", "launches")
BASELINE_STEP_S = 3.73  # the PPO step of bench/results/2026-11-23-h100-ppo-static.json (issue 26's "today")


def revision() -> dict | None:
    """commit and kernels tree hashes (fastrlhf.bench.environment), None if it cannot be imported."""
    try:
        from fastrlhf.bench.environment import revision as rev
    except ImportError:
        return None
    return rev()


def ppo_record(run_dir: Path, command: str) -> dict:
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.jsonl"
    summary = json.loads(summary_path.read_text()).get("ppo") if summary_path.is_file() else None
    rows = []
    if metrics_path.is_file():
        rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("stage") == "ppo"]
    keep = ("step", "tokens_per_s", "response_length", "response_width", "reward", "kl")
    steps = [{k: r[k] for k in keep if k in r}
             | {f"{p}_s": r.get(f"time/{p}") for p in PHASES}
             | {f"{p}_peak_bytes": r.get(f"memory/{p}") for p in PHASES} for r in rows]
    steady = steps[1:] or steps
    mean = {f"{p}_s": sum(s[f"{p}_s"] or 0.0 for s in steady) / len(steady) for p in PHASES} if steady else {}
    if steady:
        mean["tokens_per_s"] = sum(s.get("tokens_per_s", 0.0) for s in steady) / len(steady)
    return {"command": command, **(revision() or {}), "finished": summary is not None, "summary": summary,
            "steps": steps, "steady_state_mean": mean, "steady_state_steps": [s["step"] for s in steady]}


def rollout_record(paths: list[Path], command: str) -> dict:
    """One record of the engines' files: each engine's figures (ROLLOUT_KEYS; its full record under
    `detail`), then the goals of issue 26, each a ratio of this run (None where an engine is missing)."""
    engines, missing, common = [], [], None
    for path in paths:
        if not path.is_file():
            missing.append(str(path.name))
            continue
        r = json.loads(path.read_text())
        common = common or {k: r[k] for k in ("environment", "sizes", "prompt_len", "longest_prompt", "probe",
                                              "floor_bytes_per_step")}
        engines.append({k: r.get(k) for k in ROLLOUT_KEYS} | {"detail": r})
    by = {e["engine"]: e for e in engines}
    graph, static = by.get("graph"), by.get("static")

    on_gpu = bool(common) and common["sizes"]["device"] == "cuda"  # a dry run's ratios are no test of the goals

    def goal(name, goal_text, value, met):
        return {"name": name, "goal": goal_text, "value": value,
                "met": None if value is None or not on_gpu else met(value)}

    over = graph["decode_over_floor"] if graph else None
    speedup = static["rollout_s"] / graph["rollout_s"] if graph and static else None
    step_ratio = graph["step_s"] / static["step_s"] if graph and static else None
    goals = [goal("graph decode step / floor", "<= 3 (stretch 2)", over, lambda v: v <= 3),
             goal("static rollout / graph rollout", ">= 6", speedup, lambda v: v >= 6),
             goal("graph PPO step / static PPO step (same run)", "<= 0.5", step_ratio, lambda v: v <= 0.5),
             goal(f"graph PPO step / {BASELINE_STEP_S} s (2026-11-23 static record)", "<= 0.5",
                  graph["step_s"] / BASELINE_STEP_S if graph else None, lambda v: v <= 0.5)]
    return {"experiment": "rollout", "command": command, **(revision() or {}), **(common or {}),
            "engines": engines, "missing": missing, "goals": goals}


def status_record(steps_tsv: Path, env_json: Path, dry_run: bool) -> dict:
    steps = []
    for line in steps_tsv.read_text().splitlines():
        name, rc, seconds, limit = line.split("\t")
        rc_i = int(rc) if rc.lstrip("-").isdigit() else None
        steps.append({"name": name, "rc": rc_i, "seconds": int(seconds), "limit_s": int(limit),
                      "timed_out": rc_i in (124, 137), "skipped": rc == "skipped"})
    env = json.loads(env_json.read_text()) if env_json.is_file() and env_json.stat().st_size else None
    return {"dry_run": dry_run, "ok": bool(steps) and all(s["rc"] == 0 for s in steps),
            "total_seconds": sum(s["seconds"] for s in steps), "steps": steps,
            "commit": (env or {}).get("commit"), "kernels_tree": (env or {}).get("kernels_tree"),
            "kernels_tree_files": (env or {}).get("kernels_tree_files"), "environment": env}


def summary_text(out: Path) -> str:
    lines = []
    status = json.loads((out / "status.json").read_text()) if (out / "status.json").is_file() else None
    if status:
        rev = status["kernels_tree"] or status["kernels_tree_files"]
        lines.append(f"gpu_run {'(dry run) ' if status['dry_run'] else ''}ok={status['ok']} "
                     f"total {status['total_seconds']} s; commit {status['commit']}, kernels tree {rev}")
        for s in status["steps"]:
            state = "skipped" if s["skipped"] else ("TIMED OUT" if s["timed_out"] else f"rc {s['rc']}")
            lines.append(f"  {s['name']:<8} {state:<10} {s['seconds']:>4} s of {s['limit_s']} s")
    bench_path = out / "bench.json"
    if bench_path.is_file():
        record = json.loads(bench_path.read_text())
        p = record["probes"]
        lines.append(f"bench ({record['device']}, finished={record['finished']}): read probe {p['read_gbps']:.0f} "
                     f"GB/s, copy probe {p['copy_gbps']:.0f} GB/s, nominal {p.get('nominal_gbps') or '-'}")
        for t in record["targets"]:
            value = "-" if t["value"] is None else f"{t['value']:.3g}"
            met = {True: "MET", False: "missed", None: "-"}[t["met"]]
            lines.append(f"  {t['name']:<70} {t['goal']:>8} {value:>8}  {met}")
        lines += [f"  error: {e['provider']} {e['op']} {e['pass']}: {e['error']}" for e in record["errors"]]
    ppo_path = out / "ppo.json"
    if ppo_path.is_file():
        ppo = json.loads(ppo_path.read_text())
        mean = ppo["steady_state_mean"]
        if mean:
            phases = ", ".join(f"{p} {mean[f'{p}_s']:.2f}" for p in PHASES)
            lines.append(f"ppo (finished={ppo['finished']}, steps {ppo['steady_state_steps']}): seconds per step: "
                         f"{phases}; {mean['tokens_per_s']:.0f} tokens/s")
        else:
            lines.append("ppo: no step logged")
    rollout_path = out / "rollout.json"
    if rollout_path.is_file():
        rollout = json.loads(rollout_path.read_text())
        for e in rollout["engines"]:
            lines.append(f"rollout {e['engine']:<8} {e['rollout_s']:.3f} s, step {e['step_s']:.3f} s, decode "
                         f"{e['decode_ms_per_step']:.3f} ms/step ({e['decode_over_floor']:.1f}x the floor "
                         f"{e['floor_ms_per_step']:.3f} ms), compile {e['compile_s'] or 0:.1f} s")
        lines += [f"  missing: {m}" for m in rollout["missing"]]
        for g in rollout["goals"]:
            value = "-" if g["value"] is None else f"{g['value']:.3g}"
            lines.append(f"  {g['name']:<70} {g['goal']:>16} {value:>8}  "
                         f"{ {True: 'MET', False: 'missed', None: '-'}[g['met']]}")
    decode_path = out / "decode_attention.json"
    if decode_path.is_file():
        lines += decode_attention_summary(json.loads(decode_path.read_text()))
    e2e_path = out / "e2e.json"
    if e2e_path.is_file():
        lines += e2e_summary(json.loads(e2e_path.read_text()))
    return "\n".join(lines)


def decode_attention_summary(record: dict) -> list[str]:
    """bench/decode_attention.py's record: the goals (ratios of its run) and fastrlhf's errors."""
    p = record["probes"]
    lines = [f"decode_attention ({record['device']}, finished={record['finished']}): copy probe "
             f"{p['copy_gbps']:.0f} GB/s, {len(record['cases'])} cases"]
    for g in record["goals"]:
        value = "-" if g["value"] is None else f"{g['value']:.3g}"
        met = {True: "MET", False: "missed", None: "-"}[g["met"]]
        lines.append(f"  {g['name']:<95} {g['goal']:>7} {value:>8}  {met}")
    return lines + [f"  error: {e['provider']} {e['shape']}: {e['error']}" for e in record["errors"]]


def e2e_summary(record: dict) -> list[str]:
    """bench/e2e.py's record: seconds per iteration and peak memory per trainer, and the ratios."""
    lines = [f"e2e ({record['device']}, finished={record['finished']}):"]
    for section in record["timing"]:
        where = f"{section['algo']} {section['model']['name']}"
        for name, t in section["trainers"].items():
            if "seconds_per_iteration" not in t:
                lines.append(f"  {where} {name:<15} failed or not run")
                continue
            peak, first = t.get("peak_memory_bytes"), t.get("first_iteration_s")
            lines.append(f"  {where} {name:<15} {t['seconds_per_iteration']:.3f} s/iteration (the first "
                         f"{'-' if first is None else f'{first:.1f}'} s), peak "
                         f"{'-' if peak is None else round(peak / 2**20)} MiB, start-up {t['startup_s']:.0f} s")
        lines += [f"  {where} {name}: {r}" for name, r in section.get("ratios", {}).items()]
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("ppo")
    a.add_argument("run_dir", type=Path)
    a.add_argument("out", type=Path)
    a.add_argument("--command", required=True)
    s = sub.add_parser("status")
    s.add_argument("steps", type=Path)
    s.add_argument("env", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--dry-run", action="store_true")
    r = sub.add_parser("rollout")
    r.add_argument("out", type=Path)
    r.add_argument("records", type=Path, nargs="+")
    r.add_argument("--command", required=True)
    m = sub.add_parser("summary")
    m.add_argument("out_dir", type=Path)
    args = p.parse_args(argv)
    if args.what == "ppo":
        args.out.write_text(json.dumps(ppo_record(args.run_dir, args.command), indent=1) + "\n")
    elif args.what == "rollout":
        args.out.write_text(json.dumps(rollout_record(args.records, args.command), indent=1) + "\n")
    elif args.what == "status":
        args.out.write_text(json.dumps(status_record(args.steps, args.env, args.dry_run), indent=1) + "\n")
    else:
        print(summary_text(args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
