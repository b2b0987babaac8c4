#!/bin/bash
# expertd under a real systemd: boots a minimal Debian tree with systemd as PID 1 in a
# systemd-nspawn container, installs the built binaries and systemd/ units into it, and checks
# socket activation, a client in the expertd group (and one outside it refused), the hardening
# (io_uring under SystemCallFilter, ProtectSystem=strict, MemoryDenyWriteExecute, NoNewPrivileges),
# reload, the fd store (a warm cache after `systemctl restart`, after a SIGKILL and after a watchdog
# abort) and a clean stop. Prints "ok:" or "FAIL:" per check; exits 1 if any failed.
#
#   sudo scripts/systemd-check.sh [BUILD_DIR]        (default: build)
#
# Needs root, debootstrap and systemd-container (apt-get install debootstrap systemd-container)
# and, the first time, Debian's mirror (the tree is kept in $EXPERTD_NSPAWN_ROOT,
# /var/lib/machines/expertd-check by default, and reused). The build needs expertd, expertctl,
# expert-forge and expert-tune. Takes about a minute once the tree exists.
set -uo pipefail

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
BUILD=$(realpath "${1:-build}")
SRC=$(cd "$(dirname "$0")/.." && pwd)
ROOT=${EXPERTD_NSPAWN_ROOT:-/var/lib/machines/expertd-check}
SOCK=/run/expertd/expertd.sock
FAILED=0
ok() { echo "ok: $*"; }
fail() {
  echo "FAIL: $*"
  FAILED=1
}

for b in expertd expertctl expert-forge expert-tune; do
  [[ -x $BUILD/bin/$b ]] || { echo "systemd-check: $BUILD/bin/$b is missing (build it)"; exit 2; }
done
command -v systemd-nspawn >/dev/null || { echo "systemd-check: no systemd-nspawn"; exit 2; }

# --- the tree -------------------------------------------------------------------------------
if [[ ! -x $ROOT/lib/systemd/systemd ]]; then
  debootstrap --variant=minbase \
    --include=systemd,systemd-sysv,dbus,util-linux,procps,libtomlplusplus3,libspdlog1.10,libcapnp-0.9.2,liburing2,libfmt9 \
    bookworm "$ROOT" http://deb.debian.org/debian || { echo "systemd-check: debootstrap failed"; exit 2; }
fi
install -m 0755 "$BUILD"/bin/{expertd,expertctl,expert-tune} "$ROOT/usr/local/bin/"
install -m 0644 "$SRC"/systemd/expertd.{service,socket} "$ROOT/etc/systemd/system/"
install -D -m 0644 "$SRC/systemd/expertd.sysusers" "$ROOT/usr/lib/sysusers.d/expertd.conf"
install -D -m 0644 "$SRC/systemd/expertd.tmpfiles" "$ROOT/usr/lib/tmpfiles.d/expertd.conf"
mkdir -p "$ROOT/srv/models" "$ROOT/etc/expertd"
[[ -f $ROOT/srv/models/m.gguf ]] ||
  "$BUILD/bin/expert-forge" --layers 8 --experts 16 --embd 128 --ff 256 --seed 11 \
    -o "$ROOT/srv/models/m.gguf" >/dev/null
"$BUILD/bin/expert-tune" synth --layers 8 --experts 16 --top-k 2 --tokens 40 \
  -o "$ROOT/srv/models/t.etrace" >/dev/null
chmod -R a+rX "$ROOT/srv/models"
cat >"$ROOT/etc/expertd/expertd.toml" <<'EOF'
cache = "8MiB"
staging = "1MiB"
prefetch_depth = 0
[models]
m = "/srv/models/m.gguf"
EOF
systemd-sysusers --root="$ROOT" >/dev/null
chroot "$ROOT" sh -c 'id alice >/dev/null 2>&1 || useradd -m -G expertd alice;
                      id bob >/dev/null 2>&1 || useradd -m bob'

# --- boot -----------------------------------------------------------------------------------
# --rlimit: the unit's LimitMEMLOCK=infinity can only reach the container's own hard limit.
systemd-nspawn -D "$ROOT" --boot --register=no --keep-unit --console=pipe --rlimit=MEMLOCK=infinity \
  >/tmp/expertd-systemd-check.console 2>&1 &
NSPAWN=$!
cleanup() {
  [[ -n ${LEADER:-} ]] && nsenter -t "$LEADER" -a systemctl poweroff >/dev/null 2>&1
  for _ in $(seq 50); do kill -0 "$NSPAWN" 2>/dev/null || return; sleep 0.2; done
  kill "$NSPAWN" 2>/dev/null
}
trap cleanup EXIT
LEADER=
for _ in $(seq 100); do
  LEADER=$(pgrep -P "$NSPAWN" -x systemd | head -1)
  [[ -n $LEADER ]] && break
  sleep 0.1
