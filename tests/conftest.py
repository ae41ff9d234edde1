"""Shared fixtures. Without CUDA, Triton kernels run in the interpreter: the variable must
be set before triton is first imported, which is why it is set here, at collection."""

import logging
import os
import random
import re
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI replays a fixed set of examples (a landing never hinges on a new draw); locally,
# every run explores new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# A test's seed hashes its id with the file's first path: tests/ was flat when the seeds were first drawn, and
# moving a file into a folder (or renaming it) changes no draw.
FOLDERS = re.compile(r"^tests/(?:ops|bench|train/recipes|train)/")
RENAMED = {"tests/train/recipes/test_distill.py": "tests/test_distill_stage.py",
           "tests/train/recipes/test_algos.py": "tests/test_algos_trainer.py",
           "tests/train/recipes/test_ppo_rollout_correction.py": "tests/test_rollout_correction_trainer.py"}


def first_id(nodeid: str) -> str:
    path, sep, rest = nodeid.partition("::")
    return (RENAMED.get(path) or FOLDERS.sub("tests/", path, count=1)) + sep + rest


@pytest.fixture(autouse=True)
def seed(request):
    """A different, reproducible seed per test: fresh random inputs, same on every run (`first_id`)."""
    s = zlib.crc32(first_id(request.node.nodeid).encode())
    torch.manual_seed(s)
    random.seed(s)
    return s


def _on_the_gpu(request) -> None:
    """With CUDA, the test's tensors are made on the GPU (torch's default device), so the kernels run
    compiled, not in the interpreter, and the torch path runs on CUDA too."""
    if torch.cuda.is_available():
        torch.set_default_device("cuda")
        request.addfinalizer(lambda: torch.set_default_device(None))


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Run a test through the torch path and through the Triton kernels (on the GPU where there is one)."""
    monkeypatch.setenv("FASTRLHF_BACKEND", request.param)
    _on_the_gpu(request)
    return request.param


@pytest.fixture
def triton_backend(request, monkeypatch):
    """Run a test through the Triton kernels only (on the GPU where there is one)."""
    monkeypatch.setenv("FASTRLHF_BACKEND", "triton")
    _on_the_gpu(request)


@pytest.fixture
def device():
    return DEVICE


def _interpreted(item) -> bool:
    """The test runs the Triton kernels, in the interpreter on a CPU: the `backend` fixture's triton case, or the
    `triton_backend` fixture."""
    params = getattr(item, "callspec", None)
    return (params is not None and params.params.get("backend") == "triton") or \
        "triton_backend" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
        elif _interpreted(item):
            item.add_marker(pytest.mark.slow)  # seconds in the interpreter; on a GPU they are fast


@pytest.fixture
def keep_threads_and_warnings():
    """load_causal_lm drops to one thread for tiny CPU models; cli.main routes warnings into logging:
    both are put back after the test (a module opts in with `pytest.mark.usefixtures`)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
    logging.captureWarnings(False)
