#!/usr/bin/env bash
# Stop the daemons tests/slurm/setup_local_slurm.sh started (listed in STATE_DIR/started.pids):
#   tests/slurm/stop_local_slurm.sh [STATE_DIR]      (default /tmp/megaformer-slurm)
# SIGTERM each (slurmd and slurmctld first, munged last), wait up to 10 s, then SIGKILL what is left.
# A pid that now belongs to another program is skipped. Exit 0 when none of them runs any more.
set -uo pipefail
STATE=${1:-/tmp/megaformer-slurm}
LIST=$STATE/started.pids
[ -s "$LIST" ] || exit 0

alive() { [ -d "/proc/$2" ] && [ "$(cat "/proc/$2/comm" 2>/dev/null)" = "$1" ]; }
order=$(grep -E '^slurmd ' "$LIST"; grep -E '^slurmctld ' "$LIST"; grep -E '^munged ' "$LIST")
while read -r name pid; do
  [ -n "$name" ] && alive "$name" "$pid" && kill -TERM "$pid" 2>/dev/null
done <<< "$order"
for _ in $(seq 100); do
  left=0
  while read -r name pid; do
    [ -n "$name" ] && alive "$name" "$pid" && left=1
  done <<< "$order"
  [ "$left" -eq 0 ] && break
  sleep 0.1
done
while read -r name pid; do
  if [ -n "$name" ] && alive "$name" "$pid"; then kill -KILL "$pid" 2>/dev/null; fi
done <<< "$order"
rm -f "$LIST"
exit 0
