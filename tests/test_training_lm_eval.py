"""lm-evaluation-harness on our checkpoints (training/run/lm_harness.py) against `lm_eval`'s HF backend on the
exported HF model.

A random HF LLaMA (GQA) with the shipped tokenizer is converted to TP1, TP2 and TP2 x PP2 checkpoints; the TP2 x
PP2 one is exported back to HF and lm-eval's own HF backend (``HFLM``, fp32, CPU) runs the four shipped tasks on
it (two multiple-choice, one generation, one rolling log-likelihood; 8 documents each, 2-shot where the task has a
few-shot split). Ours runs them on each checkpoint: at TP1 in this process, at TP2 and at TP2 x PP2 (read as one
stage, as `generate` reads it), the TP1 one over two pipeline stages (`--pipeline 2`) and the TP1 one as two
replicas sharing the documents, in one 2-process launch of `llama-megatron evaluate --tasks`. Every request's
log-likelihood is within 1e-4 of HF's with the same ``is_greedy``, every generation identical, every metric equal.
A random Qwen2 model with a Qwen2 tokenizer, which has no BOS, is checked the same way in this process. Bad input is
one line and exit code 2 before any model is loaded.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from launch_utils import PRETRAIN_CONFIG, launch_many, train_args
from lm_eval_utils import (
    TOKENIZER,
    add_tokenizer,
    assert_same_as_hf,
    hf_results,
    qwen2_tokenizer,
    read_samples,
)
from model_utils import hf_model, tiny_config

from llama_megatron.cli import main as cli_main

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
    add_tokenizer(exported)
    out["exported"] = exported
    return out


@pytest.fixture(scope="module")
def reference(converted) -> dict:
    """lm-eval's HF backend on the exported model: its results with every sample."""
    return hf_results(converted["exported"], TASKS, LIMIT, FEWSHOT)


def test_tp1_in_process_equals_lm_eval_hf(converted, reference) -> None:
    from llama_megatron.training.run.lm_harness import LlamaMegatronLM, evaluate_tasks

    results = evaluate_tasks(LlamaMegatronLM(checkpoint=converted["tp1"], batch_size=4), TASKS, LIMIT, FEWSHOT,
                             log_samples=True)
    assert_same_as_hf(results["samples"], results, reference)
    # the shipped generation task did generate (up to its newline or 16 tokens), not return empty strings
    assert any(s["resps"][0][0] for s in results["samples"]["shakespeare_continue"])


@pytest.fixture(scope="module")
def no_bos(tmp_path_factory) -> dict[str, str]:
    """A random Qwen2 model beside a Qwen2 tokenizer, which has no BOS (``"bos_token": null``, as every Qwen2 and
    Qwen2.5 tokenizer), and its TP1 conversion."""
    root = tmp_path_factory.mktemp("lm-eval-no-bos")
    hf_dir = root / "hf"
    # Qwen2's config.json names its EOS (<|endoftext|>, here id 0) as bos_token_id too
    config = tiny_config(model_type="qwen2", vocab_size=1024, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=0)
    hf_model(config, seed=7).save_pretrained(hf_dir)
    qwen2_tokenizer(str(hf_dir))
    checkpoint = str(root / "tp1")
    assert cli_main(["convert", "hf-to-megatron", "--hf-dir", str(hf_dir), "--output", checkpoint, "--tp", "1",
                     "--make-vocab-size-divisible-by", "64"]) == 0
    return {"hf": str(hf_dir), "tp1": checkpoint}