done
[[ -n $LEADER ]] || { echo "systemd-check: the container did not start:"; cat /tmp/expertd-systemd-check.console; exit 2; }
X() { nsenter -t "$LEADER" -a "$@"; }
for _ in $(seq 100); do X test -S /run/systemd/private && break; sleep 0.1; done
state=$(X systemctl is-system-running --wait 2>/dev/null)
[[ $state == running || $state == degraded ]] && ok "systemd $(X systemctl --version | head -1 | cut -d' ' -f2) is PID 1 ($state)" ||
  fail "the container's systemd is '$state'"

main_pid() { X systemctl show -P MainPID expertd.service; }
stat_field() {  # stat_field FIELD: models[0].FIELD of `expertctl --json stats`, as alice
  X runuser -u alice -- expertctl stats --socket $SOCK --json |
    python3 -c "import json,sys; print(json.load(sys.stdin)['models'][0]['$1'])"
}
wait_active() {  # a new main pid other than $1
  for _ in $(seq 150); do
    local p
    p=$(main_pid)
    [[ $(X systemctl is-active expertd.service) == active && $p != 0 && $p != "$1" ]] && return 0
    sleep 0.2
  done
  return 1
}
journal() { X journalctl -b -u expertd.service --no-pager -o cat; }
# How many of the unit's journal lines match (case-insensitive ERE). Counting reads the whole
# journal: `journal | grep -q` under pipefail fails when grep stops early and journalctl gets
# SIGPIPE, which happens whenever an earlier line already matches.
journal_count() { journal | grep -ciE "$1"; }

# --- socket activation, groups --------------------------------------------------------------
X systemctl daemon-reload
X systemctl start expertd.socket
[[ $(X systemctl is-active expertd.socket) == active && $(X systemctl is-active expertd.service) != active ]] &&
  X test -S $SOCK && ok "expertd.socket listens on $SOCK, expertd.service not started yet" ||
  fail "expertd.socket $(X systemctl is-active expertd.socket), expertd.service $(X systemctl is-active expertd.service)"
if X runuser -u alice -- expertctl status --socket $SOCK >/dev/null; then
  ok "alice (group expertd) connects; the connection started expertd.service (socket activation)"
else
  fail "alice (group expertd) cannot use expertctl: $(X runuser -u alice -- expertctl status --socket $SOCK 2>&1)"
fi
wait_active 0 && ok "expertd.service active (Type=notify: READY=1)" ||
  fail "expertd.service is $(X systemctl is-active expertd.service)"
out=$(X runuser -u bob -- expertctl status --socket $SOCK 2>&1) &&
  fail "bob (not in the group) was let in" || ok "bob (not in group expertd) refused: $out"

# --- hardening ------------------------------------------------------------------------------
PID=$(main_pid)
backend=$(X runuser -u alice -- expertctl status --socket $SOCK | grep -i backend | head -1)
[[ $backend == *uring* ]] && ok "io_uring works under SystemCallFilter: $backend" ||
  fail "not io_uring under the filter: $backend ($(journal | grep -i -m1 'fall'))"
seccomp=$(X grep -E '^(Seccomp|NoNewPrivs):' /proc/"$PID"/status | tr -s '\t ' ' ' | tr '\n' ' ')
[[ $seccomp == *"NoNewPrivs: 1"*"Seccomp: 2"* ]] && ok "seccomp filter and no_new_privs on the daemon: $seccomp" ||
  fail "seccomp/no_new_privs: $seccomp"
rootopts=$(X nsenter -t "$PID" -m findmnt -no OPTIONS /)
[[ $rootopts == ro,* ]] && ok "ProtectSystem=strict: / is '$rootopts' in the daemon's namespace" ||
  fail "ProtectSystem: / is '$rootopts'"
if X nsenter -t "$PID" -m -S "$(X stat -c %u /proc/"$PID")" touch /var/lib/x 2>/dev/null; then
  fail "the daemon's namespace can write /var/lib"
else
  ok "the daemon's namespace cannot write /var/lib"
fi
mdwe=$(X systemctl show -P MemoryDenyWriteExecute expertd.service)
[[ $mdwe == yes ]] && ok "MemoryDenyWriteExecute=yes and the daemon runs under it" || fail "MemoryDenyWriteExecute=$mdwe"
# expertd's own lines (systemd's about the container's loopback device are not its).
errors=$(journal | grep '^<' | grep -v 'not locked' | grep -ciE 'not permitted|EPERM|seccomp')
[[ $errors == 0 ]] && ok "no EPERM in expertd's log" ||
  fail "$errors EPERM lines: $(journal | grep '^<' | grep -iE -m3 'not permitted|EPERM')"
memlock=$(X grep 'Max locked memory' /proc/"$PID"/limits | tr -s ' ' | cut -d' ' -f5)
if [[ $(journal_count 'arena not locked') == 0 ]]; then
  ok "the arena is mlocked (RLIMIT_MEMLOCK $memlock)"
elif [[ $memlock != unlimited && $(ulimit -Hl) != unlimited ]]; then
  echo "note: the arena is not mlocked: RLIMIT_MEMLOCK is $memlock bytes, the host's own hard limit" \
    "($(ulimit -Hl) KiB), which LimitMEMLOCK=infinity cannot raise without CAP_SYS_RESOURCE"
