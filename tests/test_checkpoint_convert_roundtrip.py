"""Checkpoint conversion in one process: HF / Meta -> (TP, PP) -> reshard -> HF, bit for bit.

Every comparison is ``torch.equal`` on every tensor: conversion only slices and concatenates, so anything short of
exact equality is a bug.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile

import pytest
import torch
from model_utils import hf_model, tiny_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from llama_megatron.checkpoint.directory import read_meta
from llama_megatron.checkpoint.torch_stream import StreamingTorchFile
from llama_megatron.checkpoint.weights import tensor_reader
from llama_megatron.cli import main as cli
from llama_megatron.config import ModelConfig
from llama_megatron.model.param_layout import ParamLayout, as_checkpoint_tensors, experts_apart
from llama_megatron.model.tp_slicing import (
    hf_to_rank_state_dict,
    merge_shards,
    shard_for_rank,
    shard_parts,
    shard_shape,
)
from llama_megatron.parallel.degrees import padded_vocab_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "data", "tokenizer")


def save_hf(model, path: str, shard: str = "40KB", tokenizer: bool = True) -> str:
    model.save_pretrained(path, max_shard_size=shard)
    if tokenizer:
        for name in ("tokenizer.model", "tokenizer_config.json"):
            shutil.copy(os.path.join(TOKENIZER, name), path)
    return path


def save_hf_bin(model, path: str) -> str:
    """Legacy sharded ``pytorch_model-XXXXX-of-00002.bin`` + index (written by hand: transformers 5 writes none)."""
    os.makedirs(path)
    model.config.save_pretrained(path)
    state = {k: v for k, v in model.state_dict().items()
             if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    names = list(state)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, half in enumerate(halves):
        file = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save({n: state[n].clone() for n in half}, os.path.join(path, file))
        weight_map.update({n: file for n in half})
    with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    return path


def hf_tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def assert_same_weights(exported: dict[str, torch.Tensor], model, dtype: torch.dtype | None = None,
                        config: ModelConfig | None = None) -> None:
    """``config``: ours, for a mixture of experts (its experts under the released, per-expert names, as
    save_pretrained writes them; Llama 4's files hold them fused, as the model does)."""
    want = dict(model.state_dict())
    if config is not None and config.family.moe is not None and not config.family.moe.fused_expert_files:
        want = experts_apart(want, config)  # (DeepSeek-V3's rotated rows stay interleaved, as transformers holds them)
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in exported, "tied embeddings must not export lm_head.weight"
        want.pop("lm_head.weight")
    assert set(exported) == set(want)
    for name, tensor in want.items():
        expected = tensor if dtype is None else tensor.to(dtype)
        assert exported[name].dtype == expected.dtype, name
        assert torch.equal(exported[name], expected), f"{name} differs"


CASES = {
    "mha-untied": dict(num_key_value_heads=8),
    "mha-tied": dict(num_key_value_heads=8, tie_word_embeddings=True),
    "gqa-untied-bias": dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "gqa-tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2-windows": dict(model_type="qwen2", num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                          max_window_layers=1),
    "qwen3-tied": dict(model_type="qwen3", num_key_value_heads=2, head_dim=12, tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=8),
    "mixtral": dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    # layer 0 dense (decoder_sparse_step 2), layer 1 MoE: one of each on the two pipeline stages
    "qwen3-moe": dict(model_type="qwen3_moe", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2),
    "qwen2-moe-tied": dict(model_type="qwen2_moe", attention_bias=True, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                           tie_word_embeddings=True),
    # layer 0 dense with chunked RoPE attention, layer 1 MoE (fused 3-D experts in the files) with NoPE attention;
    # q and k rows permuted on the way in and back on the way out
    "llama4": dict(model_type="llama4", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=1,
                   use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4, attention_chunk_size=8,
                   no_rope_layer_interval=2, interleave_moe_layer_step=2, intermediate_size_mlp=80,
                   attention_bias=True),
    # layer 0 dense, layer 1 MoE with the routing bias and two shared experts: MLA's rows (q latent, the shared
    # rotated key part, interleaved in the files and rotate-half in ours) split by heads over TP2
    "deepseek-v3": dict(model_type="deepseek_v3", num_key_value_heads=8, q_lora_rank=24, kv_lora_rank=16,
                        qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, num_local_experts=8,
                        num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=20, n_shared_experts=2,
                        first_k_dense_replace=1, rope_interleave=True, attention_bias=True),
}


@pytest.mark.parametrize("kind", ["vocab", "qkv", "gate_up", "row", "replicated", "bias"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parts_and_shapes_equal_the_reference_mapping(kind, tp) -> None:
    """Sharding then merging gives back every HF tensor; shard_shape predicts the shard; parts are views."""
    config = tiny_config(vocab_size=200, num_key_value_heads=4, attention_bias=True, mlp_bias=True)
    canonical = {"vocab": "embed.weight", "qkv": "layers.0.self_attn.qkv_proj.weight",
                 "gate_up": "layers.0.mlp.gate_up_proj.weight", "row": "layers.0.mlp.down_proj.weight",
                 "replicated": "layers.0.input_layernorm.weight", "bias": "layers.0.self_attn.qkv_proj.bias"}[kind]
    spec = ParamLayout(config)[canonical]
    full = {name: torch.randn(shape) for name, shape in ParamLayout(config).hf_shapes().items()}
    padded = padded_vocab_size(config.vocab_size, 32, tp)  # 32 * 4 = 128 rows per rank at TP4: whole padding shards
    shards = []
    for rank in range(tp):
        want = shard_for_rank(spec, full.__getitem__, config, rank, tp, padded)
        assert shard_shape(spec, config, tp, padded) == tuple(want.shape)
        if kind not in ("vocab", "row"):  # only padding and column blocks allocate; everything else is a view
            sources = {p.untyped_storage().data_ptr() for p in full.values()}
            parts = shard_parts(spec, full.__getitem__, config, rank, tp, padded)
            assert all(p.untyped_storage().data_ptr() in sources for p in parts)
        shards.append(want)
    merged = merge_shards(spec, shards, config)
    assert set(merged) == set(spec.hf_names)
    for name, tensor in merged.items():
        assert torch.equal(tensor, full[name])
    if kind == "vocab":
        assert not torch.cat(shards)[config.vocab_size:].any(), "padding rows must be zero"


def test_streaming_torch_file_is_a_regular_archive(tmp_path) -> None:
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(7).bfloat16(), "empty": torch.empty(0), "c": torch.arange(6)}
    path = str(tmp_path / "x.pt")
    writer = StreamingTorchFile(path, {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()},
                                wrap=lambda state: {"module": state})
    for name in ("c", "a", "empty"):
        writer.write(name, tensors[name])
    with pytest.raises(RuntimeError, match="never written: b"):
        StreamingTorchFile.close(writer)
    writer = StreamingTorchFile(path, {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()})
    for name, tensor in tensors.items():
        writer.write(name, *tensor.split(2))
    writer.close()
    assert zipfile.ZipFile(path).testzip() is None  # CRCs patched
    loaded = torch.load(path, weights_only=True, mmap=True)
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in tensors.items())


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_tp2_pp2_and_back_is_exact(case, tmp_path) -> None:
    config = tiny_config(vocab_size=250, **CASES[case])  # 250: padded to 256 per TP2 x 64 rows
    model = hf_model(config)
    hf_dir = save_hf(model, str(tmp_path / "hf"))
    assert os.path.isfile(os.path.join(hf_dir, "model.safetensors.index.json")), "input must be sharded"
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert cli(["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--output", ckpt, "--tp", "2", "--pp", "2",
                "--make-vocab-size-divisible-by", "64"]) == 0

    # exactly the training checkpoint layout: latest -> tag, pipeline layer files, metadata read_meta accepts
    meta = read_meta(ckpt)
    assert (meta.tag, meta.tensor, meta.pipeline, meta.data_parallel, meta.zero_stage, meta.step) == \
        ("converted", 2, 2, 1, 0, 0)
    assert meta.model == ModelConfig.from_file(hf_dir).to_dict() and meta.padded_vocab_size == 256
    assert ModelConfig.from_dict(meta.model).layer_windows() == config.layer_windows()
    tag_dir = os.path.join(ckpt, "converted")
    layers = config.num_hidden_layers
    indices = range(layers + 2) if config.tie_word_embeddings else range(layers + 3)
    want_files = {f"layer_{i:02d}-model_{r:02d}-model_states.pt" for i in indices for r in range(2)}
    assert set(os.listdir(tag_dir)) == want_files | {"llama_megatron.json", "manifest.json"}
    for name in ("config.json", "tokenizer.model", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(ckpt, "hf_config", name))
    hf_state = as_checkpoint_tensors(model.state_dict(), config)
    read = tensor_reader(tag_dir)
    for rank in range(2):
        reference = hf_to_rank_state_dict(hf_state, config, rank, 2, 256)
        for spec in ParamLayout(config):
            assert torch.equal(read(spec, rank), reference[spec.module_name]), spec.name

    assert cli(["convert", "megatron-to-hf", "--input", ckpt, "--output", out]) == 0
    assert_same_weights(hf_tensors(out), model, config=config)
    assert {"config.json", "generation_config.json", "tokenizer.model", "tokenizer_config.json"} <= set(os.listdir(out))
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)  # the family's class, same function
    assert type(loaded) is type(model)
    assert getattr(loaded.config, "layer_types", None) == getattr(model.config, "layer_types", None)
    ids = torch.arange(20).view(1, 20) % config.vocab_size
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def _llama4_release(config: ModelConfig, path: str):
    """A random Llama4ForConditionalGeneration (a one-layer vision tower beside ``config``'s text model), saved."""
    import transformers
    from model_utils import hf_config

    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
                  pixel_shuffle_ratio=0.5)
    torch.manual_seed(3)
    release = transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=hf_config(config).to_dict(), vision_config=vision))
    save_hf(release, path)
    return release


