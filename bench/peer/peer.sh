#!/usr/bin/env bash
# expertd side by side with llama.cpp at equal memory, both fed the same token ids (issues 13, 23;
# docs/PERFORMANCE.md, "Side by side with llama.cpp (bench/peer)").
#
# Usage: bench/peer/peer.sh [OPTIONS] [STEP...]
#
# Steps (default: build-start forge streams build-wait disk ipc run table):
#   build-start   unpack llama.cpp (the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp) and start
#                 building llama-bench and llama-feed (bench/peer/llama_feed.cpp against that
#                 build's libllama), CPU and/or CUDA, in the background; returns at once
#   build-wait    wait for those builds
#   forge         expert-forge the models that are not on disk yet
#   streams       the token ids both engines are fed, per vocabulary size V, in OUT/streams/:
#                 prompt-V.ids (PP ids, awk srand(12), the prefill of every config),
#                 random-V.ids (TG ids: glibc rand() % V after srand(--seed), as llama-bench's tg
#                 draws them) and text-V.ids (the first TG ids of docs/ARCHITECTURE.md followed by
#                 engine/engine.h, English then C++, encoded by `expertctl tokenize` with
#                 --tokenizer); README says what each file is
#   disk          the disk's O_DIRECT read rate, once (expert-bench storage on the first model's
#                 file, caches dropped, ~20 s) -> OUT/disk.json, for the disk-bound fraction
#   ipc           five shared-memory round trips against RPC (expert-bench ipc) -> OUT/ipc.jsonl
#   run           the benchmark runs (below), each in its own cgroup
#   table         the markdown tables from the results (OUT/table.md)
#   pack-src FILE write a trimmed tarball of llama.cpp (~8 MB, with the LLaMA SentencePiece vocab
#                 the text stream uses) for a machine without network
#
# Each run: page cache dropped, a fresh cgroup v2 with memory.max = the cap (page cache counted,
# swap off), a wall-clock limit, and one process (or expertd and expert-run together): prefill of
# the PP prompt ids, then, from an empty context, decode of the TG ids of a stream (random or
# text), one position at a time. Configs:
#   expertd         expertd (cache = cap - staging - engine host memory - margin) + expert-run (GPU
#                   engine, --vram-experts V, --prefill-chunk PP, --feed-tokens STREAM); the
#                   daemon's default prefetch depth (auto)
#   feed-cuda-tier  llama-feed, CUDA build, -ngl 99 -ncmoe N: experts of N layers stay on the CPU
#                   side; the other layers' experts in VRAM take the same bytes as expertd's tier
#   cuda-tier       llama-bench, CUDA build, the same -ncmoe: llama.cpp's own pp/tg (tg of ids it
#                   draws itself: a second llama.cpp figure, once per model and cap, no stream)
# and, optional (--configs):
#   expertd-d0      expertd with --prefetch-depth 0 (prefetch off): the baseline prefetch must
#                   never lose to
#   feed-cuda-all   llama-feed, CUDA build, -ngl 99 -ncmoe <all layers>
#   feed-cpu        llama-feed, CPU-only build
#   cuda-all, cpu   llama-bench, the same two builds
#   sampled         the old expert-run decode of its own samples (temperature 1, --max-tokens TG+1):
#                   sampled decode, NOT comparable (forged weights loop over a few tokens and stay
#                   in cache); once per model and cap, never in a ratio
# llama-bench gets -r 1 --no-warmup -lm mmap --repack 0 (the last two where it has them);
# llama-feed gets -lm mmap (its repack is off unless asked). Fed runs are MODEL-CAPg-CONFIG-STREAM.
#
# Options:
#   --models LIST     mixtral,qwen3 (default both): Mixtral-8x7B shape (32 layers, 8 experts,
#                     top-2, 4096/14336, 28.6 GB) and Qwen3-30B-A3B shape (48 layers, 128
#                     experts, top-8, 2048/768, 18.4 GB), both forged as qwen3moe; also
#                     mixtral-llama (Mixtral-8x7B as llama.cpp's own `llama` arch with experts,
#                     28.6 GB) and ds3 (a DeepSeek-V3 slice, llama.cpp's deepseek2: 6 blocks, the
#                     first dense, 5 x 256 experts of 7168/2048, top-8 of 8 groups, 36 GB: 31.7 GB
#                     of experts); q4_k experts, f16 dense weights. The disk holds about two at once
#   --caps LIST       memory caps in GiB (default 8,16), for every model
#   --cells LIST      MODEL:CAP pairs instead of --models x --caps, e.g. mixtral:8,mixtral:16,qwen3:8
#   --configs LIST    of expertd,expertd-d0,feed-cuda-tier,feed-cuda-all,feed-cpu,cuda-tier,
#                     cuda-all,cpu,sampled (default expertd,feed-cuda-tier,cuda-tier: the fair
#                     table; the others are optional)
#   --streams LIST    random,text (default both): the decode streams of the fed configs
#   --seed N          srand seed of the random stream (default 1: glibc's unseeded sequence,
#                     llama-bench's)
#   --tokenizer GGUF  the text stream's tokenizer (default: llama.cpp's
#                     models/ggml-vocab-llama-spm.gguf, LLaMA's SentencePiece of 32000 tokens,
#                     the vocabulary size of every full-size shape, in WORK/llama.cpp; else
#                     tests/fixtures/tokenizers/mixtral.gguf, a 1459-token test tokenizer, with a
#                     warning). Ids at or above a model's vocabulary are taken modulo its size
#   --out DIR         results.jsonl, table.md, streams/, disk.json, raw/ (default $OUT/peer, else
#                     /tmp/peer-out); runs already in DIR/results.jsonl with status ok are not run
#                     again
#   --fresh           start DIR/results.jsonl afresh
#   --quick           fewer tokens: tg 8 (pp stays 512), limits 90 s and 60 s (cpu)
#   --tg N / --pp N   decode and prefill tokens (default 16 and 512); TG is each stream's length
#   --timeout S       wall-clock limit of one run (default 150)
#   --cpu-timeout S   that of a run of the CPU-only build (default 120)
#   --budget S        start no run S seconds or more after the start (default: none), counted from
#                     $PEER_T0 (epoch seconds) when exported, so one budget spans several calls
#   --vram LIST       expertd's VRAM tier in experts per model (default mixtral=32,qwen3=256,
#                     mixtral-llama=32,ds3=256)
#   --staging MIB     expertd's staging ring (default 1024)
#   --lookahead N     expert-run's --prefetch-depth: the layers ahead its router hints (default 1,
#                     expert-run's); other than 1 the expertd configs are named expertd-lN
#                     (expertd-d0-lN), so sweeps into one --out keep every run
#   --daemon-depth D  expertd's --prefetch-depth for the expertd config (default auto: it starts at
#                     0 and climbs on evidence, so a fresh daemon reads only exact hints ahead at
#                     first); a fixed D names the configs expertd-pD
#   --prefill-gemm G  expert-run's --prefill-gemm (f32, its default, or bf16: the experts' prefill
#                     GEMMs on tensor cores); bf16 names the expertd configs expertd-bf16
#   --no-vram-preload expert-run starts with an empty VRAM tier (by default it fills the tier at
#                     start with the last layers' experts, untimed, as llama.cpp's -ncmoe loads
#                     its GPU layers' experts at model load); names the configs expertd-nopre
#   --read SPEC       expertd's reads: QD (--queue-depth QD, whole slices), QD:CHUNK (--chunk CHUNK,
#                     e.g. 32:4MiB) or probe (expertd probes the disk at start, its default);
#                     default 32; other than 32 the expertd configs are named expertd-rSPEC
#   --margin MIB      host memory left in the cap for expert-run beyond its dense weights
#                     (default 1536)
#   --bin DIR         expertd, expert-run, expertctl, expert-forge, expert-bench (default
#                     .device/bin, else build/bin); DIR/../lib goes on LD_LIBRARY_PATH
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
# Expected time on the H200 machine (16 cores, ~2 GB/s disk): the CUDA build of llama-bench and
# llama-feed ~5.3 min in the background (316 s measured), the CPU one ~1 min more; forge once per
# model, ~25 s Mixtral, ~15 s Qwen3, ~35 s the DeepSeek-V3 slice; streams ~1 s; disk ~20 s. Runs:
# expertd ~40 s, llama-feed and llama-bench ~45-55 s each (their mmap load reads the whole file):
# the default configs (2 streams) make 5 runs a cell, ~4 min. The 64 GiB disk holds Mixtral and
# Qwen3 or the DeepSeek-V3 slice, not all three: run ds3 in a call of its own after deleting the
# others' files (its CUDA engine prefilled token by token until 2026-12-04, hence --pp 64 then; it
# prefills in chunks now, not yet measured). With --budget and
# PEER_T0 exported, the same command repeated resumes where the last call stopped.
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
  # PEER_READ (peer.sh --read): QD, QD:CHUNK or probe.
  rs=${PEER_READ:-32}
  case $rs in
    probe) read_flags=(--queue-depth 0) ;;
    *:*) read_flags=(--queue-depth "${rs%%:*}" --chunk "${rs#*:}") ;;
    *) read_flags=(--queue-depth "$rs") ;;
  esac
  "$bin/expertd" --model "m=$gguf" --socket "$sock" --cache "$cache" --staging "$staging" \
    "${read_flags[@]}" --prefetch-depth "$depth" 2> "$log" &
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
all_configs=(expertd expertd-d0 feed-cuda-tier feed-cuda-all feed-cpu cuda-tier cuda-all cpu sampled)
models="" caps="" cells=""
configs=expertd,feed-cuda-tier,cuda-tier
streams=random,text seed=1 tokenizer=""
out=${OUT:+$OUT/peer}
out=${out:-/tmp/peer-out}
read_spec=32 fresh=0 quick=0 tg="" pp="" timeout="" cpu_timeout="" budget=0 staging=1024 margin=1536 lookahead="" daemon_depth="" prefill_gemm="" no_preload=0
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
    --cells) need "$@"; cells=$2; shift ;;
    --configs) need "$@"; configs=$2; shift ;;
    --streams) need "$@"; streams=$2; shift ;;
    --seed) need "$@"; seed=$2; shift ;;
    --tokenizer) need "$@"; tokenizer=$2; shift ;;
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
    --lookahead) need "$@"; lookahead=$2; shift ;;
    --daemon-depth) need "$@"; daemon_depth=$2; shift ;;
    --prefill-gemm) need "$@"; prefill_gemm=$2; shift ;;
    --no-vram-preload) no_preload=1 ;;
    --margin) need "$@"; margin=$2; shift ;;
    --read) need "$@"; read_spec=$2; shift ;;
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
    build-start | build-wait | forge | streams | disk | ipc | run | table) steps+=("$1") ;;
    pack-src) need "$@"; steps+=(pack-src); pack_out=$2; shift ;;
    *) echo "peer.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#steps[@]} -gt 0 ] || steps=(build-start forge streams build-wait disk ipc run table)
