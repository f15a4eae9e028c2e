"""One tokenizer interface over sentencepiece ``tokenizer.model`` files and HF ``tokenizer.json`` directories.

Reference behaviour: a sentencepiece model encodes exactly as raw sentencepiece does (Meta's LLaMA code and
Megatron's ``SentencePieceTokenizer``). transformers' ``LlamaTokenizer`` agrees with it except on text that starts
with a space, where transformers drops one leading "▁"; the tests pin both facts (docs/data.md).

LLaMA has no pad token: ``pad_id`` is the model's own pad piece when it has one, else ``eos_id`` (an id that is
always inside the embedding table). Never a hard-coded constant.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from llama_megatron.errors import ConfigError, DataError

# Files a tokenizer may consist of (sentencepiece, fast tokenizer, their configs, chat templates).
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")
# Names tried, in order, when a tokenizer.json directory has no tokenizer_config.json naming its specials.
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]")
_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>")


class Tokenizer:
    """Common interface; subclasses implement ``_encode_many`` and ``decode``."""

    vocab_size: int
    bos_id: int | None  # None: the tokenizer has no BOS (Qwen2's); only encode(bos=True) needs one
    eos_id: int
    pad_id: int
    path: str

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def _encode_many_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self._encode_many(texts)]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return self.encode_batch([text], bos=bos, eos=eos)[0]

    def encode_batch(self, texts: Sequence[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        if bos and self.bos_id is None:
            raise DataError(f"{self.path}: the tokenizer has no bos token to add")
        out = self._encode_many(list(texts))
        if bos or eos:
            head = [self.bos_id] if bos else []
            tail = [self.eos_id] if eos else []
            out = [head + ids + tail for ids in out]
        return out

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """All texts' ids back to back (an integer array) plus int64 per-text lengths: the preprocess path.

        Same ids as ``encode_batch``, without building Python int lists.
        """
        arrays = self._encode_many_arrays(list(texts))
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        flat = np.concatenate(arrays).astype(np.int64, copy=False) if arrays else np.zeros(0, np.int64)
        return flat, lengths

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def check_against_model_vocab(self, model_vocab_size: int) -> None:
        """Fail before training if any id this tokenizer can emit has no row in the embedding table."""
        largest = max(i for i in (self.vocab_size - 1, self.bos_id, self.eos_id, self.pad_id) if i is not None)
        if largest >= model_vocab_size:
            raise ConfigError(
                f"tokenizer {self.path} emits ids up to {largest} but the model's vocab_size is "
                f"{model_vocab_size}; use a model config with vocab_size >= {largest + 1} or the matching tokenizer"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={self.path!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id})"
        )


class SentencePieceTokenizer(Tokenizer):
    """A LLaMA-1/2 style ``tokenizer.model``; BOS/EOS/PAD come from the model itself."""

    def __init__(self, model_file: str, num_threads: int = 1) -> None:
        import sentencepiece as spm

        self.path = model_file
        # One thread by default: preprocess parallelises with processes, and a training rank must not grab
        # every core for tokenisation.
        self.num_threads = num_threads
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as exc:
            raise DataError(f"cannot load sentencepiece model {model_file}: {exc}") from None
        self.vocab_size = int(self._sp.get_piece_size())
        self.bos_id = int(self._sp.bos_id())
        self.eos_id = int(self._sp.eos_id())
        if self.bos_id < 0 or self.eos_id < 0:
            raise DataError(f"sentencepiece model {model_file} has no bos or eos piece (bos_id/eos_id = -1)")
        pad = int(self._sp.pad_id())
        self.pad_id = pad if pad >= 0 else self.eos_id
        self._numpy_out = _sentencepiece_has_numpy_output(self._sp)
        self._fast = _segment_cache(self._sp)

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, out_type=int, num_threads=self.num_threads)

    def _encode_many_arrays(self, texts: list[str]) -> list[np.ndarray]:
        if self._numpy_out:
            return self._sp.encode(texts, return_type="numpy", num_threads=self.num_threads)
        return super()._encode_many_arrays(texts)

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        if self._fast is not None:
            return self._fast.encode_flat(list(texts))
        return super().encode_flat(texts)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def __getstate__(self) -> dict:
        # sentencepiece objects do not pickle; worker processes (and datasets.map) reload from the file.
        return {"path": self.path, "num_threads": self.num_threads}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["num_threads"])


def _segment_cache(sp):
    """The exact word-cache encoder when the model allows it (sp_fastpath), else None."""
    from llama_megatron.data.sp_fastpath import SegmentCacheEncoder, eligible

    if not eligible(sp):
        return None
    try:
        return SegmentCacheEncoder(sp)
    except ValueError:  # its start-up self-check found a difference: stay on plain sentencepiece
        return None


def _sentencepiece_has_numpy_output(sp) -> bool:
    try:
        return isinstance(sp.encode(["a"], return_type="numpy", num_threads=1)[0], np.ndarray)
    except (TypeError, ValueError):  # sentencepiece < 0.2.1 has no numpy return type
        return False


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` (LLaMA-3 style byte-level BPE or a converted LLaMA-2) through ``tokenizers``.

    Special tokens are never added implicitly (the post-processor of LLaMA-3 adds BOS): ``bos``/``eos`` flags
    decide, exactly as for sentencepiece.
    """

    def __init__(self, directory: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.path = directory
        self.num_threads = 1
        json_file = os.path.join(directory, "tokenizer.json")
        try:
            self._tok = RustTokenizer.from_file(json_file)
        except Exception as exc:  # tokenizers raises a bare Exception on malformed json
            raise DataError(f"cannot load {json_file}: {exc}") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # Added tokens may sit outside get_vocab_size(); the embedding table must cover the largest id.
        self.vocab_size = max(vocab.values()) + 1
        config = _read_special_tokens(directory)
        # a tokenizer may have no BOS: Qwen2's says "bos_token": null (its models are trained without one), and
        # transformers then has none either; one that names none and has none of the usual names has none too
        self.bos_id = (None if "bos_token" in config and config["bos_token"] is None
                       else _special_id(vocab, config.get("bos_token"), _BOS_CANDIDATES, "bos", directory,
                                        required=False))
        self.eos_id = _special_id(vocab, config.get("eos_token"), _EOS_CANDIDATES, "eos", directory)
        pad_name = config.get("pad_token")
        self.pad_id = vocab[pad_name] if pad_name in vocab else self.eos_id

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in self._tok.encode_batch(texts, add_special_tokens=False)]

    def _encode_many_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [
            np.asarray(enc.ids, dtype=np.int64)
            for enc in self._tok.encode_batch(texts, add_special_tokens=False)
        ]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])


