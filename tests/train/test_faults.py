"""Issue 22: nothing lost, nothing silently wrong. Each fault a run meets in practice (a damaged
checkpoint, a kill inside a save, a second process in the folder, SIGTERM / SIGINT, a reward
that hangs, a diverging run, a torn metrics line, a full disk, a killed torchrun rank) ends
with the exit code and the message it should, naming the file where one is involved, and
nothing is lost: a resumed run's metrics and final weights equal an uninterrupted run's.

Every run here is the tiny SFT stage (6 steps of 4 pairs, a row and a checkpoint every 2 steps)
or a 1-2 step PPO run. Runs that must be killed or signalled are subprocesses started through
`DRIVER`, which pauses inside a save or signals itself during a chosen step, so that each fault
lands at a known point; everything else runs in this process.
"""

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import helpers
import pytest
import torch
from safetensors.torch import load_file

from fastrlhf import cli
from fastrlhf.train import checkpoint, rewards
from fastrlhf.train.config import PPOConfig, RunError, SFTConfig
from fastrlhf.train.metrics import read_metrics
from fastrlhf.train.recipes import ppo, sft

ROOT = Path(__file__).resolve().parents[2]
SFT = dict(steps=6, batch_size=4, num_examples=40, log_every=2, save_every=2)
TINY_PPO = dict(helpers.TINY_PPO, save_every=1)
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "state.pt", checkpoint.MANIFEST)

# Run `fastrlhf ARGS...` after patching it to stop at a known point:
#   pause_manifest STEP / pause_latest STEP: touch MARKER and sleep inside the save of STEP, before its
#   manifest is written / after it is published and before `latest` moves (the test kills it there);
#   signal STEP SIG[,SIG]: send those signals to itself when step STEP is done, before its guards are read.
DRIVER = r"""
import os, signal, sys, time
from pathlib import Path
from fastrlhf import cli
from fastrlhf.train import checkpoint, run

mode, step, marker, *args = sys.argv[1:]
step = int(step)
if mode.startswith("pause"):
    name = "write_manifest" if mode == "pause_manifest" else "_point_latest"
    real = getattr(checkpoint, name)

    def paused(folder, which):
        if (which if isinstance(which, int) else int(which[5:])) == step:
            Path(marker).touch()
            time.sleep(600)
        return real(folder, which)

    setattr(checkpoint, name, paused)
else:
    real_advance = run.StageRun.advance

    def advance(self, at, skipped, **postfix):
        if at == step:
            for name in marker.split(","):
                os.kill(os.getpid(), getattr(signal, name))
        return real_advance(self, at, skipped, **postfix)

    run.StageRun.advance = advance
sys.exit(cli.main(args))
"""

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("keep_threads_and_warnings")]  # runs whole stages


@pytest.fixture(autouse=True)
def info_logs(caplog):
    """The stages' INFO lines ("resumed from ... (step N)") in caplog."""
    caplog.set_level(logging.INFO, logger="fastrlhf")


def _args(out: Path, **kw) -> list[str]:
    return ["sft", "--out", str(out), *[f"--{k}={v}" for k, v in dict(SFT, **kw).items()]]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _driver(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, *map(str, args)], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{path} never appeared: {proc.communicate()[1][-3000:]}")
        time.sleep(0.05)


def _rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out) if r["stage"] == "sft"]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "sft" / "final" / "model.safetensors")


def _assert_as_uninterrupted(out: Path, reference) -> None:
    """Nothing lost: the metrics rows and the final weights of `out` equal the uninterrupted run's."""
    rows, weights = reference
    assert _rows(out) == rows
    final = _weights(out)
    assert final.keys() == weights.keys()
    assert all(torch.equal(final[k], weights[k]) for k in weights)


