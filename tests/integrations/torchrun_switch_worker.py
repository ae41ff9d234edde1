"""One rank of test_switch_torchrun (torchrun / accelerate launch, 2 CPU ranks, gloo): imports TRL's
GRPOTrainer as a training script does, then checks on this rank that the log-prob function GRPO calls is
fastrlhf's (identity) and gives fastrlhf.logprobs' value (bit for bit); all-gathers the verdicts to rank 0."""

import os
import sys

import torch
import torch.distributed as dist
import trl.trainer.grpo_trainer as grpo_trainer
import trl.trainer.utils as utils
from trl import GRPOTrainer  # noqa: F401  (what a GRPO script imports; patches TRL under the switch)

dist.init_process_group("gloo")
rank = dist.get_rank()
logits = torch.randn(2, 6, 13, generator=torch.Generator().manual_seed(rank))
index = torch.randint(0, 13, (2, 6), generator=torch.Generator().manual_seed(rank))
verdict = {"rank": rank, "pid": os.getpid(), "fastrlhf": "fastrlhf" in sys.modules,
           "function": utils.selective_log_softmax.__module__,
           "grpo_loss": grpo_trainer.GRPOTrainer._compute_loss.__module__}
if verdict["fastrlhf"]:
    import fastrlhf

    verdict["equal"] = torch.equal(utils.selective_log_softmax(logits, index), fastrlhf.logprobs(logits, index))
verdicts = [None] * dist.get_world_size()
dist.all_gather_object(verdicts, verdict)
if rank == 0:
    print("VERDICTS", verdicts, flush=True)
dist.destroy_process_group()
