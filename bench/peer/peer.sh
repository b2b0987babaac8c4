#!/usr/bin/env bash
# expertd side by side with llama.cpp at equal memory (issue 13; docs/PERFORMANCE.md, "Side by
# side with llama.cpp (bench/peer)").
#
# Usage: bench/peer/peer.sh [OPTIONS] [STEP...]
#
# Steps (default: build-start forge build-wait run table):
#   build-start   unpack llama.cpp (the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp) and start
#                 building llama-bench, CPU and/or CUDA, in the background; returns at once
#   build-wait    wait for those builds
#   forge         expert-forge the models that are not on disk yet
#   run           the benchmark runs (below), each in its own cgroup
#   table         the markdown tables from the results (OUT/table.md)
#   pack-src FILE write a trimmed tarball of llama.cpp (~7 MB) for a machine without network
#
# Each run: page cache dropped, a fresh cgroup v2 with memory.max = the cap (page cache counted,
# swap off), a wall-clock limit, and one process (or expertd and expert-run together) measuring
# prefill of PP random tokens and then decode of TG tokens:
#   expertd     expertd (cache = cap - staging - engine host memory - margin) + expert-run (GPU engine,
#               --vram-experts V, --prefill-chunk PP, temperature 1); the daemon's default
#               prefetch depth (auto)
#   expertd-d0  the same with expertd --prefetch-depth 0: no reads ahead (prefetch off), the
#               baseline that prefetch must never lose to
#   cuda-tier   llama-bench, CUDA build, -ngl 99 -ncmoe N: experts of N layers stay on the CPU
#               side; the other layers' experts in VRAM take the same bytes as expertd's VRAM tier
#   cuda-all    llama-bench, CUDA build, -ngl 99 -ncmoe <all layers>
#   cpu         llama-bench, CPU-only build
# llama-bench always gets -r 1 --no-warmup -lm mmap --repack 0 (the last two where it has them).
#
# Options:
#   --models LIST     mixtral,qwen3 (default both): Mixtral-8x7B shape (32 layers, 8 experts,
#                     top-2, 4096/14336, 28.6 GB) and Qwen3-30B-A3B shape (48 layers, 128
#                     experts, top-8, 2048/768, 18.4 GB), both forged as qwen3moe; also
#                     mixtral-llama (Mixtral-8x7B as llama.cpp's own `llama` arch with experts,
#                     28.6 GB) and ds3 (a DeepSeek-V3 slice, llama.cpp's deepseek2: 6 blocks, the
#                     first dense, 5 x 256 experts of 7168/2048, top-8 of 8 groups, 36 GB: 31.7 GB
#                     of experts); q4_k experts, f16 dense weights. The disk holds about two at once
#   --caps LIST       memory caps in GiB (default 8,16)
#   --configs LIST    expertd,expertd-d0,cuda-tier,cuda-all,cpu (default all; run in this order of
#                     priority)
#   --out DIR         results.jsonl, table.md, raw/ (default $OUT/peer, else /tmp/peer-out); runs
#                     already in DIR/results.jsonl with status ok are not run again
#   --fresh           start DIR/results.jsonl afresh
#   --quick           fewer tokens: tg 8 (pp stays 512), limits 90 s and 60 s (cpu)
#   --tg N / --pp N   decode and prefill tokens (default 16 and 512)
#   --timeout S       wall-clock limit of one run (default 150)
#   --cpu-timeout S   that of a run of the CPU-only build (default 120)
#   --budget S        start no run S seconds or more after the start (default: none), counted from
#                     $PEER_T0 (epoch seconds) when exported, so one budget spans several calls
#   --vram LIST       expertd's VRAM tier in experts per model (default mixtral=32,qwen3=256,
#                     mixtral-llama=32,ds3=256)
#   --staging MIB     expertd's staging ring (default 1024)
#   --margin MIB      host memory left in the cap for expert-run beyond its dense weights
#                     (default 1536)
#   --bin DIR         expertd, expert-run, expertctl, expert-forge (default .device/bin, else
#                     build/bin); DIR/../lib goes on LD_LIBRARY_PATH
#   --work DIR        models and llama.cpp builds ($EXPERTD_BENCH_DIR, default /var/tmp/expertd-bench)
#   --llama-src PATH  the sdist (.tar.gz), a trimmed tarball (pack-src) or a llama.cpp tree;
#                     default: WORK/llama.cpp if unpacked before, else pip download (network)
#   --builds LIST     cpu,cuda: what build-start builds (default: what --configs needs)
#   --jobs N          build jobs (default nproc); --cuda-arch A (default 90)
#   --cpu-engine      expert-run --cpu (the CPU engine; testing on a machine without a GPU)
#   --no-cgroup       run without a memory cap (testing only; results say "uncapped")
#   --tiny            forge and run small models of the same expert counts (testing the script)
#   --dry-run         print the plan and every command; run nothing
#   -h, --help        this text
#
# Expected time on the H200 machine (16 cores, ~2 GB/s disk): build ~6 min in the background
# (CUDA ~5, then CPU ~1), forge ~40 s once, then 20 runs (tg 16, pp 512): expertd's 8 (auto and
# depth 0) ~5 min (they may go while llama.cpp builds: steps build-start forge run), llama.cpp's 8
# CUDA runs ~6.5 min, its 4 CPU-only runs ~5 min; ~20 min in all. With --budget and PEER_T0 exported, the
# same command repeated resumes where the last call stopped.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//p}' "$0"; }

