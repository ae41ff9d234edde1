"""Checkpoints, resume, atomic writes and the run folder's lock.

A stage's folder, OUT/<stage>/:

    config.json                the stage's configuration, defaults resolved (written when it starts)
    checkpoints/step_000050/   model.safetensors (trainable weights), optimizer.pt, state.pt (step, RNG,
                               extra), manifest.json (the size and sha256 of each of them)
    checkpoints/latest         one line: the folder name of the newest complete checkpoint
    final/                     a Hugging Face model directory (+ tokenizer, + head files, + fastrlhf.json)

Resume safety (`check_run_dir`, before any model loads): a fresh run in a folder that holds a
run's own files is refused unless `--overwrite` (which deletes those files, and only those) or
`--resume`; `--resume` refuses a configuration that differs from the recorded one (apart from
`RESUME_FREE_KEYS`; the paths of `PATH_KEYS` compared as paths, inside the run folder relative
to it, so a moved folder resumes), fewer `--steps` than the checkpoint holds, and says so when
there is no checkpoint to resume from. One process at a time works in a run folder: rank 0
holds an OS lock (`run_lock`, `flock` on OUT/.fastrlhf.lock) for the whole run, and a second
process is refused with the holder's PID and host.

Integrity: every folder and JSON file is first written under a temporary name beside its
destination, its files and folder are fsynced, and it is then moved into place with
`os.replace`, so a crash or a power loss never leaves half a checkpoint and `latest` only ever
names a complete one. A checkpoint's manifest is written before it is published; `--resume`
checks it (`intact_checkpoint`) and falls back, with a warning naming the damaged one, to the
newest checkpoint that passes. What an interrupted process left half-written is removed when
the next run starts (`remove_staging`). A full disk is one error naming the file (`writing`).

What a checkpoint holds is written and read by `_write_state` / `_read_state` alone; the
rest (folders, the `latest` pointer, pruning, resume) does not look inside. Under torchrun
`_write_sharded` / `_read_sharded` replace them: torch.distributed.checkpoint writes the
sharded weights and optimizer state (`.metadata` + one `.distcp` file per rank, reshardable
to another number of ranks), and each rank its own `rank_NNNNN.pt` (step, RNG, extra). Every
rank writes into the same temporary folder and hashes its share of the files; rank 0 writes the
manifest and publishes the folder once all are done. A sharded checkpoint also resumes in a
single process; a single-process one only there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import socket
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fastrlhf.train import distributed
from fastrlhf.train.config import RunError

log = logging.getLogger("fastrlhf")

LATEST = "latest"
CONFIG_FILE = "config.json"
MANIFEST = "manifest.json"  # in each checkpoint: {"files": {name: {"bytes", "sha256"}}}
LOCK_FILE = ".fastrlhf.lock"  # in OUT: flock-ed by the run that works there
ADAPTER_DIR = "adapter"  # in a final model of --qlora: the LoRA adapters alone (peft's save_pretrained)
STAGE_FILES = (CONFIG_FILE, "checkpoints", "final")  # what a stage writes in OUT/<stage>/ (and --overwrite deletes)
# keys a resumed run may change (the run folder may move; sharded checkpoints reshard; guards and timeouts)
RESUME_FREE_KEYS = ("out", "steps", "stop_after", "resume", "overwrite", "log_every", "save_every", "eval_every",
                    "tensorboard", "shard", "max_skipped_frac", "dist_timeout_s", "reward_timeout_s",
                    "reward_clip_abs")
PATH_KEYS = ("model", "data", "reward")  # compared on resume as the paths they name, not as spelled
# what temp_path / staging_dir / publish_dir name, beside the files a run writes (and nothing of yours)
STAGING = re.compile(r"^\.(step_\d{6}|latest|final|config\.json|metrics\.jsonl|summary\.json)\.(tmp|old)(-\d+)?$")
DISK_FULL_BYTES = 2**20  # a write that fails with less free space than this ran out of space


# ---------------------------------------------------------------- atomic writes


def json_safe(obj):
    """`obj` with every non-finite float (NaN, inf) replaced by None: valid JSON (NaN -> null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def read_json(path: Path, *, fix: str):
    """The JSON file at `path`, which a run wrote; one that cannot be read (damaged, cut short) is a
    ValueError that names it and says what to do (`fix`)."""
    try:
        return json.loads(Path(path).read_bytes())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}); {fix}") from None