def test_llama4_release_converts_its_text_model_and_takes_trained_weights_back(tmp_path, capsys) -> None:
    """A multimodal Llama 4 release: conversion takes the text model (and says what it left out), which exports as a
    Llama4ForCausalLM computing what the release's language model computes; `export --into RELEASE` writes the
    release's files with another checkpoint's text weights (here a second model's, standing for trained ones) and
    the vision tower's and projector's tensors byte for byte."""
    config = tiny_config(vocab_size=250, **CASES["llama4"])
    release = _llama4_release(config, str(tmp_path / "release"))
    ckpt = str(tmp_path / "ckpt")
    assert cli(["convert", "hf-to-megatron", "--hf-dir", str(tmp_path / "release"), "--output", ckpt, "--tp", "2",
                "--pp", "2", "--make-vocab-size-divisible-by", "64"]) == 0
    vision = {n for n in release.state_dict() if not n.startswith("language_model.")}
    assert (f"(the text model of a multimodal checkpoint: {len(vision)} other tensors (the vision tower, the "
            "projector) left out)") in capsys.readouterr().out
    assert cli(["convert", "megatron-to-hf", "--input", ckpt, "--output", str(tmp_path / "text")]) == 0
    text = AutoModelForCausalLM.from_pretrained(str(tmp_path / "text"), local_files_only=True)
    assert type(text).__name__ == "Llama4ForCausalLM"
    ids = torch.arange(20).view(1, 20) % config.vocab_size
    with torch.no_grad():
        assert torch.equal(text(ids).logits, release.language_model(ids).logits)

    trained = hf_model(config, seed=5)  # another text model of the same shape: the "trained" weights
    assert cli(["convert", "hf-to-megatron", "--hf-dir", save_hf(trained, str(tmp_path / "trained")), "--output",
                str(tmp_path / "trained-ckpt"), "--tp", "2", "--make-vocab-size-divisible-by", "64"]) == 0
    assert cli(["export", "--input", str(tmp_path / "trained-ckpt"), "--output", str(tmp_path / "back"), "--into",
                str(tmp_path / "release")]) == 0
    assert sorted(os.listdir(tmp_path / "back")) == sorted(os.listdir(tmp_path / "release"))
    original, back = hf_tensors(str(tmp_path / "release")), hf_tensors(str(tmp_path / "back"))
    assert set(back) == set(original)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(back[f"language_model.{name}"], tensor), name
    for name in vision:
        assert back[name].dtype == original[name].dtype and torch.equal(back[name], original[name]), name


