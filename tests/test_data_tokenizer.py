"""Tokenizers: the shipped sentencepiece model, parity with transformers, tokenizer.json directories."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from llama_megatron.data.sp_fastpath import eligible
from llama_megatron.data.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer
from llama_megatron.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO / "data" / "tokenizer"
CORPUS = REPO / "data" / "corpus" / "shakespeare.jsonl"
TRICKY = [
    "",
    " ",
    "   ",
    " leading space",
    "  two leading",
    "trailing  ",
    "a  b   c",
    "line\nbreak \n indented",
    "tab\tsep",
    "digits 3.14159 and 2024",
    "caf\u00e9 \u2603 \U0001f600 \u4e2d\u6587 \u0434\u0430",
    "literal \u2581 meta \u2581\u2581x",
    "nul\x00 byte \x00 ",
    "   three  two one    four     five ",
    " x  y   z    ",
]


@pytest.fixture(scope="module")
def corpus_lines() -> list[str]:
    texts = [json.loads(line)["text"] for line in CORPUS.open(encoding="utf-8")]
    lines = [ln for t in texts for ln in t.split("\n") if ln.strip()]
    # A few hundred lines spread over the corpus, with its indented (leading-space) verse lines.
    return lines[::150][:400]


@pytest.fixture(scope="module")
def tok() -> SentencePieceTokenizer:
    t = load_tokenizer(str(TOKENIZER_DIR))
    assert isinstance(t, SentencePieceTokenizer)
    return t


def test_shipped_tokenizer_is_llama_style(tok):
    from sentencepiece import sentencepiece_model_pb2 as pb

    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (4096, 1, 2)
    assert tok.pad_id == tok.eos_id  # no pad piece in a LLaMA model: eos, never a hard-coded id
    proto = pb.ModelProto()
    proto.ParseFromString((TOKENIZER_DIR / "tokenizer.model").read_bytes())
    t, n = proto.trainer_spec, proto.normalizer_spec
    assert t.model_type == pb.TrainerSpec.BPE
    assert t.byte_fallback and t.split_digits
    assert (t.unk_id, t.bos_id, t.eos_id, t.pad_id) == (0, 1, 2, -1)
    assert (n.name, n.add_dummy_prefix, n.remove_extra_whitespaces) == ("identity", True, False)
    # every printable ASCII character has a piece; digits are single pieces
    assert all(tok._sp.piece_to_id(c) != 0 for c in "0123456789{}~")
    assert len(tok.encode("1234567890")) == 11  # "▁" + ten digits


def test_same_model_through_file_or_directory(tok):
    by_file = load_tokenizer(str(TOKENIZER_DIR / "tokenizer.model"))
    assert by_file.encode("To be, or not to be") == tok.encode("To be, or not to be")


def test_encode_decode_round_trip(tok, corpus_lines):
    # sentencepiece reads a literal "▁" as a space, so text containing one decodes with spaces instead
    texts = [t for t in corpus_lines + TRICKY if "\u2581" not in t]
    for text in texts:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.decode_batch(tok.encode_batch(texts)) == texts
    assert tok.decode(tok.encode("a\u2581b")) == "a b"


def test_bos_eos_flags(tok):
    ids = tok.encode("hello")
    assert tok.encode("hello", bos=True) == [tok.bos_id] + ids
    assert tok.encode("hello", eos=True) == ids + [tok.eos_id]
    assert tok.encode_batch(["a", "b"], bos=True, eos=True) == [
        [1] + tok.encode("a") + [2],
        [1] + tok.encode("b") + [2],
    ]


def test_flat_fast_path_equals_sentencepiece(tok, corpus_lines):
    assert eligible(tok._sp) and tok._fast is not None
    texts = TRICKY + corpus_lines + [" ".join(corpus_lines[:50])]
    reference = tok._sp.encode(texts, out_type=int)
    for _ in range(2):  # cold cache, then warm
        flat, lengths = tok.encode_flat(texts)
        assert lengths.tolist() == [len(r) for r in reference]
        assert flat.tolist() == [i for r in reference for i in r]


def test_fast_path_refused_when_whitespace_is_normalised(tmp_path, tok, corpus_lines):
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString((TOKENIZER_DIR / "tokenizer.model").read_bytes())
    # collapsing "a  b" to "a b" makes cutting at spaces wrong
    proto.normalizer_spec.remove_extra_whitespaces = True
    path = tmp_path / "tokenizer.model"
    path.write_bytes(proto.SerializeToString())
    other = load_tokenizer(str(path))
    assert other._fast is None
    flat, lengths = other.encode_flat(TRICKY)
    assert flat.tolist() == [i for t in TRICKY for i in other._sp.encode(t)]
    assert other.encode("a  b") != tok.encode("a  b")


def test_check_against_model_vocab(tok):
    tok.check_against_model_vocab(4096)
    tok.check_against_model_vocab(32000)
    with pytest.raises(ConfigError, match="emits ids up to 4095 but the model's vocab_size is 4000"):
        tok.check_against_model_vocab(4000)


def test_pickles_by_path(tok):
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("Good night, sweet prince") == tok.encode("Good night, sweet prince")


def test_load_errors(tmp_path):
    with pytest.raises(DataError, match="tokenizer not found"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(DataError, match="has no tokenizer.model or tokenizer.json"):
        load_tokenizer(str(tmp_path))
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(DataError, match="cannot load sentencepiece model"):
        load_tokenizer(str(bad))
    with pytest.raises(ConfigError, match="unknown tokenizer backend"):
        load_tokenizer(str(TOKENIZER_DIR), backend="tiktoken")


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """transformers' LlamaTokenizer over our tokenizer.model, and the tokenizer.json it saves."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf")
    hf = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    out = tmp_path_factory.mktemp("hf_llama")
    hf.save_pretrained(str(out))
    assert (out / "tokenizer.json").exists()
    (out / "tokenizer.model").unlink(missing_ok=True)
    return hf, out


