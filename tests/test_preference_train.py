"""Preference tuning runs (``data.type: "preference"``) under the real launcher, against TRL 1.16's ``DPOTrainer``.

A random HF LLaMA (the e2e model) is tuned on twelve preference pairs (implicit prompt, a template whose generation
prompt ends in a space) by ``DPOTrainer`` (one batch of all twelve per step, its reference a copy of the start) and by
us from the same weights converted to TP1 and TP2 (a global batch of the twelve pairs cut into micro batches; the
reference log-probabilities computed before the first step), for ``sigmoid`` at TP1, TP2 with SP, TP2 x PP2 and CP2,
and for ``ipo`` and ``["sigmoid", "sft"]`` at TP1 and TP2 x PP2; and LoRA adapters (the frozen base) against TRL +
PEFT, whose reference is the model with its adapters disabled, at TP1 and TP2 with SP: each step's loss and each metric TRL logs (rewards
chosen/rejected/accuracies/margins, logps chosen/rejected) within 1e-4 relative (rewards near zero: 1e-5 absolute,
a few float32 ulps of a sequence's log-probability times beta). At the first step the policy is the reference, so
every reward is 0 up to the rounding of a pass with gradients against one without (TP > 1, CP > 1: an ulp here and
there; TRL's own reference pass rounds alike), and a tie's accuracy depends on that last bit: accuracies are
compared from the second step on.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from chat_families import TOKENIZER, preference_records, write_templates
from launch_utils import ROOT, assert_losses_close, launch_many, losses, train_args

from llama_megatron.model.preference import METRICS
from llama_megatron.training.config import TrainingConfig

CONFIG = os.path.join(ROOT, "tests", "configs", "e2e_sft.json")
STEPS, LR, BETA = 3, 2e-3, 0.5
REL, ABS = 1e-4, 1e-5
ZERO1 = "deepspeed_config=ds_configs/zero1_fp32.json"
LOSSES = {"sigmoid": ["sigmoid"], "ipo": ["ipo"], "sigmoid+sft": ["sigmoid", "sft"]}
LAYOUTS = {  # name -> (checkpoint TP, processes, overrides)
    "tp1": (1, 1, ["batch.micro_batch_size=3"]),
    "tp2-sp": (2, 2, ["parallel.tensor=2", "parallel.sequence_parallel=true", "batch.micro_batch_size=6", ZERO1]),
    "tp2-pp2": (2, 4, ["parallel.tensor=2", "parallel.pipeline=2", "batch.micro_batch_size=3", ZERO1]),
    "cp2": (1, 2, ["parallel.context=2", "batch.micro_batch_size=3", ZERO1]),
}
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "o_proj", "down_proj"]}
LAYOUTS.update({  # LoRA adapters on the frozen base, against TRL + PEFT (its reference: the adapters disabled)
    "lora-tp1": (1, 1, ["batch.micro_batch_size=3", f"lora={json.dumps(LORA)}"]),
    "lora-tp2-sp": (2, 2, ["parallel.tensor=2", "parallel.sequence_parallel=true", "batch.micro_batch_size=6", ZERO1,
                           f"lora={json.dumps(LORA)}"]),
})
CASES = ([("sigmoid", layout) for layout in LAYOUTS] + [(loss, layout) for loss in ("ipo", "sigmoid+sft")
                                                        for layout in ("tp1", "tp2-pp2")])


@pytest.fixture(scope="module")
def trl_case(tmp_path_factory) -> dict:
    """DPOTrainer's per-step losses and logged metrics per loss, and what our runs need: the HF model converted to
    TP1 and TP2, the JSONL, the template, the overrides."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    from llama_megatron.cli import main as cli_main

    out = tmp_path_factory.mktemp("dpo")
    config = TrainingConfig.from_file(CONFIG, ["data.cache_dir=unused"])
    torch.manual_seed(11)
    hf_dir = out / "hf"
    LlamaForCausalLM(LlamaConfig(**config.model.to_hf_dict())).save_pretrained(hf_dir)
    for name in os.listdir(TOKENIZER):
        shutil.copy(os.path.join(TOKENIZER, name), hf_dir / name)
    for tp in (1, 2):
        assert cli_main(["convert", "hf-to-megatron", "--hf-dir", str(hf_dir), "--output", str(out / f"tp{tp}"),
                         "--tp", str(tp), "--make-vocab-size-divisible-by",
                         str(config.parallel.make_vocab_size_divisible_by)]) == 0
    template = write_templates(str(out))["bot", "eot"]
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.chat_template = open(template, encoding="utf-8").read()
    records = preference_records()
    jsonl = out / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    step_losses: list[float] = []

    class Recording(DPOTrainer):
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            step_losses.append((loss[0] if isinstance(loss, tuple) else loss).item())
            return loss

    def peft_model():
        """PEFT's LoRA on the start, its adapters the ones our run draws (A seeded per name, B zero)."""
        import peft

        from llama_megatron.model.init import initial_hf_tensor
        from llama_megatron.model.lora_layout import LoraConfig, adapter_layout

        lora = LoraConfig(rank=LORA["rank"], alpha=LORA["alpha"], targets=tuple(LORA["targets"]))
        model = peft.get_peft_model(LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32),
                                    peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                                                    target_modules=list(lora.module_targets)))
        tensors = {spec.hf_names[0]: initial_hf_tensor(spec.hf_names[0], spec.hf_shapes[0], spec.init,
                                                       config.model.initializer_range, config.seed)
                   for spec in adapter_layout(config.model, lora)}
        result = peft.set_peft_model_state_dict(model, tensors)
        assert not result.unexpected_keys
        return model

    cases, longest = {}, 0
    for name, loss_type in [*LOSSES.items(), ("lora-sigmoid", LOSSES["sigmoid"])]:
        step_losses.clear()
        args = DPOConfig(output_dir=str(out / "trainer"), max_length=None, report_to=[], use_cpu=True, bf16=False,
                         disable_tqdm=True, per_device_train_batch_size=len(records), gradient_accumulation_steps=1,
                         max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                         weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                         optim="adamw_torch", save_strategy="no", logging_steps=1, seed=7, beta=BETA,
                         loss_type=loss_type)
        lora = name.startswith("lora")
        trainer = Recording(model=peft_model() if lora else LlamaForCausalLM.from_pretrained(hf_dir),
                            ref_model=None if lora else LlamaForCausalLM.from_pretrained(hf_dir), args=args,
                            train_dataset=Dataset.from_list(records), processing_class=tokenizer)
        data = trainer.train_dataset
        longest = max(longest, *(len(p) + max(len(c), len(r)) for p, c, r in
                                 zip(data["prompt_ids"], data["chosen_ids"], data["rejected_ids"])))
        trainer.train()
        assert len(step_losses) == STEPS
        logged = [entry for entry in trainer.state.log_history if METRICS[0] in entry]
        assert len(logged) == STEPS
        cases[name] = {"losses": dict(enumerate(step_losses, start=1)),
                       "metrics": {step: {m: entry[m] for m in METRICS} for step, entry in enumerate(logged, 1)}}
    overrides = ["data.type=preference", f"data.path={jsonl}", f"data.chat_template={template}",
                 "data.split=100,0,0", "data.pack=false", f"seq_length={-(-(longest - 1) // 8) * 8}",
                 f"batch.global_batch_size={len(records)}", f"train.steps={STEPS}", f"optimizer.lr={LR}",
                 f"optimizer.min_lr={LR}", "optimizer.decay_style=constant", "optimizer.warmup_steps=0",
                 "optimizer.decay_steps=null", "optimizer.weight_decay=0.0", "optimizer.clip_grad=1.0",
                 "optimizer.betas=[0.9,0.999]", "optimizer.eps=1e-8", "eval.interval=0", "checkpoint.finetune=true",
                 f"preference.beta={BETA}"]
    return {"cases": cases, "overrides": overrides, "out": out}


