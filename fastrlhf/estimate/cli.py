"""`fastrlhf estimate`: the command line, the table, the plot."""

from __future__ import annotations

import argparse
import json
import sys

import fastrlhf.estimate.timing as timing
from fastrlhf.estimate.arch import LINEARS, PRESETS, format_params
from fastrlhf.estimate.hardware import device, device_names
from fastrlhf.estimate.memory import state_table
from fastrlhf.estimate.plan import (
    COMPONENTS,
    ENGINES,
    GEN_ENGINES,
    LOGITS,
    OFFLOADS,
    POOLS,
    ROLLOUT_CACHES,
    STAGES,
    Spec,
    actor_arch,
    estimate,
    host_engine,
    resolved,
)

DESCRIPTION = """Memory per GPU, FLOPs, time (with a range) and cost of each RLHF stage and PPO phase, fit per pool.

Time comes from the work of each phase (FLOPs, bytes, calls) and coefficients calibrated against
DeepSpeed-Chat's published step-3 runs and this trainer's recorded runs
(fastrlhf/estimate/data/efficiency.json; `python -m fastrlhf.estimate.calibrate` shows the points).
--engine deepspeed follows the ZeRO paper's stage definitions (table below). DeepSpeed's own
estimators count more: estimate_zero2_model_states_mem_needs = 4P + 16P/N (fp16 weights and
gradients unpartitioned, and an fp32 gradient partition beside K = 12), and
estimate_zero3_model_states_mem_needs = 4 x largest layer + 18P/N. --engine fsdp2 (default) is
this trainer's real buffers.
"""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _mapping(text: str, what: str, keys: tuple[str, ...]) -> dict[str, int]:
    out = {}
    for item in text.split(","):
        if "=" not in item:
            raise ValueError(f"{what}: expected NAME=N items separated by commas, got {text!r}")
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in keys:
            raise ValueError(f"{what}: unknown name {name!r}; expected {', '.join(keys)}")
        try:
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"{what}: {name}={value!r} is not an integer") from None
    return out


