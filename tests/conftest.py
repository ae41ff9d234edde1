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


RELAID = re.compile(r"^tests/(?:ops|trainer|bench)/")


@pytest.fixture(autouse=True)
def seed(request):
    """A different, reproducible seed per test: fresh random inputs, same on every run. It hashes the test's
    id as it was before tests/ was laid out like the package (RELAID folders' files were then at the top), so
    the move changed no draw."""
    s = zlib.crc32(RELAID.sub("tests/", request.node.nodeid, count=1).encode())
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
