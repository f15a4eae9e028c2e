"""A short launcher run on one GPU with `kernels: auto` tracks the reference-kernel run (skips without CUDA)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from launch_utils import ROOT, launch, losses

from llama_megatron.cli import main as cli_main

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.launched]

CONFIG = os.path.join(ROOT, "tests", "configs", "e2e_pretrain.json")
BF16_REL = 2e-2  # bf16 with different kernels: rounding differs, the model does not


def test_auto_kernels_track_reference_under_the_launcher(tmp_path) -> None:
    prefix = str(tmp_path / "shakespeare")
    assert cli_main(["preprocess", "--input", os.path.join(ROOT, "data/corpus/shakespeare.jsonl"), "--tokenizer",
                     os.path.join(ROOT, "data/tokenizer"), "--output-prefix", prefix, "--append-eod",
                     "--quiet"]) == 0
    runs = {}
    for kernels in ("reference", "auto"):
        out = str(tmp_path / kernels)
        launch(1, CONFIG, [f"data.prefix={prefix}_text_document", f"output_dir={out}", f"kernels={kernels}",
                           "train.steps=20", "deepspeed_config=ds_configs/zero1_bf16.json"], launcher=True)
        runs[kernels] = losses(out)
        info = json.load(open(os.path.join(out, "run.json")))
        assert info["kernels"]["kernels"] == ("reference" if kernels == "reference" else "compiled")
    assert runs["auto"][20] < runs["auto"][1] - 0.5
    for step in range(1, 21):
        assert abs(runs["auto"][step] - runs["reference"][step]) <= BF16_REL * runs["reference"][step], step
