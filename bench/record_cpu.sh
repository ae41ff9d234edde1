#!/usr/bin/env bash
# The planner's CPU calibration sources, made again on this machine in one session: probe the CPU into
# fastrlhf/estimate/data/devices.json, then ROUNDS times (default 2) record the six runs of
# bench/results/cpu_pipeline_tiny.json and cpu_ppo_*.json (one thread, CPU seconds per phase) and probe again.
# A shared machine's speed drifts while it records (here: 74-93 GFLOP/s on one core within ten minutes), and
# drift only ever slows a run down, so each record is the faster of its rounds (record --keep-faster) and the
# probe takes the best rates and the mean latencies of its probes. Then refit:
# python -m fastrlhf.estimate.calibrate --write.
#
#   bash bench/record_cpu.sh            # ~20 min; run it alone: anything else on the cores enters the records
#
# The records and the probe must come from one machine: the planner prices a CPU run with the probe's
# matmul rate, bandwidth and op latency, and the fitted CPU factors are relative to them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export OMP_NUM_THREADS=1
RES=bench/results
MID=runs/models/mid30m

$PY -m fastrlhf.estimate.calibrate --probe-cpu

# the 30M-parameter Llama of the mid30m runs: random weights from seed 0, the built-in task's char tokenizer
$PY - "$MID" <<'PYTHON'
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastrlhf.train.checkpoint import save_model_dir
from fastrlhf.train.task import build_char_tokenizer

tok = build_char_tokenizer()
torch.manual_seed(0)
config = LlamaConfig(hidden_size=640, intermediate_size=1728, num_hidden_layers=6, num_attention_heads=10,
                     max_position_embeddings=512, rms_norm_eps=1e-6, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
save_model_dir(LlamaForCausalLM(config), tok, Path(sys.argv[1]))
PYTHON

record() {  # NAME NOTE OUT -- COMMAND...: a fresh run; from the second round on, the faster of the rounds is kept
  local name=$1 note=$2 out=$3
  shift 4
  echo "== round $round: $name: $*" >&2
  rm -rf "$out"
  if [ "$round" = 1 ]; then rm -f "$RES/$name.json"; fi  # this session's rounds only
  $PY -m fastrlhf.estimate.record --cpu-time --keep-faster --json "$RES/$name.json" --note "$note" -- "$@"
}
RULE="--data builtin --reward fastrlhf.train.task:true_score --steps 6 --save_every 100"
for round in $(seq "${ROUNDS:-2}"); do
  record cpu_pipeline_tiny "embedded default pipeline (SFT -> RM -> PPO); PPO phases of its 60 iterations" \
    runs/cpu_tiny -- fastrlhf pipeline --out runs/cpu_tiny
  record cpu_ppo_tiny_full_b16_g48 "tiny, full fine-tuning, rule reward, long responses" runs/cpu_tiny_full -- \
    fastrlhf ppo --model tiny $RULE --out runs/cpu_tiny_full --rollout_batch_size 16 --mini_batch_size 16 \
    --micro_batch_size 16 --max_new_tokens 48 --lora_rank 0 --eval_prompts 16
  record cpu_ppo_mid30m_full_b16_g16 "30M-parameter Llama (hidden 640, 6 layers, char vocab; $MID made by \
bench/record_cpu.sh), full fine-tuning, rule reward" runs/cpu_mid_full -- \
    fastrlhf ppo --model $MID $RULE --out runs/cpu_mid_full --rollout_batch_size 16 --mini_batch_size 16 \
    --micro_batch_size 16 --max_new_tokens 16 --lora_rank 0 --eval_prompts 16
  record cpu_ppo_mid30m_lora_b32_g24 "the same 30M-parameter Llama, LoRA 16, rule reward" runs/cpu_mid -- \
    fastrlhf ppo --model $MID $RULE --out runs/cpu_mid --rollout_batch_size 32 --mini_batch_size 16 \
    --micro_batch_size 8 --max_new_tokens 24 --eval_prompts 16
  record cpu_ppo_llama-0.5b_b8_g16 "llama-0.5b shapes (fastrlhf built-in), random weights, LoRA 16, rule reward" \
    runs/cpu_llama -- fastrlhf ppo --model llama-0.5b $RULE --out runs/cpu_llama --rollout_batch_size 8 \
    --mini_batch_size 8 --micro_batch_size 4 --max_new_tokens 16 --eval_prompts 8
  record cpu_ppo_qwen2-0.5b_b8_g12 "qwen2-0.5b shapes (fastrlhf built-in), random weights, LoRA 16, rule reward" \
    runs/cpu_qwen -- fastrlhf ppo --model qwen2-0.5b $RULE --out runs/cpu_qwen --rollout_batch_size 8 \
    --mini_batch_size 8 --micro_batch_size 8 --max_new_tokens 12 --eval_prompts 8
  $PY -m fastrlhf.estimate.calibrate --probe-cpu --again  # merged with the earlier probes
done
