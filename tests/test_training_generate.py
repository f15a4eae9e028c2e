"""`llama-megatron generate` against `transformers`' `generate` on the same weights.

A random HF LLaMA (GQA) with the shipped tokenizer and chat template is converted to TP1 and TP2 checkpoints;
greedy decoding of 32 tokens must give HF's `generate(do_sample=False)` tokens exactly, with and without the KV
cache, at TP1 (in process) and TP2 (two processes under the deepspeed launcher), and at TP1 spread over two
pipeline stages (`--pipeline 2`) or, for Mixtral, two expert ranks (`--expert 2`). Sampling is checked for the
filters' semantics; bad input is one line and exit code 2.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from launch_utils import ROOT, launch_many
from model_utils import hf_model, tiny_config

from llama_megatron.cli import main as cli_main
from llama_megatron.model.generation import Sampling

TOKENIZER = os.path.join(ROOT, "data", "tokenizer")
PROMPTS = ["What is 2 + 3?", "Name a play by Shakespeare."]
NEW_TOKENS = 32


def _convert(root, tps: tuple[int, ...], **overrides) -> dict:
    config = tiny_config(vocab_size=4096, num_key_value_heads=4, max_position_embeddings=128, **overrides)
    hf = hf_model(config, seed=3)
    hf_dir = root / "hf"
    hf.save_pretrained(hf_dir)
    for name in os.listdir(TOKENIZER):
        shutil.copy(os.path.join(TOKENIZER, name), hf_dir / name)
    out = {"hf": hf, "root": root, "hf_dir": str(hf_dir)}
    for tp in tps:
        ckpt = str(root / f"tp{tp}")
        assert cli_main(["convert", "hf-to-megatron", "--hf-dir", str(hf_dir), "--output", ckpt, "--tp", str(tp),
                         "--make-vocab-size-divisible-by", "64"]) == 0
        out[tp] = ckpt
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    return _convert(tmp_path_factory.mktemp("generate"), (1, 2))


def _hf_greedy(hf, prompt: str, tokenizer_dir: str = TOKENIZER) -> list[int]:
    """HF's greedy tokens; ``tokenizer_dir`` as a user would load it (transformers 5 picks the tokenizer class from
    a config.json's model_type when there is one: Qwen2Tokenizer for qwen2, whatever tokenizer_config says)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = hf.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=2, pad_token_id=2)
    return out[0, ids.shape[1]:].tolist()


def _ours(ckpt: str, out_file: str, *extra: str) -> list[dict]:
    args = ["generate", "--checkpoint", ckpt, "--max-new-tokens", str(NEW_TOKENS), "--output", out_file,
            "--overwrite", *extra]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    assert cli_main(args) == 0
    return [json.loads(line) for line in open(out_file, encoding="utf-8")]


def test_greedy_equals_hf_generate_tp1_with_and_without_cache(converted, tmp_path) -> None:
    want = [_hf_greedy(converted["hf"], p) for p in PROMPTS]
    assert any(len(w) == NEW_TOKENS for w in want), "the comparison should cover 32 tokens"
    for extra in ([], ["--no-kv-cache"]):
        got = _ours(converted[1], str(tmp_path / "out.jsonl"), *extra)
        assert [r["tokens"] for r in got] == want, extra
        assert [r["prompt"] for r in got] == PROMPTS


