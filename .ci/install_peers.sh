#!/usr/bin/env bash
# Installs the peers that tests/integrations runs against into a venv (default: .venv).
#
# verl and OpenRLHF come without their dependencies (ray, vllm, deepspeed, flash-attn, ...:
# GPU serving stacks the tested loss / log-prob code never calls; tests/integrations/peer_stubs.py
# stands in for their imports), plus the few light modules that importing their core_algos,
# models and losses needs. TRL comes with its own (light) dependencies. Versions are pinned:
# the tests compare against these releases' numbers. TRL 1.12's wheel (the last TRL with
# PPOTrainer) is only downloaded, to .whl/trl-1.12/: bench/e2e.py imports it from that file in
# its own process, beside the installed TRL.
#
# usage: .ci/install_peers.sh [VENV_DIR]   (relative to the repository root, or absolute)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

"${PIP[@]}" --no-deps verl==0.9.1 openrlhf==0.11.2
# Liger (the bench's log-prob and distillation peer): pure Python over torch and triton, installed on CPU too so
# that its provider's import is checked (tests/bench/test_bench.py) and its fused linear JSD runs in the Triton
# interpreter against linear_distill_loss (tests/integrations/test_distill_peers.py)
"${PIP[@]}" --no-deps liger-kernel==0.8.5
# verl 0.9.1 pins tensordict <= 0.10.0. pip then lists the peers' other (deliberately skipped)
# dependencies as missing: expected, and filtered from the log; a failing install still fails.
log="$(mktemp)"
# ray (CPU wheel, with its own light dependencies): tests/integrations/test_switch_ray.py starts a local
# ray.init(num_cpus=2) whose actors import verl and OpenRLHF. Tested with 2.60.0 (OpenRLHF 0.11.2 declares
# ray[default]==2.55.0: pip's complaint about it is filtered below with the others; the tests use no [default] part)
if ! "${PIP[@]}" "tensordict==0.10.0" omegaconf codetiming pylatexenc "trl==1.16.0" "ray==2.60.0" >"$log" 2>&1; then
  cat "$log"
  exit 1
fi
grep -v -e "^ERROR: pip's dependency resolver" -e "^verl 0.9.1 requires" -e "^openrlhf 0.11.2 requires" \
  -e "^WARNING: Location" "$log" || true
rm -f "$log"
"$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps "trl==1.12.0" -d .whl/trl-1.12
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
print("peers:", ", ".join(f"{d} {md.version(d)}" for d in ("verl", "openrlhf", "trl", "liger-kernel", "tensordict", "ray")))
PY
