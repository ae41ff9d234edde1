# part `rollout_lengths` of bench/gpu_run.sh (sourced): issue 42's rollouts at RL shapes, one process each -> OUT/rollout_lengths.json
#   lengths_new     140 / 60   bench/rollout_lengths.py --engine new: this checkout's decode engine (compile and
#                              capture of every bucket, a first rollout, a timed one, the full-batch step, the gap)
#   lengths_before  100 / 60   --engine before: the engine of commit ca0a2cd (git show), one static batch to R
#   lengths_hf_cb    80 / 60   --engine hf_cb: transformers' continuous batching, each row's own max_new_tokens
# each on qwen2-0.5b, bf16, N 256 = 32 prompts x G 8, P 512, R 4096, log-normal lengths (median 0.2 R, 5% at R);
# LoRA r16 on fastrlhf's engines (dry run: the tiny model on CPU, N 16, P 16, R 32); then the merge judges the
# goals, ratios of this run. Sized for `--only rollout_lengths` within 8 minutes: install 45 + env 25 + 320 + merge.
# PYTHONPATH: the script imports this checkout's fastrlhf, whatever the python has installed.
if [ "$DRY" = 1 ]; then
  LENGTHS_ARGS=(--dry-run) L_LN=60 L_LB=60 L_LC=60
else
  LENGTHS_ARGS=() L_LN=140 L_LB=100 L_LC=80
fi
LENGTHS_PY=(env PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" bench/rollout_lengths.py)
LENGTHS_MISSING=()
for engine in new before hf_cb; do
  limit_var="L_L$(echo "${engine:0:1}" | tr a-z A-Z)"; [ "$engine" = hf_cb ] && limit_var=L_LC
  step "lengths_$engine" "${!limit_var}" 4 "${LENGTHS_PY[@]}" --engine "$engine" "${LENGTHS_ARGS[@]}" \
    --out "$WORK/lengths_$engine.json"
  rc=$(awk -F'\t' -v n="lengths_$engine" '$1 == n {rc = $2} END {print rc}' "$WORK/steps.tsv")
  [ "$rc" = 0 ] || LENGTHS_MISSING+=(--missing "$engine: step rc $rc (logs.tar.gz: logs/lengths_$engine.log)")
done
"${LENGTHS_PY[@]}" --merge "$OUT/rollout_lengths.json" "$WORK"/lengths_{new,before,hf_cb}.json "${LENGTHS_MISSING[@]}" \
  --command "bash bench/gpu_run.sh OUT --only rollout_lengths$([ "$DRY" = 1 ] && echo ' --dry-run')"
