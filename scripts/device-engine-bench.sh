#!/usr/bin/env bash
# The GPU engine's checks and benchmark on the device machine (H200), from the repository root
# with the binaries carried in .device/ (scripts/device-bundle.sh build-me ...). Phases, run in
# the order given:
#   tests    gpu_kernels_tests, gpu_engine_tests and engine_tests (fixtures through a real expertd)
#   gpubench expert-gpu-bench: staging->VRAM copy vs cudaMemcpy of pinned memory; expert FFN vs HBM
#   kernels  gpu_kernels_tests' matvec tests (every variant against the CPU), expert-gpu-bench
#            --variants all (docs/KERNELS.md) for q4_k, q6_k, q8_0, mxfp4 on the Mixtral expert
#            (2 experts) and q4_k, q6_k, q8_0 on Qwen3-30B-A3B's (8 experts, 768 x 2048), then
#            gpu_engine_tests with the candidate variants as the engine's default
#   forge    a Mixtral-8x7B-shaped qwen3moe GGUF (32 layers, 8 experts, top-2, embd 4096,
#            ff 14336, q4_k experts: ~25 GB of experts) on the device's disk, unless present
#   disk     expert-bench storage on it: expertd's O_DIRECT GB/s against raw O_DIRECT
#   sweep    expert-tune sweep (docs/TUNING.md) on a 1.6 GB Mixtral-shaped model
#   run:NAME:CACHE:VRAM:DEPTH:TOKENS[:DAEMON]
#            a fresh expertd (cache CACHE, --prefetch-depth DAEMON: auto, the default, or 0..64) and
#            expert-run replaying the Mixtral humaneval1 trace (benchmark mode) with --vram-experts
#            VRAM and --prefetch-depth DEPTH (its hints) for TOKENS tokens
#   forge4   a DeepSeek-V4-shaped deepseek4 GGUF (DeepseekV4Config widths: 256 experts, top-6,
#            hidden 4096, expert width 2048, 3 hash layers, q4_k experts; $DS4_LAYERS layers, 9 by
#            default: ~32 GB of experts) on the device's disk, unless present
#   disk4    expert-bench storage on it
#   run4:NAME:CACHE:VRAM:DEPTH:TOKENS:HASH
#            a fresh expertd (cache CACHE) and expert-run decoding the V4 model with its own
#            routers (temperature 1, seed 1, so tokens and hash-layer experts vary), HASH = on|off
#            for the exact hash-layer hints
#   llbuild  starts building llama.cpp's llama-bench (CUDA, sm_90) in the background from
#            .device/llama-src.tgz (the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, trimmed
#            by `bench/peer/peer.sh --llama-src SDIST pack-src .device/llama-src.tgz`)
#   llwait   waits for that build (both through bench/peer/peer.sh, which owns that logic)
#   prefill:NAME:CACHE:VRAM:CHUNK:LEN:CAP
#            out-of-core prefill on the Mixtral-shaped model: a fresh expertd (cache CACHE) and
#            expert-run (--vram-experts VRAM, --prefill-chunk CHUNK) on a LEN-token prompt of
#            pseudo-random ids, both inside a cgroup v2 with memory.max CAP, page cache dropped first
#   prefill4:NAME:CACHE:VRAM:CHUNK:LEN:CAP
#            the same on the DeepSeek-V4-shaped model of forge4
#   llprefill:NAME:LEN:UBATCH:NCMOE:CAP
#            llama-bench -p LEN -n 0 on the same GGUF under the same cap: -ngl 99 -ncmoe NCMOE (layers
#            whose experts stay on the CPU), -ub/-b UBATCH, mmap, --repack 0 (docs/PERFORMANCE.md)
#   serve    expertd on the qwen3moe-tiny and deepseek4-tiny fixtures and expert-serve on each (the
#            GPU engine), driven with curl: greedy completions and chat, streamed and not, against
#            expert-run --prompt on the same text; prefix reuse on a second chat turn
# Results land in $OUT (JSON per phase). The tests find their binaries and fixtures relative to
# themselves (testing/paths.h), so .device/ may lie anywhere; the traces come in
# EXPERTD_SHARED_TRACES.
set -euo pipefail
root=$PWD
# Progress lines, cgroup v2 caps and the llama.cpp build, shared with bench/peer/peer.sh.
. "$root/bench/peer/lib.sh"
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
bin=$root/.device/bin
out=${OUT:-/tmp/out}
work=${EXPERTD_BENCH_DIR:-/var/tmp/expertd-bench}
mkdir -p "$out" "$work"
model=$work/mixtral-q4k.gguf
trace=$root/.device/traces/mixtral-8x7b-humaneval1.trace.jsonl

