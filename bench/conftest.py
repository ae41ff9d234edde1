"""Options for the pytest-benchmark suite (`pytest bench/ --benchmark-only`).

    --bench-device cuda|cpu   default: cuda when available
    --bench-quick / --bench-full
                              the small CPU shapes or the realistic ones
                              (default: full on CUDA, quick on CPU)
    --bench-rounds N          timed rounds per test (default 10 on CUDA, 3 on CPU)
"""

from __future__ import annotations

import pytest
import torch

from fastrlhf import bench


def pytest_addoption(parser):
    group = parser.getgroup("fastrlhf bench")
    group.addoption("--bench-device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    group.addoption("--bench-quick", action="store_true", default=None, help="the small (CPU) shapes")
    group.addoption("--bench-full", action="store_false", dest="bench_quick", help="the realistic shapes")
    group.addoption("--bench-rounds", type=int, default=None, help="timed rounds per test")


def bench_device(config) -> torch.device:
    name = config.getoption("--bench-device") or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--bench-device {name}: CUDA is not available")
    return device


def bench_quick(config) -> bool:
    quick = config.getoption("bench_quick")
    return bench_device(config).type == "cpu" if quick is None else quick


@pytest.fixture(scope="session")
def device(pytestconfig) -> torch.device:
    return bench_device(pytestconfig)


@pytest.fixture(scope="session")
def rounds(pytestconfig, device) -> int:
    return pytestconfig.getoption("--bench-rounds") or (10 if device.type == "cuda" else 3)


def pytest_generate_tests(metafunc):
    """`item` = (case, pass, provider) for every case of fastrlhf.bench.cases."""
    if "item" not in metafunc.fixturenames:
        return
    quick = bench_quick(metafunc.config)
    items, ids = [], []
    for case in bench.cases(quick):
        op = bench.OPS[case.op]
        for provider in (*op.providers, "torch.compile"):
            for pass_ in case.passes:
                if pass_ in getattr(op.providers.get(provider), "passes", bench.PASSES):
                    items.append((case, pass_, provider))
                    shape = case.shape.replace(" ", ",")
                    ids.append(f"{case.op}-{pass_}-{provider}-{shape}-{case.dtype_name}")
    metafunc.parametrize("item", items, ids=ids)
