#!/usr/bin/env bash
# The expertd demo: forge a Mixtral-shaped Qwen3-MoE GGUF model, inspect it, start expertd on it,
# replay a real routing trace against the daemon (hit rate, GB/s), and stop the daemon cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${EXPERTD_BUILD_DIR:-build}/bin
work=${EXPERTD_DEMO_DIR:-$(mktemp -d /tmp/expertd-demo.XXXXXX)}
mkdir -p "$work"
model="$work/demo-moe.gguf"
first="$work/demo-moe-00001-of-00002.gguf"
sock="$work/expertd.sock"
trace_dir="$(cd .. && pwd)/shared/traces"
daemon_pid=

cleanup() {
  if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then kill -TERM "$daemon_pid"; fi
}
trap cleanup EXIT

echo "== 1. forge a Mixtral-shaped model: 32 layers x 8 experts, top-2, q4_k experts, 2 shards"
"$bin/expert-forge" --layers 32 --experts 8 --top-k 2 --embd 512 --ff 1024 --heads 8 \
  --kv-heads 4 --head-dim 64 --vocab 2048 --expert-type q4_k --dense-type f16 --split 2 \
  --seed 42 -o "$model" --force

echo
echo "== 2. expertctl inspect (offline)"
"$bin/expertctl" inspect "$first"
echo "first expert slices (expertctl inspect --json | head -3):"
("$bin/expertctl" inspect --json "$first" || true) | head -n 3

echo
echo "== 3. start expertd: a 64-expert cache (a quarter of the model), every read verified"
"$bin/expertd" --model "demo=$first" --socket "$sock" --cache 56MiB --staging 8MiB \
  --no-mlock --verify 2> "$work/expertd.log" &
daemon_pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { cat "$work/expertd.log"; exit 1; }
"$bin/expertctl" status --socket "$sock"

echo
if [ -f "$trace_dir/mixtral-8x7b-humaneval1.trace.jsonl" ]; then
  trace="$trace_dir/mixtral-8x7b-humaneval1.trace.jsonl"
  echo "== 4. replay the real Mixtral-8x7B routing trace $trace"
  trace_flag=(--trace "$trace")
else
  echo "== 4. ../shared/traces is absent: replay a generated trace with realistic locality"
  trace_flag=(--tokens 64)
fi
echo "-- without prefetch:"
"$bin/expert-tune" replay --socket "$sock" --model demo --depth 0 "${trace_flag[@]}"
echo "-- with router-style prefetch 2 layers ahead:"
"$bin/expert-tune" replay --socket "$sock" --model demo --depth 2 "${trace_flag[@]}"

echo
echo "== 5. the engine: expert-run decodes with the demo model, every routed expert from expertd"
echo "   (the CUDA engine when this machine has a GPU, else the CPU reference engine; it says which)"
"$bin/expert-run" --socket "$sock" --model demo --gguf "$first" --prompt-tokens 1,2,3,4 \
  --max-tokens 8 --prefetch-depth 2 --ignore-eos
if [ -n "${trace:-}" ]; then
  echo "-- benchmark mode: the Mixtral trace's routing replayed through the engine"
  "$bin/expert-run" --socket "$sock" --model demo --gguf "$first" --prompt-tokens 1,2,3,4 \
    --max-tokens 12 --prefetch-depth 2 --routing-trace "$trace"
fi

echo
echo "== 6. stop expertd (SIGTERM drains reads in flight, then exits 0)"
kill -TERM "$daemon_pid"
wait "$daemon_pid"
daemon_pid=
tail -n 3 "$work/expertd.log"

echo
echo "== 7. a damaged copy is refused with an error naming the file, field and byte offset"
head -c 1000 "$first" > "$work/damaged.gguf"
"$bin/expertctl" inspect "$work/damaged.gguf" || echo "(exit status $?, as expected)"
echo
echo "demo files are in $work"
