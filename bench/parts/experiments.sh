# part `experiments` of bench/gpu_run.sh (sourced), each with its own limit (GPU / dry run), its JSON in OUT:
#   dist     200 / 120  bench/dist_peak_memory.py: a 1-rank NCCL --shard full PPO run's peak vs the planner
#                       (issue 11)                                                       -> dist_peak_memory.json
#   coop     150 / 90   bench/experiments/coop_actor_loss.py: the split-row actor loss vs the fused one  -> coop.json
#   chunks   150 / 90   bench/experiments/linear_chunks.py: linear ops' time and extra peak per chunk size -> linear_chunks.json
#   few_rows  60 / 60   bench/experiments/few_rows_profile.py: kernel vs host time of logprobs at B=1, T=128 -> few_rows.json
if [ "$DRY" = 1 ]; then
  COOP_ARGS=(--dry-run) CHUNK_ARGS=(--dry-run) DIST_ARGS=(--device cpu --model tiny --steps 2 --rollout-batch 8
                                                           --mini-batch 4 --micro-batch 2)
  FEW_ARGS=(--dry-run) L_COOP=90 L_CHUNKS=90 L_DIST=120 L_FEW=60
else
  COOP_ARGS=() CHUNK_ARGS=() DIST_ARGS=() FEW_ARGS=() L_COOP=150 L_CHUNKS=150 L_DIST=200 L_FEW=60
fi
# in order of need: issue 11's run first, the deadline cuts the last ones short
step dist "$L_DIST" 20 "$PY" bench/dist_peak_memory.py "${DIST_ARGS[@]}" --out "$OUT/dist_peak_memory.json"
step coop "$L_COOP" 30 "$PY" bench/experiments/coop_actor_loss.py "${COOP_ARGS[@]}" --out "$OUT/coop.json"
step chunks "$L_CHUNKS" 45 "$PY" bench/experiments/linear_chunks.py "${CHUNK_ARGS[@]}" --out "$OUT/linear_chunks.json"
step few_rows "$L_FEW" 25 "$PY" bench/experiments/few_rows_profile.py "${FEW_ARGS[@]}" --out "$OUT/few_rows.json"
