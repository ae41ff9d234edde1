"""pytest plugin that runs a peer's OWN unit tests with fastrlhf's patch() applied.

    FASTRLHF_PATCH=verl python -m pytest -p peer_suite_plugin <verl's test files>

(with tests/integrations on PYTHONPATH). FASTRLHF_PATCH names the integrations to apply
(comma-separated; "none" runs the peer's tests unpatched, for the baseline count).
tests/integrations/test_peer_suites.py runs it for verl, OpenRLHF and TRL.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import peer_stubs  # noqa: E402

peer_stubs.install()


def pytest_configure(config):
    import importlib

    for peer in filter(None, os.environ.get("FASTRLHF_PATCH", "").split(",")):
        if peer != "none":
            importlib.import_module(f"fastrlhf.integrations.{peer}").patch()


def pytest_terminal_summary(terminalreporter):
    from fastrlhf.integrations import is_patched

    peers = [p for p in os.environ.get("FASTRLHF_PATCH", "").split(",") if p and p != "none"]
    active = [p for p in peers if is_patched(p)]
    backend = os.environ.get("FASTRLHF_BACKEND", "auto")
    terminalreporter.write_line(f"fastrlhf patched: {','.join(active) or 'none'} (backend {backend})")
