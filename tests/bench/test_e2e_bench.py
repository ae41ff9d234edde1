"""bench/e2e.py: fastrlhf beside TRL's GRPOTrainer and TRL 1.12's PPOTrainer doing the same work.

The quick run (`bench/e2e.py --device cpu --quick`) runs both trainers in every part at a small size
(at CI's cost: TRL's GRPO as shipped and matched, TRL 1.12's PPO matched, GRPO's learning) and writes
the record; the other tests check the pieces it is made of: models whose
EOS and pad cannot be sampled, and the summaries the record is built from.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import e2e_model  # noqa: E402

pytestmark = pytest.mark.slow  # runs fastrlhf and TRL side by side at a reduced size


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


e2e = _load("e2e")


def _small_tied_qwen2(vocab_size: int):
    """qwen2-0.5b's layout (tied embeddings, grouped KV heads) at a CPU test's size."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


@pytest.mark.parametrize("name", ["tiny", "tied"])
def test_eos_and_pad_are_never_sampled(tmp_path, monkeypatch, name):
    """The timing models' EOS and pad logits are so low that sampling never draws them (in float32
    and bfloat16), while the other tokens keep a spread-out distribution; with tied embeddings
    (the GPU's qwen2-0.5b) too, where the lm_head rows are the input embeddings."""
    from transformers import AutoModelForCausalLM

    if name == "tied":
        monkeypatch.setitem(e2e_model.MODELS, name, _small_tied_qwen2)
    info = e2e_model.write_model(name, tmp_path / name)
    tokenizer = e2e_model.task.build_char_tokenizer()
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / name)
    assert info["tied_embeddings"] == (name == "tied") == (lm.lm_head.weight is lm.model.embed_tokens.weight)
    ids = torch.randint(4, len(tokenizer), (16, 7))
    unreachable = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logp = lm(ids).logits.float().log_softmax(-1)
        assert logp[..., unreachable].max() < -1000  # exp() of it is 0 in float32
        others = logp[..., 4:]
        assert others.max() < -1.0 and torch.isfinite(others).all()  # no token takes the mass
    out = lm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=24,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == 7 + 24 and not torch.isin(out[:, 7:], torch.tensor(unreachable)).any()
    assert info["eos_unreachable"] and info["vocab_size"] == lm.config.vocab_size


def test_summaries():
    """Medians over the timed iterations of every repetition; ratios fastrlhf / TRL; the first
    iteration at the target true score and the seconds until its end."""
    def run(seconds, tokens=64, cpu=0.8):
        its = [{"seconds": s, "rollout": s / 2, "reward": 0.0, "logprobs": s / 4, "update": s / 4, "other": 0.0,
                "tokens": tokens, **({"cpu_seconds": cpu * s} if cpu else {})} for s in seconds]
        return {"iterations": its, "startup_s": 3.0, "peak_memory_bytes": 100}

    ours = e2e.summarize([run([9.0, 1.0, 2.0]), run([9.0, 3.0, 5.0])], warmup=1)
    assert ours["seconds_per_iteration"] == 2.5 and ours["iterations_timed"] == 4
    assert ours["phases_s"]["rollout"] == 1.25 and ours["seconds_per_iteration_each_repetition"] == [1.5, 4.0]
    theirs = e2e.summarize([run([1.0, 5.0]), {"error": "exit 1"}], warmup=1)
    assert theirs["seconds_per_iteration"] == 5.0 and len(theirs["failed"]) == 1
    r = e2e.ratios({"fastrlhf": ours, "trl_matched": theirs})["fastrlhf / trl_matched"]
    assert r["iteration"] == 0.5 and r["rollout"] == 0.5 and r["peak_memory"] == 1.0
    assert ours["cpu_seconds_per_iteration"] == 2.0 and r["iteration_cpu"] == 0.5
    older = e2e.summarize([run([1.0, 5.0], cpu=None)], warmup=1)  # a result from before cpu_seconds
    assert older["cpu_seconds_per_iteration"] is None
    assert "iteration_cpu" not in e2e.ratios({"fastrlhf": ours, "trl_matched": older})["fastrlhf / trl_matched"]
    assert ours["graphs_compiled_while_timed"] is None  # nothing compiled (TRL, or fastrlhf on CPU)

    def compiled(graphs):  # graphs so far after each iteration
        r = run([9.0, 1.0, 2.0])
        for it, g in zip(r["iterations"], graphs):
            it["compiled_graphs"] = g
        return r

    assert e2e.summarize([compiled([4, 4, 8]), compiled([4, 4, 4])], warmup=1)["graphs_compiled_while_timed"] == 4
    assert e2e.compiled_while_timed([compiled([4, 4, 8])], warmup=0) == 8

    learned = e2e.to_target({"iterations": [{"seconds": 1.0, "true_score": s} for s in (0.5, 0.92, 0.88, 0.95)],
                             "startup_s": 2.0})
    assert learned["iterations"] == 2 and learned["seconds"] == 2.0
    assert e2e.to_target({"iterations": [{"seconds": 1.0, "true_score": 0.5}]})["iterations"] is None
    assert e2e.rotated(["a", "b", "c"], 1) == ["b", "c", "a"]


