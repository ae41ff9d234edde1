"""One dataclass per stage; a docstring under every field; YAML file + `--key value` overrides.

    cfg = parse_args(PPOConfig, ["--config", "ppo.yaml", "--lr", "1e-5"])

Precedence: dataclass default < YAML file (`--config`) < command line. Nested dataclasses
(the pipeline's `sft`, `rm`, `ppo`) are addressed with dots: `--ppo.steps 20`, or a nested
mapping in YAML. An unknown key, in the file or on the command line, is a ValueError that
names the closest valid keys. `--help` prints every key with its type, default and docstring.
A default of 0 (lengths, learning rates) or `auto` is resolved by the stage and logged.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import logging
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass
class RunConfig:
    """What every stage's run shares: where it writes, its seed, logging, checkpoints and resume,
    sharding and device. The stage configurations extend it; `--help` lists a stage's own keys
    first, then these."""

    out: str = "runs/default"
    """Run directory: metrics.jsonl, summary.json, plots/ and one folder per stage (`sft/`, `rm/`,
    `ppo/`, `dpo/`, `distill/`: config.json, checkpoints/, final/); the stages of a run share it."""
    prompt_key: str = "prompt"
    """Column of the data holding the prompt text."""
    max_prompt_len: int = 0
    """Prompt tokens kept (longer prompts keep their end, with a warning and a count); 0 = auto: 32 on
    the built-in task, else the longest prompt in the data, within max_position_embeddings."""
    seed: int = 0
    """Seed for data, initialisation, shuffling and sampling."""
    log_every: int = 10
    """Write a metrics.jsonl row every this many steps."""
    save_every: int = 50
    """Checkpoint every this many steps (and at the end)."""
    stop_after: int = 0
    """Stop (with a checkpoint) after this many steps of this invocation; 0 = run to the end.
    Used to test `--resume` and for time-boxed jobs."""
    resume: bool = False
    """Continue from the newest intact checkpoint in the stage folder (each is checked against its
    sha256 manifest; a damaged one is named and skipped). The configuration must match the recorded
    one, apart from the keys in fastrlhf.train.checkpoint.RESUME_FREE_KEYS; model, data and reward are
    compared as the paths they name, inside the run folder relative to it, so a moved run folder
    resumes."""
    overwrite: bool = False
    """Delete what an earlier run left in the stage folder and start over (without it, a fresh run
    in a folder that holds a run is refused)."""
    tensorboard: bool = False
    """Also write TensorBoard event files under OUT/tb/."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    qlora: bool = False
    """QLoRA: load the base's decoder-layer linears in 4-bit NF4 with double quantisation (bitsandbytes,
    `pip install "fastrlhf[qlora]"`; one process), computing in the stage's dtype, and train LoRA adapters
    (--lora_rank > 0) on it; embeddings, norms, lm_head, value and score heads stay float32. The final model
    is the LoRA merged into the dequantised base (a plain model directory) with the adapters alone in
    final/adapter/; checkpoints hold the adapters and heads, the base reloads from its source. Distillation:
    the student's base; the teacher stays unquantised."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (scale = alpha / rank)."""
    shard: str = "full"
    """Under torchrun, FSDP2 sharding over the ranks: `full` (parameters, gradients and optimizer
    states; ZeRO-3), `grad_op` (gradients and optimizer states; parameters stay gathered from
    forward to backward; ZeRO-2) or `none` (replicated). Ignored in a single process."""
    device: str = "auto"
    """`auto` (CUDA if available), `cpu` or `cuda`; under torchrun each rank uses cuda:LOCAL_RANK."""
    max_skipped_frac: float = 0.1
    """Stop the run (non-zero exit, no final model, its last checkpoint kept) once more than this
    fraction of its optimizer updates (steps x updates per step) were skipped for a non-finite loss or
    gradient; 1 = never. A run whose parameters turn non-finite always stops."""
    dist_timeout_s: float = 600.0
    """Under torchrun: seconds a collective (all-reduce, barrier) waits for the other ranks before it
    fails instead of hanging."""


