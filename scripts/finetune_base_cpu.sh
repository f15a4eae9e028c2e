#!/usr/bin/env bash
# The Hugging Face LLaMA the CPU fine-tuning recipes start from, as a user would bring one: the quickstart's
# pretrained tiny model (trained first when missing) exported to runs/finetune-base/hf (config, safetensors,
# tokenizer with its chat template), then converted to TP2 x PP2 shards (runs/finetune-base/tp2pp2: SFT, DPO, the
# context extension) and to TP1 (runs/finetune-base/tp1: LoRA). Made once: run again, it says where the base is.
set -euo pipefail
cd "$(dirname "$0")/.."
base=runs/finetune-base
if [ -f "$base/tp2pp2/latest" ] && [ -f "$base/tp1/latest" ]; then
  echo "the fine-tuning base is made already: $base/hf (Hugging Face), $base/tp2pp2 (TP2 x PP2), $base/tp1 (TP1)"
  exit 0
fi
source scripts/common.sh
if [ ! -f "$base/hf/config.json" ]; then
  if [ ! -f runs/tiny-cpu/checkpoints/latest ]; then
    if [ ! -f data/processed/shakespeare_text_document.idx ]; then
      .venv/bin/llama-megatron preprocess --input data/corpus/shakespeare.jsonl --tokenizer data/tokenizer \
        --output-prefix data/processed/shakespeare --append-eod --workers 2
    fi
    launch 4 --module llama_megatron.train --config configs/pretrain/tiny-cpu.json
  fi
  .venv/bin/llama-megatron export --input runs/tiny-cpu/checkpoints --output "$base/hf" --tokenizer data/tokenizer \
    --overwrite
fi
for layout in "tp2pp2 --tp 2 --pp 2" "tp1 --tp 1"; do
  read -r name flags <<< "$layout"
  if [ ! -f "$base/$name/latest" ]; then
    # shellcheck disable=SC2086  # the flags are words
    .venv/bin/llama-megatron convert hf-to-megatron --hf-dir "$base/hf" --output "$base/$name" $flags --overwrite
  fi
done