# --- the expertd + expert-run pair, run inside the cgroup (peer.sh __pair ...) ----------------
# __pair BIN GGUF SOCK CACHE STAGING LOG DEPTH -- EXPERT-RUN-ARGS...: expertd (--prefetch-depth
# DEPTH), then expert-run against it; stops expertd and exits with expert-run's status.
if [ "${1:-}" = __pair ]; then
  shift
  bin=$1 gguf=$2 sock=$3 cache=$4 staging=$5 log=$6 depth=$7
  shift 8
  rm -f "$sock"
  "$bin/expertd" --model "m=$gguf" --socket "$sock" --cache "$cache" --staging "$staging" \
    --queue-depth 32 --prefetch-depth "$depth" 2> "$log" &
  dpid=$!
  for _ in $(seq 1200); do
    [ -S "$sock" ] && break
    kill -0 $dpid 2> /dev/null || { echo "expertd exited: $(tail -2 "$log")" >&2; exit 98; }
    sleep 0.1
  done
  [ -S "$sock" ] || { echo "expertd: no socket after 120 s" >&2; kill -KILL $dpid; exit 98; }
  rc=0
  "$bin/expert-run" --socket "$sock" --model m "$@" || rc=$?
  kill -TERM $dpid 2> /dev/null || true
  wait $dpid || true
  exit $rc
fi

# --- options ----------------------------------------------------------------------------------
models=mixtral,qwen3
caps=8,16
configs=expertd,expertd-d0,cuda-tier,cuda-all,cpu
out=${OUT:+$OUT/peer}
out=${out:-/tmp/peer-out}
fresh=0 quick=0 tg="" pp="" timeout="" cpu_timeout="" budget=0 staging=1024 margin=1536
vram_list="mixtral=32,qwen3=256"
bin="" work=${EXPERTD_BENCH_DIR:-/var/tmp/expertd-bench} llama_src="" builds="" jobs=$(nproc)
cuda_arch=90 cpu_engine=0 no_cgroup=0 tiny=0 dry=0
steps=() pack_out=""
need() { [ $# -ge 2 ] && [ -n "$2" ] || { echo "peer.sh: $1 needs a value (see --help)" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --models) need "$@"; models=$2; shift ;;
    --caps) need "$@"; caps=$2; shift ;;
    --configs) need "$@"; configs=$2; shift ;;
    --out) need "$@"; out=$2; shift ;;
    --fresh) fresh=1 ;;
    --quick) quick=1 ;;
    --tg) need "$@"; tg=$2; shift ;;
    --pp) need "$@"; pp=$2; shift ;;
    --timeout) need "$@"; timeout=$2; shift ;;
    --cpu-timeout) need "$@"; cpu_timeout=$2; shift ;;
    --budget) need "$@"; budget=$2; shift ;;
    --vram) need "$@"; vram_list=$2; shift ;;
    --staging) need "$@"; staging=$2; shift ;;
    --margin) need "$@"; margin=$2; shift ;;
    --bin) need "$@"; bin=$2; shift ;;
    --work) need "$@"; work=$2; shift ;;
    --llama-src) need "$@"; llama_src=$2; shift ;;
    --builds) need "$@"; builds=$2; shift ;;
    --jobs) need "$@"; jobs=$2; shift ;;
    --cuda-arch) need "$@"; cuda_arch=$2; shift ;;
    --cpu-engine) cpu_engine=1 ;;
    --no-cgroup) no_cgroup=1 ;;
    --tiny) tiny=1 ;;
    --dry-run) dry=1 ;;
    build-start | build-wait | forge | run | table) steps+=("$1") ;;
    pack-src) need "$@"; steps+=(pack-src); pack_out=$2; shift ;;
    *) echo "peer.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#steps[@]} -gt 0 ] || steps=(build-start forge build-wait run table)