@dataclass
class SFTConfig(RunConfig):
    """Supervised fine-tuning on (prompt, response) pairs; loss on response tokens only."""

    model: str = "tiny"
    """Local Hugging Face causal-LM directory (weights + tokenizer), or a built-in config with random
    weights (`tiny`, `qwen2-0.5b`, `llama-0.5b`) and the built-in task's char tokenizer."""
    data: str = "auto"
    """Training pairs: a JSONL/JSON/parquet/CSV file or a `datasets.save_to_disk` folder with a prompt
    and a response column, `builtin` (the built-in task) or `auto` (`builtin` when the model is a
    built-in config, else an error asking for data)."""
    response_key: str = "response"
    """Column of the data holding the response text."""
    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 32
    """Sequences per optimizer step."""
    lr: float = 0.0
    """AdamW learning rate (constant after a 10-step warm-up); 0 = auto: 3e-3 for the built-in `tiny`
    model, else 5e-6 (OpenRLHF's SFT default for full fine-tuning)."""
    max_response_len: int = 0
    """Response tokens kept, EOS included (longer ones keep their start, with a warning and a count);
    0 = auto: 16 on the built-in task, else the longest response, within max_position_embeddings."""
    chat_template: bool = True
    """Render prompt and response with the tokenizer's chat template when it has one (a user turn and
    the assistant's answer); false, or no template: prompt tokens then response tokens + EOS."""
    num_examples: int = 4000
    """Built-in task only: number of (prompt, response) pairs to make."""
    lora_rank: int = 0
    """LoRA rank (adapters on every linear but the lm_head); 0 = full fine-tuning. --qlora needs > 0."""


@dataclass
class RMConfig(RunConfig):
    """Bradley-Terry reward model on (prompt, chosen, rejected), initialised from the SFT model."""

    model: str = ""
    """SFT model directory to start from; empty = OUT/sft/final."""
    data: str = "auto"
    """Preference pairs: a JSONL/JSON/parquet/CSV file or a `datasets.save_to_disk` folder with prompt,
    chosen and rejected columns, `builtin` (the built-in task) or `auto` (`builtin` when the model was
    trained on the built-in task, else an error asking for data)."""
    chosen_key: str = "chosen"
    """Column of the data holding the preferred response."""
    rejected_key: str = "rejected"
    """Column of the data holding the other response."""
    steps: int = 400
    """Optimizer steps."""
    batch_size: int = 32
    """Preference pairs per optimizer step."""
    lr: float = 0.0
    """AdamW learning rate (10-step warm-up); 0 = auto: 1e-3 for a model grown from the built-in `tiny`,
    else 9e-6 (OpenRLHF's reward-model default)."""
    max_response_len: int = 0
    """Response tokens kept, EOS included (with a warning and a count); 0 = auto: 16 on the built-in
    task, else the longest response, within max_position_embeddings."""
    chat_template: bool = True
    """Render prompt and responses with the tokenizer's chat template when it has one; false, or no
    template: prompt tokens then response tokens + EOS."""
    num_pairs: int = 3000
    """Built-in task only: number of preference pairs to make."""
    eval_fraction: float = 0.1
    """Fraction of the pairs held out to measure pairwise accuracy."""
    eval_every: int = 50
    """Measure the held-out accuracy every this many steps (and at the end), independently of
    log_every: an evaluation step writes its metrics.jsonl row too."""
    lora_rank: int = 0
    """LoRA rank of the trunk (adapters on every linear; the score head trains whole); 0 = full fine-tuning.
    --qlora needs > 0."""


