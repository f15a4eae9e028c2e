#!/usr/bin/env bash
# CPU preference-tuning recipe, after the SFT one: the SFT model of runs/sft-tiny-cpu (scripts/finetune_sft_cpu.sh,
# run first when missing) tuned with DPO (sigmoid + sft) on the shipped preference pairs
# (data/chat/chat_preference.jsonl: each answer chosen over another question's) at TP2 x PP2 with SP by 4 local
# processes (gloo), the reference's log-probabilities computed once before the first step; then exported to
# Hugging Face and asked the sample prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f runs/sft-tiny-cpu/checkpoints/latest ]; then
  bash scripts/finetune_sft_cpu.sh
fi
bash scripts/finetune_run_cpu.sh configs/finetune/dpo-tiny-cpu.json runs/dpo-tiny-cpu "$@"