if [ $quick = 1 ]; then
  tg=${tg:-8} timeout=${timeout:-90} cpu_timeout=${cpu_timeout:-60}
fi
tg=${tg:-16} pp=${pp:-512} timeout=${timeout:-150} cpu_timeout=${cpu_timeout:-120}

bad() { echo "peer.sh: $*" >&2; exit 2; }
is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }
for v in tg pp timeout cpu_timeout budget staging margin jobs cuda_arch; do
  is_uint "${!v}" || bad "--${v//_/-} '${!v}' is not a whole number"
done
[ "$tg" -ge 1 ] && [ "$pp" -ge 1 ] || bad "--tg and --pp must be at least 1"
IFS=, read -ra model_list <<< "$models"
IFS=, read -ra cap_list <<< "$caps"
IFS=, read -ra config_list <<< "$configs"
[ ${#model_list[@]} -gt 0 ] && [ ${#cap_list[@]} -gt 0 ] && [ ${#config_list[@]} -gt 0 ] ||
  bad "--models, --caps and --configs need at least one entry"
for m in "${model_list[@]}"; do
  case $m in mixtral | qwen3 | mixtral-llama | ds3) ;;
    *) bad "--models: '$m' is not mixtral, qwen3, mixtral-llama or ds3" ;;
  esac
done
for c in "${cap_list[@]}"; do
  is_uint "$c" && [ "$c" -ge 1 ] || bad "--caps: '$c' is not a size in GiB (a whole number >= 1)"
done
for c in "${config_list[@]}"; do
  case $c in expertd | expertd-d0 | cuda-tier | cuda-all | cpu) ;;
    *) bad "--configs: '$c' is not expertd, expertd-d0, cuda-tier, cuda-all or cpu" ;;
  esac
done
declare -A vram
for kv in ${vram_list//,/ }; do
  [[ $kv =~ ^(mixtral|qwen3|mixtral-llama|ds3)=([0-9]+)$ ]] ||
    bad "--vram: '$kv' is not MODEL=N (MODEL: mixtral, qwen3, mixtral-llama or ds3)"
  vram[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}
done
if [ -z "$builds" ]; then
  for c in "${config_list[@]}"; do
    case $c in
      cpu) [[ $builds == *cpu* ]] || builds+=${builds:+,}cpu ;;
      cuda-*) [[ $builds == *cuda* ]] || builds="cuda${builds:+,}$builds" ;;
    esac
  done
fi
for k in ${builds//,/ }; do
  case $k in cpu | cuda) ;; *) bad "--builds: '$k' is not cpu or cuda" ;; esac
done
if [ -z "$bin" ]; then
  bin=$root/.device/bin
  [ -x "$bin/expertd" ] || bin=$root/build/bin
fi
export LD_LIBRARY_PATH=$bin/../lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
llroot=$work/llama-build
llsrc=$work/llama.cpp