@dataclass
class PPOConfig(RunConfig):
    """PPO with a LoRA-disabled (or frozen-copy) reference: a shared actor-critic with GAE, or
    critic-free with group-relative advantages (GRPO, Dr. GRPO, RLOO, REINFORCE++)."""

    model: str = ""
    """Policy: a local HF causal-LM directory or a built-in config name (`tiny`, `qwen2-0.5b`,
    `llama-0.5b`; random weights); empty = OUT/sft/final."""
    reward: str = ""
    """Reward: a reward-model directory written by `fastrlhf rm`, or a Python rule `module:function`
    (imported with the current directory on the path) taking (prompts, responses) and returning one
    finite number per response; empty = OUT/rm/final."""
    data: str = "auto"
    """Prompts: a JSONL/JSON/parquet/CSV file or a `datasets.save_to_disk` folder with a prompt column,
    `builtin` (the built-in task) or `auto` (`builtin` when the policy was trained on the built-in
    task, else an error asking for data)."""
    steps: int = 60
    """PPO iterations (rollout + update)."""
    rollout_batch_size: int = 64
    """Sampled responses per PPO iteration: rollout_batch_size / num_generations prompts, each
    answered num_generations times."""
    mini_batch_size: int = 32
    """Sequences per optimizer step inside the PPO epochs."""
    micro_batch_size: int = 32
    """Sequences per forward/backward; mini_batch_size / micro_batch_size steps of gradient accumulation."""
    micro_batch_tokens: int = 0
    """Pack micro-batches by tokens instead (verl's use_dynamic_bsz / ppo_max_token_len_per_gpu): each
    forward/backward takes whole sequences, laid end to end without padding, up to this many tokens (prompt
    and response) per rank; the log-prob forwards of phase 3 pack the same way. At least the longest
    sequence (max_prompt_len + max_new_tokens); 0 = micro_batch_size padded rows (fastrlhf.train.packing). On CUDA
    a varlen attention kernel keeps the sequences apart; on the CPU a block-diagonal mask, whose attention
    grows with the square of the pack's length."""
    shared_prompt: str = "off"
    """Forward each prompt once per group of num_generations responses in phases 3 and 5: one pack
    [prompt, response 1, ..., response G] (each response attending to the prompt and to itself;
    fastrlhf.train.shared_prompt), P + sum R_i tokens instead of sum (P + R_i), the same log-probs,
    values and gradients. `on`, `off`, or `auto` (on when num_generations > 1 and it saves at least 10%
    of the tokens; the log says which and how many). A group is never split across micro-batches: with
    micro_batch_tokens one over the budget goes unshared (logged), without it a micro-batch holds
    micro_batch_size rows' worth of whole groups (at least one). On CUDA flex attention runs it."""
    loss_agg: str = "token-mean"
    """How the per-token losses of a minibatch aggregate (verl's loss_agg_mode; fastrlhf.agg_loss): token-mean,
    token-sum, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm; the global token or
    sequence count of the minibatch divides, however it is split into micro-batches, packs and ranks."""
    ppo_epochs: int = 2
    """Passes over each rollout batch."""
    lr: float = 5e-4
    """AdamW learning rate of the trainable parameters (LoRA adapters or all weights, and the value head)."""
    lora_rank: int = 16
    """LoRA rank; 0 = full fine-tuning with a frozen reference copy."""
    max_new_tokens: int = 0
    """Longest sampled response, EOS included; 0 = auto: 12 on the built-in task, else
    max_position_embeddings - max_prompt_len, at most 512 (verl's and TRL's default); generation
    stops earlier at EOS."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template when it has one (a user turn, then the
    assistant's turn opened); false, or no template: the prompt's tokens as they are."""
    temperature: float = 1.0
    """Sampling temperature, also used for the log-probs."""
    rollout_cache: str = "dynamic"
    """KV cache of the rollout's `generate`: `dynamic` (grows per token), or `static` (preallocated
    for max_prompt_len + max_new_tokens; on CUDA transformers then compiles the decoding step: ~45 s
    once, then the rollout of qwen2-0.5b, 64 x 256 tokens, took 2.1 s instead of 13.4 s per step on an
    H100, bench/results/2026-11-23-h100-ppo-*.json); `auto` = static on one CUDA process, else dynamic
    (on CPU nothing is compiled; under torchrun it is not measured yet). The default stays dynamic
    until the test suite has run on CUDA with static (each test's first rollout would compile)."""
    rollout_sampler: str = "multinomial"
    """How `--rollout_engine hf` draws each token from softmax(logits / temperature): `multinomial`
    (transformers' torch.multinomial) or `inverse_cdf` (fastrlhf.train.rollout.InverseCDF: one uniform per
    row against the float64 running sum of the probabilities, instead of one random number per
    vocabulary entry: on one CPU thread ~11 ms per [64, 32000] draw against ~44 ms, ~1 s of a 64 x 32
    rollout of a 32000-token vocabulary). The same distribution from another random stream, so a seed's
    samples differ: opt-in. The graph engine draws inside its own step, by inversion too with
    inverse_cdf (one uniform per row; else the exponential race over one per vocabulary entry)."""
    rollout_engine: str = "hf"
    """Sampler of the rollouts: `hf` (transformers' generate with rollout_cache: the exact reference),
    `graph` (fastrlhf's own decode engine, fastrlhf/train/engine.py: the LoRA merged into a private bf16 copy
    re-formed in place before each rollout, its own static KV cache, sampling inside one compiled step
    captured as a CUDA graph; on CPU the same step runs eagerly; Llama, Qwen2/2.5, Qwen3, Mistral, other
    models fall back to hf) or `auto` (graph on CUDA where the model is supported, else hf). The log
    says which and why; with graph, rollout/logp_gap_mean and _max log how far the sampler's log-probs
    are from the trainer's. The default stays hf until the engine's GPU record is in (bench/gpu_run.sh
    --only rollout)."""
    rollout_slots: int = 0
    """With --rollout_engine graph: the rows of the engine's KV pool, the sequences that decode at once
    (0 = every row of the rank's rollout). With fewer, a finished sequence's slot is refilled with the
    next pending one (continuous batching): the KV cache is slots x (max_prompt_len + max_new_tokens)
    instead of rows x that, and the tokens are the same (each is keyed by its sequence and position)."""
    rollout_keep_memory: bool = False
    """With --rollout_engine graph: keep the engine's KV pool, its copy of the weights and its CUDA graphs
    allocated through the update. Default: freed at the end of each rollout, so the update has that
    memory, and re-formed for the next (the compiled step is kept; the CUDA graphs are captured again,
    counted in the engine's stats as captures and capture_s)."""
    rollout_correction: str = "none"
    """Weigh each token's policy loss by how much likelier the trained policy makes it than the sampler
    did (importance weights pi_train / pi_sampler from the sampler's own log-probs, ops.rollout_correction:
    verl's rollout_is, TRL's vllm_importance_sampling_correction): `none`, or the weight's unit, `token`,
    `sequence` (the row's product) or `geometric` (the row's geometric mean). Needs a sampler that reports
    its log-probs: --rollout_engine graph, or hf with --rollout_sampler inverse_cdf. Logged as
    rollout_corr/* (verl's names)."""
    rollout_correction_mode: str = "truncate"
    """`truncate` (each weight clamped into [low, high]: TIS) or `mask` (a unit whose weight leaves [low, high]
    weighs 0: IcePop, TRL's *_mask)."""
    rollout_correction_low: float = 0.0
    """Lower bound of the weights (0 = none)."""
    rollout_correction_high: float = 2.0
    """Upper bound of the weights (verl's rollout_is_threshold, TRL's vllm_importance_sampling_cap)."""
    old_logprobs: str = "recompute"
    """Where the old log-probs (the ratio's denominator; the KL-shaped reward's policy term) come from:
    `recompute` (a policy forward over the rollout in phase 3, as verl does by default), or `sampler`
    (the sampler's own log-probs of the tokens it drew: verl's rollout_correction.bypass_mode, read in
    verl 0.9.1's ray_trainer.py; phase 3 then runs the reference forward only, and with a critic the
    policy's trunk for the values, without the lm_head, unless the graph engine computed them too: on
    one process it runs the value head on its trunk's states as it samples). The same numbers up to
    the sampler's rounding where it runs the trained weights in their own dtype (hf with
    --rollout_sampler inverse_cdf, or the graph engine, in fp32: rollout/logp_gap_mean with recompute
    says how far); with a bf16 engine the ratio's first step carries that gap. Needs a sampler that
    reports them: --rollout_sampler inverse_cdf or --rollout_engine graph; not with
    --rollout_correction (its weights would all be 1)."""
    advantage: str = "gae"
    """Advantage estimator: `gae` (a value head on the policy's trunk, GAE over KL-shaped rewards, a
    value loss), or critic-free from one score per response (fastrlhf.outcome_advantages, verl's
    conventions): `grpo` (group mean and std), `dr_grpo` (group mean), `rloo` (leave-one-out mean),
    `reinforce_pp` (whitened over the batch), `reinforce_pp_baseline` (group mean, then whitened).
    Critic-free runs have no value head and no value loss."""
    num_generations: int = 1
    """Responses sampled per prompt (G); rollout_batch_size must be a multiple of it. The estimators
    that compare the responses to one prompt (grpo, dr_grpo, rloo, reinforce_pp_baseline) need G >= 2."""
    kl_in_loss: bool = False
    """Put the KL to the reference into the loss, kl_coef x k3 per token (as GRPO), instead of into the
    reward (kl_estimator)."""
    kl_coef: float = 0.2
    """Initial coefficient of the KL penalty: per token in the reward, or in the loss with kl_in_loss."""
    kl_target: float = 0.0
    """Adaptive KL controller (Ziegler et al. 2019) target KL per sequence; 0 = fixed kl_coef."""
    kl_horizon: int = 10000
    """Adaptive KL controller horizon, in sequences."""
    kl_estimator: str = "k1"
    """KL estimator in the reward: k1, k2, k3 (see fastrlhf.ops.token_kl); the loss term of kl_in_loss
    is always k3."""
    gamma: float = 1.0
    """GAE discount (advantage gae only)."""
    lam: float = 0.95
    """GAE lambda (advantage gae only)."""
    clip: float = 0.2
    """PPO policy ratio clip (the mode's clip_low, and clip_high unless loss_options sets it)."""
    loss_mode: str = "vanilla"
    """The policy loss (fastrlhf.ops.policy_loss's loss_mode, verl's policy_loss.loss_mode): vanilla, ppo,
    gspo, gspo_token, luspo, cispo, sapo, gpg, reinforce, dro, ... (`fastrlhf.ops.policy_modes.MODES`; an
    unknown name lists them). Its aggregation is loss_agg, except geo_mean's own one loss per sequence."""
    loss_options: str = ""
    """The mode's options as `name=value,name=value` (e.g. `clip_high=0.28` for a DAPO-style upper clip,
    `tau_pos=1.0,tau_neg=1.05` for sapo, `ratio_max=5` for cispo): numbers, `none`, or a name
    (ratio_level=sequence). Checked against the mode's own options before a model loads; the error
    lists what the mode takes."""
    value_clip: float = 0.2
    """Value clip around the rollout values (advantage gae only)."""
    vf_coef: float = 0.5
    """Weight of the value loss (advantage gae only)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip: the gradient is scaled down to this norm when larger; inf = no clipping."""
    eval_prompts: int = 256
    """Built-in task only: held-out prompts to measure the true score before and after."""
    compile: str = "auto"
    """Compile the decoder layer (regional compilation, fastrlhf.train.models.compile_layers: one layer's compile
    serves every layer, forward and backward, LoRA and gradient checkpointing inside) for the log-prob and
    training forwards; generation stays eager. `on`, `off`, or `auto` = on with CUDA, off on CPU."""
    reward_clip_abs: float = 1e6
    """A score with |score| above this is an error naming the reward and the sample, as a NaN is (a
    reward of 1e30 makes every update non-finite)."""
    reward_timeout_s: float = 600.0
    """Seconds one call of the reward (rule or reward model) may take; the log says every 60 s that
    it is still waiting, then the run stops with an error naming the reward."""
    log_every: int = 1  # RunConfig's field, PPO's default: a row every iteration
    save_every: int = 10  # RunConfig's field, PPO's default
    dtype: str = "auto"
    """Weight dtype: `auto` (bfloat16 frozen base on CUDA with LoRA, else float32), `float32`, `bfloat16`.
    On CUDA the forward passes also run under bf16 autocast."""