if [ $quick = 1 ]; then
  tg=${tg:-8} timeout=${timeout:-90} cpu_timeout=${cpu_timeout:-60}
fi
tg=${tg:-16} pp=${pp:-512} timeout=${timeout:-150} cpu_timeout=${cpu_timeout:-120}

bad() { echo "peer.sh: $*" >&2; exit 2; }
is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }
for v in tg pp timeout cpu_timeout budget staging margin jobs cuda_arch seed; do
  is_uint "${!v}" || bad "--${v//_/-} '${!v}' is not a whole number"
done
[ "$tg" -ge 1 ] && [ "$pp" -ge 1 ] || bad "--tg and --pp must be at least 1"
case $prefill_gemm in "" | f32 | bf16) ;; *) bad "--prefill-gemm '$prefill_gemm' is neither f32 nor bf16" ;; esac
[ -z "$lookahead" ] || { is_uint "$lookahead" && [ "$lookahead" -le 8 ]; } ||
  bad "--lookahead '$lookahead' is not a whole number of layers from 0 to 8"
[ -z "$daemon_depth" ] || [ "$daemon_depth" = auto ] ||
  { is_uint "$daemon_depth" && [ "$daemon_depth" -le 64 ]; } ||
  bad "--daemon-depth '$daemon_depth' is neither auto nor a whole number of layers from 0 to 64"
