"""fastrlhf.train.checkpoint on its own: checkpoints and their manifests, the `latest` pointer and the fallback,
resume safety of a run folder, staging leftovers and the run lock. What the stages make of it (kill -9,
signals, a full disk, torchrun) is in test_faults.py."""

import json
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from fastrlhf.train import checkpoint


def _model():
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return module, optimizer


def _save(stage_dir, step, module, optimizer, keep=2):
    weights = {k: v.detach().clone() for k, v in module.named_parameters()}
    return checkpoint.save_checkpoint(stage_dir, step, weights, optimizer, {"step_note": step}, keep=keep)


def test_a_checkpoint_loads_back_the_weights_optimizer_extra_and_random_streams(tmp_path):
    module, optimizer = _model()
    folder = _save(tmp_path, 3, module, optimizer)
    assert folder.name == "step_000003" and checkpoint.latest_checkpoint(tmp_path) == folder
    assert checkpoint.check_manifest(folder) is None
    files = json.loads((folder / checkpoint.MANIFEST).read_text())["files"]
    assert set(files) == {"model.safetensors", "optimizer.pt", "state.pt"}
    expected = torch.rand(5)  # the stream right after the save

    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = checkpoint.load_checkpoint(folder, fresh, fresh_opt)
    assert state == {"step": 3, "extra": {"step_note": 3}}
    for (name, a), b in zip(module.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(5), expected)


def test_only_the_newest_keep_checkpoints_stay_and_a_replaced_runs_later_ones_go(tmp_path):
    module, optimizer = _model()
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, module, optimizer, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000003", "step_000004"]
    _save(tmp_path, 2, module, optimizer, keep=2)  # a run that replaces this one, at an earlier step
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000002"]
    assert (root / checkpoint.LATEST).read_text().strip() == "step_000002"


@pytest.mark.parametrize("damage", ["flip", "cut", "delete", "no manifest"])
def test_the_manifest_names_what_is_wrong(damage, tmp_path):
    module, optimizer = _model()
    folder = _save(tmp_path, 1, module, optimizer)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "cut":
        path.write_bytes(bytes(data[:-4]))
    elif damage == "delete":
        path.unlink()
    else:
        (folder / checkpoint.MANIFEST).unlink()
    problem = checkpoint.check_manifest(folder)
    expected = {"flip": "model.safetensors does not match the sha256", "cut": f"holds {len(data) - 4} bytes",
                "delete": "model.safetensors missing", "no manifest": "it has no manifest.json"}[damage]
    assert problem is not None and expected in problem, problem


def test_resume_falls_back_to_the_newest_intact_checkpoint_and_refuses_when_none_is(tmp_path, caplog):
    assert checkpoint.intact_checkpoint(tmp_path, "sft") is None  # no checkpoint: a fresh start
    module, optimizer = _model()
    for step in (1, 2):
        _save(tmp_path, step, module, optimizer)
    newest = tmp_path / "checkpoints" / "step_000002"
    (newest / "state.pt").write_bytes(b"not a torch file")
    with caplog.at_level(logging.WARNING, logger="fastrlhf"):
        assert checkpoint.intact_checkpoint(tmp_path, "sft") == tmp_path / "checkpoints" / "step_000001"
    assert "checkpoint" in caplog.text and "step_000002 is damaged" in caplog.text
    (tmp_path / "checkpoints" / "step_000001" / "optimizer.pt").unlink()
    with pytest.raises(ValueError, match="no intact checkpoint.*step_000002 is damaged.*step_000001 is damaged"):
        checkpoint.intact_checkpoint(tmp_path, "sft")


def test_a_latest_naming_a_missing_folder_is_an_error_never_a_fresh_start(tmp_path):
    module, optimizer = _model()
    _save(tmp_path, 1, module, optimizer)
    (tmp_path / "checkpoints" / checkpoint.LATEST).write_text("step_000009\n")
    with pytest.raises(ValueError, match="names step_000009, which does not exist.*step_000001 on disk"):
        checkpoint.latest_checkpoint(tmp_path)


