"""Fixtures for the integration tests: the real peers (skipped when not installed), with their
heavy runtime imports stubbed by peer_stubs (test fixtures only, never library code)."""

import pytest

from . import peer_stubs

peer_stubs.install()


@pytest.fixture(autouse=True)
def _forget_stubs():
    """The stand-ins never outlive a test: other code probing for vllm / deepspeed finds none."""
    yield
    peer_stubs.forget()


def _peer(module: str, integration: str):
    pytest.importorskip(module, reason=f"{module} is not installed (.ci/install_peers.sh installs it)")
    integ = __import__(f"fastrlhf.integrations.{integration}", fromlist=["patch"])
    integ.unpatch()
    return integ


@pytest.fixture
def verl_integration():
    """fastrlhf.integrations.verl, unpatched before and after the test."""
    integ = _peer("verl.trainer.ppo.core_algos", "verl")
    yield integ
    integ.unpatch()


@pytest.fixture
def openrlhf_integration():
    integ = _peer("openrlhf.models.utils", "openrlhf")
    yield integ
    integ.unpatch()


@pytest.fixture
def trl_integration():
    integ = _peer("trl.trainer.utils", "trl")
    yield integ
    integ.unpatch()


@pytest.fixture
def op_calls(monkeypatch):
    """Counts calls of the public fastrlhf ops (by name), to tell the fused path from a fallback."""
    import collections

    import fastrlhf

    calls = collections.Counter()
    for name in fastrlhf.__all__:
        op = getattr(fastrlhf, name)

        def counted(*args, _op=op, _name=name, **kwargs):
            calls[_name] += 1
            return _op(*args, **kwargs)

        monkeypatch.setattr(fastrlhf, name, counted)
    return calls
