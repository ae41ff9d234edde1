"""fastrlhf.integrations.Patcher on a stand-in peer package (no peer installed): what patch() and unpatch() of
every integration rest on."""

import logging
import sys
import types

import pytest

from fastrlhf.integrations import Patcher


@pytest.fixture
def peer(monkeypatch):
    """A package `standin` with `core.f`, `core.registry`, `core.Loss.forward`, and `user` holding `f` under two
    names (`from standin.core import f, f as g`); a module outside the package holds `f` too."""
    def f(x):
        return x

    class Loss:
        def forward(self):
            return "original"

    core = types.ModuleType("standin.core")
    core.f, core.registry, core.Loss = f, {"f": f}, Loss
    user = types.ModuleType("standin.user")
    user.f = user.g = f
    outside = types.ModuleType("elsewhere")
    outside.f = f
    for name, module in (("standin", types.ModuleType("standin")), ("standin.core", core),
                         ("standin.user", user), ("elsewhere", outside)):
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(f=f, core=core, user=user, outside=outside, Loss=Loss)


def test_patching_rebinds_every_reference_in_the_package_and_undo_restores(peer, caplog):
    p = Patcher("standin", "standin")

    def adapter(x):
        return x + 1

    def forward(self):
        return "adapter"

    with caplog.at_level(logging.INFO, logger="fastrlhf.integrations"), p.patching():
        p.function(peer.core, "f", adapter)
        assert peer.core.f is adapter  # the defining module at once: later steps read what they patched
        p.item(peer.core.registry, "f", adapter, "core.registry")
        p.attribute(peer.Loss, "forward", forward)
    assert peer.core.f is peer.user.f is peer.user.g is peer.core.registry["f"] is adapter
    assert adapter.__wrapped__ is peer.f and peer.Loss().forward() == "adapter"
    assert peer.outside.f is peer.f  # outside the peer's package: untouched
    assert "standin.core.f, standin.user.f, standin.user.g" in caplog.text
    assert p.active

    p.undo()
    assert peer.core.f is peer.user.f is peer.user.g is peer.core.registry["f"] is peer.f
    assert peer.Loss().forward() == "original" and not p.active
    p.undo()  # idempotent
    assert peer.user.g is peer.f


def test_a_block_that_raises_leaves_nothing_patched(peer):
    p = Patcher("standin", "standin")
    with pytest.raises(ZeroDivisionError), p.patching():
        p.function(peer.core, "f", lambda x: x)
        p.item(peer.core.registry, "f", lambda x: x, "core.registry")
        raise ZeroDivisionError("a step of the patch fails")
    assert peer.core.f is peer.user.g is peer.core.registry["f"] is peer.f and not p.active


def test_function_outside_a_patching_block_is_refused(peer):
    with pytest.raises(RuntimeError, match="patching"):
        Patcher("standin", "standin").function(peer.core, "f", lambda x: x)
    assert peer.core.f is peer.f
