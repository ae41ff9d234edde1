"""FASTRLHF_PATCH in fresh processes of an interpreter with the hook installed as a user installs it
(switch_env.hooked_python): the peers patched when first imported (verl through its verl.plugins entry
point, OpenRLHF and TRL through the start-up hook), one line each; nothing imported without the
switch or by a process that imports no peer; failures as warnings naming the cause and the function;
`python -m fastrlhf.integrations check`."""

import logging
import subprocess

import pytest

import fastrlhf_hook

from .switch_env import clean_env, hooked_python


@pytest.fixture(scope="module")
def python(tmp_path_factory):
    return hooked_python(tmp_path_factory.getbasetemp().parent / "fastrlhf-switch")


def _run(python, code, **env):
    proc = subprocess.run([python, "-c", code], env=clean_env(**env), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("value, peers", [("all", ("verl", "openrlhf", "trl")), (" TRL, verl ", ("verl", "trl")),
                                          ("", ()), ("none", ()), ("openrlhf", ("openrlhf",))])
def test_switch_values(value, peers):
    assert fastrlhf_hook.requested(value) == peers


def test_bad_switch_value_names_the_variable_and_the_choices():
    with pytest.raises(ValueError, match=r"FASTRLHF_PATCH='verl,vrel'.*'vrel'.*verl, openrlhf, trl.*'all'"):
        fastrlhf_hook.requested("verl,vrel")


def test_a_process_that_imports_no_peer_imports_neither_torch_nor_the_ops(python):
    """`python -X importtime -c pass`: with the switch the hook itself loads (stdlib only); without it, nothing."""
    on = _imported(_run(python, "pass", FASTRLHF_PATCH="all", PYTHONPROFILEIMPORTTIME="1").stderr)
    assert "fastrlhf_hook" in on, sorted(on)
    assert not {m for m in on if m.split(".")[0] in ("torch", "fastrlhf", "triton", "numpy")}, sorted(on)
    off = _imported(_run(python, "pass", PYTHONPROFILEIMPORTTIME="1").stderr)
    assert not {m for m in off if m.split(".")[0] in ("fastrlhf_hook", "fastrlhf")}, sorted(off)
    bad = _run(python, "pass", FASTRLHF_PATCH="vrel").stderr
    assert "FASTRLHF_PATCH='vrel': unknown peer(s) 'vrel'" in bad and "nothing will be patched" in bad


def _imported(importtime: str) -> set:
    """The modules `-X importtime` lists."""
    return {line.rsplit("|", 1)[-1].strip() for line in importtime.splitlines() if line.startswith("import time:")}


PEERS_IMPORTED = """
import sys
import verl.trainer.ppo.core_algos as core_algos
import trl.trainer.utils as trl_utils
import peer_stubs
peer_stubs.install()  # OpenRLHF's flash-attn / vllm / deepspeed imports (installed --no-deps); after TRL's
import openrlhf.models.loss as loss
on = "fastrlhf" in sys.modules
if on:
    from fastrlhf.integrations import openrlhf, trl, verl
    assert core_algos.agg_loss.__module__ == "fastrlhf.integrations.verl"
    assert core_algos.POLICY_LOSS_REGISTRY["vanilla"].__module__ == "fastrlhf.integrations.verl"
    assert loss.PolicyLoss.forward.__module__ == "fastrlhf.integrations.openrlhf"
    assert trl_utils.selective_log_softmax.__module__ == "fastrlhf.integrations.trl"
    print("patched", verl._PATCHER.active, openrlhf._PATCHER.active, trl._PATCHER.active)
else:
    assert core_algos.agg_loss.__module__ == "verl.trainer.ppo.core_algos"
    assert trl_utils.selective_log_softmax.__module__ == "trl.trainer.utils"
    print("unpatched", [m for m in sys.modules if m.startswith("fastrlhf")])
"""


def test_each_peer_is_patched_when_first_imported_and_says_so_once(python):
    proc = _run(python, PEERS_IMPORTED, FASTRLHF_PATCH="all")
    assert "patched True True True" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "fastrlhf: pid" in line]
    assert len(lines) == 3, proc.stderr[-3000:]
    assert any("(main): patched verl: 19 functions (verl.plugins)" in line for line in lines), lines
    assert any("(main): patched openrlhf: " in line and "(import hook)" in line for line in lines), lines
    assert any("(main): patched trl: 7 functions (import hook)" in line for line in lines), lines


