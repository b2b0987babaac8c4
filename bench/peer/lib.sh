# shellcheck shell=bash
# Shared by bench/peer/peer.sh and scripts/device-engine-bench.sh (sourced, not run): timestamped
# progress lines, cgroup v2 memory caps, and building llama.cpp's llama-bench (and peer.sh's
# llama-feed against its libllama) from the llama-cpp-python sdist. The one place for this logic;
# both scripts call these functions.
#
# Variables the caller may set before sourcing: PEER_CGROUP_ROOT (/sys/fs/cgroup).

PEER_T0=${PEER_T0:-$(date +%s)}
PEER_CGROUP_ROOT=${PEER_CGROUP_ROOT:-/sys/fs/cgroup}
PEER_LLAMA_SDIST_VERSION=0.3.36

peer_log() {  # a progress line: wall-clock UTC time and seconds since the script started
  printf '[%s +%ds] %s\n' "$(date -u +%H:%M:%S)" "$(($(date +%s) - PEER_T0))" "$*" >&2
}

peer_die() {
  peer_log "error: $*"
  exit 1
}

# --- memory caps (cgroup v2) ------------------------------------------------------------------

# Succeeds when PEER_CGROUP_ROOT is a writable cgroup v2 hierarchy whose children get a memory
# controller; otherwise prints why and fails. A child is created and removed to find out: on a
# cgroup v1 or tmpfs /sys/fs/cgroup, mkdir makes a plain directory and writing memory.max makes a
# plain file, which caps nothing, so the check looks for the files the kernel creates.
peer_cgroup_check() {
  local root=$PEER_CGROUP_ROOT probe=$PEER_CGROUP_ROOT/expertd-peer-probe-$$ ok=0
  # Children get memory.max only when the parent delegates the controller (this may be refused,
  # e.g. in a container whose root cgroup holds processes: then it must be delegated already).
  if [ -f "$root/cgroup.subtree_control" ] && ! grep -qw memory "$root/cgroup.subtree_control"; then
    echo +memory 2> /dev/null > "$root/cgroup.subtree_control" || true
  fi
  # The io controller too where it can be had: the children's io.stat counts every byte a run
  # reads from storage (llama-bench reports none itself). Optional: a run without it says so.
  if [ -f "$root/cgroup.subtree_control" ] && ! grep -qw io "$root/cgroup.subtree_control" &&
    grep -qw io "$root/cgroup.controllers" 2> /dev/null; then
    echo +io 2> /dev/null > "$root/cgroup.subtree_control" || true
  fi
  if mkdir "$probe" 2> /dev/null; then
    [ -f "$probe/memory.max" ] && [ -f "$probe/cgroup.procs" ] && ok=1
    rmdir "$probe" 2> /dev/null || true
  fi
  [ $ok = 0 ] || return 0
  local fs
  fs=$(stat -fc %T "$root" 2> /dev/null || echo missing)
  if [ ! -f "$root/cgroup.controllers" ]; then
    echo "no cgroup v2 hierarchy at $root (filesystem type '$fs', no cgroup.controllers): the" \
      "memory cap needs cgroup v2 mounted there, writable, as root" >&2
  elif ! grep -qw memory "$root/cgroup.controllers"; then
    echo "$root has no memory controller (cgroup.controllers: $(cat "$root/cgroup.controllers"))" >&2
  elif [ ! -w "$root" ]; then
    echo "cannot create a cgroup under $root (not root, or read-only): $(id -un)" >&2
  else
    echo "a cgroup made under $root has no memory.max (memory not in" \
      "$root/cgroup.subtree_control: '$(cat "$root/cgroup.subtree_control" 2> /dev/null)')" >&2
  fi
  return 1
}

# Empties page cache so every run starts cold; 0 when it worked.
peer_drop_caches() {
  sync
  echo 3 2> /dev/null > /proc/sys/vm/drop_caches
}