@dataclass
class DPOConfig(RunConfig):
    """Direct preference optimisation on (prompt, chosen, rejected) pairs, from the SFT model, against
    a frozen reference (the SFT model itself)."""

    model: str = ""
    """Policy to start from (and the reference): a local HF causal-LM directory or a built-in config
    name; empty = OUT/sft/final."""
    data: str = "auto"
    """Preference pairs: a JSONL/JSON/parquet/CSV file or a `datasets.save_to_disk` folder with prompt,
    chosen and rejected columns, `builtin` (the built-in task) or `auto` (`builtin` when the model was
    trained on the built-in task, else an error asking for data)."""
    chosen_key: str = "chosen"
    """Column of the data holding the preferred response."""
    rejected_key: str = "rejected"
    """Column of the data holding the other response."""
    steps: int = 150
    """Optimizer steps."""
    batch_size: int = 32
    """Preference pairs per optimizer step (2 x batch_size sequences in one forward)."""
    lr: float = 0.0
    """AdamW learning rate (10-step warm-up); 0 = auto: 1e-3 for a model grown from the built-in `tiny`,
    else 1e-5 (OpenRLHF 0.11's train_dpo default) with full fine-tuning, 1e-4 with LoRA."""
    beta: float = 0.1
    """Strength of the pull towards the reference (IPO's tau)."""
    loss_type: str = "sigmoid"
    """`sigmoid` (DPO), `robust`, `hinge` or `ipo` (fastrlhf.dpo_loss)."""
    label_smoothing: float = 0.0
    """Probability that a label is flipped, in [0, 0.5): cDPO for `sigmoid`, robust DPO for `robust`."""
    ipo_per_token: bool = False
    """With loss_type ipo, divide each log-ratio by its response's token count (TRL) instead of summing
    (OpenRLHF, the IPO paper)."""
    shared_prompt: str = "off"
    """Forward each pair's prompt once, [prompt, chosen, rejected] (each response attending to the prompt
    and to itself; fastrlhf.train.shared_prompt), for the reference and the policy: the same sums and
    gradients from fewer tokens. `on`, `off`, or `auto` (on where it saves at least 10% of the batch's
    tokens; the log says which and how many)."""
    lora_rank: int = 0
    """LoRA rank, the reference being the model with the adapter disabled; 0 = full fine-tuning with a
    frozen reference copy."""
    max_response_len: int = 0
    """Response tokens kept, EOS included (with a warning and a count); 0 = auto: 16 on the built-in
    task, else the longest response, within max_position_embeddings."""
    chat_template: bool = True
    """Render prompt and responses with the tokenizer's chat template when it has one; false, or no
    template: prompt tokens then response tokens + EOS."""
    num_pairs: int = 3000
    """Built-in task only: number of preference pairs to make."""
    eval_fraction: float = 0.1
    """Fraction of the pairs held out to measure the implicit reward's pairwise accuracy."""
    eval_every: int = 50
    """Measure the held-out accuracy every this many steps (and at the end), independently of
    log_every: an evaluation step writes its metrics.jsonl row too."""
    eval_prompts: int = 256
    """Built-in task only: held-out prompts to measure the true score of sampled responses before and
    after."""
    max_new_tokens: int = 0
    """Built-in task only: longest sampled response of the true-score evaluation; 0 = 12."""


