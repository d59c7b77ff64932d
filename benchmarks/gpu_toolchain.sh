#!/usr/bin/env bash
# The toolchain measurements on a GPU machine without network, in two stages (each under 10 min):
#   bash benchmarks/gpu_toolchain.sh setup     # install, place the llama.cpp source, gemmactl build (CUDA)
#   bash benchmarks/gpu_toolchain.sh measure   # random E2B- and 270M-shaped models → Q4_K_M, doctor, llama-bench
# Inputs in .carry/ (see shared tools): llama.cpp-src.tgz, llama-cpp-python-sdist.tgz,
# ggml-vocab-gemma-4.gguf, a gguf wheel. Results go to $OUT (or ./.gpu/out).
set -euo pipefail
stage=${1:?setup or measure}
root=$(pwd)
export GEMMACTL_HOME=${GEMMACTL_HOME:-/root/gemmactl-gpu/store} GEMMACTL_NO_PROGRESS=1 PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
gemmactl() { python -m gemmactl "$@"; }  # run from the tree: no install step needs the network
out=${OUT:-/root/gemmactl-gpu/out}
mkdir -p "$GEMMACTL_HOME/sources" "$out"
version=0.3.36
src=$GEMMACTL_HOME/sources/llama.cpp-$version

if [ "$stage" = setup ]; then
  python -m pip install -q --no-deps .carry/gguf-*.whl
  mkdir -p /tmp/bindings && tar xzf .carry/llama-cpp-python-sdist.tgz -C /tmp/bindings
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" python -m pip install -q --no-deps --no-build-isolation /tmp/bindings/llama_cpp_python-$version
  python -m pip install -q --no-deps .carry/diskcache-*.whl
  if [ ! -f "$src/.gemmactl-source" ]; then
    tar xzf .carry/llama.cpp-src.tgz -C "$GEMMACTL_HOME/sources"
    mv "$GEMMACTL_HOME/sources/llama.cpp" "$src"
    mkdir -p "$src/models" && cp .carry/ggml-vocab-gemma-4.gguf "$src/models/"
    echo "packed-sha256:$(sha256sum .carry/llama.cpp-src.tgz | cut -d' ' -f1)" > "$src/.gemmactl-source"
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv > "$out/nvidia-smi.csv"
  start=$(date +%s)
  gemmactl build --json > "$out/build.json"
  echo "build wall seconds: $(( $(date +%s) - start ))" | tee "$out/build-time.txt"
  exit 0
fi

models=/root/gemmactl-gpu/models
mkdir -p "$models"
vocab=$src/models/ggml-vocab-gemma-4.gguf; [ -f "$vocab" ] || vocab=$root/.carry/ggml-vocab-gemma-4.gguf
python -c "import diskcache" 2>/dev/null || python -m pip install -q --no-deps .carry/diskcache-*.whl
for kind in gemma3-270m e2b; do
  if [ -f "$GEMMACTL_HOME/models/$kind-Q4_K_M/$kind-Q4_K_M.gguf" ]; then  # made by an earlier call
    gemmactl list --json | python -c "import json,sys;print(json.dumps([e for e in json.load(sys.stdin) if e['name']=='$kind-Q4_K_M'][0]))" > "$out/quantize-$kind.json"
    continue
  fi
  [ -f "$models/$kind/config.json" ] || python benchmarks/random_models.py "$kind" "$models/$kind" --vocab "$vocab" --device cuda
  gemmactl quantize "$models/$kind" --gguf Q4_K_M --force --json > "$out/quantize-$kind.json"
  rm -rf "$models/$kind"/*.safetensors
done
g270=$(python -c "import json;print(json.load(open('$out/quantize-gemma3-270m.json'))['path'])")
ge2b=$(python -c "import json;print(json.load(open('$out/quantize-e2b.json'))['path'])")
gemmactl doctor --json --model "$g270" > "$out/doctor.json"
bench=$(python -c "import json;print(json.load(open('$out/build.json'))['binaries']['llama-bench']['path'])" 2>/dev/null || true)
[ -n "$bench" ] || bench=$(ls "$GEMMACTL_HOME"/builds/*/cmake/bin/llama-bench | head -1)
"$bench" -m "$g270" -p 512 -n 128 -ngl 99 -r 5 -o json > "$out/bench-270m.json"
"$bench" -m "$ge2b" -p 512 -n 128 -ngl 99 -r 5 -o json > "$out/bench-e2b.json"
python benchmarks/decode_bandwidth.py --bench "$out/bench-270m.json" --gguf "$g270" \
  --bench "$out/bench-e2b.json" --gguf "$ge2b" --measure-device > "$out/bandwidth.json"
cat "$out/bandwidth.json"
