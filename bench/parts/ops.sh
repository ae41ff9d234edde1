# part `ops` of bench/gpu_run.sh (sourced): the kernels at the target shapes   -> OUT/bench.json, OUT/bench.png
#   ops      390 / 90   fastrlhf bench --cases targets (dry run: --device cpu --cases tiny), with the tests'
#                       peer_stubs standing in for the peers' unused ray / vllm / deepspeed imports
# Sized for `--only ops` within 8 minutes on an H100 (install 45 + env 25 + ops 390 + the record): the targets
# set is 6 vocabulary cases and the five [B, T] ops at [1024 x 4096] and [4 x 256], each timed three ways
# (GPU time with the host hidden, host us per call, back-to-back wall time) for fastrlhf, torch and every peer
# (verl, OpenRLHF, TRL, Liger) first; torch.compile, slowest to measure, gets what is left of the budget.
# With the default parts (tests, ops, ppo) the global deadline cuts the last part short.
L_OPS=$([ "$DRY" = 1 ] && echo 90 || echo 390)
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
