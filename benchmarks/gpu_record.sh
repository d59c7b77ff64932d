#!/usr/bin/env bash
# Every GPU measurement of docs/benchmarks.md in as few machine minutes as possible, one stage at a
# time (each stage is one call; chain them while the machine stays warm):
#   bash benchmarks/gpu_record.sh models   # restore/make the CUDA build; random 270M- and E2B-shaped
#                                          # models (bf16 kept), their Q4_K_M GGUFs, a Q4_0 draft
#   bash benchmarks/gpu_record.sh plan     # plan --verify at a 4 GiB cap vs llama.cpp's --fit
#   bash benchmarks/gpu_record.sh bench [gemma3-270m|e2b] [BENCH ARGS]   # gemmactl bench, every target
#   bash benchmarks/gpu_record.sh serve    # benchmarks/serve_bench.py on the E2B-shaped model
#   bash benchmarks/gpu_record.sh scaling [ARGS]  # benchmarks/serve_scaling.py on the E2B-shaped model
#   bash benchmarks/gpu_record.sh bstext [ARGS]   # benchmarks/backend_sampling_text.py on the E2B-shaped model
#   bash benchmarks/gpu_record.sh int4     # benchmarks/gpu_int4.sh's quantize + reload measurements
# Inputs in .carry/ as for benchmarks/gpu_bench.sh. Results under $OUT. KINDS="e2b" makes only
# the E2B-shaped model in the models stage.
set -euo pipefail
stage=${1:?models, plan, bench, serve or int4}
shift || true
root=$(pwd)
export GEMMACTL_HOME=${GEMMACTL_HOME:-/root/gemmactl-gpu/store} GEMMACTL_NO_PROGRESS=1 PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
gemmactl() { python -m gemmactl "$@"; }
out=${OUT:-/root/gemmactl-gpu/out}
models=/root/gemmactl-gpu/models
mkdir -p "$out" "$models"
gguf_of() { echo "$GEMMACTL_HOME/models/$1-Q4_K_M/$1-Q4_K_M.gguf"; }
draft=$models/e2b-Q4_0.gguf
start=$(date +%s)
took() { echo "[$stage] $1 after $(( $(date +%s) - start )) s"; }

case $stage in
models)
  [ -f "$GEMMACTL_HOME/builds/ACTIVE" ] || bash benchmarks/gpu_bench.sh setup > "$out/setup.log" 2>&1
  python -c "import diskcache" 2>/dev/null || python -m pip install -q --no-deps .carry/diskcache-*.whl
  vocab=$root/.carry/ggml-vocab-gemma-4.gguf
  [ -f "$vocab" ] || xz -dkc "$vocab.xz" > "$vocab"
  took "build ready"
  for kind in ${KINDS:-gemma3-270m e2b}; do
    [ -f "$models/$kind/config.json" ] || python benchmarks/random_models.py "$kind" "$models/$kind" --vocab "$vocab" --device cuda
    [ -f "$(gguf_of $kind)" ] || gemmactl quantize "$models/$kind" --gguf Q4_K_M --force --json > "$out/quantize-$kind.json"
    took "$kind ready"
  done
  quantize_bin=$(ls "$GEMMACTL_HOME"/builds/*/cmake/bin/llama-quantize | head -1)
  [ -f "$draft" ] || "$quantize_bin" --allow-requantize "$(gguf_of e2b)" "$draft" Q4_0 > "$out/draft.log" 2>&1
  took "draft ready"
  ;;
plan)
  bench=$(ls "$GEMMACTL_HOME"/builds/*/cmake/bin/llama-bench | head -1)
  mkdir -p "$out/plan"
  nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv > "$out/plan/nvidia-smi.csv"
  python benchmarks/gpu_plan.py --vram 4G --context 4096 --bench "$bench" --out "$out/plan" --repeats 2 \
    --gguf "270m-shaped=$(gguf_of gemma3-270m)" --gguf "e2b-shaped=$(gguf_of e2b)" | tail -6
  took "done"
  ;;
bench)
  kind=${1:-gemma3-270m}
  shift || true
  mkdir -p "$out/bench-$kind"
  gemmactl bench --model "$(gguf_of $kind)" --hf-model "$models/$kind" \
    --compare llama-cpp-python --compare llama-server --compare hf-generate --compare accelerate \
    --vram 4GiB "$@" --out "$out/bench-$kind" --plot > "$out/bench-$kind/table.txt" 2> "$out/bench-$kind/stderr.txt" \
    || { tail -5 "$out/bench-$kind/stderr.txt"; exit 1; }
  tail -40 "$out/bench-$kind/table.txt"
  took "done"
  ;;
serve)
  python benchmarks/serve_bench.py --model "$(gguf_of e2b)" --spec-target "$(gguf_of e2b)" --spec-draft "$draft" \
    "$@" --json "$out/serve.json" > "$out/serve.txt" 2> "$out/serve.err" || { tail -5 "$out/serve.err"; exit 1; }
  cat "$out/serve.txt"
  took "done"
  ;;
scaling)
  python benchmarks/serve_scaling.py --model "$(gguf_of e2b)" "$@" --json "$out/serve_scaling.json" \
    > "$out/serve_scaling.txt" 2> "$out/serve_scaling.err" || { tail -5 "$out/serve_scaling.err"; exit 1; }
  cat "$out/serve_scaling.txt"
  took "done"
  ;;
bstext)
  python benchmarks/backend_sampling_text.py --model "$(gguf_of e2b)" "$@" --json "$out/backend_sampling_text.json" \
    2> "$out/backend_sampling_text.err" | tail -8 || { tail -5 "$out/backend_sampling_text.err"; exit 1; }
  took "done"
  ;;
int4)
  E2B_DIR=$models/e2b bash benchmarks/gpu_int4.sh "$@"
  took "done"
  ;;
*)
  echo "unknown stage $stage" >&2
  exit 2
  ;;
esac
