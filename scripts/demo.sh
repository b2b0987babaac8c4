#!/usr/bin/env bash
# The expertd demo: forge a synthetic Qwen3-MoE GGUF model and inspect its expert slice map.
# Later stages (the daemon, a trace-replaying client, the engine) join this script as they land.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=build/bin
work=${EXPERTD_DEMO_DIR:-$(mktemp -d /tmp/expertd-demo.XXXXXX)}
mkdir -p "$work"
model="$work/demo-moe.gguf"

echo "== 1. forge a 4-layer, 16-expert, top-4 Qwen3-MoE model with q4_k experts, in 2 shards"
"$bin/expert-forge" --layers 4 --experts 16 --top-k 4 --embd 512 --ff 768 --heads 8 --kv-heads 4 \
  --head-dim 64 --vocab 2048 --expert-type q4_k --dense-type f16 --split 2 --seed 42 \
  -o "$model" --force

first="$work/demo-moe-00001-of-00002.gguf"
echo
echo "== 2. expertctl inspect (offline summary)"
"$bin/expertctl" inspect "$first"

echo
echo "== 3. the first expert slices as JSON Lines (expertctl inspect --json | head -6)"
"$bin/expertctl" inspect --json "$first" | head -n 6

echo
echo "== 4. a damaged copy is refused with an error naming the file, field and byte offset"
bad="$work/damaged.gguf"
head -c 1000 "$first" > "$bad"
"$bin/expertctl" inspect "$bad" || echo "(exit status $?, as expected)"
echo
echo "demo files are in $work"
