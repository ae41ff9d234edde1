# part `rollout` of bench/gpu_run.sh (sourced): issue 26's samplers, one process each  -> OUT/rollout.json
#   rollout_graph    170 / 90   bench/rollout_bench.py --engine graph: fastrlhf's decode engine (compile, capture,
#                               a first rollout, then 3 PPO steps)
#   rollout_static   130 / 90   --engine static: transformers' generate, static cache (compiled by transformers)
#   rollout_dynamic  110 / 90   --engine dynamic: transformers' generate, dynamic cache (2 PPO steps)
# each on qwen2-0.5b, LoRA r16, bf16, 64 prompts x 256 new tokens (dry run: the tiny model on CPU, 8 x 8, one PPO
# step); then `bench/gpu_record.py rollout` merges the three into one record with the goals, ratios of this run.
if [ "$DRY" = 1 ]; then
  ROLLOUT_ARGS=(--dry-run --iterations 1) L_RG=90 L_RS=90 L_RD=90
else
  ROLLOUT_ARGS=() L_RG=170 L_RS=130 L_RD=110
fi
step rollout_graph "$L_RG" 6 "$PY" bench/rollout_bench.py --engine graph "${ROLLOUT_ARGS[@]}" \
  --out "$WORK/rollout_graph.json"
step rollout_static "$L_RS" 6 "$PY" bench/rollout_bench.py --engine static "${ROLLOUT_ARGS[@]}" \
  --out "$WORK/rollout_static.json"
step rollout_dynamic "$L_RD" 6 "$PY" bench/rollout_bench.py --engine dynamic --iterations 2 "${ROLLOUT_ARGS[@]}" \
  --out "$WORK/rollout_dynamic.json"
"$PY" bench/gpu_record.py rollout "$OUT/rollout.json" "$WORK"/rollout_{graph,static,dynamic}.json \
  --command "bash bench/gpu_run.sh OUT --only rollout$([ "$DRY" = 1 ] && echo ' --dry-run')"