def _resume(out: Path, **kw) -> dict:
    return sft.train(SFTConfig(out=str(out), resume=True, **dict(SFT, **kw)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: its rows and final weights."""
    n = torch.get_num_threads()
    out = tmp_path_factory.mktemp("reference")
    sft.train(SFTConfig(out=str(out), **SFT))
    torch.set_num_threads(n)
    return _rows(out), _weights(out)


@pytest.fixture(scope="module")
def stopped_at_4(tmp_path_factory):
    """A run stopped after step 4 (--stop_after): checkpoints of steps 2 and 4, rows of 2 and 4."""
    n = torch.get_num_threads()
    out = tmp_path_factory.mktemp("stopped") / "run"
    assert sft.train(SFTConfig(out=str(out), stop_after=4, **SFT)) == {"stopped_at": 4}
    torch.set_num_threads(n)
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(bytes(data[:len(data) // 2]))


# ---------------------------------------------------------------- integrity


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_a_damaged_checkpoint_file_is_named_and_the_run_resumes_from_the_one_before(name, how, stopped_at_4,
                                                                                    reference, tmp_path, caplog):
    out = _copy(stopped_at_4, tmp_path)
    damaged = out / "sft" / "checkpoints" / "step_000004" / name
    _damage(damaged, how)
    _resume(out)
    warning = next(r.getMessage() for r in caplog.records if "is damaged" in r.getMessage())
    assert f"checkpoint {damaged.parent} is damaged" in warning and name in warning
    assert f"resuming from the newest intact checkpoint, {out / 'sft' / 'checkpoints' / 'step_000002'}" in warning
    _assert_as_uninterrupted(out, reference)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_latest_pointer_falls_back_to_the_newest_intact_checkpoint(how, stopped_at_4, reference, tmp_path,
                                                                            caplog):
    out = _copy(stopped_at_4, tmp_path)
    pointer = out / "sft" / "checkpoints" / "latest"
    _damage(pointer, how)
    _resume(out)
    assert f"{pointer} cannot be read; resuming from the newest intact checkpoint" in caplog.text
    assert "resumed from" in caplog.text and "(step 4)" in caplog.text
    _assert_as_uninterrupted(out, reference)


def test_a_latest_naming_a_missing_step_resumes_from_the_one_before_and_does_not_advise_overwrite(
        stopped_at_4, reference, tmp_path, caplog):
    out = _copy(stopped_at_4, tmp_path)
    shutil.rmtree(out / "sft" / "checkpoints" / "step_000004")
    with pytest.raises(ValueError, match=r"names step_000004, which does not exist; --resume continues from the "
                                         r"newest intact one before it \(step_000002 on disk\)") as e:
        checkpoint.latest_checkpoint(out / "sft")
    assert "--overwrite" not in str(e.value)
    _resume(out)
    assert "names step_000004, which does not exist; resuming from the newest intact checkpoint" in caplog.text
    _assert_as_uninterrupted(out, reference)


@pytest.mark.parametrize("text", ["", "[]", '{"files": []}', '{"files": {"state.pt": {"bytes": "12"}}}',
                                  '{"files": {"state.pt": 3}}'])
def test_a_manifest_of_the_wrong_shape_is_reported_not_raised(text, stopped_at_4, tmp_path):
    folder = shutil.copytree(stopped_at_4 / "sft" / "checkpoints" / "step_000004", tmp_path / "step_000004")
    (folder / checkpoint.MANIFEST).write_text(text)
    assert checkpoint.check_manifest(folder).startswith(f"its {checkpoint.MANIFEST} cannot be read")


def test_no_intact_checkpoint_is_an_error_naming_each(stopped_at_4, tmp_path, capsys):
    out = _copy(stopped_at_4, tmp_path)
    for step in ("step_000002", "step_000004"):
        _damage(out / "sft" / "checkpoints" / step / "optimizer.pt", "flip")
    assert cli.main([*_args(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"sft: no intact checkpoint to resume from in {out / 'sft' / 'checkpoints'}" in err
    for step in ("step_000002", "step_000004"):
        assert f"checkpoint {out / 'sft' / 'checkpoints' / step} is damaged: optimizer.pt does not match" in err
    assert "Start over with --overwrite" in err and not (out / "sft" / "final").exists()


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused(stopped_at_4, tmp_path, capsys):
    out = _copy(stopped_at_4, tmp_path)
    assert cli.main([*_args(out, steps=3), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--resume with --steps 3, but {out / 'sft' / 'checkpoints' / 'step_000004'} holds step 4" in err
    assert not (out / "sft" / "final").exists()


@pytest.mark.parametrize("name,fix", [("sft/config.json", "restore it, or start over with --overwrite"),
                                      ("summary.json", "repair it, or delete it")])
def test_a_damaged_run_file_is_named_with_what_to_do(name, fix, stopped_at_4, tmp_path, capsys):
    out = _copy(stopped_at_4, tmp_path)
    (out / name).write_text('{"steps": 6, "seed')  # cut short
    assert cli.main([*_args(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"{out / name} cannot be read (JSONDecodeError" in err and fix in err
    assert [r["step"] for r in _rows(out)] == [2, 4]  # refused before a step ran


# ---------------------------------------------------------------- kill -9 inside a save, a second process


def test_a_second_process_is_refused_and_kill_9_inside_a_save_loses_nothing(reference, tmp_path, capsys, caplog):
    """A run paused inside the save of step 4 (its files written, no manifest yet) holds the
    folder: a second process, --resume and --overwrite included, is refused naming it, and
    touches nothing. kill -9 there; the resume removes the half-written folder, continues from
    step 2 and ends as an uninterrupted run."""
    out, marker = tmp_path / "run", tmp_path / "paused"
    proc = _driver("pause_manifest", 4, marker, *_args(out))
    try:
        _wait_for(marker, proc)
        before = sorted(p.name for p in (out / "sft" / "checkpoints").iterdir())
        for flag in ("--resume", "--overwrite"):
            assert cli.main([*_args(out), flag]) == 2
            err = capsys.readouterr().err
            assert f"{out} is in use by another run (PID {proc.pid} on host {socket.gethostname()}" in err, err
        assert sorted(p.name for p in (out / "sft" / "checkpoints").iterdir()) == before
        staging = [name for name in before if name.startswith(".step_000004.tmp")]
        assert staging and "step_000002" in before
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    _resume(out)
    assert f"removed what an interrupted earlier process left half-written: {out / 'sft' / 'checkpoints'}" in \
        caplog.text and staging[0] in caplog.text
    assert "(step 2)" in caplog.text
    _assert_as_uninterrupted(out, reference)


def test_kill_9_between_publishing_a_checkpoint_and_moving_latest_loses_nothing(reference, tmp_path, caplog):
    out, marker = tmp_path / "run", tmp_path / "paused"
    proc = _driver("pause_latest", 4, marker, *_args(out))
    try:
        _wait_for(marker, proc)
        assert (out / "sft" / "checkpoints" / "latest").read_text().strip() == "step_000002"
    finally:
        proc.kill()
        proc.communicate()
    _resume(out)
    assert "resumed from" in caplog.text and "(step 2)" in caplog.text  # `latest` names a complete checkpoint
    _assert_as_uninterrupted(out, reference)


# ---------------------------------------------------------------- signals


def test_a_signal_finishes_the_step_writes_a_checkpoint_and_the_resume_continues_there(reference, tmp_path, caplog):
    """SIGTERM and SIGINT share one handler (run.StopSignals), the exit code alone is theirs (128 + the number):
    SIGTERM here, SIGINT's 130 in tests/train/recipes/test_distill.py and, as a second signal, below."""
    sig, code = "SIGTERM", 143
    out = tmp_path / "run"
    proc = _driver("signal", 3, sig, *_args(out))
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == code, err[-3000:]
    assert f"{sig} received: finishing this step, then a checkpoint" in err
    assert "sft: stopped at step 3; continue with --resume" in err and "Traceback" not in err
    assert (out / "sft" / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert checkpoint.check_manifest(out / "sft" / "checkpoints" / "step_000003") is None
    assert [r["step"] for r in _rows(out)] == [2] and not (out / "sft" / "final").exists()
    _resume(out)
    assert "(step 3)" in caplog.text
    _assert_as_uninterrupted(out, reference)


def test_a_second_signal_exits_at_once_without_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = _driver("signal", 3, "SIGTERM,SIGINT", *_args(out))
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-3000:]
    assert "a second signal (SIGINT): exiting now, without a checkpoint" in err
    assert (out / "sft" / "checkpoints" / "latest").read_text().strip() == "step_000002"


def test_ctrl_c_outside_the_training_loop_exits_130_without_a_traceback(tmp_path, monkeypatch, capsys):
    def interrupted(cfg, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(sft, "prepare", interrupted)
    assert cli.main(_args(tmp_path / "run")) == 130
    err = capsys.readouterr().err
    assert "fastrlhf sft: interrupted outside a training loop" in err and "Traceback" not in err


# ---------------------------------------------------------------- timeouts: a reward that hangs, a collective


HANGING_REWARD = '''
import threading

RELEASE = threading.Event()
calls = []


def score(prompts, responses):
    calls.append(len(prompts))
    if len(calls) > 1:  # the second step's call hangs
        RELEASE.wait()
    return [0.0] * len(prompts)
'''


def test_a_hanging_reward_times_out_with_an_error_naming_it(tmp_path, monkeypatch, capsys, caplog):
    (tmp_path / "hanging_reward.py").write_text(HANGING_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(rewards, "WAIT_LOG_S", 0.5)
    import hanging_reward

    out = tmp_path / "run"
    args = ["ppo", "--out", str(out), "--steps", "2", "--reward", "hanging_reward:score", "--reward_timeout_s", "2",
            *[f"--{k}={v}" for k, v in TINY_PPO.items() if k != "reward"]]
    start = time.monotonic()
    try:
        assert cli.main(args) == 1
    finally:
        hanging_reward.RELEASE.set()
    assert time.monotonic() - start < 60
    err = capsys.readouterr().err
    assert "reward hanging_reward:score did not return within --reward_timeout_s 2 s" in err
    assert "still waiting for reward hanging_reward:score" in caplog.text
    assert (out / "ppo" / "checkpoints" / "latest").read_text().strip() == "step_000001"  # step 1 kept
    assert checkpoint.check_manifest(out / "ppo" / "checkpoints" / "step_000001") is None
    assert not (out / "ppo" / "final").exists()


@pytest.mark.parametrize("device, expected", [("cuda", 3), ("cuda:1", 1)])
def test_a_bounded_reward_runs_on_the_callers_cuda_device(monkeypatch, device, expected):
    # the reward's thread sets its current device: a bare "cuda" (bench/e2e.py's, and the CLI's on one GPU) is
    # the caller's current device, which torch.cuda.set_device refuses as such; CUDA is stubbed on this CPU
    seen = {}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: seen.setdefault("index", index))
    call = rewards.bounded(lambda rollout: torch.ones(2), "stub", 10.0, torch.device(device))
    assert call(None).tolist() == [1.0, 1.0]
    assert seen["index"] == expected


def test_dist_timeout_s_is_the_process_groups_timeout_in_a_stage_and_in_the_pipeline(monkeypatch, tmp_path):
    import datetime

    from fastrlhf.train import distributed
    from fastrlhf.train.config import PipelineConfig
    from fastrlhf.train.recipes import pipeline

    seen = []
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, timeout: seen.append(timeout))
    monkeypatch.setattr(distributed, "check_same_config", lambda config, what: None)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(k, v)
    distributed.setup("cpu", {"dist_timeout_s": 7.5}, "sft")
    cfg = PipelineConfig(out=str(tmp_path), dist_timeout_s=30)
    cfg.sft.num_examples, cfg.rm.num_pairs, cfg.ppo.eval_prompts = 40, 40, 4
    resolved, stages = pipeline.prepare(cfg)
    assert {plan.cfg.dist_timeout_s for _, _, plan in stages} == {30}
    distributed.setup("cpu", resolved, "pipeline")
    assert seen == [datetime.timedelta(seconds=7.5), datetime.timedelta(seconds=30)]


# ---------------------------------------------------------------- a diverging run


def test_lr_1e30_stops_the_run_without_a_final_model(tmp_path, capsys):
    """Step 1 moves the weights to ~1e29 (finite); step 2's loss is NaN and is skipped: 1 of the
    run's 6 updates, more than max_skipped_frac 0.1 allows."""
    out = tmp_path / "run"
    assert cli.main([*_args(out, save_every=1), "--lr", "1e30"]) == 1
    err = capsys.readouterr().err
    assert ("sft: 1 of the run's 6 optimizer updates were skipped for a non-finite loss or gradient, more than "
            "--max_skipped_frac 0.1 allows: the run is diverging (lr 1e+30)") in err
    kept = out / "sft" / "checkpoints" / "step_000001"
    assert f"nothing is published as final and the last checkpoint, {kept}, is kept" in err and "Traceback" not in err
    assert not (out / "sft" / "final").exists() and [r["step"] for r in _rows(out)] == []
    assert (out / "sft" / "checkpoints" / "latest").read_text().strip() == kept.name  # step 2 was never saved


def test_parameters_that_turn_non_finite_stop_the_run_at_that_step(tmp_path, monkeypatch):
    """An update that leaves an inf in the weights (at step 3) stops the run there: the checkpoint
    of step 2 stays the newest, and no final model is written."""
    from fastrlhf.train import run

    real = run.guarded_step

    def overflow_at_step_2(optimizer, loss, params, step, **kw):
        applied = real(optimizer, loss, params, step, **kw)
        if step == 2:
            with torch.no_grad():
                optimizer.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return applied

    monkeypatch.setattr(sft, "guarded_step", overflow_at_step_2)
    with pytest.raises(RunError, match=r"sft: the parameters are no longer finite after step 3 \(NaN or inf: the run "
                                       r"diverged; lr 0.003\); nothing is published as final and the last checkpoint, "
                                       r".*step_000002, is kept"):
        sft.train(SFTConfig(out=str(tmp_path), **SFT))
    assert (tmp_path / "sft" / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert not (tmp_path / "sft" / "final").exists()


def test_more_skipped_updates_than_max_skipped_frac_stop_the_run(tmp_path, monkeypatch):
    from fastrlhf import ops

    real = ops.linear_ppo_actor_loss
    monkeypatch.setattr(ops, "linear_ppo_actor_loss",
                        lambda *a, **k: (lambda loss, stats: (loss * float("nan"), stats))(*real(*a, **k)))
    with pytest.warns(UserWarning, match="non-finite PPO loss"), \
            pytest.raises(RunError, match=r"ppo: 2 of the run's 4 optimizer updates were skipped for a non-finite "
                                          r"loss or gradient, more than --max_skipped_frac 0.1 allows"):
        ppo.train(PPOConfig(out=str(tmp_path), steps=2, ppo_epochs=2, **TINY_PPO))
    assert not (tmp_path / "ppo" / "final").exists()


def test_an_implausible_reward_is_an_error_naming_it(tmp_path, monkeypatch):
    (tmp_path / "huge_reward.py").write_text("def score(prompts, responses):\n    return [1e30] * len(prompts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"reward huge_reward:score returned an implausible score \(1e\+30\) for "
                                         r"sample 0 .*--reward_clip_abs 1e\+06"):
        ppo.train(PPOConfig(out=str(tmp_path / "run"), steps=1, **dict(TINY_PPO, reward="huge_reward:score")))


# ---------------------------------------------------------------- metrics.jsonl


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(stopped_at_4, reference, tmp_path, caplog):
    out = _copy(stopped_at_4, tmp_path)
    metrics = out / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"stage": "sft", "step": 5, "lo')  # a crash during an append
    _resume(out)
    assert f"{metrics}: line 3 is cut short" in caplog.text and "it is dropped" in caplog.text
    _assert_as_uninterrupted(out, reference)


def test_a_damaged_metrics_line_is_named(stopped_at_4, tmp_path, capsys):
    out = _copy(stopped_at_4, tmp_path)
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    assert cli.main([*_args(out), "--resume"]) == 2
    assert f"{metrics}, line 2, is not a metrics row" in capsys.readouterr().err


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 14 MiB tmpfs (a tiny-model checkpoint is 10 MiB: the second one does not fit); skipped where
    mounting is not allowed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=14m", "tmpfs", str(disk)], capture_output=True)
    except OSError as e:  # no mount command
        pytest.skip(f"cannot mount a tmpfs here ({e})")
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip() or r.returncode})")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_names_the_file_leaves_no_staging_and_the_run_resumes(small_disk, reference, capsys):
    out = small_disk / "run"
    assert cli.main(_args(out)) == 1
    err = capsys.readouterr().err
    ckpts = out / "sft" / "checkpoints"
    assert f"no space left on device while writing {ckpts / 'step_000004'}" in err and "Traceback" not in err
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000002"]  # no half-written folder
    assert checkpoint.check_manifest(ckpts / "step_000002") is None
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    assert cli.main([*_args(out), "--resume"]) == 0
    _assert_as_uninterrupted(out, reference)


# ---------------------------------------------------------------- two ranks, one killed


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").glob("*") for c in (task / "children").read_text().split()]


STEPS_2 = 16  # the kill lands at the first checkpoint (step 2), 14 steps before the run could end


def test_a_killed_torchrun_rank_ends_the_job_naming_it_and_the_run_resumes(tmp_path):
    """Rank 1 of 2 is killed once a checkpoint exists: the job ends within seconds, torchrun naming
    the rank; the resume under torchrun finishes with the loss curve of one process."""
    from fastrlhf.train import distributed

    out = tmp_path / "run"
    args = _args(out, steps=STEPS_2, save_every=2, log_every=1, device="cpu")
    env = {k: v for k, v in _env().items() if k not in distributed.LAUNCH_ENV}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fastrlhf",
           *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    latest = out / "sft" / "checkpoints" / "latest"
    try:
        _wait_for(latest, proc, timeout=240)
        ranks = _children(proc.pid)
        assert len(ranks) == 2
        rank1 = next(p for p in ranks if "\0RANK=1\0" in "\0" + Path(f"/proc/{p}/environ").read_text())
        killed = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - killed < 30
    assert proc.returncode != 0 and not (out / "sft" / "final").exists()
    assert "local_rank: 1" in output and "Signal 9 (SIGKILL)" in output, output[-3000:]
    r = subprocess.run([*cmd, "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr
    one = tmp_path / "one"
    sft.train(SFTConfig(out=str(one), **dict(SFT, steps=STEPS_2, save_every=2, log_every=1, device="cpu")))
    two, single = _rows(out), _rows(one)
    assert [r["step"] for r in two] == list(range(1, STEPS_2 + 1))
    for a, b in zip(single, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