def temp_path(path: Path) -> Path:
    """A hidden name beside `path` for this process to write first (`remove_staging` finds it)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _free_bytes(path: Path) -> int | None:
    for folder in (Path(path), *Path(path).parents):
        if folder.exists():
            stat = os.statvfs(folder)
            return stat.f_bavail * stat.f_frsize
    return None


@contextlib.contextmanager
def writing(path: Path):
    """Around a write of `path`: a full disk becomes one RunError, "no space left on device while
    writing PATH" (torch.save reports it as "unexpected pos", safetensors as an I/O error, Python
    as ENOSPC)."""
    try:
        yield
    except RunError:
        raise
    except Exception as e:  # noqa: BLE001 - each writer wraps ENOSPC in its own exception type
        free = _free_bytes(Path(path).parent)
        if (getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e)
                or (free is not None and free < DISK_FULL_BYTES)):
            raise RunError(f"no space left on device while writing {path}; free some space there, then continue "
                           "with --resume") from None
        raise


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename into it) durable; a no-op where the file system refuses."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder` (before it is renamed into place)."""
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def write_json_atomic(path: Path, obj) -> None:
    """`obj` as indented, valid JSON at `path` (NaN/inf as null), via a temporary file (fsynced) and
    `os.replace`."""
    path = Path(path)
    tmp = temp_path(path)
    with writing(path):
        with open(tmp, "w") as f:
            f.write(json.dumps(json_safe(obj), indent=2, sort_keys=True, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)


def staging_dir(path: Path) -> Path:
    """An empty temporary folder beside `path`, to be published with `publish_dir`."""
    tmp = temp_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish_dir(tmp: Path, path: Path) -> None:
    """Atomically publish a finished folder, its files fsynced first: an existing one is renamed
    away first, then removed."""
    path = Path(path)
    fsync_tree(tmp)
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def save_model_dir(lm, tokenizer, path: Path, extra: dict[str, dict[str, torch.Tensor]] | None = None,
                   lineage: dict | None = None, adapter=None) -> None:
    """A Hugging Face model directory (+ tokenizer, + extra safetensors files, + `lineage` as
    fastrlhf.json: see fastrlhf.train.models, + `adapter`'s LoRA adapters alone in adapter/, peft's
    format), published atomically."""
    tmp = staging_dir(path)
    try:
        with writing(tmp):
            lm.save_pretrained(tmp)
            if adapter is not None:
                adapter.save_pretrained(tmp / ADAPTER_DIR, save_embedding_layers=False)  # embeddings stay frozen
            tokenizer.save_pretrained(tmp)
            for filename, tensors in (extra or {}).items():
                save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / filename)
            if lineage is not None:
                write_json_atomic(tmp / "fastrlhf.json", lineage)
            publish_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a publish; a failed write leaves nothing behind


def remove_staging(folder: Path) -> None:
    """Remove what an interrupted earlier process left half-written in `folder` and its checkpoints
    (a full disk stays full otherwise). Call it only while holding the run's lock."""
    stale = [p for d in (Path(folder), Path(folder) / "checkpoints") if d.is_dir()
             for p in d.iterdir() if STAGING.match(p.name)]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    if stale:
        log.warning("removed what an interrupted earlier process left half-written: %s", ", ".join(map(str, stale)))


# ---------------------------------------------------------------- manifests


def _digest(path: Path) -> dict:
    """{"bytes", "sha256"} of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _shared_digests(folder: Path) -> dict[str, dict]:
    """The digest of every file in `folder` (not its manifest); under torchrun each rank hashes
    every world_size-th file and all ranks receive them all."""
    names = sorted(p.name for p in Path(folder).iterdir() if p.is_file() and p.name != MANIFEST)
    mine = {name: _digest(Path(folder) / name) for name in names[distributed.rank()::distributed.world_size()]}
    return {k: v for part in distributed.all_gather_object(mine) for k, v in part.items()}


def write_manifest(folder: Path, step: int) -> None:
    """folder/manifest.json: the size and sha256 of every file in `folder` (every rank joins; rank 0 writes)."""
    files = _shared_digests(folder)
    if distributed.is_main():
        write_json_atomic(Path(folder) / MANIFEST, {"format": 1, "step": step, "files": files})


def check_manifest(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder against its manifest (a missing, cut or changed
    file), or None when every file it lists is intact. Under torchrun every rank joins."""
    manifest = Path(folder) / MANIFEST
    try:
        listed = json.loads(manifest.read_bytes())["files"]
        if not all(isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
                   for v in listed.values()):
            raise ValueError("an entry without its bytes and sha256")
    except FileNotFoundError:
        return f"it has no {MANIFEST} (its save did not finish, or an older fastrlhf wrote it)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its {MANIFEST} cannot be read ({type(e).__name__}: {e})"
    present = {p.name for p in Path(folder).iterdir() if p.is_file()}
    missing = sorted(set(listed) - present)
    if missing:
        return f"{', '.join(missing)} missing"
    found = _shared_digests(folder)
    for name, want in sorted(listed.items()):
        got = found[name]
        if got["bytes"] != want["bytes"]:
            return f"{name} holds {got['bytes']} bytes, its manifest says {want['bytes']}"
        if got["sha256"] != want["sha256"]:
            return f"{name} does not match the sha256 in its manifest (changed or damaged after it was written)"
    return None