def parse_zero(text: str):
    """`3` or `actor=3,critic=2,all=0`."""
    text = str(text)
    if "=" in text:
        return _mapping(text, "zero", ("actor", "critic", "reference", "reward", "ema", "all"))
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"zero: expected a stage 0-3 or actor=3,critic=2,..., got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    d = Spec()
    p = argparse.ArgumentParser(prog="fastrlhf estimate", description=DESCRIPTION, epilog=state_table(),
                                formatter_class=_Formatter)
    p.add_argument("--model", default=d.model,
                   help=f"preset ({', '.join(PRESETS)}), a `fastrlhf ppo --model` built-in (tiny, qwen2-0.5b, "
                        "llama-0.5b), a model directory or a config.json")
    p.add_argument("--params", default=None, help="actor parameter count (7.5e9, 7.5B, 770M): the model is widened "
                                                  "or narrowed to it (layers kept; weights, FLOPs, activations, "
                                                  "KV cache follow)")
    p.add_argument("--stage", default=d.stage, choices=(*STAGES, "all"), help="all = sft, rm, ppo")
    p.add_argument("--gpus", type=int, default=d.gpus,
                   help="GPUs of a colocated run (--gpu cpu: processes, torchrun --nproc-per-node)")
    p.add_argument("--placement", default=d.placement, choices=("colocated", "disaggregated"),
                   help="colocated: every model on every GPU; disaggregated: a pool of GPUs per role (--pools)")
    p.add_argument("--pools", default=None,
                   help=f"disaggregated: GPUs per pool, e.g. gen=4,actor=4,critic=4,reference=2,reward=2 "
                        f"({', '.join(POOLS)})")
    p.add_argument("--engine", default=d.engine, choices=ENGINES,
                   help="fsdp2: this trainer's buffers; deepspeed: the ZeRO paper's accounting")
    p.add_argument("--zero", default=str(d.zero),
                   help="ZeRO stage 0-3 for every model, or per model: actor=3,critic=2,reference=3,reward=0 "
                        "(all=N sets the rest); fsdp2: 0 none, 2 reshard_after_forward=False, 3 full")
    p.add_argument("--dtype", default=d.dtype, choices=("bf16", "fp16", "fp32"),
                   help="bf16 / fp16: mixed precision; fp32. Unset: the trainer's, fp32 with --gpu cpu, else bf16")
    p.add_argument("--lora-rank", type=int, default=d.lora_rank, help="0 = full fine-tuning")
    p.add_argument("--lora-targets", default=",".join(d.lora_targets), help="comma list of " + ",".join(LINEARS))
    p.add_argument("--qlora", action="store_true", help="4-bit NF4 base under the adapters")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="keep each layer's input only; recompute in backward")
    p.add_argument("--no-flash", action="store_true", help="eager attention (saves [T, T] probabilities)")
    p.add_argument("--logits", default=d.logits, choices=LOGITS,
                   help="linear: fastrlhf's chunked log-probs from hidden states; fused: kernels on dtype "
                        "logits; materialised: fp32 logits + log-softmax")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch,
                   help="sequences per forward/backward per GPU (DPO: pairs)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="prompt tokens")
    p.add_argument("--gen-len", type=int, default=d.gen_len, help="longest generated response")
    p.add_argument("--mean-gen-len", type=int, default=d.mean_gen_len, help="mean response length (None = gen-len)")
    p.add_argument("--rollout-batch", type=int, default=d.rollout_batch,
                   help="prompts per PPO/GRPO iteration over all GPUs (DPO: pairs per step)")
    p.add_argument("--micro-rollout-batch", type=int, default=d.micro_rollout_batch,
                   help="sequences per generate call and experience forward per GPU (None = all of its share)")
    p.add_argument("--mini-batch", type=int, default=d.mini_batch,
                   help="sequences per optimizer step over all GPUs (None = the whole rollout)")
    p.add_argument("--ppo-epochs", type=int, default=d.ppo_epochs, help="passes over each rollout")
    p.add_argument("--num-generations", type=int, default=d.num_generations, help="samples per prompt (GRPO's G)")
    p.add_argument("--critic", default=d.critic,
                   help="shared (value head on the actor), actor (a copy), a parameter count or a model")
    p.add_argument("--reward", default=d.reward, help="actor (like the actor), rule, a parameter count or a model")
    p.add_argument("--gen-engine", default=d.gen_engine, choices=GEN_ENGINES,
                   help="hf generate; ds-he: DeepSpeed hybrid engine; vllm")
    p.add_argument("--gen-tp", type=int, default=d.gen_tp, help="tensor-parallel GPUs per generation engine")
    p.add_argument("--rollout-cache", default=d.rollout_cache, choices=ROLLOUT_CACHES,
                   help="hf generate's KV cache (fastrlhf ppo --rollout_cache): dynamic (eager decode step), "
                        "static (decode step compiled by transformers); auto = static on one GPU, else dynamic")
    p.add_argument("--offload", default=d.offload, choices=OFFLOADS,
                   help="optimizer: states on the host (deepspeed); params: weights too (ZeRO-3 / FSDP2 "
                        "CPUOffloadPolicy)")
    p.add_argument("--offload-frozen", action="store_true",
                   help="reference and reward weights on the host (streamed in for their forward)")
    p.add_argument("--ema", action="store_true", help="an EMA copy of the actor (DeepSpeed-Chat --enable_ema)")
    p.add_argument("--gpu", default=d.gpu, choices=device_names(),
                   help="device (cpu: the recorded CPU, data/devices.json)")
    p.add_argument("--cpu-threads", type=int, default=d.cpu_threads,
                   help="--gpu cpu: threads (None = the trainer's rule: one below 20M parameters, else all)")
    p.add_argument("--price", type=float, default=d.price, help="dollars per GPU-hour")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps / PPO iterations to cost")
    p.add_argument("--json", action="store_true", help="print the estimate (and its inputs) as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a stacked bar chart of memory per phase")
    p.add_argument("--measure", action="store_true",
                   help="run a tiny model for a few steps and print predicted vs measured bytes")
    p.add_argument("--compare-run", metavar="OUT",
                   help="a fastrlhf run directory: its measured PPO phases beside the prediction for its "
                        "configuration (flags given here override what is read from the run)")
    p.add_argument("--run-args", metavar="ARGS", default=None,
                   help="--compare-run of a stand-alone `fastrlhf ppo` run, which writes no config.json: its "
                        "arguments, quoted ('--model qwen2-0.5b --steps 10 ...')")
    return p


