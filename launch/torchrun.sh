#!/usr/bin/env bash
# Data-parallel training on one node with torchrun: one process per GPU (or N CPU processes).
#   launch/torchrun.sh NPROC CONFIG.yaml [KEY=VALUE ...] [--run-dir DIR]
# Example: launch/torchrun.sh 2 configs/quickstart.yaml train.steps=50
# The config and the layout are checked once before any process starts (one line and exit 2 on a
# mistake). torchrun's own flags (--nnodes, --node_rank, --rdzv_endpoint) go in TORCHRUN_ARGS;
# Slurm and hostfile launchers arrive with the cluster work.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 NPROC CONFIG.yaml [KEY=VALUE ...] [--run-dir DIR]" >&2
  exit 2
fi
NPROC=$1; shift
PYTHON=${PYTHON:-python}
"$PYTHON" -m megaformer train "$@" --dry-run --world-size "$NPROC" > /dev/null
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m torch.distributed.run --nproc_per_node="$NPROC" ${TORCHRUN_ARGS:-} -m megaformer train "$@"
