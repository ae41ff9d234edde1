"""Stand-ins for the heavy runtime imports of verl and OpenRLHF (test fixtures only).

verl and OpenRLHF are installed with `--no-deps` (.ci/install_peers.sh): their loss and
log-prob modules import ray, deepspeed, vllm, flash-attn's padding helpers and serving
libraries at module level without using them on the paths tested here. `install()` adds a
finder at the END of sys.meta_path that serves empty stand-ins for those names only when no
real package is found AND the import comes straight from a peer's module (verl, openrlhf, or
the `tests` package their wheels ship): TRL and transformers probing for vllm or deepspeed
still find nothing. `forget()` drops the stand-ins from sys.modules again (the peer modules
keep their references). `flash_attn.ops` is never stubbed: the peers probe it to choose their
cross-entropy path, and must find it missing.
"""

import importlib.abc
import importlib.machinery
import sys
import types

STUB_PACKAGES = {"ray", "vllm", "deepspeed", "aiohttp", "fastapi", "uvicorn", "torchdata"}
PEER_PACKAGES = {"verl", "openrlhf", "tests"}
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


def _imported_by_peer() -> bool:
    """Whether the code asking for the module (the first frame outside the import machinery)
    belongs to a peer package."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen") or "importlib" in
                                 frame.f_code.co_filename):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in PEER_PACKAGES


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if (name.split(".")[0] in STUB_PACKAGES or name in STUB_MODULES) and _imported_by_peer():
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


def forget():
    """Drop the stand-ins from sys.modules, so that code probing for e.g. vllm later finds none."""
    for name, module in list(sys.modules.items()):
        if isinstance(module, _StubModule):
            del sys.modules[name]