@pytest.mark.launched  # lm-eval's simple_evaluate runs `pip list` (torch's collect_env) for its results
def test_a_tokenizer_without_bos_equals_lm_eval_hf(no_bos) -> None:
    """A Qwen2 checkpoint whose tokenizer has no BOS: lm-eval's HF backend prefixes what has no context (a rolling
    log-likelihood's first window) with EOS then, or with its ``prefix_token_id`` argument; ours is that backend, so
    on the four tasks every request and metric is the HF backend's on the same model, and on the rolling task with a
    ``prefix_token_id`` too (given as lm-eval's CLI gives it, in the argument string)."""
    from llama_megatron.training.run.lm_harness import LlamaMegatronLM, evaluate_tasks

    lm = LlamaMegatronLM(checkpoint=no_bos["tp1"], batch_size=4)  # refused before: "cannot tell the bos token"
    assert lm.tokenizer.bos_token_id is None and lm.prefix_token_id == lm.tokenizer.eos_token_id
    results = evaluate_tasks(lm, TASKS, LIMIT, FEWSHOT, log_samples=True)
    assert_same_as_hf(results["samples"], results, hf_results(no_bos["hf"], TASKS, LIMIT, FEWSHOT))
    assert any(s["resps"][0][0] for s in results["samples"]["shakespeare_continue"])  # it generated text

    rolling, prefix = ["shakespeare_passages"], 7  # any token but EOS
    prefixed = LlamaMegatronLM.create_from_arg_string(f"prefix_token_id={prefix}", {"loaded": lm.loaded,
                                                                                    "batch_size": 4})
    custom = evaluate_tasks(prefixed, rolling, LIMIT, FEWSHOT, log_samples=True)
    assert_same_as_hf(custom["samples"], custom, hf_results(no_bos["hf"], rolling, LIMIT, FEWSHOT,
                                                            prefix_token_id=prefix))
    # the argument took effect: every passage's first token is conditioned on another token than EOS
    by_doc = {s["doc_id"]: s["resps"] for s in results["samples"][rolling[0]]}
    assert all(s["resps"] != by_doc[s["doc_id"]] for s in custom["samples"][rolling[0]])


def test_eval_tasks_take_a_tokenizer_without_bos(no_bos, tmp_path) -> None:
    """A run with eval.tasks and that tokenizer passes the checks before launch, which asked it for a BOS."""
    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.run.setup import preflight

    config = TrainingConfig.from_file(PRETRAIN_CONFIG, [
        'data={"type": "synthetic"}', "parallel.tensor=1", "eval.interval=2", 'eval.tasks=["shakespeare_play"]',
        f"tokenizer={os.path.join(no_bos['tp1'], 'hf_config')}", f"output_dir={tmp_path / 'out'}"])
    assert preflight(config, world_size=1).config.tokenizer == os.path.join(no_bos["tp1"], "hf_config")


def _typed(value):
    """A response as lm-eval's sample files write it (every number as text) as its values."""
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return value == "True" if value in ("True", "False") else float(value)


def _shipped_tasks_in(folder) -> None:
    """The shipped tasks as YAML files with their data files made absolute (lm-eval's CLI resolves them from the
    working directory), for its --include_path."""
    import yaml

    from llama_megatron.training.run.lm_tasks import task_configs

    for config in task_configs(TASKS):
        (folder / f"{config['task']}.yaml").write_text(yaml.safe_dump(config))


