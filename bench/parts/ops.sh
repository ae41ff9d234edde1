# part `ops` of bench/gpu_run.sh (sourced): the kernels at the target shapes   -> OUT/bench.json, OUT/bench.png
#   ops      130 / 90   fastrlhf bench --cases targets (dry run: --device cpu --cases tiny), with the tests'
#                       peer_stubs standing in for the peers' unused ray / vllm / deepspeed imports
L_OPS=$([ "$DRY" = 1 ] && echo 90 || echo 130)
if [ "$DRY" = 1 ]; then
  BENCH_ARGS=(--device cpu --cases tiny --threads 1 --rep-ms 1 --budget-s $((L_OPS - 40)))
else
  BENCH_ARGS=(--cases targets --budget-s $((L_OPS - 50)))  # the last pass started may compile for ~30 s
fi
# verl's and OpenRLHF's modules import ray / vllm / deepspeed at module level (absent from the image and from the
# --no-deps peer wheels) without using them in the functions timed: the tests' peer_stubs stands in for them, so the
# peers' columns (e.g. verl's GAE) are measured rather than skipped
WITH_PEER_STUBS=(env PYTHONPATH="$REPO/tests/integrations${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c
                 "import sys, peer_stubs; peer_stubs.install(); from fastrlhf.cli import main; sys.exit(main())")
step ops "$L_OPS" 3 "${WITH_PEER_STUBS[@]}" bench "${BENCH_ARGS[@]}" --json "$OUT/bench.json" --plot "$OUT/bench.png"