def test_without_the_switch_nothing_is_patched_and_fastrlhf_not_imported(python):
    proc = _run(python, PEERS_IMPORTED)
    # verl imports its plugins (fastrlhf_hook.verl_plugin: the standard library only) whatever the switch says
    assert "unpatched ['fastrlhf_hook', 'fastrlhf_hook.verl_plugin']" in proc.stdout, proc.stdout + proc.stderr
    assert "fastrlhf: pid" not in proc.stderr


def test_a_scripts_patch_call_under_the_switch_patches_once(python):
    """patch() importing the peer runs the hook, which patches first: patch() then finds it patched."""
    code = ("from fastrlhf.integrations import trl; trl.patch(); import trl.trainer.utils as u; "
            "print(u.selective_log_softmax.__wrapped__.__module__, len(trl._PATCHER.adapters()))")
    proc = _run(python, code, FASTRLHF_PATCH="trl")
    assert proc.stdout.split() == ["trl.trainer.utils", "7"], proc.stdout + proc.stderr[-2000:]


def test_verls_external_module_hook_patches_without_the_switch(python):
    code = "import verl.utils.torch_functional as F; print(F.entropy_from_logits.__module__)"
    proc = _run(python, code, VERL_USE_EXTERNAL_MODULES="fastrlhf_hook.patch_verl")
    assert proc.stdout.strip() == "fastrlhf.integrations.verl", proc.stdout + proc.stderr[-2000:]
    assert proc.stderr.count("(main): patched verl: 19 functions (external module)") == 1, proc.stderr[-2000:]


def test_a_process_that_never_imports_a_named_peer_says_so_at_exit(python):
    code = "import logging; logging.basicConfig(level=logging.INFO)"
    err = _run(python, code, FASTRLHF_PATCH="verl,trl").stderr
    assert "(main): verl, trl not imported, nothing patched" in err, err


def test_a_failing_patch_is_a_warning_naming_the_cause_and_the_function(trl_integration, monkeypatch, caplog):
    import trl.trainer.utils as utils

    from fastrlhf.integrations import switch

    monkeypatch.delattr(utils, "entropy_from_logits")
    with caplog.at_level(logging.WARNING, logger="fastrlhf.integrations"):
        assert not switch.apply("trl", via="test")
    (record,) = [r for r in caplog.records if "NOT patched" in r.getMessage()]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "trl NOT patched (test): AttributeError" in message and "entropy_from_logits" in message, message
    assert "in fastrlhf.integrations.trl.patch line" in message, message
    assert not trl_integration._PATCHER.active  # never half-patched


def test_check_lists_what_patch_replaces_and_whether_the_switch_is_on(trl_integration, verl_integration,
                                                                     monkeypatch):
    from fastrlhf.integrations import switch

    monkeypatch.setenv("FASTRLHF_PATCH", "trl")
    lines = []
    assert switch.check(("verl", "trl"), write=lines.append) == 0  # OpenRLHF's needs stubs that break TRL's
    text = "\n".join(lines)
    assert lines[0] == "FASTRLHF_PATCH='trl': patches trl", text
    assert "trl 1.16.0: patch() replaces 7 functions" in text and "the switch patches it" in text, text
    assert "    trl.trainer.utils.selective_log_softmax" in lines, text
    assert "verl 0.9.1: patch() replaces 19 functions" in text and "the switch does not patch it" in text, text
    assert not trl_integration._PATCHER.active and not verl_integration._PATCHER.active  # put back
