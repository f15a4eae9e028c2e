#!/usr/bin/env bash
# CPU LoRA recipe: TP2 (sequence parallel) LoRA fine-tuning of the tiny LLaMA on the shipped corpus, 2 local processes
# (gloo). The base is the quickstart's TP2 x PP2 pretraining checkpoint (made first when missing); the adapters are
# exported as a PEFT adapter directory and merged into full HF weights. A few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=1
if [ ! -f data/processed/shakespeare_text_document.idx ]; then
  .venv/bin/llama-megatron preprocess --input data/corpus/shakespeare.jsonl --tokenizer data/tokenizer \
    --output-prefix data/processed/shakespeare --append-eod --workers 2
fi
if [ ! -f runs/tiny-cpu/checkpoints/latest ]; then  # the base model: the quickstart's pretraining run
  .venv/bin/deepspeed --num_gpus 4 --module llama_megatron.train --config configs/pretrain/tiny-cpu.json
fi
.venv/bin/deepspeed --num_gpus 2 --module llama_megatron.train --config configs/finetune/lora-tiny-cpu.json "$@"
out=runs/lora-tiny-cpu
.venv/bin/llama-megatron export --input runs/tiny-cpu/checkpoints --output "$out/base-hf" --tokenizer data/tokenizer \
  --overwrite
.venv/bin/llama-megatron export --input "$out/checkpoints" --output "$out/adapter" --base-model "$out/base-hf" \
  --overwrite
.venv/bin/llama-megatron export --input "$out/checkpoints" --output "$out/merged" --merge --tokenizer data/tokenizer \
  --overwrite
.venv/bin/llama-megatron plot "$out" --output "$out/metrics.png"
echo "adapter (PEFT): $out/adapter  merged HF model: $out/merged  base (HF): $out/base-hf  metrics: $out/metrics.jsonl"
