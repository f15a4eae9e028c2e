#!/usr/bin/env bash
# The second half of every CPU full fine-tuning recipe: train CONFIG on 4 local processes (gloo), export the
# checkpoints of OUT to Hugging Face (OUT/hf), ask the sample prompts (OUT/answers.jsonl), draw the curves.
#   bash scripts/finetune_run_cpu.sh CONFIG OUT [--set key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
config=$1 out=$2
shift 2
export OMP_NUM_THREADS=1
.venv/bin/deepspeed --num_gpus 4 --module llama_megatron.train --config "$config" "$@"
.venv/bin/llama-megatron export --input "$out/checkpoints" --output "$out/hf" --tokenizer data/tokenizer --overwrite
.venv/bin/deepspeed --num_gpus 2 --module llama_megatron generate --checkpoint "$out/checkpoints" \
  --tokenizer data/tokenizer --prompts data/chat/sample_prompts.jsonl --max-new-tokens 48 \
  --output "$out/answers.jsonl"
.venv/bin/llama-megatron plot "$out" --output "$out/metrics.png"
echo "fine-tuned (HF): $out/hf  answers: $out/answers.jsonl  metrics: $out/metrics.jsonl"
