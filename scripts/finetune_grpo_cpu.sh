#!/usr/bin/env bash
# CPU online-RL recipe, after the SFT one: the SFT model of runs/sft-tiny-cpu (scripts/finetune_sft_cpu.sh, run first
# when missing) trained with GRPO to answer the digit it is asked (data/grpo/numbers.jsonl, built by
# scripts/make_grpo_data.py) at TP2 x PP2 with SP by 4 local processes (gloo): every step samples 8 completions of
# each of 4 prompts on the training weights themselves, scores them (math-verify's check of the final number, and of
# the first), and trains on their group advantages, a KL term holding it near the SFT model. The mean reward of the
# logged steps 1-10 is 0.07, of steps 30-40 0.72 (docs/grpo.md); then exported to Hugging Face and asked the sample
# prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f runs/sft-tiny-cpu/checkpoints/latest ]; then
  bash scripts/finetune_sft_cpu.sh
fi
if [ ! -f data/grpo/numbers.jsonl ]; then
  .venv/bin/python scripts/make_grpo_data.py
fi
bash scripts/finetune_run_cpu.sh configs/finetune/grpo-tiny-cpu.json runs/grpo-tiny-cpu "$@"
