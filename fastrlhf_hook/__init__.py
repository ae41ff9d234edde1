"""The switch `FASTRLHF_PATCH=verl,openrlhf,trl` (or `all`): fastrlhf's drop-in in every Python process of a run.

Two ways in, both installed with fastrlhf (`pip install fastrlhf`, or `pip install -e .`):
- `fastrlhf-patch.pth` in site-packages: its one line runs at every interpreter start-up and, only
  when FASTRLHF_PATCH is set and not empty, imports this package and calls `install()`;
- verl's `verl.plugins` entry point, `fastrlhf_hook.verl_plugin`, which verl imports at the end of
  its own `__init__` in every process that imports verl (read from verl 0.9.1).

This package imports only the standard library (fastrlhf's own package imports torch and its ops).
`install()` puts a finder first on `sys.meta_path`; once a named peer's top-level package has run,
it calls `activate(peer)`, which imports fastrlhf and runs `fastrlhf.integrations.<peer>.patch()`
through `fastrlhf.integrations.switch.apply` (one line in the log per process and peer, a warning
naming the cause on failure; the peer's import never fails because of fastrlhf). A process that
never imports a named peer imports nothing more, and at exit logs (at INFO) which named peers it
never imported. FASTRLHF_PATCH unset, empty or `none`: nothing is installed or imported.
"""

from __future__ import annotations

import os
import sys

ENV = "FASTRLHF_PATCH"
PEERS = ("verl", "openrlhf", "trl")

_state = {"finder": None, "activated": set(), "warned": False}


def requested(value: str | None = None) -> tuple[str, ...]:
    """The peers FASTRLHF_PATCH names (`value`, or the environment's): a comma-separated subset of
    PEERS, `all`, or empty / `none` for none. Raises ValueError naming the variable otherwise."""
    if value is None:
        value = os.environ.get(ENV, "")
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    if names in ([], ["none"]):
        return ()
    if names == ["all"]:
        return PEERS
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"{ENV}={value!r}: unknown peer(s) {', '.join(map(repr, unknown))}; expected a "
                         f"comma-separated list of {', '.join(PEERS)}, or 'all', or 'none'")
    return tuple(p for p in PEERS if p in names)


def install() -> tuple[str, ...]:
    """Patch each peer FASTRLHF_PATCH names when it is first imported (at once if it already is);
    the peers it watches. Idempotent. A bad value is reported on stderr and installs nothing."""
    try:
        peers = requested()
    except ValueError as e:
        _warn_once(f"fastrlhf: {e}; nothing will be patched")
        return ()
    if not peers:
        return ()
    if _state["finder"] is None:
        finder = _Finder(peers)
        sys.meta_path.insert(0, finder)
        _state["finder"] = finder
        import atexit

        atexit.register(_report_unimported, peers)
        for peer in peers:
            if peer in sys.modules:
                finder.pending.discard(peer)
                activate(peer, via="import hook")
    return _state["finder"].peers


def installed() -> bool:
    """Whether install() has put its finder on sys.meta_path in this process."""
    return _state["finder"] is not None and _state["finder"] in sys.meta_path


def activate(peer: str, via: str) -> None:
    """If FASTRLHF_PATCH names `peer`: fastrlhf.integrations.<peer>.patch(), once per process, reported
    on the log. Never raises (a failure is a warning naming its cause)."""
    try:
        peers = requested()
    except ValueError as e:
        _warn_once(f"fastrlhf: {e}; nothing will be patched")
        return
    if peer not in peers or peer in _state["activated"]:
        return
    _state["activated"].add(peer)
    try:
        from fastrlhf.integrations import switch
    except Exception as e:  # fastrlhf itself does not import: say so, leave the peer as it is
        _warn_once(f"fastrlhf: pid {os.getpid()} ({role()}): {peer} not patched: importing "
                   f"fastrlhf.integrations.switch failed: {type(e).__name__}: {e}")
        return
    switch.apply(peer, via=via)


def role() -> str:
    """What this process is in a run, for the log: `ray actor <Class>` / `ray worker`, `rank R/W` (torchrun,
    accelerate, or verl's workers set RANK and WORLD_SIZE), or `main`. Reads ray only if it is imported."""
    parts = []
    ray = sys.modules.get("ray")
    if ray is not None:
        try:
            if ray._private.worker.global_worker.mode == ray.WORKER_MODE:
                context = ray.get_runtime_context()
                task = context.get_task_name() if context.get_actor_id() else None
                parts.append(f"ray actor {task.split('.')[0]}" if task else "ray worker")
        except Exception:  # a ray without these internals, or none connected: no ray role
            pass
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is not None and world is not None:
        parts.append(f"rank {rank}/{world}")
    return ", ".join(parts) or "main"


def _warn_once(message: str) -> None:
    if not _state["warned"]:
        _state["warned"] = True
        print(message, file=sys.stderr)


def _report_unimported(peers: tuple[str, ...]) -> None:
    missing = [p for p in peers if p not in sys.modules]
    if missing and not _state["activated"]:
        import logging

        logging.getLogger("fastrlhf.integrations").info(
            "fastrlhf: pid %d (%s): %s not imported, nothing patched", os.getpid(), role(), ", ".join(missing))


class _Finder:
    """A meta-path finder that finds nothing itself: for a watched peer's top-level package it asks the
    finders after it for the spec and wraps that loader's exec_module (once) so that the peer is patched
    right after its package body has run."""

    def __init__(self, peers: tuple[str, ...]):
        self.peers = peers
        self.pending = set(peers)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)  # the look-up below, and any later one, passes through
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            self.pending.add(fullname)
            return spec
        original = loader.exec_module

        def exec_module(module):
            vars(loader).pop("exec_module", None)  # the loader's own method again
            try:
                original(module)
            except BaseException:
                self.pending.add(fullname)  # a failed import may be retried
                raise
            activate(fullname, via="import hook")

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):  # a loader without an instance dict: not wrapped
            _warn_once(f"fastrlhf: pid {os.getpid()}: cannot watch the import of {fullname} "
                       f"({type(loader).__name__}); it is not patched")
        return spec