def spec_from_args(args: argparse.Namespace) -> Spec:
    pools = _mapping(args.pools, "pools", POOLS) if args.pools else None
    spec = Spec(model=args.model, params=args.params, stage=args.stage, gpus=args.gpus, placement=args.placement,
                pools=pools, engine=args.engine, zero=parse_zero(args.zero), dtype=args.dtype,
                lora_rank=args.lora_rank,
                lora_targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()),
                qlora=args.qlora, gradient_checkpointing=args.gradient_checkpointing,
                flash_attention=not args.no_flash, logits=args.logits, micro_batch=args.micro_batch,
                seq_len=args.seq_len, gen_len=args.gen_len, mean_gen_len=args.mean_gen_len,
                rollout_batch=args.rollout_batch, micro_rollout_batch=args.micro_rollout_batch,
                mini_batch=args.mini_batch, ppo_epochs=args.ppo_epochs, num_generations=args.num_generations,
                critic=args.critic, reward=args.reward, gen_engine=args.gen_engine, gen_tp=args.gen_tp,
                rollout_cache=args.rollout_cache, offload=args.offload, offload_frozen=args.offload_frozen,
                ema=args.ema, gpu=args.gpu,
                cpu_threads=args.cpu_threads, price=args.price, steps=args.steps)
    return resolved(spec)  # dtype None: the trainer's on the device


def spec_json(spec: Spec) -> dict:
    import dataclasses

    out = dataclasses.asdict(spec)
    if not isinstance(out["model"], str):
        out["model"] = str(actor_arch(spec).source or "config")
    out["lora_targets"] = list(spec.lora_targets)
    return out