phase_tests() {  # the tests find binaries and fixtures next to themselves (.device/bin, fixtures)
  export EXPERTD_SHARED_TRACES=$root/.device/traces
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
  local rc=0
  for t in gpu_kernels_tests gpu_engine_tests engine_tests; do
    [ -x "$bin/$t" ] || continue
    echo "== $t"
    "$bin/$t" --gtest_brief=1 --gtest_output="xml:$out/$t.xml" 2>&1 | tee "$out/$t.log" |
      grep -vE '^\[ +(OK|RUN) ' || rc=1
  done
  return $rc
}

phase_gpubench() {  # Mixtral's expert (q4_k, and q6_k / q8_0 / mxfp4 encodings), Qwen3-30B-A3B's (top-8)
  "$bin/expert-gpu-bench" | tee "$out/gpubench-q4k.txt"
  "$bin/expert-gpu-bench" --json > "$out/gpubench-q4k.json"
  "$bin/expert-gpu-bench" --type q6_k --json > "$out/gpubench-q6k.json"
  "$bin/expert-gpu-bench" --type q8_0 --json > "$out/gpubench-q8.json"
  "$bin/expert-gpu-bench" --type mxfp4 --json > "$out/gpubench-mxfp4.json"
  "$bin/expert-gpu-bench" --rows 768 --cols 2048 --experts 8 | tee "$out/gpubench-qwen30b.txt"
}

phase_kernels() {  # every matvec variant: checked against the CPU, then timed side by side
  local rc=0
  "$bin/gpu_kernels_tests" --gtest_brief=1 --gtest_filter='*Matvec*:*Swiglu*' \
    --gtest_output="xml:$out/kernels-tests.xml" 2>&1 | tee "$out/kernels-tests.log" |
    grep -vE '^\[ +(OK|RUN) ' || rc=1
  local t
  for t in q4_k q6_k q8_0 mxfp4; do
    "$bin/expert-gpu-bench" --type $t --variants all --no-inplace --iters 50 \
      --json > "$out/variants-mixtral-$t.json" 2> "$out/variants-mixtral-$t.txt" || rc=1
    sed -n '/matvec variants/,$p' "$out/variants-mixtral-$t.txt" | sed "s/^/[mixtral $t] /"
  done
  for t in q4_k q6_k q8_0; do
    "$bin/expert-gpu-bench" --type $t --rows 768 --cols 2048 --experts 8 --variants all \
      --no-inplace --iters 100 --json > "$out/variants-qwen30b-$t.json" \
      2> "$out/variants-qwen30b-$t.txt" || rc=1
    sed -n '/matvec variants/,$p' "$out/variants-qwen30b-$t.txt" | sed "s/^/[qwen30b $t] /"
  done
  # The engine against the CPU with the candidates as its default (EXPERTD_MATVEC_VARIANT) and
  # SwiGLU fused into down (EXPERTD_FUSE_SWIGLU), if gpu_engine_tests was carried.
  local v
  if [ -x "$bin/gpu_engine_tests" ]; then
    export EXPERTD_SHARED_TRACES=$root/.device/traces
    for v in splitk splitk+pdl splitk+q6r2; do
      echo "== gpu_engine_tests EXPERTD_MATVEC_VARIANT=$v EXPERTD_FUSE_SWIGLU=1"
      EXPERTD_MATVEC_VARIANT=$v EXPERTD_FUSE_SWIGLU=1 "$bin/gpu_engine_tests" --gtest_brief=1 \
        > "$out/kernels-engine-$v.log" 2>&1 || { rc=1; tail -30 "$out/kernels-engine-$v.log"; }
      tail -3 "$out/kernels-engine-$v.log"
    done
  fi
  return $rc
}