def test_parity_with_transformers(tok, hf_llama, corpus_lines):
    """Reference = raw sentencepiece (Meta, Megatron). transformers agrees except that it drops one leading
    "▁" from text that starts with a space: for such text its ids are ours for text[1:]."""
    hf, _ = hf_llama
    assert (hf.bos_token_id, hf.eos_token_id) == (tok.bos_id, tok.eos_id)
    theirs = hf(corpus_lines, add_special_tokens=False)["input_ids"]
    plain = [i for i, t in enumerate(corpus_lines) if not t.startswith(" ")]
    spaced = [i for i, t in enumerate(corpus_lines) if t.startswith(" ")]
    assert len(plain) > 200 and len(spaced) > 5
    for i in plain:
        assert theirs[i] == tok.encode(corpus_lines[i]), corpus_lines[i]
    for i in spaced:
        assert theirs[i] == tok.encode(corpus_lines[i][1:]), corpus_lines[i]
        assert theirs[i] != tok.encode(corpus_lines[i])
    # with special tokens transformers adds BOS only, like encode(bos=True)
    assert hf("To be")["input_ids"] == tok.encode("To be", bos=True)


def test_tokenizer_json_directory_matches_transformers(hf_llama, tok, corpus_lines):
    hf, directory = hf_llama
    ours = load_tokenizer(str(directory))
    assert isinstance(ours, HFTokenizer)
    assert (ours.vocab_size, ours.bos_id, ours.eos_id, ours.pad_id) == (4096, 1, 2, 2)
    theirs = hf(corpus_lines, add_special_tokens=False)["input_ids"]
    assert ours.encode_batch(corpus_lines) == theirs
    flat, lengths = ours.encode_flat(corpus_lines)
    assert flat.tolist() == [i for t in theirs for i in t] and lengths.tolist() == [len(t) for t in theirs]
    assert ours.decode(ours.encode("Alas, poor Yorick!")) == "Alas, poor Yorick!"
    assert pickle.loads(pickle.dumps(ours)).encode_batch(corpus_lines[:20]) == theirs[:20]  # spawned workers


