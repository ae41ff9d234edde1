"""The project's names never shadow a dependency's: every folder the project puts on `sys.path` (the repository
root for `python -m fastrlhf` and pytest, tests/ for the tests' own imports, bench/ for its scripts) holds no
module or regular package under a top-level name that an installed distribution provides (Hugging Face's
`kernels`, which transformers imports, was one). The wheel holds `fastrlhf`, and beside it only the
FASTRLHF_PATCH switch: the stdlib-only `fastrlhf_hook` and its `fastrlhf-patch.pth`."""

import importlib.metadata
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT, run_cli

SEARCHED = (ROOT, ROOT / "tests", ROOT / "bench")


def _importable(folder: Path) -> set[str]:
    """Top-level names a module file or a regular package (a folder with __init__.py) in `folder` gives.
    A folder without __init__.py is a namespace portion, which any regular package of the name takes
    precedence over, so it shadows nothing."""
    names = {p.stem for p in folder.glob("*.py")}
    return names | {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}


@pytest.mark.parametrize("folder", SEARCHED, ids=lambda p: str(p.relative_to(ROOT)) or ".")
def test_no_top_level_name_a_dependency_uses(folder):
    theirs = importlib.metadata.packages_distributions()
    ours = {"fastrlhf", "fastrlhf_hook"}  # what this project's own distribution installs
    clashes = {name: theirs[name] for name in _importable(folder) - ours if name in theirs}
    assert not clashes, f"{folder} shadows the installed distributions' top-level names: {clashes}"


@pytest.mark.skipif(importlib.util.find_spec("kernels") is None, reason="Hugging Face's kernels is not installed")
def test_hf_kernels_and_the_cli_from_the_repository_root(tmp_path):
    """From the root (its folder first on sys.path), `import kernels` is Hugging Face's, and the CLI, whose
    transformers imports it, runs."""
    code = "import kernels; from kernels import CUDAProperties; print(kernels.__file__)"
    where = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr[-2000:]
    assert "site-packages" in Path(where.stdout.strip()).parts, where.stdout
    out = run_cli("sft", "--steps", "1", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "sft" / "final").is_dir()


def test_wheel_holds_fastrlhf_and_the_switch_with_its_kernels_and_data(tmp_path):
    """`pip wheel .`: fastrlhf and the FASTRLHF_PATCH switch (fastrlhf_hook and the .pth that starts it) at the
    top, the kernels inside fastrlhf, the planner's data files shipped."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("fastrlhf-*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    tops = {f.split("/")[0] for f in files if not f.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"fastrlhf", "fastrlhf_hook", "fastrlhf-patch.pth"}, tops
    kernels = {Path(f).name for f in files if f.startswith("fastrlhf/kernels/")}
    assert {p.name for p in (ROOT / "fastrlhf" / "kernels").glob("*.py")} <= kernels
    assert any(f.startswith("fastrlhf/estimate/data/") and f.endswith(".json") for f in files)
