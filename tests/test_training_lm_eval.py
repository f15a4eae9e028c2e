"""lm-evaluation-harness on our checkpoints (training/run/lm_harness.py) against `lm_eval`'s HF backend on the
exported HF model.

A random HF LLaMA (GQA) with the shipped tokenizer is converted to TP1, TP2 and TP2 x PP2 checkpoints; the TP2 x
PP2 one is exported back to HF and lm-eval's own HF backend (``HFLM``, fp32, CPU) runs the four shipped tasks on
it (two multiple-choice, one generation, one rolling log-likelihood; 8 documents each, 2-shot where the task has a
few-shot split). Ours runs them on each checkpoint: at TP1 in this process, at TP2 and at TP2 x PP2 (read as one
stage, as `generate` reads it) in one 2-process launch of `llama-megatron evaluate --tasks`. Every request's
log-likelihood is within 1e-4 of HF's with the same ``is_greedy``, every generation identical, every metric equal.
Bad input is one line and exit code 2 before any model is loaded.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from launch_utils import PRETRAIN_CONFIG, ROOT, launch_many, train_args
from model_utils import hf_model, tiny_config

from llama_megatron.cli import main as cli_main

TOKENIZER = os.path.join(ROOT, "data", "tokenizer")
TASKS = ["shakespeare_next_line", "shakespeare_play", "shakespeare_continue", "shakespeare_passages"]
LIMIT, FEWSHOT = 8, 2


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lm-eval")
    config = tiny_config(vocab_size=4096, num_key_value_heads=2, max_position_embeddings=256)
    hf_dir = root / "hf"
    hf_model(config, seed=5).save_pretrained(hf_dir)
    for name in os.listdir(TOKENIZER):
        shutil.copy(os.path.join(TOKENIZER, name), hf_dir / name)
    out = {"root": root}
    for name, layout in (("tp1", ["--tp", "1"]), ("tp2", ["--tp", "2"]), ("tp2pp2", ["--tp", "2", "--pp", "2"])):
        out[name] = str(root / name)
        assert cli_main(["convert", "hf-to-megatron", "--hf-dir", str(hf_dir), "--output", out[name], *layout,
                         "--make-vocab-size-divisible-by", "64"]) == 0
    exported = str(root / "exported")
    assert cli_main(["export", "--input", out["tp2pp2"], "--output", exported]) == 0
    for name in os.listdir(TOKENIZER):  # the tokenizer beside the exported weights, as a user's HF directory has it
        if not os.path.exists(os.path.join(exported, name)):
            shutil.copy(os.path.join(TOKENIZER, name), os.path.join(exported, name))
    out["exported"] = exported
    return out


@pytest.fixture(scope="module")
def reference(converted) -> dict:
    """lm-eval's HF backend on the exported model: its results with every sample."""
    from lm_eval.models.huggingface import HFLM

    from llama_megatron.training.run.lm_harness import evaluate_tasks

    model = HFLM(pretrained=converted["exported"], device="cpu", dtype="float32", batch_size=1)
    return evaluate_tasks(model, TASKS, LIMIT, FEWSHOT, log_samples=True)


def assert_same_as_hf(samples: dict[str, list[dict]], results: dict, reference: dict) -> None:
    """Request by request: log-likelihoods within 1e-4 with the same is_greedy, generations identical; then every
    metric of every task equal."""
    for task in TASKS:
        ours = sorted(samples[task], key=lambda s: s["doc_id"])
        theirs = sorted(reference["samples"][task], key=lambda s: s["doc_id"])
        assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in theirs] and len(ours) == LIMIT
        for mine, hf in zip(ours, theirs):
            for got, want in zip(mine["resps"], hf["resps"], strict=True):
                if task == "shakespeare_continue":
                    assert got == want, (task, mine["doc_id"], got, want)
                elif task == "shakespeare_passages":  # a sum over a whole passage's tokens
                    assert got[0] == pytest.approx(want[0], abs=1e-3), (task, got, want)
                else:
                    (logprob, greedy), (ref_logprob, ref_greedy) = got[0], want[0]
                    assert abs(logprob - ref_logprob) < 1e-4 and greedy == ref_greedy, (task, got, want)
        for metric, value in reference["results"][task].items():
            got = results["results"][task][metric]
            if isinstance(value, (int, float)):
                assert got == pytest.approx(value, rel=1e-6, abs=1e-9), (task, metric, got, value)
            else:  # the alias, "N/A" standard errors
                assert got == value, (task, metric, got, value)


