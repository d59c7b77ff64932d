#!/usr/bin/env bash
# int4-stream on a GPU machine without network, in one command (about 4-6 minutes for E2B):
#   bash benchmarks/gpu_int4.sh --work DIR --out DIR [--shape e2b|tiny] [--device cuda|cpu] [--repeats 3]
# 1. build a random full-size E2B-shaped Gemma 4 (bf16 safetensors, made on the GPU, no tokenizer)
#    with tests/helpers/random_gemma.py (through benchmarks/int4_gpu.py build);
# 2. `gemmactl quantize --int4-stream` it: time, throughput, peak RSS against an import-only baseline;
# 3. cached reload, interleaved, median of --repeats: artifact → every tensor on the GPU (packed
#    copy + GPU dequantize), the same into a transformers model built on the meta device (dense and
#    packed weights), and HF from_pretrained of the bf16 checkpoint onto the GPU;
# 4. print the markdown tables for docs/benchmarks.md; delete the big files.
# --shape tiny --device cpu runs the same steps on a toy model anywhere (a test of the script).
# Needs nothing carried: torch, transformers, accelerate and safetensors are on the machine, and
# gemmactl runs from the tree (PYTHONPATH). Options --work/--out/--home as in benchmarks/gpu_common.sh:
# the models live in WORK/int4-models while the script runs; results go to OUT/int4-*.json
# (benchmarks/results/int4_gpu-quantize.json and int4_gpu-reload.json hold the recorded ones).
# Environment: PYTHON (default python).
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
set -- "${args[@]}"
shape=e2b device=cuda repeats=3
while [ $# -gt 0 ]; do
  case $1 in
    --shape) shape=${2:?}; shift 2 ;;
    --device) device=${2:?}; shift 2 ;;
    --repeats) repeats=${2:?}; shift 2 ;;
    *) die "unknown argument $1 (--shape e2b|tiny, --device cuda|cpu, --repeats N)" ;;
  esac
done
py=${PYTHON:-python}
int4_models=$work/int4-models
ckpt=$int4_models/$shape-bf16
art=$int4_models/$shape-int4
mkdir -p "$int4_models"
trap 'rm -rf "$int4_models"' EXIT  # tens of GB for E2B: never leave them on the disk

if [ "$device" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/int4-nvidia-smi.csv"
fi
start=$(date +%s)
"$py" "$root/benchmarks/int4_gpu.py" build "$ckpt" --shape "$shape" --device "$device" > "$out/int4-build.json"
echo "built $shape in $(( $(date +%s) - start )) s" >&2
"$py" "$root/benchmarks/int4_gpu.py" quantize --checkpoint "$ckpt" --artifact "$art" > "$out/int4-quantize.json"
echo "quantized at $(( $(date +%s) - start )) s" >&2
"$py" -m gemmactl inspect "$art" --verify > "$out/int4-inspect.txt"
"$py" "$root/benchmarks/int4_gpu.py" reload --checkpoint "$ckpt" --artifact "$art" --device "$device" \
  --repeats "$repeats" > "$out/int4-reload.json"
echo "reloaded at $(( $(date +%s) - start )) s" >&2
"$py" "$root/benchmarks/int4_gpu.py" table "$out/int4-quantize.json" "$out/int4-reload.json" | tee "$out/int4-tables.md"
