#!/usr/bin/env bash
# Manual check, not in ctest: llama.cpp itself loads expert-forge's deepseek4 models and runs a
# finite forward on them. Builds llama.cpp's CPU backend from LLAMA_CPP_DIR (a few minutes).
#
#   tests/forge/llama_cpp_check/run.sh LLAMA_CPP_DIR EXPERT_FORGE WORKDIR
#   e.g. run.sh /tmp/llsd/llama_cpp_python-0.3.36/vendor/llama.cpp build/bin/expert-forge /tmp/llc
set -euo pipefail
[ $# -eq 3 ] || { sed -n 2,7p "$0"; exit 2; }
llama=$(realpath "$1"); forge=$(realpath "$2"); work=$3
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work"
cmake -S "$here" -B "$work/build" -DLLAMA_CPP_DIR="$llama" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_CUDA=OFF -DLLAMA_CURL=OFF >"$work/cmake.log"
cmake --build "$work/build" -j"$(nproc)" --target llama_load_check >"$work/build.log"
small="--experts 16 --top-k 4 --embd 256 --ff 256 --heads 4 --head-dim 128 --q-lora-rank 64
  --o-lora-rank 64 --o-groups 2 --index-heads 4 --index-head-dim 64 --rope-dim 32 --index-topk 8
  --window 8 --force"
models=(
  "schedule.gguf --layers 6 $small --expert-type q4_k"
  "sliding-mtp.gguf --layers 5 --nextn 1 $small --compress-ratios 0,4,128,0,4,0 --expert-type q8_0 --dense-type f16"
  "no-hash.gguf --layers 4 $small --hash-layers 0 --expert-type q6_k --dense-type bf16"
  "default-dims.gguf --layers 4 --experts 8 --expert-type q4_k --force"
)
fail=0
for m in "${models[@]}"; do
  set -- $m
  out=$1; shift
  "$forge" --arch deepseek4 "$@" -o "$work/$out" 2>/dev/null
  if "$work/build/llama_load_check" "$work/$out" >"$work/$out.log" 2>&1; then
    echo "ok: $out: $(grep '^step 15' "$work/$out.log")"
  else
    echo "FAIL: $out (see $work/$out.log)"; fail=1
  fi
  rm -f "$work/$out"
done
exit $fail
