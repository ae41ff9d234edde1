# part `decode_attention` of bench/gpu_run.sh (sourced): issue 41's decode attention    -> OUT/decode_attention.json
#   decode_attention  390 / 90   bench/decode_attention.py: `fastrlhf bench --cases decode_attention --ops
#                                decode_attention` (bf16, the Qwen2.5-0.5B and 7B head shapes, B 64 / 256, 512 / 2048 /
#                                4096 written slots of 4608, G 1 / 8) with fastrlhf, SDPA, flash-attn where installed,
#                                then compiled flex attention within the bench's 300 s; the kernel's own K / V tile
#                                counts at every case; the goals, ratios of this run (dry run: the tiny set's decode
#                                cases on CPU, the tile counts in the Triton interpreter, nothing judged)
# Sized for `--only decode_attention` within 8 minutes on an H100 / H200: install 45 + env 25 + 390 + the record.
# PYTHONPATH: the script imports this checkout's fastrlhf, whatever the python has installed.
if [ "$DRY" = 1 ]; then
  L_DECODE=90 DECODE_ARGS=(--dry-run)
else
  L_DECODE=390 DECODE_ARGS=(--budget-s 300)
fi
step decode_attention "$L_DECODE" 40 env PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" bench/decode_attention.py \
  "${DECODE_ARGS[@]}" --out "$OUT/decode_attention.json"
