"""``data.type: "sft"``: chat / instruction JSONL for supervised fine-tuning (docs/data.md, "SFT data"), and
``data.type: "preference"``: preference pairs in TRL's formats (``preference_formats.py``; docs/preference.md).

    "data": {"type": "sft", "path": "data/chat/chat_messages.jsonl", "masking": "assistant", "pack": true}
    "data": {"type": "sft", "prefix": "data/processed/chat"}            # shards from `preprocess-sft`

With ``path`` the JSONL is tokenised on first use (multi-process, progress line) into a cache beside it (or in
``cache_dir``): the first rank to take the lock builds it, the others wait and reuse it, and any later run with the
same inputs, tokenizer, template, format and masking starts at once. ``prefix`` names shards written by
``llama-megatron preprocess-sft``, whose format, masking and template were fixed there.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from llama_megatron.data.gpt_dataset import DEFAULT_SPLIT
from llama_megatron.data.index_cache import cached_directory, check_entry, check_token_range, file_fingerprint
from llama_megatron.data.indexed_dataset import prefix_exists
from llama_megatron.data.sample_index import parse_split, split_document_ranges
from llama_megatron.data.sft.chat_template import ChatEncoder
from llama_megatron.data.sft.dataset import OVERLONG, PairTruncation, SFTShards, build_sft_datasets
from llama_megatron.data.sft.formats import FORMATS, MASKING
from llama_megatron.data.sft.preference_formats import PREFERENCE_FORMAT
from llama_megatron.data.sft.preprocess import (
    SFT_VERSION,
    output_paths,
    preprocess_sft,
    read_meta,
    shard_prefixes,
)
from llama_megatron.errors import ConfigError

CACHE_DIR_NAME = "sft-cache"


@dataclass
class ChatData:
    """What ``data.type`` sft and preference share: JSONL rendered through the chat template into token and mask
    shards (cached on first use, or made by ``preprocess-sft``), rows padded or packed."""

    type: ClassVar[str]
    # Keys that fix how the JSONL is tokenised: given with ``prefix`` they would silently not apply.
    preprocess_keys: ClassVar[tuple[str, ...]] = ("chat_template", "workers", "skip_bad_records")
    # chat / instruction JSONL file(s), tokenised on first use into a cache
    path: str | list[str] | None = None
    prefix: str | None = None  # shards written by llama-megatron preprocess-sft (instead of path)
    chat_template: str | None = None     # a Jinja file; default: the tokenizer's chat_template
    # pack whole samples first-fit into rows (false: one sample per row, padded)
    pack: bool = False
    split: str = DEFAULT_SPLIT  # train, validation, test proportions by records
    cache_dir: str | None = None  # where the tokenised cache is kept (default: sft-cache/ beside the JSONL)
    workers: int | None = None           # default: min(8, CPUs)
    skip_bad_records: bool = False  # count and skip malformed records instead of stopping with one line
    _shards: SFTShards | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def per_document_attention(self) -> bool:
        return self.pack

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path or [])

    def to_dict(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        return {"type": self.type, **{k: v for k, v in fields.items() if v is not None}}

    def _record_format(self) -> tuple[str, str]:
        """(format, masking) the JSONL is tokenised with."""
        raise NotImplementedError

    def _validate_keys(self) -> None:
        """The checks of this type's own keys."""

    def _check_shards(self, meta: dict) -> None:
        """ConfigError when shards made by preprocess-sft are not of this type's data."""

    def validate(self) -> None:
        if (self.path is None) == (self.prefix is None):
            raise ConfigError(f"data.type {self.type} needs exactly one of path (JSONL) or prefix (preprocess-sft "
                              "shards)")
        if self.path is not None and (not self.paths or not all(isinstance(p, str) and p for p in self.paths)):
            raise ConfigError("data.path must be a JSONL path or a non-empty list of them")
        self._validate_keys()
        for key in ("pack", "skip_bad_records"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"data.{key} must be true or false")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise ConfigError("data.workers must be a positive integer")
        parse_split(self.split)
        if self.prefix is not None:
            given = [k for k in self.preprocess_keys if getattr(self, k) not in (None, False)]
            if given:
                raise ConfigError(f"data.{given[0]} is fixed when the shards are made (preprocess-sft); "
                                  "with data.prefix leave it out")
            missing = [p for p in shard_prefixes(self.prefix).values() if not prefix_exists(p)]
            if missing:
                raise ConfigError(f"data.prefix {self.prefix!r}: {missing[0]}.bin/.idx not found "
                                  f"(cwd {os.getcwd()}); write them with llama-megatron preprocess-sft")
            self._check_shards(read_meta(self.prefix))
        for path in self.paths:
            if not os.path.isfile(path):
                raise ConfigError(f"data.path {path!r} not found (cwd {os.getcwd()})")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ConfigError(f"data.chat_template {self.chat_template!r} not found (cwd {os.getcwd()})")

    def files(self) -> list[str]:
        if self.path is not None:
            return self.paths + ([self.chat_template] if self.chat_template else [])
        return output_paths(self.prefix)

    def _cache_dir(self) -> str:
        if self.cache_dir:
            return self.cache_dir
        anchor = self.paths[0] if self.path is not None else self.prefix
        return os.path.join(os.path.dirname(os.path.abspath(anchor)), CACHE_DIR_NAME)

    def prepare(self, tokenizer: str | None) -> None:
        """Tokenise the JSONL into the cache once (or open the preprocessed shards); idempotent."""
        if self._shards is not None:
            return
        if self.prefix is not None:
            self._shards = SFTShards(self.prefix)
            return
        encoder = ChatEncoder(tokenizer, self.chat_template)
        fmt, masking = self._record_format()
        description = {"kind": "sft-shards", "version": SFT_VERSION, "format": fmt, "masking": masking,
                       "skip_bad_records": self.skip_bad_records, **encoder.fingerprint(),
                       "inputs": [_input_fingerprint(p) for p in self.paths]}
        workers = self.workers or min(8, os.cpu_count() or 1)

        name = os.path.splitext(os.path.basename(self.paths[0]))[0]

        def write(tmp: str) -> None:
            preprocess_sft(self.paths, tokenizer, os.path.join(tmp, name), fmt, masking, self.chat_template,
                           workers, skip_bad=self.skip_bad_records)

        entry = cached_directory(self._cache_dir(), name, description, write)
        check_entry(entry, description)
        self._shards = SFTShards(os.path.join(entry, name))

    def check(self, vocab_size: int, need_validation: bool) -> None:
        if self._shards is None:
            raise RuntimeError(f"{type(self).__name__}.prepare(tokenizer) must run before check")
        check_token_range(self._shards.tokens, self._cache_dir(), vocab_size)
        lo, hi = split_document_ranges(len(self._shards), parse_split(self.split))[1]
        if need_validation and hi <= lo:
            raise ConfigError(f"eval.interval is set but data.split {self.split!r} gives the validation split none of "
                              f"the {len(self._shards)} samples: give it a share, or set eval.interval 0")

    def _build(self, seq_length: int, seed: int, num_samples: tuple[int, int, int], vocab_size: int,
               eod_id: int | None, overlong: str, pairs: PairTruncation | None) -> tuple:
        if self._shards is None:
            raise RuntimeError(f"{type(self).__name__}.prepare(tokenizer) must run before build")
        return build_sft_datasets(self._shards, self.split, seq_length, seed, num_samples, self._cache_dir(),
                                  self.pack, overlong, 0 if eod_id is None else eod_id, vocab_size, pairs)


