#!/usr/bin/env bash
# bench/peer/peer.sh without a GPU, llama.cpp or network (ctest peer_bench_plan, a few seconds):
# --help, refused arguments, the --dry-run plan (the -ncmoe of each config from the expert sizes,
# the cache from the cap, the run order), and summarize.py on recorded outputs of llama-bench and
# expert-run (the figures, a timed-out run, the ratio to llama.cpp's best configuration).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
peer=$here/peer.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
has() { grep -qF -- "$2" <<< "$1" || fail "$3: no '$2' in: $(head -c 600 <<< "$1")"; }

out=$("$peer" --help) || fail "--help exits non-zero"
has "$out" "--caps LIST" "--help"
has "$out" "build-start" "--help"

for args in "--models llama" "--caps 0" "--caps 8,x" "--configs gpu" "--tg" "--vram mixtral=x" \
  "--bogus" "--tg 0"; do
  # shellcheck disable=SC2086
  if err=$("$peer" $args --dry-run 2>&1); then
    fail "'$args' accepted"
  else
    rc=$?
    [ $rc = 2 ] || fail "'$args' exits $rc, not 2"
    has "$err" "peer.sh: " "'$args'"
  fi
done

plan=$("$peer" --dry-run --bin /b --work /w --out "$tmp/o" --llama-src /s.tgz)
has "$plan" "run: 20 runs, tg 16, pp 512" "plan"
has "$plan" "unpack /s.tgz to /w/llama.cpp" "plan"
has "$plan" "/b/expert-forge --arch qwen3moe --layers 48 --experts 128 --top-k 8 --embd 2048 --ff 768" "plan"
# Mixtral: 32 layers of 8 experts, a tier of 32 experts = 4 layers in VRAM; Qwen3: 48 of 128, 256.
has "$plan" "-p 512 -n 16 -r 1 --no-warmup -lm mmap --repack 0 -o jsonl -ngl 99 -ncmoe 28" "plan"
has "$plan" "mixtral-q4k.gguf -p 512 -n 16 -r 1 --no-warmup -lm mmap --repack 0 -o jsonl -ngl 99 -ncmoe 32" "plan"
has "$plan" "-ncmoe 46 (256 experts in VRAM)" "plan"
has "$plan" "qwen3-30b-a3b-q4k.gguf -p 512 -n 16 -r 1 --no-warmup -lm mmap --repack 0 -o jsonl -ngl 99 -ncmoe 48" "plan"
has "$plan" "--max-tokens 17 --vram-experts 32 --prefill-chunk 512" "plan"
# cache = 8 GiB - 1 GiB staging - the estimated 3,134 MiB of dense weights - 1.5 GiB margin
has "$plan" "run 1/20 mixtral-8g-expertd: expertd cache 4882 MiB" "plan"
has "$plan" "memory.max 17179869184" "plan"
# The issue-15 models: Mixtral as llama.cpp's own arch, and a DeepSeek-V3 slice whose first block
# is dense (its 5 MoE blocks of 256 experts: a tier of 256 = 1 block in VRAM, so -ncmoe 5).
plan15=$("$peer" --dry-run --bin /b --work /w --out "$tmp/o" --llama-src /s.tgz \
  --models mixtral-llama,ds3 --caps 8 --configs expertd,cuda-tier)
has "$plan15" "/b/expert-forge --arch mixtral --layers 32 --experts 8 --top-k 2" "plan15"
has "$plan15" "/b/expert-forge --arch deepseek3 --layers 6 --experts 256 --top-k 8 --embd 7168" "plan15"
has "$plan15" "--dense-layers 1 -o /w/ds3-slice-q4k.gguf" "plan15"
has "$plan15" "ds3-slice-q4k.gguf -p 512 -n 16 -r 1 --no-warmup -lm mmap --repack 0 -o jsonl -ngl 99 -ncmoe 5" "plan15"
has "$plan15" "mixtral-llama-q4k.gguf -p 512 -n 16 -r 1 --no-warmup -lm mmap --repack 0 -o jsonl -ngl 99 -ncmoe 28" "plan15"
# The CPU-only build runs last.
[ "$(grep -c '^run .*: llama.cpp CPU-only build' <<< "$plan")" = 4 ] || fail "plan: not 4 cpu runs"
grep -q '^run 17/20 mixtral-8g-cpu' <<< "$plan" || fail "plan: the cpu runs are not last"
# expertd's runs first (they can go while llama.cpp builds).
grep -q '^run 7/20 qwen3-16g-expertd:' <<< "$plan" || fail "plan: expertd's runs are not first"
# Each beside the same run with prefetch off, the baseline of the prefetch comparison.
grep -q '^run 2/20 mixtral-8g-expertd-d0: .*daemon prefetch depth 0' <<< "$plan" ||
  fail "plan: no depth-0 run beside expertd's"