# ---------------------------------------------------------------- RNG


def rng_state() -> dict:
    """CPU, Python and CUDA generator states (under torchrun: this rank's GPU only)."""
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state() if distributed.active() else torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, _, gauss = random.getstate()
    random.setstate((version, tuple(state["python"]), gauss))
    if "cuda" in state and torch.cuda.is_available():
        if isinstance(state["cuda"], torch.Tensor):
            torch.cuda.set_rng_state(state["cuda"])
        else:
            torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- checkpoints


def _write_state(folder: Path, weights: dict[str, torch.Tensor], optimizer, meta: dict) -> None:
    """Single process: weights as safetensors, optimizer and meta (step, RNG, extra) as torch files."""
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, folder / "model.safetensors")
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    torch.save(meta, folder / "state.pt")


def _read(path: Path, load):
    """load(path); a checkpoint file that cannot be read is a ValueError naming it."""
    try:
        return load(path)
    except Exception as e:  # noqa: BLE001 - safetensors, pickle and dcp each raise their own types
        raise ValueError(f"checkpoint file {path} cannot be read ({type(e).__name__}: {e}); it passed its manifest, "
                         "so it was likely written by another version of fastrlhf or torch: resume with that "
                         "version, or start over with --overwrite") from None


def _torch_load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _read_state(folder: Path, module: nn.Module, optimizer) -> dict:
    """Load the weights into `module` (every saved tensor must match a parameter) and the
    optimizer state; returns the meta dict."""
    params = dict(module.named_parameters())
    weights = _read(folder / "model.safetensors", load_file)
    unknown = set(weights) - set(params)
    if unknown:
        raise ValueError(f"checkpoint {str(folder)!r} holds tensors the model does not have: {sorted(unknown)[:5]}")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    optimizer.load_state_dict(_read(folder / "optimizer.pt", _torch_load))
    return _read(folder / "state.pt", _torch_load)


def _rank_file(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank_{rank:05d}.pt"


def _write_sharded(folder: Path, module: nn.Module, weights: dict[str, torch.Tensor], optimizer, meta: dict) -> None:
    """Under torchrun: the weights named in `weights` and the optimizer state, sharded
    (torch.distributed.checkpoint, every rank joins), and this rank's meta."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(module, optimizer)
    model_state = {k: v for k, v in model_state.items() if k in weights}
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder))
    torch.save(dict(meta, world_size=distributed.world_size()), _rank_file(folder, distributed.rank()))


def _read_sharded(folder: Path, module: nn.Module, optimizer) -> dict:
    """Load a torch.distributed.checkpoint folder into `module` and `optimizer` (on any number
    of ranks, or one plain process); returns this rank's meta (rank 0's when the checkpoint
    was written by fewer ranks, with a warning: the RNG streams then differ from an
    uninterrupted run)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    saved = _read(folder / ".metadata", lambda _: dcp.FileSystemReader(str(folder)).read_metadata()).state_dict_metadata
    model_state, optim_state = get_state_dict(module, optimizer)
    model_state = {k: v for k, v in model_state.items() if f"model.{k}" in saved}
    unknown = {k[len("model."):] for k in saved if k.startswith("model.")} - set(model_state)
    if unknown:
        raise ValueError(f"checkpoint {str(folder)!r} holds tensors the model does not have: {sorted(unknown)[:5]}")
    _read(folder, lambda f: dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(f)))
    set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(strict=False))
    own = _rank_file(folder, distributed.rank())
    meta = _read(own if own.is_file() else _rank_file(folder, 0), _torch_load)
    if meta["world_size"] != distributed.world_size():
        log.warning("checkpoint %s was written by %d rank(s), resumed on %d: weights and optimizer state are "
                    "resharded; the random streams differ from an uninterrupted run", folder, meta["world_size"],
                    distributed.world_size())
    return meta