# --- models -----------------------------------------------------------------------------------
# Sets the shape of model $1: layers, experts, top-k, widths, heads, vocab, seed, file, the
# forge's arch and extra flags, the leading dense layers D (no routed experts), and the bytes of
# one q4_k expert (gate, up and down: 3 x embd x ff elements at 144 bytes per 256).
shape() {
  local name=$1
  ARCH=qwen3moe D=0 XF=()
  case $name:$tiny in
    mixtral-llama:0) L=32 E=8 K=2 EMBD=4096 FF=14336 HEADS=32 KV=8 HD=128 VOCAB=32000 SEED=9
      ARCH=mixtral file=$work/mixtral-llama-q4k.gguf ;;
    ds3:0) L=6 E=256 K=8 EMBD=7168 FF=2048 HEADS=128 KV=1 HD=128 VOCAB=32000 SEED=31
      ARCH=deepseek3 D=1 XF=(--dense-layers 1) file=$work/ds3-slice-q4k.gguf ;;
    mixtral-llama:1) L=4 E=8 K=2 EMBD=256 FF=512 HEADS=4 KV=2 HD=64 VOCAB=1024 SEED=9
      ARCH=mixtral file=$work/mixtral-llama-tiny-q4k.gguf ;;
    ds3:1) L=3 E=32 K=4 EMBD=256 FF=256 HEADS=4 KV=1 HD=64 VOCAB=1024 SEED=31
      ARCH=deepseek3 D=1 file=$work/ds3-tiny-q4k.gguf
      XF=(--dense-layers 1 --dense-ff 512 --q-lora-rank 64 --kv-lora-rank 64 --rope-dim 32
        --v-head-dim 64 --expert-groups 4 --groups-used 2) ;;
    mixtral:0) L=32 E=8 K=2 EMBD=4096 FF=14336 HEADS=32 KV=8 HD=128 VOCAB=32000 SEED=8
      file=$work/mixtral-q4k.gguf ;;  # the file of scripts/device-engine-bench.sh forge
    qwen3:0) L=48 E=128 K=8 EMBD=2048 FF=768 HEADS=32 KV=4 HD=128 VOCAB=32000 SEED=30
      file=$work/qwen3-30b-a3b-q4k.gguf ;;
    mixtral:1) L=4 E=8 K=2 EMBD=256 FF=512 HEADS=4 KV=2 HD=64 VOCAB=1024 SEED=8
      file=$work/mixtral-tiny-q4k.gguf ;;
    qwen3:1) L=6 E=128 K=8 EMBD=256 FF=256 HEADS=4 KV=2 HD=64 VOCAB=1024 SEED=30
      file=$work/qwen3-tiny-q4k.gguf ;;
  esac
  EB=$((3 * EMBD * FF * 144 / 256))
  ML=$((L - D))  # blocks with routed experts
  V=${vram[$name]:-$([[ $name == mixtral* ]] && echo 32 || echo 256)}
}

forge_cmd() {  # sets fcmd
  fcmd=("$bin/expert-forge" --arch "$ARCH" --layers "$L" --experts "$E" --top-k "$K" --embd "$EMBD"
    --ff "$FF" --heads "$HEADS" --kv-heads "$KV" --head-dim "$HD" --vocab "$VOCAB"
    --expert-type q4_k --dense-type f16 --seed "$SEED" --threads "$(nproc)" "${XF[@]}" -o "$file"
    --force)
}

# Dense bytes (everything but the routed experts): from the file when it exists, else estimated
# from the shape (f16 attention, embeddings and head; f32 router and norms).
dense_bytes() {
  if [ -f "$file" ]; then
    echo $(($(stat -c %s "$file") - ML * E * EB))
  else
    local q=$((HEADS * HD)) kv=$((KV * HD))
    echo $((L * (EMBD * (2 * q + 2 * kv) * 2 + EMBD * E * 4) + 2 * VOCAB * EMBD * 2))
  fi
}

# --- runs -------------------------------------------------------------------------------------
mib=$((1 << 20))
gib=$((1 << 30))
results=$out/results.jsonl
prompt_ids() {  # PP pseudo-random ids in [100, min(vocab - 100, 31900)), comma-separated
  local hi=$((VOCAB - 100 < 31900 ? VOCAB - 100 : 31900))
  awk -v n="$1" -v hi=$hi 'BEGIN { srand(12); for (i = 0; i < n; ++i)
    printf "%s%d", (i ? "," : ""), 100 + int(rand() * (hi - 100)) }'
}

llama_flags=()
llama_help_checked=""
# -lm mmap and --repack 0 where this llama-bench has them (older builds have --mmap and no repack).
llama_mem_flags() {  # BIN
  if [ "$llama_help_checked" != "$1" ]; then
    local help
    help=$("$1" --help 2>&1 || true)
    llama_flags=()
    if grep -q -- '--load-mode' <<< "$help"; then llama_flags+=(-lm mmap); else llama_flags+=(-mmp 1); fi
    grep -q -- '--repack' <<< "$help" && llama_flags+=(--repack 0)
    llama_help_checked=$1
  fi
}