# peer_in_cgroup CAP_BYTES TIMEOUT_S STATS_FILE CMD...
# Runs CMD in a fresh cgroup with memory.max = CAP_BYTES (page cache included) and swap off, under
# a wall-clock limit (0 = none). Everything CMD starts stays in the cgroup (it moves itself in before
# exec), and whatever is left when it ends is killed, so a hung run leaves nothing behind. Writes
# "key value" lines to STATS_FILE: rc, timed_out, wall_s, peak, memory.events' counters, and,
# where the kernel has them, io_rbytes / io_rios (io.stat summed over devices: everything the run
# read from storage, mmap faults and O_DIRECT alike) and the largest anon and file (page cache)
# bytes of memory.stat, sampled every 0.5 s while CMD runs (at its end both are gone or stale).
# With CAP_BYTES = none, runs CMD the same way without a cgroup (testing on a machine without one).
peer_in_cgroup() {
  local cap=$1 limit=$2 stats=$3
  shift 3
  local cg="" t0 rc=0
  if [ "$cap" != none ]; then
    cg=$PEER_CGROUP_ROOT/expertd-peer-$$-$RANDOM
    mkdir "$cg" || return 1
    echo "$cap" > "$cg/memory.max" || { rmdir "$cg"; return 1; }
    echo 0 2> /dev/null > "$cg/memory.swap.max" || true
    local got
    got=$(cat "$cg/memory.max")
    [ "$got" = "$cap" ] || echo "warning: $cg/memory.max reads '$got' after writing $cap" >&2
  fi
  t0=$(date +%s%N)
  local to=() sampler=""
  [ "$limit" != 0 ] && to=(timeout -k 10 "$limit")
  if [ -n "$cg" ] && [ -f "$cg/memory.stat" ]; then
    # Outside the cgroup (this shell's child, not CMD's), so it is neither capped nor counted.
    peer_memory_sampler "$cg/memory.stat" "$stats.mem" &
    sampler=$!
  fi
  if [ -n "$cg" ]; then
    "${to[@]}" bash -c 'echo $$ > "$1/cgroup.procs" || exit 97; shift; exec "$@"' _ "$cg" "$@" ||
      rc=$?
  else
    "${to[@]}" "$@" || rc=$?
  fi
  local wall_ms=$((($(date +%s%N) - t0) / 1000000))
  if [ -n "$sampler" ]; then
    kill "$sampler" 2> /dev/null || true
    wait "$sampler" 2> /dev/null || true
  fi
  {
    echo "rc $rc"
    echo "timed_out $([ "$rc" = 124 ] || [ "$rc" = 137 ] && [ "$limit" != 0 ] && echo 1 || echo 0)"
    echo "wall_s $((wall_ms / 1000)).$(printf %03d $((wall_ms % 1000)))"
    if [ -n "$cg" ]; then
      echo "cap $(cat "$cg/memory.max" 2> /dev/null || echo "$cap")"
      echo "peak $(cat "$cg/memory.peak" 2> /dev/null || echo -1)"
      [ -f "$cg/memory.events" ] && sed 's/^/event_/' "$cg/memory.events"
      if [ -f "$cg/io.stat" ]; then
        # One line per device: "MAJ:MIN rbytes=N wbytes=N rios=N ...".
        awk '{ for (i = 2; i <= NF; i++) { split($i, kv, "=")
                 if (kv[1] == "rbytes") b += kv[2]; if (kv[1] == "rios") n += kv[2] } }
             END { printf "io_rbytes %d\nio_rios %d\n", b, n }' "$cg/io.stat"
      fi
      [ ! -s "$stats.mem" ] || awk '$1 > a { a = $1 } $2 > f { f = $2 }
        END { printf "mem_anon_max %d\nmem_file_max %d\n", a, f }' "$stats.mem"
    fi
  } > "$stats"
  rm -f "$stats.mem"
  if [ -n "$cg" ]; then
    # A daemon the command started and did not stop (a timeout or a crash) dies with the cgroup.
    if [ -f "$cg/cgroup.kill" ]; then
      echo 1 2> /dev/null > "$cg/cgroup.kill" || true
    fi
    local pid
    for pid in $(cat "$cg/cgroup.procs" 2> /dev/null); do kill -KILL "$pid" 2> /dev/null || true; done
    for _ in $(seq 100); do
      [ -z "$(cat "$cg/cgroup.procs" 2> /dev/null)" ] && break
      sleep 0.1
    done
    rmdir "$cg" 2> /dev/null || echo "cgroup $cg not removed (processes left)" >&2
  fi
  return $rc
}

# Appends "anon file" (memory.stat's bytes) to OUT every 0.5 s until killed.
peer_memory_sampler() {  # MEMORY_STAT OUT
  while :; do
    awk '$1 == "anon" { a = $2 } $1 == "file" { f = $2 } END { print a + 0, f + 0 }' "$1" \
      2> /dev/null >> "$2" || return 0
    sleep 0.5
  done
}

# --- llama.cpp --------------------------------------------------------------------------------

