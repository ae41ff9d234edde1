# part `e2e` of bench/gpu_run.sh (sourced): fastrlhf's GRPO iteration beside TRL's GRPOTrainer, same work -> OUT/e2e.json
#   e2e      430 / 240  bench/e2e.py --device cuda --only grpo: qwen2-0.5b (random weights, EOS unreachable), 8 prompts
#                       x 8 generations x 256 tokens per iteration, LoRA 16, bf16; fastrlhf, TRL as shipped, TRL matched
#                       (cache_implementation static), then TRL matched with continuous batching if time is left;
#                       1 warm-up + 2 timed iterations each, one fresh process each; no run starts within 30 s of the
#                       step's end, and the record is rewritten after every run (a cut run keeps the ones before it)
#                       (dry run: --device cpu --quick --only grpo). Needs TRL and accelerate: bench/gpu_wheels.sh.
if [ "$DRY" = 1 ]; then
  L_E2E=240 E2E_ARGS=(--device cpu --quick --only grpo)
else
  L_E2E=430 E2E_ARGS=(--device cuda --only grpo)
fi
E2E_LEFT=$((DEADLINE - $(date +%s) - 5))  # what `step` will allow: its limit, or less when the deadline is nearer
[ "$E2E_LEFT" -lt "$L_E2E" ] && E2E_LIMIT=$E2E_LEFT || E2E_LIMIT=$L_E2E
step e2e "$L_E2E" 40 "$PY" bench/e2e.py "${E2E_ARGS[@]}" --deadline-s $((E2E_LIMIT - 20)) --work "$WORK/e2e" \
  --out "$OUT/e2e.json"
