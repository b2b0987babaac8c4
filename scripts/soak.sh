#!/usr/bin/env bash
# The soak (issue 14): expertd for a long while under clients that check every byte, clients killed
# at random moments, injected read faults when the build has them, and restarts under the clients.
# It prints figures as it goes and a summary, and exits non-zero on any wrong byte, a leak (the
# daemon's fds not back to their baseline once every client is gone, or its RSS grown by more than
# --rss-slack-mib), or a daemon that did not exit 0 on SIGTERM.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/soak.sh [--minutes N] [--clients N] [--restart-every M] [--faults SPEC]
                       [--bin DIR] [--work DIR] [--rss-slack-mib N]

  --minutes N         how long to soak (default 30)
  --clients N         verifying clients, each a process that reconnects across restarts (default 4)
  --restart-every M   restart expertd (SIGTERM, start again) every M minutes under the clients;
                      0: never (default 5)
  --faults SPEC       inject read faults with expertd-test: the value of its fault hook
                      (EXPERTD_TEST_FAULTS); default eio=0.01,short=0.01,eagain=0.01 when it
                      has the hook, none when it has not (the summary says which); none: off
  --bin DIR           the build's bin directory (default build/bin)
  --work DIR          where the model, logs and figures go (default a new /tmp/expertd-soak.*)
  --rss-slack-mib N   RSS growth allowed between the first and the last sample of one daemon
                      (default 64)

Besides the verifying clients, a killer starts one client at a time that holds and prefetches,
and SIGKILLs it 0-2 s later. Figures every 30 s: time, daemon pid, RSS, fds, sessions, acquires,
hit rate. Summary: acquires, experts, MB verified, wrong bytes, errors, reconnects, kills,
restarts, acquire p50/p99 over every client, fds and RSS at the start and the end.
EOF
}

minutes=30
clients=4
restart_every=5
faults=default
bin=build/bin
work=
rss_slack_mib=64
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) minutes=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;;
    --restart-every) restart_every=$2; shift 2 ;;
    --faults) faults=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --rss-slack-mib) rss_slack_mib=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "soak.sh: unknown option '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
for b in expertd expertd-test expert-forge expertctl expert-chaos-client; do
  [ -x "$bin/$b" ] || { echo "soak.sh: $bin/$b is missing (build it: ninja -C build $b)" >&2; exit 2; }
done
bin=$(cd "$bin" && pwd)
work=${work:-$(mktemp -d /tmp/expertd-soak.XXXXXX)}
mkdir -p "$work"
sock="$work/expertd.sock"
lat="$work/latencies.bin"
: > "$lat"

# The fault hook, if this build's expertd-test has one.
daemon_bin=expertd
daemon_env=()
fault_note="none (expertd has no fault hook in this build)"
if grep -aq EXPERTD_TEST_FAULTS "$bin/expertd-test"; then
  [ "$faults" = default ] && faults=eio=0.01,short=0.01,eagain=0.01
  if [ "$faults" != none ]; then
    daemon_bin=expertd-test
    daemon_env=("EXPERTD_TEST_FAULTS=$faults")
    fault_note="$faults (expertd-test)"
  fi
elif [ "$faults" != default ] && [ "$faults" != none ]; then
  echo "soak.sh: --faults $faults: $bin/expertd-test has no EXPERTD_TEST_FAULTS hook" >&2
  exit 2
fi

daemon_pid=
killer_pid=
client_pids=()
cleanup() {
  for p in "${client_pids[@]}" $killer_pid; do kill -KILL "$p" 2>/dev/null || true; done
  [ -n "$daemon_pid" ] && kill -TERM "$daemon_pid" 2>/dev/null || true
}
trap cleanup EXIT

# A model of 8 layers x 32 experts (430 MB, 1.7 MB an expert) and a 64 MiB cache: most acquires
# read, and slots are reused all the time.
model="$work/soak.gguf"
[ -f "$model" ] || "$bin/expert-forge" --layers 8 --experts 32 --embd 512 --ff 1024 --seed 5 \
  -o "$model" >/dev/null

