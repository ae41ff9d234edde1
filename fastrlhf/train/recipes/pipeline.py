"""`fastrlhf pipeline`: SFT -> reward model -> PPO in a row (`--algo ppo`, the default), or
SFT -> DPO (`--algo dpo`), or SFT -> reward model -> PPO (the teacher) -> the SFT of a smaller student ->
its distillation from the PPO policy (`--algo distill`), under one run directory.

With no arguments it runs the embedded default: a char tokenizer and a tiny Llama built
from a config, trained on the built-in "echo the key letter" task (see fastrlhf.train.task),
in a few minutes on a laptop CPU. Stage keys are set with dots: `--ppo.steps 20`.

Every stage's configuration is checked before the first model loads (a missing `--ppo.data`
is reported before SFT trains). With a rule reward (`--ppo.reward module:function`), or a
reward model of your own (`--ppo.reward DIR`), the reward-model stage is skipped. `--resume`
skips finished stages (their `final` folder exists) and resumes the unfinished one from its
latest checkpoint; a fresh run in a run directory is refused unless `--overwrite`. `--qlora` trains
every stage's LoRA adapters on a 4-bit base (rank 16 where a stage's lora_rank is 0), except an SFT that
starts from a built-in config's random weights: that one trains whole, and the later stages quantise its result.

`--algo distill` on the embedded default trains `tiny` (0.87M parameters) with PPO as the teacher and
distils it into `tiny-student` (0.29M), SFT'd on the same data first (its own run folder OUT/student);
the headline gives the true scores of the teacher and of the student before and after, and the share of
the teacher's PPO gain over the SFT start the student recovers.

Leaves OUT/config.json, OUT/{sft,rm,ppo}/ (or OUT/{sft,dpo}/; with distill also OUT/student/ and
OUT/distill/), OUT/metrics.jsonl, OUT/summary.json, OUT/plots/*.png.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

from fastrlhf.train import distributed
from fastrlhf.train.checkpoint import check_run_dir
from fastrlhf.train.config import PipelineConfig, run_cli, to_dict
from fastrlhf.train.metrics import log, setup_logging, update_summary
from fastrlhf.train.models import BUILTIN_MODELS
from fastrlhf.train.recipes import distill, dpo, ppo, rm, sft
from fastrlhf.train.rewards import is_rule
from fastrlhf.train.run import holds_run_folder, start_stage_dir

# what a pipeline writes in OUT: what makes a folder hold a run, and all that --overwrite deletes
OUTPUTS = ("config.json", "sft", "rm", "ppo", "dpo", "student", "distill", "metrics.jsonl", "summary.json", "plots",
           "tb")
ALGOS = ("ppo", "dpo", "distill")
STUDENT_DIR = "student"  # the student's SFT run folder inside OUT (--algo distill)
STAGE_DIRS = {"student": "sft"}  # a stage whose folder in its run folder is not its name
QLORA_RANK = 16  # --qlora: the LoRA rank of a stage whose lora_rank is 0 (PPO's default)


def random_base(model: str) -> bool:
    """Whether the SFT stage starts from a built-in config's random weights (no model directory)."""
    return model in BUILTIN_MODELS and not Path(model).is_dir()