def _read_special_tokens(directory: str) -> dict[str, str | None]:
    """bos/eos/pad names from tokenizer_config.json, then special_tokens_map.json (HF's two places); None for one
    a file sets to null (no such token), a key left out where neither file names it."""
    names: dict[str, str | None] = {}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):  # later file wins
        path = os.path.join(directory, fname)
        if not os.path.exists(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise DataError(f"cannot read {path}: {exc}") from None
        for key in ("bos_token", "eos_token", "pad_token"):
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) or (value is None and key in data):
                names[key] = value
    return names


def _special_id(
    vocab: dict[str, int], name: str | None, candidates: tuple[str, ...], what: str, where: str,
    required: bool = True,
) -> int | None:
    if name is not None:
        if name not in vocab:
            raise DataError(
                f"{where}: {what}_token {name!r} from tokenizer_config.json is not in tokenizer.json"
            )
        return vocab[name]
    for cand in candidates:
        if cand in vocab:
            return vocab[cand]
    if not required:
        return None
    raise DataError(f'{where}: cannot tell the {what} token; set "{what}_token" in tokenizer_config.json')


def load_tokenizer(path: str, backend: str | None = None) -> Tokenizer:
    """``path`` is a ``tokenizer.model`` file or a directory holding ``tokenizer.model`` or ``tokenizer.json``.

    A directory with both (HF LLaMA-2 repos) uses ``tokenizer.model`` (the original) unless ``backend="hf"``.
    """
    p = Path(path)
    if not p.exists():
        raise DataError(f"tokenizer not found: {path}")
    if backend not in (None, "sentencepiece", "hf"):
        raise ConfigError(f"unknown tokenizer backend {backend!r}; use 'sentencepiece' or 'hf'")
    if p.is_file():
        if p.name == "tokenizer.json":
            return HFTokenizer(str(p.parent))
        return SentencePieceTokenizer(str(p))
    sp_file, hf_file = p / "tokenizer.model", p / "tokenizer.json"
    if backend != "hf" and sp_file.exists():
        return SentencePieceTokenizer(str(sp_file))
    if backend != "sentencepiece" and hf_file.exists():
        return HFTokenizer(str(p))
    raise DataError(f"{path} has no tokenizer.model or tokenizer.json")