[ "$daemon_depth" != auto ] || daemon_depth=""
is_model() { case $1 in mixtral | qwen3 | mixtral-llama | ds3) return 0 ;; esac; return 1; }
is_cap() { is_uint "$1" && [ "$1" -ge 1 ]; }
# The cells (model, cap) in order: --cells as given, else every model at every cap.
cell_list=()
if [ -n "$cells" ]; then
  [ -z "$models$caps" ] || bad "--cells names the models and caps itself: give it or --models/--caps"
  IFS=, read -ra items <<< "$cells"
  for it in "${items[@]}"; do
    [[ $it =~ ^([a-z0-9-]+):([0-9]+)$ ]] || bad "--cells: '$it' is not MODEL:CAP (e.g. mixtral:8)"
    m=${BASH_REMATCH[1]} c=${BASH_REMATCH[2]}
    is_model "$m" || bad "--cells: '$m' in '$it' is not mixtral, qwen3, mixtral-llama or ds3"
    is_cap "$c" || bad "--cells: '$it': the cap is not a size in GiB (>= 1)"
    cell_list+=("$m $c")
  done
else
  IFS=, read -ra model_list <<< "${models:-mixtral,qwen3}"
  IFS=, read -ra cap_list <<< "${caps:-8,16}"
  [ ${#model_list[@]} -gt 0 ] && [ ${#cap_list[@]} -gt 0 ] || bad "--models and --caps need at least one entry"
  for m in "${model_list[@]}"; do
    is_model "$m" || bad "--models: '$m' is not mixtral, qwen3, mixtral-llama or ds3"
  done
  for c in "${cap_list[@]}"; do
    is_cap "$c" || bad "--caps: '$c' is not a size in GiB (a whole number >= 1)"
  done
  for m in "${model_list[@]}"; do for c in "${cap_list[@]}"; do cell_list+=("$m $c"); done; done
fi
[ ${#cell_list[@]} -gt 0 ] || bad "--cells needs at least one MODEL:CAP"
# Each model once, in order of first appearance (forge, streams).
model_list=()
for cell in "${cell_list[@]}"; do
  [[ " ${model_list[*]} " == *" ${cell%% *} "* ]] || model_list+=("${cell%% *}")
done
IFS=, read -ra config_list <<< "$configs"
[ ${#config_list[@]} -gt 0 ] || bad "--configs needs at least one entry"
for c in "${config_list[@]}"; do
  [[ " ${all_configs[*]} " == *" $c "* ]] || bad "--configs: '$c' is not one of ${all_configs[*]}"
done
IFS=, read -ra stream_list <<< "$streams"
[[ $read_spec =~ ^(probe|[0-9]+(:[0-9]+[KMG]iB)?)$ ]] ||
  bad "--read: '$read_spec' is not QD, QD:CHUNK (e.g. 32:4MiB) or probe"
export PEER_READ=$read_spec
[ ${#stream_list[@]} -gt 0 ] || bad "--streams needs at least one of random, text"
for s in "${stream_list[@]}"; do
  case $s in random | text) ;; *) bad "--streams: '$s' is not random or text" ;; esac
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
      cpu | feed-cpu) [[ $builds == *cpu* ]] || builds+=${builds:+,}cpu ;;
      cuda-* | feed-cuda-*) [[ $builds == *cuda* ]] || builds="cuda${builds:+,}$builds" ;;
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
sdir=$out/streams

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

# --- token streams ----------------------------------------------------------------------------
mib=$((1 << 20))
gib=$((1 << 30))
results=$out/results.jsonl
prompt_ids() {  # PP pseudo-random ids in [100, min(vocab - 100, 31900)), comma-separated
  local hi=$((VOCAB - 100 < 31900 ? VOCAB - 100 : 31900))
  awk -v n="$1" -v hi=$hi 'BEGIN { srand(12); for (i = 0; i < n; ++i)
    printf "%s%d", (i ? "," : ""), 100 + int(rand() * (hi - 100)) }'
}

# glibc's rand() itself (python's random is another generator): llama-bench draws tg's ids with
# std::rand() % n_vocab, unseeded, which is srand(1).
random_cmd() {  # N VOCAB: sets scmd
  scmd=(python3 -c 'import ctypes, sys
libc = ctypes.CDLL("libc.so.6")
libc.srand(int(sys.argv[1]))
n, vocab = int(sys.argv[2]), int(sys.argv[3])
print(",".join(str(libc.rand() % vocab) for _ in range(n)))' "$seed" "$1" "$2")
}

text_files=("$root/docs/ARCHITECTURE.md" "$root/engine/engine.h")
# The text stream's tokenizer: --tokenizer; else LLaMA's SentencePiece from llama.cpp's models/
# (a real 32000-token vocabulary, the size of every full-size shape's; the forged models' own
# vocabularies are synthetic); else the repository's 1459-token test tokenizer, said loudly.
resolve_tokenizer() {  # sets tok_file, tok_note
  if [ -n "$tokenizer" ]; then
    tok_file=$tokenizer tok_note="--tokenizer"
  elif [ -f "$llsrc/models/ggml-vocab-llama-spm.gguf" ] || [ $dry = 1 ]; then
    tok_file=$llsrc/models/ggml-vocab-llama-spm.gguf
    tok_note="LLaMA's SentencePiece BPE from llama.cpp's models/, a real tokenizer of the full-size shapes' vocabulary size"
  else
    tok_file=$root/tests/fixtures/tokenizers/mixtral.gguf
    tok_note="WARNING: a 1459-token SentencePiece test tokenizer (tests/fixtures), not a real vocabulary: no $llsrc/models/ggml-vocab-llama-spm.gguf (unpack the sdist or a pack-src tarball of this version, or give --tokenizer)"
  fi
}

stream_file() { echo "$sdir/$1-$2.ids"; }  # STREAM VOCAB

# --- runs -------------------------------------------------------------------------------------
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

# Prints the plan lines "model cap config stream" (stream "-": a config that is not fed) in
# order: expertd's runs first (needing no llama.cpp build, so they can go while it builds), then
# llama.cpp's CUDA configs cell by cell, and its CPU-only build last (the slowest, the one most
# likely to time out).
selected() { [[ ",$configs," == *",$1,"* ]]; }
plan() {
  local c s cell
  for cell in "${cell_list[@]}"; do
    # Prefetch on and off side by side, so that both see the same conditions.
    for s in "${stream_list[@]}"; do
      for c in expertd expertd-d0; do
        if selected $c; then echo "$cell $c $s"; fi
      done
    done
    if selected sampled; then echo "$cell sampled -"; fi
  done
  for cell in "${cell_list[@]}"; do
    for s in "${stream_list[@]}"; do
      for c in feed-cuda-tier feed-cuda-all; do
        if selected $c; then echo "$cell $c $s"; fi
      done
    done
    for c in cuda-tier cuda-all; do
      if selected $c; then echo "$cell $c -"; fi
    done
  done
  for cell in "${cell_list[@]}"; do
    for s in "${stream_list[@]}"; do
      if selected feed-cpu; then echo "$cell feed-cpu $s"; fi
    done
    if selected cpu; then echo "$cell cpu -"; fi
  done
}

already_done() {  # ID: a result with status ok for this run and these token counts
  [ -f "$results" ] && python3 "$here/summarize.py" is-done "$results" "$1" "$tg" "$pp"
}

# How many ids a stream file holds (0 when absent).
ids_in() {
  if [ -f "$1" ]; then tr ',' '\n' < "$1" | awk '/[0-9]/ { n++ } END { print n + 0 }'; else echo 0; fi
}

run_one() {  # MODEL CAP CONFIG STREAM INDEX COUNT
  local m=$1 cap=$2 c=$3 stream=$4 idx=$5 count=$6
  shape "$m"
  local capb=$((cap * gib)) dense eng_config=$c tool=llama.cpp cmd=() what
  if [ $cpu_engine = 1 ]; then
    case $c in expertd) eng_config=expertd-cpu ;; expertd-d0) eng_config=expertd-cpu-d0 ;;
      sampled) eng_config=sampled-cpu ;; esac
  fi
  # expert-run's --prefetch-depth other than its default (1): its own config name, so a sweep
  # into one --out keeps every run.
  if [ -n "$lookahead" ] && [ "$lookahead" != 1 ] && [[ $c == expertd* ]]; then
    eng_config+="-l$lookahead"
  fi
  if [ -n "$daemon_depth" ] && [ "$c" = expertd ]; then eng_config+="-p$daemon_depth"; fi
  if [ "$read_spec" != 32 ] && [[ $c == expertd* ]]; then eng_config+="-r${read_spec//:/-}"; fi
  if [ "$prefill_gemm" = bf16 ] && [[ $c == expertd* ]]; then eng_config+="-bf16"; fi
  if [ $no_preload = 1 ] && [[ $c == expertd* ]] && [ $cpu_engine = 0 ]; then eng_config+="-nopre"; fi
  local id="$m-${cap}g-$eng_config"
  [ "$stream" = - ] || id+="-$stream"
  dense=$(dense_bytes)
  local cgcap=$capb
  [ $no_cgroup = 1 ] && cgcap=none
  local raw=$out/raw/$id fields=()
  fields=(--field "model=$m" --field "cap_gib=$cap" --field "config=$eng_config"
    --field "model_file=$file" --field "layers=$L" --field "experts=$E" --field "top_k=$K"
    --field "expert_bytes=$EB" --field "dense_bytes=$dense" --field "tg_tokens=$tg"
    --field "pp_tokens=$pp" --field "uncapped=$no_cgroup" --field "vocab=$VOCAB")
  # The ids: a fed run's decode stream and everyone's prompt, from the streams step.
  local sfile="" pfile
  pfile=$(stream_file prompt "$VOCAB")
  if [ "$stream" = - ]; then
    case $c in
      sampled | sampled-cpu) fields+=(--field "stream=sampled" --field "decode_input=sampled (not comparable: expertd samples its own tokens)") ;;
      *) fields+=(--field "stream=llama-bench" --field "decode_input=llama-bench's own random ids (std::rand() % n_vocab)") ;;
    esac
  else
    sfile=$(stream_file "$stream" "$VOCAB")
    fields+=(--field "stream=$stream" --field "stream_file=$sfile" --field "decode_input=fed")
  fi
  case $c in
    expertd | expertd-d0 | sampled)
      tool=expertd
      local depth=auto
      [ "$c" != expertd ] || depth=${daemon_depth:-auto}
      [ "$c" != expertd-d0 ] || depth=0
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
      local prompt
      if [ -f "$pfile" ]; then prompt=$(cat "$pfile"); else prompt=$(prompt_ids "$pp"); fi
      cmd=("$here/peer.sh" __pair "$bin" "$file" "$work/peer-expertd.sock" "${cache}MiB"
        "${staging}MiB" "$raw.expertd.log" "$depth" -- --prompt-tokens "$prompt")
      if [ "$c" = sampled ]; then
        cmd+=(--max-tokens $((tg + 1)) "${vflag[@]}" --prefill-chunk "$pp" --temperature 1 --seed 1
          --ignore-eos --json)
      else
        cmd+=(--feed-tokens "$sfile" "${vflag[@]}" --prefill-chunk "$pp" --json)
      fi
      [ -z "$lookahead" ] || cmd+=(--prefetch-depth "$lookahead")
      [ -z "$prefill_gemm" ] || cmd+=(--prefill-gemm "$prefill_gemm")
      [ $no_preload = 0 ] || [ $cpu_engine = 1 ] || cmd+=(--no-vram-preload)
      what="expertd cache ${cache} MiB, staging $staging MiB, $([ $cpu_engine = 1 ] && echo "CPU engine" || echo "VRAM tier $V experts")"
      what+=", daemon prefetch depth $depth"
      what+=", engine router lookahead ${lookahead:-1} layer(s)"
      [ "$c" = sampled ] && what+=", sampled decode (not comparable)"
      fields+=(--field "cache_mib=$cache" --field "staging_mib=$staging" --field "daemon_depth=$depth"
        --field "lookahead=${lookahead:-1}" --field "read=$read_spec"
        --field "prefill_gemm=${prefill_gemm:-f32}")
      [ $cpu_engine = 1 ] || fields+=(--field "vram_experts=$V" --field "vram_preload=$((1 - no_preload))")
      ;;
    cuda-tier | cuda-all | cpu | feed-cuda-tier | feed-cuda-all | feed-cpu)
      local kind=cuda ncmoe=$L fed=0
      [[ $c == *cpu ]] && kind=cpu
      [[ $c == feed-* ]] && fed=1 tool=llama-feed
      if [[ $c == *cuda-tier ]]; then
        ncmoe=$((L - V / E))
        [ "$ncmoe" -ge 0 ] || ncmoe=0
      fi
      local llbin
      if [ $fed = 1 ]; then llbin=$(peer_llama_feed_bin "$llroot" $kind); else llbin=$(peer_llama_bin "$llroot" $kind); fi
      if [ $dry = 1 ]; then
        llama_flags=(-lm mmap --repack 0)
      else
        if peer_llama_building "$llroot"; then
          peer_log "run $idx/$count $id: waiting for the llama.cpp build to finish first"
          peer_llama_build_idle "$llroot" 900
        fi
        [ -x "$llbin" ] || { peer_log "run $idx/$count $id: skipped: no $llbin (build-start, build-wait)"; return 0; }
        [ $fed = 1 ] || llama_mem_flags "$llbin"
      fi
      if [ $fed = 1 ]; then
        cmd=("$llbin" -m "$file" --prompt-ids "$pfile" --feed "$sfile" -lm mmap --no-repack)
      else
        cmd=("$llbin" -m "$file" -p "$pp" -n "$tg" -r 1 --no-warmup "${llama_flags[@]}" -o jsonl)
      fi
      local name="llama-bench"
      [ $fed = 0 ] || name="llama-feed ($stream ids)"
      if [ $kind = cpu ]; then
        what="$name, llama.cpp CPU-only build"
      else
        cmd+=(-ngl 99 -ncmoe "$ncmoe")
        what="$name, llama.cpp CUDA -ngl 99 -ncmoe $ncmoe ($(((L - ncmoe) * E)) experts in VRAM)"
        fields+=(--field "ncmoe=$ncmoe" --field "vram_experts=$(((L - ncmoe) * E))")
      fi
      ;;
  esac
  fields+=(--field "tool=$tool" --field "id=$id")
  # The command as shown and recorded: the prompt's ids as where they come from.
  local shown=("${cmd[@]/#[0-9]*,[0-9]*,*/<$pp ids, awk srand(12)>}")
  local limit=$timeout
  [[ $c != *cpu ]] || limit=$cpu_timeout
  if [ $dry = 1 ]; then
    echo "run $idx/$count $id: $what; memory.max $cgcap, limit $limit s:"
    echo "  ${shown[*]}"
    return 0
  fi
  if already_done "$id"; then
    peer_log "run $idx/$count $id: in $results already (--fresh to redo)"
    return 0
  fi
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
  # Every config but llama-bench's reads the prompt's ids, the fed ones their stream's: both must
  # be this run's length (a stream of another --tg is stale).
  local f n
  for f in "$pfile" ${sfile:+"$sfile"}; do
    [[ $f == "$pfile" && ($c == cuda-* || $c == cpu) ]] && continue
    n=$(ids_in "$f")
    if [ "$n" = 0 ]; then
      peer_log "run $idx/$count $id: skipped: no $f (the streams step)"
      return 0
    fi
    local want=$tg
    [ "$f" != "$pfile" ] || want=$pp
    if [ "$n" != "$want" ]; then
      peer_log "run $idx/$count $id: skipped: $f holds $n ids, not $want (run the streams step again)"
      return 0
    fi
  done
  [ -z "$sfile" ] || fields+=(--field "stream_source=$(cat "$sfile.source" 2> /dev/null || echo unknown)")
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
    echo "build-start: unpack ${llama_src:-<pip download llama-cpp-python==$PEER_LLAMA_SDIST_VERSION>} to $llsrc; build llama-bench and llama-feed ($builds) in $llroot/{${builds}} with -j $jobs in the background"
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
  peer_llama_build_start "$llsrc" "$llroot" "$builds" "$jobs" "$cuda_arch" "$here/llama_feed.cpp"
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