def test_readme_block(tmp_path):
    """`--readme` rewrites the README's block from the newest finished full record per device, and
    only that block; a quick record, an unfinished one or an older one is passed over."""
    def record(date, finished=True, quick=False, seconds=1.0):
        trainer = {"seconds_per_iteration": seconds, "phases_s": dict.fromkeys(e2e.PHASES, seconds / 5),
                   "tokens_per_s": 64 / seconds, "peak_memory_bytes": 2**30, "startup_s": 9.0}
        section = {"algo": "grpo", "model": {"name": "tiny", "parameters": 867712, "vocab_size": 57},
                   "trainers": {"fastrlhf": trainer, "trl_matched": dict(trainer, seconds_per_iteration=2.0)},
                   "ratios": {"fastrlhf / trl_matched": {"iteration": seconds / 2.0}}}
        return {"schema": e2e.SCHEMA, "date": date, "device": "cpu", "device_name": "CPU: x", "commit": "abcdef1234",
                "command": "python bench/e2e.py", "finished": finished, "quick": quick, "timing": [section],
                "learning": {"sections": []}, "goals": []}

    results = tmp_path / "results"
    results.mkdir()
    for name, rec in {"a": record("2026-01-01T00:00:00", seconds=1.5), "b": record("2026-02-01T00:00:00"),
                      "c": record("2026-03-01T00:00:00", finished=False), "d": record("2026-04-01T00:00:00", quick=True)
                      }.items():
        (results / f"{name}-cpu-e2e.json").write_text(json.dumps(rec))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{e2e.README_START}\nold\n{e2e.README_END}\noutro\n")
    e2e.update_readme(readme, results)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{e2e.README_END}\noutro\n") and "old" not in text
    assert "| grpo | tiny (0.9M, V=57) | trl_matched | 2 |" in text and "from b-cpu-e2e.json" in text
    assert text.count("| grpo |") == 2


def test_bad_arguments(tmp_path, capsys):
    """Each refused before any run starts: exit 2 and the reason (in this process: argparse exits the same way
    from the command line)."""
    for args, says in ((["--only", "grpo,nope"], "unknown part"),
                       (["--only", "ppo", "--trl-ppo-wheel", str(tmp_path / "missing.whl")], "wheel is not at"),
                       (["--only", "grpo", "--resume"], "--resume needs --work")):
        with pytest.raises(SystemExit) as exit_:
            e2e.main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and says in err, (args, err[-500:])


def test_resume_reuses_only_a_finished_run_of_the_same_spec(tmp_path):
    """--resume reads back a run only when its spec file holds exactly the spec asked for (its result
    path and spawn time aside) and its result holds iterations; and it continues only an unfinished record."""
    spec = {"trainer": "trl", "algo": "ppo", "seed": 2, "iterations": 3}
    spec_path, result = tmp_path / "spec.json", tmp_path / "result.json"
    assert e2e.finished_run(spec_path, result, spec) is None  # nothing there
    spec_path.write_text(json.dumps(dict(spec, result=str(result), spawn_time=123.0)))
    assert e2e.finished_run(spec_path, result, spec) is None  # the run left no result
    result.write_text(json.dumps({"iterations": [{"seconds": 1.5}], "startup_s": 9.0}))
    assert e2e.finished_run(spec_path, result, spec) == {"iterations": [{"seconds": 1.5}], "startup_s": 9.0,
                                                         "spec": spec}
    assert e2e.finished_run(spec_path, result, dict(spec, seed=3)) is None  # another run's work
    result.write_text(json.dumps({"error": "exit 1"}))
    assert e2e.finished_run(spec_path, result, spec) is None

    record = tmp_path / "record.json"
    record.write_text(json.dumps({"schema": e2e.SCHEMA, "finished": False, "date": "2026-11-27T07:09:26",
                                  "commit": "f33af71", "command": "python bench/e2e.py --device cpu",
                                  "uptime": {"start": "07:09:26 up 1:32, 0 user, load average: 11.56, 11.01, 9.96"}}))
    earlier = e2e.resumed_from(record)
    assert earlier["commit"] == "f33af71" and earlier["reused_runs"] == []
    assert e2e.start_load(earlier["uptime_start"]) == 11.56 and e2e.start_load(None) is None
    record.write_text(json.dumps({"schema": e2e.SCHEMA, "finished": True}))
    with pytest.raises(SystemExit, match="not an unfinished"):
        e2e.resumed_from(record)