def test_export_loads_in_transformers_with_tokenizer(tmp_path) -> None:
    from transformers import AutoTokenizer

    model = hf_model(tiny_config(vocab_size=4096, num_key_value_heads=2))
    hf_dir = save_hf(model, str(tmp_path / "hf"), shard="200KB")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert cli(["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--output", ckpt, "--tp", "2"]) == 0
    assert os.path.isfile(os.path.join(ckpt, "converted", "mp_rank_01_model_states.pt"))  # PP=1 layout
    assert cli(["export", "--input", ckpt, "--output", out, "--max-shard-size", "300KB"]) == 0
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = torch.tensor([tokenizer("Now is the winter of our discontent").input_ids])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_bin_input_and_dtypes(tmp_path, capsys) -> None:
    config = tiny_config(num_key_value_heads=2)
    model = hf_model(config)
    hf_dir = save_hf_bin(model, str(tmp_path / "hf"))
    ckpt = str(tmp_path / "ckpt")
    assert cli(["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--output", ckpt, "--tp", "2", "--pp", "2",
                "--dtype", "bf16"]) == 0
    # the progress line: every parameter of the layout table, its bytes (bf16, all TP ranks), an ETA
    n = len(ParamLayout(config).specs)
    assert re.search(rf"^hf-to-megatron: {n}/{n} tensors, \S+B in [\d.]+s \| \S+B/s, ETA 0s$",
                     capsys.readouterr().err, re.M)
    read = tensor_reader(os.path.join(ckpt, "converted"))
    assert read(ParamLayout(config)["layers.1.mlp.down_proj.weight"], 1).dtype == torch.bfloat16
    out_bf16, out_fp32 = str(tmp_path / "bf16"), str(tmp_path / "fp32")
    assert cli(["export", "--input", ckpt, "--output", out_bf16]) == 0
    assert_same_weights(hf_tensors(out_bf16), model, torch.bfloat16)
    assert json.load(open(os.path.join(out_bf16, "config.json")))["torch_dtype"] == "bfloat16"
    assert cli(["export", "--input", ckpt, "--output", out_fp32, "--dtype", "fp32"]) == 0
    exported = hf_tensors(out_fp32)
    assert all(torch.equal(exported[k], v.bfloat16().float()) for k, v in model.state_dict().items())


