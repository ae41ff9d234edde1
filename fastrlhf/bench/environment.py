"""Where it was measured: device, clocks, nominal bandwidth, versions and source revision.

    python -c "from fastrlhf.bench.environment import main; main()"   # the JSON record's environment part

The source revision is the git commit and `git rev-parse HEAD:fastrlhf/kernels` when git works, and in
every case `kernels_tree_files`: the same git tree hash computed from the files on disk
(`__pycache__` and `*.pyc` left out, as .gitignore does), so a copy of the tree without
`.git` still says which kernels ran; `dirty` is true when the two differ or git reports
changes under fastrlhf/.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "fastrlhf" / "kernels"

# nvidia-smi --query-gpu fields: identity, state, and the clocks (MHz) now and at most
SMI_FIELDS = ("name", "driver_version", "pstate", "temperature.gpu", "power.draw", "power.limit",
              "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "memory.total")


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git(*args: str) -> str | None:
    return _run(["git", "-C", str(ROOT), *args], timeout=10)


# ---------------------------------------------------------------- source revision


def _git_object(kind: str, body: bytes) -> bytes:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).digest()


def tree_hash(path: Path) -> bytes:
    """git's tree object id for the directory at `path` (files as they are on disk)."""
    entries = []
    for child in path.iterdir():
        if child.name in ("__pycache__", ".git") or child.suffix == ".pyc":
            continue
        if child.is_symlink():
            mode, digest = b"120000", _git_object("blob", os.readlink(child).encode())
        elif child.is_dir():
            if not any(child.iterdir()):
                continue  # git stores no empty directories
            mode, digest = b"40000", tree_hash(child)
        else:
            mode = b"100755" if os.access(child, os.X_OK) else b"100644"
            digest = _git_object("blob", child.read_bytes())
        key = child.name + ("/" if mode == b"40000" else "")  # git sorts a directory as "name/"
        entries.append((key.encode(), mode + b" " + child.name.encode() + b"\0" + digest))
    return _git_object("tree", b"".join(body for _, body in sorted(entries)))


def revision() -> dict:
    """commit, kernels_tree (git), kernels_tree_files (from the files) and dirty."""
    commit, kernels_tree = git("rev-parse", "HEAD"), git("rev-parse", "HEAD:fastrlhf/kernels")
    files = tree_hash(KERNELS).hex() if KERNELS.is_dir() else None
    status = git("status", "--porcelain", "--", "fastrlhf")
    dirty = (kernels_tree is not None and files != kernels_tree) or bool(status)
    return {"commit": commit, "kernels_tree": kernels_tree, "kernels_tree_files": files,
            "dirty": dirty if commit is not None else None}


# ---------------------------------------------------------------- GPU state


def gpu_state(index: int = 0) -> dict | None:
    """nvidia-smi's SMI_FIELDS for GPU `index` (numbers as floats, '[N/A]' as None), or None
    when nvidia-smi is missing or fails. Clocks in MHz."""
    if shutil.which("nvidia-smi") is None:
        return None

    def query(fields) -> list[str] | None:
        out = _run(["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
        return None if out is None else [v.strip() for v in out.splitlines()[0].split(",")]

    values = query(SMI_FIELDS)
    if values is None or len(values) != len(SMI_FIELDS):  # an old nvidia-smi lacks a field: ask one by one
        values = [(query([f]) or [None])[0] for f in SMI_FIELDS]
    state = {}
    for name, value in zip(SMI_FIELDS, values):
        if value is None or value.startswith("[") or value == "N/A":
            state[name] = None
        else:
            try:
                state[name] = float(value)
            except ValueError:
                state[name] = value
    return state


def nominal_bandwidth(device: torch.device, state: dict | None) -> dict:
    """Nominal DRAM bandwidth = 2 (double data rate) x memory clock x bus width / 8, from the
    device properties, or nvidia-smi's maximum memory clock with the properties' bus width.
    Returns {"gbps": float or None, "source": how it was had}."""
    props = torch.cuda.get_device_properties(device)
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    if bus_bits and clock_khz:
        return {"gbps": 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9,
                "source": f"2 x memory_clock_rate {clock_khz / 1e3:.0f} MHz x memory_bus_width {bus_bits} bit / 8"}
    smi_mhz = (state or {}).get("clocks.max.mem")
    if bus_bits and isinstance(smi_mhz, float):
        return {"gbps": 2 * smi_mhz * 1e6 * bus_bits / 8 / 1e9,
                "source": f"2 x nvidia-smi clocks.max.mem {smi_mhz:.0f} MHz x memory_bus_width {bus_bits} bit / 8"}
    return {"gbps": None, "source": "unknown: torch reports no memory bus width / clock on this version"}


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        cpu = platform.processor() or platform.machine()
        return {"device": f"CPU: {cpu}, {torch.get_num_threads()} threads", "kind": "cpu", "driver": None,
                "cuda": None, "gpu": None}
    props = torch.cuda.get_device_properties(device)
    state = gpu_state(device.index or 0)
    sm_khz = getattr(props, "clock_rate", 0) or None
    gpu = {"sm_count": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
           "memory_bytes": props.total_memory, "l2_bytes": getattr(props, "L2_cache_size", None),
           "memory_bus_width_bits": getattr(props, "memory_bus_width", None),
           "sm_clock_mhz_props": sm_khz and sm_khz / 1e3, "nominal_bandwidth": nominal_bandwidth(device, state),
           "state_at_start": state}
    return {"device": props.name, "kind": "cuda", "driver": (state or {}).get("driver_version"),
            "cuda": torch.version.cuda, "gpu": gpu}


def environment(device: torch.device) -> dict:
    """Device, versions and source revision for the JSON record."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {**device_info(device), "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(), **revision()}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(json.dumps(environment(device), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
