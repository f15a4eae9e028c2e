"""Whole SFT runs on the shipped chat set under the real `deepspeed` launcher (gloo, CPU).

The loss of a step is the token mean over the trained tokens of its whole global batch, so runs that cut the same
global batches into different micro batches, DP ranks and pipeline stages train the same model: TP2 x PP2 (packed
with SP at micro batch 1, and padded at micro batch 2) and TP2 x DP2 with SP (packed, micro batch 4, ZeRO-1, the
compiled kernels: chunked linear cross-entropy, document attention without masks) reproduce the TP1-PP1 run
(micro batch 2, 4 accumulation steps, reference kernels) step by step, training and validation loss, fp32,
relative 1e-4. The padded TP1-PP1 run itself equals transformers.LlamaForCausalLM + torch AdamW with HF's
``num_items_in_batch`` loss (the global-batch token mean) on the same batches.

Against TRL: a random HF LLaMA converted to TP2 is fine-tuned on twelve conversations with a template whose
generation prompt ends in a space and whose markers leave text after the end of turn untrained, by TRL's
``SFTTrainer`` (``assistant_only_loss``, one batch of all twelve per step) and by us at TP2-SP x DP2 and at TP2 x PP2
(the same twelve per global batch, cut into micro batches), and on their prompt/completion forms by SFTTrainer's
default (``completion_only_loss``: the text after the markers trained too) and by us at TP2-SP x DP2 (default
masking): the losses of three steps agree to 1e-4 relative.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from chat_families import TOKENIZER, message_records, prompt_completion_records, write_templates
from launch_utils import SFT_CONFIG, assert_losses_close, hf_adamw_twin, launch_many, losses, train_args
from model_utils import recording_losses

from llama_megatron.data.sft.dataset import SFTShards
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.run.batches import step_batches

CONFIG = SFT_CONFIG
REL = 1e-4
STEPS, EVAL_STEPS = 6, [3, 6]  # the config's train.steps and eval.interval
ZERO1 = "deepspeed_config=ds_configs/zero1_fp32.json"
TP2_SP = ["parallel.tensor=2", "parallel.sequence_parallel=true"]
LAYOUTS = {  # name -> (reference, overrides)
    "packed-tp2-pp2-sp-micro1": ("packed", [*TP2_SP, "parallel.pipeline=2", "batch.micro_batch_size=1", ZERO1]),
    "padded-tp2-pp2-micro2": ("padded", ["parallel.tensor=2", "parallel.pipeline=2", ZERO1]),
    "packed-tp2-dp2-sp-micro4-compiled": ("packed", [*TP2_SP, "batch.micro_batch_size=4", ZERO1, "kernels=compiled"]),
}


TRL_STEPS, TRL_LR = 3, 2e-3
TRL_LAYOUTS = {  # name -> (records, overrides); global batch 12 = every record, once per step
    "trl-tp2-dp2-sp-micro3": ("messages", [*TP2_SP, "batch.micro_batch_size=3"]),
    "trl-tp2-pp2-micro2": ("messages", ["parallel.tensor=2", "parallel.pipeline=2", "batch.micro_batch_size=2"]),
    "trl-prompt-completion-tp2-dp2-sp-micro3": ("prompt_completion", [*TP2_SP, "batch.micro_batch_size=3"]),
}


def _args(work, name: str, *overrides: str) -> list[str]:
    return train_args(CONFIG, [f"data.cache_dir={work / 'cache'}", f"output_dir={work / name}", *overrides])


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("sft-runs")


@pytest.fixture(scope="module")
def references(work) -> dict:
    """TP1-PP1, padded and packed, in one single-process launch; returns its stdout too."""
    result = launch_many(1, [_args(work, "padded"), _args(work, "packed", "data.pack=true")],
                         str(work / "references.json"))
    return {"stdout": result.stdout, "padded": _metrics(work / "padded"), "packed": _metrics(work / "packed")}


@pytest.fixture(scope="module")
def trl_case(work) -> dict:
    """TRL's SFTTrainer from a random HF LLaMA (the e2e model) on the twelve conversations (``assistant_only_loss``)
    and on their prompt/completion forms (its default ``completion_only_loss``): per kind of records, its per-step
    losses and what our runs need (the HF model converted to TP2, the JSONL, the template, the training overrides)."""
    pytest.importorskip("trl")
    import shutil

    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from llama_megatron.cli import main as cli_main

    out = work / "trl"
    out.mkdir()
    config = TrainingConfig.from_file(CONFIG, ["data.cache_dir=unused"])
    torch.manual_seed(7)
    hf_dir = out / "hf"
    LlamaForCausalLM(LlamaConfig(**config.model.to_hf_dict())).save_pretrained(hf_dir)
    for name in os.listdir(TOKENIZER):
        shutil.copy(os.path.join(TOKENIZER, name), hf_dir / name)
    assert cli_main(["convert", "hf-to-megatron", "--hf-dir", str(hf_dir), "--output", str(out / "tp2"), "--tp", "2",
                     "--make-vocab-size-divisible-by", str(config.parallel.make_vocab_size_divisible_by)]) == 0
    template = write_templates(str(out))["bot", "eot"]
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.chat_template = open(template, encoding="utf-8").read()
    step_losses: list[float] = []

    Recording = recording_losses(SFTTrainer, step_losses)

    cases = {}
    for kind, records in (("messages", message_records()), ("prompt_completion", prompt_completion_records())):
        jsonl = out / f"{kind}.jsonl"
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        step_losses.clear()
        args = SFTConfig(output_dir=str(out / "trainer"), assistant_only_loss=kind == "messages", max_length=None,
                         report_to=[], use_cpu=True, bf16=False, disable_tqdm=True,
                         per_device_train_batch_size=len(records), gradient_accumulation_steps=1, max_steps=TRL_STEPS,
                         learning_rate=TRL_LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                         max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch",
                         save_strategy="no", logging_steps=1, seed=7)
        trainer = Recording(model=LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32), args=args,
                            train_dataset=Dataset.from_list(records), processing_class=tokenizer)
        longest = max(len(ids) for ids in trainer.train_dataset["input_ids"])
        trainer.train()
        assert len(step_losses) == TRL_STEPS
        overrides = [f"data.path={jsonl}", f"data.chat_template={template}", "data.split=100,0,0", "data.pack=false",
                     f"seq_length={-(-longest // 8) * 8}", f"batch.global_batch_size={len(records)}",
                     f"train.steps={TRL_STEPS}", f"optimizer.lr={TRL_LR}", f"optimizer.min_lr={TRL_LR}",
                     "optimizer.decay_style=constant", "optimizer.warmup_steps=0", "optimizer.decay_steps=null",
                     "optimizer.weight_decay=0.0", "optimizer.clip_grad=1.0", "optimizer.betas=[0.9,0.999]",
                     "optimizer.eps=1e-8", "eval.interval=0", f"checkpoint.load={out / 'tp2'}",
                     "checkpoint.finetune=true", ZERO1]
        cases[kind] = {"losses": dict(enumerate(step_losses, start=1)), "overrides": overrides}
    return cases


@pytest.fixture(scope="module")
def layouts(work, references, trl_case) -> dict[str, dict]:
    runs = [_args(work, name, *overrides, *(["data.pack=true"] if ref == "packed" else []))
            for name, (ref, overrides) in LAYOUTS.items()]
    runs += [_args(work, name, *trl_case[kind]["overrides"], *overrides) for name, (kind, overrides) in
             TRL_LAYOUTS.items()]
    launch_many(4, runs, str(work / "layouts.json"))
    return {name: _metrics(work / name) for name in [*LAYOUTS, *TRL_LAYOUTS]}


def _metrics(out) -> dict:
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"), encoding="utf-8")]
    return {"loss": losses(str(out)), "val": {r["step"]: r["val_loss"] for r in records if "val_loss" in r}}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, layouts, references) -> None:
    want = references[LAYOUTS[name][0]]
    got = layouts[name]
    assert_losses_close(got["loss"], want["loss"], REL, range(1, STEPS + 1))
    assert sorted(got["val"]) == EVAL_STEPS
    assert_losses_close(got["val"], want["val"], REL, EVAL_STEPS)


def test_packing_learns_and_logs_its_counters(references, work) -> None:
    """Loss falls; the log counts truncated and dropped samples and the row filling, as the shards say."""
    for kind in ("padded", "packed"):
        loss = references[kind]["loss"]
        assert loss[STEPS] < loss[1] - 0.8, kind
    lines = [line for line in references["stdout"].splitlines() if line.startswith("train data: ")]
    assert len(lines) == 2, references["stdout"][-3000:]
    (entry,) = [p for p in (work / "cache").glob("*/chat_messages_sft.json")]
    shards = SFTShards(str(entry)[: -len("_sft.json")])
    train = range(int(round(0.9 * len(shards))))
    long = [i for i in train if shards.sizes[i] > 65]
    untrained = [i for i in long if not shards.mask[i][1:65].any()]
    assert long, "seq_length 64 should truncate some of the shipped conversations"
    for line in lines:
        assert f"{len(train)} samples, {len(long) - len(untrained)} truncated" in line
        assert f"{len(untrained)} dropped with no trained token left" in line
    assert "(padded)" in lines[0] and "(packed)" in lines[1]


def test_padded_reference_equals_hf_with_global_token_mean(references, work) -> None:
    """Each micro batch's HF loss is its summed token loss over the global count (num_items_in_batch), summed
    over the step's micro batches: the rule the engine implements through DeepSpeed's 1/GA and DP averaging."""
    config = TrainingConfig.from_file(CONFIG, [f"data.cache_dir={work / 'cache'}"])
    hf, optimizer, scheduler, train_ds = hf_adamw_twin(config, eod_id=2)
    opt = config.optimizer
    ours = references["padded"]["loss"]
    counts = set()
    for step, micro_batches in enumerate(step_batches(train_ds, config, ParallelContext.single(), 0, STEPS), start=1):
        optimizer.zero_grad()
        n = torch.tensor(sum(mb.num_targets() for mb in micro_batches))
        counts.update(mb.num_targets() for mb in micro_batches)
        total = 0.0
        for mb in micro_batches:
            loss = hf(input_ids=mb.input_ids, labels=mb.labels, shift_labels=mb.labels, num_items_in_batch=n).loss
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), opt.clip_grad)
        optimizer.step()
        scheduler.step()
        assert abs(total - ours[step]) <= REL * ours[step], f"step {step}: HF {total} vs ours {ours[step]}"
    assert len(counts) > 5, "micro batches should hold different numbers of trained tokens"


@pytest.mark.parametrize("name", list(TRL_LAYOUTS))
def test_whole_batch_steps_equal_trl_sft_trainer(name, layouts, trl_case) -> None:
    got, want = layouts[name]["loss"], trl_case[TRL_LAYOUTS[name][0]]["losses"]
    print(f"{name}: largest relative difference from SFTTrainer "
          f"{max(abs(got[s] - want[s]) / want[s] for s in want):.2g}")
    assert_losses_close(got, want, REL, range(1, TRL_STEPS + 1))
    assert want[TRL_STEPS] < want[1], "the steps should train"
