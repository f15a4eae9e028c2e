#!/usr/bin/env bash
# The Hugging Face LLaMA the CPU fine-tuning recipes start from, as a user would bring one: the quickstart's
# pretrained tiny model (trained first when missing) exported to runs/finetune-base/hf (config, safetensors,
# tokenizer with its chat template), then converted to TP2 x PP2 shards in runs/finetune-base/tp2pp2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=1
base=runs/finetune-base
if [ -f "$base/tp2pp2/latest" ]; then exit 0; fi
if [ ! -f runs/tiny-cpu/checkpoints/latest ]; then
  if [ ! -f data/processed/shakespeare_text_document.idx ]; then
    .venv/bin/llama-megatron preprocess --input data/corpus/shakespeare.jsonl --tokenizer data/tokenizer \
      --output-prefix data/processed/shakespeare --append-eod --workers 2
  fi
  .venv/bin/deepspeed --num_gpus 4 --module llama_megatron.train --config configs/pretrain/tiny-cpu.json
fi
.venv/bin/llama-megatron export --input runs/tiny-cpu/checkpoints --output "$base/hf" --tokenizer data/tokenizer \
  --overwrite
.venv/bin/llama-megatron convert hf-to-megatron --hf-dir "$base/hf" --output "$base/tp2pp2" --tp 2 --pp 2
