"""Bad conversion inputs end in one ``error: ...`` line, exit code 2, and no output (not even a temp dir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from model_utils import hf_model, tiny_config
from test_checkpoint_convert_roundtrip import save_hf, save_meta

from llama_megatron.cli import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model():
    return hf_model(tiny_config(num_key_value_heads=2))


@pytest.fixture
def hf_dir(model, tmp_path) -> str:
    return save_hf(model, str(tmp_path / "hf"))


@pytest.fixture
def converted(hf_dir, tmp_path) -> str:
    ckpt = str(tmp_path / "ckpt")
    assert cli(["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--output", ckpt, "--tp", "2", "--pp", "2"]) == 0
    return ckpt


def fails(capsys, argv: list[str], message: str) -> None:
    out_dir = argv[argv.index("--output") + 1]
    existed = os.path.exists(out_dir)
    capsys.readouterr()
    assert cli(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert message in errors[0], errors[0]
    assert os.path.exists(out_dir) == existed, "a failed conversion must leave no output"
    parent = os.path.dirname(os.path.abspath(out_dir))
    assert not [n for n in os.listdir(parent) if n.startswith((".tmp-", ".old-"))], "temp dir left behind"


def test_missing_shard(hf_dir, tmp_path, capsys) -> None:
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))
    victim = sorted(set(index["weight_map"].values()))[1]
    os.remove(os.path.join(hf_dir, victim))
    fails(capsys, ["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--output", str(tmp_path / "o"), "--tp", "2"],
          f"shard {victim} listed in model.safetensors.index.json is missing")


@pytest.mark.parametrize("key, value, message", [
    ("intermediate_size", 128, "has shape (96, 64), the model config implies (128, 64)"),
    ("num_hidden_layers", 1, "tensors the model config does not describe, e.g. model.layers.1."),
    ("num_hidden_layers", 3, "tensor model.layers.2.input_layernorm.weight is missing"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
])
def test_config_mismatch(hf_dir, tmp_path, capsys, key, value, message) -> None:
    path = os.path.join(hf_dir, "config.json")
    config = json.load(open(path))
    config[key] = value
    json.dump(config, open(path, "w"))
    fails(capsys, ["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--output", str(tmp_path / "o"), "--tp", "1"],
          message)


@pytest.mark.parametrize("tp, message", [(3, "tensor parallel degree 3 does not divide num_attention_heads 8"),
                                         (4, "tensor parallel degree 4 does not divide num_key_value_heads 2")])
def test_tp_must_divide_heads(hf_dir, converted, tmp_path, capsys, tp, message) -> None:
    fails(capsys, ["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--output", str(tmp_path / "o"), "--tp", str(tp)],
          message)
    fails(capsys, ["reshard", "--input", converted, "--output", str(tmp_path / "r"), "--tp", str(tp)], message)


def test_existing_output_needs_overwrite(hf_dir, tmp_path, capsys) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    argv = ["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--output", str(out), "--tp", "1"]
    fails(capsys, argv, "already exists (pass --overwrite to replace it)")
    assert (out / "keep.txt").read_text() == "mine"
    assert cli([*argv, "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["converted", "hf_config", "latest"]
    fails(capsys, ["export", "--input", str(out), "--output", str(out / "converted")], "overlaps the input")


def test_truncated_files(hf_dir, converted, tmp_path, capsys) -> None:
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))
    shard = os.path.join(hf_dir, sorted(set(index["weight_map"].values()))[0])
    os.truncate(shard, os.path.getsize(shard) - 100)
    fails(capsys, ["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--output", str(tmp_path / "o"), "--tp", "1"],
          "(truncated or not safetensors)")
    # a layer file in the middle of the model: the manifest's size says so before anything is read or written
    layer = os.path.join(converted, "converted", "layer_02-model_01-model_states.pt")
    os.truncate(layer, os.path.getsize(layer) // 2)
    fails(capsys, ["export", "--input", converted, "--output", str(tmp_path / "hf-out")],
          "is damaged: layer_02-model_01-model_states.pt has")
    assert not os.path.exists(tmp_path / "hf-out")


def test_missing_checkpoint_pieces(converted, tmp_path, capsys) -> None:
    os.remove(os.path.join(converted, "converted", "layer_01-model_01-model_states.pt"))
    fails(capsys, ["export", "--input", converted, "--output", str(tmp_path / "o")],
          "is incomplete: layer_01-model_01-model_states.pt is missing")
    os.remove(os.path.join(converted, "latest"))
    fails(capsys, ["reshard", "--input", converted, "--output", str(tmp_path / "r"), "--tp", "1"],
          "no 'latest' file")


def test_meta_missing_shard(model, tmp_path, capsys) -> None:
    params = {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "multiple_of": 32, "norm_eps": 1e-5}
    meta_dir = save_meta(hf_model(tiny_config(num_key_value_heads=2, intermediate_size=192)), str(tmp_path / "m"),
                         shards=2, embedding_dim=1, params=params)
    os.rename(os.path.join(meta_dir, "consolidated.01.pth"), os.path.join(meta_dir, "consolidated.02.pth"))
    fails(capsys, ["convert", "meta-to-megatron", "--meta-dir", meta_dir, "--output", str(tmp_path / "o"),
                   "--tp", "1"], "consolidated.01.pth is missing")
    os.remove(os.path.join(meta_dir, "consolidated.02.pth"))  # only shard 0 of 2 left: half of every w1
    fails(capsys, ["convert", "meta-to-megatron", "--meta-dir", meta_dir, "--output", str(tmp_path / "o"),
                   "--tp", "1"], "implies intermediate size 192")


@pytest.mark.launched
def test_cli_prints_one_line_and_exits_2(tmp_path) -> None:
    """The real command line, in a fresh process: stderr is exactly one line."""
    result = subprocess.run([sys.executable, "-m", "llama_megatron.cli", "export", "--input", str(tmp_path / "none"),
                             "--output", str(tmp_path / "o")], capture_output=True, text=True, cwd=ROOT,
                            env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "real_accelerator" not in line]
    assert lines == [f"error: checkpoint directory not found: {tmp_path / 'none'}"], result.stderr


def _index(hf_dir: str) -> tuple[str, dict]:
    path = os.path.join(hf_dir, "model.safetensors.index.json")
    return path, json.load(open(path))


@pytest.mark.parametrize("damage, message", [
    ("list", "its weight_map is not an object of tensor names to file names"),
    ("outside", "names shard '../outside.safetensors', which is not a file inside the model directory"),
    ("f8", "has dtype F8_E4M3, which conversion does not read"),
])
def test_malformed_hf_inputs(damage, message, hf_dir, tmp_path, capsys) -> None:
    """An index whose weight_map is a list, one that sends the reader outside the model directory (the file
    there exists: it is read otherwise), a float8 tensor: one line each, not a traceback."""
    from safetensors.torch import load_file, save_file

    path, index = _index(hf_dir)
    shard = sorted(set(index["weight_map"].values()))[0]
    if damage == "list":
        index["weight_map"] = sorted(index["weight_map"].items())
    elif damage == "outside":
        os.replace(os.path.join(hf_dir, shard), tmp_path / "outside.safetensors")
        index["weight_map"] = {k: "../outside.safetensors" if v == shard else v for k, v in index["weight_map"].items()}
    else:
        tensors = load_file(os.path.join(hf_dir, shard))
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)
        save_file(tensors, os.path.join(hf_dir, shard))
    json.dump(index, open(path, "w"))
    fails(capsys, ["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--output", str(tmp_path / "o"), "--tp", "1"],
          message)


@pytest.mark.parametrize("key, value, message", [
    ("tensor", 0, "tensor 0 is not a positive integer"),
    ("model", [], "model is not an object"),
    ("step", "7", "step '7' is not an integer >= 0"),
])
def test_malformed_checkpoint_metadata(key, value, message, converted, tmp_path, capsys) -> None:
    """A hand-edited llama_megatron.json (its manifest rewritten to match): one line naming the field."""
    from llama_megatron.checkpoint.manifest import write_manifest_for

    tag = os.path.join(converted, "converted")
    meta_path = os.path.join(tag, "llama_megatron.json")
    meta = json.load(open(meta_path))
    meta[key] = value
    json.dump(meta, open(meta_path, "w"))
    os.remove(os.path.join(tag, "manifest.json"))
    write_manifest_for(tag)
    fails(capsys, ["export", "--input", converted, "--output", str(tmp_path / "o")], message)
    fails(capsys, ["reshard", "--input", converted, "--output", str(tmp_path / "r"), "--tp", "1"], message)


@pytest.mark.parametrize("release", ["vision-only", "text-weights-missing"])
def test_llama4_release_without_a_text_model(release, tmp_path, capsys) -> None:
    """A Llama 4 vision tower on its own (its config names no text model), and a multimodal config whose files hold
    no text weights: one line each, nothing written."""
    import transformers

    vision = transformers.Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64, image_size=28, patch_size=14, vision_output_dim=32,
                                             projector_input_dim=32, projector_output_dim=32)
    hf_dir = tmp_path / "release"
    transformers.Llama4VisionModel(vision).save_pretrained(hf_dir)
    if release == "text-weights-missing":
        text = tiny_config(model_type="llama4", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=1,
                           intermediate_size_mlp=80).to_hf_dict()
        transformers.Llama4Config(text_config=text, vision_config=vision.to_dict()).save_pretrained(hf_dir)
        message = "tensor model.embed_tokens.weight is missing"
    else:
        message = "model_type 'llama4_vision_model' is not supported"
    fails(capsys, ["convert", "hf-to-megatron", "--hf-dir", str(hf_dir), "--output", str(tmp_path / "o"),
                   "--tp", "1"], message)
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.parametrize("chunk, message", [
    (0, "model.attention_chunk_size must be a positive integer or null, got 0"),
    (None, "model.layer_types names chunked_attention layers and attention_chunk_size is null"),
])
def test_llama4_checkpoint_with_a_bad_chunk_size(chunk, message, tmp_path, capsys) -> None:
    """A Llama 4 checkpoint whose config.json gives chunks of no size (0, or null beside chunked layers): one line
    before any tensor is read. (No chunk size is wrong for context parallelism: CP is Ulysses, each rank attends over
    whole sequences, and chunks crossing the CP shards are tested in tests/test_model_moe.py.)"""
    config = tiny_config(model_type="llama4", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=1,
                         intermediate_size_mlp=80, attention_chunk_size=8)
    hf_dir = save_hf(hf_model(config), str(tmp_path / "hf"))
    path = os.path.join(hf_dir, "config.json")
    data = json.load(open(path))
    data["attention_chunk_size"] = chunk
    json.dump(data, open(path, "w"))
    fails(capsys, ["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--output", str(tmp_path / "o"), "--tp", "2"],
          message)
