#!/usr/bin/env bash
# One call on a bare GPU machine without network, in under 9 minutes:
#
#   bash bench/gpu_run.sh OUT                       # install, environment, then the parts tests, ops, ppo
#   bash bench/gpu_run.sh OUT --only ops[,PART...]  # install, environment, then only the parts named
#   bash bench/gpu_run.sh OUT --dry-run [...]       # the same steps on CPU (CUDA hidden) at small shapes
#                                                   # (CI: tests/bench/test_gpu_run.py)
#   bash bench/gpu_run.sh OUT --experiments         # the same as --only experiments
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
# then each part, a file bench/parts/PART.sh sourced by this script (a new part is a new file; its header says
# what it runs, its steps' limits and the files it leaves in OUT). It runs its steps with `step` (below) and
# may read DRY (1 on a dry run), OUT, WORK (scratch, removed at the end), PY, REPO and START. The parts today:
#   tests        pytest tests/ on CUDA                                   -> tests.log
#   ops          fastrlhf bench --cases targets (the kernels)            -> bench.json, bench.png
#   ppo          fastrlhf ppo on qwen2-0.5b, LoRA, bf16                  -> ppo.json
#   experiments  the candidates in bench/experiments/, FSDP2 peak memory -> one JSON each
#   rollout      bench/rollout_bench.py: the graph decode engine vs generate's static and dynamic caches
#                on qwen2-0.5b (issue 26)                                -> rollout.json
#   e2e          fastrlhf's GRPO iteration beside TRL's GRPOTrainer      -> e2e.json
#   decode_attention  bench/decode_attention.py: the decode attention op beside SDPA, flex attention and flash-attn
#                at the Qwen2.5 head shapes, its goals judged in the run (issue 41)  -> decode_attention.json
#   rollout_lengths  bench/rollout_lengths.py: rollouts at RL shapes (N 256 = 32 x G 8, P 512, R 4096, log-normal
#                lengths): this engine, the one before issue 42, transformers' continuous batching -> rollout_lengths.json
# and always status.json (every step's rc, seconds and limit; commit, kernels tree hash; the environment) and
# logs.tar.gz (every step's log, env.json and what the parts add to WORK). The device tool returns at most 8
# files, 16 MiB each, and no folders: keep a call's parts within that.
#
# Wheels: `bash bench/gpu_wheels.sh` (here, with network) fills .whl/ with what the GPU image lacks (datasets,
# the peers); pass `.whl` in the device call's carry. Without them the run still goes, but the tests that need
# datasets fail and the bench has no peer columns.
# Environment: PYTHON (default python3), GPU_RUN_DEADLINE_S (default 525; dry run 300).
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
usage() {
  echo "usage: $0 OUT [--dry-run] [--only PART[,PART...]] [--experiments]; parts: $(cd "$REPO/bench/parts" && ls *.sh | sed 's/\.sh$//' | tr '\n' ' ')" >&2
  exit 2
}
OUT="" DRY=0 PARTS="tests,ops,ppo"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --experiments) PARTS=experiments ;;
    --only) [ $# -ge 2 ] || usage; PARTS=$2; shift ;;
    --only=*) PARTS=${1#--only=} ;;
    -*) usage ;;
    *) [ -z "$OUT" ] || usage; OUT="$1" ;;
  esac
  shift
done
[ -n "$OUT" ] || usage
IFS=, read -ra PART_LIST <<< "$PARTS"
for part in "${PART_LIST[@]}"; do
  [ -f "$REPO/bench/parts/$part.sh" ] || { echo "unknown part '$part'" >&2; usage; }
done
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
  L_INSTALL=30 L_ENV=30
else
  DEADLINE=$((START + ${GPU_RUN_DEADLINE_S:-525}))
  L_INSTALL=45 L_ENV=25
fi

has_module() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }

bundle() {  # logs.tar.gz of everything in WORK but model weights and installed wheels; cheap, redone after each step
  tar czf "$OUT/logs.tar.gz.tmp" -C "$WORK" --exclude=./ppo_run/ppo --exclude=./e2e/models --exclude=./e2e/learn . \
    2>/dev/null \
    && mv "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
}

# step NAME LIMIT TAIL_LINES COMMAND...: run COMMAND (a program, or a function of this script) under
# min(LIMIT, time to the deadline), log to WORK/logs/NAME.log, print its last TAIL_LINES lines,
# record "name rc seconds limit" in steps.tsv
export PY REPO WORK DRY OUT
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
  echo "commit $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo 'unknown (no git)'), kernels tree $(git -C "$REPO" rev-parse HEAD:fastrlhf/kernels 2>/dev/null || echo 'unknown (no git)')"
  "$PY" -c "
import json, sys, torch, triton
print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| cuda',
      torch.version.cuda, '| cuda available', torch.cuda.is_available())
from fastrlhf.bench.environment import environment
e = environment(torch.device('cuda' if torch.cuda.is_available() else 'cpu'))
open('$WORK/env.json', 'w').write(json.dumps(e, indent=1) + '\\n')
g = e.get('gpu') or {}; s = g.get('state_at_start') or {}
print('device', e['device'], '| kernels_tree_files', e['kernels_tree_files'], '| dirty', e['dirty'])
print('SM clock', s.get('clocks.sm'), 'of', s.get('clocks.max.sm'), 'MHz | memory clock', s.get('clocks.mem'), 'of',
      s.get('clocks.max.mem'), 'MHz | nominal bandwidth', (g.get('nominal_bandwidth') or {}).get('gbps'), 'GB/s')"
}
step env "$L_ENV" 8 environment

# 3. the parts, in the order given
for part in "${PART_LIST[@]}"; do
  # shellcheck source=/dev/null
  source "$REPO/bench/parts/$part.sh"
done

# 4. status, logs, summary
"$PY" bench/gpu_record.py status "$WORK/steps.tsv" "$WORK/env.json" "$OUT/status.json" $([ "$DRY" = 1 ] && echo --dry-run)
bundle
echo "== summary ($(($(date +%s) - START)) s)"
"$PY" bench/gpu_record.py summary "$OUT"
echo "== files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
[ "$DRY" = 1 ] || [ ! -f "$OUT/bench.json" ] \
  || echo "== record it: cp OUT/bench.json bench/results/$(date +%F)-<gpu>.json; python bench/README_table.py"
[ "$DRY" = 1 ] || [ ! -f "$OUT/rollout.json" ] \
  || echo "== record it: cp OUT/rollout.json bench/results/$(date +%F)-<gpu>-rollout.json; python bench/README_table.py"
rm -rf "$WORK"
"$PY" -c "import json, sys; sys.exit(0 if json.load(open('$OUT/status.json'))['ok'] else 1)"
