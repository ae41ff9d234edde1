"""One PPO update on a fixed rollout, in one plain process or under torchrun (run by
tests/train/test_distributed.py):

    python tests/dist_worker.py OUT.pt                            # one process: float64 and float32
    torchrun --nproc-per-node 2 tests/dist_worker.py OUT.pt       # 2 ranks: float32, sharded

The rollout (8 sequences, responses of different lengths, old log-probs perturbed so some
ratios clip) is the same global batch on every rank; each rank takes its contiguous share.
For every case rank 0 saves the full gradients after one optimizer step (AdamW at lr 0: the
weights do not move, the gradients and optimizer states stay), the stats, every rank's
bytes of parameters, gradients and optimizer states, and how far the decode engine's log-probs,
its weights merged from the gathered policy, are from the policy's own (`engine_vs_policy`); the
PACKED cases again with padded and packed micro-batches for each loss aggregation of AGGS, and the
SHARED case on groups sharing their prompt with --shared_prompt off and on. Then
`fastrlhf dpo` trains 3 steps (`dpo_rows`), and, under torchrun, `fastrlhf sft` starts with
another learning rate on rank 1 (`configured_differently`).
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch

from fastrlhf import ops
from fastrlhf.train import distributed, task
from fastrlhf.train.config import DPOConfig, PPOConfig, SFTConfig
from fastrlhf.train.data import pack
from fastrlhf.train.engine import DecodeEngine
from fastrlhf.train.heads import ActorCritic
from fastrlhf.train.models import hidden_states, load_causal_lm
from fastrlhf.train.recipes import dpo, sft
from fastrlhf.train.recipes.ppo import advantage_estimator, experience, ppo_update, with_advantages
from fastrlhf.train.rollout import Rollout, engine_generate, token_logprobs

B = 8  # sequences in the rollout (the global batch)
CASES = {  # name: (lora_rank, gradient_checkpointing, shard, advantage)
    "full": (0, False, "full", "gae"),
    "lora_checkpointing_grad_op": (4, True, "grad_op", "gae"),
    "lora_none": (4, False, "none", "gae"),
    "grpo_kl_in_loss": (4, False, "full", "grpo"),  # groups of 2, k3 KL in the loss, no critic
    "reinforce_pp": (0, False, "full", "reinforce_pp"),  # advantages whitened over the batch's tokens
}
GROUP = 2  # responses per prompt of the critic-free cases
PACKED = ("full", "grpo_kl_in_loss")  # also run packed (micro_batch_tokens=BUDGET), for each of AGGS
AGGS = ("token-mean", "seq-mean-token-mean")
BUDGET = 16  # tokens per pack: the sequences hold 4-13, so packs hold 1-4 of them
SHARED = "grpo_kl_in_loss"  # also run on groups sharing their prompt, --shared_prompt off and on (rows and packs)


def dpo_config(folder: Path) -> DPOConfig:
    """3 DPO steps with LoRA on the tiny model, from a file of the built-in task's pairs (a file:
    no true-score sampling, whose randomness a rank spends on its share of the prompts only)."""
    pairs = folder / "pairs.jsonl"
    with distributed.main_first() as main:  # one writer: a rank reading the file while another rewrote
        if main:  # it read it empty or half-written (datasets' reader then failed or aborted the process)
            folder.mkdir(parents=True, exist_ok=True)
            pairs.write_text("".join(json.dumps(r) + "\n" for r in task.synthetic_pairs(40, 0)))
    return DPOConfig(out=str(folder / "run"), model="tiny", data=str(pairs), steps=3, batch_size=4, log_every=1,
                     eval_every=3, save_every=10, lora_rank=4, device="cpu")


def fixed_rollout(tokenizer, device, grouped: bool = False) -> tuple[Rollout, torch.Tensor, torch.Tensor]:
    """(rollout, scores [B], old_logp noise [B, R]) of a fixed global batch: prompts of 3-7
    tokens, responses of 1-6 (uneven over the ranks' shares); `grouped`: rows 2i and 2i + 1 share
    row 2i's prompt (groups of GROUP = 2, as a rollout lays them)."""
    g = torch.Generator().manual_seed(1234)
    letters = list(range(5, 30))
    prompts = [[letters[i] for i in torch.randint(len(letters), (int(n),), generator=g)]
               for n in torch.randint(3, 8, (B,), generator=g)]
    if grouped:
        prompts = [prompts[i - i % GROUP] for i in range(B)]
    lengths = [6, 1, 5, 2, 6, 6, 3, 4]
    responses = [[letters[i] for i in torch.randint(len(letters), (n,), generator=g)] for n in lengths]
    batch = pack(prompts, responses, tokenizer.pad_token_id).to(device)
    scores = torch.randn(B, generator=g)
    noise = 0.3 * torch.randn(batch.response_mask.shape, generator=g)
    return Rollout(batch, [""] * B, [""] * B), scores.to(device), noise.to(device)


def share(rollout: Rollout, *tensors):
    """This rank's contiguous rows of the global batch."""
    n = B // distributed.world_size()
    rows = slice(distributed.rank() * n, (distributed.rank() + 1) * n)
    b = rollout.batch
    mine = type(b)(b.input_ids[rows], b.attention_mask[rows], b.position_ids[rows], b.response_mask[rows],
                   b.prompt_len)
    return (Rollout(mine, rollout.prompts[rows], rollout.responses[rows]), *(t[rows] for t in tensors))


def one_update(case: str, dtype: torch.dtype, device, micro_batch_tokens: int = 0, loss_agg: str = "token-mean",
               shared_prompt: str | None = None) -> dict:
    """`shared_prompt`: on a rollout of groups sharing their prompt, with --shared_prompt this (None: the
    fixed rollout, off)."""
    lora, checkpointing, shard, advantage = CASES[case]
    critic = advantage == "gae"
    torch.manual_seed(0)
    lm, tokenizer = load_causal_lm("tiny", device=device, dtype=dtype, gradient_checkpointing=checkpointing)
    ac = ActorCritic(lm, lora_rank=lora, value_head=critic)
    model = distributed.shard_model(ac, shard, device)
    rollout, scores, noise = share(*fixed_rollout(tokenizer, device, grouped=shared_prompt is not None))
    mask = rollout.batch.response_mask
    kl_in_loss = case == "grpo_kl_in_loss"
    cfg = PPOConfig(rollout_batch_size=B, mini_batch_size=B, micro_batch_size=4, ppo_epochs=1, max_grad_norm=1e9,
                    advantage=advantage, num_generations=GROUP if advantage != "gae" else 1, lam=0.95,
                    kl_in_loss=kl_in_loss, micro_batch_tokens=micro_batch_tokens, loss_agg=loss_agg,
                    shared_prompt=shared_prompt or "off")
    exp = model.run(experience, rollout, cfg, device)
    exp.ref_logp = exp.ref_logp + 0.1 * noise
    exp = with_advantages(exp, scores, 0.1, dataclasses.replace(cfg, kl_in_loss=False), advantage_estimator(cfg))
    if critic:
        here = ops.whiten(ops.gae(exp.rewards, exp.values, mask, gamma=1.0, lam=0.95, whiten=False)[0], mask)
    else:  # this rank's moments only
        here = ops.outcome_advantages(exp.rewards.sum(-1), mask, group_size=GROUP, estimator=advantage)
    local_vs_global = (here - exp.advantages).abs().max().item()
    generation_gathers = model.run(gathered_layers, gathered=ac.policy)  # what the rollout's generate sees
    engine_gap = None  # checked in the plain runs; packing and the aggregation do not touch the engine
    if micro_batch_tokens == 0 and loss_agg == "token-mean":
        engine_gap = model.run(engine_vs_policy, tokenizer, device, gathered=ac.policy)
    trainable = [p for p in ac.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=0.0, weight_decay=0.0)
    exp.old_logp = exp.old_logp + noise * mask
    stats = ppo_update(model, optimizer, exp, cfg, device, step=0, kl_coef=0.05 if kl_in_loss else 0.0)
    grads = {}
    for name, p in ac.named_parameters():
        if p.requires_grad:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().cpu().clone()
    per_rank = [None] * distributed.world_size()
    mine = dict(distributed.state_bytes(ac, optimizer), tokens=float(mask.sum()),
                whiten_local_vs_global=local_vs_global, engine_vs_policy=engine_gap)
    if distributed.active():
        torch.distributed.all_gather_object(per_rank, mine)
    else:
        per_rank = [mine]
    return {"grads": grads, "stats": stats, "per_rank": per_rank, "generation_gathers": generation_gathers}


def packed_runs(device, dtypes) -> dict:
    """The PACKED cases with each loss aggregation of AGGS: padded in `dtypes`, packed in float32."""
    runs = {}
    for case in PACKED:
        for agg in AGGS:
            for dtype in dtypes:
                runs[f"{case}/{agg}/padded/{str(dtype)[6:]}"] = one_update(case, dtype, device, loss_agg=agg)
            runs[f"{case}/{agg}/packed/float32"] = one_update(case, torch.float32, device, BUDGET, agg)
    for dtype in dtypes:  # groups sharing their prompt: unshared padded, the reference
        runs[f"{SHARED}/shared_off/{str(dtype)[6:]}"] = one_update(SHARED, dtype, device, shared_prompt="off")
    for tokens in (0, BUDGET):
        runs[f"{SHARED}/shared_on/{tokens}/float32"] = one_update(SHARED, torch.float32, device, tokens,
                                                                 shared_prompt="on")
    return runs


def engine_vs_policy(ac: ActorCritic, tokenizer, device) -> float:
    """Max |log-prob of the decode engine - the policy's teacher-forced one| over this rank's rollout of
    4 prompts: the engine's own weights, copied and merged from the gathered policy (never read in
    place under FSDP: the gathered tensors are freed after the rollout)."""
    engine = DecodeEngine(ac.policy, batch=4, prompt_len=7, new_tokens=6, temperature=1.0,
                          eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, device=device, compile=False,
                          share_frozen=not distributed.active())
    prompts = [[5 + distributed.rank(), 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17]]
    rollout = engine_generate(engine, ac.policy, tokenizer, prompts, [""] * len(prompts))
    b = rollout.batch
    with torch.no_grad():
        logp = token_logprobs(ac.policy, b, hidden_states(ac.policy, b.input_ids, b.attention_mask, b.position_ids))
    return ((logp - rollout.sampler_logp).abs() * b.response_mask).max().item()


def gathered_layers(ac: ActorCritic) -> dict[str, bool]:
    """Whether the first decoder layer of the policy and of the frozen reference (full fine-tuning)
    holds its whole parameters (under FSDP a sharded parameter is a DTensor)."""

    def whole(module) -> bool:  # fully_shard renames a layer's class to FSDP<name>
        layer = next(m for m in module.modules() if type(m).__name__.endswith("DecoderLayer"))
        return not any(hasattr(p, "to_local") for p in layer.parameters())

    return {"policy": whole(ac.policy), **({"reference": whole(ac.reference)} if ac.reference is not None else {})}


def main(out: str) -> None:
    device = distributed.setup("cpu", {"worker": sys.argv[1:]}, "dist_worker")
    runs = {}
    dtypes = [torch.float32] if distributed.active() else [torch.float64, torch.float32]
    for case in CASES:
        for dtype in dtypes:
            runs[f"{case}/{str(dtype)[6:]}"] = one_update(case, dtype, device)
    runs.update(packed_runs(device, dtypes))
    dpo_run = dpo_rows(Path(out).parent / "dpo")
    mismatch = configured_differently(Path(out).parent / "mismatch") if distributed.active() else None
    if distributed.is_main():
        torch.save({"world_size": distributed.world_size(), "runs": runs, "dpo": dpo_run, "mismatch": mismatch}, out)
    distributed.shutdown()


def dpo_rows(out: Path) -> dict:
    """`fastrlhf dpo` for 3 steps (LoRA, the built-in task): its metrics rows and summary, and
    whether a final model was written."""
    cfg = dpo_config(out)
    summary = dpo.train(cfg)
    run = Path(cfg.out)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] if distributed.is_main() \
        else []
    return {"rows": rows, "summary": summary, "final": (run / "dpo" / "final" / "model.safetensors").is_file()}


def configured_differently(out: Path) -> list:
    """`fastrlhf sft`'s train() with lr 1e-3 on rank 1 (auto, 3e-3, on rank 0): the error
    message and whether a model was built, of every rank."""
    messages = None
    try:
        sft.train(SFTConfig(out=str(out), steps=1, num_examples=64, lr=0.001 if distributed.rank() == 1 else 0.0))
    except ValueError as e:
        messages = str(e)
    gathered = [None] * distributed.world_size()
    torch.distributed.all_gather_object(gathered, {"error": messages, "model_dir": (out / "sft" / "final").exists()})
    return gathered


if __name__ == "__main__":
    main(sys.argv[1])
    distributed.exit_process(0)  # under torchrun: no interpreter teardown for gloo's threads to abort in
