#!/usr/bin/env bash
# One call on a bare GPU machine without network, in under 9 minutes:
#
#   bash bench/gpu_run.sh OUT            # install, environment, tests on CUDA, bench at the target shapes, PPO run
#   bash bench/gpu_run.sh OUT --dry-run  # the same steps on CPU (CUDA hidden) at small shapes (CI: tests/test_gpu_run.py)
#   bash bench/gpu_run.sh OUT --experiments [--dry-run]   # install, environment, then the experiments below
#                                          # instead of tests, bench and PPO (each a JSON file in OUT)
#
# Steps, each with its own time limit (seconds, GPU / dry run), run in order and continue on
# failure; a global deadline cuts the last ones short if earlier ones ran long:
#   install   45 / 30   pip install --no-build-isolation --no-deps -e . into the image's python
#                       (dry run: checks that `fastrlhf` imports from this checkout, installs nothing);
#                       wheels in .whl/, if present, are installed too (--no-deps): what the image lacks, e.g.
#                       datasets (a dependency) and the peers verl / OpenRLHF / TRL for the tests and the bench;
#                       the machine is bare and given back after the run, so its python takes them directly
#                       (subprocesses of the tests and of torchrun see them too)
#   env       25 / 30   nvidia-smi, torch / triton / CUDA versions, SM and memory clocks, commit, kernels tree
#   tests    220 / 90   pytest tests/ on CUDA (xdist and per-test timeouts when installed; dry run: tests/test_kl.py)
#   bench    130 / 90   fastrlhf bench --cases targets (dry run: --device cpu --cases tiny), with the tests'
#                       peer_stubs standing in for the peers' unused ray / vllm / deepspeed imports
#   ppo      140 / 90   fastrlhf ppo on qwen2-0.5b, LoRA, bf16 (dry run: the tiny model on CPU)
#
# Wheels: `bash bench/gpu_wheels.sh` (here, with network) fills .whl/ with what the GPU image lacks (datasets,
# the peers); pass `.whl` in the device call's carry. Without them the run still goes, but the tests that need
# datasets fail and the bench has no peer columns.
#
# OUT receives 6 files, no folders (the device tool returns at most 8, 16 MiB each):
#   status.json  every step's rc, seconds and limit; commit, kernels tree hash; the environment
#   bench.json   the `fastrlhf bench` record (rewritten after every case) -> bench/results/<date>-<gpu>.json
#   bench.png    its plot
#   ppo.json     the PPO run: command, summary (phase seconds, peak memory), per-step rows, steady-state means
#   tests.log    pytest's output
#   logs.tar.gz  every step's log, env.json, junit.xml, the PPO run's metrics.jsonl, summary.json and plots
# Experiments (--experiments), each with its own limit (GPU / dry run), its JSON in OUT:
#   dist     200 / 120  bench/dist_peak_memory.py: a 1-rank NCCL --shard full PPO run's peak vs the planner
#                       (issue 11)                                                       -> dist_peak_memory.json
#   coop     150 / 90   bench/experiments/coop_actor_loss.py: the split-row actor loss vs the fused one  -> coop.json
#   chunks   150 / 90   bench/experiments/linear_chunks.py: linear ops' time and extra peak per chunk size -> linear_chunks.json
#   few_rows  60 / 60   bench/experiments/few_rows_profile.py: kernel vs host time of logprobs at B=1, T=128 -> few_rows.json
# Environment: PYTHON (default python3), GPU_RUN_DEADLINE_S (default 525; dry run 300).
set -uo pipefail

usage() { echo "usage: $0 OUT [--dry-run] [--experiments]" >&2; exit 2; }
OUT="" DRY=0 EXPERIMENTS=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --experiments) EXPERIMENTS=1 ;;
    -*) usage ;;
    *) [ -z "$OUT" ] || usage; OUT="$arg" ;;
  esac
done
[ -n "$OUT" ] || usage

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_run.XXXXXX")"
mkdir -p "$WORK/logs"
: > "$WORK/steps.tsv"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export CI="${CI:-true}"  # tests/conftest.py: hypothesis replays CI's fixed examples, so a GPU failure reproduces on CPU
cd "$REPO"