def save_checkpoint(stage_dir: Path, step: int, weights: dict[str, torch.Tensor], optimizer, extra: dict,
                    keep: int = 2, module: nn.Module | None = None) -> Path:
    """stage_dir/checkpoints/step_{step:06d}/ with its manifest, published atomically, then `latest`
    points at it. Only this checkpoint and the newest `keep - 1` before it stay; any with a later
    step (from a run this one replaces) are removed, so `latest` always names the newest
    checkpoint on disk. Under torchrun every rank calls this (`module`: the model that holds
    `weights`)."""
    root = Path(stage_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    meta = {"step": step, "rng": rng_state(), "extra": extra}
    if distributed.active():
        if module is None:
            raise ValueError("save_checkpoint: a sharded checkpoint needs the module that holds the weights")
        tmp = final.with_name(f".{final.name}.tmp")  # one name every rank knows
        with distributed.main_first() as main:
            if main:
                root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
        with writing(final):
            _write_sharded(tmp, module, weights, optimizer, meta)
        distributed.barrier()  # every rank's shards are on disk
    else:
        root.mkdir(parents=True, exist_ok=True)
        tmp = staging_dir(final)
        try:
            with writing(final):
                _write_state(tmp, weights, optimizer, meta)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed save leaves nothing (a full disk would stay full)
            raise
    with writing(final):
        write_manifest(tmp, step)
        with distributed.main_first() as main:
            if main:
                publish_dir(tmp, final)
                _point_latest(root, final.name)
                older = sorted(p for p in root.glob("step_*") if p.name < final.name)
                newer = [p for p in root.glob("step_*") if p.name > final.name]
                for old in older[:max(0, len(older) - (keep - 1))] + newer:
                    shutil.rmtree(old, ignore_errors=True)
    return final


def _point_latest(root: Path, name: str) -> None:
    """checkpoints/latest names `name`, replaced atomically and durably."""
    pointer, tmp = root / LATEST, temp_path(root / LATEST)
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, pointer)
    fsync_dir(root)


def _latest_name(root: Path) -> str | None:
    """The folder name checkpoints/latest holds (None without a pointer, or one that is not a step name)."""
    try:
        name = (root / LATEST).read_bytes().decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if re.fullmatch(r"step_\d{6}", name) else None


def _step_folders(root: Path) -> list[Path]:
    """The checkpoint folders in `root`, newest first."""
    return sorted((p for p in root.glob("step_*") if p.is_dir() and re.fullmatch(r"step_\d{6}", p.name)),
                  reverse=True)


