"""Scale-out on 2 CPU processes (torchrun, gloo): the same training on 1 and 2 ranks, global
whitening and loss normalisation, sharding that saves what it claims, a killed run that
resumes to the same metrics, and bad setups that fail fast.

Process launches (every rank imports torch and transformers) are what costs here, so the
module shares them: one 2-rank PPO-update worker (tests/dist_worker.py), one uninterrupted
2-rank pipeline, and one 2-rank pipeline killed after a checkpoint and resumed. The
single-process references run inside this process.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import dist_worker
import pytest
import torch
from helpers import assert_close_to_ref, metric_rows

from fastrlhf.train import checkpoint, distributed
from fastrlhf.train.config import PPOConfig, SFTConfig
from fastrlhf.train.recipes import dpo, ppo, sft

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("keep_threads_and_warnings")]  # runs whole stages


ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ["--sft.steps", "10", "--sft.batch_size", "8", "--sft.log_every", "1", "--sft.save_every", "5",
            "--sft.num_examples", "200",
            "--rm.steps", "4", "--rm.batch_size", "8", "--rm.num_pairs", "80", "--rm.eval_every", "4",
            "--ppo.steps", "4", "--ppo.rollout_batch_size", "8", "--ppo.mini_batch_size", "4",
            "--ppo.micro_batch_size", "2", "--ppo.eval_prompts", "8", "--ppo.max_new_tokens", "5",
            "--ppo.save_every", "1", "--ppo.lora_rank", "4"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in distributed.LAUNCH_ENV}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = ""  # 2 CPU ranks (gloo), on a GPU machine too: one GPU cannot hold two ranks
    return env


def _torchrun_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


def _torchrun(*args, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(_torchrun_cmd(*args), cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


# ---------------------------------------------------------------- one PPO update, 1 vs 2 ranks


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("worker") / "two_ranks.pt"
    r = _torchrun("tests/dist_worker.py", str(out))
    assert r.returncode == 0, r.stderr[-4000:]
    result = torch.load(out, weights_only=False)
    assert result["world_size"] == 2
    return result


@pytest.fixture(scope="module")
def one_rank():
    n = torch.get_num_threads()
    dtypes = (torch.float64, torch.float32)
    runs = {f"{case}/{str(dtype)[6:]}": dist_worker.one_update(case, dtype, torch.device("cpu"))
            for case in dist_worker.CASES for dtype in dtypes}
    runs.update(dist_worker.packed_runs(torch.device("cpu"), dtypes))
    torch.set_num_threads(n)
    return runs


def _worst(a: dict, b: dict) -> tuple[float, str]:
    """The largest absolute difference between two gradient dicts, and where."""
    return max(((a[k].double() - b[k].double()).abs().max().item(), k) for k in a)


@pytest.mark.parametrize("case", list(dist_worker.CASES))
def test_ppo_update_gives_the_same_gradients_on_1_and_2_ranks(case, one_rank, two_ranks):
    """DESIGN.md's rule: the error of the 2-rank float32 gradients against the float64 run is
    at most 2x that of the 1-rank float32 run, + atol, + the float32 result's last bit
    (`assert_close_to_ref`)."""
    ref, one, two = one_rank[f"{case}/float64"], one_rank[f"{case}/float32"], two_ranks["runs"][f"{case}/float32"]
    assert set(two["grads"]) == set(ref["grads"]) and len(ref["grads"]) > 0
    for name in ref["grads"]:
        assert_close_to_ref(two["grads"][name], ref["grads"][name], one["grads"][name], atol=1e-6,
                            name=f"{case} {name}, 2 ranks")
    worst, where = _worst(two["grads"], one["grads"])
    scale = max(g.abs().max().item() for g in one["grads"].values())
    assert worst <= 1e-5 * scale, f"{case}: worst |2 ranks - 1 rank| {worst:.3g} at {where}"
    for k, v in one["stats"].items():
        assert two["stats"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k


def _assert_run_close_to_ref(run: dict, ref: dict, baseline: dict, label: str) -> None:
    """Every gradient and update stat of `run` (float32) within `assert_close_to_ref` of the float64 `ref`,
    against the float32 `baseline`'s own error; `label` % the tensor's name names a failure."""
    assert set(run["grads"]) == set(ref["grads"]) and len(ref["grads"]) > 0
    for name in ref["grads"]:
        assert_close_to_ref(run["grads"][name], ref["grads"][name], baseline["grads"][name], atol=1e-6,
                            name=label % name)
    for k in ("pg_loss", "clipfrac", "approx_kl", "entropy", "grad_norm"):
        stat = (torch.tensor(r["stats"][k], dtype=torch.float64) for r in (run, ref, baseline))
        assert_close_to_ref(*stat, atol=1e-6, name=label % k)


@pytest.mark.parametrize("agg", dist_worker.AGGS)
@pytest.mark.parametrize("case", dist_worker.PACKED)
def test_packed_micro_batches_give_the_padded_gradients_on_1_and_2_ranks(case, agg, one_rank, two_ranks):
    """Packed micro-batches (sequences end to end, position_ids restarting, no padding) against the
    padded ones, token-mean and seq-mean-token-mean: the error of the packed float32 gradients and stats
    against the padded float64 run is at most 2x that of the padded float32 run, + atol, + the float32
    result's own last bit (docs/ops.md, `assert_close_to_ref`), on one rank and on two (where the ranks'
    shares pack into different numbers of micro-batches). grad_norm is ~35, where one float32 ulp is
    3.8e-6: without the last-bit term the bound (2 x a padded error of half an ulp + 1e-6) sat between
    one and two ulps, and on an AMD EPYC the packed norm, one ulp further off, failed it."""
    ref, padded = one_rank[f"{case}/{agg}/padded/float64"], one_rank[f"{case}/{agg}/padded/float32"]
    for where, packed in (("1 rank", one_rank[f"{case}/{agg}/packed/float32"]),
                          ("2 ranks", two_ranks["runs"][f"{case}/{agg}/packed/float32"])):
        _assert_run_close_to_ref(packed, ref, padded, f"{where} %s, packed")
    # the two aggregations are different losses (the check above is not comparing one loss twice)
    other = one_rank[f"{case}/{[a for a in dist_worker.AGGS if a != agg][0]}/padded/float64"]
    assert abs(other["stats"]["pg_loss"] - ref["stats"]["pg_loss"]) > 1e-4


@pytest.mark.parametrize("tokens", [0, dist_worker.BUDGET])
def test_shared_prompt_packs_give_the_unshared_gradients_on_1_and_2_ranks(tokens, one_rank, two_ranks):
    """--shared_prompt on (each group's prompt forwarded once; micro-batches of rows' worth of groups, or
    packs of BUDGET tokens) against off, on groups sharing their prompt: the error of the shared float32
    gradients and stats against the unshared float64 run is at most 2x the unshared float32 run's, + atol,
    + the float32 result's last bit, on one rank and on two (each rank its own groups)."""
    case = dist_worker.SHARED
    ref, unshared = one_rank[f"{case}/shared_off/float64"], one_rank[f"{case}/shared_off/float32"]
    for where, shared in (("1 rank", one_rank[f"{case}/shared_on/{tokens}/float32"]),
                          ("2 ranks", two_ranks["runs"][f"{case}/shared_on/{tokens}/float32"])):
        _assert_run_close_to_ref(shared, ref, unshared, f"{where} %s, shared prompt")


