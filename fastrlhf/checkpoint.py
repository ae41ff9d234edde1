"""Checkpoints, resume and atomic writes.

A stage's folder, OUT/<stage>/:

    checkpoints/step_000050/   model.safetensors (trainable weights), optimizer.pt, state.pt (step, RNG, extra)
    checkpoints/latest         one line: the folder name of the newest complete checkpoint
    final/                     a Hugging Face model directory (+ tokenizer, + head files)

Every folder and JSON file is first written under a temporary name beside its destination
and then moved into place with `os.replace`, so a crash never leaves half a checkpoint and
`latest` only ever names a complete one.

What a checkpoint holds is written and read by `_write_state` / `_read_state` alone; the
rest (folders, the `latest` pointer, pruning, resume) does not look inside. Sharded
checkpoints (torch.distributed.checkpoint: every rank writes its shards into the same
temporary folder, rank 0 publishes it once all are done) replace those two functions.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

log = logging.getLogger("fastrlhf")

LATEST = "latest"


# ---------------------------------------------------------------- atomic writes


def write_json_atomic(path: Path, obj) -> None:
    """`obj` as indented JSON at `path`, via a temporary file and `os.replace`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
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


def save_model_dir(lm, tokenizer, path: Path, extra: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
    """A Hugging Face model directory (+ tokenizer, + extra safetensors files), published atomically."""
    tmp = staging_dir(path)
    lm.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for filename, tensors in (extra or {}).items():
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / filename)
    publish_dir(tmp, path)


# ---------------------------------------------------------------- RNG


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, _, gauss = random.getstate()
    random.setstate((version, tuple(state["python"]), gauss))
    if "cuda" in state and torch.cuda.is_available():
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


def save_checkpoint(stage_dir: Path, step: int, weights: dict[str, torch.Tensor], optimizer, extra: dict,
                    keep: int = 2) -> Path:
    """stage_dir/checkpoints/step_{step:06d}/, then `latest` points at it; only the newest
    `keep` checkpoints stay."""
    root = Path(stage_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = staging_dir(final)
    _write_state(tmp, weights, optimizer, {"step": step, "rng": rng_state(), "extra": extra})
    publish_dir(tmp, final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / LATEST)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(stage_dir: Path) -> Path | None:
    pointer = Path(stage_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if path.is_dir() else None


def load_checkpoint(path: Path, module: nn.Module, optimizer) -> dict:
    """Load weights into `module`, the optimizer state and the RNG state; returns {"step", "extra"}."""
    state = _read_state(Path(path), module, optimizer)
    set_rng_state(state["rng"])
    return {"step": int(state["step"]), "extra": state["extra"]}


def resume_from_checkpoint(stage_dir: Path, module: nn.Module, optimizer, enabled: bool, stage: str):
    """(step, extra) of the stage's latest checkpoint, loaded into `module` and `optimizer`, when
    `enabled` and one exists; None otherwise (a fresh start)."""
    ckpt = latest_checkpoint(stage_dir) if enabled else None
    if ckpt is None:
        return None
    state = load_checkpoint(ckpt, module, optimizer)
    log.info("%s: resumed from %s (step %d)", stage, ckpt, state["step"])
    return state["step"], state["extra"]