# Prints the plan lines "model cap config" in order: expertd's runs first (a few minutes, needing
# no llama.cpp build, so they can go while it builds), then llama.cpp's CUDA configs model by model
# and cap by cap, and its CPU-only build last (the slowest, the one most likely to time out).
selected() { [[ ",$configs," == *",$1,"* ]]; }
plan() {
  local c m cap
  # Prefetch on and off side by side for each model and cap, so that both see the same
  # conditions (a llama.cpp build beside them or not).
  for m in "${model_list[@]}"; do
    for cap in "${cap_list[@]}"; do
      for c in expertd expertd-d0; do
        if selected $c; then echo "$m $cap $c"; fi
      done
    done
  done
  for m in "${model_list[@]}"; do
    for cap in "${cap_list[@]}"; do
      for c in cuda-tier cuda-all; do
        if selected $c; then echo "$m $cap $c"; fi
      done
    done
  done
  if selected cpu; then
    for m in "${model_list[@]}"; do for cap in "${cap_list[@]}"; do echo "$m $cap cpu"; done; done
  fi
}

already_done() {  # ID: a result with status ok for this run and these token counts
  [ -f "$results" ] && python3 "$here/summarize.py" is-done "$results" "$1" "$tg" "$pp"
}

run_one() {  # MODEL CAP CONFIG INDEX COUNT
  local m=$1 cap=$2 c=$3 idx=$4 count=$5
  shape "$m"
  local id="$m-${cap}g-$c" capb=$((cap * gib)) dense eng_config=$c tool=llama.cpp cmd=() what
  [ "$c" = expertd ] && [ $cpu_engine = 1 ] && eng_config=expertd-cpu
  [ "$c" = expertd-d0 ] && [ $cpu_engine = 1 ] && eng_config=expertd-cpu-d0
  id="$m-${cap}g-$eng_config"
  dense=$(dense_bytes)
  local cgcap=$capb
  [ $no_cgroup = 1 ] && cgcap=none
  local raw=$out/raw/$id fields=()
  fields=(--field "model=$m" --field "cap_gib=$cap" --field "config=$eng_config"
    --field "model_file=$file" --field "layers=$L" --field "experts=$E" --field "top_k=$K"
    --field "expert_bytes=$EB" --field "dense_bytes=$dense" --field "tg_tokens=$tg"
    --field "pp_tokens=$pp" --field "uncapped=$no_cgroup")
  case $c in
    expertd | expertd-d0)
      tool=expertd
      local depth=auto
      [ "$c" = expertd ] || depth=0
      # The CUDA engine reads each dense matrix from the file as it uploads it (DenseLoad::Deferred):
      # its host peak is the largest one, the embeddings, as read and as f32. The CPU engine holds
      # them all.
      local host=$((VOCAB * EMBD * 6))
      [ $cpu_engine = 1 ] && host=$dense
      local cache=$(((capb - staging * mib - host - margin * mib) / mib))
      [ "$cache" -gt 0 ] || {
        peer_log "run $idx/$count $id: skipped: a $cap GiB cap leaves no cache after" \
          "$((staging)) MiB staging, $((host / mib)) MiB of the engine's and $margin MiB margin"
        return 0
      }
      local vflag=(--vram-experts "$V")
      [ $cpu_engine = 1 ] && vflag=(--cpu)
      cmd=("$here/peer.sh" __pair "$bin" "$file" "$work/peer-expertd.sock" "${cache}MiB"
        "${staging}MiB" "$raw.expertd.log" "$depth" -- --prompt-tokens "$(prompt_ids "$pp")"
        --max-tokens $((tg + 1)) "${vflag[@]}" --prefill-chunk "$pp" --temperature 1 --seed 1
        --ignore-eos --json)
      what="expertd cache ${cache} MiB, staging $staging MiB, $([ $cpu_engine = 1 ] && echo "CPU engine" || echo "VRAM tier $V experts")"
      what+=", daemon prefetch depth $depth"
      fields+=(--field "cache_mib=$cache" --field "staging_mib=$staging" --field "daemon_depth=$depth")
      [ $cpu_engine = 1 ] || fields+=(--field "vram_experts=$V")
      ;;
    cuda-tier | cuda-all | cpu)
      local kind=cuda ncmoe=$L
      [ "$c" = cpu ] && kind=cpu
      if [ "$c" = cuda-tier ]; then
        ncmoe=$((L - V / E))
        [ "$ncmoe" -ge 0 ] || ncmoe=0
      fi
      local llbin
      llbin=$(peer_llama_bin "$llroot" $kind)
      if [ $dry = 1 ]; then
        llama_flags=(-lm mmap --repack 0)
      else
        if peer_llama_building "$llroot"; then
          peer_log "run $idx/$count $id: waiting for the llama.cpp build to finish first"
          peer_llama_build_idle "$llroot" 900
        fi
        [ -x "$llbin" ] || { peer_log "run $idx/$count $id: skipped: no $llbin (build-start, build-wait)"; return 0; }
        llama_mem_flags "$llbin"
      fi
      cmd=("$llbin" -m "$file" -p "$pp" -n "$tg" -r 1 --no-warmup "${llama_flags[@]}" -o jsonl)
      if [ "$c" = cpu ]; then
        what="llama.cpp CPU-only build"
      else
        cmd+=(-ngl 99 -ncmoe "$ncmoe")
        what="llama.cpp CUDA -ngl 99 -ncmoe $ncmoe ($(((L - ncmoe) * E)) experts in VRAM)"
        fields+=(--field "ncmoe=$ncmoe" --field "vram_experts=$(((L - ncmoe) * E))")
      fi
      ;;
  esac
  fields+=(--field "tool=$tool" --field "id=$id")
  # The command as shown and recorded: the prompt's ids as where they come from.
  local shown=("${cmd[@]/#[0-9]*,[0-9]*,*/<$pp ids, awk srand(12)>}")
  if [ $dry = 1 ]; then
    echo "run $idx/$count $id: $what; memory.max $cgcap, limit $([ "$c" = cpu ] && echo "$cpu_timeout" || echo "$timeout") s:"
    echo "  ${shown[*]}"
    return 0
  fi
  if already_done "$id"; then
    peer_log "run $idx/$count $id: in $results already (--fresh to redo)"
    return 0
  fi
  local limit=$timeout
  [ "$c" != cpu ] || limit=$cpu_timeout
  local left=$limit
  if [ "$budget" -gt 0 ]; then
    left=$((budget - ($(date +%s) - PEER_T0)))
    if [ $left -lt 30 ]; then
      peer_log "run $idx/$count $id: skipped: the --budget of ${budget}s is spent"
      return 0
    fi
    [ $left -lt "$limit" ] || left=$limit
  fi
  [ -f "$file" ] || { peer_log "run $idx/$count $id: skipped: no $file (forge)"; return 0; }
  # A build competes for the cores: llama.cpp's runs wait for it (above); expertd's note it.
  local building=0
  if peer_llama_building "$llroot"; then
    building=1
    peer_log "run $idx/$count $id: note: a llama.cpp build is running beside this run"
  fi
  fields+=(--field "build_running=$building")
  local dropped=1
  peer_drop_caches || dropped=0
  peer_log "run $idx/$count $id: $what; cap $cap GiB, limit ${left}s"
  local rc=0
  peer_in_cgroup "$cgcap" "$left" "$raw.stats" "${cmd[@]}" > "$raw.out" 2> "$raw.err" || rc=$?
  local line
  line=$(python3 "$here/summarize.py" record --raw "$raw.out" --stats "$raw.stats" \
    --kind "$tool" "${fields[@]}" --field "caches_dropped=$dropped" \
    --field "command=${shown[*]}") || peer_die "summarize.py record failed on $raw.out"
  echo "$line" >> "$results"
  peer_log "run $idx/$count $id: $(python3 "$here/summarize.py" brief <<< "$line")"
  [ $rc = 0 ] || tail -3 "$raw.err" | sed 's/^/    /' >&2
}