def test_whitening_and_loss_normalisation_are_global(one_rank, two_ranks):
    """The two shares differ: whitening a share with its own moments gives other advantages
    (GAE, REINFORCE++), and the shares hold different token counts (per-rank token means would
    weight them differently), so the equal gradients above come from global moments and
    counts. GRPO's groups stay whole on one rank: its advantages need nothing global."""
    for case, (_, _, _, advantage) in dist_worker.CASES.items():
        ranks = two_ranks["runs"][f"{case}/float32"]["per_rank"]
        (single,) = one_rank[f"{case}/float32"]["per_rank"]
        assert ranks[0]["tokens"] != ranks[1]["tokens"]
        assert ranks[0]["tokens"] + ranks[1]["tokens"] == single["tokens"]
        if advantage == "grpo":
            assert max(r["whiten_local_vs_global"] for r in ranks) == 0.0
        else:
            assert min(r["whiten_local_vs_global"] for r in ranks) > 0.05, case
        assert single["whiten_local_vs_global"] == 0.0
    # on one process the global whitening is ops.whiten itself
    x, mask = torch.randn(4, 7), (torch.rand(4, 7) > 0.3).float()
    from fastrlhf import ops

    assert torch.equal(ppo.whitened(x, mask), ops.whiten(x, mask))


def test_generation_gathers_the_policy_and_not_the_frozen_reference(one_rank, two_ranks):
    """The rollout's generate runs with the policy's layers gathered once (`run(gathered=policy)`);
    the frozen reference copy of full fine-tuning stays sharded (it was gathered too: a second
    whole model in the rollout's peak memory)."""
    assert one_rank["full/float32"]["generation_gathers"] == {"policy": True, "reference": True}  # nothing sharded
    assert two_ranks["runs"]["full/float32"]["generation_gathers"] == {"policy": True, "reference": False}
    assert two_ranks["runs"]["lora_none/float32"]["generation_gathers"] == {"policy": True}


