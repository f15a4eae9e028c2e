#!/usr/bin/env bash
# CPU LoRA recipe: TP2 (sequence parallel) LoRA fine-tuning of the tiny LLaMA on the shipped chat set, 2 local processes
# (gloo). The base is the HF checkpoint of scripts/finetune_base_cpu.sh converted to TP2 x PP2 (read per layer at
# TP2); the adapters are exported as a PEFT adapter directory and merged into full HF weights, the adapter checkpoint
# is asked the sample prompts (24 new tokens each: its answers are noise, see below), and the base (adapters at
# B = 0) is evaluated on the same validation batch as the adapters. Under 3 minutes on 2 cores with the base already
# made (2 min 57 s on a fresh clone, 2026-11-25), more on a loaded machine.
#
# What it shows: 149,504 adapter parameters on the frozen 1.79M-parameter base take the validation loss from the
# base's 8.15 to 6.01 in 200 steps (training loss 8.34 at step 1, which is the base: B = 0, to 5.78). The answers are
# not right, and no adapter's would be: adapters do not reach the output layer (final norm, lm_head), and this base's,
# after 40 steps of pretraining, is too weak for the answers' tokens: with it frozen, even the best hidden state per
# token leaves a loss of 4.81 on the answers, with some token of every answer still not the greedy choice. Tuning does
# not move this (rank 16-64, lr 1e-3 to 2e-2, warm-up: 6.0-6.9 at step 200; full-rank updates of all seven linears:
# 5.6); training lm_head too (PEFT's modules_to_save, not offered here) gives 0.97, as full fine-tuning (0.87,
# scripts/finetune_sft_cpu.sh) does. LoRA needs a base whose output layer serves the task, as a released LLaMA's
# does. Figures and how they were measured: docs/fine-tuning.md, "LoRA".
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
.venv/bin/deepspeed --num_gpus 2 --module llama_megatron.train --eval-only --config configs/finetune/lora-tiny-cpu.json \
  --set output_dir="$out/base-eval" --set logging.tensorboard_dir=null "$@"
.venv/bin/deepspeed --num_gpus 2 --module llama_megatron generate --checkpoint "$out/checkpoints" \
  --tokenizer data/tokenizer --prompts data/chat/sample_prompts.jsonl --max-new-tokens 24 \
  --output "$out/answers.jsonl"
.venv/bin/llama-megatron plot "$out" --output "$out/metrics.png"
.venv/bin/python - "$out" <<'EOF'
import json, sys
from safetensors.torch import load_file
out = sys.argv[1]
adapter, base = (sum(t.numel() for t in load_file(path).values())
                 for path in (f"{out}/adapter/adapter_model.safetensors", "runs/finetune-base/hf/model.safetensors"))
records = [json.loads(line) for line in open(f"{out}/metrics.jsonl", encoding="utf-8")]
last = [r for r in records if "loss" in r][-1]
val = [r["val_loss"] for r in records if "val_loss" in r][-1]
base_val = [json.loads(line) for line in open(f"{out}/base-eval/metrics.jsonl", encoding="utf-8")][-1]["val_loss"]
print(f"LoRA: {adapter:,} adapter parameters on a frozen base of {base:,}: validation loss {base_val:.2f} (the base) "
      f"-> {val:.2f}, training loss {last['loss']:.2f} at step {last['step']}. The answers are not expected to be "
      "right: this base's frozen output layer bounds what adapters can do (scripts/finetune_lora_cpu.sh, docs/fine-tuning.md)")
EOF
echo "adapter (PEFT): $out/adapter  merged HF model: $out/merged  base (HF): runs/finetune-base/hf  answers: $out/answers.jsonl"