# --- steps ------------------------------------------------------------------------------------
step_pack_src() {
  local src=$llama_src
  [ -n "$src" ] || src=$(peer_llama_download "$work/sdist")
  if [ $dry = 1 ]; then echo "pack-src: $src -> $pack_out"; return; fi
  peer_llama_pack "$src" "$pack_out"
}

step_build_start() {
  if [ $dry = 1 ]; then
    echo "build-start: unpack ${llama_src:-<pip download llama-cpp-python==$PEER_LLAMA_SDIST_VERSION>} to $llsrc; build llama-bench ($builds) in $llroot/{${builds}} with -j $jobs in the background"
    return
  fi
  [ -n "$builds" ] || { peer_log "build-start: no llama.cpp config selected"; return; }
  if [ -n "$llama_src" ]; then
    if [ "$(cat "$llsrc/.peer-source" 2> /dev/null)" != "$llama_src" ]; then
      peer_log "build-start: unpacking $llama_src into $llsrc"
      peer_llama_unpack "$llama_src" "$llsrc"
      echo "$llama_src" > "$llsrc/.peer-source"
      rm -rf "$llroot"
    fi
  elif [ ! -f "$llsrc/CMakeLists.txt" ]; then
    local sd
    sd=$(peer_llama_download "$work/sdist")
    peer_llama_unpack "$sd" "$llsrc"
    echo "$sd" > "$llsrc/.peer-source"
  fi
  peer_llama_build_start "$llsrc" "$llroot" "$builds" "$jobs" "$cuda_arch"
}

