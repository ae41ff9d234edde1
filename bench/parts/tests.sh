# part `tests` of bench/gpu_run.sh (sourced): pytest tests/ on CUDA            -> OUT/tests.log
#   tests    220 / 90   (xdist and per-test timeouts when installed; dry run: the hand-worked cases of
#                       tests/ops/test_kl.py, both backends: the step's run, not the suite, which CI runs anyway)
if [ "$DRY" = 1 ]; then
  step tests 90 3 "$PY" -m pytest -q -p no:cacheprovider tests/ops/test_kl.py -k hand_worked --junitxml="$WORK/junit.xml"
else
  TEST_ARGS=(-q -p no:cacheprovider --maxfail=25 --durations=15 --junitxml="$WORK/junit.xml")
  has_module xdist && TEST_ARGS+=(-n 14 --dist loadfile)
  has_module pytest_timeout && TEST_ARGS+=(--timeout 120)
  step tests 220 25 "$PY" -m pytest "${TEST_ARGS[@]}" tests/
fi
cp "$WORK/logs/tests.log" "$OUT/tests.log" 2>/dev/null
