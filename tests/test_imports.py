"""Imports point down and never loop (the layering: cli -> stages -> ops -> kernels): read with `ast`, every import
statement (module level and inside functions) of every fastrlhf module."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    """fastrlhf module name -> file."""
    found = {}
    for path in (ROOT / "fastrlhf").rglob("*.py"):
        parts = ["fastrlhf", *path.relative_to(ROOT / "fastrlhf").with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The modules `name` imports by name (`from a import b` counts a.b when it is a module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return out


GRAPH = {name: {m for m in _imports(name) if m in MODULES and m != name} for name in MODULES}


def test_no_import_cycle():
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if nxt in ("fastrlhf",):  # the package itself: every submodule's parent, not a dependency
                continue
            if state.get(nxt) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def _third_party(name: str) -> set[str]:
    """The packages outside fastrlhf and the standard library that `name` imports."""
    return {m.split(".")[0] for m in _imports(name) if not m.startswith("fastrlhf")} - set(sys.stdlib_module_names)


@pytest.mark.parametrize("name", sorted(m for m in MODULES if m.startswith("fastrlhf.kernels")))
def test_kernels_import_only_torch_triton_and_constants(name):
    assert _third_party(name) <= {"torch", "triton"}, name
    own = {m for m in _imports(name) if m.startswith("fastrlhf")}
    assert all(m.startswith("fastrlhf.kernels") or m == "fastrlhf.constants" for m in own), (name, own)


def test_reference_and_constants_import_only_torch():
    assert _third_party("fastrlhf.reference") <= {"torch"}
    assert {m for m in _imports("fastrlhf.reference") if m.startswith("fastrlhf")} == {"fastrlhf.constants"}
    assert _imports("fastrlhf.constants") == set()


def test_ops_layers():
    """The shared modules (checks, the call path) import no op module; reuse flows one way:
    linear -> losses -> (logprobs, kl)."""
    ops = {m for m in MODULES if m.startswith("fastrlhf.ops.")}
    shared = {"fastrlhf.ops._common", "fastrlhf.ops._dispatch"}
    assert not GRAPH["fastrlhf.ops._common"] & ops
    assert GRAPH["fastrlhf.ops._dispatch"] & ops <= {"fastrlhf.ops._common"}
    assert not GRAPH["fastrlhf.ops.logprobs"] & (ops - shared)
    for name in ops:
        own = {m for m in GRAPH[name] if m.startswith("fastrlhf.") and not m.startswith("fastrlhf.ops")}
        assert own <= {"fastrlhf.constants", "fastrlhf.reference", "fastrlhf.kernels", "fastrlhf.kernels.logprobs",
                       "fastrlhf.kernels.kl", "fastrlhf.kernels.gae", "fastrlhf.kernels.ppo_loss",
                       "fastrlhf.kernels.distill", "fastrlhf.kernels.policy_modes",
                       "fastrlhf.kernels.decode_attention"}, (name, own)
