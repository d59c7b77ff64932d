#!/usr/bin/env bash
# The int4 engine against llama.cpp and transformers on a GPU machine without network, in stages
# (each under 10 minutes):
#   bash benchmarks/gpu_engine.sh --work DIR --out DIR --carry DIR prepare [KIND]  # CUDA llama.cpp build while a
#                                                  # random KIND-shaped checkpoint (default e2b) is made and
#                                                  # quantized to int4-stream; then its Q4_K_M GGUF
#   bash benchmarks/gpu_engine.sh --work DIR --out DIR STAGE [KIND]  # then, on those models:
#     check    the engine's GPU tests, fidelity against transformers (KLD, greedy agreement)
#     kernels  the decode kernel table (tinygemm / dense, compiled or not, graph or eager), llama-bench
#     profile  where a decode step's GPU time goes, kernel by kernel
#     compare  gemmactl bench: the engine beside llama-server and HF generate, short and 512-token prompts
#     start    cold and warm start to the first token, beside transformers from_pretrained
#     capped   under a cap that keeps half the layers resident: where the streamed step's time goes,
#              then the engine (eager with GEMMACTL_ENGINE_GRAPH=off, then captured: as by default, or for
#              26b-a4b with GEMMACTL_ENGINE_GRAPH=on, its step in pieces) beside llama.cpp
#              with the plan's -ngl/-ot and (eager run only) accelerate; e.g. KIND e4b
# KIND 26b-a4b is never a checkpoint: `prepare 26b-a4b` writes its int4-stream artifact and a Q4_K
# GGUF straight from random blocks (tests/helpers/random_gemma.py --int4-stream / --gguf-from), and
# only `capped` runs on it (no accelerate row: there is no bfloat16 copy).
# Options: see benchmarks/gpu_common.sh. Results: OUT/engine-KIND-*.json, OUT/bench-engine-KIND/.
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
set -- "${args[@]}"
stage=${1:?prepare or measure}
kind=${2:-e2b}
ckpt=$models/$kind
art=$work/int4/$kind-int4
mkdir -p "$work/int4"

if [ "$stage" = prepare ] && [ "$kind" = 26b-a4b ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/nvidia-smi.csv"
  bash "$root/benchmarks/gpu_toolchain.sh" "${common_opts[@]}" setup
  vocab_file=$(gemma4_vocab)
  source_tree=$(dirname "$(ls "$home"/sources/*/convert_hf_to_gguf.py | head -1)")
  [ -f "$art/index.json" ] || python "$root/tests/helpers/random_gemma.py" "$kind" "$art" --int4-stream --vocab "$vocab_file"
  [ -f "$work/$kind-Q4_K.gguf" ] || python "$root/tests/helpers/random_gemma.py" "$kind" "$work/$kind-Q4_K.gguf" \
    --gguf-from "$source_tree" --vocab "$vocab_file"
  exit 0
fi

if [ "$stage" = prepare ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/nvidia-smi.csv"
  (
    random_checkpoint "$kind"
    start=$(date +%s)
    [ -f "$art/index.json" ] || gemmactl quantize "$ckpt" --int4-stream --out "$art" --json > "$out/engine-$kind-quantize.json"
    echo "int4-stream quantize: $(( $(date +%s) - start )) s" >&2
  ) > "$out/engine-$kind-models.log" 2>&1 &
  models_pid=$!
  bash "$root/benchmarks/gpu_toolchain.sh" "${common_opts[@]}" setup
  wait $models_pid || { cat "$out/engine-$kind-models.log"; exit 1; }
  gemmactl quantize "$ckpt" --gguf Q4_K_M --force --json > "$out/engine-$kind-gguf.json"
  exit 0
fi

case $stage in check|kernels|profile|compare|start|capped) ;; *) die "unknown stage $stage (prepare, check, kernels, profile, compare, start or capped)" ;; esac
ensure_diskcache
if [ -f "$work/$kind-Q4_K.gguf" ]; then
  gguf=$work/$kind-Q4_K.gguf
else
  gguf=$(gemmactl list --json | python -c "import json,sys;print([e['path'] for e in json.load(sys.stdin) if e['name']=='$kind-Q4_K_M'][0])")
fi
py=python
case $stage in
  check)  # the engine's tests on this GPU, then fidelity against transformers on the same weights
    $py -m pytest -q -p no:cacheprovider "$root/tests/test_engine.py" -k gpu 2>&1 | tail -5 | tee "$out/engine-tests-gpu.txt"
    $py "$root/benchmarks/engine_gpu.py" fidelity --artifact "$art" > "$out/engine-$kind-fidelity.json"
    ;;
  kernels)  # the decode kernel table, and llama.cpp's own figures for the same shapes
    $py "$root/benchmarks/engine_gpu.py" kernels --artifact "$art" > "$out/engine-$kind-kernels.json"
    "$(build_binary llama-bench)" -m "$gguf" -p 512 -n 128 -ngl 99 -r 3 -o json > "$out/engine-$kind-llama-bench.json"
    ;;
  profile)  # the compiled step under torch.profiler, and the captured step's own rate
    $py "$root/benchmarks/engine_gpu.py" profile --artifact "$art" > "$out/engine-$kind-profile.json"
    ;;
  compare)  # gemmactl bench: the engine beside llama-server (same GGUF shapes) and HF generate
    $py "$root/benchmarks/engine_gpu.py" prompts "$work/engine-prompts.txt" > /dev/null
    mkdir -p "$out/bench-engine-$kind"
    gemmactl bench --model "$art" --gguf "$gguf" --hf-model "$ckpt" --compare llama-server --compare hf-generate \
      --prompts "$work/engine-prompts.txt" --max-tokens 128 --repeat 3 --out "$out/bench-engine-$kind" \
      2>&1 | tee "$out/bench-engine-$kind/table.txt"
    ;;
  start)  # cold and warm start to the first token
    $py "$root/benchmarks/engine_gpu.py" start --artifact "$art" --checkpoint "$ckpt" > "$out/engine-$kind-start.json"
    ;;
  capped)  # half the layers resident: the step's time, then the engine beside llama.cpp and accelerate
    [ "$kind" = 26b-a4b ] || $py "$root/benchmarks/engine_stream_step.py" "$art" > "$out/engine-$kind-stream-step.json"
    hf=() cap=()
    [ ! -f "$ckpt/config.json" ] || hf=(--hf-model "$ckpt")
    # an MoE model's layers fit early: the 4 GB box's cap, and llama.cpp's --n-cpu-moe sweep and --fit
    again=()
    [ "$kind" != 26b-a4b ] || { cap=(--cap 4G --runs verify,run,bench,sweep,fit); again=(--cap 4G --runs verify,run,bench); }
    GEMMACTL_ENGINE_GRAPH=off $py "$root/benchmarks/engine_capped.py" --artifact "$art" --gguf "$gguf" "${hf[@]}" "${cap[@]}" \
      --bench "$(build_binary llama-bench)" --out "$out/capped-$kind" > "$out/engine-$kind-capped.txt"
    graph=auto
    [ "$kind" != 26b-a4b ] || graph=on  # an MoE step in pieces between its routing decisions (asked for)
    GEMMACTL_ENGINE_GRAPH=$graph $py "$root/benchmarks/engine_capped.py" --artifact "$art" --gguf "$gguf" "${again[@]}" \
      --bench "$(build_binary llama-bench)" --out "$out/capped-$kind-captured" > "$out/engine-$kind-capped-captured.txt"
    ;;
esac