def test_config_changes_compare_paths_as_paths_and_ignore_free_keys_and_new_defaults(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    recorded = {"model": str(model), "lr": 1e-3, "steps": 10, "out": str(tmp_path / "o"),
                "reward": {"data": str(tmp_path / "o" / "rm" / "final")}}
    same = dict(recorded, model=str(model) + "/", steps=20, reward={"data": str(tmp_path / "o" / "rm" / "final")})
    assert checkpoint.config_changes(recorded, same) == []
    assert checkpoint.config_changes(recorded, dict(recorded, lr=2e-3)) == ["lr: 0.001 -> 0.002"]
    # a key the recorded run lacks (an older fastrlhf) is no change at its default, a change otherwise
    assert checkpoint.config_changes(recorded, dict(recorded, new=1), defaults={"new": 1}) == []
    assert checkpoint.config_changes(recorded, dict(recorded, new=2), defaults={"new": 1}) == ["new: '<absent>' -> 2"]


def test_a_run_folder_is_described_by_its_own_files_only(tmp_path):
    (tmp_path / "train.log").write_text("a log written into the run folder")
    (tmp_path / checkpoint.LOCK_FILE).write_text("")
    assert checkpoint.describe_run(tmp_path) is None
    checkpoint.check_run_dir(tmp_path, {"steps": 5}, resume=False, overwrite=False, what="sft")  # not a run

    module, optimizer = _model()
    _save(tmp_path, 7, module, optimizer)
    checkpoint.write_json_atomic(tmp_path / checkpoint.CONFIG_FILE, {"steps": 10, "lr": 0.1})
    assert checkpoint.describe_run(tmp_path) == "checkpoints up to step 7, a recorded configuration"
    with pytest.raises(ValueError, match="already holds a run.*--resume.*--overwrite"):
        checkpoint.check_run_dir(tmp_path, {"steps": 10, "lr": 0.1}, resume=False, overwrite=False, what="sft")
    with pytest.raises(ValueError, match="differs from the one recorded.*lr: 0.1 -> 0.2"):
        checkpoint.check_run_dir(tmp_path, {"steps": 10, "lr": 0.2}, resume=True, overwrite=False, what="sft")
    with pytest.raises(ValueError, match="cannot resume backwards; pass --steps 7 or more"):
        checkpoint.check_run_dir(tmp_path, {"steps": 5, "lr": 0.1}, resume=True, overwrite=False, what="sft")
    with pytest.raises(ValueError, match="--resume and --overwrite contradict"):
        checkpoint.check_run_dir(tmp_path, {}, resume=True, overwrite=True, what="sft")

    checkpoint.start_run_dir(tmp_path, {"steps": 3}, resume=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([checkpoint.CONFIG_FILE, checkpoint.LOCK_FILE,
                                                                 "train.log"])


def test_staging_leftovers_are_removed_and_nothing_else(tmp_path, caplog):
    (tmp_path / "checkpoints").mkdir()
    stale = [tmp_path / ".final.tmp", tmp_path / "checkpoints" / ".step_000004.tmp", tmp_path / ".config.json.tmp-12"]
    stale[0].mkdir()
    stale[1].mkdir()
    stale[2].write_text("{")
    kept = [tmp_path / ".final.tmpx", tmp_path / "notes.tmp", tmp_path / "checkpoints" / "step_000004"]
    kept[0].write_text("")
    kept[1].write_text("")
    kept[2].mkdir()
    with caplog.at_level(logging.WARNING, logger="fastrlhf"):
        checkpoint.remove_staging(tmp_path)
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)
    assert "half-written" in caplog.text


def test_json_is_written_atomically_as_valid_json(tmp_path):
    path = tmp_path / "summary.json"
    checkpoint.write_json_atomic(path, {"loss": float("nan"), "t": 2.5, "inf": float("inf")})
    assert json.loads(path.read_text()) == {"inf": None, "loss": None, "t": 2.5}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_the_run_lock_refuses_a_second_process_naming_the_holder_and_re_enters_in_its_own(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from fastrlhf.train import checkpoint
        with checkpoint.run_lock({str(tmp_path)!r}, "holder"):
            print("locked", flush=True)
            sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"sft: {tmp_path} is in use by another run \(PID {holder.pid} on host"):
            with checkpoint.run_lock(tmp_path, "sft"):
                pass
    finally:
        holder.communicate("\n", timeout=60)
    with checkpoint.run_lock(tmp_path, "pipeline"):
        with checkpoint.run_lock(tmp_path, "sft"):  # the pipeline's stages re-enter its lock
            pass
    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError):
        with checkpoint.run_lock(fresh, "sft"):
            raise RuntimeError("refused before writing anything")
    assert not fresh.exists()  # a folder created for the lock alone is removed again