phase_forge() {
  if [ -f "$model" ]; then echo "forge: $model exists"; return; fi
  "$bin/expert-forge" --layers 32 --experts 8 --top-k 2 --embd 4096 --ff 14336 --heads 32 \
    --kv-heads 8 --head-dim 128 --vocab 32000 --expert-type q4_k --dense-type f16 --seed 8 \
    --threads 16 -o "$model" --force
  ls -l "$model"
}

phase_disk() {
  "$bin/expert-bench" storage --model "$model" --seconds 3 --json | tee "$out/disk.json"
}

phase_sweep() {  # issue 6's tuning sweep (docs/TUNING.md) on a 1.6 GB Mixtral-shaped model
  local m=$work/sweep
  mkdir -p "$m"
  "$bin/expert-forge" --layers 32 --experts 8 --top-k 2 --embd 1024 --ff 3584 --expert-type q4_k \
    --seed 1 --threads 16 -o "$m/mixtral-shaped.gguf" --force
  "$bin/expertd" --model "mixtral=$m/mixtral-shaped.gguf" --socket "$m/x.sock" --cache 1GiB \
    2> "$out/sweep-expertd.log" &
  local pid=$!
  for _ in $(seq 300); do "$bin/expertctl" status --socket "$m/x.sock" > /dev/null 2>&1 && break; sleep 0.2; done
  local rc=0
  "$bin/expert-tune" sweep --socket "$m/x.sock" --model mixtral --trace "$trace" \
    --depths 0,1,2,3,4 --queue-depths 4,16 --cache 512MiB,1GiB --compute-us-per-layer 1000 \
    --repeat 2 --plot "$out/tuning-sweep-h200.svg" > "$out/sweep-h200.txt" 2> "$out/sweep-h200.err" || rc=$?
  "$bin/expertctl" stats --socket "$m/x.sock" > "$out/stats-h200.txt" || true
  kill -TERM $pid; wait $pid || true
  tail -40 "$out/sweep-h200.txt"
  return $rc
}

model4=$work/ds4-q4k.gguf

phase_forge4() {
  if [ -f "$model4" ]; then echo "forge4: $model4 exists"; return; fi
  "$bin/expert-forge" --arch deepseek4 --layers "${DS4_LAYERS:-9}" --expert-type q4_k --vocab 129280 \
    --seed 4 --threads 16 -o "$model4" --force
  ls -l "$model4"
}

phase_disk4() {
  "$bin/expert-bench" storage --model "$model4" --seconds 3 --json | tee "$out/disk4.json"
}

phase_run4() {  # NAME CACHE VRAM DEPTH TOKENS HASH
  local name=$1 cache=$2 vram=$3 depth=$4 tokens=$5 hash=$6
  local sock=$work/expertd4.sock
  rm -f "$sock"
  sync; echo 3 > /proc/sys/vm/drop_caches || true
  "$bin/expertd" --model "v4=$model4" --socket "$sock" --cache "$cache" --staging 1GiB \
    --queue-depth 32 2> "$work/expertd4-$name.log" &
  local pid=$!
  for _ in $(seq 600); do [ -S "$sock" ] && break; sleep 0.1; done
  [ -S "$sock" ] || { cat "$work/expertd4-$name.log"; kill $pid; return 1; }
  local rc=0 extra=()
  [ "$hash" = off ] && extra+=(--no-hash-hints)
  "$bin/expert-run" --socket "$sock" --model v4 --gguf "$model4" \
    --prompt-tokens 9707,11,1879,0,16,8,30,101,4096,77 --max-tokens "$tokens" --vram-experts "$vram" \
    --prefetch-depth "$depth" --temperature 1 --seed 1 --ignore-eos "${extra[@]}" --json \
    > "$out/run4-$name.json" || rc=$?
  "$bin/expertctl" stats --socket "$sock" > "$out/stats4-$name.txt" 2>&1 || true
  kill -TERM $pid; wait $pid || true
  echo "run4 $name (cache $cache, vram $vram, depth $depth, hash hints $hash): $(head -c 900 "$out/run4-$name.json")"
  return $rc
}