restarts=0
failures=()
start_daemon() {
  env "${daemon_env[@]}" "$bin/$daemon_bin" --model "soak=$model" --socket "$sock" --cache 64MiB \
    --staging 8MiB --no-mlock >> "$work/expertd.log" 2>&1 &
  daemon_pid=$!
  for _ in $(seq 200); do
    "$bin/expertctl" status --socket "$sock" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "soak.sh: expertd did not start; its log:" >&2
  tail -20 "$work/expertd.log" >&2
  exit 1
}
stop_daemon() {
  kill -TERM "$daemon_pid"
  local rc=0
  wait "$daemon_pid" || rc=$?
  [ "$rc" = 0 ] || failures+=("expertd $daemon_pid exited $rc on SIGTERM")
  daemon_pid=
}
fds() { (ls "/proc/$daemon_pid/fd" 2>/dev/null || true) | wc -l; }
# The fd count once a closed control connection (expertctl's) has been let go: two equal readings.
stable_fds() {
  local a b
  a=$(fds)
  for _ in $(seq 50); do
    sleep 0.1
    b=$(fds)
    [ "$a" = "$b" ] && break
    a=$b
  done
  echo "$b"
}
rss_mib() { awk '/VmRSS/ { printf "%d", $2 / 1024 }' "/proc/$daemon_pid/status" 2>/dev/null; }
# sessions, acquires and hit rate of the running daemon
daemon_figures() {
  "$bin/expertctl" stats --json --socket "$sock" 2>/dev/null | python3 -c '
import json, sys
j = json.load(sys.stdin)
s = j["models"][0]["scheduler"]
n = s["hits"] + s["misses"]
print(len(j["sessions"]), s["acquires"], "%.1f%%" % (100.0 * s["hits"] / n if n else 0.0))
' 2>/dev/null || echo "- - -"
}

start_daemon
base_fds=$(stable_fds)
base_rss=$(rss_mib)
first_fds=$base_fds
first_rss=$base_rss
end=$(( $(date +%s) + minutes * 60 ))
echo "soak: $minutes min, $clients verifying clients, restarts every ${restart_every} min," \
  "faults: $fault_note; work dir $work"
echo "soak: expertd $daemon_pid: $base_fds fds, $base_rss MiB RSS with no client"

for i in $(seq "$clients"); do
  "$bin/expert-chaos-client" --socket "$sock" --model soak --name "verify-$i" --seed "$i" \
    --seconds $(( minutes * 60 + 60 )) --prefetch --reconnect --latencies "$lat" \
    > "$work/client-$i.out" 2>&1 &
  client_pids+=($!)
done

# The killer: one holding, prefetching client at a time, SIGKILLed 0-2 s after its start.
(
  kills=0
  while [ "$(date +%s)" -lt "$end" ]; do
    "$bin/expert-chaos-client" --socket "$sock" --model soak --name doomed --hold --prefetch \
      --seed "$RANDOM" --seconds 60 > /dev/null 2>&1 &
    p=$!
    sleep "$(( RANDOM % 2000 / 1000 )).$(printf %03d $(( RANDOM % 1000 )))"
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
    kills=$((kills + 1))
    echo "$kills" > "$work/kills"
  done
) &
killer_pid=$!

next_restart=$(( restart_every > 0 ? $(date +%s) + restart_every * 60 : end + 1 ))
t0=$(date +%s)
printf '%6s %8s %8s %5s %9s %10s %7s\n' time pid rss_mib fds sessions acquires hit_rate | tee "$work/samples.txt"
while [ "$(date +%s)" -lt "$end" ]; do
  sleep 30
  read -r sessions acquires hits <<< "$(daemon_figures)"
  rss=$(rss_mib)
  printf '%5ss %8s %8s %5s %9s %10s %7s\n' $(( $(date +%s) - t0 )) "$daemon_pid" "$rss" "$(fds)" \
    "$sessions" "$acquires" "$hits" | tee -a "$work/samples.txt"
  if [ -n "$rss" ] && [ "$rss" -gt $(( base_rss + rss_slack_mib + 64 + 8 )) ]; then
    failures+=("expertd $daemon_pid RSS $rss MiB (started at $base_rss MiB, arena 72 MiB)")
  fi
  now=$(date +%s)
  if [ "$now" -ge "$next_restart" ] && [ "$now" -lt $(( end - 45 )) ]; then
    stop_daemon
    start_daemon
    restarts=$((restarts + 1))
    base_fds=$(stable_fds)
    base_rss=$(rss_mib)
    echo "soak: restarted under the clients: expertd $daemon_pid ($base_fds fds, $base_rss MiB" \
      "with the clients back)"
    next_restart=$(( now + restart_every * 60 ))
  fi