@dataclass
class SFTData(ChatData):
    type: ClassVar[str] = "sft"
    preprocess_keys: ClassVar[tuple[str, ...]] = ("format", "masking", *ChatData.preprocess_keys)
    format: str | None = None            # default "auto"
    masking: str | None = None           # default "assistant"
    overlong: str = "truncate"  # a conversation longer than seq_length + 1 tokens: truncate or drop

    def _record_format(self) -> tuple[str, str]:
        return self.format or "auto", self.masking or "assistant"

    def _validate_keys(self) -> None:
        for key, value, allowed in (("format", self.format, FORMATS), ("masking", self.masking, MASKING),
                                    ("overlong", self.overlong, OVERLONG)):
            if value is not None and value not in allowed:
                raise ConfigError(f"data.{key} {value!r}: choose one of {', '.join(allowed)}")

    def _check_shards(self, meta: dict) -> None:
        if meta.get("format") == PREFERENCE_FORMAT:
            raise ConfigError(f"data.prefix {self.prefix!r} holds preference pairs: train on them with "
                              "data.type preference")

    def build(self, seq_length: int, seed: int, num_samples: tuple[int, int, int], vocab_size: int,
              eod_id: int | None) -> tuple:
        return self._build(seq_length, seed, num_samples, vocab_size, eod_id, self.overlong, None)


TRUNCATION_MODES = ("keep_start", "keep_end")


@dataclass
class PreferenceData(ChatData):
    type: ClassVar[str] = "preference"
    # tokens per sequence (TRL's max_length; default: seq_length + 1, padded; half that, packed: a pair per row)
    max_length: int | None = None
    # an overlong sequence keeps its first max_length tokens (pairs whose prompt fills them are dropped) or its last
    truncation_mode: str = "keep_start"

    def _record_format(self) -> tuple[str, str]:
        return PREFERENCE_FORMAT, "assistant"

    def _validate_keys(self) -> None:
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ConfigError(f"data.truncation_mode {self.truncation_mode!r}: choose one of "
                              f"{', '.join(TRUNCATION_MODES)}")
        if self.max_length is not None and (isinstance(self.max_length, bool) or not isinstance(self.max_length, int)
                                            or self.max_length < 2):
            raise ConfigError("data.max_length must be an integer >= 2 (tokens per sequence)")

    def _check_shards(self, meta: dict) -> None:
        if meta.get("format") != PREFERENCE_FORMAT:
            raise ConfigError(f"data.prefix {self.prefix!r} holds SFT samples, not preference pairs: write them "
                              "with llama-megatron preprocess-sft --format preference")

    def pair_count(self) -> int:
        """Pairs in the shards (every split), after ``prepare``."""
        return len(self._shards)

    def shards_fingerprint(self) -> dict:
        return self._shards.fingerprint()

    def cache_directory(self) -> str:
        return self._cache_dir()

    def pair_truncation(self, seq_length: int) -> PairTruncation:
        """Each sequence's cut: ``max_length``, or what fits a row (two sequences of a packed pair)."""
        default = (seq_length + 1) // 2 if self.pack else seq_length + 1
        return PairTruncation(self.max_length or default, self.truncation_mode == "keep_end")

    def build(self, seq_length: int, seed: int, num_samples: tuple[int, int, int], vocab_size: int,
              eod_id: int | None) -> tuple:
        return self._build(seq_length, seed, num_samples, vocab_size, eod_id, "truncate",
                           self.pair_truncation(seq_length))


def _input_fingerprint(path: str) -> dict:
    """Name, size, mtime and a hash of the first and last MiB: cheap on huge files, changes when they are rewritten."""
    stat = os.stat(path)
    return {"name": os.path.basename(path), "mtime_ns": stat.st_mtime_ns, "sha": file_fingerprint(path)}
