"""lm-eval tasks during training under every kind of layout, request by request equal to lm-eval's HF backend on the
exported checkpoint of the same step; a LoRA checkpoint evaluated offline equal to HF + PEFT.

One 4-process launch trains five 2-step runs with ``eval.tasks`` (a multiple-choice, a generation and a rolling
log-likelihood task, 4 documents each, the tasks' own few-shot counts) and ``eval.tasks_log_samples`` at step 2, each
saving its step-2 weights: TP2 x PP2 with SP (DeepSpeed's pipeline module, stage after stage), TP2 x PP2 under ZB-V
(our chunked module: two virtual stages per rank in a V), CP2 x DP2 (Ulysses; whole sequences per rank for
inference), Mixtral at EP2 x TP2 with SP (the experts' all-to-all), and LoRA on the CP2 run's step-2 weights at DP4.
Each step-2 save is exported to HF (the LoRA one to a PEFT adapter on the exported base) and lm-eval's HF backend
runs the same tasks on it: every log-likelihood within 1e-4 with the same is_greedy, every generation identical,
every metric equal. The same holds for `evaluate --tasks` of the TP2 x PP2 save over two pipeline stages and of
the Mixtral save over two expert ranks (4 processes each), and for the LoRA save evaluated offline by our backend
in this process (TP1).
"""

from __future__ import annotations

import json

import pytest
from family_cases import FAMILIES
from launch_utils import PRETRAIN_CONFIG, launch_many, train_args
from lm_eval_utils import TOKENIZER, add_tokenizer, assert_same_as_hf, hf_results, read_samples

from llama_megatron.cli import main as cli_main

TASKS = ["shakespeare_play", "shakespeare_continue", "shakespeare_passages"]
LIMIT, SEED = 4, 42  # the seed of tests/configs/e2e_pretrain.json: the few-shot draw of the run's evaluations
LAYOUTS = {
    "tp2-pp2-sp": ["parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true"],
    "tp2-pp2-zb-v": ["parallel.tensor=2", "parallel.pipeline=2", "pipeline.schedule=zb-v",
                     "pipeline.virtual_stages=2"],
    "cp2-dp2": ["parallel.context=2"],
    "mixtral-ep2-tp2-sp": [*FAMILIES["mixtral"].runs, "parallel.expert=2", "parallel.tensor=2",
                           "deepspeed_config=ds_configs/zero1_fp32.json",
                           "parallel.sequence_parallel=true"],
}
LORA_BASE = "cp2-dp2"
# `evaluate --tasks` of a save over other ranks than TP's: its layers over two pipeline stages, its experts over two
# expert ranks
OFFLINE = {"offline-tp2-pp2-sp": ["--pipeline", "2"], "offline-mixtral-ep2-tp2-sp": ["--expert", "2"]}


def _run(root, name: str, *extra: str) -> list[str]:
    return train_args(PRETRAIN_CONFIG, [
        'data={"type": "synthetic"}', "train.steps=2", "eval.interval=2", f"eval.tasks={json.dumps(TASKS)}",
        f"eval.tasks_limit={LIMIT}", "eval.tasks_log_samples=true", f"checkpoint.save={root / name / 'ckpt'}",
        "checkpoint.interval=2", f"output_dir={root / name}", *extra])


@pytest.fixture(scope="module")
def eval_layouts(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lm-eval-layouts")
    lora = ['lora={"rank": 4, "alpha": 8}', f"checkpoint.load={root / LORA_BASE / 'ckpt'}",
            "checkpoint.tag=global_step2", "checkpoint.finetune=true"]
    runs = [_run(root, name, *extra) for name, extra in LAYOUTS.items()] + [_run(root, "lora", *lora)]
    for name, layout in OFFLINE.items():  # the saves evaluated offline, spread over 4 processes
        source = name.removeprefix("offline-")
        runs.append({"verb": "evaluate", "args": [
            "--tasks", ",".join(TASKS), "--checkpoint", str(root / source / "ckpt"), "--tokenizer", TOKENIZER,
            "--limit", str(LIMIT), "--seed", str(SEED), "--batch-size", "3", *layout,
            "--output", str(root / f"{name}.json"), "--log-samples", str(root / f"{name}.samples.jsonl")]})
    launch_many(4, runs, str(root / "runs.json"))
    for name in LAYOUTS:
        hf = root / name / "hf"
        assert cli_main(["export", "--input", str(root / name / "ckpt"), "--output", str(hf)]) == 0
        add_tokenizer(str(hf))
    adapter = root / "lora" / "adapter"
    assert cli_main(["export", "--input", str(root / "lora" / "ckpt"), "--output", str(adapter),
                     "--base-model", str(root / LORA_BASE / "hf")]) == 0
    return {"root": root}


@pytest.fixture(scope="module")
def references(eval_layouts) -> dict:
    """lm-eval's HF backend on each exported step-2 save (the LoRA one: its base with the PEFT adapter)."""
    root = eval_layouts["root"]
    # the runs' own tokenizer, which AutoTokenizer reads as its tokenizer_config says (LlamaTokenizer) when no model
    # type overrides it: transformers 5 gives model type mixtral its TokenizersBackend, which converts this
    # sentencepiece-only tokenizer with another normaliser and tokenises the same text differently
    out = {name: hf_results(str(root / name / "hf"), TASKS, LIMIT, None, SEED, tokenizer=TOKENIZER)
           for name in LAYOUTS}
    out["lora"] = hf_results(str(root / LORA_BASE / "hf"), TASKS, LIMIT, None, SEED, peft=str(root / "lora" / "adapter"),
                             tokenizer=TOKENIZER)
    return out


@pytest.mark.parametrize("name", [*LAYOUTS, "lora"])
def test_tasks_in_training_equal_lm_eval_hf_on_the_export(eval_layouts, references, name) -> None:
    run = eval_layouts["root"] / name
    results = json.loads((run / "tasks" / "step2.json").read_text())
    assert_same_as_hf(read_samples(run / "tasks" / "step2.samples.jsonl"), results, references[name])
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step2 = next(record for record in logged if record["step"] == 2)
    assert step2["tasks/shakespeare_play/acc"] == results["results"]["shakespeare_play"]["acc,none"]
    assert step2["tasks/shakespeare_passages/word_perplexity"] == pytest.approx(
        results["results"]["shakespeare_passages"]["word_perplexity,none"], rel=1e-12)


@pytest.mark.parametrize("name", list(OFFLINE))
def test_evaluate_over_stages_and_expert_ranks_equals_lm_eval_hf(eval_layouts, references, name) -> None:
    root = eval_layouts["root"]
    results = json.loads((root / f"{name}.json").read_text())
    assert_same_as_hf(read_samples(root / f"{name}.samples.jsonl"), results, references[name.removeprefix("offline-")])


def test_lora_checkpoint_offline_equals_hf_with_peft(eval_layouts, references) -> None:
    """The LoRA save (adapters on the base it records) through our backend at TP1 in this process."""
    from llama_megatron.training.run.lm_harness import LlamaMegatronLM, evaluate_tasks

    lm = LlamaMegatronLM(checkpoint=str(eval_layouts["root"] / "lora" / "ckpt"), tokenizer=TOKENIZER, batch_size=4)
    results = evaluate_tasks(lm, TASKS, LIMIT, None, seed=SEED, log_samples=True)
    assert_same_as_hf(results["samples"], results, references["lora"])
