#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels bench/gpu_run.sh installs on the GPU machine (which has
# none): what its image lacks of fastrlhf's dependencies (datasets and its own), and the peers the tests
# and the bench compare against (verl, OpenRLHF, TRL, Liger, at .ci/install_peers.sh's versions, with what
# their imported modules need). Python 3.12, x86-64 manylinux, no dependencies resolved.
#
#   bash bench/gpu_wheels.sh [DIR]     # DIR defaults to .whl (add /.whl/ to .git/info/exclude)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
mkdir -p "$DIR"
WHEELS=(
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19                       # fastrlhf's data loading
  verl==0.9.1 openrlhf==0.11.2 trl==1.16.0 liger-kernel==0.8.5            # the peers
  tensordict==0.10.0 pyvers==0.1.0 orjson==3.13.0 importlib_metadata==10.2.0  # verl's imports
  omegaconf==2.4.0 codetiming==1.4.0 pylatexenc==2.11
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d "$DIR" "${WHEELS[@]}"
ls "$DIR"