@pytest.mark.parametrize("case", list(dist_worker.CASES))
def test_decode_engine_on_each_rank_samples_the_gathered_policy(case, one_rank, two_ranks):
    """Under FSDP2 each rank's decode engine merges its rollout weights from the gathered policy
    (LoRA or full weights): its log-probs are the policy's within 1e-5 (fp32), as on one process."""
    assert one_rank[f"{case}/float32"]["per_rank"][0]["engine_vs_policy"] < 1e-5
    gaps = [r["engine_vs_policy"] for r in two_ranks["runs"][f"{case}/float32"]["per_rank"]]
    assert len(gaps) == 2 and max(gaps) < 1e-5, gaps


@pytest.mark.parametrize("case", list(dist_worker.CASES))
def test_sharding_saves_what_it_claims(case, one_rank, two_ranks):
    """--shard full: each rank holds half the bytes of parameters, gradients and optimizer
    states (within 5%, padding included); grad_op: half the gradients and optimizer states;
    none: everything replicated."""
    (single,) = one_rank[f"{case}/float32"]["per_rank"]
    shard = dist_worker.CASES[case][2]
    halved = {"full": ("params", "grads", "optimizer"), "grad_op": ("params", "grads", "optimizer"),
              "none": ()}[shard]  # grad_op keeps parameters sharded between steps too (FSDP2)
    for rank in two_ranks["runs"][f"{case}/float32"]["per_rank"]:
        for kind in ("params", "grads", "optimizer"):
            expected = single[kind] / 2 if kind in halved else single[kind]
            assert single[kind] > 0 and rank[kind] == pytest.approx(expected, rel=0.05), (kind, rank[kind], expected)