def latest_checkpoint(stage_dir: Path) -> Path | None:
    """The checkpoint `latest` names; None when there is none. A `latest` that names a missing
    folder is an error, never a silent fresh start."""
    pointer = Path(stage_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not path.is_dir():
        older = [p.name for p in _step_folders(pointer.parent) if p.name < path.name]
        fix = (f"--resume continues from the newest intact one before it ({', '.join(older)} on disk)" if older else
               "there is no checkpoint before it: start over with --overwrite")
        raise ValueError(f"{pointer} names {path.name}, which does not exist; {fix}")
    return path


def intact_checkpoint(stage_dir: Path, stage: str) -> Path | None:
    """The checkpoint to resume from: the one `latest` names when it passes its manifest, else the
    newest one before it that does, with a warning naming each damaged (or missing) one. None when
    the stage has no checkpoint at all; a ValueError listing them when none is intact. Under
    torchrun every rank joins (each hashes its share of the files) and gets the same answer."""
    root = Path(stage_dir) / "checkpoints"
    named = _latest_name(root)
    folders = [p for p in _step_folders(root) if named is None or p.name <= named]
    problems = []
    if (root / LATEST).is_file() and named is None:
        problems.append(f"{root / LATEST} cannot be read")
    elif named is not None and not (root / named).is_dir():
        problems.append(f"{root / LATEST} names {named}, which does not exist")
    for folder in folders:
        problem = check_manifest(folder)
        if problem is None:
            if problems:
                log.warning("%s: %s; resuming from the newest intact checkpoint, %s", stage, "; ".join(problems),
                            folder)
            return folder
        problems.append(f"checkpoint {folder} is damaged: {problem}")
    if not problems:
        return None
    raise ValueError(f"{stage}: no intact checkpoint to resume from in {root}: {'; '.join(problems)}. Start over "
                     "with --overwrite (it deletes them)")


def load_checkpoint(path: Path, module: nn.Module, optimizer) -> dict:
    """Load weights into `module`, the optimizer state and the RNG state; returns {"step", "extra"}."""
    path = Path(path)
    if (path / ".metadata").is_file():
        state = _read_sharded(path, module, optimizer)
    elif distributed.active():
        raise ValueError(f"checkpoint {str(path)!r} was written by a single process; resume it without torchrun, or "
                         "start over with --overwrite")
    else:
        state = _read_state(path, module, optimizer)
    set_rng_state(state["rng"])
    return {"step": int(state["step"]), "extra": state["extra"]}


def resume_from_checkpoint(stage_dir: Path, module: nn.Module, optimizer, enabled: bool, stage: str):
    """{"step", "extra", "path"} of the stage's newest intact checkpoint (`intact_checkpoint`),
    loaded into `module` and `optimizer`, when `enabled` and one exists; None otherwise (a fresh
    start, said in the log when resuming)."""
    if not enabled:
        return None
    ckpt = intact_checkpoint(stage_dir, stage)
    if ckpt is None:
        log.warning("%s: --resume, but %s holds no checkpoint: starting from step 0", stage,
                    Path(stage_dir) / "checkpoints")
        return None
    state = load_checkpoint(ckpt, module, optimizer)
    log.info("%s: resumed from %s (step %d)", stage, ckpt, state["step"])
    return dict(state, path=ckpt)


# ---------------------------------------------------------------- run folders: resume safety


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _as_path(value: str, out: str | None) -> str:
    """What a path-valued key names, comparable across spellings: inside the run folder `out`
    (as spelled, or once both are resolved) relative to it, so that a moved run folder still
    matches; elsewhere the resolved path when it exists. Anything else (a built-in model,
    `builtin`, a rule `module:function`) as it is."""
    path = Path(value)
    if out:
        for p, o in ((path, Path(out)), (path.resolve(), Path(out).resolve())):
            if p.is_relative_to(o):
                return f"OUT/{p.relative_to(o).as_posix()}"
    return str(path.resolve()) if path.exists() else value


def _paths(d: dict, out: str | None = None, prefix: str = "") -> dict:
    """The PATH_KEYS of a (nested) configuration, flattened as `_flat` does, each `_as_path` against
    the nearest `out`."""
    out = d.get("out", out)
    paths = {}
    for k, v in d.items():
        if isinstance(v, dict):
            paths.update(_paths(v, out, f"{prefix}{k}."))
        elif k in PATH_KEYS and isinstance(v, str) and v:
            paths[f"{prefix}{k}"] = _as_path(v, out)
    return paths


def config_changes(recorded: dict, current: dict, free=RESUME_FREE_KEYS, defaults: dict | None = None) -> list[str]:
    """'key: recorded -> current' for every key that differs, keys in `free` (at any depth) aside.
    Path-valued keys (PATH_KEYS) differ only when they name other paths (`_as_path`): `m` and
    `/abs/m` are the same model, and OUT/sft/final is the same in a run folder that moved. A key
    the recorded configuration lacks (a run recorded by an older fastrlhf) is no change while it
    holds its default (`defaults`: the configuration class's own values)."""
    a, b = _flat(recorded), _flat(current)
    pa, pb = _paths(recorded), _paths(current)
    default = _flat(defaults or {})
    keys = [k for k in sorted(set(a) | set(b)) if k.rsplit(".", 1)[-1] not in free
            and not (k not in a and k in default and default[k] == b.get(k))]
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in keys
            if a.get(k) != b.get(k) and (k not in pa or k not in pb or pa[k] != pb[k])]


def _describe_stage(folder: Path) -> str | None:
    """What an earlier run left in a stage folder ("checkpoints up to step 120, a final model"), or None."""
    found = [name for name in STAGE_FILES if (folder / name).exists()]
    if not found:
        return None
    parts = []
    steps = _step_folders(folder / "checkpoints")
    if steps:
        parts.append(f"checkpoints up to step {int(steps[0].name[5:])}")
    if (folder / "final").is_dir():
        parts.append("a final model")
    if (folder / CONFIG_FILE).is_file():
        parts.append("a recorded configuration")
    return ", ".join(parts) or ", ".join(found)


