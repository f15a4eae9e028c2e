#!/usr/bin/env bash
# LLaMA-3-8B (8k context) extended to 32k tokens on one 8-GPU node: llama3 RoPE scaling (factor 4, chosen in
# configs/pretrain/llama3-8b-long-32k.json), tensor parallel 4 x context parallel 2 with SP, bf16 ZeRO-1,
# recomputation, per-document attention on packed long documents; then exported back to Hugging Face.
# Preprocess your long-document corpus to data/processed/long_text_document first (see docs/data.md).
# HF_DIR: the Hugging Face checkpoint (default models/Meta-Llama-3-8B).
set -euo pipefail
cd "$(dirname "$0")/.."
hf_dir=${HF_DIR:-models/Meta-Llama-3-8B}
if [ ! -f ckpt/llama3-8b-tp4/latest ]; then
  llama-megatron convert hf-to-megatron --hf-dir "$hf_dir" --output ckpt/llama3-8b-tp4 --tp 4
fi
deepspeed --num_gpus 8 --module llama_megatron.train --config configs/pretrain/llama3-8b-long-32k.json "$@"
llama-megatron export --input runs/llama3-8b-long-32k/checkpoints --output hf/llama3-8b-32k --dtype bf16 \
  --tokenizer ckpt/llama3-8b-tp4/hf_config