START=$(date +%s)
if [ "$DRY" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""  # on CPU even where a GPU is present
  DEADLINE=$((START + ${GPU_RUN_DEADLINE_S:-300}))
  L_INSTALL=30 L_ENV=30 L_TESTS=90 L_BENCH=90 L_PPO=90
else
  DEADLINE=$((START + ${GPU_RUN_DEADLINE_S:-525}))
  L_INSTALL=45 L_ENV=25 L_TESTS=220 L_BENCH=130 L_PPO=140
fi

has_module() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }

bundle() {  # logs.tar.gz of everything in WORK but model weights and installed wheels; cheap, redone after each step
  tar czf "$OUT/logs.tar.gz.tmp" -C "$WORK" --exclude=./ppo_run/ppo . 2>/dev/null \
    && mv "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
}

# step NAME LIMIT TAIL_LINES COMMAND...: run COMMAND (a program, or a function of this script) under
# min(LIMIT, time to the deadline), log to WORK/logs/NAME.log, print its last TAIL_LINES lines,
# record "name rc seconds limit" in steps.tsv
export PY REPO WORK
step() {
  local name=$1 limit=$2 tail_lines=$3; shift 3
  if declare -F "$1" > /dev/null; then export -f "$1"; set -- bash -c "$1"; fi
  local left=$((DEADLINE - $(date +%s) - 5))
  [ "$left" -lt "$limit" ] && limit=$left
  local log="$WORK/logs/$name.log"
  if [ "$limit" -le 5 ]; then
    echo "== $name: skipped, no time left before the deadline"
    printf '%s\tskipped\t0\t0\n' "$name" >> "$WORK/steps.tsv"
    return
  fi
  echo "== $name (limit ${limit} s): $*"
  local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  local dt=$(($(date +%s) - t0))
  tail -n "$tail_lines" "$log" | cut -c1-220
  echo "== $name: rc $rc in ${dt} s$([ $rc = 124 ] || [ $rc = 137 ] && echo ' (TIMED OUT)')"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$limit" >> "$WORK/steps.tsv"
  bundle
}

# 1. install
if [ "$DRY" = 1 ]; then
  step install "$L_INSTALL" 5 "$PY" -c "
