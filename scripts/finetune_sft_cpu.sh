#!/usr/bin/env bash
# CPU SFT recipe, from a Hugging Face checkpoint to a generated answer: the tiny LLaMA in runs/finetune-base/hf
# (scripts/finetune_base_cpu.sh) converted to TP2 x PP2, fully fine-tuned on the shipped chat set (data/chat/,
# assistant turns only, packed) by 4 local processes (gloo), exported back to Hugging Face, and asked the sample
# prompts with its chat template. A few minutes on 2 cores; it overfits the set and answers its prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/finetune_base_cpu.sh
bash scripts/finetune_run_cpu.sh configs/finetune/sft-tiny-cpu.json runs/sft-tiny-cpu "$@"
