#!/usr/bin/env bash
# CPU quickstart: tokenise the shipped corpus, then a TP2 x PP2 pretraining run of a tiny LLaMA under the
# deepspeed launcher (4 local processes, gloo), with evaluation and checkpoints. About a minute on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=1
if [ ! -f data/processed/shakespeare_text_document.idx ]; then
  .venv/bin/llama-megatron preprocess --input data/corpus/shakespeare.jsonl --tokenizer data/tokenizer \
    --output-prefix data/processed/shakespeare --append-eod --workers 2
fi
.venv/bin/deepspeed --num_gpus 4 --module llama_megatron.train --config configs/pretrain/tiny-cpu.json "$@"
.venv/bin/llama-megatron plot runs/tiny-cpu --output runs/tiny-cpu/metrics.png
echo "metrics: runs/tiny-cpu/metrics.jsonl (plot: runs/tiny-cpu/metrics.png)  checkpoints: runs/tiny-cpu/checkpoints  tensorboard: runs/tiny-cpu/tensorboard"