def describe_run(folder: Path, own: tuple[str, ...] = STAGE_FILES) -> str | None:
    """What an earlier run left in `folder` among the entries a run writes there (`own`: a stage
    folder's STAGE_FILES, or the pipeline's outputs in OUT), or None when it holds none of them:
    other files (a log you write there, the lock) are not a run."""
    folder = Path(folder)
    if own == STAGE_FILES:
        return _describe_stage(folder)
    parts = []
    for name in own:
        path = folder / name
        if path.is_dir():
            inner = _describe_stage(path)
            parts.append(f"{name}/ ({inner})" if inner else f"{name}/")
        elif path.exists():
            parts.append(name)
    return "; ".join(parts) or None


def check_run_dir(folder: Path, config: dict, *, resume: bool, overwrite: bool, what: str,
                  own: tuple[str, ...] = STAGE_FILES, defaults: dict | None = None) -> None:
    """Refuse, before any model loads, a run that would silently mix with an earlier one in
    `folder` (a stage folder, or the pipeline's OUT, whose entries are `own`): a fresh run where
    one exists (unless `overwrite`), or `resume` with a configuration that differs from the
    recorded one (`defaults`: see `config_changes`) or with fewer steps than its checkpoints hold."""
    if resume and overwrite:
        raise ValueError(f"{what}: --resume and --overwrite contradict each other; pass one")
    found = describe_run(folder, own)
    if found is None or overwrite:
        return
    if not resume:
        raise ValueError(f"{what}: {folder} already holds a run ({found}); pass --resume to continue it, or "
                         "--overwrite to delete it and start over")
    recorded = Path(folder) / CONFIG_FILE
    if recorded.is_file():
        fix = "restore it, or start over with --overwrite (it deletes the run)"
        changes = config_changes(read_json(recorded, fix=fix), config, defaults=defaults)
        if changes:
            raise ValueError(f"{what}: --resume with a configuration that differs from the one recorded in "
                             f"{recorded}: {'; '.join(changes)}. Restore those values, or start over with "
                             "--overwrite")
    steps = _step_folders(Path(folder) / "checkpoints")
    if "steps" in config and steps and int(steps[0].name[5:]) > config["steps"]:
        raise ValueError(f"{what}: --resume with --steps {config['steps']}, but {steps[0]} holds step "
                         f"{int(steps[0].name[5:])}: a run cannot resume backwards; pass --steps "
                         f"{int(steps[0].name[5:])} or more, or start over with --overwrite")


def start_run_dir(folder: Path, config: dict, *, resume: bool, overwrite: bool,
                  remove: tuple[str, ...] = STAGE_FILES) -> None:
    """After `check_run_dir`, holding the run's lock: delete the earlier run when `overwrite` (the
    entries `remove` names, nothing else), remove what an interrupted process left half-written,
    then record `config` in folder/config.json."""
    folder = Path(folder)
    if overwrite and folder.exists():
        for name in remove:
            path = folder / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        log.info("deleted the earlier run in %s (--overwrite)", folder)
    folder.mkdir(parents=True, exist_ok=True)
    remove_staging(folder)
    write_json_atomic(folder / CONFIG_FILE, config)


# ---------------------------------------------------------------- one run per folder

_held: dict[str, int] = {}  # resolved OUT -> the lock file's descriptor, for the locks this process holds


@contextlib.contextmanager
def run_lock(out: Path, what: str):
    """Hold OUT's lock for the body: an OS lock (`flock`) on OUT/.fastrlhf.lock, which records who
    holds it. Rank 0 takes it, the other ranks nothing; a process re-enters its own lock (the
    pipeline holds it, its stages re-enter). A folder another process holds is a ValueError naming
    that process (PID, host). OUT, created here for the lock, is removed again when the body leaves
    nothing else in it (a refused configuration leaves no folder behind)."""
    out = Path(out)
    key = str(out.resolve())
    if key in _held or not distributed.is_main():  # held by an enclosing call (the pipeline), or not rank 0
        yield
        return
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process that has not said who it is"
        os.close(fd)
        raise ValueError(f"{what}: {out} is in use by another run ({holder}; lock {path}); wait for it to end, or "
                         "stop it (SIGTERM: it writes a checkpoint, then continue here with --resume), or pick "
                         "another --out") from None
    except OSError as e:  # a file system without flock (some network mounts)
        os.close(fd)
        log.warning("%s: cannot lock %s (%s): a second run in this folder would not be refused", what, path, e)
        yield
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"PID {os.getpid()} on host {socket.gethostname()}, since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
    _held[key] = fd
    try:
        yield
    finally:
        del _held[key]
        os.close(fd)  # releases the lock
        if created and [p.name for p in out.iterdir()] == [LOCK_FILE]:
            path.unlink(missing_ok=True)
            out.rmdir()
