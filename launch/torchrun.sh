#!/usr/bin/env bash
# torchrun launch, one node or several: NPROC processes per node (one per GPU, or CPU processes).
#   launch/torchrun.sh NPROC CONFIG.yaml [KEY=VALUE ...] [--run-dir DIR]
# Single node:  launch/torchrun.sh 8 configs/llama-1b.yaml
# Multi-node:   run the same line on every node with
#   NNODES=4 NODE_RANK=<0..3> RDZV_ENDPOINT=<node 0 host>:29400 launch/torchrun.sh 8 CONFIG.yaml
# Environment:  NNODES (1), NODE_RANK (0), RDZV_ENDPOINT (host:port of the c10d rendezvous; needed when
#   NNODES > 1), RDZV_ID (a job name shared by the nodes, default megaformer), MAX_RESTARTS (0: how
#   often torchrun restarts all workers after a failure; each restart resumes from the latest
#   checkpoint), PYTHON (default: the project's .venv/bin/python, else python3 on PATH),
#   OMP_NUM_THREADS (1), TORCHRUN_ARGS (more torchrun flags), LAYOUT=auto (a run relaunched with
#   another number of ranks than its first launch trains at the layout `megaformer plan` ranks
#   best for it, global batch kept; see launch/layout.sh), PLAN_ARGS (megaformer plan's hardware
#   flags for LAYOUT=auto, e.g. "--gpu H100-SXM").
# The config, the layout and the data paths are checked once before any process starts (one line
# and exit 2 on a mistake); an error a rank meets later is one line from rank 0 and exit 2 as well
# (megaformer.cli.torchrun: torchrun with the ranks' exit code, without its failure table).
# SIGTERM / SIGUSR1 to torchrun reach the workers, which save a checkpoint and exit 0; Ctrl-C
# (SIGINT) saves a checkpoint too and exits 130, a second Ctrl-C stops at once.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 NPROC CONFIG.yaml [KEY=VALUE ...] [--run-dir DIR]" >&2
  exit 2
fi
NPROC=$1; shift
# shellcheck source=launch/python.sh
source "$(dirname "${BASH_SOURCE[0]}")/python.sh"
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
if [ "${LAYOUT:-}" = auto ]; then  # the planner's layout when the run has another world size
  # shellcheck source=launch/layout.sh
  source "$(dirname "${BASH_SOURCE[0]}")/layout.sh"
  WORDS=$(auto_layout "$((NPROC * NNODES))" "$@") || exit 2
  # shellcheck disable=SC2086
  set -- "$@" $WORDS
fi
"$PYTHON" -m megaformer train "$@" --dry-run --world-size "$((NPROC * NNODES))" > /dev/null
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ARGS=(--nproc-per-node="$NPROC" --max-restarts="${MAX_RESTARTS:-0}")
if [ "$NNODES" -gt 1 ]; then
  if [ -z "${RDZV_ENDPOINT:-}" ]; then
    echo "$0: NNODES=$NNODES needs RDZV_ENDPOINT=host:port (node 0's address)" >&2
    exit 2
  fi
  ARGS+=(--nnodes="$NNODES" --node-rank="$NODE_RANK" --rdzv-backend=c10d
         --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-megaformer}")
else
  ARGS+=(--standalone)
fi
# forward Slurm's warning signal too (where this torchrun has --signals-to-handle)
# (read from torchrun's source: importing torch to ask would cost seconds)
RUN_PY=$("$PYTHON" -c 'import importlib.util as u, os; print(os.path.join(os.path.dirname(u.find_spec("torch").origin), "distributed", "run.py"))' 2>/dev/null)
if grep -qs -- --signals-to-handle "$RUN_PY"; then
  ARGS+=(--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1)
fi
# shellcheck disable=SC2086
exec "$PYTHON" -m megaformer.cli.torchrun "${ARGS[@]}" ${TORCHRUN_ARGS:-} -m megaformer train "$@"