def _name(loss: str, layout: str) -> str:
    return f"{loss}-{layout}"


@pytest.fixture(scope="module")
def runs(trl_case) -> dict[str, dict]:
    out = trl_case["out"]
    by_procs: dict[int, list] = {}
    for loss, layout in CASES:
        tp, procs, overrides = LAYOUTS[layout]
        by_procs.setdefault(procs, []).append(train_args(CONFIG, [
            *trl_case["overrides"], f"data.cache_dir={out / 'cache'}", f"checkpoint.load={out / f'tp{tp}'}",
            f"preference.loss_type={json.dumps(LOSSES[loss])}", f"output_dir={out / _name(loss, layout)}",
            *overrides]))
    for procs, args in sorted(by_procs.items()):
        launch_many(procs, args, str(out / f"runs-{procs}.json"))
    found = {}
    for loss, layout in CASES:
        run_dir = out / _name(loss, layout)
        records = [json.loads(line) for line in open(run_dir / "metrics.jsonl", encoding="utf-8")]
        found[_name(loss, layout)] = {"loss": losses(str(run_dir)),
                                      "metrics": {r["step"]: r for r in records if METRICS[0] in r}}
    return found


@pytest.mark.parametrize("loss, layout", CASES, ids=[_name(*case) for case in CASES])
def test_whole_batch_steps_equal_trl_dpo_trainer(loss, layout, runs, trl_case) -> None:
    want = trl_case["cases"][("lora-" if layout.startswith("lora") else "") + loss]
    got = runs[_name(loss, layout)]
    print(f"{_name(loss, layout)}: largest relative difference from DPOTrainer's loss "
          f"{max(abs(got['loss'][s] - want['losses'][s]) / abs(want['losses'][s]) for s in want['losses']):.2g}")
    assert_losses_close(got["loss"], want["losses"], REL, range(1, STEPS + 1))
    assert want["metrics"][1]["rewards/margins"] == 0.0, "the first step's policy is the reference"
    for step, metrics in want["metrics"].items():
        for name, value in metrics.items():
            if name == "rewards/accuracies" and step == 1:
                continue
            assert got["metrics"][step][name] == pytest.approx(value, rel=REL, abs=ABS), f"step {step} {name}"
    assert want["losses"][STEPS] < want["losses"][1], "the steps should train"
