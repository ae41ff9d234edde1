"""pytest plugin that runs a peer's OWN unit tests with fastrlhf's patch() applied.

    FASTRLHF_PATCH=verl python -m pytest -p peer_suite_plugin <verl's test files>

(with tests/integrations on PYTHONPATH). FASTRLHF_PATCH names the integrations to apply
(comma-separated; "none" runs the peer's tests unpatched, for the baseline count).
tests/integrations/test_peer_suites.py runs it for verl and OpenRLHF.

Some of OpenRLHF's tests do not import `openrlhf`: they execute private copies of its source
files (`importlib.util.spec_from_file_location(".../openrlhf/models/utils.py")` under another
module name) and test those. patch() only knows the real package, so this plugin carries each
replacement into such copies as they are executed: a copy's function or class attribute that
is the same source object (file and qualified name) as a patched original becomes the adapter.
The plugin reports how many fastrlhf op calls the suite made, so a suite that never reached the
patched code cannot pass for one that did.
"""

import collections
import importlib
import os
import sys
from importlib.machinery import SourceFileLoader

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import peer_stubs  # noqa: E402

peer_stubs.install()

OP_CALLS = collections.Counter()
_MIRRORED = collections.Counter()
_PEERS = [p for p in os.environ.get("FASTRLHF_PATCH", "").split(",") if p and p != "none"]


def pytest_configure(config):
    for peer in _PEERS:
        importlib.import_module(f"fastrlhf.integrations.{peer}").patch()
    _count_op_calls()
    _exec_module = SourceFileLoader.exec_module

    def exec_module(self, module):
        _exec_module(self, module)
        _mirror_into(module)

    SourceFileLoader.exec_module = exec_module


def pytest_terminal_summary(terminalreporter):
    from fastrlhf.integrations import is_patched

    active = [p for p in _PEERS if is_patched(p)]
    backend = os.environ.get("FASTRLHF_BACKEND", "auto")
    terminalreporter.write_line(f"fastrlhf patched: {','.join(active) or 'none'} (backend {backend})")
    terminalreporter.write_line(f"fastrlhf patches carried into copies of the peer's files: {sum(_MIRRORED.values())}")
    terminalreporter.write_line(f"fastrlhf op calls: {sum(OP_CALLS.values())} {dict(sorted(OP_CALLS.items()))}")


def _count_op_calls():
    import fastrlhf

    for name in fastrlhf.__all__:
        op = getattr(fastrlhf, name)
        if callable(op):
            def counted(*args, _op=op, _name=name, **kwargs):
                OP_CALLS[_name] += 1
                return _op(*args, **kwargs)

            setattr(fastrlhf, name, counted)


def _source_key(obj):
    """(source file, qualified name) of a function (a torch.compile'd one: of the function it wraps)."""
    fn = getattr(obj, "_torchdynamo_orig_callable", obj)
    path, name = getattr(getattr(fn, "__code__", None), "co_filename", None), getattr(fn, "__qualname__", None)
    if not isinstance(path, str) or not isinstance(name, str):
        return None
    return os.path.realpath(path), name


def _class_key(cls):
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    return (os.path.realpath(path), cls.__qualname__) if isinstance(path, str) else None


def _replacements():
    """{source key of a patched function: adapter}, {class key: [(attribute, adapter)]} over the active patches."""
    functions, classes = {}, collections.defaultdict(list)
    for peer in _PEERS:
        patcher = importlib.import_module(f"fastrlhf.integrations.{peer}")._PATCHER
        for original, adapter in patcher._functions:
            functions[_source_key(original)] = adapter
        for owner, name, _original, adapter in patcher._slots:
            if isinstance(owner, type):
                classes[_class_key(owner)].append((name, adapter))
    return functions, classes


def _mirror_into(module):
    """Point a copy of a peer's source file (a module outside the peer's package) at the adapters."""
    path = getattr(module, "__file__", None)
    if not isinstance(path, str) or any(module.__name__ == p or module.__name__.startswith(p + ".") for p in _PEERS):
        return
    functions, classes = _replacements()
    for attr, value in list(vars(module).items()):
        if isinstance(value, type):
            if getattr(value, "__module__", None) != module.__name__:
                continue
            for name, adapter in classes.get(_class_key(value), ()):
                setattr(value, name, adapter)
                _MIRRORED[f"{module.__name__}.{attr}.{name}"] += 1
        elif callable(value):
            adapter = functions.get(_source_key(value))
            if adapter is not None and value is not adapter:
                setattr(module, attr, adapter)
                _MIRRORED[f"{module.__name__}.{attr}"] += 1