def prepare(cfg: PipelineConfig) -> tuple[dict, list]:
    """Check every stage's configuration, before any model loads. Returns the resolved
    configuration (what OUT/config.json records) and the (name, train, plan) of each stage to run."""
    cfg = copy.deepcopy(cfg)
    if cfg.algo not in ALGOS:
        raise ValueError(f"pipeline: algo must be one of {', '.join(ALGOS)}, got {cfg.algo!r}")
    out = Path(cfg.out)
    for stage in (cfg.sft, cfg.rm, cfg.ppo, cfg.dpo, cfg.student, cfg.distill):
        stage.out, stage.seed, stage.resume, stage.overwrite = cfg.out, cfg.seed, cfg.resume, cfg.overwrite
        stage.dist_timeout_s = cfg.dist_timeout_s
        if cfg.qlora:
            stage.qlora, stage.lora_rank = True, stage.lora_rank or QLORA_RANK
    for name, stage in (("sft", cfg.sft), ("student", cfg.student)):
        if cfg.qlora and random_base(stage.model) and (name == "sft" or cfg.algo == "distill"):
            # QLoRA keeps a pretrained base frozen in 4 bits; a built-in config has random weights and a random
            # lm_head, which rank-16 adapters cannot make a language model (SFT loss 2.09 against 0.60 trained
            # whole on tiny): its SFT trains it whole, and the later stages quantise what SFT made
            stage.qlora, stage.lora_rank = False, 0
            log.info("pipeline: --qlora: %s trains the built-in %r whole (random weights, nothing pretrained to "
                     "keep in 4 bits); the later stages train LoRA adapters on its 4-bit NF4 copy", name, stage.model)
    cfg.student.out = str(out / STUDENT_DIR)
    not_run = f"not run (algo {cfg.algo})"
    sft_plan = sft.prepare(cfg.sft, key_prefix="sft.")
    if cfg.algo == "dpo":
        dpo_plan = dpo.prepare(cfg.dpo, upstream=sft_plan.produces, key_prefix="dpo.")
        resolved = dict(to_dict(cfg), sft=to_dict(sft_plan.cfg), dpo=to_dict(dpo_plan.cfg),
                        rm=not_run, ppo=not_run, student=not_run, distill=not_run)
        check_run_dir(out, resolved, resume=cfg.resume, overwrite=cfg.overwrite, what="pipeline", own=OUTPUTS,
                      defaults=to_dict(PipelineConfig()))
        return resolved, [("sft", sft.train, sft_plan), ("dpo", dpo.train, dpo_plan)]
    own_rm = str(out / "rm" / "final")
    train_rm = cfg.ppo.reward in ("", own_rm)
    rm_plan = rm.prepare(cfg.rm, upstream=sft_plan.produces, key_prefix="rm.") if train_rm else None
    ppo_plan = ppo.prepare(cfg.ppo, upstream=sft_plan.produces, key_prefix="ppo.",
                           reward_upstream=rm_plan.produces if rm_plan else None)
    if not train_rm:
        kind = "the rule" if is_rule(cfg.ppo.reward) else "the reward model"
        log.info("pipeline: ppo.reward is %s %s: the reward-model stage is skipped", kind, cfg.ppo.reward)
    skipped = f"skipped (ppo.reward {cfg.ppo.reward})"
    resolved = dict(to_dict(cfg), sft=to_dict(sft_plan.cfg), ppo=to_dict(ppo_plan.cfg),
                    rm=to_dict(rm_plan.cfg) if rm_plan else skipped, dpo=not_run, student=not_run, distill=not_run)
    stages = [("sft", sft.train, sft_plan), ("rm", rm.train, rm_plan), ("ppo", ppo.train, ppo_plan)]
    if cfg.algo == "distill":  # the PPO policy is the teacher of a smaller student, SFT'd on the same data first
        if cfg.student.data == "auto":
            cfg.student.data = sft_plan.cfg.data
        student_plan = sft.prepare(cfg.student, key_prefix="student.")
        teacher = ppo_plan.model.descendant(out / "ppo" / "final", ppo_plan.cfg.data)
        distill_plan = distill.prepare(cfg.distill, student_upstream=student_plan.produces, teacher_upstream=teacher,
                                       key_prefix="distill.")
        resolved.update(student=to_dict(student_plan.cfg), distill=to_dict(distill_plan.cfg))
        stages += [("student", sft.train, student_plan), ("distill", distill.train, distill_plan)]
    check_run_dir(out, resolved, resume=cfg.resume, overwrite=cfg.overwrite, what="pipeline", own=OUTPUTS,
                  defaults=to_dict(PipelineConfig()))
    return resolved, [s for s in stages if s[2] is not None]


@holds_run_folder("pipeline")
def run(cfg: PipelineConfig) -> dict:
    resolved, stages = prepare(cfg)
    distributed.setup(stages[0][2].cfg.device, resolved, "pipeline")  # torchrun: every rank, the same config
    out = Path(cfg.out)
    start_stage_dir(out, resolved, resume=cfg.resume, overwrite=cfg.overwrite, remove=OUTPUTS)
    start = time.perf_counter()
    for name, train, plan in stages:
        if cfg.resume and (Path(plan.cfg.out) / STAGE_DIRS.get(name, name) / "final").is_dir():
            log.info("pipeline: %s already finished, skipping", name)
            continue
        result = train(plan.cfg, plan)
        if "stopped_at" in result:
            log.info("pipeline: stopped inside %s; run again with --resume", name)
            return result
    if not distributed.is_main():
        return {}
    summary = update_summary(out, "pipeline", {"seconds": time.perf_counter() - start})
    if cfg.algo == "distill":
        summary = update_summary(out, "pipeline", dict(summary["pipeline"], **_distill_gain(summary)))
    headline = {k: round(v, 4) for k, v in _headline(summary, cfg.algo).items() if v is not None}
    log.info("pipeline: done in %.0f s\n%s", summary["pipeline"]["seconds"], json.dumps(headline, indent=2))
    return summary


def _distill_gain(summary: dict) -> dict:
    """The share of the teacher's true-score gain over the SFT start (PPO's before -> after) that the
    distilled student reaches, over the SFT start and over its own SFT'd start; None off the built-in task."""
    p, d = summary["ppo"], summary["distill"]
    start, teacher, after = p.get("true_score_before"), p.get("true_score_after"), d.get("true_score_after")
    if None in (start, teacher, after) or teacher == start:
        return {"recovered_gain": None, "recovered_gain_student_start": None}
    return {"recovered_gain": (after - start) / (teacher - start),
            "recovered_gain_student_start": (after - d["true_score_before"]) / (teacher - d["true_score_before"])}


def _headline(summary: dict, algo: str) -> dict:
    """The figures the pipeline ends with."""
    if algo == "distill":
        d = summary["distill"]
        return {
            "ppo.true_score_before (SFT start)": summary["ppo"].get("true_score_before"),
            "ppo.true_score_after (teacher)": summary["ppo"].get("true_score_after"),
            "distill.true_score_teacher": d.get("true_score_teacher"),
            "distill.true_score_before": d.get("true_score_before"),
            "distill.true_score_after": d.get("true_score_after"),
            "distill.student_params": d["student_params"],
            "distill.teacher_params": d["teacher_params"],
            "pipeline.recovered_gain": summary["pipeline"].get("recovered_gain"),
        }
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
