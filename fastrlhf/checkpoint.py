"""Checkpoints, resume and atomic writes.

A stage's folder, OUT/<stage>/:

    config.json                the stage's configuration, defaults resolved (written when it starts)
    checkpoints/step_000050/   model.safetensors (trainable weights), optimizer.pt, state.pt (step, RNG, extra)
    checkpoints/latest         one line: the folder name of the newest complete checkpoint
    final/                     a Hugging Face model directory (+ tokenizer, + head files, + fastrlhf.json)

Resume safety (`check_run_dir`, before any model loads): a fresh run in a folder that holds a
run is refused unless `--overwrite` (which deletes it) or `--resume`; `--resume` refuses a
configuration that differs from the recorded one (apart from `RESUME_FREE_KEYS`; the paths of
`PATH_KEYS` compared as paths, inside the run folder relative to it, so a moved folder resumes)
and says so when there is no checkpoint to resume from.

Every folder and JSON file is first written under a temporary name beside its destination
and then moved into place with `os.replace`, so a crash never leaves half a checkpoint and
`latest` only ever names a complete one.

What a checkpoint holds is written and read by `_write_state` / `_read_state` alone; the
rest (folders, the `latest` pointer, pruning, resume) does not look inside. Under torchrun
`_write_sharded` / `_read_sharded` replace them: torch.distributed.checkpoint writes the
sharded weights and optimizer state (`.metadata` + one `.distcp` file per rank, reshardable
to another number of ranks), and each rank its own `rank_NNNNN.pt` (step, RNG, extra). Every
rank writes into the same temporary folder; rank 0 publishes it once all are done. A
sharded checkpoint also resumes in a single process; a single-process one only there.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fastrlhf import distributed

log = logging.getLogger("fastrlhf")

LATEST = "latest"
CONFIG_FILE = "config.json"
# keys a resumed run may change (the run folder may move; sharded checkpoints reshard)
RESUME_FREE_KEYS = ("out", "steps", "stop_after", "resume", "overwrite", "log_every", "save_every", "eval_every",
                    "tensorboard", "shard")
PATH_KEYS = ("model", "data", "reward")  # compared on resume as the paths they name, not as spelled


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


def write_json_atomic(path: Path, obj) -> None:
    """`obj` as indented, valid JSON at `path` (NaN/inf as null), via a temporary file and `os.replace`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(json_safe(obj), indent=2, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, path)