phase_run() {  # NAME CACHE VRAM DEPTH TOKENS [DAEMON]
  local name=$1 cache=$2 vram=$3 depth=$4 tokens=$5 daemon_depth=${6:-auto}
  local sock=$work/expertd.sock
  rm -f "$sock"
  "$bin/expertd" --model "mix=$model" --socket "$sock" --cache "$cache" --staging 1GiB \
    --queue-depth 32 --prefetch-depth "$daemon_depth" 2> "$work/expertd-$name.log" &
  local pid=$!
  for _ in $(seq 600); do [ -S "$sock" ] && break; sleep 0.1; done
  [ -S "$sock" ] || { cat "$work/expertd-$name.log"; kill $pid; return 1; }
  local rc=0
  "$bin/expert-run" --socket "$sock" --model mix --gguf "$model" --prompt-tokens 1 \
    --max-tokens "$tokens" --vram-experts "$vram" --prefetch-depth "$depth" \
    --routing-trace "$trace" --json > "$out/run-$name.json" || rc=$?
  kill -TERM $pid; wait $pid || true
  echo "run $name (cache $cache, vram $vram, depth $depth, daemon depth $daemon_depth):" \
    "$(head -c 600 "$out/run-$name.json")"
  return $rc
}

# Runs "$@" inside a fresh cgroup v2 whose memory.max (page cache included) is $1 (12G, 8GiB or
# bytes); fails, naming why, where there is no such cgroup (a cgroup v1 machine), rather than run
# uncapped.
in_cgroup() {
  local cap stats=$work/cgroup-$$.stats rc=0
  cap=$(numfmt --from=iec "${1%iB}")
  shift
  local why
  why=$(peer_cgroup_check 2>&1) || { echo "in_cgroup: $why" >&2; return 1; }
  peer_in_cgroup "$cap" 0 "$stats" "$@" || rc=$?
  echo "cgroup: memory.max $cap, peak $(sed -n 's/^peak //p' "$stats"), events:" \
    "$(sed -n 's/^event_//p' "$stats" | tr '\n' ' ')" >&2
  return $rc
}

prompt_ids() {  # LEN pseudo-random token ids in [100, 31900), comma-separated
  awk -v n="$1" 'BEGIN { srand(12); for (i = 0; i < n; ++i) printf "%s%d", (i ? "," : ""), 100 + int(rand() * 31800) }'
}

phase_llbuild() {
  "$root/bench/peer/peer.sh" --work "$work" --llama-src "$root/.device/llama-src.tgz" \
    --builds cuda --jobs 14 build-start
}

phase_llwait() {
  "$root/bench/peer/peer.sh" --work "$work" --builds cuda build-wait
}

phase_prefill() {  # NAME CACHE VRAM CHUNK LEN CAP [GGUF]
  local name=$1 cache=$2 vram=$3 chunk=$4 len=$5 cap=$6 gguf=${7:-$model}
  local sock=$work/expertd-pf.sock
  rm -f "$sock"
  sync; echo 3 > /proc/sys/vm/drop_caches || true
  local rc=0
  in_cgroup "$cap" bash -c '
    "$0/expertd" --model "mix=$1" --socket "$2" --cache "$3" --staging 1GiB --queue-depth 32 \
      2> "$7" &
    pid=$!
    for _ in $(seq 600); do [ -S "$2" ] && break; sleep 0.1; done
    rc=0
    "$0/expert-run" --socket "$2" --model mix --prompt-tokens "$4" --max-tokens 4 \
      --vram-experts "$5" --prefill-chunk "$6" --ignore-eos --json || rc=$?
    kill -TERM $pid; wait $pid
    exit $rc' "$bin" "$gguf" "$sock" "$cache" "$(prompt_ids "$len")" "$vram" "$chunk" \
    "$work/expertd-pf-$name.log" > "$out/prefill-$name.json" || rc=$?
  echo "prefill $name (cache $cache, vram $vram, chunk $chunk, $len tokens, cap $cap): \
$(grep -o '"prefill":{[^}]*}' "$out/prefill-$name.json")"
  return $rc
}

