"""Stand-ins for the heavy runtime imports of verl and OpenRLHF (test fixtures only).

verl and OpenRLHF are installed with `--no-deps` (.ci/install_peers.sh): their loss and
log-prob modules import ray, deepspeed, vllm, flash-attn's padding helpers and serving
libraries at module level without using them on the paths tested here. `install()` adds a
finder at the END of sys.meta_path that serves empty stand-ins for those names only when no
real package is found. `flash_attn.ops` is never stubbed: the peers probe it to choose their
cross-entropy path, and must find it missing.
"""

import importlib.abc
import importlib.machinery
import sys
import types

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


def install():
    if not any(type(f).__name__ == "_StubFinder" for f in sys.meta_path):
        sys.meta_path.append(_StubFinder())
