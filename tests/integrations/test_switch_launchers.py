"""FASTRLHF_PATCH=trl reaches every rank: `torchrun --nproc-per-node 2` and `accelerate launch` (2 CPU ranks,
gloo) of tests/integrations/torchrun_switch_worker.py with the hooked interpreter. On each rank the
function TRL's GRPO calls is fastrlhf's (identity; the GRPO loss method too) and gives fastrlhf.logprobs'
value bit for bit, and each rank logs its one line. A full GRPOTrainer step is not run here (the rank
start-up, torch + TRL, is what one launch costs)."""

import ast
import subprocess

import pytest

from .switch_env import clean_env, hooked_python

pytestmark = pytest.mark.slow  # two 2-rank launches, each rank importing torch and TRL (~15-30 s each)

LAUNCHERS = {
    "torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
    "accelerate": ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                   "--mixed_precision", "no", "--dynamo_backend", "no"],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_every_rank_is_patched(launcher, tmp_path_factory):
    pytest.importorskip("trl")
    if launcher == "accelerate":
        pytest.importorskip("accelerate")
    from pathlib import Path

    python = hooked_python(tmp_path_factory.getbasetemp().parent / "fastrlhf-switch")
    worker = Path(__file__).with_name("torchrun_switch_worker.py")
    proc = subprocess.run([python, *LAUNCHERS[launcher], str(worker)], capture_output=True, text=True, timeout=400,
                          env=clean_env(FASTRLHF_PATCH="trl", CUDA_VISIBLE_DEVICES=""))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("VERDICTS ")]
    verdicts = ast.literal_eval(line.split(" ", 1)[1])
    assert [v["rank"] for v in verdicts] == [0, 1]
    for v in verdicts:
        assert v["fastrlhf"] and v["equal"], v
        assert v["function"] == v["grpo_loss"] == "fastrlhf.integrations.trl", v
        assert out.count(f"fastrlhf: pid {v['pid']} (rank {v['rank']}/2): patched trl: 7 functions") == 1, out[-4000:]
