"""`fastrlhf estimate --stage distill` (a trained student, the frozen teacher: the teacher's forward, the student's
update, on-policy the student's rollout) and `--stage serve --student` (the teacher's and the student's serving cost
side by side), against the trainer's own bytes where it can be run."""

import json

import pytest

from fastrlhf import estimate as est
from fastrlhf.constants import CHUNK_BUDGET_BYTES
from fastrlhf.estimate import phases, plan
from fastrlhf.estimate import work as W
from fastrlhf.estimate.memory import kv_cache_bytes, logit_bytes
from fastrlhf.estimate.spec import Spec, resolved, student_arch

BASE = dict(stage="distill", model="llama-3.1-8b", student="1B", gpu="h100", gpus=8, zero=3, seq_len=256,
            gen_len=256, rollout_batch=64, micro_batch=4)


def _plan(**kw):
    return est.make_plan(**{**BASE, **kw}).stages["distill"]


def test_the_student_trains_and_the_teacher_is_frozen_in_fp32():
    """fsdp2 (the trainer): the student's 16 bytes per parameter sharded over the GPUs, the teacher's weights as
    `fastrlhf distill` loads them (fp32, like the student), no gradient or optimizer state for the teacher."""
    r = _plan(zero=3, gpus=8)
    by = {m.name: m for m in r.models}
    student, teacher = by["student"], by["teacher"]
    spec = resolved(Spec(**BASE))
    assert student.arch.params() == student_arch(spec).params() == pytest.approx(1e9, rel=1e-6)
    assert student.trainable and not teacher.trainable and teacher.arch.params() == est.PRESETS["llama-3.1-8b"].params()
    p = student.arch.params()
    assert (student.weights, student.gradients, student.optimizer) == (4 * p / 8, 4 * p / 8, 8 * p / 8)
    assert teacher.weights == 4 * teacher.arch.params() / 8 and teacher.gradients == teacher.optimizer == 0
    lora = {m.name: m for m in _plan(lora_rank=16).models}["student"]
    assert 0 < lora.trainable_params < 0.05 * p  # LoRA: the student's adapters train, its base is frozen


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_planner_predicts_the_trainers_state_bytes(tmp_path, capsys, lora_rank):
    """The distillation stage's parameters, gradients and AdamW states on one CPU process (its summary's
    state_bytes: student and teacher under one root) equal the planner's student + teacher, to the byte."""
    from fastrlhf.train.config import DistillConfig
    from fastrlhf.train.recipes import distill

    cfg = DistillConfig(model="tiny-student", teacher="tiny", out=str(tmp_path), steps=1, batch_size=2,
                        num_examples=8, eval_prompts=2, device="cpu", lora_rank=lora_rank)
    measured = distill.train(cfg)["state_bytes"]
    assert est.main(["--stage", "distill", "--model", "tiny", "--student", "tiny-student", "--gpu", "cpu",
                     "--lora-rank", str(lora_rank), "--json"]) == 0
    models = json.loads(capsys.readouterr().out)["stages"]["distill"]["models"]
    student, teacher = models["student"], models["teacher"]
    assert student["weights"] + teacher["weights"] == measured["params"]
    assert student["gradients"] == measured["grads"] and student["optimizer"] == measured["optimizer"]


def test_offline_is_the_teachers_forward_then_the_students_update():
    r = _plan()
    assert list(r.phases) == ["teacher", "update"]
    spec = resolved(Spec(**BASE))
    teacher, student = est.PRESETS["llama-3.1-8b"], student_arch(spec)
    n, seq = spec.rollout_batch, spec.seq_len + spec.gen_len
    # the teacher: a forward over every token, its lm_head on the response tokens (inside the fused loss)
    assert r.phases["teacher"].flops == pytest.approx(W.forward_flops(teacher, n * seq, seq / 2,
                                                                      head_tokens=n * spec.gen_len))
    # the student: forward + backward (3 passes; 2 with LoRA), its lm_head on the response tokens
    student_fwd = W.forward_flops(student, n * seq, seq / 2, head_tokens=n * spec.gen_len)
    assert r.phases["update"].flops == pytest.approx(3 * student_fwd)
    assert _plan(lora_rank=16).phases["update"].flops == pytest.approx(2 * student_fwd)
    assert r.phases["update"].optimizer_steps == 1
    smaller = _plan(student="0.5B")
    assert smaller.phases["update"].seconds < r.phases["update"].seconds
    assert smaller.phases["teacher"].flops == r.phases["teacher"].flops


def test_on_policy_samples_from_the_student_as_a_ppo_actor_of_its_shape():
    """--on-policy adds the rollout phase: the student's hf generate, its KV cache, its gathered weights; the same
    phase PPO's rollout is for an actor of the student's shape."""
    r = _plan(on_policy=True)
    assert list(r.phases) == ["rollout", "teacher", "update"]
    spec = resolved(Spec(**BASE))
    student = student_arch(spec)
    rollout = r.phases["rollout"]
    share = spec.rollout_batch / spec.gpus
    length = spec.seq_len + spec.gen_len
    assert rollout.peak_memory().kv_cache == kv_cache_bytes(student, sequences=share, length=length, dtype="bf16")
    as_ppo = est.make_plan(**{**BASE, "stage": "ppo", "model": student, "student": None, "reward": "rule"})
    assert rollout.seconds == pytest.approx(as_ppo.stages["ppo"].phases["rollout"].seconds)
    assert r.phases["teacher"].seconds == _plan().phases["teacher"].seconds