def test_reshard_to_other_layouts_is_exact(tmp_path) -> None:
    config = tiny_config(num_hidden_layers=4, num_key_value_heads=4, vocab_size=300)
    model = hf_model(config)
    hf_dir = save_hf(model, str(tmp_path / "hf"))
    ckpt = str(tmp_path / "tp2pp2")
    assert cli(["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--output", ckpt, "--tp", "2", "--pp", "2"]) == 0
    for tp, pp in ((1, 4), (4, 1)):
        resharded, out = str(tmp_path / f"tp{tp}pp{pp}"), str(tmp_path / f"hf-tp{tp}pp{pp}")
        assert cli(["reshard", "--input", ckpt, "--output", resharded, "--tp", str(tp), "--pp", str(pp)]) == 0
        meta = read_meta(resharded)
        assert (meta.tensor, meta.pipeline, meta.padded_vocab_size) == (tp, pp, padded_vocab_size(300, 128, tp))
        read = tensor_reader(os.path.join(resharded, meta.tag))
        for rank in range(tp):
            reference = hf_to_rank_state_dict(model.state_dict(), config, rank, tp, meta.padded_vocab_size)
            for spec in ParamLayout(config):
                assert torch.equal(read(spec, rank), reference[spec.module_name])
        assert cli(["export", "--input", resharded, "--output", out]) == 0
        assert_same_weights(hf_tensors(out), model)
        assert os.path.isfile(os.path.join(out, "tokenizer.model")), "hf_config must travel through reshard"


