#!/usr/bin/env bash
# The toolchain measurements on a GPU machine without network, in two stages (each under 10 min):
#   bash benchmarks/gpu_toolchain.sh --work DIR --out DIR --carry DIR setup     # install from --carry, place the
#                                                                             # llama.cpp source, gemmactl build (CUDA)
#   bash benchmarks/gpu_toolchain.sh --work DIR --out DIR [--carry DIR] measure # random E2B- and 270M-shaped models
#                                                                             # → Q4_K_M, doctor, llama-bench, bandwidth
# Options (see benchmarks/gpu_common.sh): --work (store and models), --out (results), --home,
# --carry (setup needs llama.cpp-src.tgz, llama-cpp-python-sdist.tgz, ggml-vocab-gemma-4.gguf[.xz],
# gguf-*.whl, diskcache-*.whl), --vocab. Results: OUT/nvidia-smi.csv, build.json, build-time.txt,
# quantize-*.json, doctor.json, bench-270m.json, bench-e2b.json, bandwidth.json
# (benchmarks/results/gpu_toolchain/ holds the recorded ones).
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
set -- "${args[@]}"
stage=${1:?setup or measure}
mkdir -p "$home/sources"

if [ "$stage" = setup ]; then
  gguf_wheel=$(carried 'gguf-*.whl')
  sdist=$(carried llama-cpp-python-sdist.tgz)
  source_tgz=$(carried llama.cpp-src.tgz)
  python -m pip install -q --no-deps "$gguf_wheel"
  bindings=$(mktemp -d "$work/bindings.XXXXXX")
  tar xzf "$sdist" -C "$bindings"
  package=$(ls -d "$bindings"/llama_cpp_python-* | head -1)
  version=${package##*-}  # the llama.cpp source is the tree vendored in this sdist
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" python -m pip install -q --no-deps --no-build-isolation "$package"
  rm -rf "$bindings"
  ensure_diskcache
  src=$home/sources/llama.cpp-$version
  if [ ! -f "$src/.gemmactl-source" ]; then
    vocab_file=$(gemma4_vocab)
    unpacked=$(mktemp -d "$home/sources/unpack.XXXXXX")
    tar xzf "$source_tgz" -C "$unpacked"
    mv "$unpacked/llama.cpp" "$src"
    rmdir "$unpacked"
    mkdir -p "$src/models"
    [ -f "$src/models/ggml-vocab-gemma-4.gguf" ] || cp "$vocab_file" "$src/models/"
    echo "packed-sha256:$(sha256sum "$source_tgz" | cut -d' ' -f1)" > "$src/.gemmactl-source"
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv > "$out/nvidia-smi.csv"
  start=$(date +%s)
  gemmactl build --json > "$out/build.json"
  echo "build wall seconds: $(( $(date +%s) - start ))" | tee "$out/build-time.txt"
  exit 0
fi

[ "$stage" = measure ] || die "unknown stage $stage (setup or measure)"
ensure_diskcache
for kind in gemma3-270m e2b; do
  if [ -f "$home/models/$kind-Q4_K_M/$kind-Q4_K_M.gguf" ]; then  # made by an earlier call
    gemmactl list --json | python -c "import json,sys;print(json.dumps([e for e in json.load(sys.stdin) if e['name']=='$kind-Q4_K_M'][0]))" > "$out/quantize-$kind.json"
    continue
  fi
  random_checkpoint "$kind"
  gemmactl quantize "$models/$kind" --gguf Q4_K_M --force --json > "$out/quantize-$kind.json"
  rm -rf "$models/$kind"/*.safetensors
done
g270=$(python -c "import json;print(json.load(open('$out/quantize-gemma3-270m.json'))['path'])")
ge2b=$(python -c "import json;print(json.load(open('$out/quantize-e2b.json'))['path'])")
gemmactl doctor --json --model "$g270" > "$out/doctor.json"
bench=$(build_binary llama-bench)
"$bench" -m "$g270" -p 512 -n 128 -ngl 99 -r 5 -o json > "$out/bench-270m.json"
"$bench" -m "$ge2b" -p 512 -n 128 -ngl 99 -r 5 -o json > "$out/bench-e2b.json"
python "$root/benchmarks/decode_bandwidth.py" --bench "$out/bench-270m.json" --gguf "$g270" \
  --bench "$out/bench-e2b.json" --gguf "$ge2b" --measure-device > "$out/bandwidth.json"
cat "$out/bandwidth.json"
