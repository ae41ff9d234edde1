"""`fastrlhf pipeline`: SFT -> reward model -> PPO in a row, under one run directory.

With no arguments it runs the embedded default: a char tokenizer and a tiny Llama built
from a config, trained on the synthetic "echo the key letter" task (see fastrlhf.data),
in a few minutes on a laptop CPU. Stage keys are set with dots: `--ppo.steps 20`.
`--resume` skips finished stages (their `final` folder exists) and resumes the unfinished
one from its latest checkpoint.

Leaves OUT/{sft,rm,ppo}/, OUT/metrics.jsonl, OUT/summary.json, OUT/plots/*.png.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from fastrlhf import ppo, rm, sft
from fastrlhf.checkpoint import write_json_atomic
from fastrlhf.config import PipelineConfig, run_cli, to_dict
from fastrlhf.metrics import log, setup_logging, update_summary


def run(cfg: PipelineConfig) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for stage in (cfg.sft, cfg.rm, cfg.ppo):
        stage.out, stage.seed, stage.resume = cfg.out, cfg.seed, cfg.resume
    write_json_atomic(out / "config.json", to_dict(cfg))
    start = time.perf_counter()
    stages = (("sft", sft.train, cfg.sft), ("rm", rm.train, cfg.rm), ("ppo", ppo.train, cfg.ppo))
    for name, train, stage_cfg in stages:
        if cfg.resume and (out / name / "final").is_dir():
            log.info("pipeline: %s already finished, skipping", name)
            continue
        result = train(stage_cfg)
        if "stopped_at" in result:
            log.info("pipeline: stopped inside %s; run again with --resume", name)
            return result
    summary = update_summary(out, "pipeline", {"seconds": time.perf_counter() - start})
    headline = {
        "sft.loss_final": summary["sft"]["loss_final"],
        "rm.accuracy": summary["rm"]["accuracy"],
        "ppo.true_score_before": summary["ppo"].get("true_score_before"),
        "ppo.true_score_after": summary["ppo"].get("true_score_after"),
        "ppo.kl_final": summary["ppo"]["kl_final"],
    }
    log.info("pipeline: done in %.0f s\n%s", summary["pipeline"]["seconds"], json.dumps(headline, indent=2))
    return summary


def main(argv: list[str]) -> int:
    setup_logging()
    return run_cli(PipelineConfig, argv, "fastrlhf pipeline", run)
