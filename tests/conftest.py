"""Shared fixtures. Without CUDA, Triton kernels run in the interpreter: the variable must
be set before triton is first imported, which is why it is set here, at collection."""

import os
import random
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


@pytest.fixture(autouse=True)
def seed(request):
    """A different, reproducible seed per test: fresh random inputs, same on every run."""
    s = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(s)
    random.seed(s)
    return s


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Run a test through the torch path and through the Triton kernels."""
    monkeypatch.setenv("FASTRLHF_BACKEND", request.param)
    return request.param


@pytest.fixture
def device():
    return DEVICE


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