done

# The end: every client stops; the daemon must come back to its baseline.
wait "$killer_pid" 2>/dev/null || true
killer_pid=
for p in "${client_pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
for p in "${client_pids[@]}"; do wait "$p" 2>/dev/null || true; done
client_pids=()
for _ in $(seq 100); do
  read -r sessions _ _ <<< "$(daemon_figures)"
  [ "$sessions" = 0 ] && [ "$(fds)" = "$first_fds" ] && break
  sleep 0.1
done
end_fds=$(fds)
end_rss=$(rss_mib)
[ "$sessions" = 0 ] || failures+=("$sessions sessions left after every client exited")
# Every expertd of the soak has the same fds with no client as the first had (the later ones are
# never seen without clients: those reconnect at once).
[ "$end_fds" = "$first_fds" ] || failures+=("expertd fds $first_fds -> $end_fds with no client")
[ "$end_rss" -le $(( first_rss + 64 + 8 + rss_slack_mib )) ] ||
  failures+=("expertd RSS $first_rss -> $end_rss MiB")
hostile=$("$bin/expertctl" stats --json --socket "$sock" | python3 -c \
  'import json,sys; print(json.load(sys.stdin)["sessions_closed_hostile"])')
"$bin/expertctl" metrics --socket "$sock" > "$work/metrics.prom"
stop_daemon

python3 - "$work" "$lat" <<'EOF' | tee "$work/summary.txt"
import glob, json, struct, sys
work, lat = sys.argv[1], sys.argv[2]
tot = dict(acquires=0, experts=0, bytes_verified=0, wrong_bytes=0, errors=0, reconnects=0)
errs = []
for f in sorted(glob.glob(work + "/client-*.out")):
    lines = [l for l in open(f) if l.startswith("{")]
    if not lines:
        print(f"{f}: no summary (the client died?)")
        tot["errors"] += 1
        continue
    j = json.loads(lines[-1])
    for k in tot:
        tot[k] += j[k]
    errs += j["first_errors"]
raw = open(lat, "rb").read()
us = sorted(struct.unpack(f"{len(raw) // 4}I", raw))
pct = lambda p: us[min(len(us) - 1, int(p * len(us)))] if us else 0
print(f"acquires {tot['acquires']} ({tot['experts']} experts, "
      f"{tot['bytes_verified'] / 1e6:.0f} MB verified), wrong bytes {tot['wrong_bytes']}, "
      f"errors {tot['errors']}, reconnects {tot['reconnects']}")
print(f"acquire latency over every client: p50 {pct(0.5)} us, p99 {pct(0.99)} us, "
      f"max {us[-1] if us else 0} us")
for e in sorted(set(errs))[:8]:
    print(f"  error seen: {e}")
EOF
wrong=$(awk '/wrong bytes/ { for (i = 1; i <= NF; ++i) if ($i == "bytes") { print $(i + 1) + 0; exit } }' \
  "$work/summary.txt")
[ "${wrong:-1}" = 0 ] || failures+=("wrong bytes: ${wrong:-unknown}")
echo "kills $(cat "$work/kills" 2>/dev/null || echo 0), restarts $restarts," \
  "sessions closed as hostile $hostile, faults: $fault_note"
echo "expertd with no client: $first_fds fds and $first_rss MiB RSS at the start," \
  "$end_fds fds and $end_rss MiB RSS at the end (after $restarts restarts)"
echo "figures over time: $work/samples.txt; last metrics: $work/metrics.prom"
if [ ${#failures[@]} -gt 0 ]; then
  printf 'soak: FAILED: %s\n' "${failures[@]}"
  exit 1
fi
echo "soak: passed ($minutes min)"
