"""Converted checkpoints under the real `deepspeed` launcher, and training checkpoints exported back to HF.

One HF model (GQA, untied, vocab padded) is converted to TP2 x PP2; then, 4 processes each (gloo, CPU, fp32):
1. `--eval-only` of the converted checkpoint gives HF's loss on the same validation batches, with and without
   sequence parallelism, and with context parallelism (CP2 x TP2);
2. fine-tuning it at TP2 x PP2 with ZeRO-1 for 3 steps, saving, exporting: HF on the export gives the run's own
   validation loss, and the export's logits equal our model loaded from the same checkpoint (load_model_weights);
3. the same at TP2 x PP1 x DP2 with ZeRO-3 (so the converted PP2 checkpoint also starts a PP1 run, and the export
   reads the fp32 partitions out of the optimizer files).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from launch_utils import launch_many, run_command
from model_utils import hf_model, tiny_config
from test_checkpoint_convert_roundtrip import hf_tensors, save_hf

from llama_megatron.checkpoint.directory import read_meta
from llama_megatron.checkpoint.megatron_reader import load_model_weights
from llama_megatron.cli import main as cli
from llama_megatron.model.build import build_model
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import ParallelConfig
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.run.batches import build_datasets, step_batches

REL = 1e-5
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("convert-ds")
    config = tiny_config(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    hf_dir = save_hf(hf_model(config, seed=3), str(work / "hf"), tokenizer=False)
    converted = str(work / "converted")
    assert cli(["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--output", converted, "--tp", "2", "--pp", "2",
                "--make-vocab-size-divisible-by", "64"]) == 0
    train_config = {
        "model": hf_dir,
        "parallel": {"tensor": 2, "pipeline": 2, "make_vocab_size_divisible_by": 64},
        "data": {"type": "synthetic"},
        "seq_length": 32,
        "batch": {"micro_batch_size": 2, "global_batch_size": 8},
        "train": {"steps": 3},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "weight_decay": 0.1, "clip_grad": 1.0, "warmup_steps": 1,
                      "decay_style": "cosine", "decay_steps": 3},
        "eval": {"interval": 3, "iters": 1},
        "logging": {"interval": 1},
        "checkpoint": {"load": converted, "finetune": True},
        "deepspeed_config": "ds_configs/zero1_fp32.json",
        "seed": 42,
    }
    path = str(work / "train.json")
    with open(path, "w") as fh:
        json.dump(train_config, fh)
    return {"work": work, "hf_dir": hf_dir, "converted": converted, "config": path}


def launch(setup: dict, name: str, *args: str, entry: tuple[str, ...] = ("-m", "llama_megatron.train")) -> str:
    """4 processes under the deepspeed launcher; returns the run's output dir."""
    out = str(setup["work"] / name)
    run_command(4, list(entry), ["--config", setup["config"], "--set", f"output_dir={out}", *args])
    return out


TRAIN_RUNS = {  # name -> arguments of `train`: all in one 4-process launch (tests/scripts/train_many.py)
    "eval-only": ["--eval-only", "--set=parallel.sequence_parallel=false"],
    "eval-only-cp2": ["--eval-only", "--set=parallel.context=2", "--set=parallel.pipeline=1",
                      "--set=parallel.sequence_parallel=true"],
    "zero1-tp2-pp2": ["--set=checkpoint.save={work}/zero1-ckpt", "--set=checkpoint.interval=3"],
    "zero3-tp2-dp2": ["--set=parallel.pipeline=1", f"--set=deepspeed_config={json.dumps(ZERO3)}",
                      "--set=checkpoint.save={work}/zero3-ckpt", "--set=checkpoint.interval=3"],
}


@pytest.fixture(scope="module")
def runs(setup) -> dict[str, str]:
    """Every TRAIN_RUNS entry trained or evaluated; name -> output dir."""
    work = setup["work"]
    outs = {name: str(work / name) for name in TRAIN_RUNS}
    launch_many(4, [["--config", setup["config"], "--set", f"output_dir={outs[name]}",
                     *(a.replace("{work}", str(work)) for a in args)] for name, args in TRAIN_RUNS.items()],
                str(work / "runs.json"))
    return outs


def val_loss(out: str) -> dict[int, float]:
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return {r["step"]: r["val_loss"] for r in map(json.loads, fh) if "val_loss" in r}