def test_llama3_style_tokenizer_json(tmp_path, corpus_lines):
    """Byte-level BPE whose special tokens are added after the base vocab, as in LLaMA-3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rust = Tokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.train_from_iterator(corpus_lines, trainers.BpeTrainer(vocab_size=600, show_progress=False))
    base = rust.get_vocab_size()
    rust.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_0|>"])
    # LLaMA-3's post-processor prepends BOS; our encode must not unless asked.
    rust.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", base)]
    )
    rust.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (base, base + 1, base + 1)
    assert tok.vocab_size == base + 3
    ids = tok.encode("Now is the winter of our discontent")
    assert tok.bos_id not in ids
    framed = tok.encode("Now", bos=True, eos=True)
    assert (framed[0], framed[-1], framed[1:-1]) == (base, base + 1, tok.encode("Now"))
    assert tok.decode(ids) == "Now is the winter of our discontent"
    tok.check_against_model_vocab(base + 3)
    with pytest.raises(ConfigError, match=f"emits ids up to {base + 2}"):
        tok.check_against_model_vocab(base)
    # names from tokenizer_config.json win over the built-in guesses
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|reserved_0|>", "eos_token": {"content": "<|end_of_text|>"}})
    )
    assert load_tokenizer(str(tmp_path)).bos_id == base + 2
    # "bos_token": null (every Qwen2 tokenizer): no BOS, as transformers reads it, the usual name in the vocabulary
    # notwithstanding; only encode(bos=True) needs one
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|end_of_text|>"}))
    without = load_tokenizer(str(tmp_path))
    assert (without.bos_id, without.eos_id, without.pad_id) == (None, base + 1, base + 1)
    assert without.encode("Now", eos=True) == framed[1:]
    without.check_against_model_vocab(base + 3)
    with pytest.raises(DataError, match="has no bos token to add"):
        without.encode("Now", bos=True)
    # nothing names one and none of the usual names is there (a Qwen2 tokenizer.json alone): no BOS either
    bare = Tokenizer(models.BPE())
    bare.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bare.train_from_iterator(corpus_lines, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                               show_progress=False))
    (tmp_path / "bare").mkdir()
    bare.save(str(tmp_path / "bare" / "tokenizer.json"))
    unnamed = load_tokenizer(str(tmp_path / "bare"))
    assert (unnamed.bos_id, unnamed.eos_id) == (None, 0)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(DataError, match="eos_token '<\\|nope\\|>' from tokenizer_config.json is not in"):
        load_tokenizer(str(tmp_path))


def test_directory_with_both_files_prefers_sentencepiece(tmp_path, hf_llama):
    _, directory = hf_llama
    both = tmp_path / "both"
    shutil.copytree(directory, both)
    shutil.copy(TOKENIZER_DIR / "tokenizer.model", both / "tokenizer.model")
    assert isinstance(load_tokenizer(str(both)), SentencePieceTokenizer)
    assert isinstance(load_tokenizer(str(both), backend="hf"), HFTokenizer)
    assert isinstance(load_tokenizer(str(both / "tokenizer.json")), HFTokenizer)
    assert np.array_equal(
        load_tokenizer(str(both)).encode_flat(["x y"])[0],
        load_tokenizer(str(both), "hf").encode_flat(["x y"])[0],
    )


def test_fast_path_fuzz_against_sentencepiece(tok):
    """Random strings over an alphabet rich in the characters the word cut depends on."""
    rng = np.random.default_rng(0)
    alphabet = list("  \u2581\x00\n\tab.,'1") + ["the", "Thou", "caf\u00e9", "\u2603", " ", " "]
    texts = ["".join(rng.choice(alphabet, rng.integers(0, 30))) for _ in range(3000)]
    for batch in (texts[:1500], texts[1500:], texts):  # cold, then partly and fully warm
        flat, lengths = tok.encode_flat(batch)
        reference = tok._sp.encode(batch, out_type=int)
        assert lengths.tolist() == [len(r) for r in reference]
        assert flat.tolist() == [i for r in reference for i in r]


def test_fast_path_stays_exact_when_its_cache_is_dropped(tok, corpus_lines):
    from llama_megatron.data.sp_fastpath import SegmentCacheEncoder

    small = SegmentCacheEncoder(tok._sp, max_entries=50, max_tokens=200)
    for start in range(0, 400, 40):
        batch = corpus_lines[start : start + 40]
        flat, _ = small.encode_flat(batch)
        assert flat.tolist() == [i for t in batch for i in tok._sp.encode(t)]
        assert len(small._index) <= 50 + len({w for t in batch for w in t.split()}) + 40