@dataclass
class DistillConfig(RunConfig):
    """Knowledge distillation of a teacher into a (smaller) student with the teacher-student divergence
    per token (fastrlhf.linear_distill_loss: forward KL, reverse KL or the generalized JSD, TRL's beta):
    offline on (prompt, response) data, or on-policy on the student's own samples."""

    model: str = ""
    """Student to train: a local HF causal-LM directory or a built-in config name (`tiny-student`: half of
    `tiny` or less; random weights); empty = OUT/student/sft/final (what the pipeline's student SFT writes)."""
    teacher: str = ""
    """Teacher (frozen): a local HF causal-LM directory with the student's tokenizer and vocabulary, or a
    built-in config name; empty = OUT/ppo/final."""
    data: str = "auto"
    """Offline: (prompt, response) pairs, as `fastrlhf sft` reads them; on-policy: prompts (the prompt
    column). A JSONL/JSON/parquet/CSV file or a `datasets.save_to_disk` folder, `builtin` (the built-in
    task) or `auto` (`builtin` when the student is a built-in config or was trained on the built-in task)."""
    response_key: str = "response"
    """Column of the data holding the response text (offline)."""
    mode: str = "offline"
    """`offline`: the divergence on the data's response tokens (teacher-forced); `on_policy`: the student
    samples a response to each prompt (the rollout path) and the divergence is taken on its own tokens
    (TRL's DistillationTrainer, GKD with lambda = 1)."""
    rollout_engine: str = "hf"
    """On-policy: the student's sampler, as `fastrlhf ppo --rollout_engine`: `hf` (transformers' generate),
    `graph` (fastrlhf's decode engine: the student's LoRA merged into a private bf16 copy re-formed before each
    step's samples, a CUDA graph on CUDA, its step run eagerly on CPU) or `auto` (graph on CUDA where the model
    is supported, else hf). Unused offline."""
    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 32
    """Sequences per optimizer step."""
    lr: float = 0.0
    """AdamW learning rate (10-step warm-up); 0 = auto: 3e-3 for a student grown from `tiny` or
    `tiny-student`, else 1e-6 with full fine-tuning (TRL 1.16's DistillationConfig default), 1e-4 with LoRA."""
    beta: float = 0.5
    """Divergence: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), between the
    generalized JSD with mixture (1 - beta) student + beta teacher (TRL's and Liger's beta; 0.5 is GKD's
    and Liger's default, TRL's DistillationTrainer defaults to 1)."""
    temperature: float = 1.0
    """Softmax temperature of both models in the divergence (and of the student's sampling on-policy)."""
    lora_rank: int = 0
    """LoRA rank of the student's adapters; 0 = full fine-tuning of the student."""
    max_response_len: int = 0
    """Offline: response tokens kept, EOS included; 0 = auto: 16 on the built-in task, else the longest
    response in the data. On-policy: the longest sampled response; 0 = auto: 12 on the built-in task, else
    what the prompt leaves of max_position_embeddings, at most 512."""
    chat_template: bool = True
    """Render prompts and responses with the tokenizer's chat template when it has one; false, or no
    template: prompt tokens then response tokens + EOS."""
    num_examples: int = 4000
    """Built-in task only, offline: number of (prompt, response) pairs (the SFT data's mixture)."""
    eval_prompts: int = 256
    """Built-in task only: held-out prompts to measure the true score of the teacher and of the student
    before and after."""


