"""The CPU fine-tuning recipe end to end, in one process: a Hugging Face LLaMA (random weights, the shipped
tokenizer and chat template) converted to our format, fully fine-tuned on the shipped chat set with the recipe's
config (`configs/finetune/sft-tiny-cpu.json`, here at TP1-PP1; the recipe's TP2-PP2 is checked against TP1-PP1 per
step in tests/test_sft_e2e.py), then asked training prompts through `generate`: it overfits the set and answers
them with the assistant's words.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from launch_utils import ROOT, launch

from llama_megatron.cli import main as cli_main
from llama_megatron.config import ModelConfig

RECIPE = os.path.join(ROOT, "configs", "finetune", "sft-tiny-cpu.json")
CHATS = os.path.join(ROOT, "data", "chat", "chat_messages.jsonl")
ASKED = 8


def test_recipe_overfits_the_chat_set_and_answers_its_prompts(tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = ModelConfig.from_file(os.path.join(ROOT, "configs", "models", "tiny.json"))
    hf_dir = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(**config.to_hf_dict())).save_pretrained(hf_dir)
    for name in os.listdir(os.path.join(ROOT, "data", "tokenizer")):
        shutil.copy(os.path.join(ROOT, "data", "tokenizer", name), hf_dir / name)
    base = str(tmp_path / "base")
    assert cli_main(["convert", "hf-to-megatron", "--hf-dir", str(hf_dir), "--output", base, "--tp", "1"]) == 0

    run = tmp_path / "run"
    # 200 of the recipe's 400 steps: from random weights the loss is below 0.2 by then
    launch(1, RECIPE, ["parallel.tensor=1", "parallel.pipeline=1", "parallel.sequence_parallel=false",
                       f"checkpoint.load={base}", f"checkpoint.save={run}/ckpt", "checkpoint.interval=200",
                       "train.steps=200", f"output_dir={run}", "logging.tensorboard_dir=null"], timeout=900)
    records = [json.loads(line) for line in open(run / "metrics.jsonl", encoding="utf-8")]
    assert records[-1]["loss"] < 0.5 < records[0]["loss"], "the recipe should overfit the chat set"

    chats = [json.loads(line)["messages"] for line in open(CHATS, encoding="utf-8")][:ASKED]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": c[:-1]}) + "\n" for c in chats), encoding="utf-8")
    answers = tmp_path / "answers.jsonl"
    assert cli_main(["generate", "--checkpoint", f"{run}/ckpt", "--tokenizer", os.path.join(ROOT, "data", "tokenizer"),
                     "--prompts", str(prompts), "--max-new-tokens", "48", "--output", str(answers)]) == 0
    got = [json.loads(line)["completion"] for line in open(answers, encoding="utf-8")]
    exact = sum(answer == chat[-1]["content"] for answer, chat in zip(got, chats))
    assert exact >= ASKED * 3 // 4, list(zip(got, [c[-1]["content"] for c in chats]))
