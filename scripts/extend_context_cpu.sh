#!/usr/bin/env bash
# CPU long-context recipe: the tiny LLaMA in runs/finetune-base (a Hugging Face checkpoint trained at 128 tokens,
# converted to TP2 x PP2 by scripts/finetune_base_cpu.sh) extended to 1024 tokens: linear RoPE scaling (factor 8,
# chosen in configs/pretrain/tiny-long-cpu.json), context parallelism 2 x tensor parallelism 2 with SP (4 local
# processes, gloo), per-document attention on packed Shakespeare scenes, then exported back to Hugging Face with
# the new rope_scaling in config.json. Validation loss at 1024 tokens is printed before (with and without the
# scaling) and after. About 2 minutes on 2 cores. Run again, it finds the run finished and the evaluations up to date
# (newer than the base), and prints the same losses.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/finetune_base_cpu.sh
source scripts/common.sh
config=configs/pretrain/tiny-long-cpu.json
out=runs/tiny-long-cpu
train=(--module llama_megatron.train --config "$config")
base=runs/finetune-base/tp2pp2/latest
if stale "$out/eval-base-no-scaling/metrics.jsonl" "$base"; then
  launch 4 "${train[@]}" --eval-only --set output_dir=$out/eval-base-no-scaling --set model.rope_scaling=null "$@"
fi
if stale "$out/eval-base/metrics.jsonl" "$base"; then
  launch 4 "${train[@]}" --eval-only --set output_dir=$out/eval-base "$@"
fi
launch 4 "${train[@]}" "$@"
if stale "$out/hf/config.json" "$out/checkpoints/latest"; then
  .venv/bin/llama-megatron export --input "$out/checkpoints" --output "$out/hf" --tokenizer data/tokenizer --overwrite
fi
for run in eval-base-no-scaling eval-base .; do
  echo "$run: $(grep -o '"val_loss": [0-9.]*' "$out/$run/metrics.jsonl" | tail -1)"
done
echo "extended model (HF, rope_scaling in config.json): $out/hf  metrics: $out/metrics.jsonl"
