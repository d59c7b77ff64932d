#!/usr/bin/env bash
# `gemmactl bench` on a GPU machine without network.
#   bash benchmarks/gpu_bench.sh --work DIR --out DIR --carry DIR setup   # install + CUDA build (or restore a
#                                                                       # packed build), pack it for reuse
#   bash benchmarks/gpu_bench.sh --work DIR --out DIR KIND [BENCH ARGS]   # KIND = gemma3-270m | e2b: random-weight
#                                                                       # model of that shape, Q4_K_M GGUF, then
#                                                                       # bench against every target
# Options (see benchmarks/gpu_common.sh): --work (store and models), --out (results), --home,
# --carry (as for benchmarks/gpu_toolchain.sh; a packed build CARRY/cuda-build.tar.xz.*, made by
# `setup` into OUT, skips the 5-minute CUDA build on a fresh machine), --vocab.
# Results: OUT/bench-KIND/ (result.json, plot.png, table.txt). benchmarks/gpu_record.sh does the
# same in separate stages (models once, then bench, serve, ... on them).
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
set -- "${args[@]}"
stage=${1:?setup, gemma3-270m or e2b}
shift || true

if [ "$stage" = setup ]; then
  packed=no
  if [ -n "$carry" ] && ls "$carry"/cuda-build.tar.xz.* >/dev/null 2>&1; then packed=yes; fi
  if [ $packed = yes ] && [ ! -d "$home/builds" ]; then
    cat "$carry"/cuda-build.tar.xz.* | tar xJf - -C "$home"
    echo "restored the packed build: $(cat "$home/builds/ACTIVE")"
  fi
  bash "$root/benchmarks/gpu_toolchain.sh" "${common_opts[@]}" setup
  if [ $packed = no ]; then
    # Binaries, libraries and the manifest only: enough for `gemmactl build` to find it again.
    (cd "$home" && tar cf - --exclude='*.o' --exclude=CMakeFiles --exclude='*.a' builds \
      | xz -T0 -6 > "$work/cuda-build.tar.xz")
    ls -l "$work/cuda-build.tar.xz"
    split -b 15M -d "$work/cuda-build.tar.xz" "$out/cuda-build.tar.xz."
  fi
  exit 0
fi

kind=$stage
case $kind in gemma3-270m|e2b) ;; *) die "unknown stage $kind (setup, gemma3-270m or e2b)" ;; esac
random_checkpoint "$kind"
hf=$models/$kind
gguf=$(gemmactl quantize "$hf" --gguf Q4_K_M --force --json | python -c "import json,sys;print(json.load(sys.stdin)['path'])")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
mkdir -p "$out/bench-$kind"
gemmactl bench --model "$gguf" --hf-model "$hf" \
  --compare llama-cpp-python --compare llama-server --compare hf-generate --compare accelerate \
  --vram 4GiB "$@" --out "$out/bench-$kind" --plot 2>&1 | tee "$out/bench-$kind/table.txt" || exit 1
