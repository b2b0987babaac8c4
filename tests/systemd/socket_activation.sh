#!/usr/bin/env bash
# expertd under socket activation, as expertd.socket starts it: systemd-socket-activate binds the
# socket and passes it (LISTEN_FDS); expertd must serve on it rather than bind its own.
set -euo pipefail
bin=$1  # build/bin
work=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
"$bin/expert-forge" -o "$work/m.gguf" --layers 2 --experts 4 --embd 256 --ff 256 >/dev/null 2>&1
systemd-socket-activate -l "$work/s.sock" "$bin/expertd" --model "m=$work/m.gguf" \
  --socket "$work/s.sock" --cache 16MiB --queue-depth 8 --no-mlock 2> "$work/log" &
pid=$!
for _ in $(seq 50); do [ -S "$work/s.sock" ] && break; sleep 0.1; done
out=$(timeout 20 "$bin/expertctl" models --socket "$work/s.sock")
echo "$out"
grep -q "^m " <<<"$out" || { echo "model m not listed"; cat "$work/log"; exit 1; }
grep -q "using the socket systemd passed" "$work/log" || { cat "$work/log"; exit 1; }
kill -TERM "$pid"
wait "$pid"
status=$?
pid=
[ "$status" -eq 0 ] || { echo "exit status $status"; cat "$work/log"; exit 1; }
echo "socket activation: served on the passed socket, exited 0"