# Writes FILE (the ids) and FILE.source (one line: what they are), and the line to the README.
put_stream() {  # FILE SOURCE IDS
  printf '%s\n' "$3" > "$1"
  printf '%s\n' "$2" > "$1.source"
  printf '%s: %s\n' "$(basename "$1")" "$2" >> "$sdir/README"
}

step_streams() {
  local vocabs=() m v
  for m in "${model_list[@]}"; do
    shape "$m"
    [[ " ${vocabs[*]} " == *" $VOCAB "* ]] || vocabs+=("$VOCAB")
  done
  resolve_tokenizer
  local tcmd=("$bin/expertctl" tokenize "$tok_file" --file "${text_files[0]}" --file "${text_files[1]}"
    --max "$tg" --json)
  if [ $dry = 1 ]; then
    for v in "${vocabs[@]}"; do
      random_cmd "$tg" "$v"
      echo "streams: $(stream_file prompt "$v"): $pp ids, awk srand(12) in [100, $((v - 100 < 31900 ? v - 100 : 31900)))"
      echo "streams: $(stream_file random "$v"): $tg ids, glibc rand() % $v after srand($seed): python3 -c <ctypes libc.so.6 srand/rand> $seed $tg $v"
      echo "streams: $(stream_file text "$v"): the first $tg ids of docs/ARCHITECTURE.md + engine/engine.h (mod $v): ${tcmd[*]}"
    done
    return
  fi
  command -v python3 > /dev/null || peer_die "streams: python3 is needed (glibc's rand() through ctypes)"
  [ -x "$bin/expertctl" ] || peer_die "streams: no $bin/expertctl (--bin)"
  [ -f "$tok_file" ] || peer_die "streams: --tokenizer $tok_file: no such file"
  [[ $tok_note != WARNING* ]] || peer_log "streams: $tok_note"
  mkdir -p "$sdir"
  local tj
  tj=$("${tcmd[@]}") || peer_die "streams: ${tcmd[*]} failed"
  local tvocab text_ids random_ids
  tvocab=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["vocab"])' <<< "$tj")
  {
    echo "Token streams of bench/peer/peer.sh (issue 23): both engines prefill prompt-V.ids, then"
    echo "decode each id of one stream file from an empty context. V: the models' vocabulary size."
    echo "Made $(date -u +%Y-%m-%dT%H:%M:%SZ) with --tg $tg --pp $pp --seed $seed."
  } > "$sdir/README"
  for v in "${vocabs[@]}"; do
    put_stream "$(stream_file prompt "$v")" \
      "$pp ids, awk srand(12): 100 + int(rand() * (hi - 100)), hi = min(V - 100, 31900)" \
      "$(VOCAB=$v prompt_ids "$pp")"
    random_cmd "$tg" "$v"
    random_ids=$("${scmd[@]}") || peer_die "streams: drawing the random ids failed: ${scmd[*]}"
    put_stream "$(stream_file random "$v")" \
      "$tg ids, glibc rand() % $v after srand($seed) (llama-bench's tg draws std::rand() % n_vocab; unseeded = srand(1))" \
      "$random_ids"
    text_ids=$(python3 -c 'import json, sys
j = json.loads(sys.argv[1]); v = int(sys.argv[2])
print(",".join(str(i % v) for i in j["ids"]))' "$tj" "$v")
    local note="the first $tg ids of docs/ARCHITECTURE.md followed by engine/engine.h (English, then C++), encoded by expertctl tokenize with $tok_file ($tvocab tokens: $tok_note)"
    [ "$tvocab" -le "$v" ] || note+="; ids taken modulo $v, this vocabulary being smaller"
    put_stream "$(stream_file text "$v")" "$note" "$text_ids"
  done
  local made=("$sdir"/*.ids)
  peer_log "streams: ${#made[@]} files in $sdir (README says what each is)"
}

step_disk() {
  shape "${model_list[0]}"
  local cache=4GiB
  [ $tiny = 0 ] || cache=64MiB
  local dcmd=("$bin/expert-bench" storage --model "$file" --cache "$cache" --grid engine
    --seconds 3 --no-verify --json)
  if [ $dry = 1 ]; then echo "disk: caches dropped; ${dcmd[*]} > $out/disk.json"; return; fi
  [ -x "$bin/expert-bench" ] || { peer_log "disk: skipped: no $bin/expert-bench (--bin)"; return 0; }
  [ -f "$file" ] || { peer_log "disk: skipped: no $file (forge)"; return 0; }
  mkdir -p "$out"
  # A llama.cpp build writes its objects to the same disk and takes every core: the probe beside it
  # read 1.47 GB/s where expertd's own reads later sustained 2.24 (H200, 2026-12-04).
  if peer_llama_building "$llroot"; then
    peer_log "disk: waiting for the llama.cpp build to finish first (its writes would slow the probe)"
    peer_llama_build_idle "$llroot" 900
  fi
  peer_drop_caches || peer_log "disk: warning: cannot drop the page cache: the rate may be cached"
  peer_log "disk: ${dcmd[*]}"
  if "${dcmd[@]}" > "$out/disk.json.tmp" 2> "$out/disk.log"; then
    mv "$out/disk.json.tmp" "$out/disk.json"
    peer_log "disk: $(python3 "$here/summarize.py" disk "$out/disk.json")"
  else
    tail -3 "$out/disk.log" >&2
    peer_log "disk: expert-bench storage failed (log $out/disk.log): no disk-bound fraction"
  fi
}

# Five shared-memory round trips against RPC (expert-bench ipc, its own daemon on a forged model)
# -> OUT/ipc.jsonl, for issue 23's "shm p50 <= 3 us in every run" on this machine.
step_ipc() {
  local icmd=("$bin/expert-bench" ipc --json)
  if [ $dry = 1 ]; then echo "ipc: 5 x ${icmd[*]} >> $out/ipc.jsonl"; return; fi
  [ -x "$bin/expert-bench" ] || { peer_log "ipc: skipped: no $bin/expert-bench (--bin)"; return 0; }
  mkdir -p "$out"
  : > "$out/ipc.jsonl.tmp"
  local i
  for i in 1 2 3 4 5; do
    if ! "${icmd[@]}" 2>> "$out/ipc.log" | tail -1 >> "$out/ipc.jsonl.tmp"; then
      tail -3 "$out/ipc.log" >&2
      peer_log "ipc: run $i failed (log $out/ipc.log)"
    fi
  done
  mv "$out/ipc.jsonl.tmp" "$out/ipc.jsonl"
  peer_log "ipc: $(python3 "$here/summarize.py" ipc "$out/ipc.jsonl")"
}

step_run() {
  if [ $dry = 0 ]; then
    command -v python3 > /dev/null || peer_die "python3 is needed to read the tools' output"
    if [ $no_cgroup = 0 ]; then
      local why
      why=$(peer_cgroup_check 2>&1) || peer_die "memory cap: $why. (--no-cgroup runs uncapped, for testing only.)"
    fi
    local needs_expertd=0 c
    for c in "${config_list[@]}"; do [[ $c != expertd* && $c != sampled ]] || needs_expertd=1; done
    [ -x "$bin/expertd" ] || [ $needs_expertd = 0 ] || peer_die "no $bin/expertd (--bin)"
    mkdir -p "$out/raw"
    [ $fresh = 0 ] || : > "$results"
    peer_drop_caches || peer_log "warning: cannot drop the page cache (/proc/sys/vm/drop_caches): runs start warm"
  fi
  local lines count i=0
  lines=$(plan)
  count=$(wc -l <<< "$lines")
  [ $dry = 0 ] || echo "run: $count runs, tg $tg, pp $pp, streams ${stream_list[*]}, results in $results"
  while read -r m cap c s; do
    i=$((i + 1))
    run_one "$m" "$cap" "$c" "$s" $i "$count"
  done <<< "$lines"
}

step_table() {
  if [ $dry = 1 ]; then echo "table: $out/table.md from $results (and $out/disk.json)"; return; fi
  [ -f "$results" ] || { peer_log "table: no $results yet"; return; }
  local disk=()
  [ ! -f "$out/disk.json" ] || disk=(--disk "$out/disk.json")
  [ ! -s "$out/ipc.jsonl" ] || disk+=(--ipc "$out/ipc.jsonl")
  python3 "$here/summarize.py" table "${disk[@]}" "$results" > "$out/table.md"
  peer_log "table: $out/table.md"
  cat "$out/table.md"
}

for s in "${steps[@]}"; do
  case $s in
    pack-src) step_pack_src ;;
    build-start) step_build_start ;;
    build-wait) step_build_wait ;;
    forge) step_forge ;;
    streams) step_streams ;;
    disk) step_disk ;;
    ipc) step_ipc ;;
    run) step_run ;;
    table) step_table ;;
  esac
done
