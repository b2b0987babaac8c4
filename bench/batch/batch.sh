#!/usr/bin/env bash
# Sequences decoded together against one alone, out of core (issue 25; docs/PERFORMANCE.md
# "Sequences decoded together"): expertd and `expert-run --batch-prompts` inside one cgroup v2
# memory cap, for N = 1, 2, 4, 8 streams of uniform random ids (glibc rand() % vocabulary, a seed
# per stream, as llama-bench's tg draws them). Each stream prefills its own short prompt of random
# ids, then is fed its ids through the decode path, all streams one step at a time together. The
# figure is tokens/s of all streams together over the one-stream run's, beside MB read per token.
#
# Usage: bench/batch/batch.sh [OPTIONS]
#   --models LIST   mixtral,qwen3 (default both): bench/peer/peer.sh's forged shapes (forged by
#                   its forge step when missing, into --work)
#   --cap GIB       the memory cap (default 16)
#   --streams LIST  the N of each run (default 1,2,4,8)
#   --tg N          ids fed to each stream (default 24); --pp N prompt ids per stream (default 16)
#   --out DIR       results.jsonl, table.md, raw/ (default $OUT/batch, else /tmp/batch-out)
#   --bin DIR       expertd and expert-run (default .device/bin, else build/bin)
#   --work DIR      the models (default /var/tmp/expertd-bench, as peer.sh)
#   --timeout S     one run's wall-clock limit (default 150)
#   --cpu-engine    expert-run --cpu (testing without a GPU); --no-cgroup (testing only)
#   --tiny          peer.sh's tiny forges (testing the script)
#   -h, --help      this text
# The cache is peer.sh's: cap - 1 GiB staging - the engine's host peak (the embeddings as read and
# as f32) - 1.5 GiB margin; the VRAM tier peer.sh's (Mixtral 32 experts, Qwen3 256).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=../peer/lib.sh
. "$root/bench/peer/lib.sh"
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//p}' "$0"; }

models=mixtral,qwen3 cap=16 streams=1,2,4,8 tg=24 pp=16 out="" bin="" timeout=150
work=${EXPERTD_BENCH_DIR:-/var/tmp/expertd-bench} cpu_engine=0 no_cgroup=0 tiny=0
need() { [ $# -ge 2 ] && [ -n "$2" ] || { echo "batch.sh: $1 needs a value (see --help)" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --models) need "$@"; models=$2; shift ;;
    --cap) need "$@"; cap=$2; shift ;;
    --streams) need "$@"; streams=$2; shift ;;
    --tg) need "$@"; tg=$2; shift ;;
    --pp) need "$@"; pp=$2; shift ;;
    --out) need "$@"; out=$2; shift ;;
    --bin) need "$@"; bin=$2; shift ;;
    --work) need "$@"; work=$2; shift ;;
    --timeout) need "$@"; timeout=$2; shift ;;
    --cpu-engine) cpu_engine=1 ;;
    --no-cgroup) no_cgroup=1 ;;
    --tiny) tiny=1 ;;
    *) echo "batch.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
for v in "$cap" "$tg" "$pp" "$timeout"; do
  [[ $v =~ ^[1-9][0-9]*$ ]] || { echo "batch.sh: '$v' is not a positive whole number" >&2; exit 2; }
done
IFS=, read -ra ns <<< "$streams"
for n in "${ns[@]}"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] && [ "$n" -le 64 ] ||
    { echo "batch.sh: --streams: '$n' is not 1..64" >&2; exit 2; }
done
if [ -z "$bin" ]; then
  bin=$root/.device/bin
  [ -x "$bin/expert-run" ] || bin=$root/build/bin
fi
for b in expertd expert-run; do
  [ -x "$bin/$b" ] || { echo "batch.sh: no $bin/$b (--bin)" >&2; exit 2; }
done
export LD_LIBRARY_PATH=$bin/../lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
out=${out:-${OUT:+$OUT/batch}}
out=${out:-/tmp/batch-out}
mkdir -p "$out/raw" "$work"
results=$out/results.jsonl
cgcap=none
if [ $no_cgroup = 0 ]; then
  peer_cgroup_check || peer_die "no memory cap possible (--no-cgroup runs without, for testing)"
fi
mib=$((1 << 20))

