#!/usr/bin/env bash
# `gemmactl bench` on a GPU machine without network, for the record in docs/benchmarks.md.
#   bash benchmarks/gpu_bench.sh setup         # install + CUDA build (or restore a packed build), pack it for reuse
#   bash benchmarks/gpu_bench.sh KIND [ARGS]   # KIND = gemma3-270m | e2b: random-weight model of that shape,
#                                              # Q4_K_M GGUF, then bench against every target
# Inputs in .carry/ as for benchmarks/gpu_toolchain.sh; a packed build (.carry/cuda-build.tar.xz.*,
# made by `setup` into $OUT) skips the 5-minute CUDA build on a fresh machine.
set -euo pipefail
stage=${1:?setup, gemma3-270m or e2b}
shift || true
root=$(pwd)
export GEMMACTL_HOME=${GEMMACTL_HOME:-/root/gemmactl-gpu/store} GEMMACTL_NO_PROGRESS=1 PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
gemmactl() { python -m gemmactl "$@"; }
out=${OUT:-/root/gemmactl-gpu/out}
mkdir -p "$out"

# The vocabulary may travel compressed (the carried files have a size limit).
[ -f .carry/ggml-vocab-gemma-4.gguf ] || xz -dkc .carry/ggml-vocab-gemma-4.gguf.xz > .carry/ggml-vocab-gemma-4.gguf

if [ "$stage" = setup ]; then
  if ls .carry/cuda-build.tar.xz.* >/dev/null 2>&1 && [ ! -d "$GEMMACTL_HOME/builds" ]; then
    mkdir -p "$GEMMACTL_HOME"
    cat .carry/cuda-build.tar.xz.* | tar xJf - -C "$GEMMACTL_HOME"
    echo "restored the packed build: $(cat "$GEMMACTL_HOME/builds/ACTIVE")"
  fi
  bash benchmarks/gpu_toolchain.sh setup
  if ! ls .carry/cuda-build.tar.xz.* >/dev/null 2>&1; then
    # Binaries, libraries and the manifest only: enough for `gemmactl build` to find it again.
    (cd "$GEMMACTL_HOME" && tar cf - --exclude='*.o' --exclude=CMakeFiles --exclude='*.a' builds \
      | xz -T0 -6 > /tmp/cuda-build.tar.xz)
    ls -l /tmp/cuda-build.tar.xz
    split -b 15M -d /tmp/cuda-build.tar.xz "$out/cuda-build.tar.xz."
  fi
  exit 0
fi

kind=$stage
models=/root/gemmactl-gpu/models
src=$GEMMACTL_HOME/sources/llama.cpp-0.3.36
vocab=$src/models/ggml-vocab-gemma-4.gguf; [ -f "$vocab" ] || vocab=$root/.carry/ggml-vocab-gemma-4.gguf
mkdir -p "$models"
hf=$models/$kind
if [ ! -f "$hf/model.safetensors" ] && [ ! -f "$hf/model.safetensors.index.json" ]; then
  python benchmarks/random_models.py "$kind" "$hf" --vocab "$vocab" --device cuda
fi
gguf=$(gemmactl quantize "$hf" --gguf Q4_K_M --force --json | python -c "import json,sys;print(json.load(sys.stdin)['path'])")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
mkdir -p "$out/bench-$kind"
gemmactl bench --model "$gguf" --hf-model "$hf" \
  --compare llama-cpp-python --compare llama-server --compare hf-generate --compare accelerate \
  --vram 4GiB "$@" --out "$out/bench-$kind" --plot 2>&1 | tee "$out/bench-$kind/table.txt" || exit 1
