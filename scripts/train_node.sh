#!/usr/bin/env bash
# One node's share of a multi-node job, without ssh between nodes: the deepspeed launcher on this node, told its
# rank among the hostfile's nodes, starts this node's processes. Run it on every node at once (a scheduler's
# per-node task: SLURM's srun (scripts/slurm_train.sbatch does), a Kubernetes indexed Job, or by hand).
#
#   scripts/train_node.sh HOSTFILE NODE_RANK MASTER_ADDR MASTER_PORT CONFIG.json [--set key=value ...]
#
# HOSTFILE: one line per node, "hostname slots=GPUS", the same file and order on every node; NODE_RANK: this
# node's line (from 0); MASTER_ADDR: an address of the first node every node can reach. PYTHON picks the
# interpreter (default python3; a virtualenv's python works without activating it).
set -euo pipefail
HOSTFILE=${1:?usage: train_node.sh HOSTFILE NODE_RANK MASTER_ADDR MASTER_PORT CONFIG [--set k=v ...]}
NODE_RANK=${2:?node rank}; MASTER_ADDR=${3:?master address}; MASTER_PORT=${4:?master port}; CONFIG=${5:?config}
shift 5
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -u -m deepspeed.launcher.runner --hostfile "$HOSTFILE" --no_ssh --node_rank "$NODE_RANK" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --module llama_megatron.train --config "$CONFIG" "$@"