def test_quick_record(tmp_path):
    """`bench/e2e.py --device cpu --quick` runs fastrlhf and both TRL configurations for GRPO (TRL 1.16),
    TRL 1.12's PPO (from its wheel) matched, and GRPO's learning from an SFT checkpoint, and writes the record:
    every trainer did the same work (exactly prompts x generations x R response tokens per
    iteration), its phases add up to its iteration, and the settings are the ones named."""
    pytest.importorskip("trl", reason="TRL is not installed (.ci/install_peers.sh installs it)")
    if not e2e.TRL_PPO_WHEEL.is_file():
        pytest.skip(f"TRL {e2e.TRL_PPO_VERSION}'s wheel is not at {e2e.TRL_PPO_WHEEL} (.ci/install_peers.sh)")
    out = tmp_path / "record.json"
    env = {k: v for k, v in os.environ.items() if k not in ("FASTRLHF_BACKEND", "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--device", "cpu", "--quick", "--out",
                           str(out), "--work", str(tmp_path / "work")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["finished"] and record["quick"] and record["parts"] == ["grpo", "ppo", "learning"]
    assert record["load_average"]["samples"] >= 1 and record["commit"]

    assert [(s["algo"], s["model"]["name"]) for s in record["timing"]] == [("grpo", "tiny"), ("ppo", "tiny")]
    for section in record["timing"]:
        work = section["work"]
        per_iteration = work["prompts"] * work["generations"] * work["response_len"]
        quick = e2e.PLANS["quick"]  # at CI's cost: PPO's TRL as shipped (its own critic) is left to the full record
        assert set(section["trainers"]) == set(e2e.CONFIGS if section["algo"] == "grpo" else quick.ppo_configs)
        for name, t in section["trainers"].items():
            assert not t["failed"], (name, t["failed"])
            assert t["seconds_per_iteration"] > 0 and t["startup_s"] > 0 and t["peak_memory_bytes"] > 0
            assert t["tokens_per_s"] == pytest.approx(per_iteration / t["seconds_per_iteration"])
            raw = json.loads((tmp_path / "work" / "results" / f"{section['algo']}-tiny-{name}-rep0.json").read_text())
            for it in raw["iterations"]:
                assert it["tokens"] == per_iteration, (name, it)  # EOS unreachable: every response is R tokens
                assert 0 < it["cpu_seconds"] <= 1.5 * it["seconds"] + 0.5, (name, it)  # one thread (+ stragglers)
                assert sum(it[p] for p in e2e.PHASES) == pytest.approx(it["seconds"])
                assert min(it[p] for p in e2e.PHASES if p != "other") >= 0 and it["rollout"] > 0 and it["update"] > 0
            assert t["command"]
        trl = section["trainers"]["trl_matched"]
        assert trl["versions"]["trl"] == ("1.16.0" if section["algo"] == "grpo" else e2e.TRL_PPO_VERSION)
        if "trl_shipped" in section["trainers"]:
            shipped = section["trainers"]["trl_shipped"]["settings"]
            assert shipped["gradient_checkpointing"] is True and shipped["bf16"] is True
        matched = trl["settings"]
        assert matched["gradient_checkpointing"] is False and matched["bf16"] is False
        assert "adamw_torch" in matched["optim"].lower() and "fused" not in matched["optim"].lower()
        ours = section["trainers"]["fastrlhf"]
        assert ours["command"].startswith("fastrlhf ppo ") and "--rollout_sampler=inverse_cdf" in ours["command"]
        assert ours["settings"]["rollout_sampler"] == "inverse_cdf"  # on CPU: torch.multinomial's draw, cheaper
        # on CPU: fastrlhf's own decode step, whose fp32 log-probs (and values) are the old ones
        assert ours["settings"]["rollout_engine"] == "graph" and ours["settings"]["old_logprobs"] == "sampler"
        assert ours["settings"]["compile"] == "auto"  # quick: nothing compiled (the plan compiles llama-10m*)
        assert set(section["ratios"]) == {f"fastrlhf / {name}" for name in section["trainers"] if name != "fastrlhf"}
        for name, r in section["ratios"].items():
            theirs = section["trainers"][name.split(" / ")[1]]
            ours_cpu = section["trainers"]["fastrlhf"]["cpu_seconds_per_iteration"]
            assert r["iteration_cpu"] == round(ours_cpu / theirs["cpu_seconds_per_iteration"], 3)

    sections = record["learning"]["sections"]
    assert [s["algo"] for s in sections] == ["grpo"]  # quick: PPO's learning is left to the full record
    for section in sections:
        assert set(section["trainers"]) == {"fastrlhf", "trl_matched"}
        for t in section["trainers"].values():
            curve = t["seeds"]["0"]["true_score_per_iteration"]
            assert len(curve) == section["budget_iterations"] and all(0.0 <= s <= 1.0 for s in curve)
    table = e2e.readme_table([record])
    assert "| grpo | tiny" in table and "trl_matched" in table and "| learning |" in table