def _hf_to_meta(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of the Meta -> HF rotary permutation (what Meta's release stores)."""
    rows, dim = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, dim).transpose(1, 2).reshape(rows, dim)


def save_meta(model, path: str, shards: int, embedding_dim: int, params: dict) -> str:
    """A Meta-format release of ``model``: model-parallel consolidated.XX.pth files + params.json."""
    c = model.config
    state = model.state_dict()
    meta: dict[str, tuple[torch.Tensor, int | None]] = {
        "tok_embeddings.weight": (state["model.embed_tokens.weight"], embedding_dim),
        "norm.weight": (state["model.norm.weight"], None),
        "output.weight": (state["lm_head.weight"], 0),
    }
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        meta.update({
            f"layers.{i}.attention.wq.weight": (_hf_to_meta(state[p + "self_attn.q_proj.weight"],
                                                            c.num_attention_heads), 0),
            f"layers.{i}.attention.wk.weight": (_hf_to_meta(state[p + "self_attn.k_proj.weight"],
                                                            c.num_key_value_heads), 0),
            f"layers.{i}.attention.wv.weight": (state[p + "self_attn.v_proj.weight"], 0),
            f"layers.{i}.attention.wo.weight": (state[p + "self_attn.o_proj.weight"], 1),
            f"layers.{i}.feed_forward.w1.weight": (state[p + "mlp.gate_proj.weight"], 0),
            f"layers.{i}.feed_forward.w2.weight": (state[p + "mlp.down_proj.weight"], 1),
            f"layers.{i}.feed_forward.w3.weight": (state[p + "mlp.up_proj.weight"], 0),
            f"layers.{i}.attention_norm.weight": (state[p + "input_layernorm.weight"], None),
            f"layers.{i}.ffn_norm.weight": (state[p + "post_attention_layernorm.weight"], None),
        })
    os.makedirs(path)
    for s in range(shards):
        shard = {k: (t if d is None else t.chunk(shards, dim=d)[s]).clone() for k, (t, d) in meta.items()}
        shard["rope.freqs"] = torch.ones(4)  # LLaMA-2's files carry this buffer
        torch.save(shard, os.path.join(path, f"consolidated.{s:02d}.pth"))
    with open(os.path.join(path, "params.json"), "w") as fh:
        json.dump(params, fh)
    shutil.copy(os.path.join(TOKENIZER, "tokenizer.model"), path)
    return path


@pytest.mark.parametrize("style", ["llama2", "llama3"])
def test_meta_release_converts_to_identical_hf_logits(style, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if style == "llama2":  # MHA, vocab_size -1, embedding split on dim 1
        config = tiny_config(vocab_size=4096, intermediate_size=192, max_position_embeddings=4096)
        params = {"dim": 64, "n_layers": 2, "n_heads": 8, "multiple_of": 32, "norm_eps": 1e-5, "vocab_size": -1}
        embedding_dim = 1
    else:  # GQA, ffn multiplier, rope theta, embedding split on dim 0
        config = tiny_config(vocab_size=4096, intermediate_size=224, num_key_value_heads=2, rope_theta=500000.0,
                             max_position_embeddings=4096)
        params = {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "multiple_of": 32,
                  "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 4096}
        embedding_dim = 0
    model = hf_model(config)
    meta_dir = save_meta(model, str(tmp_path / "meta"), shards=2, embedding_dim=embedding_dim, params=params)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    verb = ["convert", "meta-to-megatron", "--meta-dir"] if style == "llama2" else ["convert", "hf-to-megatron",
                                                                                    "--hf-dir"]
    assert cli([*verb, meta_dir, "--output", ckpt, "--tp", "2", "--pp", "2"]) == 0
    assert read_meta(ckpt).model == config.to_dict()
    assert cli(["export", "--input", ckpt, "--output", out]) == 0
    assert_same_weights(hf_tensors(out), model)
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ids = torch.tensor([AutoTokenizer.from_pretrained(out, local_files_only=True)("To be, or not to be").input_ids])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
