#!/usr/bin/env bash
# `gemmactl plan` on a GPU machine without network: verify at a 4 GiB cap and compare with llama.cpp's --fit.
# Run after `bash benchmarks/gpu_toolchain.sh setup` (CUDA llama.cpp build) in the same machine session:
#   bash benchmarks/gpu_plan.sh [CAP] [CONTEXT]      # defaults: 4G 4096
# Makes the random 270M- and E2B-shaped Q4_K_M GGUFs the toolchain measurements use (kept between
# calls), then runs benchmarks/gpu_plan.py. Results go to $OUT (or /root/gemmactl-gpu/out/plan).
set -euo pipefail
cap=${1:-4G}
context=${2:-4096}
root=$(pwd)
export GEMMACTL_HOME=${GEMMACTL_HOME:-/root/gemmactl-gpu/store} GEMMACTL_NO_PROGRESS=1 PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
gemmactl() { python -m gemmactl "$@"; }
out=${OUT:-/root/gemmactl-gpu/out}/plan
models=/root/gemmactl-gpu/models
mkdir -p "$out" "$models"
src=$GEMMACTL_HOME/sources/llama.cpp-0.3.36
vocab=$src/models/ggml-vocab-gemma-4.gguf; [ -f "$vocab" ] || vocab=$root/.carry/ggml-vocab-gemma-4.gguf
python -c "import diskcache" 2>/dev/null || python -m pip install -q --no-deps .carry/diskcache-*.whl
for kind in gemma3-270m e2b; do
  gguf=$GEMMACTL_HOME/models/$kind-Q4_K_M/$kind-Q4_K_M.gguf
  [ -f "$gguf" ] && continue
  [ -f "$models/$kind/config.json" ] || python benchmarks/random_models.py "$kind" "$models/$kind" --vocab "$vocab" --device cuda
  gemmactl quantize "$models/$kind" --gguf Q4_K_M --force --json > "$out/quantize-$kind.json"
  rm -rf "$models/$kind"/*.safetensors
done
bench=$(ls "$GEMMACTL_HOME"/builds/*/cmake/bin/llama-bench | head -1)
nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv > "$out/nvidia-smi.csv"
python benchmarks/gpu_plan.py --vram "$cap" --context "$context" --bench "$bench" --out "$out" \
  --gguf "270m-shaped=$GEMMACTL_HOME/models/gemma3-270m-Q4_K_M/gemma3-270m-Q4_K_M.gguf" \
  --gguf "e2b-shaped=$GEMMACTL_HOME/models/e2b-Q4_K_M/e2b-Q4_K_M.gguf"
