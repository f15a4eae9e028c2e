"""Preference tuning runs (``data.type: "preference"``) under the real launcher, against TRL 1.16's ``DPOTrainer``.

A random HF LLaMA (the e2e model) is tuned on twelve preference pairs (implicit prompt, a template whose generation
prompt ends in a space) by ``DPOTrainer`` (one batch of all twelve per step, its reference a copy of the start) and by
us from the same weights converted to TP1 and TP2 (a global batch of the twelve pairs cut into micro batches; the
reference log-probabilities computed before the first step): ``sigmoid``, ``ipo`` and ``["sigmoid", "sft"]`` at TP1,
TP2 with SP, TP2 x PP2 and CP2 (under ZeRO-2); LoRA adapters on the frozen base against TRL + PEFT (its reference:
the adapters disabled) at TP1 and TP2 with SP; packed rows (whole pairs first-fit, per-document attention, a global batch of every
row) at TP1 and TP2 x PP2. Each step's loss and each metric TRL logs (rewards chosen/rejected/accuracies/margins,
logps chosen/rejected) within 1e-4 relative (rewards near zero: 1e-5 absolute, a few float32 ulps of a sequence's
log-probability times beta). At the first step the policy is the reference, so every reward is 0 up to the rounding
of a pass with gradients against one without (TP > 1, CP > 1: an ulp here and there; TRL's own reference pass rounds
alike), and a tie's accuracy depends on that last bit: accuracies are compared from the second step on.

Whole runs on the shipped pairs (data/chat/chat_preference.jsonl, sequences cut at 64 tokens, four steps of eight
samples in micro batches of two, evaluation every two steps) against the TP1-PP1 run of the same rows, family and
precision: TP2 x PP2 with SP under 1F1B (padded and packed: two 64-token sequences per 129-token row) and ZB-H1,
TP2 x PP2 interleaved with recomputation, PP2 x DP2 under ZB-V, DP2 ZeRO-3 with recomputation, bf16 at TP2 x PP2
with SP, Qwen3 (q/k norms) at TP2 x PP2 with SP; each multi-process run
computes its own reference table under its layout and schedule. The TP1-PP1 checkpoint of step 2 resumed to step 4
and the step-4 one evaluated (their reference table read back, not recomputed), and refused in one line when the
table is gone; an ORPO run (reference-free: no reference pass); TensorBoard's pair metrics; a bad pair stopping
`train`; the config's refusals; the estimate's rows.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from chat_families import TOKENIZER, preference_records, write_templates
from launch_utils import ROOT, SFT_CONFIG, assert_losses_close, launch, launch_many, losses, train_args
from model_utils import peft_twin, recording_losses, save_and_convert

from llama_megatron.errors import ConfigError
from llama_megatron.model.preference import METRICS
from llama_megatron.training.config import TrainingConfig

CONFIG = SFT_CONFIG
STEPS, LR, BETA = 3, 2e-3, 0.5
REL, ABS = 1e-4, 1e-5
ZERO1 = "deepspeed_config=ds_configs/zero1_fp32.json"
LOSSES = {"sigmoid": ["sigmoid"], "ipo": ["ipo"], "sigmoid+sft": ["sigmoid", "sft"]}
LAYOUTS = {  # name -> (checkpoint TP, processes, overrides)
    "tp1": (1, 1, ["batch.micro_batch_size=3"]),
    "tp2-sp": (2, 2, ["parallel.tensor=2", "parallel.sequence_parallel=true", "batch.micro_batch_size=6", ZERO1]),
    "tp2-pp2": (2, 4, ["parallel.tensor=2", "parallel.pipeline=2", "batch.micro_batch_size=3", ZERO1]),
    # ZeRO-2 here: its gradient partitions over DP x CP = 2 ranks
    "cp2": (1, 2, ["parallel.context=2", "batch.micro_batch_size=3", "deepspeed_config=ds_configs/zero2_fp32.json"]),
}
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "o_proj", "down_proj"]}
LAYOUTS.update({  # LoRA adapters on the frozen base, against TRL + PEFT (its reference: the adapters disabled)
    "lora-tp1": (1, 1, ["batch.micro_batch_size=3", f"lora={json.dumps(LORA)}"]),
    "lora-tp2-sp": (2, 2, ["parallel.tensor=2", "parallel.sequence_parallel=true", "batch.micro_batch_size=6", ZERO1,
                           f"lora={json.dumps(LORA)}"]),
})
PACKED = "PACKED"  # the packed rows' overrides, known once the pairs are tokenised (trl_case)
LAYOUTS.update({"packed-tp1": (1, 1, [PACKED]), "packed-tp2-pp2": (2, 4, ["parallel.tensor=2", "parallel.pipeline=2",
                                                                      ZERO1, PACKED])})
CASES = ([("sigmoid", layout) for layout in LAYOUTS] + [(loss, layout) for loss in ("ipo", "sigmoid+sft")
                                                        for layout in ("tp1", "tp2-sp", "tp2-pp2", "cp2")])


@pytest.fixture(scope="module")
def trl_case(tmp_path_factory) -> dict:
    """DPOTrainer's per-step losses and logged metrics per loss, and what our runs need: the HF model converted to
    TP1 and TP2, the JSONL, the template, the overrides."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    out = tmp_path_factory.mktemp("dpo")
    config = TrainingConfig.from_file(CONFIG, ["data.cache_dir=unused"])
    torch.manual_seed(11)
    hf_dir = save_and_convert(LlamaForCausalLM(LlamaConfig(**config.model.to_hf_dict())), out, TOKENIZER, (1, 2),
                              config.parallel.make_vocab_size_divisible_by)
    template = write_templates(str(out))["bot", "eot"]
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.chat_template = open(template, encoding="utf-8").read()
    records = preference_records()
    jsonl = out / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    step_losses: list[float] = []

    Recording = recording_losses(DPOTrainer, step_losses)

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
        trainer = Recording(model=peft_twin(hf_dir, config, LORA) if lora else LlamaForCausalLM.from_pretrained(hf_dir),
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
    # packed: whole pairs in rows of two longest sequences, a global batch of every row (so of every pair)
    from llama_megatron.data.config import data_config_from_dict

    packed_seq = -(-(2 * longest - 1) // 8) * 8
    data = data_config_from_dict({"type": "preference", "path": str(jsonl), "chat_template": template, "pack": True,
                                  "max_length": longest, "split": "100,0,0", "cache_dir": str(out / "cache")})
    data.prepare(TOKENIZER)
    rows = data.build(packed_seq, config.seed, (len(records), 0, 0), config.model.vocab_size, None)[0]
    packed_rows = rows.stats["rows_per_epoch"]
    assert packed_rows < len(records), "some rows should hold several pairs"
    packed = ["data.pack=true", f"data.max_length={longest}", f"seq_length={packed_seq}",
              f"batch.global_batch_size={packed_rows}", "batch.micro_batch_size=1"]
    return {"cases": cases, "overrides": overrides, "out": out, "packed": packed}


def _name(loss: str, layout: str) -> str:
    return f"{loss}-{layout}"


def _trl_run_args(trl_case) -> dict[int, list]:
    out = trl_case["out"]
    by_procs: dict[int, list] = {}
    for loss, layout in CASES:
        tp, procs, overrides = LAYOUTS[layout]
        by_procs.setdefault(procs, []).append(train_args(CONFIG, [
            *trl_case["overrides"], f"data.cache_dir={out / 'cache'}", f"checkpoint.load={out / f'tp{tp}'}",
            f"preference.loss_type={json.dumps(LOSSES[loss])}", f"output_dir={out / _name(loss, layout)}",
            *[item for o in overrides for item in (trl_case["packed"] if o == PACKED else [o])]]))
    return by_procs


@pytest.fixture(scope="module")
def launched(trl_case, tmp_path_factory) -> dict:
    """Every run of this file in one launch per process count (the whole runs first: their log is read in order)."""
    work = tmp_path_factory.mktemp("dpo-runs")
    by_procs = _whole_run_args(work)
    for procs, args in _trl_run_args(trl_case).items():
        by_procs.setdefault(procs, []).extend(args)
    results = {procs: launch_many(procs, args, str(work / f"runs-{procs}.json"))
               for procs, args in sorted(by_procs.items())}
    return {"stdout": results[1].stdout, "work": work}


@pytest.fixture(scope="module")
def runs(trl_case, launched) -> dict[str, dict]:
    found = {}
    for loss, layout in CASES:
        run_dir = trl_case["out"] / _name(loss, layout)
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


# --- whole runs on the shipped pairs: layouts against TP1-PP1, packed against padded, resume, bf16 -------------------

PAIRS = os.path.join(ROOT, "data", "chat", "chat_preference.jsonl")
RUN_STEPS, HALF = 4, 2
TP2_PP2_SP = ["parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true", ZERO1]
BF16 = "deepspeed_config=ds_configs/zero1_bf16.json"
QWEN3 = ["model.model_type=qwen3", "model.head_dim=12"]  # q/k norms, a head_dim of its own
RECOMPUTE = "activation_checkpointing.interval=1"
WHOLE = {  # name -> (processes, overrides); padded rows of 65 tokens, packed of 129: the same 64-token sequences
    "padded": (1, []),
    "packed": (1, ["data.pack=true", "seq_length=128"]),
    "padded-bf16": (1, [BF16]),
    "qwen3": (1, QWEN3),
    "padded-dp2-zero3-recompute": (2, ["deepspeed_config=ds_configs/zero3_fp32.json", RECOMPUTE]),
    "padded-tp2-pp2-sp": (4, TP2_PP2_SP),
    "packed-tp2-pp2-sp": (4, [*TP2_PP2_SP, "data.pack=true", "seq_length=128"]),
    "padded-tp2-pp2-sp-bf16": (4, [*TP2_PP2_SP[:-1], BF16]),
    "padded-tp2-pp2-sp-zb-h1": (4, [*TP2_PP2_SP, "pipeline.schedule=zb-h1"]),
    "padded-tp2-pp2-interleaved-recompute": (4, ["parallel.tensor=2", "parallel.pipeline=2", ZERO1, RECOMPUTE,
                                                 "pipeline.schedule=interleaved-1f1b", "pipeline.virtual_stages=2"]),
    "padded-pp2-dp2-zb-v": (4, ["parallel.pipeline=2", ZERO1, "pipeline.schedule=zb-v", "pipeline.virtual_stages=2",
                                "batch.micro_batch_size=1"]),
    "qwen3-tp2-pp2-sp": (4, [*QWEN3, *TP2_PP2_SP]),
}
# bf16 runs against the bf16 TP1-PP1 run: bf16's rounding, not an exactness claim. Observed over four steps: TP2 x
# PP2 with SP 1.1e-3, and (measured on 2026-11-26, not kept in the suite) PP2 alone, the same arithmetic per micro
# batch, 1.5e-3: the gap is the bf16 weights' and gradients' rounding along another engine path, grown by each
# update, not the layout's reductions
BF16_REL = 5e-3


def _whole_run_base(work) -> list[str]:
    return [f"data.path={PAIRS}", "data.type=preference", "data.max_length=64", "data.split=90,10,0",
            f"data.cache_dir={work / 'cache'}", "seq_length=64", f"train.steps={RUN_STEPS}", "eval.interval=2",
            "batch.micro_batch_size=2", "batch.global_batch_size=8", "preference.beta=0.5", "optimizer.lr=5e-4",
            "optimizer.min_lr=5e-5"]


def _whole_run_args(work) -> dict[int, list]:
    base = _whole_run_base(work)

    def run(name: str, *overrides: str) -> list[str]:
        return train_args(CONFIG, [*base, f"output_dir={work / name}", *overrides])

    single = [run(name, *overrides) for name, (procs, overrides) in WHOLE.items() if procs == 1]
    single[0] += ["--set", f"checkpoint.save={work / 'ckpt'}", "--set", f"checkpoint.interval={HALF}",
                  "--set", f"logging.tensorboard_dir={work / 'padded' / 'tb'}"]
    single.append(run("resumed", f"checkpoint.load={work / 'ckpt'}", f"checkpoint.tag=global_step{HALF}"))
    single.append(run("orpo", 'preference.loss_type=["sft","orpo"]'))  # reference-free: no reference pass
    single.append(run("evaluated", f"checkpoint.load={work / 'ckpt'}") + ["--eval-only"])  # the step-4 checkpoint
    by_procs = {1: single}
    for name, (procs, overrides) in WHOLE.items():
        if procs > 1:
            # a cache of its own: the reference pass runs under this layout and schedule (not read from TP1's)
            by_procs.setdefault(procs, []).append(run(name, *overrides, f"data.cache_dir={work / f'cache-{name}'}"))
    return by_procs


@pytest.fixture(scope="module")
def whole_runs(launched) -> dict:
    work = launched["work"]
    found = {"stdout": launched["stdout"], "work": work}
    for name in [*WHOLE, "resumed", "orpo", "evaluated"]:
        found[name] = {"loss": losses(str(work / name)), "val": losses(str(work / name), "val_loss"),
                       "margins": losses(str(work / name), "rewards/margins")}
    return found


def _single_process_twin(name: str) -> str:
    if name.startswith(("qwen3", "packed")):
        return name.split("-")[0]
    return "padded-bf16" if "bf16" in name else "padded"


@pytest.mark.parametrize("name", [n for n, (procs, _) in WHOLE.items() if procs > 1])
def test_whole_runs_match_the_single_process_run(name, whole_runs) -> None:
    """Every layout trains the TP1-PP1 run's model (of the same rows: a packed sample is a row of pairs; of the same
    family and precision): losses, validation losses and reward margins per step (fp32 1e-4 relative; bf16 5e-3, the
    margins what that bound lets the loss's argument move)."""
    want, got = whole_runs[_single_process_twin(name)], whole_runs[name]
    rel = BF16_REL if "bf16" in name else REL
    assert_losses_close(got["loss"], want["loss"], rel, range(1, RUN_STEPS + 1))
    assert_losses_close(got["val"], want["val"], rel, [2, 4])
    for step in range(2, RUN_STEPS + 1):  # step 1's margins are 0 up to rounding (the policy is the reference)
        if "bf16" not in name:
            assert got["margins"][step] == pytest.approx(want["margins"][step], rel=rel * 10, abs=ABS)
            continue
        # A margin is a difference of summed log-probabilities that nearly cancel, so its bf16 rounding is the sums',
        # not a share of the small difference (5.7% of it on a CPU without SIMD, 2.0e-3 absolute). It is held to
        # what the loss's own bound lets it move: the sigmoid loss -log sigmoid(m) moves by sigmoid(-m) per unit
        # of m (1/2 at m = 0)
        margin = want["margins"][step]
        bound = rel * want["loss"][step] / (1 / (1 + math.exp(margin)))
        assert got["margins"][step] == pytest.approx(margin, abs=bound)


def test_a_resume_reads_its_reference_and_continues_exactly(whole_runs) -> None:
    want, got = whole_runs["padded"], whole_runs["resumed"]
    assert sorted(got["loss"]) == list(range(HALF + 1, RUN_STEPS + 1))
    assert_losses_close(got["loss"], want["loss"], 1e-6, range(HALF + 1, RUN_STEPS + 1))
    stdout = whole_runs["stdout"]
    # the launch's first runs: padded and packed compute theirs (other rows, another key), the resume and the
    # evaluation read; ORPO, between them, needs none
    computed = [line for line in stdout.splitlines() if line.startswith("reference log-probabilities")][:6]
    assert all("computed, stored in" in line for line in computed[:4]), computed  # padded, packed, bf16, qwen3
    assert len({line.split("stored in ")[1] for line in computed[:4]}) == 4, "four keys: rows, precision, model"
    assert "read from" in computed[4] and computed[4].endswith(computed[0].split("stored in ")[1]), computed
    assert "read from" in computed[5] and computed[5].endswith(computed[0].split("stored in ")[1])
    assert whole_runs["evaluated"]["val"] == pytest.approx({RUN_STEPS: want["val"][RUN_STEPS]}, rel=1e-6), (
        "evaluating the step-4 checkpoint against its run's reference gives the run's validation loss")
    orpo = whole_runs["orpo"]["loss"]
    assert sorted(orpo) == list(range(1, RUN_STEPS + 1)) and orpo[1] > 1.0, "ORPO's loss starts at its NLL"
    record = json.loads((whole_runs["work"] / "ckpt" / "preference_reference.json").read_text())
    assert os.path.isfile(record["table"]) and record["key"] in record["table"]
    assert want["loss"][1] == pytest.approx(0.6931471805599453, rel=1e-6), "step 1: the policy is the reference"
    # the policy moves off the reference (the falling loss of repeated batches is TRL's case above; here each step
    # sees new pairs, whose answers are other pairs' chosen ones)
    assert abs(want["margins"][RUN_STEPS]) > 0.05


def test_tensorboard_receives_the_pair_metrics(whole_runs) -> None:
    """TRL's six metrics reach TensorBoard under train/ with metrics.jsonl's values at every step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(whole_runs["work"] / "padded" / "tb"))
    events.Reload()
    logged = [json.loads(line) for line in open(whole_runs["work"] / "padded" / "metrics.jsonl", encoding="utf-8")]
    for metric in METRICS:
        scalars = {event.step: event.value for event in events.Scalars(f"train/{metric}")}
        want = {record["step"]: record[metric] for record in logged if metric in record}
        assert sorted(scalars) == list(range(1, RUN_STEPS + 1)) and sorted(want) == sorted(scalars), metric
        assert scalars == pytest.approx(want, rel=1e-6, abs=1e-7), metric  # TensorBoard keeps float32


@pytest.mark.launched
def test_a_resume_whose_reference_table_is_gone_is_refused(whole_runs, tmp_path) -> None:
    """The table a checkpoint names cannot be made again from moved weights: a resume without it is one line, exit
    2, and nothing is written."""
    work = whole_runs["work"]
    table = json.loads((work / "ckpt" / "preference_reference.json").read_text())["table"]
    aside = tmp_path / "table.npy"
    shutil.move(table, aside)
    try:
        out = tmp_path / "out"
        result = launch(1, CONFIG, [*_whole_run_base(work), f"output_dir={out}", f"checkpoint.load={work / 'ckpt'}",
                                    f"checkpoint.tag=global_step{HALF}"], check=False)
    finally:
        shutil.move(aside, table)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and errors == [
        f"error: {table} (the reference log-probabilities this run started with) is gone: they cannot be made again "
        "from moved weights; restart from the starting checkpoint"], result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (out / "metrics.jsonl").exists() or "loss" not in (out / "metrics.jsonl").read_text()


@pytest.mark.launched
def test_a_bad_pair_stops_train_before_launch(tmp_path) -> None:
    """`train` on preference pairs with a bad record (a rejected completion missing): one line naming FILE:LINE,
    exit 2, no shards in the cache."""
    records = [json.loads(line) for line in open(PAIRS, encoding="utf-8")][:3]
    del records[1]["rejected"]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    cache = tmp_path / "cache"
    result = launch(1, CONFIG, [f"data.path={pairs}", "data.type=preference", f"data.cache_dir={cache}",
                                f"output_dir={tmp_path / 'run'}"], check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and f"{pairs}:2: " in errors[0], result.stderr[-2000:]
    assert "rejected" in errors[0] and "Traceback" not in result.stderr
    assert not cache.exists() or not [p for p in cache.iterdir() if p.is_dir()]


@pytest.mark.parametrize("overrides, message", [
    (["preference.beta=0.2"], "the preference section sets the loss of the preference objective, and data.type is 'sft'"),
    (["data.type=preference", "preference.loss_type=aot"], "preference.loss_type 'aot' is not one of"),
    (["data.type=preference", "preference.loss_type=[\"sigmoid\",\"sft\"]", "preference.loss_weights=[1.0]"],
     "preference.loss_weights has 1 weights for 2 loss types"),
    (["data.type=preference", "data.pack=true", "data.max_length=64"],
     "data.max_length 64 does not fit rows of seq_length \\+ 1 = 65 tokens twice"),
])
def test_the_config_refuses_what_cannot_run(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainingConfig.from_file(CONFIG, [f"data.path={PAIRS}", *overrides]).validate()


def test_estimate_counts_a_padded_pair_as_two_rows() -> None:
    """A micro batch of b padded pairs holds what a micro batch of 2b SFT rows holds, but the whole logits of the
    loss (the chunked head cannot weight tokens by their pair); packed pairs are rows as SFT's are."""
    from llama_megatron.training.diagnostics.memory_estimate import estimate
    from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config

    def stage(*overrides: str):
        config = TrainingConfig.from_file(CONFIG, [f"data.path={PAIRS}", "kernels=reference",
                                                   "batch.global_batch_size=8", *overrides])
        return estimate(config, build_deepspeed_config(config, None, 1), 1).stages[0]

    pairs, rows = stage("data.type=preference", "batch.micro_batch_size=2"), stage("batch.micro_batch_size=4")
    assert pairs.activations_per_micro_batch == rows.activations_per_micro_batch
    assert pairs.logits == rows.logits
    packed = stage("data.type=preference", "data.pack=true", "data.max_length=32", "batch.micro_batch_size=2")
    assert packed.activations_per_micro_batch == stage("batch.micro_batch_size=2").activations_per_micro_batch
    compiled = [stage(*o, "kernels=compiled") for o in (("data.type=preference", "batch.micro_batch_size=2"),
                                                           ("batch.micro_batch_size=4",))]
    assert compiled[0].logits > compiled[1].logits, "the chunked loss keeps one chunk of logits, pairs all of them"