else
  fail "the arena is not mlocked (RLIMIT_MEMLOCK $memlock): $(journal | grep -m1 'not locked')"
fi

# --- reload ---------------------------------------------------------------------------------
X systemctl reload expertd.service
for _ in $(seq 50); do [[ $(journal_count "reload: tunables applied") -gt 0 ]] && break; sleep 0.1; done
[[ $(journal_count "reload: tunables applied") -gt 0 ]] && ok "systemctl reload: $(journal | grep -m1 'reload: tunables')" ||
  fail "reload: $(journal | grep -m2 reload)"

# --- the fd store ---------------------------------------------------------------------------
# Each backend in turn: io_uring (the default; its arena is populated with write faults, so a
# hand-over keeps what READ_FIXED wrote, docs/RELIABILITY.md "Warm restart"), then pread.
for backend in uring pread; do
X sed -i '/^backend = /d' /etc/expertd/expertd.toml
X sed -i "s/^prefetch_depth = 0\$/prefetch_depth = 0\nbackend = \"$backend\"/" /etc/expertd/expertd.toml
X systemctl restart expertd.service
wait_active 0 || fail "restart on the $backend backend"
evicted=$(X expertctl evict-all m --socket $SOCK 2>&1)  # as root: an admin; a cold start for this backend
X runuser -u alice -- expert-tune replay --socket $SOCK --model m --trace /srv/models/t.etrace >/dev/null
cached=$(stat_field cache_ready)
nstore=$(X systemctl show -P NFileDescriptorStore expertd.service)
[[ $nstore == 3 ]] && ok "$backend: 3 fds in systemd's fd store (manifest, arena, slot table); $cached experts cached" ||
  fail "$backend: NFileDescriptorStore=$nstore"
check_warm() {  # check_warm WHAT OLDPID
  if ! wait_active "$2"; then
    fail "$1: expertd.service did not come back ($(X systemctl is-active expertd.service))"
    return
  fi
  local now line
  for _ in $(seq 50); do X runuser -u alice -- expertctl status --socket $SOCK >/dev/null 2>&1 && break; sleep 0.1; done
  now=$(stat_field cache_ready)
  line=$(journal | grep 'cached experts taken over' | tail -1)
  [[ $now -gt 0 && $now == "$cached" ]] && ok "$1: warm, $now of $cached experts back ($line)" ||
    fail "$1: $now of $cached experts back; $(journal | grep -E 'warm restart' | tail -2)"
}
PID=$(main_pid)
X systemctl restart expertd.service
check_warm "$backend: systemctl restart" "$PID"
PID=$(main_pid)
X systemctl kill -s SIGKILL expertd.service
check_warm "$backend: SIGKILL (Restart=on-failure)" "$PID"
PID=$(main_pid)
before=$(journal | grep -c 'cached experts taken over')
X systemctl kill -s SIGUSR2 --kill-who=main expertd.service  # exec in place, fds inherited
for _ in $(seq 100); do [[ $(journal | grep -c 'cached experts taken over') -gt $before ]] && break; sleep 0.1; done
for _ in $(seq 50); do X runuser -u alice -- expertctl status --socket $SOCK >/dev/null 2>&1 && break; sleep 0.1; done
now=$(stat_field cache_ready)
[[ $(main_pid) == "$PID" && $now == "$cached" ]] &&
  ok "$backend: SIGUSR2: exec in place (main pid $PID kept), warm, $now of $cached experts back" ||
  fail "$backend: SIGUSR2: main pid $PID -> $(main_pid), $now of $cached experts back"
PID=$(main_pid)
timeouts=$(journal_count "watchdog timeout")
X systemctl kill -s SIGSTOP expertd.service  # no more WATCHDOG=1: WatchdogSec=10s aborts it
sleep 0.5
for _ in $(seq 200); do [[ $(journal_count "watchdog timeout") -gt $timeouts ]] && break; sleep 0.1; done
[[ $(journal_count "watchdog timeout") -gt $timeouts ]] && ok "$backend: watchdog: a stopped daemon was aborted ($(journal | grep -i 'watchdog timeout' | tail -1))" ||
  fail "$backend: watchdog: no timeout within 20 s"
check_warm "$backend: watchdog restart" "$PID"

nstore=$(X systemctl show -P NFileDescriptorStore expertd.service)
[[ $nstore == 3 ]] && ok "$backend: after 4 restarts still 3 fds in the store (each start replaced the last one's)" ||
  fail "$backend: after 4 restarts NFileDescriptorStore=$nstore (the old entries were not removed)"
done

# --- stop -----------------------------------------------------------------------------------
X systemctl stop expertd.service
result=$(X systemctl show -P ExecMainStatus expertd.service)
[[ $result == 0 ]] && ok "systemctl stop: exit status 0" || fail "systemctl stop: exit status $result"
nstore=$(X systemctl show -P NFileDescriptorStore expertd.service)
[[ $nstore == 0 ]] && ok "systemctl stop empties the fd store (the next start is cold)" ||
  echo "note: after systemctl stop the fd store still holds $nstore fds"
exit $FAILED