has "$plan" "mixtral-8g-expertd-d0.expertd.log 0 -- --prompt-tokens" "plan"
quick=$("$peer" --dry-run --quick --models qwen3 --caps 16 --configs expertd,cpu --vram qwen3=384)
has "$quick" "run: 2 runs, tg 8, pp 512" "quick plan"
has "$quick" "--max-tokens 9 --vram-experts 384 --prefill-chunk 512" "quick plan"
has "$quick" "memory.max 17179869184, limit 90 s:" "quick plan"
has "$quick" "CPU-only build; memory.max 17179869184, limit 60 s:" "quick plan"

# summarize.py on recorded outputs.
td=$here/testdata
rec() { python3 "$here/summarize.py" record "$@"; }
common=(--field cap_gib=8 --field tg_tokens=16 --field pp_tokens=512 --field model=mixtral)
{
  rec --kind expertd --raw "$td/expertd.out" --stats "$td/ok.stats" "${common[@]}" \
    --field config=expertd --field tool=expertd --field id=mixtral-8g-expertd \
    --field cache_mib=2568 --field vram_experts=32
  rec --kind llama.cpp --raw "$td/llama-cuda-tier.out" --stats "$td/ok.stats" "${common[@]}" \
    --field config=cuda-tier --field tool=llama.cpp --field id=mixtral-8g-cuda-tier \
    --field ncmoe=28 --field vram_experts=32
  rec --kind llama.cpp --raw "$td/llama-cuda-all.out" --stats "$td/timeout.stats" "${common[@]}" \
    --field config=cuda-all --field tool=llama.cpp --field id=mixtral-8g-cuda-all \
    --field ncmoe=32 --field vram_experts=0
} > "$tmp/results.jsonl"
brief=$(sed -n 1p "$tmp/results.jsonl" | python3 "$here/summarize.py" brief)
# expert-run's 2.55 tokens/s over 17 tokens, 16 of them decode steps: 2.40 per decode step.
has "$brief" "ok: tg 2.40 tokens/s, pp512 42.14 tokens/s (41.2 s, peak 8.00 GiB, oom kills 0)" "brief"
brief=$(sed -n 3p "$tmp/results.jsonl" | python3 "$here/summarize.py" brief)
has "$brief" "timeout: tg – tokens/s, pp512 33.30 tokens/s" "brief of a timed-out run"
python3 "$here/summarize.py" is-done "$tmp/results.jsonl" mixtral-8g-cuda-tier 16 512 ||
  fail "done: an ok run not found"
! python3 "$here/summarize.py" is-done "$tmp/results.jsonl" mixtral-8g-cuda-tier 8 128 ||
  fail "done: found at other token counts"
! python3 "$here/summarize.py" is-done "$tmp/results.jsonl" mixtral-8g-cuda-all 16 512 ||
  fail "done: a timed-out run counts as done"
table=$(python3 "$here/summarize.py" table "$tmp/results.jsonl")
has "$table" "| Mixtral-8x7B shape | 8 GiB | llama.cpp CUDA, -ngl 99 -ncmoe 32 (0 experts in VRAM) | timeout | 33.30 | timeout, 150.01 s, 8.0 GiB |" "table"
has "$table" "| Mixtral-8x7B shape | 8 GiB | 2.40 | 1.08 (cuda-tier) | **2.22×** | 42.14 | 41.84 (cuda-tier) | **1.01×** |" "table"

if [ $fails = 0 ]; then echo "peer selftest: ok"; else echo "peer selftest: $fails failed"; exit 1; fi
