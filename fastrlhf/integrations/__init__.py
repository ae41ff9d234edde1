"""Drop fastrlhf's ops into existing trainers: one module per peer, each with `patch()` and
`unpatch()` (in the spirit of Liger's `apply_liger_kernel_to_*`).

    from fastrlhf.integrations import verl        # or openrlhf, trl
    verl.patch()                                   # before the trainer builds its workers

`patch()` swaps the peer's functions for adapters around the fastrlhf ops everywhere the
peer holds them: the defining module, every loaded module of the peer that imported them by
name (aliases included), registries such as verl's `POLICY_LOSS_REGISTRY`, and class
attributes (OpenRLHF's `PolicyLoss.forward`). Modules of the peer imported later pick up the
patched function from the defining module. Each adapter returns what the original returns
(shapes, dtypes, metric keys, gradients, the peer's conventions off the mask); where an
argument has no fused path it calls the original for that call. Two exceptions, listed under
"Not kept" in each module: at an exact tie of a clipped and an unclipped loss term the
gradient is fastrlhf's (the unclipped term takes all of it; the peers split it), and inputs
the peers reject or turn into NaN (labels of -100 or outside [0, V), -inf logits in the
entropy) get fastrlhf's documented answers instead. Both functions are
idempotent; `unpatch()` restores every original.

The peers are never dependencies of fastrlhf: each module imports its peer inside `patch()`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import sys

logger = logging.getLogger("fastrlhf.integrations")

__all__ = ["UnsupportedPeerError", "is_patched"]


class UnsupportedPeerError(RuntimeError):
    """The installed peer's version is outside the range an integration supports."""


def peer_version(dist: str, *, supported: str, minimum: str, maximum: str | None = None) -> str:
    """The installed version of distribution `dist`; raises ImportError when it is missing and
    UnsupportedPeerError when it is outside [minimum, maximum] (`supported` names the range)."""
    from packaging.version import Version

    try:
        found = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"fastrlhf.integrations needs {dist} installed ({supported}); it is not") from None
    v = Version(found)
    if v < Version(minimum) or (maximum is not None and v > Version(maximum)):
        raise UnsupportedPeerError(f"fastrlhf.integrations supports {supported}; found {dist} {found}")
    return found


class Patcher:
    """Swaps a peer's objects for adapters and puts them back.

    Inside `with patcher.patching():`, `function(module, name, adapter)` binds the adapter in `module` at once
    and, when the block ends, every other reference to the original inside the peer's loaded modules (found by
    identity, so `from x import f as g` is covered): one pass over those modules for all the functions, not one
    per function. `item(mapping, key, adapter)` and `attribute(owner, name, adapter)` replace one slot. A block
    that raises leaves nothing patched; `undo()` puts every original back, also in one pass.
    """

    def __init__(self, peer: str, package: str):
        self.peer = peer
        self.package = package
        self._functions: list[tuple[object, object]] = []  # (original, adapter)
        self._slots: list[tuple[object, str, object, object]] = []  # (owner, key, original, adapter)
        self._labels: list[str] | None = None  # inside patching(): module.name of each function() so far
        self.replaced: list[str] = []  # what is patched now: module.name, mapping[key] or Class.name of each

    @property
    def active(self) -> bool:
        return bool(self._functions or self._slots)

    def adapters(self) -> list:
        """The distinct adapters in place now (one adapter may fill a module attribute and a registry slot)."""
        seen = {}
        for adapter in [a for _, a in self._functions] + [s[3] for s in self._slots]:
            seen.setdefault(id(adapter), adapter)
        return list(seen.values())

    @contextlib.contextmanager
    def patching(self):
        """The block's function(), item() and attribute() calls; the rebinding pass at its end, or undo() if it
        raises (never a half-patched peer)."""
        start, self._labels = len(self._functions), []
        try:
            yield self
            pairs = self._functions[start:]
            where = self._rebind(pairs)
        except BaseException:
            self._labels = None
            self.undo()
            raise
        self.replaced += self._labels
        for (_, adapter), label in zip(pairs, self._labels):
            logger.info("fastrlhf patched %s: %s", self.peer, ", ".join([label] + where[id(adapter)]))
        self._labels = None

    def _rebind(self, pairs) -> dict[int, list[str]]:
        """For each (old, new) of `pairs`, every reference to `old` inside the peer's loaded modules rebound to
        `new`; {id(new): the module.attribute names rebound}."""
        by_old = {id(old): (old, new) for old, new in pairs}
        where = {id(new): [] for _, new in by_old.values()}
        prefix = self.package + "."
        modules = [m for name, m in list(sys.modules.items())
                   if m is not None and (name == self.package or name.startswith(prefix))]
        for module in modules:
            for attr, value in list(vars(module).items()):
                swap = by_old.get(id(value))
                if swap is not None and swap[0] is value:
                    setattr(module, attr, swap[1])
                    where[id(swap[1])].append(f"{module.__name__}.{attr}")
        return where

    def function(self, module, name: str, adapter) -> None:
        if self._labels is None:
            raise RuntimeError("Patcher.function() runs inside `with patcher.patching():`")
        original = getattr(module, name)
        adapter.__wrapped__ = original
        setattr(module, name, adapter)
        self._functions.append((original, adapter))
        self._labels.append(f"{module.__name__}.{name}")

    def item(self, mapping: dict, key: str, adapter, label: str) -> None:
        original = mapping[key]
        mapping[key] = adapter
        self._slots.append((mapping, key, original, adapter))
        self.replaced.append(f"{label}[{key!r}]")
        logger.info("fastrlhf patched %s: %s[%r]", self.peer, label, key)

    def attribute(self, owner, name: str, adapter) -> None:
        original = owner.__dict__[name]
        adapter.__wrapped__ = original
        setattr(owner, name, adapter)
        self._slots.append((owner, name, original, adapter))
        self.replaced.append(f"{owner.__module__}.{owner.__qualname__}.{name}")
        logger.info("fastrlhf patched %s: %s.%s.%s", self.peer, owner.__module__, owner.__qualname__, name)

    def undo(self) -> None:
        for owner, key, original, adapter in reversed(self._slots):
            if isinstance(owner, dict):
                if owner.get(key) is adapter:
                    owner[key] = original
            elif owner.__dict__.get(key) is adapter:
                setattr(owner, key, original)
        self._rebind((adapter, original) for original, adapter in self._functions)
        self._slots.clear()
        self._functions.clear()
        self.replaced.clear()
        logger.info("fastrlhf unpatched %s", self.peer)


def is_patched(peer: str) -> bool:
    """True while `fastrlhf.integrations.<peer>.patch()` is in effect."""
    module = sys.modules.get(f"fastrlhf.integrations.{peer}")
    return bool(module is not None and module._PATCHER.active)
