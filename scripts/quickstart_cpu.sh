#!/usr/bin/env bash
# CPU quickstart: tokenise the shipped corpus, then a TP2 x PP2 pretraining run of a tiny LLaMA under the
# deepspeed launcher (4 local processes, gloo), with evaluation (validation loss and an lm-eval task) and checkpoints.
# One to two minutes on 2 cores.
# Run again, it finds the run finished (the same config, seed and data at its last step), says so and draws the plot
# again; `bash scripts/quickstart_cpu.sh --set checkpoint.overwrite=true` trains it again from the start.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
if [ ! -f data/processed/shakespeare_text_document.idx ]; then
  .venv/bin/llama-megatron preprocess --input data/corpus/shakespeare.jsonl --tokenizer data/tokenizer \
    --output-prefix data/processed/shakespeare --append-eod --workers 2
fi
launch 4 --module llama_megatron.train --config configs/pretrain/tiny-cpu.json "$@"
.venv/bin/llama-megatron plot runs/tiny-cpu --output runs/tiny-cpu/metrics.png
echo "metrics: runs/tiny-cpu/metrics.jsonl (plot: runs/tiny-cpu/metrics.png)  checkpoints: runs/tiny-cpu/checkpoints  tensorboard: runs/tiny-cpu/tensorboard"