peer_args=(--work "$work" --bin "$bin" --out "$out/peer")
[ $tiny = 1 ] && peer_args+=(--tiny)
IFS=, read -ra model_list <<< "$models"
for m in "${model_list[@]}"; do
  case $m in
    mixtral) file=mixtral-q4k.gguf vram=32 embd=4096 ;;
    qwen3) file=qwen3-30b-a3b-q4k.gguf vram=256 embd=2048 ;;
    *) peer_die "--models: '$m' is not mixtral or qwen3" ;;
  esac
  [ $tiny = 0 ] || file=$m-tiny-q4k.gguf
  gguf=$work/$file
  [ -f "$gguf" ] || "$root/bench/peer/peer.sh" "${peer_args[@]}" --cells "$m:$cap" forge >&2
  [ -f "$gguf" ] || peer_die "forge did not write $gguf"
  host=$((32000 * embd * 6))
  cache=$(((cap * (1 << 30) - 1024 * mib - host - 1536 * mib) / mib))
  [ $tiny = 0 ] || cache=64
  for n in "${ns[@]}"; do
    id=$m-${cap}g-n$n
    raw=$out/raw/$id
    prompts=$raw.prompts
    : > "$prompts"
    for s in $(seq 1 "$n"); do echo "random:$pp:$((100 + s)) | random:$tg:$s" >> "$prompts"; done
    eflags=(--vram-experts "$vram")
    [ $cpu_engine = 1 ] && eflags=(--cpu)
    cmd=("$root/bench/peer/peer.sh" __pair "$bin" "$gguf" "$work/batch-expertd.sock" "${cache}MiB"
      1024MiB "$raw.expertd.log" auto -- --batch-prompts "$prompts" "${eflags[@]}" --json)
    [ $no_cgroup = 1 ] || cgcap=$((cap * (1 << 30)))
    peer_drop_caches || true
    peer_log "run $id: $n stream(s) of $tg random ids after $pp prompt ids, cache $cache MiB, cap $cap GiB"
    rc=0
    peer_in_cgroup "$cgcap" "$timeout" "$raw.stats" "${cmd[@]}" > "$raw.out" 2> "$raw.err" || rc=$?
    line=$(grep '^{' "$raw.out" | tail -1 || true)
    if [ $rc != 0 ] || [ -z "$line" ]; then
      peer_log "run $id: failed (rc $rc): $(tail -2 "$raw.err" | tr '\n' ' ')"
      line='{}'
    fi
    python3 - "$line" "$id" "$m" "$n" "$cap" "$cache" "$rc" "$raw.stats" >> "$results" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
stats = {}
for l in open(sys.argv[8]):
    k, _, v = l.strip().partition(" ")
    stats[k] = v
r.update(id=sys.argv[2], model=sys.argv[3], streams=int(sys.argv[4]), cap_gib=int(sys.argv[5]),
         cache_mib=int(sys.argv[6]), status="ok" if sys.argv[7] == "0" and "tokens_per_s" in r
         else "failed", wall_s=float(stats.get("wall_s", 0)), peak=int(stats.get("peak", -1)))
r.pop("prompt_tokens", None); r.pop("generated", None)
print(json.dumps(r))
PY
    peer_log "run $id: $(python3 -c 'import json, sys
r = json.loads(sys.argv[1])
print("%.2f tokens/s together, %.1f MB/token, %.1f experts/step, %s" % (r.get("tokens_per_s", 0),
      r.get("bytes_read_per_token", 0) / 1e6, r.get("experts_per_step", 0), r["status"]))' \
      "$(tail -1 "$results")")"
  done
done
python3 - "$results" > "$out/table.md" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| model | cap | streams | tokens/s together | vs 1 stream | MB read / token | experts / step | stall s | status |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
base = {}
for r in rows:
    if r["streams"] == 1 and r["status"] == "ok": base[(r["model"], r["cap_gib"])] = r["tokens_per_s"]
for r in rows:
    b = base.get((r["model"], r["cap_gib"]))
    t = r.get("tokens_per_s", 0)
    ratio = f"{t / b:.2f}x" if b and r["status"] == "ok" else "-"
    print(f"| {r['model']} | {r['cap_gib']} GiB | {r['streams']} | {t:.2f} | {ratio} | "
          f"{r.get('bytes_read_per_token', 0) / 1e6:.1f} | {r.get('experts_per_step', 0):.1f} | "
          f"{r.get('stall_s', 0):.2f} | {r['status']} |")
PY
cat "$out/table.md"