# ---------------------------------------------------------------------------------------------
# Output


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _secs(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 1:
        return f"{s:.2f}"
    return f"{s:.3g}"


def _title(result: dict, spec: Spec) -> str:
    arch = actor_arch(spec)
    gpus = (f"{spec.gpus} x {spec.gpu}" if spec.placement == "colocated"
            else ", ".join(f"{k} {v}" for k, v in spec.pools.items()) + f" x {spec.gpu}")
    zero = spec.zero if isinstance(spec.zero, int) else ",".join(f"{k}={v}" for k, v in spec.zero.items())
    train = f"LoRA r={spec.lora_rank}" + (" (QLoRA)" if spec.qlora else "") if spec.lora_rank else "full"
    return (f"{arch.source or spec.model}: {format_params(arch.params())} params, {gpus}, {spec.engine} "
            f"ZeRO-{zero}, {spec.dtype}, {train}, gen {spec.gen_engine}"
            + (f" tp{spec.gen_tp}" if spec.gen_tp > 1 else "") + " - memory per GPU in GB (1e9 B)")


def format_table(result: dict, spec: Spec) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=_title(result, spec))
    cols = ("stage / phase", *COMPONENTS, "peak", "fits", "TFLOP", "seconds", "range", "share")
    for col in cols:
        table.add_column(col, justify="left" if col == "stage / phase" else "right")
    limit = device(spec.gpu).memory_bytes - device(spec.gpu).context_bytes
    for stage, r in result["stages"].items():
        mem = r["memory_per_gpu_bytes"]
        table.add_row(stage, *(_gb(mem[c]) for c in COMPONENTS), _gb(mem["peak"]), "yes" if r["fits"] else "NO",
                      f"{r['flops'] / 1e12:.1f}", _secs(r["seconds"]),
                      f"{_secs(r['seconds_range'][0])}-{_secs(r['seconds_range'][1])}", "")
        for phase, p in r.get("phases", {}).items():
            mem = p["memory_per_gpu_bytes"]
            mark = " *" if phase == r["dominant_phase"] else ""
            table.add_row(f"  {phase}{mark}", *(_gb(mem[c]) for c in COMPONENTS), _gb(mem["peak"]),
                          "yes" if mem["peak"] <= limit else "NO", f"{p['flops'] / 1e12:.1f}", _secs(p["seconds"]),
                          f"{_secs(p['seconds_range'][0])}-{_secs(p['seconds_range'][1])}", f"{p['share']:.0%}")
    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(table)
    lines = [console.export_text().rstrip()]
    for stage, r in result["stages"].items():
        if r.get("dominant_phase"):
            lines.append(f"{stage}: {r['dominant_phase']} dominates ({r['phases'][r['dominant_phase']]['share']:.0%} "
                         f"of {_secs(r['seconds'])} s per {spec.steps} iteration(s)); * marks it")
        for pool, f in r["pools"].items():
            verdict = "fits" if f["fits"] else f"does NOT fit: {f['component']} is the largest part"
            lines.append(f"{stage}: pool {pool} ({f['gpus']} GPU): peak {_gb(f['peak'])} GB in {f['phase']}, {verdict}")
            held = [f"{name} {_gb(m['weights'] + m['gradients'] + m['optimizer'] + m['buffers'])}"
                    f" (w {_gb(m['weights'])} g {_gb(m['gradients'])} opt {_gb(m['optimizer'])}"
                    f" buf {_gb(m['buffers'])})" for name, m in r["models"].items() if m["pool"] == pool]
            lines.append(f"    states per GPU, GB: {'; '.join(held)}")
        if r["host_memory_per_gpu_bytes"]:
            lines.append(f"{stage}: host memory per GPU {_gb(r['host_memory_per_gpu_bytes'])} GB (offloaded optimizer "
                         "states, fp32 gradient partitions, weights)")
        if "advice" in r:
            lines.append("  one change at a time:")
            for a in r["advice"]["single"]:
                lines.append(f"    {a['change']:<32} -> peak {_gb(a['peak_bytes'])} GB per GPU"
                             + (" (fits)" if a["fits"] else " (still too big)"))
            if r["advice"]["path"]:
                lines.append("  changes in a row (each lowers the peak most):")
                for a in r["advice"]["path"]:
                    lines.append(f"    + {a['change']:<30} -> peak {_gb(a['peak_bytes'])} GB per GPU"
                                 + (" (fits)" if a["fits"] else ""))
        if spec.price:
            lines.append(f"{stage}: ${r['cost_usd']:.2f} for {spec.steps} step(s) at ${spec.price}/GPU-hour")
    kind = device(spec.gpu).kind
    coef = timing.coefficients(kind)
    dec = coef[f"decode:{spec.gen_engine}"]
    hidden = actor_arch(spec).hidden

    def mfu(k: str) -> float:
        c = coef[k]["value"] + coef[f"{k}/h"]["value"] * 1024 / hidden
        return 1 / c if c else float("inf")

    generates = any("rollout" in r.get("phases", {}) for r in result["stages"].values())
    calls = coef[f"calls:{host_engine(spec)}"]
    decode = (f"{spec.gen_engine} decode at {1 / dec['value']:.2f} of memory bandwidth "
              f"(from {', '.join(dec['from'])}), {host_engine(spec)} host overhead "
              f"{calls['value'] * 1e3:.2g} ms per layer call (from {', '.join(calls['from'])}); "
              if generates else "")
    lines.append(f"time ({kind}): at this model's width training MFU {mfu('train'):.2f}, forward MFU {mfu('fwd'):.2f}; "
                 f"{decode}a range takes every coefficient at an end of its calibrated range; fits = peak + CUDA "
                 "context <= GPU memory")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Stacked bars of memory per GPU by component, one bar per stage / PPO phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for stage, r in result["stages"].items():
        if "phases" in r:
            rows += [(f"{stage}:{ph}", p["memory_per_gpu_bytes"]) for ph, p in r["phases"].items()]
        else:
            rows.append((stage, r["memory_per_gpu_bytes"]))
    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(rows), 4.5))
    bottom = [0.0] * len(rows)
    for component in COMPONENTS:
        values = [mem[component] / 1e9 for _, mem in rows]
        ax.bar([name for name, _ in rows], values, bottom=bottom, label=component)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("memory per GPU (GB)")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _print_measure(lora_rank: int) -> None:
    from fastrlhf.estimate.measure import measure

    m = measure(lora_rank)
    print(f"--measure ({m['device']}, {m['dtype']}, {'LoRA r=' + str(lora_rank) if lora_rank else 'full'}):")
    for key, measured in m["measured"].items():
        predicted = m["predicted"][key]
        print(f"  {key:<10} predicted {predicted:>12,d} B  measured {measured:>12,d} B  "
              f"({(predicted - measured) / measured:+.1%})")


def _explicit(argv: list[str]) -> set[str]:
    """The flags given on the command line (they override what --compare-run reads from the run)."""
    p = parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    try:
        if args.compare_run:
            from fastrlhf.estimate.compare import compare_main

            return compare_main(args, _explicit(argv), spec_from_args(args))
        spec = spec_from_args(args)
        result = estimate(spec)
    except (ValueError, TypeError) as err:
        print(f"fastrlhf estimate: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"inputs": spec_json(spec), **result}, indent=2))
    else:
        print(format_table(result, spec))
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.measure:
        for rank in sorted({0, args.lora_rank or 8}):
            _print_measure(rank)
    return 0