@pytest.mark.launched
def test_plain_lm_eval_command_line_finds_the_backend(converted, reference, tmp_path) -> None:
    """lm-eval's own console script (`lm_eval run --model llama_megatron`, nothing of ours imported first) on the TP1
    checkpoint: its result and sample files as lm-eval writes them, the same as the HF backend's."""
    import glob
    import subprocess
    import sys

    _shipped_tasks_in(tmp_path)
    out = tmp_path / "out"
    lm_eval = os.path.join(os.path.dirname(sys.executable), "lm_eval")
    done = subprocess.run([lm_eval, "run", "--model", "llama_megatron", "--model_args", f"checkpoint={converted['tp1']}",
                           "--batch_size", "4", "--include_path", str(tmp_path), "--tasks", ",".join(TASKS), "--limit",
                           str(LIMIT), "--num_fewshot", str(FEWSHOT), "--seed", "1234", "--output_path", str(out),
                           "--log_samples"], capture_output=True, text=True,
                          env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    [results_file] = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    samples: dict[str, list[dict]] = {}
    for task in TASKS:
        [path] = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        samples[task] = [json.loads(line) for line in open(path, encoding="utf-8")]
        if task != "shakespeare_continue":  # lm-eval's sample files write each number of a response as text
            for sample in samples[task]:
                sample["resps"] = _typed(sample["resps"])
    assert_same_as_hf(samples, json.loads(open(results_file, encoding="utf-8").read()), reference)


def test_lm_eval_verb_and_simple_evaluate_find_the_backend(converted, reference, tmp_path) -> None:
    """`llama-megatron lm-eval run` (lm-eval's CLI in our process, offline) and `simple_evaluate(model=
    "llama_megatron")`: the HF backend's accuracy."""
    import glob

    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model

    from llama_megatron.training.run.lm_harness import LlamaMegatronLM
    from llama_megatron.training.run.lm_tasks import task_configs

    _shipped_tasks_in(tmp_path)
    out = tmp_path / "out"
    assert cli_main(["lm-eval", "run", "--model", "llama_megatron", "--model_args", f"checkpoint={converted['tp1']}",
                     "--batch_size", "4", "--include_path", str(tmp_path), "--tasks", TASKS[0], "--limit", str(LIMIT),
                     "--num_fewshot", str(FEWSHOT), "--seed", "1234", "--output_path", str(out)]) == 0
    [results_file] = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    results = json.loads(open(results_file, encoding="utf-8").read())
    assert results["results"][TASKS[0]]["acc,none"] == reference["results"][TASKS[0]]["acc,none"]

    assert get_model("llama_megatron") is LlamaMegatronLM and get_model("hf").__name__ == "HFLM"
    by_name = simple_evaluate(model="llama_megatron", model_args=f"checkpoint={converted['tp1']}",
                              tasks=task_configs(TASKS[:1]), limit=LIMIT, num_fewshot=FEWSHOT, batch_size=2)
    assert by_name["results"][TASKS[0]]["acc,none"] == reference["results"][TASKS[0]]["acc,none"]


@pytest.fixture(scope="module")
def launched(converted) -> dict:
    """`evaluate --tasks` on 2 processes: the TP2 checkpoint and the TP2 x PP2 one, results and samples written."""
    root = converted["root"]
    runs = []
    for name, checkpoint, layout in (("tp2", "tp2", []), ("tp2pp2", "tp2pp2", []),
                                     ("tp1-pipeline2", "tp1", ["--pipeline", "2"]), ("tp1-replicas2", "tp1", [])):
        runs.append({"verb": "evaluate", "args": [
            "--tasks", ",".join(TASKS), "--checkpoint", converted[checkpoint], "--limit", str(LIMIT), "--num-fewshot",
            str(FEWSHOT), "--batch-size", "3", *layout, "--output", str(root / f"{name}.json"),
            "--log-samples", str(root / f"{name}.samples.jsonl")]})
    launch_many(2, runs, str(root / "runs.json"))
    return {name: root for name in ("tp2", "tp2pp2", "tp1-pipeline2", "tp1-replicas2")}


@pytest.mark.parametrize("name", ["tp2", "tp2pp2", "tp1-pipeline2", "tp1-replicas2"])
def test_tensor_parallel_checkpoints_equal_lm_eval_hf(launched, reference, name) -> None:
    root = launched[name]
    results = json.loads((root / f"{name}.json").read_text())
    assert_same_as_hf(read_samples(root / f"{name}.samples.jsonl"), results, reference)


@pytest.mark.parametrize("args, message", [
    (["--tasks", "no_such_task"], "unknown lm-eval task 'no_such_task'"),
    (["--tasks", "shakespeare_play", "--limit", "0"], "--limit must be >= 1, got 0"),
    (["--tasks", "shakespeare_play", "--pipeline", "0"], "--pipeline and --expert must be >= 1"),
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


def test_a_layout_the_processes_do_not_make_is_one_line(converted, capsys) -> None:
    """`--pipeline 2` of a TP1 checkpoint in one process: the processes it needs, before any process group."""
    import torch.distributed as dist

    capsys.readouterr()
    assert cli_main(["evaluate", "--tasks", "shakespeare_play", "--checkpoint", converted["tp1"], "--pipeline",
                     "2"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and "is tensor parallel 1, read over 2 pipeline stage(s) and 1 expert rank(s): run with " \
        "2 process(es) (deepspeed --num_gpus 2) or a multiple of it, not 1" in errors[0], errors
    assert not dist.is_initialized()


def test_tasks_run_at_every_evaluation_or_every_tasks_interval() -> None:
    from llama_megatron.training.config_sections import EvalConfig

    every = EvalConfig(interval=2, tasks=("shakespeare_play",))
    sparse = EvalConfig(interval=2, tasks=("shakespeare_play",), tasks_interval=6)
    assert [s for s in range(1, 13) if every.tasks_due(s)] == [2, 4, 6, 8, 10, 12]
    assert [s for s in range(1, 13) if sparse.tasks_due(s)] == [6, 12]
    assert not any(EvalConfig(interval=2).tasks_due(s) for s in range(1, 13))
    off = EvalConfig(interval=0, tasks=("no_such_task",))  # evaluation off: the tasks never run, nothing refused
    off.check()
    assert not any(off.tasks_due(s) for s in range(1, 13))


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
    (['eval.tasks=["shakespeare_play"]', "eval.interval=2", "eval.tasks_interval=3"],
     "eval.tasks_interval 3 must be a multiple of eval.interval 2"),
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
