#!/usr/bin/env bash
# Verifies the systemd units with systemd-analyze (works without systemd as PID 1): `verify` must
# be clean, and `security --offline` must rate the service at 2.0 or lower. The ExecStart path is
# pointed at the freshly built binary, as an install would.
set -euo pipefail
src=$1      # the repository's systemd/ folder
daemon=$2   # the built expertd
serve=${3:-}  # the built expert-serve: its unit is checked too when given
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sed "s#/usr/local/bin/expertd#$daemon#" "$src/expertd.service" > "$work/expertd.service"
cp "$src/expertd.socket" "$work/expertd.socket"
units=(./expertd.service ./expertd.socket)
if [ -n "$serve" ]; then
  sed "s#/usr/local/bin/expert-serve#$serve#" "$src/expert-serve@.service" \
    > "$work/expert-serve@.service"
  units+=(./expert-serve@model.service)  # an instance of the template
fi
cd "$work"
out=$(systemd-analyze verify "${units[@]}" 2>&1 || true)
if [ -n "$out" ]; then
  echo "systemd-analyze verify reported:"
  echo "$out"
  exit 1
fi
echo "systemd-analyze verify: clean"
score=$(systemd-analyze security --offline=true ./expertd.service 2>&1 |
  sed -n 's/.*Overall exposure level for expertd.service: \([0-9.]*\).*/\1/p')
echo "systemd-analyze security: exposure $score"
awk -v s="$score" 'BEGIN { exit !(s != "" && s <= 2.0) }' || {
  echo "exposure $score is above 2.0"; exit 1; }
if [ -n "$serve" ]; then
  score=$(systemd-analyze security --offline=true ./expert-serve@model.service 2>&1 |
    sed -n 's/.*Overall exposure level for expert-serve@model.service: \([0-9.]*\).*/\1/p')
  echo "systemd-analyze security: expert-serve@ exposure $score"
  awk -v s="$score" 'BEGIN { exit !(s != "" && s <= 2.0) }' || {
    echo "expert-serve@ exposure $score is above 2.0"; exit 1; }
fi
