"""ZeRO-3 with the model built partitioned (``deepspeed.zero.Init``, ``distributed.zero3_init``) against the model
built whole on every rank and partitioned by the engine: the seeded random start and the fine-tuning start from a
checkpoint (weights read straight into each rank's slices) train bit for bit alike, at DP2 and at TP2 x DP2, in bf16
too; the checkpoints they write export to the same Hugging Face weights and generate the same text."""

from __future__ import annotations

import os

import pytest
import torch
from launch_utils import PRETRAIN_CONFIG, ROOT, launch_many, train_args
from safetensors.torch import load_file

from llama_megatron.cli import main as cli_main

CONFIG = PRETRAIN_CONFIG
STEPS = 3
ZERO3 = 'deepspeed_config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}'
ZERO3_BF16 = ('deepspeed_config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, '
              '"bf16": {"enabled": true}}')
# odd sizes: partitions that do not divide the parameters (padding on the last rank)
ODD = ["model.hidden_size=63", "model.num_attention_heads=3", "model.num_key_value_heads=3", "model.head_dim=22",
       "model.intermediate_size=129"]


def _curve(out) -> dict[int, tuple[float, float]]:
    import json

    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, fh) if "loss" in r}


def _runs(prefix: str, work, layouts: dict[str, list[str]]) -> list[list[str]]:
    """For each layout and each construction: a seeded start saving its last step, then a fine-tuning start from
    the whole-construction run's checkpoint."""
    runs = []
    for name, layout in layouts.items():
        for init in ("false", "true"):
            common = [f"data.prefix={prefix}", f"train.steps={STEPS}", f"distributed.zero3_init={init}", *layout]
            out = work / f"{name}-{init}"
            runs.append(train_args(CONFIG, [*common, f"output_dir={out}", f"checkpoint.save={out}/ckpt",
                                            f"checkpoint.interval={STEPS}"]))
            runs.append(train_args(CONFIG, [*common, f"output_dir={out}-finetune",
                                            f"checkpoint.load={work / name}-false/ckpt", "checkpoint.finetune=true",
                                            "seed=7"]))
    return runs


DP2 = {"dp2": [ZERO3], "dp2-odd-bf16": [ZERO3_BF16, *ODD]}
TP2_DP2 = {"tp2-dp2": ["parallel.tensor=2", "parallel.sequence_parallel=true", ZERO3]}


@pytest.fixture(scope="module")
def runs(shakespeare_prefix, tmp_path_factory):
    work = tmp_path_factory.mktemp("zero3-init")
    built = []
    for ranks, layouts in ((2, DP2), (4, TP2_DP2)):
        output = launch_many(ranks, _runs(shakespeare_prefix, work, layouts), str(work / f"{ranks}.json")).stdout
        built += [line for line in output.splitlines() if "built partitioned" in line]
    # the partitioned construction was taken: by the 2 zero3_init runs of each layout
    assert len(built) == 2 * (len(DP2) + len(TP2_DP2)), built
    assert all("each rank holding 1/2 of each" in line for line in built), built
    return work


@pytest.mark.parametrize("name", [*DP2, *TP2_DP2])
def test_partitioned_construction_trains_like_the_whole_model(runs, name) -> None:
    for suffix in ("", "-finetune"):
        whole, partitioned = _curve(runs / f"{name}-false{suffix}"), _curve(runs / f"{name}-true{suffix}")
        assert len(whole) == STEPS and partitioned == whole, (suffix, partitioned, whole)
    assert _curve(runs / f"{name}-false-finetune") != _curve(runs / f"{name}-false")  # it did start from the save


@pytest.mark.parametrize("name", ["dp2-odd-bf16", "tp2-dp2"])
def test_its_checkpoints_export_the_same_weights(runs, name) -> None:
    exported = []
    for init in ("false", "true"):
        out = runs / f"export-{name}-{init}"
        assert cli_main(["export", "--input", str(runs / f"{name}-{init}" / "ckpt"), "--output", str(out)]) == 0
        tensors = {}
        for file in sorted(os.listdir(out)):
            if file.endswith(".safetensors"):
                tensors.update(load_file(out / file))
        exported.append(tensors)
    assert exported[0].keys() == exported[1].keys()
    for key, tensor in exported[0].items():
        assert torch.equal(tensor, exported[1][key]), key


def test_generate_reads_its_checkpoint(runs) -> None:
    """generate decodes the checkpoint of the partitioned run (TP1) exactly as that of the whole-model run."""
    import json

    tokens = []
    for init in ("false", "true"):
        out = runs / f"generated-{init}.jsonl"
        assert cli_main(["generate", "--checkpoint", str(runs / f"dp2-odd-bf16-{init}" / "ckpt"), "--tokenizer",
                         os.path.join(ROOT, "data", "tokenizer"), "--raw", "--prompt", "To be, or not to be",
                         "--max-new-tokens", "8", "--output", str(out)]) == 0
        tokens.append([json.loads(line)["tokens"] for line in open(out, encoding="utf-8")])
    assert tokens[0] == tokens[1] and len(tokens[0][0]) == 8
