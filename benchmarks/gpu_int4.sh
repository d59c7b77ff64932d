#!/usr/bin/env bash
# int4-stream on a GPU machine without network, in one command (about 4-6 minutes for E2B):
#   bash benchmarks/gpu_int4.sh
# 1. build a random full-size E2B-shaped Gemma 4 (bf16 safetensors, made on the GPU, no tokenizer);
# 2. `gemmactl quantize --int4-stream` it: time, throughput, peak RSS against an import-only baseline;
# 3. cached reload, interleaved, median of REPEATS: artifact → every tensor on the GPU (packed
#    copy + GPU dequantize), the same into a transformers model built on the meta device, and
#    HF from_pretrained of the bf16 checkpoint onto the GPU;
# 4. print the markdown tables for docs/benchmarks.md; delete the big files.
# Needs nothing carried: torch, transformers, accelerate and safetensors are on the machine, and
# gemmactl runs from the tree (PYTHONPATH). Results go to $OUT (or $WORK/out).
# Environment: SHAPE=e2b|tiny (tiny: a toy model, to test the script on a CPU), DEVICE=cuda|cpu,
# REPEATS=3, WORK=/root/gemmactl-gpu (state outside the repository), PYTHON=python.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
shape=${SHAPE:-e2b}
device=${DEVICE:-cuda}
repeats=${REPEATS:-3}
work=${WORK:-/root/gemmactl-gpu}
py=${PYTHON:-python}
out=${OUT:-$work/out}
export GEMMACTL_HOME=$work/store GEMMACTL_NO_PROGRESS=1 PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
models=$work/int4-models
ckpt=$models/$shape-bf16
art=$models/$shape-int4
mkdir -p "$GEMMACTL_HOME" "$out" "$models"
trap 'rm -rf "$models"' EXIT  # tens of GB for E2B: never leave them on the disk

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
