#!/usr/bin/env bash
# The second half of every CPU full fine-tuning recipe: train CONFIG on 4 local processes (gloo), export the
# checkpoints of OUT to Hugging Face (OUT/hf), ask the sample prompts (OUT/answers.jsonl), draw the curves. Run
# again, the training finds itself finished and says so, the export and the answers are up to date (newer than the
# checkpoint) and the curves are drawn again.
#   bash scripts/finetune_run_cpu.sh CONFIG OUT [--set key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
config=$1 out=$2
shift 2
source scripts/common.sh
launch 4 --module llama_megatron.train --config "$config" "$@"
if stale "$out/hf/config.json" "$out/checkpoints/latest"; then
  .venv/bin/llama-megatron export --input "$out/checkpoints" --output "$out/hf" --tokenizer data/tokenizer --overwrite
fi
if stale "$out/answers.jsonl" "$out/checkpoints/latest"; then
  launch 2 --module llama_megatron generate --checkpoint "$out/checkpoints" \
    --tokenizer data/tokenizer --prompts data/chat/sample_prompts.jsonl --max-new-tokens 48 \
    --output "$out/answers.jsonl" --overwrite
fi
.venv/bin/llama-megatron plot "$out" --output "$out/metrics.png"
echo "fine-tuned (HF): $out/hf  answers: $out/answers.jsonl  metrics: $out/metrics.jsonl"
