"""An interpreter with fastrlhf's FASTRLHF_PATCH hook installed the way a user installs it (test helper).

`hooked_python(base)` is sys.executable when this interpreter already has this checkout installed
editable with the hook (CI's `pip install -e ".[dev]"`: fastrlhf-patch.pth in site-packages, the
verl.plugins entry point registered), else a throwaway venv under `base`: `python -m venv
--without-pip --system-site-packages`, this interpreter's site-packages added as a site dir (so
its peers and their .pth files load), then `pip install --no-deps --no-build-isolation -e` of this
checkout, which writes the .pth and the entry point. Built once per test session (file lock:
xdist workers share it).
"""

import fcntl
import importlib.metadata
import importlib.util
import os
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV_KEYS = ("FASTRLHF_PATCH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TRITON_INTERPRET")


def _has_hook() -> bool:
    spec = importlib.util.find_spec("fastrlhf_hook")
    if spec is None or not spec.origin or Path(spec.origin).resolve().parent != ROOT / "fastrlhf_hook":
        return False
    plugins = {ep.value for ep in importlib.metadata.entry_points(group="verl.plugins")}
    pth = any(Path(d, "fastrlhf-patch.pth").is_file() for d in site.getsitepackages())
    return pth and "fastrlhf_hook.verl_plugin" in plugins


def hooked_python(base: Path) -> str:
    if _has_hook():
        return sys.executable
    venv = base / "hooked-venv"
    python = venv / "bin" / "python"
    base.mkdir(parents=True, exist_ok=True)
    with open(base / "hooked-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / "ready").exists():
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                           check=True)
            sites = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                   check=True, capture_output=True, text=True).stdout.strip()
            parents = "; ".join(f"site.addsitedir({d!r})" for d in site.getsitepackages())
            Path(sites, "00-parent-site.pth").write_text(f"import site; {parents}\n")
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                            "--no-build-isolation", "-e", str(ROOT)], check=True, capture_output=True)
            (venv / "ready").touch()
    return str(python)


def clean_env(**extra) -> dict:
    """os.environ without the switch and launcher variables, plus `extra`; this checkout first on PYTHONPATH
    (the editable install points at it too)."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "integrations")])
    env.update(extra)
    return env
