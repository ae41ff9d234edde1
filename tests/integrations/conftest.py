"""Fixtures for the integration tests: the real peers, with their heavy runtime imports stubbed.

verl and OpenRLHF are installed with `--no-deps` (.ci/install_peers.sh): their loss and
log-prob modules import ray, deepspeed, vllm, flash-attn's padding helpers and serving
libraries at module level without using them on these paths. A finder at the END of
sys.meta_path serves empty stand-ins for those names only when no real package is found;
it lives here, in the test fixtures, never in library code. `flash_attn.ops` is never
stubbed: the peers probe it to choose their cross-entropy path, and must find it missing.
"""

import importlib.abc
import importlib.machinery
import sys
import types

import pytest

STUB_PACKAGES = {"ray", "vllm", "deepspeed", "aiohttp", "fastapi", "uvicorn", "torchdata"}
STUB_MODULES = {"flash_attn", "flash_attn.bert_padding", "flash_attn.utils", "flash_attn.utils.distributed"}


class _Anything:
    """Stands for any attribute of a stubbed module: callable, subclassable, decorating."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # used as a decorator
            return args[0]
        return _Anything()

    def __getattr__(self, name):
        return _Anything()

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STUB_PACKAGES or name in STUB_MODULES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.append(_StubFinder())


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
