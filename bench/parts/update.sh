# part `update` of bench/gpu_run.sh (sourced): the PPO update phase of the 0.5B config     -> OUT/update.json
#   update   420 / 120  bench/update_record.py: qwen2-0.5b, LoRA r16, bf16, 64 x (8 + 256) tokens, 2 epochs,
#                       micro-batches of 16: update_s with compile off/on x padded/packed, packed vs padded on a
#                       32-256 spread, the FLOP floor at a measured peak, ops per layer, peak memory
#                       (dry run: the tiny model on CPU, compiled by aot_eager)
if [ "$DRY" = 1 ]; then
  L_UPDATE=120 UPDATE_ARGS=(--dry-run)
else
  L_UPDATE=420 UPDATE_ARGS=()
fi
step update "$L_UPDATE" 12 "$PY" bench/update_record.py "${UPDATE_ARGS[@]}" --out "$OUT/update.json"