def staging_dir(path: Path) -> Path:
    """An empty temporary folder beside `path`, to be published with `publish_dir`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish_dir(tmp: Path, path: Path) -> None:
    """Atomically publish a finished folder: an existing one is renamed away first, then removed."""
    path = Path(path)
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def save_model_dir(lm, tokenizer, path: Path, extra: dict[str, dict[str, torch.Tensor]] | None = None,
                   lineage: dict | None = None) -> None:
    """A Hugging Face model directory (+ tokenizer, + extra safetensors files, + `lineage` as
    fastrlhf.json: see fastrlhf.models), published atomically."""
    tmp = staging_dir(path)
    lm.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for filename, tensors in (extra or {}).items():
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / filename)
    if lineage is not None:
        write_json_atomic(tmp / "fastrlhf.json", lineage)
    publish_dir(tmp, path)


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


def _read_state(folder: Path, module: nn.Module, optimizer) -> dict:
    """Load the weights into `module` (every saved tensor must match a parameter) and the
    optimizer state; returns the meta dict."""
    params = dict(module.named_parameters())
    weights = load_file(folder / "model.safetensors")
    unknown = set(weights) - set(params)
    if unknown:
        raise ValueError(f"checkpoint {str(folder)!r} holds tensors the model does not have: {sorted(unknown)[:5]}")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True))
    return torch.load(folder / "state.pt", map_location="cpu", weights_only=True)


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

    saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    model_state, optim_state = get_state_dict(module, optimizer)
    model_state = {k: v for k, v in model_state.items() if f"model.{k}" in saved}
    unknown = {k[len("model."):] for k in saved if k.startswith("model.")} - set(model_state)
    if unknown:
        raise ValueError(f"checkpoint {str(folder)!r} holds tensors the model does not have: {sorted(unknown)[:5]}")
    dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder))
    set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(strict=False))
    own = _rank_file(folder, distributed.rank())
    meta = torch.load(own if own.is_file() else _rank_file(folder, 0), map_location="cpu", weights_only=True)
    if meta["world_size"] != distributed.world_size():
        log.warning("checkpoint %s was written by %d rank(s), resumed on %d: weights and optimizer state are "
                    "resharded; the random streams differ from an uninterrupted run", folder, meta["world_size"],
                    distributed.world_size())
    return meta


def save_checkpoint(stage_dir: Path, step: int, weights: dict[str, torch.Tensor], optimizer, extra: dict,
                    keep: int = 2, module: nn.Module | None = None) -> Path:
    """stage_dir/checkpoints/step_{step:06d}/, then `latest` points at it. Only this checkpoint
    and the newest `keep - 1` before it stay; any with a later step (from a run this one
    replaces) are removed, so `latest` always names the newest checkpoint on disk. Under
    torchrun every rank calls this (`module`: the model that holds `weights`)."""
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
        _write_sharded(tmp, module, weights, optimizer, meta)
        distributed.barrier()  # every rank's shards are on disk
    else:
        root.mkdir(parents=True, exist_ok=True)
        tmp = staging_dir(final)
        _write_state(tmp, weights, optimizer, meta)
    with distributed.main_first() as main:
        if main:
            publish_dir(tmp, final)
            pointer = root / f".{LATEST}.tmp"
            pointer.write_text(final.name + "\n")
            os.replace(pointer, root / LATEST)
            older = sorted(p for p in root.glob("step_*") if p.name < final.name)
            newer = [p for p in root.glob("step_*") if p.name > final.name]
            for old in older[:max(0, len(older) - (keep - 1))] + newer:
                shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(stage_dir: Path) -> Path | None:
    """The checkpoint `latest` names; None when there is none. A `latest` that names a missing
    folder is an error, never a silent fresh start."""
    pointer = Path(stage_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not path.is_dir():
        raise ValueError(f"{pointer} names {path.name}, which does not exist; the checkpoints in "
                         f"{pointer.parent} are inconsistent (start over with --overwrite)")
    return path


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
    """(step, extra) of the stage's latest checkpoint, loaded into `module` and `optimizer`, when
    `enabled` and one exists; None otherwise (a fresh start, said in the log when resuming)."""
    if not enabled:
        return None
    ckpt = latest_checkpoint(stage_dir)
    if ckpt is None:
        log.warning("%s: --resume, but %s holds no checkpoint: starting from step 0", stage,
                    Path(stage_dir) / "checkpoints")
        return None
    state = load_checkpoint(ckpt, module, optimizer)
    log.info("%s: resumed from %s (step %d)", stage, ckpt, state["step"])
    return state["step"], state["extra"]


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


def config_changes(recorded: dict, current: dict, free=RESUME_FREE_KEYS) -> list[str]:
    """'key: recorded -> current' for every key that differs, keys in `free` (at any depth) aside.
    Path-valued keys (PATH_KEYS) differ only when they name other paths (`_as_path`): `m` and
    `/abs/m` are the same model, and OUT/sft/final is the same in a run folder that moved."""
    a, b = _flat(recorded), _flat(current)
    pa, pb = _paths(recorded), _paths(current)
    keys = [k for k in sorted(set(a) | set(b)) if k.rsplit(".", 1)[-1] not in free]
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in keys
            if a.get(k) != b.get(k) and (k not in pa or k not in pb or pa[k] != pb[k])]


def describe_run(folder: Path) -> str | None:
    """What an earlier run left in a stage folder ("checkpoints up to step 120, a final model"), or None."""
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.iterdir()):
        return None
    parts = []
    steps = sorted(p.name for p in (folder / "checkpoints").glob("step_*"))
    if steps:
        parts.append(f"checkpoints up to step {int(steps[-1][5:])}")
    if (folder / "final").is_dir():
        parts.append("a final model")
    if (folder / CONFIG_FILE).is_file():
        parts.append("a recorded configuration")
    return ", ".join(parts) or "files"


def check_run_dir(folder: Path, config: dict, *, resume: bool, overwrite: bool, what: str) -> None:
    """Refuse, before any model loads, a run that would silently mix with an earlier one in
    `folder` (a stage folder, or the pipeline's OUT): a fresh run where one exists (unless
    `overwrite`), or `resume` with a configuration that differs from the recorded one."""
    if resume and overwrite:
        raise ValueError(f"{what}: --resume and --overwrite contradict each other; pass one")
    found = describe_run(folder)
    if found is None or overwrite:
        return
    if not resume:
        raise ValueError(f"{what}: {folder} already holds a run ({found}); pass --resume to continue it, or "
                         "--overwrite to delete it and start over")
    recorded = Path(folder) / CONFIG_FILE
    if recorded.is_file():
        changes = config_changes(json.loads(recorded.read_text()), config)
        if changes:
            raise ValueError(f"{what}: --resume with a configuration that differs from the one recorded in "
                             f"{recorded}: {'; '.join(changes)}. Restore those values, or start over with "
                             "--overwrite")


def start_run_dir(folder: Path, config: dict, *, resume: bool, overwrite: bool,
                  remove: tuple[str, ...] | None = None) -> None:
    """After `check_run_dir`: delete the earlier run when `overwrite` (the entries `remove`
    names, or the whole folder), then record `config` in folder/config.json."""
    folder = Path(folder)
    if overwrite and folder.exists():
        if remove is None:
            shutil.rmtree(folder)
        else:
            for name in remove:
                path = folder / name
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
        log.info("deleted the earlier run in %s (--overwrite)", folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / CONFIG_FILE, config)