import pathlib, fastrlhf, fastrlhf.kernels
where = pathlib.Path(fastrlhf.__file__).resolve().parents[1]
print('dry run: would run: $PY -m pip install --no-build-isolation --no-deps -e $REPO')
print('fastrlhf imports from', where)
assert where == pathlib.Path('$REPO').resolve(), f'fastrlhf imports from {where}, not from $REPO'"
else
  install() {
    "$PY" -m pip install --no-build-isolation --no-deps --no-index -e "$REPO" || return
    if compgen -G "$REPO/.whl/*.whl" > /dev/null; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile "$REPO"/.whl/*.whl || return
    fi
    "$PY" -c "import fastrlhf, fastrlhf.kernels; print('fastrlhf from', fastrlhf.__file__)"
  }
  step install "$L_INSTALL" 5 install
fi

# 2. environment
environment() {
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,pstate,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,power.limit \
      --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| triton', triton.__version__, '| cuda', torch.version.cuda, '| cuda available', torch.cuda.is_available())"
  echo "commit $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo 'unknown (no git)'), kernels tree $(git -C "$REPO" rev-parse HEAD:kernels 2>/dev/null || echo 'unknown (no git)')"
  "$PY" -c "from fastrlhf.bench.environment import main; main()" > "$WORK/env.json" || return
  "$PY" -c "
import json; e = json.load(open('$WORK/env.json')); g = e.get('gpu') or {}; s = g.get('state_at_start') or {}
print('device', e['device'], '| kernels_tree_files', e['kernels_tree_files'], '| dirty', e['dirty'])
print('SM clock', s.get('clocks.sm'), 'of', s.get('clocks.max.sm'), 'MHz | memory clock', s.get('clocks.mem'), 'of',
      s.get('clocks.max.mem'), 'MHz | nominal bandwidth', (g.get('nominal_bandwidth') or {}).get('gbps'), 'GB/s')"
}
step env "$L_ENV" 8 environment

if [ "$EXPERIMENTS" = 1 ]; then
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
  "$PY" bench/gpu_record.py status "$WORK/steps.tsv" "$WORK/env.json" "$OUT/status.json" $([ "$DRY" = 1 ] && echo --dry-run)
  bundle
  echo "== summary ($(($(date +%s) - START)) s)"
  "$PY" bench/gpu_record.py summary "$OUT"
  echo "== files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
  exit 0
fi

# 3. tests
if [ "$DRY" = 1 ]; then
  step tests "$L_TESTS" 3 "$PY" -m pytest -q -p no:cacheprovider tests/test_kl.py --junitxml="$WORK/junit.xml"
else
  TEST_ARGS=(-q -p no:cacheprovider --maxfail=25 --durations=15 --junitxml="$WORK/junit.xml")
  has_module xdist && TEST_ARGS+=(-n 14 --dist loadfile)
  has_module pytest_timeout && TEST_ARGS+=(--timeout 120)
  step tests "$L_TESTS" 25 "$PY" -m pytest "${TEST_ARGS[@]}" tests/
fi
cp "$WORK/logs/tests.log" "$OUT/tests.log" 2>/dev/null

# 4. bench
if [ "$DRY" = 1 ]; then
  BENCH_ARGS=(--device cpu --cases tiny --threads 1 --rep-ms 1 --budget-s $((L_BENCH - 40)))
else
  BENCH_ARGS=(--cases targets --budget-s $((L_BENCH - 50)))  # the last pass started may compile for ~30 s
fi
# verl's and OpenRLHF's modules import ray / vllm / deepspeed at module level (absent from the image and from the
# --no-deps peer wheels) without using them in the functions timed: the tests' peer_stubs stands in for them, so the
# peers' columns (e.g. verl's GAE) are measured rather than skipped
WITH_PEER_STUBS=(env PYTHONPATH="$REPO/tests/integrations${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c
                 "import sys, peer_stubs; peer_stubs.install(); from fastrlhf.cli import main; sys.exit(main())")
step bench "$L_BENCH" 3 "${WITH_PEER_STUBS[@]}" bench "${BENCH_ARGS[@]}" --json "$OUT/bench.json" --plot "$OUT/bench.png"

# 5. PPO timing run
if [ "$DRY" = 1 ]; then
  PPO_ARGS=(--model tiny --device cpu --steps 2 --rollout_batch_size 8 --mini_batch_size 4 --micro_batch_size 2
            --max_new_tokens 8 --lora_rank 4 --eval_prompts 8)
else
  PPO_ARGS=(--model qwen2-0.5b --device cuda --dtype bfloat16 --steps 3 --rollout_batch_size 64 --mini_batch_size 32
            --micro_batch_size 16 --max_new_tokens 256 --lora_rank 16 --eval_prompts 16)
fi
PPO_ARGS+=(--reward fastrlhf.task:true_score --out "$WORK/ppo_run" --save_every 1000)
step ppo "$L_PPO" 3 "$PY" -m fastrlhf ppo "${PPO_ARGS[@]}"
"$PY" bench/gpu_record.py ppo "$WORK/ppo_run" "$OUT/ppo.json" --command "fastrlhf ppo ${PPO_ARGS[*]}"

# 6. status, logs, summary
"$PY" bench/gpu_record.py status "$WORK/steps.tsv" "$WORK/env.json" "$OUT/status.json" $([ "$DRY" = 1 ] && echo --dry-run)
bundle
echo "== summary ($(($(date +%s) - START)) s)"
"$PY" bench/gpu_record.py summary "$OUT"
echo "== files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
[ "$DRY" = 1 ] || echo "== record it: cp OUT/bench.json bench/results/$(date +%F)-<gpu>.json; python bench/README_table.py"
rm -rf "$WORK"
"$PY" -c "import json, sys; sys.exit(0 if json.load(open('$OUT/status.json'))['ok'] else 1)"