def test_tp1_in_process_equals_lm_eval_hf(converted, reference) -> None:
    from llama_megatron.training.run.lm_harness import LlamaMegatronLM, evaluate_tasks

    results = evaluate_tasks(LlamaMegatronLM(checkpoint=converted["tp1"], batch_size=4), TASKS, LIMIT, FEWSHOT,
                             log_samples=True)
    assert_same_as_hf(results["samples"], results, reference)
    # the shipped generation task did generate (up to its newline or 16 tokens), not return empty strings
    assert any(s["resps"][0][0] for s in results["samples"]["shakespeare_continue"])


@pytest.fixture(scope="module")
def launched(converted) -> dict:
    """`evaluate --tasks` on 2 processes: the TP2 checkpoint and the TP2 x PP2 one, results and samples written."""
    root = converted["root"]
    runs = []
    for name in ("tp2", "tp2pp2"):
        runs.append({"verb": "evaluate", "args": [
            "--tasks", ",".join(TASKS), "--checkpoint", converted[name], "--limit", str(LIMIT), "--num-fewshot",
            str(FEWSHOT), "--batch-size", "3", "--output", str(root / f"{name}.json"),
            "--log-samples", str(root / f"{name}.samples.jsonl")]})
    launch_many(2, runs, str(root / "runs.json"))
    return {name: root for name in ("tp2", "tp2pp2")}