step_build_wait() {
  if [ $dry = 1 ]; then echo "build-wait: $builds (at most 900 s)"; return; fi
  [ -n "$builds" ] || return 0
  peer_llama_build_wait "$llroot" "$builds" 900
}

step_forge() {
  local m
  for m in "${model_list[@]}"; do
    shape "$m"
    forge_cmd
    if [ $dry = 1 ]; then echo "forge $m (unless present): ${fcmd[*]}"; continue; fi
    if [ -f "$file" ]; then
      peer_log "forge $m: $file exists ($(($(stat -c %s "$file") / mib)) MiB)"
      continue
    fi
    [ -x "$bin/expert-forge" ] || peer_die "no $bin/expert-forge (--bin)"
    mkdir -p "$work"
    local need=$(((ML * E * EB + $(dense_bytes)) / mib + 1024)) free
    free=$(($(df -Pk "$work" | awk 'NR == 2 { print $4 }') / 1024))
    [ "$free" -ge "$need" ] || peer_die "forge $m: $work has $free MiB free, $need MiB needed"
    peer_log "forge $m: $L layers x $E experts (top-$K, $EMBD/$FF) -> $file"
    "${fcmd[@]}" > "$work/forge-$m.log" 2>&1 || { tail -5 "$work/forge-$m.log" >&2; peer_die "forge $m failed"; }
    peer_log "forge $m: $(tail -1 "$work/forge-$m.log")"
  done
}

step_run() {
  if [ $dry = 0 ]; then
    command -v python3 > /dev/null || peer_die "python3 is needed to read the tools' output"
    if [ $no_cgroup = 0 ]; then
      local why
      why=$(peer_cgroup_check 2>&1) || peer_die "memory cap: $why. (--no-cgroup runs uncapped, for testing only.)"
    fi
    [ -x "$bin/expertd" ] || [[ " ${config_list[*]} " != *" expertd "* ]] || peer_die "no $bin/expertd (--bin)"
    mkdir -p "$out/raw"
    [ $fresh = 0 ] || : > "$results"
    peer_drop_caches || peer_log "warning: cannot drop the page cache (/proc/sys/vm/drop_caches): runs start warm"
  fi
  local lines count i=0
  lines=$(plan)
  count=$(wc -l <<< "$lines")
  [ $dry = 0 ] || echo "run: $count runs, tg $tg, pp $pp, results in $results"
  while read -r m cap c; do
    i=$((i + 1))
    run_one "$m" "$cap" "$c" $i "$count"
  done <<< "$lines"
}

step_table() {
  if [ $dry = 1 ]; then echo "table: $out/table.md from $results"; return; fi
  [ -f "$results" ] || { peer_log "table: no $results yet"; return; }
  python3 "$here/summarize.py" table "$results" > "$out/table.md"
  peer_log "table: $out/table.md"
  cat "$out/table.md"
}

for s in "${steps[@]}"; do
  case $s in
    pack-src) step_pack_src ;;
    build-start) step_build_start ;;
    build-wait) step_build_wait ;;
    forge) step_forge ;;
    run) step_run ;;
    table) step_table ;;
  esac
done
