"""Calibration sources, the fit of the efficiency factors, leave-one-source-out cross-validation.

    python -m fastrlhf.estimate.calibrate                # every source: predicted vs measured, in and out of sample
    python -m fastrlhf.estimate.calibrate --write        # refit, cross-validate, write data/efficiency.json
    python -m fastrlhf.estimate.calibrate --markdown     # the README / docs tables (--heldout: OpenRLHF's too)
    python -m fastrlhf.estimate.calibrate --probe-cpu    # measure this CPU into data/devices.json

Sources (each left out in turn; a source is everything one publication or one recording session measured):
- gpu: DeepSpeed-Chat's step-3 log (data/points_deepspeed_chat.json), its blog's Figure 6 (training TFLOPs), this
  trainer's H100 runs (data/recorded/h100_*.json), and the published vLLM serving measurements
  (data/serving_points.json, one source per publication);
- cpu: each of this trainer's recorded CPU runs (bench/results/cpu_*.json).
Checks that fit nothing (their prediction is out of sample by construction): DeepSpeed-Chat's blog Figure 5
(generation share), its Llama-2 blog's minimum GPU counts, the step-3 log's peak memory, the serving points taken
at a request rate. Held out: data/heldout_openrlhf.json (OpenRLHF's benchmark), predicted, never fitted.

The fit: the factors of timing.py (mm, bw, op, gap, net, adam) in log space minimise
    sum over sources of the mean over its rows of (log(predicted / measured) / sigma_row)^2
    + sum over factors of ((log f - log prior) / sigma_prior)^2,   sigma_prior: the plausible range is +-2 sigma,
by torch.optim.LBFGS on the rows' physical work (a factor no row sees stays at its prior). Leave-one-source-out:
refit without a source, predict it; the spread of those ratios per phase group is the range printed beside each
time (timing.time_range), and each source must come out within its stated band.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import fastrlhf.estimate.timing as timing
import fastrlhf.estimate.work as W
from fastrlhf.estimate.arch import resolve_model
from fastrlhf.estimate.compare import RunRecord, compare, spec_from_run
from fastrlhf.estimate.hardware import DATA, device
from fastrlhf.estimate.plan import Spec, estimate, phase_works, run_stage
from fastrlhf.estimate.serve import Engine
from fastrlhf.estimate.spec import check, resolved

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
RUNS = (RESULTS, DATA / "recorded")  # where recorded runs are kept
RUN_STAT = "median"  # a recorded phase: the median over the iterations after the first
MINOR_SHARE = 0.005  # phases under 0.5% of the iteration (a rule reward: 0.1 ms) are shown, not judged
TIME_BAND = 1.5  # a time predicted out of sample within a factor 1.5 of its measurement (stated per source)
SIGMA = {"run": 0.05, "log": 0.05, "figure": 0.15, "serving": 0.1}  # a measurement's relative uncertainty
GROUPS = ("rollout", "forward", "train", "serve", "host")


@dataclass
class Row:
    """One measured quantity: the work that predicts it (scaled parts), its measurement in seconds."""

    source: str
    label: str
    group: str
    kind: str  # gpu or cpu
    parts: list[tuple[timing.Work, float]]
    measured: float
    sigma: float
    fitted: bool = True  # False: a check predicted from the fit, never fitted (serving at a request rate)
    predict: object = None  # for a row that is not a sum of work: predict(factors) -> seconds

    def predicted(self, f: dict | None = None):
        if self.predict is not None:
            return self.predict(f)
        return sum(timing.seconds(w, f) * scale for w, scale in self.parts)


def band_of(source: str) -> float:
    """A source's band: a serving publication's own (data/serving_points.json), else TIME_BAND."""
    bands = {f"serve:{s['id']}": s["band"] for s in serving_sources()}
    return bands.get(source, TIME_BAND)


# ---------------------------------------------------------------------------------------------
# The sources


def published_points() -> list[dict]:
    points = json.loads((DATA / "points_deepspeed_chat.json").read_text())["points"]
    by_id = {p["id"]: p for p in points}
    for p in points:
        if "setup_from" in p:
            p["setup"] = by_id[p["setup_from"]]["setup"]
    return points


def heldout_points() -> list[dict]:
    return json.loads((DATA / "heldout_openrlhf.json").read_text())["points"]


def serving_sources() -> list[dict]:
    return json.loads((DATA / "serving_points.json").read_text())["sources"]


def run_records(directory: Path | tuple[Path, ...] = RUNS) -> list[tuple[str, RunRecord, dict]]:
    """(name, record, raw json) of every recorded fastrlhf run under bench/results/ and data/recorded/."""
    out = []
    directories = (directory,) if isinstance(directory, Path) else directory
    for path in sorted(p for d in directories for p in d.glob("*.json")):
        data = json.loads(path.read_text())
        if "rows" in data and "model_config" in data:
            out.append((path.stem, RunRecord.from_json(data), data))
    return out


def run_key(rec: RunRecord) -> str:
    return "cpu" if rec.has_cpu_time() and rec.device == "cpu" else "time"


def fits(spec: Spec) -> bool:
    spec = resolved(spec)
    check(spec)
    return run_stage(spec, spec.stage).fits


def spec_of(setup: dict, **changes) -> Spec:
    """A point's Spec. `"batch": "max_fit"`: the largest power-of-two batch per GPU (generation and training alike,
    DeepSpeed-Chat's defaults of --per_device_generation_batch_size and --per_device_training_batch_size are equal)
    the planner judges to fit, at most 1024 sequences over all GPUs - DeepSpeed-Chat's benchmark rule
    (BenckmarkSetting.md: 'we always use the largest training batch size that does not result in an out-of-memory
    error', a global batch of at most 1024)."""
    setup = dict(setup, **changes)
    setup.setdefault("stage", "ppo")
    rule = setup.pop("batch", None)
    if rule is None:
        return Spec(**setup)
    if rule != "max_fit":
        raise ValueError(f"batch: expected max_fit, got {rule!r}")
    gpus = setup.get("gpus", 1)
    best, b = None, 1
    while b * gpus <= 1024:
        spec = Spec(**setup, rollout_batch=b * gpus, micro_rollout_batch=b, micro_batch=b)
        if not fits(spec):
            break
        best, b = spec, 2 * b
    if best is None:
        raise ValueError(f"batch: not even one sequence per GPU fits ({setup})")
    return best


def _dschat_log_rows() -> list[Row]:
    p = next(p for p in published_points() if p["id"] == "dschat-log-opt1.3b-v100x16")
    works, pub = phase_works(spec_of(p["setup"])), p["published"]
    training = [(works[k], 1.0) for k in ("reward", "logprobs", "advantages", "update:actor")]
    source, sigma = "dschat-log", SIGMA["log"]
    return [Row(source, "generate_s", "rollout", "gpu", [(works["rollout"], 1.0)], pub["generate_s"], sigma),
            Row(source, "training_s", "train", "gpu", training, pub["training_s"], sigma),
            Row(source, "others_s", "train", "gpu", [(works["update:critic"], 1.0)], pub["others_s"], sigma)]


def deepspeed_chat_flops(arch, factor: float, tokens: float, seq: int) -> float:
    """DeepSpeed-Chat's FLOP accounting (dschat/utils/perf.py calculate_flops, Megatron's formula):
    24 f B s L h^2 (1 + s / 6h + V / 16 L h), here per `tokens` = B s."""
    h, n_layers, vocab = arch.hidden, arch.layers, arch.vocab
    return 24 * factor * tokens * n_layers * h * h * (1 + seq / (6 * h) + vocab / (16 * n_layers * h))


FIG6_MICRO_BATCH = 4  # DeepSpeed-Chat's release scripts: --per_device_train_batch_size 4 (run_1.3b.sh at e468799f)


def _fig6_rows() -> list[Row]:
    """Figure 6's training TFLOPs as rows: per GPU and sequence, the published training time is (actor + critic
    FLOPs in DeepSpeed-Chat's accounting) / TFLOPs; the planner's is the actor's and the critic's (OPT-350m) forward
    + backward of a micro-batch, per sequence."""
    p = next(p for p in published_points() if p["id"] == "dschat-blog-fig6-train-tflops")
    rows = []
    for row in p["published"]["rows"]:
        if row["model"] not in p["setups"]:
            continue
        spec = resolved(spec_of(p["setups"][row["model"]]))
        actor, critic = resolve_model(row["model"]), resolve_model("opt-350m")
        seq, lora, dev = spec.seq_len + spec.gen_len, spec.lora_rank > 0, device(spec.gpu)
        f_actor = (4 if spec.gradient_checkpointing else 3) - ((1 - 2 * spec.lora_rank / actor.hidden) if lora else 0)
        published = (deepspeed_chat_flops(actor, f_actor, seq, seq) + deepspeed_chat_flops(critic, 3, seq, seq)) \
            / (row["training_tflops"] * 1e12)
        parts = []
        for arch, trained_lora in ((actor, lora), (critic, False)):
            adapters = len(arch.linear_shapes()) if trained_lora else 0
            w = W.train_work(W.new_work(dev, arch), arch, FIG6_MICRO_BATCH, seq, micro=FIG6_MICRO_BATCH,
                             db=W.db_of(spec.dtype), lm_head=arch is actor, lora=trained_lora, adapters=adapters,
                             checkpointing=spec.gradient_checkpointing and arch is actor)
            parts.append((w, 1 / FIG6_MICRO_BATCH))
        rows.append(Row("dschat-fig6", row["model"], "train", "gpu", parts, published, SIGMA["figure"]))
    return rows


def record_rows(kind: str, directory: Path | tuple[Path, ...] = RUNS) -> list[Row]:
    """The judged phases (>= 0.5% of the iteration) of every recorded run of a device class: a CPU run is a source
    of its own (CPU seconds), the GPU runs one source (this trainer's H100 session, wall seconds)."""
    rows = []
    for name, rec, _ in run_records(directory):
        spec = spec_from_run(rec)
        if ("cpu" if spec.gpu == "cpu" else "gpu") != kind:
            continue
        measured = {ph: t for ph, t in rec.phase_seconds(RUN_STAT, run_key(rec)).items() if t > 0}
        total = sum(measured.values())
        works = phase_works(spec)
        source = name if kind == "cpu" else "fastrlhf-gpu-runs"
        for phase, t in measured.items():
            if t < MINOR_SHARE * total:
                continue
            group = {"rollout": "rollout", "update": "train", "advantages": "host"}.get(phase, "forward")
            rows.append(Row(source, f"{name}:{phase}", group, kind, [(works[phase], 1.0)], t, SIGMA["run"]))
    return rows


def _serving_engine(p: dict) -> Engine:
    return Engine(resolve_model(p["model"]), device(p["gpu"]), p["tp"], p["weights"], p["prompt"], p["output"])


def serving_rows() -> list[Row]:
    """Each published serving point as a row: TPOT at a fixed concurrency (step + prefill share), an offline
    throughput as the TPOT of the most requests that fit (measured: concurrency / tokens per s), and TPOT at a request
    rate (a check: Little's law in the loop)."""
    rows = []
    for source in serving_sources():
        sid = f"serve:{source['id']}"
        for p in source["points"]:
            e = _serving_engine(p)
            if p["quantity"] == "tpot_at_rate_s":
                rows.append(Row(sid, p["id"], "serve", "gpu", [], p["value"], SIGMA["serving"], fitted=False,
                                predict=_rate_predictor(e, p["rate"])))
                continue
            c = p["concurrency"] if p["quantity"] == "tpot_s" else e.max_concurrency()
            measured = p["value"] if p["quantity"] == "tpot_s" else c / p["value"]
            parts = [(e.step_work(c), 1.0), (e.prefill_work(), c / e.output)]
            rows.append(Row(sid, p["id"], "serve", "gpu", parts, measured, SIGMA["serving"]))
    return rows


def _rate_predictor(e: Engine, rate: float):
    def predict(f):
        return e.latency(e.at_rate(rate, f), f)[1]
    return predict


def calibration_rows(kind: str, directory: Path | tuple[Path, ...] = RUNS) -> list[Row]:
    rows = record_rows(kind, directory)
    if kind == "gpu":
        rows = _dschat_log_rows() + _fig6_rows() + rows + serving_rows()
    return rows


# ---------------------------------------------------------------------------------------------
# The fit


def fit(kind: str, rows: list[Row]) -> dict[str, float]:
    """Factors minimising the sources' mean squared log-errors plus each factor's log-space prior (LBFGS)."""
    import torch

    prior = timing.priors(kind)
    names = list(timing.FACTORS)
    center = torch.tensor([math.log(prior[k].value) for k in names], dtype=torch.float64)
    sigma = torch.tensor([prior[k].sigma for k in names], dtype=torch.float64)
    x = center.clone().requires_grad_(True)
    fitted = [r for r in rows if r.fitted]
    per_source = {}
    for r in fitted:
        per_source[r.source] = per_source.get(r.source, 0) + 1
    opt = torch.optim.LBFGS([x], lr=1.0, max_iter=400, tolerance_grad=1e-10, tolerance_change=1e-13,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        f = dict(zip(names, torch.exp(x)))
        loss = (((x - center) / sigma) ** 2).sum()
        for r in fitted:
            err = torch.log(torch.as_tensor(r.predicted(f)) / r.measured) / r.sigma
            loss = loss + err ** 2 / per_source[r.source]
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    return {k: float(v) for k, v in zip(names, torch.exp(x.detach()))}


def ratios(rows: list[Row], f: dict) -> dict[str, float]:
    return {f"{r.source}|{r.label}": float(r.predicted(f)) / r.measured for r in rows}


def leave_one_source_out(kind: str, rows: list[Row] | None = None) -> dict:
    """Each source predicted by a fit without it: {"factors": {source: fit}, "ratio": {source|label: ratio}}."""
    rows = calibration_rows(kind) if rows is None else rows
    out = {"factors": {}, "ratio": {}}
    for source in sorted({r.source for r in rows}):
        f = fit(kind, [r for r in rows if r.source != source])
        out["factors"][source] = f
        out["ratio"].update(ratios([r for r in rows if r.source == source], f))
    return out


def cv_spread(rows: list[Row], loso: dict) -> dict[str, list[float]]:
    """Per phase group (and `all`): the lowest and highest out-of-sample ratio; a group with under 3 rows borrows
    `all`."""
    out = {}
    every = [loso[f"{r.source}|{r.label}"] for r in rows]
    for group in GROUPS:
        values = [loso[f"{r.source}|{r.label}"] for r in rows if r.group == group]
        if len(values) >= 3:
            out[group] = [min(values), max(values)]
    out["all"] = [min(every), max(every)]
    return out


def calibrate_class(kind: str) -> dict:
    """The fit, the leave-one-source-out ratios and spreads of one device class (what --write stores)."""
    rows = calibration_rows(kind)
    f = fit(kind, rows)
    loso = leave_one_source_out(kind, rows)
    prior = timing.priors(kind)
    factor_table = {}
    for k in timing.FACTORS:
        values = [fs[k] for fs in loso["factors"].values()]
        factor_table[k] = {"value": f[k], "prior": prior[k].value, "plausible": [prior[k].low, prior[k].high],
                           "meaning": prior[k].meaning, "loso": [min(values), max(values)],
                           "within_plausible": prior[k].low <= f[k] <= prior[k].high}
    return {"factors": factor_table, "cv": cv_spread(rows, loso["ratio"]),
            "in_sample": ratios(rows, f), "loso": loso["ratio"]}


def fit_all() -> dict[str, dict]:
    return {kind: calibrate_class(kind) for kind in ("gpu", "cpu")}


def write(tables: dict[str, dict]) -> None:
    path = DATA / "efficiency.json"
    data = {"about": "Efficiency factors per device class (fastrlhf/estimate/timing.py), written by `python -m "
                     "fastrlhf.estimate.calibrate --write`: the fitted value, its prior and plausible range, its value "
                     "across the leave-one-source-out fits (`loso`); `cv`: per phase group the lowest and highest "
                     "predicted / measured of a source predicted by a fit without it (the printed ranges); "
                     "`in_sample` and `loso`: every calibration row's ratio.",
            "classes": {k: t["factors"] for k, t in tables.items()},
            "cv": {k: t["cv"] for k, t in tables.items()},
            "in_sample": {k: t["in_sample"] for k, t in tables.items()},
            "loso": {k: t["loso"] for k, t in tables.items()}}
    path.write_text(json.dumps(data, indent=1) + "\n")
    timing.calibration.cache_clear()
    timing.cpu_priors.cache_clear()


# ---------------------------------------------------------------------------------------------
# Reports: every source in and out of sample, the checks, the held-out benchmark


def source_report(kind: str) -> list[dict]:
    """Per source: its rows' measured value, in-sample and cross-validated ratios, its band, whether it holds."""
    cal = timing.calibration()
    in_sample, loso = cal.get("in_sample", {}).get(kind, {}), cal.get("loso", {}).get(kind, {})
    out = {}
    for r in calibration_rows(kind):
        key = f"{r.source}|{r.label}"
        entry = out.setdefault(r.source, {"source": r.source, "band": band_of(r.source), "rows": []})
        entry["rows"].append({"label": r.label, "group": r.group, "measured_s": r.measured, "fitted": r.fitted,
                              "in_sample": in_sample.get(key), "cross_validated": loso.get(key)})
    for entry in out.values():
        b = entry["band"]
        entry["within_band"] = all(r["cross_validated"] is not None and 1 / b <= r["cross_validated"] <= b
                                   if b >= 1 else abs(r["cross_validated"] - 1) <= b for r in entry["rows"])
    return list(out.values())


def check_published() -> list[dict]:
    """The DeepSpeed-Chat checks that fit nothing: Figure 5's generation share, the step-3 log's peak memory, the
    Llama-2 blog's minimum GPUs; and README Table 1 (validation, no band)."""
    out = []
    for p in published_points():
        kind = p["kind"]
        if kind == "peak_memory":
            r = estimate(spec_of(p["setup"]))["stages"]["ppo"]
            pred, pub = r["memory_per_gpu_bytes"]["peak"], p["published"]["peak_bytes"]
            out.append({"id": p["id"], "published": pub, "predicted": pred, "ratio": pred / pub,
                        "within_band": abs(pred / pub - 1) <= p["band"]["peak"], "band": p["band"]})
        elif kind == "generate_share":
            pred = estimate(spec_of(p["setup"]))["stages"]["ppo"]["phases"]["rollout"]["share"]
            pub = p["published"]["generate_share"]
            out.append({"id": p["id"], "published": pub, "predicted": pred,
                        "within_band": abs(pred - pub) <= p["band"]["generate_share"], "band": p["band"]})
        elif kind == "min_gpus":
            rows = []
            for row in p["published"]["rows"]:
                n = min_gpus(spec_of(p["setup"], **row["setup"]))
                ok = n is not None and max(n, row["min_gpus"]) / min(n, row["min_gpus"]) <= p["band"]["factor"]
                rows.append({"case": row["case"], "published": row["min_gpus"], "predicted": n, "within_band": ok})
            out.append({"id": p["id"], "rows": rows, "within_band": all(r["within_band"] for r in rows),
                        "band": p["band"]})
        elif kind == "epoch_time":
            out.append({"id": p["id"], "rows": _table1_rows(p), "within_band": None, "band": None})
    return out


def _table1_rows(p: dict) -> list[dict]:
    rows = []
    for row in p["published"]["rows"]:
        try:
            spec = spec_of(dict(p["common"], **row["setup"]))
        except ValueError:
            rows.append({"case": row["case"], "published": row["published_text"], "predicted_s": None,
                         "note": "judged not to fit at one sequence per GPU"})
            continue
        r = estimate(spec)["stages"]["ppo"]
        iterations = p["queries"] / spec.rollout_batch
        rows.append({"case": row["case"], "published": row["published_text"], "published_s": row["seconds"],
                     "predicted_s": r["seconds"] * iterations, "batch_per_gpu": spec.micro_batch,
                     "ratio": r["seconds"] * iterations / row["seconds"],
                     "generate_share": r["phases"]["rollout"]["share"]})
    return rows


def min_gpus(spec: Spec, limit: int = 64) -> int | None:
    """The fewest GPUs (powers of two) on which the planner judges the run to fit."""
    n = 1
    while n <= limit:
        if fits(dataclasses.replace(spec, gpus=n, rollout_batch=n * (spec.micro_rollout_batch or 1))):
            return n
        n *= 2
    return None


def check_runs() -> list[dict]:
    """Every recorded fastrlhf run: predicted vs measured phase times with the committed factors."""
    out = []
    for name, rec, raw in run_records():
        c = compare(rec, stat=RUN_STAT, key=run_key(rec))
        total = sum(r["measured_seconds"] or 0.0 for r in c["phases"].values())
        rows = {ph: dict(r, judged=(r["measured_seconds"] or 0.0) >= MINOR_SHARE * total)
                for ph, r in c["phases"].items() if r["measured_seconds"]}
        out.append({"id": name, "command": raw.get("command"), "measured": run_key(rec), "phases": rows,
                    "iteration": c["iteration"]})
    return out


def check_heldout() -> list[dict]:
    out = []
    for p in heldout_points():
        for row in p["published"]["rows"]:
            r = estimate(spec_of(p["setup"], **row["setup"]))["stages"]["ppo"]
            n = row.get("iterations", 1)
            out.append({"id": f"{p['id']}:{row['case']}", "published_s": row["seconds"],
                        "predicted_s": r["seconds"] * n, "range_s": [x * n for x in r["seconds_range"]],
                        "ratio": r["seconds"] * n / row["seconds"], "fits": r["fits"], "tight": r["tight"],
                        "dominant_phase": r["dominant_phase"],
                        "shares": {k: p_["share"] for k, p_ in r["phases"].items()}})
    return out


# ---------------------------------------------------------------------------------------------


PROBE_NOTE = ("fp32 1024^3 matmuls and 64 MiB copies (the best of five one-second probes each), the eager torch.add "
              "of two 64-element tensors (op_latency) and the bare tensor expressions of hardware.bare_round "
              "(bare_op_latency) (the median of five each), one thread in process time (hardware.probe_cpu); on a "
              "machine shared with other jobs the 2-thread figure can fall below the 1-thread one (the threads wait "
              "on each other), which is why the recorded runs use one thread. bench/record_cpu.sh probes before "
              "and again after the CPU records (`probes`); the one-thread figures are the best rates and the mean "
              "latencies of those probes, since the machine's speed drifts while it records")


def _one_thread(probe: dict) -> dict:
    return {"peak_flops": probe["peak_flops"], "bandwidth": probe["bandwidth"], "op_latency": probe["op_latency"],
            "bare_op_latency": probe["bare_op_latency"], "load_avg": list(os.getloadavg()),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def merged_probes(entry: dict) -> dict:
    """The entry's one-thread figures from its `probes`: the best matmul and copy rates (a peak: a slower moment
    of a shared machine only lowers it) and the mean op latencies."""
    probes = entry["probes"]
    return dict(entry, peak_flops_1_thread=max(p["peak_flops"] for p in probes),
                bandwidth=max(p["bandwidth"] for p in probes),
                op_latency_1_thread=statistics.mean(p["op_latency"] for p in probes),
                bare_op_latency_1_thread=statistics.mean(p["bare_op_latency"] for p in probes))


def probe_cpu_into_devices(again: bool = False) -> dict:
    """Measure this CPU into data/devices.json; `again`: one more one-thread probe of the same CPU, merged with
    the earlier ones (merged_probes)."""
    from fastrlhf.estimate.hardware import probe_cpu
    from fastrlhf.estimate.record import cpu_model

    name = f"{cpu_model()}, {os.cpu_count()} cores"
    if again:
        entry = json.loads((DATA / "devices.json").read_text())["cpu"]
        if entry.get("name") != name or "probes" not in entry:
            raise SystemExit(f"--probe-cpu --again: data/devices.json holds {entry.get('name')!r}, not a probe of "
                             f"this {name!r}: run --probe-cpu first")
        spec = merged_probes(dict(entry, probes=[*entry["probes"], _one_thread(probe_cpu(threads=1))]))
    else:
        one = probe_cpu(threads=1)
        every = probe_cpu(threads=os.cpu_count() or 1)
        spec = merged_probes({
            "name": name, "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "bandwidth_all_threads": every["bandwidth"], "peak_flops": every["peak_flops"], "threads": every["threads"],
            "command": "python -m fastrlhf.estimate.calibrate --probe-cpu [--again]", "note": PROBE_NOTE,
            "probes": [_one_thread(one)]})
    (DATA / "devices.json").write_text(json.dumps({"cpu": spec}, indent=1) + "\n")
    return spec


def _f(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def markdown_sources(kind: str) -> str:
    """Every calibration source: measured, in-sample and cross-validated predicted / measured, band, holds."""
    out = ["| source | quantity | measured | in-sample pred/meas | cross-validated pred/meas | band | within |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in source_report(kind):
        band = f"x{s['band']:g}" if s["band"] >= 1 else f"±{s['band']:.0%}"
        for r in s["rows"]:
            ins = _f(r["in_sample"]) + ("" if r["fitted"] else " (check)")
            out.append(f"| {s['source']} | {r['label']} | {_f(r['measured_s'])} s | {ins} | {_f(r['cross_validated'])} "
                       f"| {band} | {'yes' if s['within_band'] else 'NO'} |")
    return "\n".join(out)


def markdown_factors() -> str:
    out = ["| class | factor | meaning | prior | plausible | fitted | across LOSO fits |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for kind, table in timing.calibration()["classes"].items():
        for k, e in table.items():
            if kind == "cpu" and k in ("gap", "net", "adam"):
                continue
            lo, hi = e["plausible"]
            out.append(f"| {kind} | {k} | {e['meaning']} | {_f(e['prior'])} | {_f(lo)}-{_f(hi)} | {_f(e['value'])} | "
                       f"{_f(e['loso'][0])}-{_f(e['loso'][1])} |")
    return "\n".join(out)


def markdown(heldout: bool) -> str:
    parts = ["**Factors**", "", markdown_factors(), "", "**GPU sources**", "", markdown_sources("gpu"), "",
             "**CPU runs**", "", markdown_sources("cpu"), "", "**Checks (fit nothing)**", "",
             "| check | published | predicted | band | within |", "| --- | --- | --- | --- | --- |"]
    for p in check_published():
        if p["id"].endswith("-memory"):
            parts.append(f"| DS-Chat log: peak allocated GB | {p['published'] / 1e9:.2f} | {p['predicted'] / 1e9:.2f} "
                         f"| ±{p['band']['peak']:.0%} | {'yes' if p['within_band'] else 'NO'} |")
        elif p["id"].startswith("dschat-blog-fig5"):
            parts.append(f"| DS-Chat blog fig. 5, OPT-1.3B, 8 x A100-40G: generate share | {_f(p['published'])} | "
                         f"{_f(p['predicted'])} | ±{p['band']['generate_share']} | "
                         f"{'yes' if p['within_band'] else 'NO'} |")
        elif p["id"].startswith("dschat-blog-8-31"):
            for r in p["rows"]:
                parts.append(f"| DS-Chat Llama-2 blog fig. 4, Llama-2-7B min V100-32G, {r['case']} | {r['published']} "
                             f"| {r['predicted']} | x2 | {'yes' if r['within_band'] else 'NO'} |")
    parts += ["", "| DS-Chat README table 1 (validation, not fitted) | published | predicted | pred/pub | batch/GPU |",
              "| --- | --- | --- | --- | --- |"]
    for p in check_published():
        if p["id"] == "dschat-readme-table1-step3-e2e":
            for r in p["rows"]:
                if r.get("predicted_s") is None:
                    parts.append(f"| {r['case']} | {r['published']} | judged not to fit | - | - |")
                else:
                    parts.append(f"| {r['case']} | {r['published']} | {r['predicted_s'] / 3600:.2f} h | "
                                 f"{r['ratio']:.2f} | {r['batch_per_gpu']} |")
    if heldout:
        parts += ["", "| OpenRLHF benchmark (held out) | published s | predicted s | range | pred/pub | fits |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in check_heldout():
            parts.append(f"| {r['id'].replace('openrlhf-readme-', '')} | {r['published_s']:.0f} | "
                         f"{r['predicted_s']:.0f} | {r['range_s'][0]:.0f}-{r['range_s'][1]:.0f} | {r['ratio']:.2f} | "
                         f"{'yes' + (' (tight)' if r['tight'] else '') if r['fits'] else 'NO'} |")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastrlhf.estimate.calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="refit, cross-validate, write data/efficiency.json")
    p.add_argument("--heldout", action="store_true", help="also predict OpenRLHF's published benchmark")
    p.add_argument("--probe-cpu", action="store_true", help="measure this CPU into data/devices.json")
    p.add_argument("--again", action="store_true",
                   help="with --probe-cpu: probe the same CPU once more and merge (after recording its runs)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print the README / docs tables")
    args = p.parse_args(argv)
    if args.probe_cpu:
        print(json.dumps(probe_cpu_into_devices(again=args.again), indent=1))
    if args.write:
        write(fit_all())
    if args.markdown:
        print(markdown(args.heldout))
        return 0
    report = {"sources": {k: source_report(k) for k in ("gpu", "cpu")}, "checks": check_published()}
    if args.heldout:
        report["heldout"] = check_heldout()
    if args.json:
        print(json.dumps(report, indent=1, default=float))
        return 0
    for kind in ("gpu", "cpu"):
        print(f"{kind} factors: " + ", ".join(f"{k} {v:.4g}" for k, v in timing.factors(kind).items()))
        for s in report["sources"][kind]:
            values = [r["cross_validated"] for r in s["rows"] if r["cross_validated"] is not None]
            spread = f"{min(values):.2f}-{max(values):.2f}" if values else "-"
            print(f"  {s['source']:<36} cross-validated {spread}  band {s['band']}  "
                  f"{'within' if s['within_band'] else 'OUTSIDE'}")
    print(json.dumps(report, indent=1, default=float))
    return 0

if __name__ == "__main__":
    sys.exit(main())
