#!/usr/bin/env bash
# Multi-node launch with a DeepSpeed hostfile (one line per node: "hostname slots=8"); needs passwordless ssh
# between nodes and the repo + data at the same path on every node (checkpoints on a shared filesystem).
# Usage: scripts/pretrain_multinode.sh hostfile MASTER_ADDR configs/pretrain/X.json [--set key=value ...]
set -euo pipefail
HOSTFILE=${1:?hostfile}; MASTER=${2:?master address}; CONFIG=${3:?training config}; shift 3
cd "$(dirname "$0")/.."
deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER" --master_port 29500 \
  --module llama_megatron.train --config "$CONFIG" "$@"