def hf_val_loss(setup: dict, hf_dir: str) -> float:
    """HF's loss on the run's validation batches (mean over micro batches, as the engine reports it)."""
    from transformers import AutoModelForCausalLM

    config = TrainingConfig.from_file(setup["config"])
    _, valid, _ = build_datasets(config)
    batches = [mb for step in step_batches(valid, config, ParallelContext.single(), 0, config.eval.iters)
               for mb in step]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        losses = [F.cross_entropy(model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits.flatten(0, 1),
                                  mb.labels.flatten()) for mb in batches]
    return float(torch.stack(losses).mean())


def export(ckpt: str, out: str, *extra: str) -> str:
    assert cli(["export", "--input", ckpt, "--output", out, *extra]) == 0
    return out


def assert_close(got: float, want: float) -> None:
    assert abs(got - want) <= REL * abs(want), f"{got!r} vs {want!r} (rel tol {REL})"


def assert_trained(setup: dict, hf_out: str) -> None:
    """The export holds the trained weights (every tensor moved), not the converted starting point."""
    start, trained = hf_tensors(setup["hf_dir"]), hf_tensors(hf_out)
    assert set(start) == set(trained)
    unchanged = [name for name in start if torch.equal(start[name], trained[name])]
    assert not unchanged, f"tensors not trained: {unchanged}"


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.launched
def test_converted_checkpoint_evaluates_like_hf(setup, runs, sequence_parallel) -> None:
    """TP2 x PP2 with and without sequence parallelism (sequence shards travel between the stages); once as
    `train --eval-only`, once as the `evaluate` verb of `python -m llama_megatron` under the launcher."""
    if sequence_parallel:
        out = launch(setup, "evaluate-sp", "--set=parallel.sequence_parallel=true",
                     entry=("-m", "llama_megatron", "evaluate"))
    else:
        out = runs["eval-only"]
    assert_close(val_loss(out)[0], hf_val_loss(setup, setup["hf_dir"]))


def test_converted_checkpoint_evaluates_like_hf_with_context_parallelism(setup, runs) -> None:
    """`--eval-only` at CP2 x TP2 with SP (4 processes; the PP2 checkpoint read per layer into PP1): each rank holds 8
    of the 32 tokens, and the one KV head per TP rank is repeated for CP2's all-to-all."""
    out = runs["eval-only-cp2"]
    info = json.load(open(os.path.join(out, "run.json")))
    assert (info["context"], info["tensor"], info["pipeline"]) == (2, 2, 1)
    assert_close(val_loss(out)[0], hf_val_loss(setup, setup["hf_dir"]))


def test_zero1_pipeline_training_exports_exactly(setup, runs) -> None:
    out = runs["zero1-tp2-pp2"]
    ckpt = str(setup["work"] / "zero1-ckpt")
    meta = read_meta(ckpt)
    assert (meta.step, meta.tensor, meta.pipeline, meta.zero_stage) == (3, 2, 2, 1)
    hf_out = export(ckpt, str(setup["work"] / "zero1-hf"))
    assert_close(hf_val_loss(setup, hf_out), val_loss(out)[3])
    assert_trained(setup, hf_out)

    # our model, loaded by load_model_weights from the same weights (resharded to TP1 for one process)
    tp1 = str(setup["work"] / "zero1-tp1")
    assert cli(["reshard", "--input", ckpt, "--output", tp1, "--tp", "1", "--pp", "1",
                "--make-vocab-size-divisible-by", "64"]) == 0
    config = TrainingConfig.from_file(setup["config"]).model
    ours = build_model(config, ParallelConfig(make_vocab_size_divisible_by=64), ParallelContext.single(),
                       initialize=False)
    load_model_weights(ours, tp1, "converted", tp_rank=0)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_out, local_files_only=True, dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours.full_logits(ours(ids)) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4, f"logits differ by {diff}"


def test_zero3_training_exports_exactly(setup, runs) -> None:
    out = runs["zero3-tp2-dp2"]
    ckpt = str(setup["work"] / "zero3-ckpt")
    meta = read_meta(ckpt)
    assert (meta.tensor, meta.pipeline, meta.data_parallel, meta.zero_stage) == (2, 1, 2, 3)
    hf_out = export(ckpt, str(setup["work"] / "zero3-hf"))
    assert_close(hf_val_loss(setup, hf_out), val_loss(out)[3])
    assert_trained(setup, hf_out)
    # one DP partition gone: a clear error, no output
    os.remove(os.path.join(ckpt, meta.tag, "zero_pp_rank_1_mp_rank_01_optim_states.pt"))
    bad = str(setup["work"] / "zero3-bad")
    assert cli(["export", "--input", ckpt, "--output", bad]) == 2
    assert not os.path.exists(bad)
