#!/usr/bin/env bash
# CPU LoRA recipe: TP2 (sequence parallel) LoRA fine-tuning of the tiny LLaMA on the shipped chat set, 2 local processes
# (gloo). The base is the HF checkpoint of scripts/finetune_base_cpu.sh converted to TP2 x PP2 (read per layer at
# TP2); the adapters are exported as a PEFT adapter directory and merged into full HF weights, and the adapter
# checkpoint answers the sample prompts. A few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/finetune_base_cpu.sh
export OMP_NUM_THREADS=1
.venv/bin/deepspeed --num_gpus 2 --module llama_megatron.train --config configs/finetune/lora-tiny-cpu.json "$@"
out=runs/lora-tiny-cpu
.venv/bin/llama-megatron export --input "$out/checkpoints" --output "$out/adapter" --base-model runs/finetune-base/hf \
  --overwrite
.venv/bin/llama-megatron export --input "$out/checkpoints" --output "$out/merged" --merge --tokenizer data/tokenizer \
  --overwrite
.venv/bin/deepspeed --num_gpus 2 --module llama_megatron generate --checkpoint "$out/checkpoints" \
  --tokenizer data/tokenizer --prompts data/chat/sample_prompts.jsonl --max-new-tokens 48 \
  --output "$out/answers.jsonl"
.venv/bin/llama-megatron plot "$out" --output "$out/metrics.png"
echo "adapter (PEFT): $out/adapter  merged HF model: $out/merged  base (HF): runs/finetune-base/hf  answers: $out/answers.jsonl"
