"""FASTRLHF_PATCH reaches Ray actors: one local ray.init(num_cpus=2) (tests/integrations/ray_switch_driver.py,
run with the hooked interpreter, the switch set in the driver's environment) starts two actors that import
verl's and OpenRLHF's loss and log-prob modules. The one that inherits the switch runs fastrlhf's
functions (identity, and entropies computed in the actor equal to fastrlhf.entropy's, bit for bit) and says
so in the log the driver shows; the one with FASTRLHF_PATCH=none runs the peers' own and never imports
fastrlhf."""

import json
import subprocess
from pathlib import Path

import pytest

from .switch_env import clean_env, hooked_python

pytestmark = pytest.mark.slow  # a Ray session and two actors importing verl, OpenRLHF and torch (~40 s on 2 cores)

DRIVER = Path(__file__).with_name("ray_switch_driver.py")


def test_actors_are_patched_with_the_switch_and_not_without(tmp_path_factory):
    pytest.importorskip("ray")
    pytest.importorskip("verl")
    pytest.importorskip("openrlhf")
    python = hooked_python(tmp_path_factory.getbasetemp().parent / "fastrlhf-switch")
    proc = subprocess.run([python, str(DRIVER)], env=clean_env(FASTRLHF_PATCH="all"), capture_output=True,
                          text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    results = {line.split()[1]: json.loads(line.split(" ", 2)[2]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")}
    on, off = results["on"], results["off"]
    assert on["fastrlhf_imported"] and on["equals_fastrlhf"], on
    assert all(m.startswith("fastrlhf.integrations.") for m in on["modules"].values()), on["modules"]
    assert not off["fastrlhf_imported"] and not off["equals_fastrlhf"], off
    assert all(m.split(".")[0] in ("verl", "openrlhf") for m in off["modules"].values()), off["modules"]
    assert "(ray actor Probe): patched verl: 19 functions (verl.plugins)" in out, out[-4000:]
    assert "(ray actor Probe): patched openrlhf: " in out, out[-4000:]
    assert out.count("): patched verl:") == 1 and out.count("): patched openrlhf:") == 1, out[-4000:]
