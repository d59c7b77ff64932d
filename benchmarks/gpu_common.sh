# Options and helpers shared by benchmarks/gpu_*.sh. Sourced by them, not run on its own.
#
# The options come first, before the stage, in any order:
#   --work DIR    required: state kept between stages, outside the repository:
#                 DIR/store (the gemmactl store: llama.cpp source and build, GGUFs) and
#                 DIR/models (random-weight checkpoints)
#   --out DIR     required (default: $OUT when set): where the results go
#   --home DIR    the gemmactl store to use instead of WORK/store (e.g. one with a CUDA build)
#   --carry DIR   inputs for a machine without network: llama.cpp-src.tgz, llama-cpp-python-sdist.tgz,
#                 ggml-vocab-gemma-4.gguf (or .gguf.xz), gguf-*.whl, diskcache-*.whl, and
#                 optionally cuda-build.tar.xz.* (a build packed by `gpu_bench.sh setup`)
#   --vocab FILE  llama.cpp's models/ggml-vocab-gemma-4.gguf (default: the one in the store's
#                 llama.cpp source, then the one in --carry)
# The first argument that is none of these ends the options.
# Sets: root work out home carry vocab models, common_opts (the options again, to pass on), args
# (what is left); exports GEMMACTL_HOME, GEMMACTL_NO_PROGRESS=1 and PYTHONPATH (gemmactl from this tree).

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

die() { echo "$(basename "$0"): $*" >&2; exit 2; }

work="" out=${OUT:-} home="" carry="" vocab=""
while [ $# -gt 0 ]; do
  case $1 in
    --work|--out|--home|--carry|--vocab)
      [ $# -ge 2 ] || die "$1 needs a value"
      printf -v "${1#--}" '%s' "$2"
      shift 2
      ;;
    *) break ;;
  esac
done
args=("$@")

[ -n "$work" ] || die "--work DIR is required (state kept between stages: the store and the models)"
[ -n "$out" ] || die "--out DIR is required (or set OUT)"
mkdir -p "$work" "$out"
work=$(cd "$work" && pwd)
out=$(cd "$out" && pwd)
home=${home:-$work/store}
mkdir -p "$home"
home=$(cd "$home" && pwd)
if [ -n "$carry" ]; then
  [ -d "$carry" ] || die "--carry $carry is not a folder"
  carry=$(cd "$carry" && pwd)
fi
if [ -n "$vocab" ]; then
  [ -f "$vocab" ] || die "--vocab $vocab is not a file"
  vocab=$(cd "$(dirname "$vocab")" && pwd)/$(basename "$vocab")
fi
models=$work/models
mkdir -p "$models"
common_opts=(--work "$work" --out "$out" --home "$home")
[ -z "$carry" ] || common_opts+=(--carry "$carry")
[ -z "$vocab" ] || common_opts+=(--vocab "$vocab")

export GEMMACTL_HOME=$home GEMMACTL_NO_PROGRESS=1 PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
gemmactl() { python -m gemmactl "$@"; }  # run from the tree: no install step needs the network

# A file from --carry (a glob is fine: the first match); fails when there is no --carry or no such file.
carried() {
  [ -n "$carry" ] || die "this step needs --carry DIR with $1"
  local found
  found=$(ls -d "$carry"/$1 2>/dev/null | head -1)
  [ -n "$found" ] || die "no $1 in $carry"
  echo "$found"
}

# The Gemma 4 vocabulary GGUF that random-weight checkpoints get their tokenizer from.
gemma4_vocab() {
  local f
  if [ -n "$vocab" ]; then echo "$vocab"; return; fi
  for f in "$home"/sources/*/models/ggml-vocab-gemma-4.gguf; do
    [ -f "$f" ] && { echo "$f"; return; }
  done
  [ -n "$carry" ] || die "no ggml-vocab-gemma-4.gguf in the store's llama.cpp source: pass --vocab FILE or --carry DIR"
  if [ -f "$carry/ggml-vocab-gemma-4.gguf" ]; then echo "$carry/ggml-vocab-gemma-4.gguf"; return; fi
  [ -f "$carry/ggml-vocab-gemma-4.gguf.xz" ] || die "no ggml-vocab-gemma-4.gguf(.xz) in $carry"
  [ -f "$work/ggml-vocab-gemma-4.gguf" ] || xz -dkc "$carry/ggml-vocab-gemma-4.gguf.xz" > "$work/ggml-vocab-gemma-4.gguf"
  echo "$work/ggml-vocab-gemma-4.gguf"
}

# A tool of the store's active llama.cpp build (llama-bench, llama-quantize, ...).
build_binary() {
  python -c "import sys
from gemmactl.llamacpp.build import active_build
from gemmactl.store import Store
build = active_build(Store())
sys.exit('no llama.cpp build in the store: run the setup stage first') if build is None else print(build.binary('$1'))"
}

# diskcache, which llama-cpp-python imports, from --carry when it is not installed.
ensure_diskcache() {
  local wheel
  python -c "import diskcache" 2>/dev/null && return
  wheel=$(carried 'diskcache-*.whl')
  python -m pip install -q --no-deps "$wheel"
}

# A random-weight checkpoint of KIND (tests/helpers/random_gemma.py) in WORK/models/KIND, unless it is there.
random_checkpoint() {
  local kind=$1 vocab_file
  [ ! -f "$models/$kind/config.json" ] || return 0
  vocab_file=$(gemma4_vocab)
  python "$root/tests/helpers/random_gemma.py" "$kind" "$models/$kind" --vocab "$vocab_file" --device cuda
}