phase_llprefill() {  # NAME LEN UBATCH NCMOE CAP
  local name=$1 len=$2 ub=$3 ncmoe=$4 cap=$5
  sync; echo 3 > /proc/sys/vm/drop_caches || true
  local rc=0
  in_cgroup "$cap" "$(peer_llama_bin "$work/llama-build" cuda)" -m "$model" -p "$len" -n 0 -r 1 \
    -b "$ub" -ub "$ub" -ngl 99 -ncmoe "$ncmoe" --repack 0 -o json > "$out/llprefill-$name.json" \
    2> "$work/llprefill-$name.err" || rc=$?
  echo "llprefill $name ($len tokens, ubatch $ub, ncmoe $ncmoe, cap $cap): \
$(tr -d '\n ' < "$out/llprefill-$name.json" | grep -o '"avg_ts":[0-9.e+-]*')"
  [ $rc = 0 ] || tail -5 "$work/llprefill-$name.err"
  return $rc
}

phase_serve() {
  local fx=${EXPERTD_TEST_DATA:-$root/tests/fixtures} sock=$work/serve.sock rc=0
  rm -f "$sock"
  "$bin/expertd" --model "q=$fx/qwen3moe-tiny/model-q8_0.gguf" \
    --model "v4=$fx/deepseek4-tiny/model-mxfp4.gguf" --socket "$sock" --cache 256MiB \
    2> "$work/serve-expertd.log" &
  local dpid=$!
  for _ in $(seq 300); do [ -S "$sock" ] && break; sleep 0.1; done
  local m port=18080
  for m in q v4; do
    "$bin/expert-serve" --socket "$sock" --model "$m" --port $port 2> "$out/serve-$m.log" &
    local spid=$!
    for _ in $(seq 300); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 0.1; done
    local want got chat1 chat2
    want=$("$bin/expert-run" --socket "$sock" --model "$m" --prompt "The expert cache" \
      --max-tokens 12 --json | sed -n 's/.*"text":\("[^"]*"\).*/\1/p')
    got=$(curl -sf "localhost:$port/v1/completions" -H 'content-type: application/json' \
      -d "{\"model\":\"$m\",\"prompt\":\"The expert cache\",\"max_tokens\":12,\"temperature\":0}")
    echo "serve $m: expert-run text $want"
    echo "serve $m: completion $got"
    echo "$got" | grep -qF "\"text\":$want" || { echo "serve $m: MISMATCH"; rc=1; }
    echo "serve $m: stream $(curl -sfN "localhost:$port/v1/completions" \
      -H 'content-type: application/json' -d "{\"model\":\"$m\",\"prompt\":\"The expert cache\",\"max_tokens\":12,\"temperature\":0,\"stream\":true,\"stream_options\":{\"include_usage\":true}}" | tail -c 400)"
    chat1=$(curl -sf "localhost:$port/v1/chat/completions" -H 'content-type: application/json' \
      -d "{\"model\":\"$m\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],\"max_tokens\":4}")
    chat2=$(curl -sf "localhost:$port/v1/chat/completions" -H 'content-type: application/json' \
      -d "{\"model\":\"$m\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"},{\"role\":\"assistant\",\"content\":\"Hi\"},{\"role\":\"user\",\"content\":\"More\"}],\"max_tokens\":4}")
    echo "serve $m: chat $chat1"
    echo "serve $m: chat turn 2 $chat2"
    [ -n "$chat1" ] && [ -n "$chat2" ] || rc=1
    kill -TERM $spid; wait $spid || rc=1
    tail -4 "$out/serve-$m.log"
    port=$((port + 1))
  done
  kill -TERM $dpid; wait $dpid || true
  return $rc
}

for p in "$@"; do
  case $p in
    run:*) IFS=: read -r _ n c v d t dd <<< "$p"; phase_run "$n" "$c" "$v" "$d" "$t" "${dd:-auto}" ;;
    run4:*) IFS=: read -r _ n c v d t h <<< "$p"; phase_run4 "$n" "$c" "$v" "$d" "$t" "$h" ;;
    prefill:*) IFS=: read -r _ n c v k l m <<< "$p"; phase_prefill "$n" "$c" "$v" "$k" "$l" "$m" ;;
    prefill4:*) IFS=: read -r _ n c v k l m <<< "$p"
      phase_prefill "$n" "$c" "$v" "$k" "$l" "$m" "$model4" ;;
    llprefill:*) IFS=: read -r _ n l u g m <<< "$p"; phase_llprefill "$n" "$l" "$u" "$g" "$m" ;;
    *) "phase_$p" ;;
  esac
done