# The trees a tarball or directory may hold: the sdist (llama_cpp_python-V/vendor/llama.cpp), a
# trimmed copy of that vendor folder (llama.cpp/), or a llama.cpp checkout.
peer_llama_unpack() {  # SRC DEST: DEST/CMakeLists.txt is llama.cpp's afterwards
  local src=$1 dest=$2
  if [ -d "$src" ]; then
    local d=$src
    [ -f "$d/vendor/llama.cpp/CMakeLists.txt" ] && d=$d/vendor/llama.cpp
    [ -f "$d/tools/llama-bench/llama-bench.cpp" ] ||
      peer_die "$src: neither llama.cpp's tree nor the llama-cpp-python sdist's (no tools/llama-bench)"
    rm -rf "$dest" && mkdir -p "$(dirname "$dest")" && cp -a "$d" "$dest"
    return
  fi
  [ -f "$src" ] || peer_die "--llama-src $src: no such file or directory"
  local list top inner
  # The whole listing first: grep -m1 on a pipe would kill tar with SIGPIPE (pipefail).
  list=$(tar tzf "$src" 2> /dev/null) || peer_die "$src: not a readable .tar.gz"
  list=$(grep -m1 -E '(^|/)tools/llama-bench/llama-bench\.cpp$' <<< "$list") ||
    peer_die "$src: not a .tar.gz holding llama.cpp's tools/llama-bench"
  inner=${list%tools/llama-bench/llama-bench.cpp}  # e.g. llama_cpp_python-0.3.36/vendor/llama.cpp/
  top=${inner%%/*}
  local tmp=$dest.unpack
  rm -rf "$tmp" "$dest" && mkdir -p "$tmp"
  tar xzf "$src" -C "$tmp" "$inner" || peer_die "$src: extracting $inner failed"
  mv "$tmp/${inner%/}" "$dest" && rm -rf "$tmp"
  echo "$src" > "$dest/.peer-source"
  : "$top"
}

# Fetches the sdist with pip (network needed), into DIR; prints the tarball's path.
peer_llama_download() {
  local dir=$1
  mkdir -p "$dir"
  local py=python3
  command -v "$py" > /dev/null || peer_die "no python3 for pip download"
  "$py" -m pip download --no-deps --no-binary :all: \
    "llama-cpp-python==$PEER_LLAMA_SDIST_VERSION" -d "$dir" >&2 ||
    peer_die "pip download llama-cpp-python==$PEER_LLAMA_SDIST_VERSION failed (no network? pass" \
      "--llama-src with the sdist or a trimmed tarball)"
  ls "$dir"/llama_cpp_python-"$PEER_LLAMA_SDIST_VERSION".tar.gz
}

# Writes a trimmed tarball (llama.cpp/...) of the sdist's vendor/llama.cpp to OUT: without the
# docs, tests, examples, web UI, the Vulkan/SYCL/OpenCL backends and the models but one (about
# 8 MB instead of 77), which is all llama-bench's CPU and CUDA builds need. The model kept,
# models/ggml-vocab-llama-spm.gguf (0.7 MB), is LLaMA's SentencePiece vocabulary, the tokenizer of
# peer.sh's text stream.
peer_llama_pack() {  # SRC OUT
  local src=$1 out=$2 tmp
  tmp=$(mktemp -d)
  peer_llama_unpack "$src" "$tmp/llama.cpp"
  find "$tmp/llama.cpp/models" -mindepth 1 ! -name ggml-vocab-llama-spm.gguf -delete 2> /dev/null || true
  tar czf "$out" -C "$tmp" --exclude=llama.cpp/docs \
    --exclude=llama.cpp/tests --exclude=llama.cpp/examples --exclude=llama.cpp/media \
    --exclude=llama.cpp/.github --exclude=llama.cpp/.git --exclude=llama.cpp/gguf-py --exclude=llama.cpp/conversion \
    --exclude=llama.cpp/tools/ui --exclude=llama.cpp/tools/server/tests \
    --exclude=llama.cpp/tools/server/bench --exclude=llama.cpp/ggml/src/ggml-vulkan \
    --exclude=llama.cpp/ggml/src/ggml-sycl --exclude=llama.cpp/ggml/src/ggml-opencl llama.cpp
  rm -rf "$tmp"
  peer_log "pack: $out ($(du -h "$out" | cut -f1))"
}

# KIND is cpu or cuda. The build lives in BUILD_ROOT/KIND; BUILD_ROOT/KIND.rc holds the exit
# status of the build (ninja, then llama-feed's compile) once it is done, BUILD_ROOT/KIND.log the
# output.
peer_llama_bin() { echo "$1/$2/bin/llama-bench"; }
peer_llama_feed_bin() { echo "$1/$2/bin/llama-feed"; }

# Prints the commands that build KIND: configure, ninja llama-bench and llama (libllama), then
# llama_feed.cpp with g++ against that libllama. BUILD_SHARED_LIBS is on by default and llama.cpp
# puts the shared libraries beside the binaries (bin/), so llama-feed finds them through $ORIGIN.
# The commit comes from the build-info.cpp the build generates (llama-bench's build_commit).
peer_llama_build_script() {  # SRC_DIR BUILD_ROOT KIND JOBS CUDA_ARCH [FEED_SRC]
  local src=$1 root=$2 k=$3 jobs=$4 arch=$5 feed=${6:-} flags="-DGGML_CUDA=OFF"
  [ "$k" = cuda ] && flags="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$arch \
-DCMAKE_CUDA_COMPILER=${CUDACXX:-/usr/local/cuda/bin/nvcc}"
  cat << EOF
cmake -S '$src' -B '$root/$k' -G Ninja -DCMAKE_BUILD_TYPE=Release $flags \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > '$root/$k.log' 2>&1 &&
  ninja -C '$root/$k' -j $jobs llama-bench llama >> '$root/$k.log' 2>&1 &&
EOF
  [ -z "$feed" ] || cat << EOF
  commit=\$(sed -n 's/.*LLAMA_COMMIT = "\([^"]*\)".*/\1/p' '$root/$k/common/build-info.cpp') &&
  echo "llama-feed: g++ $feed against llama.cpp \$commit" >> '$root/$k.log' &&
  g++ -O2 -std=c++17 -I'$src/include' -I'$src/ggml/include' \
    -DLLAMA_FEED_BUILD_COMMIT="\"\$commit\"" '$feed' -o '$root/$k/bin/llama-feed' \
    -L'$root/$k/bin' -lllama -lggml -lggml-base -lggml-cpu -Wl,-rpath,'\$ORIGIN' \
    >> '$root/$k.log' 2>&1 &&
EOF
  echo "  true"
  echo "echo \$? > '$root/$k.rc'"
}

# Starts building llama-bench (and llama-feed from FEED_SRC, when given) for each kind (in the
# order given, one after the other) in the background, detached, and returns at once; kinds
# already built (llama-feed newer than its source) are skipped.
peer_llama_build_start() {  # SRC_DIR BUILD_ROOT KINDS(cpu,cuda) JOBS CUDA_ARCH [FEED_SRC]
  local src=$1 root=$2 kinds=$3 jobs=$4 arch=$5 feed=${6:-} k
  [ -z "$feed" ] || [ -f "$feed" ] || peer_die "llama-feed: no source $feed"
  mkdir -p "$root"
  : > "$root/build.sh"
  for k in ${kinds//,/ }; do
    if [ -x "$(peer_llama_bin "$root" "$k")" ] && [ "$(cat "$root/$k.rc" 2> /dev/null)" = 0 ] &&
      { [ -z "$feed" ] || [ "$(peer_llama_feed_bin "$root" "$k")" -nt "$feed" ]; }; then
      peer_log "llama.cpp $k: already built ($(peer_llama_bin "$root" "$k")${feed:+, llama-feed})"
      continue
    fi
    rm -f "$root/$k.rc"
    peer_llama_build_script "$src" "$root" "$k" "$jobs" "$arch" "$feed" >> "$root/build.sh"
    peer_log "llama.cpp $k: building llama-bench and llama-feed in $root/$k (log $root/$k.log)"
  done
  [ -s "$root/build.sh" ] || return 0
  (
    setsid nohup bash "$root/build.sh" > /dev/null 2>&1 &
    echo $! > "$root/build.pid"
  )
}

# Waits (at most LIMIT seconds) until no build that peer_llama_build_start began is running.
peer_llama_build_idle() {  # BUILD_ROOT LIMIT
  local deadline=$(($(date +%s) + $2))
  while peer_llama_building "$1"; do
    [ "$(date +%s)" -lt "$deadline" ] || peer_die "a llama.cpp build in $1 still runs after $2 s"
    sleep 2
  done
}

# Succeeds while a build that peer_llama_build_start began is still running.
peer_llama_building() {  # BUILD_ROOT
  local pid
  pid=$(cat "$1/build.pid" 2> /dev/null) && kill -0 "$pid" 2> /dev/null
}

# Waits (at most LIMIT seconds) for the builds of KINDS; fails naming the log of a failed one.
peer_llama_build_wait() {  # BUILD_ROOT KINDS LIMIT
  local root=$1 kinds=$2 limit=$3 k deadline=$(($(date +%s) + $3))
  for k in ${kinds//,/ }; do
    while [ ! -f "$root/$k.rc" ]; do
      [ -f "$root/build.pid" ] || peer_die "llama.cpp $k: no build started (build-start)"
      peer_llama_building "$root" || [ -f "$root/$k.rc" ] ||
        peer_die "llama.cpp $k: the build process is gone and left no status ($root/$k.log)"
      [ "$(date +%s)" -lt "$deadline" ] || peer_die "llama.cpp $k: not built after ${limit} s" \
        "($root/$k.log: $(tail -1 "$root/$k.log" 2> /dev/null))"
      sleep 2
    done
    if [ "$(cat "$root/$k.rc")" != 0 ]; then
      tail -20 "$root/$k.log" >&2
      peer_die "llama.cpp $k: the build failed (log $root/$k.log)"
    fi
    peer_log "llama.cpp $k: built ($(peer_llama_bin "$root" "$k"), $(peer_llama_feed_bin "$root" "$k"))"
  done
}
