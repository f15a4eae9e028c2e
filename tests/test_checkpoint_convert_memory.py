"""Conversion streams: peak RSS stays under 2x the largest layer above the converter's fixed overhead.

The model (~210 MB fp32: 6 decoder layers of 28 MB, two 25 MB embeddings) is converted in fresh processes
(``tests/scripts/peak_rss.py`` reports VmHWM). The fixed overhead is measured, not assumed: the same script with
``--idle`` imports exactly what the converter imports and exits (about 245 MB here, nearly all of it torch).
Loading the whole model, as ``from_pretrained`` does, would add ~210 MB: far beyond the 2 x 28 MB allowed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from llama_megatron.config import ModelConfig
from llama_megatron.model.param_layout import ParamLayout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "peak_rss.py")
CONFIG = ModelConfig(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                     num_attention_heads=12, max_position_embeddings=128)


def peak_rss(*args: str) -> int:
    result = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT,
                            env=dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_rss"]


def largest_layer_bytes(config: ModelConfig) -> int:
    return max(ParamLayout(config).numel_by_layer().values()) * 4


@pytest.fixture(scope="module")
def big_hf(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("big-hf")
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=generator) for name, shape in ParamLayout(CONFIG).hf_shapes().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with open(path / "config.json", "w") as fh:
        json.dump(CONFIG.to_hf_dict(), fh)
    return str(path)


@pytest.mark.launched
def test_conversion_peak_rss_is_bounded_by_the_largest_layer(big_hf, tmp_path) -> None:
    model_bytes = os.path.getsize(os.path.join(big_hf, "model.safetensors"))
    layer = largest_layer_bytes(CONFIG)
    assert model_bytes > 7 * layer  # the bound below is far from "the whole model"
    idle = peak_rss("--idle")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    # PP=1: the whole TP rank goes into one mp_rank file, the case that would tempt a converter to hold it all
    to_megatron = peak_rss("convert", "hf-to-megatron", "--hf-dir", big_hf, "--output", ckpt, "--tp", "1")
    to_hf = peak_rss("export", "--input", ckpt, "--output", out, "--max-shard-size", "100MB")
    mb = 2**20
    print(f"model {model_bytes / mb:.0f} MB, largest layer {layer / mb:.1f} MB, fixed overhead {idle / mb:.0f} MB, "
          f"hf-to-megatron +{(to_megatron - idle) / mb:.0f} MB, megatron-to-hf +{(to_hf - idle) / mb:.0f} MB")
    assert to_megatron <= idle + 2 * layer, f"hf-to-megatron peak {to_megatron / mb:.0f} MB"
    assert to_hf <= idle + 2 * layer, f"megatron-to-hf peak {to_hf / mb:.0f} MB"
    # and the round trip is exact
    exported = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(out, name), "pt") as fh:
                exported.update({key: fh.get_tensor(key) for key in fh.keys()})
    with safe_open(os.path.join(big_hf, "model.safetensors"), "pt") as fh:
        assert set(fh.keys()) == set(exported)
        for key in fh.keys():
            assert torch.equal(fh.get_tensor(key), exported[key]), key