@dataclass
class PipelineConfig:
    """SFT -> reward model -> PPO (or SFT -> DPO with `--algo dpo`; or PPO, then a student's SFT and its
    distillation from the PPO policy with `--algo distill`) in a row, all under one run
    directory. Every stage's configuration is checked before the first model loads. With a rule
    reward (`--ppo.reward module:function`) or a reward model of your own (`--ppo.reward DIR`) the
    reward-model stage is skipped."""

    out: str = "runs/default"
    """Run directory for every stage; overrides the stages' own `out`."""
    seed: int = 0
    """Seed for every stage; overrides the stages' own `seed`."""
    dist_timeout_s: float = 600.0
    """Under torchrun, the collective timeout of every stage; overrides the stages' own `dist_timeout_s`."""
    qlora: bool = False
    """Every stage trains LoRA adapters on a 4-bit NF4 base (the stages' `--qlora`; the distillation's
    student, not its teacher); a stage whose lora_rank is 0 gets rank 16. An SFT (or student SFT) from a
    built-in config's random weights trains whole (nothing pretrained to keep in 4 bits; the log says so).
    False: each stage's own `qlora`."""
    resume: bool = False
    """Skip finished stages and resume the unfinished one from its latest checkpoint (the
    configuration must match the recorded one)."""
    overwrite: bool = False
    """Delete what an earlier run left in OUT and start over (without it, a fresh run in a run
    directory is refused)."""
    algo: str = "ppo"
    """`ppo`: SFT -> reward model -> PPO (any `--ppo.advantage`); `dpo`: SFT -> DPO on preference pairs;
    `distill`: SFT -> reward model -> PPO (the teacher), then SFT of a smaller student (`--student.KEY`) and
    its distillation from the PPO policy (`--distill.KEY`)."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning stage (`--sft.KEY`)."""
    rm: RMConfig = field(default_factory=RMConfig)
    """Reward-model stage (`--rm.KEY`)."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO stage (`--ppo.KEY`)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """DPO stage of `--algo dpo` (`--dpo.KEY`)."""
    student: SFTConfig = field(default_factory=lambda: SFTConfig(model="tiny-student", lr=3e-3))
    """SFT of the student of `--algo distill` (`--student.KEY`), on the SFT stage's data; its run folder is
    OUT/student (OUT/student/sft/final)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """Distillation stage of `--algo distill` (`--distill.KEY`): the PPO policy into the student."""


