#!/usr/bin/env bash
# LLaMA-2-7B pretraining on one 8-GPU node: TP2 x PP2 x DP2, sequence parallel, ZeRO-1, bf16.
# Preprocess your corpora to data/processed/{web,code}_text_document first (see docs/data.md).
set -euo pipefail
cd "$(dirname "$0")/.."
deepspeed --num_gpus 8 --module llama_megatron.train --config configs/pretrain/llama2-7b-tp2-pp2.json "$@"
