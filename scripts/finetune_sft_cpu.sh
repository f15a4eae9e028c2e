#!/usr/bin/env bash
# CPU SFT recipe, from a Hugging Face checkpoint to a generated answer: the tiny LLaMA in runs/finetune-base/hf
# (scripts/finetune_base_cpu.sh) converted to TP2 x PP2, fully fine-tuned on the shipped chat set (data/chat/,
# assistant turns only, packed) by 4 local processes (gloo), exported back to Hugging Face, and asked the sample
# prompts with its chat template. A few minutes on 2 cores; it overfits the set and answers its prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/finetune_base_cpu.sh
export OMP_NUM_THREADS=1
out=runs/sft-tiny-cpu
.venv/bin/deepspeed --num_gpus 4 --module llama_megatron.train --config configs/finetune/sft-tiny-cpu.json "$@"
.venv/bin/llama-megatron export --input "$out/checkpoints" --output "$out/hf" --tokenizer data/tokenizer --overwrite
.venv/bin/deepspeed --num_gpus 2 --module llama_megatron generate --checkpoint "$out/checkpoints" \
  --tokenizer data/tokenizer --prompts data/chat/sample_prompts.jsonl --max-new-tokens 48 \
  --output "$out/answers.jsonl"
.venv/bin/llama-megatron plot "$out" --output "$out/metrics.png"
echo "fine-tuned (HF): $out/hf  answers: $out/answers.jsonl  metrics: $out/metrics.jsonl"