@pytest.mark.parametrize("name", ["tp2", "tp2pp2"])
def test_tensor_parallel_checkpoints_equal_lm_eval_hf(launched, reference, name) -> None:
    root = launched[name]
    results = json.loads((root / f"{name}.json").read_text())
    samples: dict[str, list[dict]] = {}
    for line in (root / f"{name}.samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        samples.setdefault(record["task"], []).append(record)
    assert_same_as_hf(samples, results, reference)


@pytest.mark.parametrize("args, message", [
    (["--tasks", "no_such_task"], "unknown lm-eval task 'no_such_task'"),
    (["--tasks", "shakespeare_play", "--limit", "0"], "--limit must be >= 1, got 0"),
    (["--tasks", "MISSING_YAML"], "task MISSING_YAML: its test data"),
    (["--tasks", "HUB_YAML"], "task hub_only: its dataset someone/not-here is not on this machine and nothing is "
                              "downloaded"),
    (["--tasks", "shakespeare_play"], "--tasks needs --checkpoint DIR"),
    ([], "give --config (the validation loss of checkpoint.load) or --tasks with --checkpoint"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path, capsys) -> None:
    """An unknown task, a task whose local data file is missing, a task whose dataset would have to be downloaded,
    --limit 0, no checkpoint: one line, exit 2, before any process group."""
    import torch.distributed as dist

    missing = tmp_path / "missing.yaml"
    missing.write_text("task: missing_data\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: gone.jsonl\n"
                       "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: x\n")
    hub = tmp_path / "hub.yaml"
    hub.write_text("task: hub_only\ndataset_path: someone/not-here\ntest_split: test\n"
                   "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: x\n")
    args = [a.replace("MISSING_YAML", str(missing)).replace("HUB_YAML", str(hub)) for a in args]
    message = message.replace("MISSING_YAML", str(missing))
    checkpoint = [] if message.startswith("--tasks needs") else ["--checkpoint", str(tmp_path / "none")]
    capsys.readouterr()
    assert cli_main(["evaluate", *args, *checkpoint]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"error: {message}"), errors
    assert not dist.is_initialized()


IN_TRAINING = ['data={"type": "synthetic"}', "parallel.tensor=2", "eval.interval=2", "train.steps=4",
               'eval.tasks=["shakespeare_play", "shakespeare_continue"]', "eval.tasks_limit=4"]


@pytest.fixture(scope="module")
def in_training(tmp_path_factory) -> dict:
    """One 2-process launch: a 4-step TP2 run with eval.tasks at steps 2 and 4; the same run stopped at step 2 with
    a save and resumed to step 4 (the LR schedule's decay_steps fixed: the two runs' steps are alike); the step-2
    save evaluated by `evaluate --tasks`."""
    root = tmp_path_factory.mktemp("lm-eval-training")
    save = ["checkpoint.save=" + str(root / "saves"), "checkpoint.interval=2", "checkpoint.load=auto"]
    runs = [train_args(PRETRAIN_CONFIG, [*IN_TRAINING, f"output_dir={root / 'whole'}"]),
            train_args(PRETRAIN_CONFIG, [*IN_TRAINING, *save, "train.steps=2", f"output_dir={root / 'first'}"]),
            train_args(PRETRAIN_CONFIG, [*IN_TRAINING, *save, f"output_dir={root / 'resumed'}"]),
            {"verb": "evaluate", "args": ["--tasks", "shakespeare_play,shakespeare_continue", "--checkpoint",
                                          str(root / "saves"), "--tag", "global_step2", "--tokenizer", TOKENIZER,
                                          "--limit", "4", "--output", str(root / "step2.json")]}]
    launch_many(2, runs, str(root / "runs.json"))
    return {"root": root}


def _task_records(run_dir) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        tasks = {k: v for k, v in record.items() if k.startswith("tasks/")}
        if tasks:
            assert record["tasks_s"] > 0
            out[record["step"]] = tasks
    return out


def test_tasks_during_training_resume_exactly_and_equal_evaluate(in_training) -> None:
    """The tasks' metrics at each evaluation in metrics.jsonl; the resumed run's equal the whole run's, and the
    step-2 save evaluated offline gives the step-2 figures."""
    root = in_training["root"]
    whole = _task_records(root / "whole")
    assert sorted(whole) == [2, 4]
    assert set(whole[2]) == {"tasks/shakespeare_play/acc", "tasks/shakespeare_continue/exact_match"}
    assert 0 <= whole[2]["tasks/shakespeare_play/acc"] <= 1
    assert _task_records(root / "first") == {2: whole[2]}
    assert _task_records(root / "resumed") == {4: whole[4]}
    offline = json.loads((root / "step2.json").read_text())["results"]
    assert offline["shakespeare_play"]["acc,none"] == whole[2]["tasks/shakespeare_play/acc"]
    assert offline["shakespeare_continue"]["exact_match,none"] == whole[2]["tasks/shakespeare_continue/exact_match"]


@pytest.mark.parametrize("overrides, message", [
    (['eval.tasks=["no_such_task"]', "eval.interval=2"], "unknown lm-eval task 'no_such_task'"),
    (['eval.tasks=["shakespeare_play"]'], "eval.tasks run at the evaluations, and eval.interval is 0"),
    (['eval.tasks=["shakespeare_play"]', "eval.interval=2", "parallel.pipeline=2"],
     "eval.tasks runs on a one-stage model without context parallelism"),
    (['eval.tasks=["shakespeare_play"]', "eval.interval=2", "tokenizer=null"],
     "eval.tasks tokenises lm-eval's requests with the run's tokenizer"),
])
def test_bad_eval_tasks_are_one_line_before_launch(overrides, message, tmp_path, capsys) -> None:
    import torch.distributed as dist

    capsys.readouterr()
    code = cli_main(["train", *train_args(PRETRAIN_CONFIG, ['data={"type": "synthetic"}', *overrides,
                                                           f"output_dir={tmp_path / 'out'}"])])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {message}"), errors
    assert not dist.is_initialized()
