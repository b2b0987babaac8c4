#!/usr/bin/env bash
# bench/peer/peer.sh without a GPU, llama.cpp or network (ctest peer_bench_plan, a few seconds):
# --help, refused arguments, the --dry-run plan (the streams step, fed and llama-bench runs, the
# -ncmoe of each config from the expert sizes, the cache from the cap, the run order, --cells),
# the streams step for real when given expertctl's folder (glibc's rand() sequence, the text's
# ids), and summarize.py on recorded outputs of llama-bench, llama-feed and expert-run (fed and
# sampled): the figures, a timed-out run, the fair table's ratio and disk-bound fraction.
#
# Usage: selftest.sh [BIN_DIR]   (BIN_DIR: where expertctl is; without it the streams step is
#                                 only checked in --dry-run)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
peer=$here/peer.sh
bindir=${1:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
has() { grep -qF -- "$2" <<< "$1" || fail "$3: no '$2' in: $(head -c 600 <<< "$1")"; }
hasnt() { ! grep -qF -- "$2" <<< "$1" || fail "$3: '$2' should not be in: $(grep -F -- "$2" <<< "$1" | head -c 400)"; }

out=$("$peer" --help) || fail "--help exits non-zero"
has "$out" "--lookahead N" "--help"
has "$out" "--caps LIST" "--help"
has "$out" "--cells LIST" "--help"
has "$out" "--streams LIST" "--help"
has "$out" "build-start" "--help"
has "$out" "the others are optional" "--help"
has "$out" "NOT comparable" "--help"

for args in "--models llama" "--caps 0" "--caps 8,x" "--configs gpu" "--tg" "--vram mixtral=x" \
  "--bogus" "--tg 0" "--streams bogus" "--streams random,sampled" "--streams ," "--seed x" \
  "--cells mixtral" "--cells foo:8" "--cells mixtral:0" "--cells mixtral:8,qwen3" \
  "--cells mixtral:8 --models qwen3" "--lookahead x" "--lookahead 9" \
  "--daemon-depth x" "--daemon-depth 65"; do
  # shellcheck disable=SC2086
  if err=$("$peer" $args --dry-run 2>&1); then
    fail "'$args' accepted"
  else
    rc=$?
    [ $rc = 2 ] || fail "'$args' exits $rc, not 2"
    has "$err" "peer.sh: " "'$args'"
  fi
done
err=$("$peer" --streams random,text,xyz --dry-run 2>&1) || true
has "$err" "--streams: 'xyz' is not random or text" "bad --streams"

# The default plan: 2 models x 2 caps x (expertd and llama-feed per stream, llama-bench once).
plan=$("$peer" --dry-run --bin /b --work /w --out "$tmp/o" --llama-src /s.tgz)
has "$plan" "run: 20 runs, tg 16, pp 512, streams random text" "plan"
has "$plan" "unpack /s.tgz to /w/llama.cpp; build llama-bench and llama-feed (cuda)" "plan"
has "$plan" "/b/expert-forge --arch qwen3moe --layers 48 --experts 128 --top-k 8 --embd 2048 --ff 768" "plan"
# The streams, once per vocabulary size (every full-size shape: 32000).
has "$plan" "streams: $tmp/o/streams/prompt-32000.ids: 512 ids, awk srand(12) in [100, 31900)" "plan"
has "$plan" "streams: $tmp/o/streams/random-32000.ids: 16 ids, glibc rand() % 32000 after srand(1)" "plan"
has "$plan" "streams: $tmp/o/streams/text-32000.ids: the first 16 ids of docs/ARCHITECTURE.md + engine/engine.h (mod 32000): /b/expertctl tokenize /w/llama.cpp/models/ggml-vocab-llama-spm.gguf --file $root/docs/ARCHITECTURE.md --file $root/engine/engine.h --max 16 --json" "plan"
[ "$(grep -c '^streams: ' <<< "$plan")" = 3 ] || fail "plan: not 3 stream files (one vocabulary)"
has "$plan" "disk: caches dropped; /b/expert-bench storage --model /w/mixtral-q4k.gguf --cache 4GiB --grid engine --seconds 3 --no-verify --json > $tmp/o/disk.json" "plan"
# Steps in order: the streams before the build is waited for, the disk after it, both before run.
[ "$(grep -oE '^(build-start|forge|streams|build-wait|disk|ipc|run|table)' <<< "$plan" | uniq | tr '\n' ' ')" = \
  "build-start forge streams build-wait disk ipc run table " ] || fail "plan: steps out of order"
has "$plan" "ipc: 5 x /b/expert-bench ipc --json >> $tmp/o/ipc.jsonl" "plan"
# expertd fed: the stream file, the same prompt; no sampling flags.
has "$plan" "run 1/20 mixtral-8g-expertd-random: expertd cache 4882 MiB" "plan"
has "$plan" "-- --prompt-tokens <512 ids, awk srand(12)> --feed-tokens $tmp/o/streams/random-32000.ids --vram-experts 32 --prefill-chunk 512 --json" "plan"
grep -q '^run 2/20 mixtral-8g-expertd-text: ' <<< "$plan" || fail "plan: the text stream does not follow the random one"
hasnt "$plan" "--temperature" "plan (fed decode samples nothing)"
hasnt "$plan" "--max-tokens" "plan (fed decode samples nothing)"
# llama-feed: the same prompt and stream files, -ncmoe of the tier; repack off.
has "$plan" "run 9/20 mixtral-8g-feed-cuda-tier-random: llama-feed (random ids), llama.cpp CUDA -ngl 99 -ncmoe 28 (32 experts in VRAM)" "plan"
has "$plan" "/w/llama-build/cuda/bin/llama-feed -m /w/mixtral-q4k.gguf --prompt-ids $tmp/o/streams/prompt-32000.ids --feed $tmp/o/streams/text-32000.ids -lm mmap --no-repack -ngl 99 -ncmoe 28" "plan"
has "$plan" "--feed $tmp/o/streams/random-32000.ids -lm mmap --no-repack -ngl 99 -ncmoe 46" "plan"
# llama-bench once per model and cap, no stream in its id.
has "$plan" "run 11/20 mixtral-8g-cuda-tier: llama-bench, llama.cpp CUDA -ngl 99 -ncmoe 28" "plan"
has "$plan" "mixtral-q4k.gguf -p 512 -n 16 -r 1 --no-warmup -lm mmap --repack 0 -o jsonl -ngl 99 -ncmoe 28" "plan"
has "$plan" "qwen3-30b-a3b-q4k.gguf -p 512 -n 16 -r 1 --no-warmup -lm mmap --repack 0 -o jsonl -ngl 99 -ncmoe 46" "plan"
[ "$(grep -c '^run .*: llama-bench' <<< "$plan")" = 4 ] || fail "plan: not 4 llama-bench runs"
[ "$(grep -c '^run .*: llama-feed' <<< "$plan")" = 8 ] || fail "plan: not 8 llama-feed runs"
has "$plan" "memory.max 17179869184" "plan"
# expertd's runs first (they can go while llama.cpp builds).
grep -q '^run 8/20 qwen3-16g-expertd-text:' <<< "$plan" || fail "plan: expertd's runs are not first"

# Every config: 14 runs a cell; the CPU-only build's last; prefetch off beside on; sampled apart.
all=$("$peer" --dry-run --bin /b --work /w --out "$tmp/o" --streams random,text \
  --configs expertd,expertd-d0,feed-cuda-tier,feed-cuda-all,feed-cpu,cuda-tier,cuda-all,cpu,sampled)
has "$all" "run: 56 runs" "all configs"
grep -q '^run 2/56 mixtral-8g-expertd-d0-random: .*daemon prefetch depth 0' <<< "$all" ||
  fail "all configs: no depth-0 run beside expertd's"
has "$all" "mixtral-8g-expertd-d0-random.expertd.log 0 -- --prompt-tokens" "all configs"
grep -q '^run 5/56 mixtral-8g-sampled: .*sampled decode (not comparable)' <<< "$all" ||
  fail "all configs: no sampled run after the fed expertd runs"
has "$all" "--max-tokens 17 --vram-experts 32 --prefill-chunk 512 --temperature 1 --seed 1 --ignore-eos --json" "all configs"
[ "$(grep -c '^run .*: llama-feed (.* ids), llama.cpp CPU-only build' <<< "$all")" = 8 ] || fail "all configs: not 8 feed-cpu runs"
grep -q '^run 45/56 mixtral-8g-feed-cpu-random' <<< "$all" || fail "all configs: the cpu runs are not last"
grep -q '^run 56/56 qwen3-16g-cpu: llama-bench, llama.cpp CPU-only build; memory.max 17179869184, limit 120 s' <<< "$all" ||
  fail "all configs: the last run is not llama-bench's CPU-only"
has "$all" "/w/llama-build/cpu/bin/llama-feed -m /w/mixtral-q4k.gguf --prompt-ids $tmp/o/streams/prompt-32000.ids --feed $tmp/o/streams/random-32000.ids -lm mmap --no-repack" "all configs"
has "$all" "-ngl 99 -ncmoe 32 (0 experts in VRAM)" "all configs"

# --cells: per-model caps (the device's full-size set); the DeepSeek-V3 slice's first block is
# dense (its 5 MoE blocks of 256 experts: a tier of 256 = 1 block in VRAM, so -ncmoe 5).
cells=$("$peer" --dry-run --bin /b --work /w --out "$tmp/o" --cells mixtral:8,mixtral:16,qwen3:8,ds3:16)
has "$cells" "run: 20 runs" "cells"
[ "$(grep -c '^forge ' <<< "$cells")" = 3 ] || fail "cells: not 3 models forged"
has "$cells" "/b/expert-forge --arch deepseek3 --layers 6 --experts 256 --top-k 8 --embd 7168" "cells"
has "$cells" "--dense-layers 1 -o /w/ds3-slice-q4k.gguf" "cells"
grep -q '^run 7/20 ds3-16g-expertd-random: ' <<< "$cells" || fail "cells: ds3 at 16 GiB not the 4th cell"
has "$cells" "ds3-slice-q4k.gguf --prompt-ids $tmp/o/streams/prompt-32000.ids --feed $tmp/o/streams/random-32000.ids -lm mmap --no-repack -ngl 99 -ncmoe 5" "cells"
! grep -q '^run .* qwen3-16g' <<< "$cells" || fail "cells: a qwen3 16 GiB run not asked for"
# Issue 15's llama-arch Mixtral.
plan15=$("$peer" --dry-run --bin /b --work /w --out "$tmp/o" --models mixtral-llama --caps 8 \
  --configs expertd,cuda-tier --streams text)
has "$plan15" "run: 2 runs" "plan15"
has "$plan15" "/b/expert-forge --arch mixtral --layers 32 --experts 8 --top-k 2" "plan15"
has "$plan15" "mixtral-llama-q4k.gguf -p 512 -n 16 -r 1 --no-warmup -lm mmap --repack 0 -o jsonl -ngl 99 -ncmoe 28" "plan15"
quick=$("$peer" --dry-run --quick --models qwen3 --caps 16 --configs expertd,feed-cpu,cpu --vram qwen3=384 --streams random)
has "$quick" "run: 3 runs, tg 8, pp 512" "quick plan"
has "$quick" "random-32000.ids: 8 ids" "quick plan"
has "$quick" "--vram-experts 384 --prefill-chunk 512" "quick plan"
has "$quick" "memory.max 17179869184, limit 90 s:" "quick plan"
has "$quick" "CPU-only build; memory.max 17179869184, limit 60 s:" "quick plan"
# --tiny: the small shapes' vocabulary of 1024, the text taken modulo it.
tiny=$("$peer" --dry-run --tiny --models mixtral --caps 1 --configs feed-cpu --work /w --out "$tmp/o")
has "$tiny" "text-1024.ids: the first 16 ids of docs/ARCHITECTURE.md + engine/engine.h (mod 1024)" "tiny plan"
has "$tiny" "awk srand(12) in [100, 924)" "tiny plan"

# The streams step for real: glibc's sequence after srand(1) (1804289383 % 32000 = 1383, ...), the
# text's ids as expertctl gives them, the prompt as the awk line.
if [ -n "$bindir" ] && [ -x "$bindir/expertctl" ]; then
  tok=$root/tests/fixtures/tokenizers/mixtral.gguf
  "$peer" --bin "$bindir" --out "$tmp/s" --models mixtral --caps 8 --tokenizer "$tok" streams \
    2> "$tmp/streams.err" || fail "streams step: $(tail -3 "$tmp/streams.err")"
  [ "$(cut -d, -f1-5 "$tmp/s/streams/random-32000.ids")" = "1383,18886,28777,12915,19793" ] ||
    fail "random stream: $(head -c 80 "$tmp/s/streams/random-32000.ids")"
  [ "$(tr ',' '\n' < "$tmp/s/streams/random-32000.ids" | wc -l)" = 16 ] || fail "random stream: not 16 ids"
  want=$("$bindir/expertctl" tokenize "$tok" --file "$root/docs/ARCHITECTURE.md" \
    --file "$root/engine/engine.h" --max 16)
  [ "$(cat "$tmp/s/streams/text-32000.ids")" = "$want" ] ||
    fail "text stream: $(cat "$tmp/s/streams/text-32000.ids") is not $want"
  [ "$(tr ',' '\n' < "$tmp/s/streams/prompt-32000.ids" | wc -l)" = 512 ] || fail "prompt: not 512 ids"
  readme=$(cat "$tmp/s/streams/README")
  has "$readme" "random-32000.ids: 16 ids, glibc rand() % 32000 after srand(1)" "streams README"
  has "$readme" "text-32000.ids: the first 16 ids of docs/ARCHITECTURE.md followed by engine/engine.h" "streams README"
  has "$readme" "(1459 tokens: --tokenizer)" "streams README"
  has "$(cat "$tmp/s/streams/text-32000.ids.source")" "$tok" "text stream source"
else
  echo "peer selftest: the streams step only in --dry-run (no BIN_DIR with expertctl given)"
fi

# summarize.py on recorded outputs.
td=$here/testdata
rec() { python3 "$here/summarize.py" record "$@"; }
common=(--field cap_gib=8 --field tg_tokens=16 --field pp_tokens=512 --field model=mixtral)
# The stream expertd-feed.out decoded (it echoes the ids), and another one.
echo "1383,18886,28777,12915,19793,14335,13386,492,4649,9421,18362,26027,8690,24059,1763,25926" > "$tmp/random.ids"
echo "1,2,3" > "$tmp/other.ids"
{
  rec --kind expertd --raw "$td/expertd-feed.out" --stats "$td/ok.stats" "${common[@]}" \
    --field config=expertd --field tool=expertd --field id=mixtral-8g-expertd-random \
    --field stream=random --field cache_mib=4882 --field vram_experts=32 \
    --field "stream_file=$tmp/random.ids"
  rec --kind expertd --raw "$td/expertd-d0-feed.out" --stats "$td/ok.stats" "${common[@]}" \
    --field config=expertd-d0 --field tool=expertd --field id=mixtral-8g-expertd-d0-random \
    --field stream=random --field cache_mib=4882 --field vram_experts=32 --field daemon_depth=0
  rec --kind expertd --raw "$td/expertd.out" --stats "$td/ok.stats" "${common[@]}" \
    --field config=sampled --field tool=expertd --field id=mixtral-8g-sampled \
    --field stream=sampled --field cache_mib=4882 --field vram_experts=32
  rec --kind llama-feed --raw "$td/llama-feed.out" --stats "$td/ok.stats" "${common[@]}" \
    --field config=feed-cuda-tier --field tool=llama-feed --field id=mixtral-8g-feed-cuda-tier-random \
    --field stream=random --field ncmoe=28 --field vram_experts=32
  rec --kind llama-feed --raw "$td/llama-feed-all.out" --stats "$td/ok.stats" "${common[@]}" \
    --field config=feed-cuda-all --field tool=llama-feed --field id=mixtral-8g-feed-cuda-all-random \
    --field stream=random --field ncmoe=32 --field vram_experts=0
  rec --kind llama.cpp --raw "$td/llama-cuda-tier.out" --stats "$td/ok-io.stats" "${common[@]}" \
    --field config=cuda-tier --field tool=llama.cpp --field id=mixtral-8g-cuda-tier \
    --field stream=llama-bench --field ncmoe=28 --field vram_experts=32
  rec --kind llama.cpp --raw "$td/llama-cuda-all.out" --stats "$td/timeout.stats" "${common[@]}" \
    --field config=cuda-all --field tool=llama.cpp --field id=mixtral-8g-cuda-all \
    --field stream=llama-bench --field ncmoe=32 --field vram_experts=0
} > "$tmp/results.jsonl"
line() { sed -n "$1p" "$tmp/results.jsonl"; }
brief=$(line 1 | python3 "$here/summarize.py" brief)
has "$brief" "ok: tg 2.50 tokens/s (470.0 MB read per token), pp512 45.30 tokens/s (41.2 s, peak 8.00 GiB, oom kills 0)" "brief (fed)"
brief=$(line 3 | python3 "$here/summarize.py" brief)
# expert-run's 2.55 tokens/s over 17 sampled tokens, 16 of them decode steps: 2.40 per decode step.
has "$brief" "ok: tg 2.40 tokens/s (470.0 MB read per token), pp512 42.14 tokens/s" "brief (sampled)"
brief=$(line 4 | python3 "$here/summarize.py" brief)
has "$brief" "ok: tg 1.25 tokens/s (1100.0 MB read per token), pp512 41.84 tokens/s" "brief (llama-feed)"
brief=$(line 7 | python3 "$here/summarize.py" brief)
has "$brief" "timeout: tg – tokens/s, pp512 33.30 tokens/s" "brief of a timed-out run"
python3 -c 'import json, sys
r = json.loads(sys.argv[1])
assert r["llama"]["build_commit"] == "0c1e570" and r["llama"]["tg_ms_p99"] == 1103.87, r
assert r["pp_bytes_read_per_token"] == 21474836480 / 512, r' "$(line 4)" || fail "llama-feed record"
python3 -c 'import json, sys
r = json.loads(sys.argv[1])
assert r["cgroup"]["io_rbytes"] == 67500000000 and r["cgroup"]["mem_file_max"] == 6710886400, r' \
  "$(line 6)" || fail "the cgroup io of a llama-bench record"
python3 -c 'import json, sys
e = json.loads(sys.argv[1])["expertd"]
assert e["fed"] and e["reads_in_flight_max"] == 32 and e["hits"]["disk"] == 76, e
assert e["ids_match_stream"] is True, e' "$(line 1)" || fail "expert-run's feed record"
# Ids other than the stream file's void the run.
brief=$(rec --kind expertd --raw "$td/expertd-feed.out" --stats "$td/ok.stats" "${common[@]}" \
  --field config=expertd --field tool=expertd --field id=x --field "stream_file=$tmp/other.ids" |
  python3 "$here/summarize.py" brief)
has "$brief" "failed (expert-run decoded other ids than the stream file's)" "ids of another stream"
python3 "$here/summarize.py" is-done "$tmp/results.jsonl" mixtral-8g-feed-cuda-tier-random 16 512 ||
  fail "done: an ok run not found"
! python3 "$here/summarize.py" is-done "$tmp/results.jsonl" mixtral-8g-feed-cuda-tier-random 8 128 ||
  fail "done: found at other token counts"
! python3 "$here/summarize.py" is-done "$tmp/results.jsonl" mixtral-8g-cuda-all 16 512 ||
  fail "done: a timed-out run counts as done"
has "$(python3 "$here/summarize.py" disk "$td/disk.json")" "best raw O_DIRECT 2.10 GB/s (io_uring QD32 4 MiB), expertd 2.03 GB/s" "disk"
# expert-bench ipc's five runs (recorded on the dev VM): each p50, how many within 3 us.
has "$(python3 "$here/summarize.py" ipc "$td/ipc.jsonl")" "shm round trip p50 0.81, 0.80, 0.82, 0.81, 2.64 us (p99 at most 3.72), 5 of 5 runs <= 3 us; RPC p50 32, 54, 39, 44, 83 us" "ipc"
table=$(python3 "$here/summarize.py" table --disk "$td/disk.json" "$tmp/results.jsonl")
has "$table" "Disk: best raw O_DIRECT 2.10 GB/s (io_uring QD32 4 MiB)" "table"
has "$table" "| Mixtral-8x7B shape | 8 GiB | llama-bench's own (random) | llama-bench, llama.cpp CUDA -ngl 99 -ncmoe 32 (0 experts in VRAM) | timeout | – | 33.30 | timeout, 150.01 s, 8.0 GiB |" "table"
has "$table" "| Mixtral-8x7B shape | 8 GiB | llama-bench's own (random) | llama-bench, llama.cpp CUDA -ngl 99 -ncmoe 28 (32 experts in VRAM) | 1.08 | – | 41.84 | ok, 52.4 s, 8.0 GiB, 67.5 GB read in all |" "table"
# The fair table: 2.50 / 1.25 = 2.00; disk-bound fraction (470 MB / 2100 MB/s) / 0.4 s = 0.56.
has "$table" "| Mixtral-8x7B shape | 8 GiB | random | 2.50 | 470.0 | 1.25 (feed-cuda-tier) | 1100.0 | **2.00×** | 0.56 | 18.4 / 32 | 0.61 |" "fair table"
# Sampled decode: shown, labelled, never in a ratio.
has "$table" "| Mixtral-8x7B shape | 8 GiB | sampled (not comparable: expertd samples its own tokens) | 2.40 | 470.0 | – | – | – |" "fair table (sampled)"
# llama-bench's own tg, a second figure: 2.50 / 1.08 = 2.31.
has "$table" "| Mixtral-8x7B shape | 8 GiB | 1.08 | timeout | – | 1.08 (cuda-tier) | 67.5 | 1.25 (feed-cuda-tier) | 2.50 | **2.31×** |" "llama-bench table"
# Prefill: expertd's best 45.30 against llama-feed's 41.84 and llama-bench's 41.84.
has "$table" "| Mixtral-8x7B shape | 8 GiB | 45.30 | 41.84 (feed-cuda-tier) | **1.08×** | 41.84 (cuda-tier) | **1.08×** |" "prefill table"
# Prefetch on and off on the same fed stream: 2.50 / 2.35 = 1.06.
has "$table" "| Mixtral-8x7B shape | 8 GiB | random | 2.50 / 2.35 | **1.06×** | 470 / 470 | 290.0 / 315.5 | 0.780 | 1, 0.61, 0.50 |" "prefetch table"
# With the probe's 2.10 GB/s above every run's busy-time rate, the probe's rate counts (above).
hasnt "$table" "Disk-bound fractions below use" "fair table with a faster probe"
# Without the disk's rate, the fastest busy-time rate of an expertd run stands in: the d0 run's
# 470 MB x 2.35 tokens/s / 0.55 busy = 2.01 GB/s; (470 / 2008) x 2.50 = 0.59.
table=$(python3 "$here/summarize.py" table "$tmp/results.jsonl")
has "$table" "Disk-bound fractions below use 2.01 GB/s: the rate mixtral-8g-expertd-d0-random's reads sustained while the disk was busy, above the probe's –" "fair table without disk.json"
has "$table" "| **2.00×** | 0.59 | 18.4 / 32 | 0.61 |" "fair table without disk.json"

# --lookahead: expert-run's --prefetch-depth, and its own config name so a sweep keeps every run.
la=$("$peer" --cells mixtral:8 --configs expertd --streams random --lookahead 3 --dry-run 2>&1) ||
  fail "--lookahead 3 --dry-run failed: $la"
has "$la" "mixtral-8g-expertd-l3-random" "--lookahead 3"
has "$la" "--json --prefetch-depth 3" "--lookahead 3"
has "$la" "engine router lookahead 3 layer(s)" "--lookahead 3"

# --daemon-depth: expertd's --prefetch-depth for the expertd config (not expertd-d0's 0).
dd=$("$peer" --cells mixtral:8 --configs expertd,expertd-d0 --streams random --daemon-depth 2 \
  --dry-run 2>&1) || fail "--daemon-depth 2 --dry-run failed: $dd"
has "$dd" "mixtral-8g-expertd-p2-random" "--daemon-depth 2"
has "$dd" "daemon prefetch depth 2," "--daemon-depth 2"
has "$dd" "mixtral-8g-expertd-d0-random" "--daemon-depth 2"
has "$dd" "daemon prefetch depth 0," "--daemon-depth 2"

if [ $fails = 0 ]; then echo "peer selftest: ok"; else echo "peer selftest: $fails failed"; exit 1; fi
