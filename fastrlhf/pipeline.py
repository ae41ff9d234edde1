"""`fastrlhf pipeline`: SFT -> reward model -> PPO in a row (`--algo ppo`, the default), or
SFT -> DPO (`--algo dpo`), under one run directory.

With no arguments it runs the embedded default: a char tokenizer and a tiny Llama built
from a config, trained on the built-in "echo the key letter" task (see fastrlhf.task),
in a few minutes on a laptop CPU. Stage keys are set with dots: `--ppo.steps 20`.

Every stage's configuration is checked before the first model loads (a missing `--ppo.data`
is reported before SFT trains). With a rule reward (`--ppo.reward module:function`), or a
reward model of your own (`--ppo.reward DIR`), the reward-model stage is skipped. `--resume`
skips finished stages (their `final` folder exists) and resumes the unfinished one from its
latest checkpoint; a fresh run in a run directory is refused unless `--overwrite`.

Leaves OUT/config.json, OUT/{sft,rm,ppo}/ (or OUT/{sft,dpo}/), OUT/metrics.jsonl, OUT/summary.json,
OUT/plots/*.png.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

from fastrlhf import distributed, dpo, ppo, rm, sft
from fastrlhf.checkpoint import check_run_dir
from fastrlhf.config import PipelineConfig, run_cli, to_dict
from fastrlhf.metrics import log, setup_logging, update_summary
from fastrlhf.rewards import is_rule
from fastrlhf.run import holds_run_folder, start_stage_dir

# what a pipeline writes in OUT: what makes a folder hold a run, and all that --overwrite deletes
OUTPUTS = ("config.json", "sft", "rm", "ppo", "dpo", "metrics.jsonl", "summary.json", "plots", "tb")
ALGOS = ("ppo", "dpo")


def prepare(cfg: PipelineConfig) -> tuple[dict, list]:
    """Check every stage's configuration, before any model loads. Returns the resolved
    configuration (what OUT/config.json records) and the (name, train, plan) of each stage to run."""
    cfg = copy.deepcopy(cfg)
    if cfg.algo not in ALGOS:
        raise ValueError(f"pipeline: algo must be one of {', '.join(ALGOS)}, got {cfg.algo!r}")
    for stage in (cfg.sft, cfg.rm, cfg.ppo, cfg.dpo):
        stage.out, stage.seed, stage.resume, stage.overwrite = cfg.out, cfg.seed, cfg.resume, cfg.overwrite
        stage.dist_timeout_s = cfg.dist_timeout_s
    sft_plan = sft.prepare(cfg.sft, key_prefix="sft.")
    if cfg.algo == "dpo":
        dpo_plan = dpo.prepare(cfg.dpo, upstream=sft_plan.produces, key_prefix="dpo.")
        resolved = dict(to_dict(cfg), sft=to_dict(sft_plan.cfg), dpo=to_dict(dpo_plan.cfg),
                        rm="not run (algo dpo)", ppo="not run (algo dpo)")
        check_run_dir(Path(cfg.out), resolved, resume=cfg.resume, overwrite=cfg.overwrite, what="pipeline",
                      own=OUTPUTS, defaults=to_dict(PipelineConfig()))
        return resolved, [("sft", sft.train, sft_plan), ("dpo", dpo.train, dpo_plan)]
    own_rm = str(Path(cfg.out) / "rm" / "final")
    train_rm = cfg.ppo.reward in ("", own_rm)
    rm_plan = rm.prepare(cfg.rm, upstream=sft_plan.produces, key_prefix="rm.") if train_rm else None
    ppo_plan = ppo.prepare(cfg.ppo, upstream=sft_plan.produces, key_prefix="ppo.",
                           reward_upstream=rm_plan.produces if rm_plan else None)
    if not train_rm:
        kind = "the rule" if is_rule(cfg.ppo.reward) else "the reward model"
        log.info("pipeline: ppo.reward is %s %s: the reward-model stage is skipped", kind, cfg.ppo.reward)
    skipped = f"skipped (ppo.reward {cfg.ppo.reward})"
    resolved = dict(to_dict(cfg), sft=to_dict(sft_plan.cfg), ppo=to_dict(ppo_plan.cfg),
                    rm=to_dict(rm_plan.cfg) if rm_plan else skipped, dpo="not run (algo ppo)")
    check_run_dir(Path(cfg.out), resolved, resume=cfg.resume, overwrite=cfg.overwrite, what="pipeline", own=OUTPUTS,
                  defaults=to_dict(PipelineConfig()))
    stages = [("sft", sft.train, sft_plan), ("rm", rm.train, rm_plan), ("ppo", ppo.train, ppo_plan)]
    return resolved, [s for s in stages if s[2] is not None]


@holds_run_folder("pipeline")
def run(cfg: PipelineConfig) -> dict:
    resolved, stages = prepare(cfg)
    distributed.setup(stages[0][2].cfg.device, resolved, "pipeline")  # torchrun: every rank, the same config
    out = Path(cfg.out)
    start_stage_dir(out, resolved, resume=cfg.resume, overwrite=cfg.overwrite, remove=OUTPUTS)
    start = time.perf_counter()
    for name, train, plan in stages:
        if cfg.resume and (out / name / "final").is_dir():
            log.info("pipeline: %s already finished, skipping", name)
            continue
        result = train(plan.cfg, plan)
        if "stopped_at" in result:
            log.info("pipeline: stopped inside %s; run again with --resume", name)
            return result
    if not distributed.is_main():
        return {}
    summary = update_summary(out, "pipeline", {"seconds": time.perf_counter() - start})
    headline = {k: round(v, 4) for k, v in _headline(summary, cfg.algo).items() if v is not None}
    log.info("pipeline: done in %.0f s\n%s", summary["pipeline"]["seconds"], json.dumps(headline, indent=2))
    return summary


def _headline(summary: dict, algo: str) -> dict:
    """The figures the pipeline ends with."""
    if algo == "dpo":
        return {
            "sft.loss_final": summary["sft"]["loss_final"],
            "dpo.accuracy": summary["dpo"]["accuracy"],
            "dpo.true_score_before": summary["dpo"].get("true_score_before"),
            "dpo.true_score_after": summary["dpo"].get("true_score_after"),
            "dpo.reward_margin_final": summary["dpo"]["reward_margin_final"],
        }
    return {
        "sft.loss_final": summary["sft"]["loss_final"],
        "rm.accuracy": summary.get("rm", {}).get("accuracy"),
        "ppo.true_score_before": summary["ppo"].get("true_score_before"),
        "ppo.true_score_after": summary["ppo"].get("true_score_after"),
        "ppo.reward_first": summary["ppo"]["reward_first"],
        "ppo.reward_final": summary["ppo"]["reward_final"],
        "ppo.kl_final": summary["ppo"]["kl_final"],
    }


def main(argv: list[str]) -> int:
    setup_logging()
    return run_cli(PipelineConfig, argv, "fastrlhf pipeline", distributed.entry(run))