# ---------------------------------------------------------------- parsing


def own_field_docs(cls) -> dict[str, str]:
    """The string literal under each field that the class body of `cls` declares, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        is_doc = isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and is_doc:
            docs[stmt.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def field_docs(cls) -> dict[str, str]:
    """The docstring of every field of a dataclass, inherited ones included (a field a subclass
    redeclares for another default keeps its base's docstring)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(own_field_docs(klass))
    return docs


class Key(typing.NamedTuple):
    type: type
    default: object
    doc: str


def flat_fields(cls, prefix: str = "", defaults=None) -> dict[str, Key]:
    """{"dotted.key": Key(type, default, docstring)} over a dataclass and its nested dataclasses (a nested
    one's defaults are those its parent's default holds, e.g. the pipeline's student SFT)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    defaults = cls() if defaults is None else defaults
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    out = {}
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name in inherited):  # the class's own keys first
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(flat_fields(tp, f"{prefix}{f.name}.", getattr(defaults, f.name)))
        else:
            out[f"{prefix}{f.name}"] = Key(tp, getattr(defaults, f.name), docs.get(f.name, ""))
    return out


def _members(tp) -> tuple:
    """The types of a union (`int | str | None`), () for any other type."""
    return typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else ()


def _type_name(tp) -> str:
    if _members(tp):
        return " | ".join(_type_name(m) for m in _members(tp))
    return "None" if tp is type(None) else getattr(tp, "__name__", None) or str(tp)


def _convert(key: str, tp: type, value):
    members = _members(tp)
    if members:  # `int | str | None`: None from none/null, else the first member that takes the value
        if type(None) in members and (value is None or str(value).lower() in ("none", "null")):
            return None
        kinds = [m for m in members if m is not type(None)]
        for member in [m for m in kinds if isinstance(m, type) and isinstance(value, m)] + kinds:
            try:
                return _convert(key, member, value)
            except (TypeError, ValueError):
                continue
        raise ValueError(f"config key {key!r} expects {_type_name(tp)}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"config key {key!r} expects a boolean (true/false), got {value!r}")
    if tp is int and (isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())):
        raise ValueError(f"config key {key!r} expects an integer, got {value!r}")
    try:
        return tp(value)
    except (TypeError, ValueError):
        raise ValueError(f"config key {key!r} expects {_type_name(tp)}, got {value!r}") from None


def _set(cfg, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for name in parents:
        cfg = getattr(cfg, name)
    setattr(cfg, last, value)


def _flatten_mapping(mapping: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update(_flatten_mapping(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def closest_keys(key: str, valid) -> list[str]:
    """Valid keys that `key` was probably meant to be: the same name under another prefix
    (`kl_coef` -> `ppo.kl_coef`), then the closest spellings (`stepz` -> `steps`)."""
    valid = list(valid)
    last = key.rsplit(".", 1)[-1]
    same_name = [v for v in valid if v.rsplit(".", 1)[-1] == last and v != key]
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
    return list(dict.fromkeys(same_name + close))[:3]


def _unknown(keys, valid) -> ValueError:
    parts = []
    for key in sorted(keys):
        near = closest_keys(key, valid)
        hint = f"did you mean {' or '.join(repr(k) for k in near)}?" if near else "no key is close to it"
        parts.append(f"{key!r} ({hint})")
    return ValueError(f"unknown config key(s): {'; '.join(parts)}. `--help` lists every key.")


def _read_yaml(path: Path):
    """The YAML file at `path`; a file that is not UTF-8 text or not YAML is an error naming its line."""
    raw = path.read_bytes()
    try:
        return yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"config file {str(path)!r}, line {line}: not UTF-8 text ({e.reason}); save it as "
                         "UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ValueError(f"config file {str(path)!r}{where}: not valid YAML ({problem})") from None


def load_config(cls, overrides: dict | None = None, path: str | None = None):
    """Build `cls` from its defaults, then the YAML file at `path`, then `overrides` (dotted keys)."""
    fields_ = flat_fields(cls)
    values = {}
    if path:
        if not Path(path).is_file():
            raise ValueError(f"config file {path!r} does not exist")
        loaded = _read_yaml(Path(path)) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path!r} must hold a mapping of keys to values")
        values.update(_flatten_mapping(loaded))
    values.update({k.replace("-", "_"): v for k, v in (overrides or {}).items()})
    unknown = set(values) - set(fields_)
    if unknown:
        raise _unknown(unknown, fields_)
    cfg = cls()
    for key, value in values.items():
        _set(cfg, key, _convert(key, fields_[key].type, value))
    return cfg


def help_text(cls) -> str:
    """Every key with its type, default and docstring, as `--help` prints them."""
    lines = []
    for name, key in flat_fields(cls).items():
        lines.append(f"  --{name} ({_type_name(key.type)}, default {key.default!r})")
        lines += textwrap.wrap(key.doc, width=96, initial_indent="      ", subsequent_indent="      ")
    return "keys:\n" + "\n".join(lines)


def parse_args(cls, argv: list[str], prog: str | None = None):
    """Parse `--config FILE` and `--key value` (or `--key=value`; `--flag` alone for booleans)."""
    fields_ = flat_fields(cls)
    parser = argparse.ArgumentParser(
        prog=prog, description=(cls.__doc__ or "").strip(), epilog=help_text(cls),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file of keys (nested mappings for dotted keys)")
    args, rest = parser.parse_known_args(argv)
    overrides, i = {}, 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--"):
            raise ValueError(f"expected --key value, got {token!r}; `--help` lists every key")
        key = token[2:].replace("-", "_")
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif key in fields_ and fields_[key].type is bool and (i + 1 == len(rest) or rest[i + 1].startswith("--")):
            value, i = True, i + 1
        elif i + 1 < len(rest):
            value, i = rest[i + 1], i + 2
        else:
            raise ValueError(f"config key --{key} needs a value")
        if key not in fields_:
            raise _unknown([key], fields_)
        overrides[key] = value
    return load_config(cls, overrides, args.config)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


class RunError(RuntimeError):
    """A run that cannot go on (it diverged, a reward hangs, the disk is full): `run_cli` prints
    `prog: error: ...` and exits with `exit_code` (1), no traceback."""

    exit_code = 1


class Stopped(RunError):
    """A signal stopped the run after its checkpoint: exit 128 + the signal's number (SIGTERM 143,
    SIGINT 130), as a shell reports a process the signal ended."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def run_cli(cls, argv: list[str], prog: str, train) -> int:
    """Parse `argv` into `cls` and call `train(cfg)`; bad input (ValueError/TypeError) prints
    `prog: error: ...` and returns 2 instead of a traceback; a run that cannot go on (RunError)
    returns its exit code (1; 143 / 130 when SIGTERM / SIGINT stopped it after a checkpoint);
    Ctrl-C outside a training loop (loading, evaluating, exporting) returns 130."""
    log = logging.getLogger("fastrlhf")
    try:
        train(parse_args(cls, argv, prog=prog))
    except (ValueError, TypeError) as e:
        log.debug("error details", exc_info=True)
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return e.exit_code
    except RunError as e:
        log.debug("error details", exc_info=True)
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted outside a training loop; the checkpoints written so far are kept", file=sys.stderr)
        return 130
    return 0
