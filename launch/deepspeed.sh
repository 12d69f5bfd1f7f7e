#!/usr/bin/env bash
# The DeepSpeed launcher: every host of a hostfile, `slots` processes per host.
#   launch/deepspeed.sh HOSTFILE CONFIG.yaml [KEY=VALUE ...] [--run-dir DIR]
# HOSTFILE lines are `HOST slots=N` (see launch/hostfile.example). With more than one host the
# launcher starts the other hosts' processes over pdsh/ssh (passwordless ssh from this host to all
# of them, same paths everywhere; or run it on every node with DEEPSPEED_ARGS="--no_ssh --node_rank
# N --master_addr NODE0"); with one host it starts them locally. Each process gets
# RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, which megaformer reads.
# Environment: MASTER_PORT (29500), PYTHON (the project's .venv/bin/python, else python3),
# OMP_NUM_THREADS (1), DEEPSPEED_ARGS (more
# launcher flags, e.g. --include host1:0,1). The config and layout are checked first.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 HOSTFILE CONFIG.yaml [KEY=VALUE ...] [--run-dir DIR]" >&2
  exit 2
fi
HOSTFILE=$1; shift
# shellcheck source=launch/python.sh
source "$(dirname "${BASH_SOURCE[0]}")/python.sh"
if [ ! -f "$HOSTFILE" ]; then
  echo "megaformer: error: hostfile $HOSTFILE: no such file" >&2
  exit 2
fi
WORLD=$(awk '!/^[[:space:]]*(#|$)/ { n = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) n = substr($i, 7); s += n } END { print s + 0 }' "$HOSTFILE")
if [ "$WORLD" -lt 1 ]; then
  echo "megaformer: error: hostfile $HOSTFILE: no hosts (expected lines 'HOST slots=N')" >&2
  exit 2
fi
HOSTS=$(awk '!/^[[:space:]]*(#|$)/ { print $1 }' "$HOSTFILE")
"$PYTHON" -m megaformer train "$@" --dry-run --world-size "$WORLD" > /dev/null
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ARGS=(--hostfile "$HOSTFILE" --master_port "${MASTER_PORT:-29500}" --no_local_rank)
if [ "$(echo "$HOSTS" | wc -l)" -eq 1 ]; then
  # one host: started locally, no ssh needed
  HOST=$(echo "$HOSTS" | head -1)
  [ "$HOST" = localhost ] && HOST=127.0.0.1
  ARGS+=(--no_ssh_check --master_addr "${MASTER_ADDR:-$HOST}")
fi
# shellcheck disable=SC2086
exec "$PYTHON" -m deepspeed.launcher.runner "${ARGS[@]}" ${DEEPSPEED_ARGS:-} --module megaformer train "$@"
