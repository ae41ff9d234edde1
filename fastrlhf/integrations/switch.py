"""What FASTRLHF_PATCH does once a named peer is imported (fastrlhf_hook calls `apply`), and the
`python -m fastrlhf.integrations check` report.

`apply(peer)` runs `fastrlhf.integrations.<peer>.patch()` (the same call a script would make) and
logs one line per process on the "fastrlhf.integrations" logger, at WARNING or the peer's own
logger's level if that is higher, so that it shows wherever the peer's warnings show:

    fastrlhf: pid 4242 (ray actor TaskRunner): patched verl: 24 functions (verl.plugins)

A patch() that raises leaves the peer unpatched (patch() never half-patches) and is a warning that
names the exception and the line of fastrlhf's patch() it came from (the peer's function being
replaced). The peer's own import goes on either way.
"""

from __future__ import annotations

import importlib
import logging
import os
import traceback

import fastrlhf_hook
from fastrlhf.integrations import logger
from fastrlhf_hook import PEERS

__all__ = ["apply", "check", "report_level"]


def report_level(peer: str) -> int:
    """WARNING, or the peer's logger's effective level where that is higher (capped at ERROR)."""
    return min(max(logging.WARNING, logging.getLogger(peer).getEffectiveLevel()), logging.ERROR)


def apply(peer: str, via: str) -> bool:
    """Patch `peer` in this process and say so on the log; whether it is patched."""
    head = f"fastrlhf: pid {os.getpid()} ({fastrlhf_hook.role()})"
    try:
        integration = importlib.import_module(f"fastrlhf.integrations.{peer}")
        if integration._PATCHER.active:  # patched already (another way in, or the script): said once
            return True
        integration.patch()
    except Exception as e:  # the peer keeps its own functions; the run goes on, loudly
        logger.warning("%s: %s NOT patched (%s): %s: %s%s", head, peer, via, type(e).__name__, e, _where(e, peer))
        return False
    count = len(integration._PATCHER.adapters())
    logger.log(report_level(peer), "%s: patched %s: %d functions (%s)", head, peer, count, via)
    return True


def _where(error: BaseException, peer: str) -> str:
    """`, at <file>:<line> (<source line>)` for the innermost frame of fastrlhf's integration module."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if f.filename.replace(os.sep, "/").endswith(f"fastrlhf/integrations/{peer}.py")]
    if not frames:
        return ""
    f = frames[-1]
    return f", in fastrlhf.integrations.{peer}.{f.name} line {f.lineno}: {(f.line or '').strip()}"


def check(peers=PEERS, write=print) -> int:
    """For each installed peer of `peers`: what patch() replaces (patched, listed, unpatched again in this
    process), and whether FASTRLHF_PATCH is set and reaches new processes. The number of peers patch()
    failed for."""
    import importlib.metadata as md

    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"peers: unknown {unknown}; expected some of {', '.join(PEERS)}")
    try:
        switched, problem = fastrlhf_hook.requested(), ""
    except ValueError as e:
        switched, problem = (), f" -- {e}"
    value = os.environ.get(fastrlhf_hook.ENV)
    write(f"{fastrlhf_hook.ENV}={value!r}: patches {', '.join(switched) or 'nothing'}{problem}")
    pth = _pth_files()
    write(f"start-up hook (fastrlhf-patch.pth): {', '.join(pth) if pth else 'NOT installed in this interpreter'}")
    plugins = [ep for ep in md.entry_points(group="verl.plugins") if ep.value.startswith("fastrlhf_hook")]
    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    allowed = policy == "auto" or "fastrlhf" in {n.strip() for n in policy.split(",")}
    write(f"verl.plugins entry point: {plugins[0].value if plugins else 'NOT registered'}"
          + ("" if allowed else f" (VERL_USE_EXTERNAL_PLUGINS={policy!r} keeps verl from loading it)"))
    failures = 0
    for peer in (p for p in PEERS if p in peers):
        try:
            version = md.version(peer)
        except md.PackageNotFoundError:
            write(f"{peer}: not installed")
            continue
        failures += not _check_peer(peer, version, peer in switched, write)
    return failures


def _check_peer(peer: str, version: str, switched: bool, write) -> bool:
    integration = importlib.import_module(f"fastrlhf.integrations.{peer}")
    was_patched = integration._PATCHER.active
    try:
        integration.patch()
    except Exception as e:
        write(f"{peer} {version}: patch() fails: {type(e).__name__}: {e}{_where(e, peer)}")
        return False
    replaced = list(integration._PATCHER.replaced)
    count = len(integration._PATCHER.adapters())
    if not was_patched:
        integration.unpatch()
    write(f"{peer} {version}: patch() replaces {count} functions ({len(replaced)} references); "
          f"the switch {'patches' if switched else 'does not patch'} it")
    for name in replaced:
        write(f"    {name}")
    return True


def _pth_files() -> list[str]:
    import site
    import sys

    dirs = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    found = {os.path.join(d, "fastrlhf-patch.pth") for d in dirs if isinstance(d, str)}
    return sorted(p for p in found if os.path.isfile(p))
