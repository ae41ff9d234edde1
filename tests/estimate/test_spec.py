"""The planner's inputs (`Spec`), its command line built from them, and the phase registry: a new planner input is
one field, a new stage its models and its phases."""

import dataclasses
import json

import pytest

from fastrlhf import estimate as est
from fastrlhf.estimate import phases
from fastrlhf.estimate.spec import Spec
from fastrlhf.train.config import help_text


def test_every_spec_field_is_a_command_line_key_with_its_help(capsys):
    text = help_text(Spec)
    for f in dataclasses.fields(Spec):
        assert f"--{f.name} (" in text, f.name
    assert "dollars per gpu-hour" in " ".join(text.split()).lower()


@pytest.mark.parametrize("argv,field,expected", [
    (["--zero", "actor=3,critic=2,all=0"], "zero", {"actor": 3, "critic": 2, "all": 0}),
    (["--zero", "3"], "zero", 3),
    (["--lora-targets", "q,v"], "lora_targets", ("q", "v")),
    (["--params", "7.5B"], "params", "7.5B"),
    (["--mean_gen_len", "400", "--gen-len", "512"], "mean_gen_len", 400),
    (["--micro-rollout-batch", "none"], "micro_rollout_batch", None),
    (["--flash-attention", "false"], "flash_attention", False),
    (["--qlora", "--lora-rank", "8"], "qlora", True),
    (["--pools", "gen=2,actor=2", "--placement", "disaggregated", "--gen-engine", "vllm"], "pools",
     {"gen": 2, "actor": 2}),
    (["--request-rate", "2.5"], "request_rate", 2.5),
])
def test_command_line_values_become_spec_values(argv, field, expected):
    assert getattr(est.spec_from_argv(argv), field) == expected


def test_a_yaml_file_of_keys(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model: llama-3-8b\ngpus: 8\nzero: 3\ngpu: h100\n")
    spec = est.spec_from_argv(["--config", str(path), "--gpus", "16"])
    assert (spec.model, spec.gpus, spec.zero, spec.gpu) == ("llama-3-8b", 16, 3, "h100")  # the command line wins
    assert est.main(["--config", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["gpus"] == 8


def test_unknown_and_bad_keys_are_clear_errors(capsys):
    assert est.main(["--rollout-bach", "64"]) == 2
    assert "rollout_batch" in capsys.readouterr().err  # the closest key is named
    assert est.main(["--gpus", "two"]) == 2
    assert "gpus" in capsys.readouterr().err
    assert est.main(["--zero", "actor=x"]) == 2
    assert "zero" in capsys.readouterr().err


def test_the_registry_holds_one_function_per_phase():
    assert tuple(phases.STAGE_PHASES["ppo"]) == est.PPO_PHASES
    assert tuple(phases.STAGE_PHASES["dpo"]) == ("logprobs", "update")
    assert phases.STAGE_PHASES["grpo"]["rollout"] is phases.STAGE_PHASES["ppo"]["rollout"]
    with pytest.raises(ValueError, match="registered twice"):
        phases.register_phase("ppo", "rollout")(lambda ctx: None)
    with pytest.raises(ValueError, match="registered twice"):
        phases.register_models("ppo")(lambda spec, arch, other: [])


def test_a_new_stage_is_its_models_and_its_phases(monkeypatch):
    """A distillation-like stage: a trained student and a frozen teacher, a teacher forward then a student update,
    registered from outside the planner, estimated with everything else it offers (memory, fit, ranges)."""
    monkeypatch.setitem(phases.STAGE_PHASES, "toy", {})
    monkeypatch.setattr(phases, "STAGE_MODELS", dict(phases.STAGE_MODELS))
    monkeypatch.setattr("fastrlhf.estimate.plan.STAGE_MODELS", phases.STAGE_MODELS)

    @phases.register_models("toy")
    def _models(spec, arch, other):
        return [phases.Role("actor", arch, True, True, "actor"), phases.Role("reference", arch, False, True, "actor")]

    @phases.register_phase("toy", "teacher")
    def _teacher(ctx):
        return phases.STAGE_PHASES["ppo"]["logprobs"](ctx)

    @phases.register_phase("toy", "update")
    def _update(ctx):
        return phases.STAGE_PHASES["ppo"]["update"](ctx)

    from fastrlhf.estimate.plan import run_stage
    from fastrlhf.estimate.spec import resolved

    result = run_stage(resolved(Spec(model="qwen2.5-0.5b", gpu="h100")), "toy")
    assert list(result.phases) == ["teacher", "update"] and result.fits
    assert {m.name for m in result.models} == {"actor", "reference"}
    assert result.phases["update"].seconds > 0