@pytest.mark.parametrize("mode", ["linear", "materialised"])
def test_the_update_holds_the_students_logits_and_one_chunk_of_the_teachers(mode):
    """linear (ops.linear_distill_loss): one chunk of each model's logits, the student's with its d(lm_head)
    accumulator; materialised: both models' [N, V]. Beside them, the teacher's final hidden states."""
    r = _plan(logits=mode)
    spec = resolved(Spec(**BASE))
    teacher, student = est.PRESETS["llama-3.1-8b"], student_arch(spec)
    head_tokens = spec.micro_batch * (spec.gen_len if mode == "linear" else spec.seq_len + spec.gen_len)
    tokens = spec.micro_batch * (spec.seq_len + spec.gen_len)
    expected = (logit_bytes(student, tokens=tokens, dtype="bf16", mode=mode, backward=True)
                + logit_bytes(teacher, tokens=head_tokens, dtype="bf16", mode=mode, backward=False))
    assert r.phases["update"].peak_memory().logits == pytest.approx(expected)
    teacher_part = expected - logit_bytes(student, tokens=tokens, dtype="bf16", mode=mode, backward=True)
    if mode == "linear":  # one chunk, at most the op's budget, whatever the batch
        assert teacher_part == min(CHUNK_BUDGET_BYTES, head_tokens * teacher.vocab * 8)
    else:  # the teacher's [N, V] in bf16, an fp32 copy and its log-softmax
        assert teacher_part == head_tokens * teacher.vocab * (2 + 4 + 4)


def test_a_teacher_that_does_not_fit_gets_advice(capsys):
    r = est.estimate(**{**BASE, "model": "llama-3.1-70b", "student": "8B", "gpus": 1, "zero": 0})["stages"]["distill"]
    assert not r["fits"] and r["advice"]["single"]
    assert est.main(["--stage", "distill", "--model", "llama-3.1-8b", "--student", "1B", "--gpu", "h100", "--gpus",
                     "8", "--zero", "3", "--on-policy"]) == 0
    out = capsys.readouterr().out
    assert "teacher meta-llama/Llama-3.1-8B" in out and "-> student" in out and "(on-policy)" in out
    for phase in ("rollout", "teacher", "update"):
        assert f"  {phase}" in out
    assert "states per GPU, GB: student" in out and "; teacher" in out


@pytest.mark.parametrize("kw,match", [
    (dict(student=None), "student: --stage distill needs --student"),
    (dict(model="qwen2.5-7b", student="qwen2.5-0.5b"), "student: .* vocabulary of 151936 .* 152064"),
    (dict(placement="disaggregated", pools="gen=2,actor=2", gen_engine="vllm"), "placement: .* colocated only"),
    (dict(on_policy=True, gen_engine="vllm"), "gen_engine: fastrlhf distill samples with hf generate"),
    (dict(stage="ppo", on_policy=True), "on_policy: a --stage distill option"),
    (dict(stage="sft"), "student: --stage distill or serve only"),
    (dict(student="three"), "student: expected actor, a parameter count"),
])
def test_bad_distill_input_is_a_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        est.estimate(**{**BASE, **kw})


def test_serve_shows_the_teacher_and_the_student_side_by_side(capsys):
    """--stage serve --student: the teacher's serving as without it, the student's as serving a model of its shape,
    and a table of the two with the student / teacher ratios."""
    serve = dict(stage="serve", model="llama-3.1-8b", gpu="h100", seq_len=1024, gen_len=256, request_rate=20,
                 price=2.5)
    both = est.estimate(**serve, student="1B")["stages"]
    assert set(both) == {"serve", plan.SERVE_STUDENT}
    assert both["serve"] == est.estimate(**serve)["stages"]["serve"]
    student = both[plan.SERVE_STUDENT]
    arch = student_arch(resolved(Spec(**serve, student="1B")))
    assert student == est.estimate(**{**serve, "model": arch})["stages"]["serve"]
    assert student["memory_per_gpu_bytes"]["weights"] == int(arch.params() * 2)
    assert student["tpot_s"] < both["serve"]["tpot_s"] and student["gpus"] <= both["serve"]["gpus"]
    assert student["usd_per_1m_output_tokens"] < both["serve"]["usd_per_1m_output_tokens"]
    assert est.main(["--stage", "serve", "--model", "llama-3.1-8b", "--student", "1B", "--gpu", "h100",
                     "--request-rate", "20", "--price", "2.5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("teacher: meta-llama/Llama-3.1-8B") and "\nstudent: " in out
    assert "student / teacher" in out and "GPUs for 20.0 requests/s" in out and "$ per 1M output tokens" in out
    assert est.main(["--stage", "serve", "--model", "llama-3.1-8b", "--student", "1B", "--json"]) == 0
    assert plan.SERVE_STUDENT in json.loads(capsys.readouterr().out)["stages"]


def test_the_registry_has_the_distill_stage():
    assert tuple(phases.STAGE_PHASES["distill"]) == ("rollout", "teacher", "update")
    spec = est.spec_from_argv(["--stage", "distill", "--student", "1B", "--on-policy"])
    assert (spec.stage, spec.student, spec.on_policy) == ("distill", "1B", True)
