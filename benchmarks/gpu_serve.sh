#!/usr/bin/env bash
# `gemmactl serve` measured on the GPU machine (no network): warm vs cold TTFT on a 2,254-token
# prefix, fast→deep escalation, aggregate tok/s at 1/16/64 clients, speculative decoding on vs off
# (code and free text), front overhead vs llama-server direct. About 5 minutes after the build.
#   bash benchmarks/gpu_toolchain.sh setup   # once per machine: CUDA llama.cpp build (~5 min)
#   bash benchmarks/gpu_serve.sh             # models (reused when present) + benchmarks/serve_bench.py
# Inputs in .carry/ as for gpu_toolchain.sh. Results: $OUT/serve.json and a table on stdout.
set -euo pipefail
root=$(pwd)
export GEMMACTL_HOME=${GEMMACTL_HOME:-/root/gemmactl-gpu/store} GEMMACTL_NO_PROGRESS=1 PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
gemmactl() { python -m gemmactl "$@"; }
out=${OUT:-/root/gemmactl-gpu/out}
models=/root/gemmactl-gpu/models
mkdir -p "$out" "$models"
version=0.3.36
src=$GEMMACTL_HOME/sources/llama.cpp-$version
[ -f "$GEMMACTL_HOME/builds/ACTIVE" ] || bash "$root/benchmarks/gpu_toolchain.sh" setup
python -c "import gguf" 2>/dev/null || python -m pip install -q --no-deps .carry/gguf-*.whl
python -c "import diskcache" 2>/dev/null || python -m pip install -q --no-deps .carry/diskcache-*.whl
vocab=$src/models/ggml-vocab-gemma-4.gguf; [ -f "$vocab" ] || vocab=$root/.carry/ggml-vocab-gemma-4.gguf
quantize_bin=$(ls "$GEMMACTL_HOME"/builds/*/cmake/bin/llama-quantize | head -1)
start=$(date +%s)

# The E2B-shaped random model: Q8_0 as the speculative target, Q4_0 of the same weights as its
# draft (same vocabulary; random weights, so acceptance says how close the quantizations agree,
# not what a trained drafter would reach), Q4_K_M (from gpu_toolchain.sh measure, else Q4_0) for
# fast/deep/bulk.
q8=$GEMMACTL_HOME/models/e2b-Q8_0/e2b-Q8_0.gguf
if [ ! -f "$q8" ]; then
  [ -f "$models/e2b/config.json" ] || python benchmarks/random_models.py e2b "$models/e2b" --vocab "$vocab" --device cuda
  gemmactl quantize "$models/e2b" --gguf Q8_0 --force --json > "$out/quantize-e2b-q8.json"
  rm -rf "$models/e2b"/*.safetensors
fi
q4=$models/e2b-Q4_0.gguf
[ -f "$q4" ] || "$quantize_bin" --allow-requantize "$q8" "$q4" Q4_0 > "$out/requantize-q4_0.log" 2>&1
main=$GEMMACTL_HOME/models/e2b-Q4_K_M/e2b-Q4_K_M.gguf; [ -f "$main" ] || main=$q4
echo "models ready after $(( $(date +%s) - start )) s: main=$main target=$q8 draft=$q4"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/serve-gpu.txt"

python benchmarks/serve_bench.py --model "$main" --spec-target "$q8" --spec-draft "$q4" \
  --repeat 5 --rounds 3 --max-tokens 128 --json "$out/serve.json" | tee "$out/serve.txt"
echo "serve benchmarks done after $(( $(date +%s) - start )) s"
