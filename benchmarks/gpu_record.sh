#!/usr/bin/env bash
# Every GPU measurement of docs/benchmarks.md in as few machine minutes as possible, one stage at a
# time (each stage is one call; chain them while the machine stays warm):
#   bash benchmarks/gpu_record.sh OPTIONS models   # restore/make the CUDA build; random 270M- and E2B-shaped
#                                                  # models (bf16 kept), their Q4_K_M GGUFs, a Q4_0 draft
#   bash benchmarks/gpu_record.sh OPTIONS plan     # plan --verify at a 4 GiB cap vs llama.cpp's --fit
#   bash benchmarks/gpu_record.sh OPTIONS bench [gemma3-270m|e2b] [BENCH ARGS]   # gemmactl bench, every target
#   bash benchmarks/gpu_record.sh OPTIONS serve [ARGS]     # benchmarks/serve_bench.py on the E2B-shaped model
#   bash benchmarks/gpu_record.sh OPTIONS scaling [ARGS]   # benchmarks/serve_scaling.py on the E2B-shaped model
#   bash benchmarks/gpu_record.sh OPTIONS bstext [ARGS]    # benchmarks/backend_sampling_text.py on the E2B-shaped model
#   bash benchmarks/gpu_record.sh OPTIONS int4 [ARGS]      # benchmarks/gpu_int4.sh: int4-stream quantize + reload
# OPTIONS (see benchmarks/gpu_common.sh): --work DIR (required: store and models, kept between
# stages), --out DIR (required, or $OUT), --home DIR, --carry DIR (the `models` stage's first run:
# inputs as for benchmarks/gpu_bench.sh setup), --vocab FILE. Environment: KINDS="e2b" makes only
# the E2B-shaped model in the models stage. Results under OUT: plan/, bench-KIND/, serve.json,
# serve_scaling.json, backend_sampling_text.json, int4-*.
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
set -- "${args[@]}"
stage=${1:?models, plan, bench, serve, scaling, bstext or int4}
shift || true
gguf_of() { echo "$home/models/$1-Q4_K_M/$1-Q4_K_M.gguf"; }
draft=$models/e2b-Q4_0.gguf
start=$(date +%s)
took() { echo "[$stage] $1 after $(( $(date +%s) - start )) s"; }

case $stage in
models)
  [ -f "$home/builds/ACTIVE" ] || bash "$root/benchmarks/gpu_bench.sh" "${common_opts[@]}" setup > "$out/setup.log" 2>&1
  ensure_diskcache
  took "build ready"
  for kind in ${KINDS:-gemma3-270m e2b}; do
    random_checkpoint "$kind"
    [ -f "$(gguf_of $kind)" ] || gemmactl quantize "$models/$kind" --gguf Q4_K_M --force --json > "$out/quantize-$kind.json"
    took "$kind ready"
  done
  quantize_bin=$(build_binary llama-quantize)
  [ -f "$draft" ] || "$quantize_bin" --allow-requantize "$(gguf_of e2b)" "$draft" Q4_0 > "$out/draft.log" 2>&1
  took "draft ready"
  ;;
plan)
  bench=$(build_binary llama-bench)
  mkdir -p "$out/plan"
  nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv > "$out/plan/nvidia-smi.csv"
  python "$root/benchmarks/gpu_plan.py" --vram 4G --context 4096 --bench "$bench" --out "$out/plan" --repeats 2 \
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
  python "$root/benchmarks/serve_bench.py" --model "$(gguf_of e2b)" --spec-target "$(gguf_of e2b)" --spec-draft "$draft" \
    "$@" --json "$out/serve.json" > "$out/serve.txt" 2> "$out/serve.err" || { tail -5 "$out/serve.err"; exit 1; }
  cat "$out/serve.txt"
  took "done"
  ;;
scaling)
  python "$root/benchmarks/serve_scaling.py" --model "$(gguf_of e2b)" "$@" --json "$out/serve_scaling.json" \
    > "$out/serve_scaling.txt" 2> "$out/serve_scaling.err" || { tail -5 "$out/serve_scaling.err"; exit 1; }
  cat "$out/serve_scaling.txt"
  took "done"
  ;;
bstext)
  python "$root/benchmarks/backend_sampling_text.py" --model "$(gguf_of e2b)" --log-dir "$out/bstext-logs" "$@" \
    --json "$out/backend_sampling_text.json" 2> "$out/backend_sampling_text.err" | tail -8 \
    || { tail -5 "$out/backend_sampling_text.err"; exit 1; }
  took "done"
  ;;
int4)
  bash "$root/benchmarks/gpu_int4.sh" "${common_opts[@]}" "$@"
  took "done"
  ;;
*)
  die "unknown stage $stage"
  ;;
esac
