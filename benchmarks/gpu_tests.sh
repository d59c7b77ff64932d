#!/usr/bin/env bash
# The GPU test tier (`pytest -m gpu`) on a GPU machine without network, in one call:
#   bash benchmarks/gpu_tests.sh --work DIR --out DIR --carry DIR
# It installs the carried packages and builds llama.cpp with CUDA into the tests' own cache
# (WORK/test-cache, as GEMMACTL_TEST_CACHE) the way gpu_toolchain.sh setup does (about 7 minutes
# the first time; a later call with the same WORK reuses the build), then runs every test marked
# gpu and writes pytest's report to OUT/gpu-tests.txt (docs/benchmarks.md records the last one).
# Options: see benchmarks/gpu_common.sh (--carry as for gpu_toolchain.sh setup).
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
export GEMMACTL_TEST_CACHE=$work/test-cache
mkdir -p "$GEMMACTL_TEST_CACHE/store"
setup=(--work "$work" --out "$out/toolchain" --home "$GEMMACTL_TEST_CACHE/store")
[ -z "$carry" ] || setup+=(--carry "$carry")
[ -z "$vocab" ] || setup+=(--vocab "$vocab")
bash "$root/benchmarks/gpu_toolchain.sh" "${setup[@]}" setup
cd "$root"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/GPU: /' > "$out/gpu-tests.txt"
python -m pytest -m gpu -p no:cacheprovider -q -rs tests 2>&1 | tee -a "$out/gpu-tests.txt"