def test_dpo_loss_curve_is_the_same_on_1_and_2_ranks(two_ranks, tmp_path):
    """`fastrlhf dpo` (LoRA: the reference is the sharded policy with the adapter disabled):
    the same losses, margins and held-out accuracy; one consolidated final model."""
    cfg = dist_worker.dpo_config(tmp_path)
    dpo.train(cfg)
    one = [r for r in (json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines())
           if r["stage"] == "dpo"]
    two = [r for r in two_ranks["dpo"]["rows"] if r["stage"] == "dpo"]
    assert [r["step"] for r in two] == [1, 2, 3] and two_ranks["dpo"]["final"]
    for a, b in zip(one, two):
        for k in ("loss", "reward_margin"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (k, a, b)
    assert two[-1]["accuracy"] == one[-1]["accuracy"]


# ---------------------------------------------------------------- the CLI on 2 ranks


@pytest.fixture(scope="module")
def pipeline_2(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_2") / "run"
    r = _torchrun("-m", "fastrlhf", "pipeline", "--out", str(out), *PIPELINE)
    assert r.returncode == 0, r.stderr[-4000:]
    return out, r.stderr


def test_sft_loss_curve_is_the_same_on_1_and_2_ranks(pipeline_2, tmp_path):
    out, _ = pipeline_2
    sft.train(SFTConfig(out=str(tmp_path), steps=10, batch_size=8, log_every=1, save_every=5, num_examples=200,
                        device="cpu"))
    one, two = metric_rows(tmp_path, "sft", timing=False), metric_rows(out, "sft", timing=False)
    assert [r["step"] for r in two] == list(range(1, 11))
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)


def test_pipeline_on_2_ranks_writes_one_run(pipeline_2):
    out, stderr = pipeline_2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ppo"]["ranks"] == 2 and summary["ppo"]["shard"] == "full"
    for stage in ("sft", "rm", "ppo"):
        final = out / stage / "final"
        assert (final / "config.json").is_file() and (final / "model.safetensors").is_file(), stage
        assert set(summary[stage]["state_bytes"]) == {"params", "grads", "optimizer"}, stage
        assert summary[stage]["state_bytes_mean"]["params"] > 0, stage
        assert summary[stage]["state_bytes"]["grads"] > 0, stage  # PPO's: read before it frees them
    assert (out / "ppo" / "final" / "value_head.safetensors").is_file()
    assert summary["ppo"]["phase_seconds_mean"].keys() == summary["ppo"]["phase_seconds"].keys()
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    for phase in ppo.PPO_PHASES:  # per rank: max and mean
        assert row[f"time/{phase}"] >= row[f"time_mean/{phase}"] > 0, phase
        assert row[f"memory/{phase}"] >= row[f"memory_mean/{phase}"] > 0, phase
    ckpt = out / "ppo" / "checkpoints" / (out / "ppo" / "checkpoints" / "latest").read_text().strip()
    assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json",
                                                      "rank_00000.pt", "rank_00001.pt"]
    assert checkpoint.check_manifest(ckpt) is None  # every rank's files, hashed by the ranks in turn
    assert "[rank 1]" not in stderr and stderr.count("sft: done") == 1  # rank 0 alone speaks
    # the exported model loads as a plain Hugging Face model with the trained weights
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(out / "sft" / "final")
    assert sum(p.numel() for p in lm.parameters()) > 0


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_killed_2_rank_run_resumes_with_the_same_metrics(pipeline_2, tmp_path):
    """Both ranks are killed (SIGKILL) once a PPO checkpoint exists; --resume finishes the
    run, and every stage's metrics equal the uninterrupted run's. (To save a launch the run
    starts from a copy of the uninterrupted run's finished SFT and RM stages, its recorded
    configurations naming the new folder: `--resume` skips them and starts PPO afresh.)"""
    reference, _ = pipeline_2
    out = tmp_path / "run"
    shutil.copytree(reference, out, ignore=lambda folder, names: ["ppo"] if Path(folder) == reference else [])
    for recorded in out.rglob("*.json"):
        recorded.write_text(recorded.read_text().replace(str(reference), str(out)))
    latest = out / "ppo" / "checkpoints" / "latest"
    cmd = _torchrun_cmd("-m", "fastrlhf", "pipeline", "--out", str(out), *PIPELINE, "--resume")
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            while not latest.is_file() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert latest.is_file(), (tmp_path / "killed.log").read_text()[-3000:]
            for worker in _children(proc.pid):
                os.kill(worker, signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                for worker in _children(proc.pid):
                    os.kill(worker, signal.SIGKILL)
                proc.kill()
    assert proc.returncode != 0 and not (out / "ppo" / "final").exists()
    killed_at = int(latest.read_text().strip()[5:])
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"resumed from {out / 'ppo' / 'checkpoints'}" in r.stderr and f"(step {killed_at})" in r.stderr
    for stage in ("sft", "rm", "ppo"):
        assert metric_rows(out, stage, timing=False) == metric_rows(reference, stage, timing=False), stage


# ---------------------------------------------------------------- the end of a rank's process

EXIT_SCRIPT = """
import atexit, sys
from fastrlhf.train import distributed

class Teardown:  # a global's finalizer runs only when the interpreter is torn down
    def __del__(self, write=sys.__stderr__.write):
        write("torn down")

keep = Teardown()
atexit.register(print, "atexit ran")
print("buffered", end="")  # a pipe: block-buffered, written only by a flush
distributed.exit_process(3)
"""


@pytest.mark.parametrize("launched", [True, False])
def test_a_rank_exits_without_interpreter_teardown(launched):
    """Under torchrun `exit_process` runs the atexit handlers, flushes stdout and stderr and ends the
    process with its code before the interpreter is torn down (where a gloo worker that takes the GIL
    aborts the process); one process exits as usual."""
    env = {k: v for k, v in _env().items() if k != "WORLD_SIZE"}
    if launched:
        env["WORLD_SIZE"] = "2"  # what distributed.launched() reads; no process group is needed
    r = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 3, r.stderr[-2000:]
    assert r.stdout.startswith("buffered") and "atexit ran" in r.stdout, r.stdout
    assert ("torn down" in r.stderr) is not launched, r.stderr[-2000:]


# ---------------------------------------------------------------- bad setups fail fast


@pytest.fixture
def torchrun_env(monkeypatch):
    """What torchrun sets for rank 0 of 2 (no process group is made: the checks come first)."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(k, v)
    return monkeypatch


def test_a_global_batch_the_world_size_does_not_divide_is_refused(torchrun_env, tmp_path):
    with pytest.raises(ValueError, match=r"sft: batch_size=3 is a global batch size and must be divisible by the "
                                         r"number of ranks \(2\)"):
        sft.prepare(SFTConfig(out=str(tmp_path), batch_size=3))
    with pytest.raises(ValueError, match=r"ppo: micro_batch_size=3 is a global batch size .* \(2\)"):
        ppo.prepare(PPOConfig(out=str(tmp_path), model="tiny", reward="fastrlhf.train.task:true_score",
                              rollout_batch_size=6, mini_batch_size=6, micro_batch_size=3))


def test_a_missing_rendezvous_variable_is_named(torchrun_env, tmp_path, capsys):
    torchrun_env.delenv("MASTER_PORT")
    assert sft.main(["--out", str(tmp_path), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "MASTER_PORT not set" in err and "torchrun --nproc-per-node 2" in err


def test_an_unknown_shard_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="sft: shard must be one of full, grad_op, none, got 'zero3'"):
        sft.prepare(SFTConfig(out=str(tmp_path), shard="zero3"))


def test_ranks_configured_differently_fail_fast(two_ranks):
    """Rank 1 started with another learning rate (tests/dist_worker.py): every rank stops at
    the configuration check, before a model is built, naming the difference."""
    for rank in two_ranks["mismatch"]:
        assert "sft: rank(s) [1] resolved a configuration different from rank 0's" in rank["error"]
        assert "lr: 0.003 on rank 0, 0.001 here" in rank["error"]
        assert not rank["model_dir"]