FAMILIES = {  # windows far shorter than prompt + 32 new tokens: the cache holds keys no query may see any more
    "mistral": dict(model_type="mistral", sliding_window=7),
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=9, max_window_layers=1),
    "qwen3": dict(model_type="qwen3", head_dim=12, use_sliding_window=True, sliding_window=6,
                  layer_types=["sliding_attention", "full_attention"]),
    "mixtral": dict(model_type="mixtral", sliding_window=7, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=12, use_sliding_window=True, sliding_window=6,
                      num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0]),
    "qwen2_moe": dict(model_type="qwen2_moe", attention_bias=True, use_sliding_window=True, sliding_window=9,
                      max_window_layers=1, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    # chunks of 8 (the chunked layer's cache keeps every position, its mask the current chunk), the NoPE layer's
    # temperature changing every 4 positions, q/k L2 norm, top-1 sigmoid routing and the shared expert
    "llama4": dict(model_type="llama4", attention_chunk_size=8, no_rope_layer_interval=2, use_qk_norm=True,
                   attn_temperature_tuning=True, floor_scale=4, num_local_experts=4, num_experts_per_tok=1,
                   intermediate_size_mlp=80),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_hf_generate_for_each_family(family, tmp_path) -> None:
    """Each family's checkpoint decodes as its transformers class does, with the KV cache (its sliding-window cache
    included; the path without a cache is the model's forward, which tests/test_model_parity.py covers)."""
    converted = _convert(tmp_path, (1,), **FAMILIES[family])
    want = [_hf_greedy(converted["hf"], p, converted["hf_dir"]) for p in PROMPTS]
    assert any(len(w) == NEW_TOKENS for w in want)
    assert [r["tokens"] for r in _ours(converted[1], str(tmp_path / "out.jsonl"))] == want


# family -> (TP of the checkpoint, the layout flags of its two processes)
LAUNCHED = {"llama": (2, []), "llama4": (2, []), "llama-pipeline2": (1, ["--pipeline", "2"]),
            "mixtral-expert2": (1, ["--expert", "2"])}


@pytest.fixture(scope="module")
def launched(converted, tmp_path_factory) -> dict[str, tuple[list[list[int]], list[str]]]:
    """Every LAUNCHED case decoded by two processes, all in one launch (tests/scripts/train_many.py runs each
    ``generate`` through its own entry point, in the same two processes): case -> (HF's greedy tokens, the output
    files, with and without the cache for llama)."""
    root = tmp_path_factory.mktemp("launched")
    runs, out = [], {}
    for case, (tp, layout) in LAUNCHED.items():
        family = case.split("-")[0]
        case_converted = converted if family == "llama" else _convert(root / case, (tp,), **FAMILIES[family])
        tokenizer = TOKENIZER if family == "llama" else case_converted["hf_dir"]
        want = [_hf_greedy(case_converted["hf"], p, tokenizer) for p in PROMPTS]
        files = []
        for extra in ([], ["--no-kv-cache"])[:2 if family == "llama" else 1]:
            files.append(str(root / f"{case}-{len(extra)}.jsonl"))
            args = ["--checkpoint", case_converted[tp], "--max-new-tokens", str(NEW_TOKENS), "--output", files[-1],
                    *layout, *extra]
            for prompt in PROMPTS:
                args += ["--prompt", prompt]
            runs.append({"verb": "generate", "args": args})
        out[case] = (want, files)
    launch_many(2, runs, str(root / "runs.json"))
    return out


@pytest.mark.launched
@pytest.mark.parametrize("case", list(LAUNCHED))
def test_greedy_equals_hf_generate_under_the_launcher(case, launched) -> None:
    """Two processes decode as HF does: TP2, with and without the cache (Llama 4 past several chunks with it); a TP1
    checkpoint over two pipeline stages (each token through both in turn, each stage's cache its own); Mixtral's
    experts over two expert ranks."""
    want, files = launched[case]
    for out_file in files:
        assert [json.loads(line)["tokens"] for line in open(out_file, encoding="utf-8")] == want, out_file


def test_sampling_filters() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert Sampling().choose(logits, None).item() == 0
    gen = torch.Generator().manual_seed(0)
    top2 = {Sampling(temperature=1.0, top_k=2).choose(logits, gen).item() for _ in range(200)}
    assert top2 == {0, 1}
    # probabilities 0.64, 0.24, 0.09, ...: top_p 0.7 keeps the two tokens whose mass first exceeds 0.7
    top_p = {Sampling(temperature=1.0, top_p=0.7).choose(logits, gen).item() for _ in range(200)}
    assert top_p == {0, 1}


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "hi", "--top-p", "0"], "--top-p in (0, 1]"),
    (["--prompts", "missing.jsonl"], "prompt file missing.jsonl not found"),
    (["--prompt", "hi", "--tokenizer", "no-such-dir"], "--tokenizer no-such-dir is not a directory"),
    (["--prompt", "hi", "--checkpoint", "runs/nope"], "checkpoint directory not found: runs/nope"),
])
def test_bad_input_is_one_line(converted, args, message, capsys) -> None:
    assert cli_main(["generate", "--checkpoint", converted[1], *args]) == 2  # a later --checkpoint replaces it
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_bad_prompt_record_names_its_line(converted, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"text": "no prompt key"}\n', encoding="utf-8")
    assert cli_main(["generate", "--checkpoint", converted[1], "--prompts", str(prompts)]) == 2
    assert f"{prompts}:2: expected" in capsys.readouterr().err
