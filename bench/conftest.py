"""Options for the pytest-benchmark suite (`pytest bench/ --benchmark-only`).

    --bench-device cuda|cpu   default: cuda when available
    --bench-cases SET         targets, full, quick or tiny (default: full on CUDA, quick on CPU)
    --bench-rounds N          timed rounds per test (default 10 on CUDA, 3 on CPU)
"""

from __future__ import annotations

import pytest
import torch

from fastrlhf import bench


def pytest_addoption(parser):
    group = parser.getgroup("fastrlhf bench")
    group.addoption("--bench-device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    group.addoption("--bench-cases", default=None, choices=tuple(bench.CASE_SETS),
                    help="case set (default: full on CUDA, quick on CPU)")
    group.addoption("--bench-rounds", type=int, default=None, help="timed rounds per test")


def bench_device(config) -> torch.device:
    name = config.getoption("--bench-device") or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--bench-device {name}: CUDA is not available")
    return device


def bench_cases(config) -> str:
    return config.getoption("--bench-cases") or ("full" if bench_device(config).type == "cuda" else "quick")


@pytest.fixture(scope="session")
def device(pytestconfig) -> torch.device:
    return bench_device(pytestconfig)


@pytest.fixture(scope="session")
def rounds(pytestconfig, device) -> int:
    return pytestconfig.getoption("--bench-rounds") or (10 if device.type == "cuda" else 3)


def pytest_generate_tests(metafunc):
    """`item` = (case, pass, provider) for every case of the chosen set."""
    if "item" not in metafunc.fixturenames:
        return
    items, ids = [], []
    for case in bench.cases(bench_cases(metafunc.config)):
        for provider in bench.providers_of(case.op):
            for pass_ in bench.passes_of(case.op, provider, case.passes):
                items.append((case, pass_, provider))
                ids.append(f"{case.op}-{pass_}-{provider}-{case.shape.replace(' ', ',')}-{case.dtype_name}")
    metafunc.parametrize("item", items, ids=ids)
