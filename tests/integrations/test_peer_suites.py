"""The peers' OWN unit tests for the patched functions, run with patch() applied.

verl's and OpenRLHF's wheels ship their tests (a top-level `tests` package in
site-packages); they run here in a subprocess through peer_suite_plugin, on both backends.
TRL's wheel ships none: its upstream tests for these functions are run locally only (see
the integration note), not in CI.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

SUITES = {
    "verl": ["tests/trainer/ppo/test_core_algos_on_cpu.py", "tests/trainer/ppo/test_loss_aggregation_on_cpu.py",
             "tests/trainer/ppo/test_value_loss_normalization_on_cpu.py",
             "tests/trainer/ppo/test_rollout_corr_integration.py",
             "tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py"],
    "openrlhf": ["tests/test_kl_estimator_gradient.py", "tests/test_loss_aggregation.py",
                 "tests/test_reward_shaping.py", "tests/test_actor_entropy_temperature.py", "tests/test_experience.py",
                 "tests/test_ppo_trainer.py"],
}
MODULES = {"verl": "verl.trainer.ppo.core_algos", "openrlhf": "openrlhf.models.utils"}


def test_peer_unit_tests_pass_with_patch(backend, tmp_path):
    """Both peers' suites in one subprocess per backend (one start-up of torch and the peers)."""
    import importlib.util

    peers, files = [], []
    for peer in sorted(SUITES):
        spec = importlib.util.find_spec(peer)
        if spec is None:
            continue
        site = Path(spec.origin).parent.parent  # the wheel puts its `tests` package beside the peer's
        peers.append(peer)
        files += [site / f for f in SUITES[peer] if (site / f).exists()]
    if not files:
        pytest.skip("neither verl nor OpenRLHF (with the tests its wheel ships) is installed")
    env = dict(os.environ, FASTRLHF_PATCH=",".join(peers), FASTRLHF_BACKEND=backend,
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "peer_suite_plugin", "-p", "no:cacheprovider",
         f"--rootdir={tmp_path}", "-o", "addopts=", "-W", "ignore::DeprecationWarning", *map(str, files)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = re.search(r"(\d+) passed", tail)
    assert summary and "failed" not in tail and " error" not in tail.lower(), tail
    assert f"fastrlhf patched: {','.join(peers)} (backend {backend})" in proc.stdout, tail
