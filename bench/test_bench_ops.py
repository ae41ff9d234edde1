"""pytest-benchmark over the `fastrlhf bench` cases: `pytest bench/ --benchmark-only`.

One test per (case, pass, provider), parametrised in conftest.py: the same cases, inputs and
providers as the CLI (`fastrlhf.bench`), each on fresh inputs. Each round runs one pass on the
next rotated input copy and then synchronises the device, so the wall-clock timer of
pytest-benchmark sees the whole kernel time; gradients are reset in the (untimed) setup.
`extra_info` carries the bytes counted and the GB/s at the median. For the roofline against
the read / copy probes, peak memory and the targets, use `fastrlhf bench`.
"""

from __future__ import annotations

import pytest
import torch

from fastrlhf import bench


def test_op(benchmark, item, device, rounds):
    case, pass_, provider = item
    try:
        fn, autograd = bench.load_provider(case.op, provider, pass_, device, no_compile=bench.OPS[case.op].no_compile)
    except bench.Skip as exc:
        pytest.skip(str(exc))
    if provider == "torch.compile":
        torch._dynamo.reset()
    l2 = 16 * 2**20
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or l2
    pool = bench.make_pool(case, bench.Settings(device, rep_ms=0.0, rotate_bytes=4 * l2))
    try:
        runner, grads = bench.make_runner(pass_, fn, autograd, pool, device)
        for _ in range(bench.warmup_calls(provider)):  # compiles torch.compile graphs and kernels
            runner()
    except NotImplementedError as exc:
        pytest.skip(f"{provider} {case.op}: {exc}")

    def clear_grads():
        for t in grads:
            t.grad = None

    def one_pass():
        runner()
        bench.sync(device)

    benchmark.group = f"{case.op} {pass_} {case.shape} {case.dtype_name}"
    benchmark.pedantic(one_pass, setup=clear_grads, rounds=rounds, warmup_rounds=1)
    clear_grads()
    counted = bench.case_bytes(case)[pass_]
    benchmark.extra_info.update(op=case.op, shape=case.shape, dtype=case.dtype_name, pass_=pass_,
                                provider=provider, bytes=counted)
    if benchmark.stats is not None:
        median_s = benchmark.stats.stats.median
        benchmark.extra_info["gbps"] = counted / bench.GB / median_s
        assert median_s > 0
