"""Exact, faster batch encoding for LLaMA-style sentencepiece BPE models: encode each distinct word once.

Why it is exact: for a BPE model with identity normalisation, a dummy "▁" prefix, whitespace kept as is
(remove_extra_whitespaces=false) and no vocabulary piece in which "▁" follows another character, no merge can
cross a single space that sits between two non-space characters. Cutting the text at such spaces and encoding
each part on its own (the dummy prefix stands in for the dropped space) therefore yields exactly the ids of the
whole text. ``eligible`` checks every one of those conditions on the model; ``SegmentCacheEncoder`` also
compares itself against plain sentencepiece on tricky strings at start-up and refuses to run if they differ.

Natural text repeats its words, so after a warm-up most parts come from the cache and sentencepiece only sees
new ones. Memory is bounded: the cache is dropped whenever it exceeds its limits.
"""

from __future__ import annotations

import itertools
import operator
import re

import numpy as np

WS = "\u2581"
_GROUP = 64  # new words encoded per sentencepiece call item
# A single space with a non-space, non-"▁" character on both sides.
_CUT = re.compile(r"(?<=[^ \u2581]) (?=[^ \u2581])")
_SELF_TEST = [
    "",
    " ",
    "  ",
    "a",
    " lead",
    "  two leading",
    "trail ",
    "trail  ",
    "a  b   c    d",
    "x \ny",
    "x\n y",
    "tab\there and\tthere",
    "digits 12345 67.89",
    "caf\u00e9 na\u00efve \u2603 \U0001f600 \u4e2d\u6587 \u0434\u0430",
    f"lit{WS}eral {WS} {WS}{WS}x",
    "nul\x00 byte \x00",
    "   three  two one    four ",
    "Who's there? Nay, answer me:  stand, and unfold yourself.\n\n  Long live the king!",
]


def eligible(sp) -> bool:
    """True when the word-cut argument above holds for this model (see the module docstring)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError:  # protobuf missing: stay on the plain path
        return False
    proto = pb.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    norm, trainer = proto.normalizer_spec, proto.trainer_spec
    if trainer.model_type != pb.TrainerSpec.BPE or trainer.treat_whitespace_as_suffix:
        return False
    if norm.name != "identity" or norm.precompiled_charsmap or not norm.add_dummy_prefix:
        return False
    if norm.remove_extra_whitespaces or not norm.escape_whitespaces:
        return False
    if sp.piece_to_id(WS) == sp.unk_id():  # the dummy prefix must be a piece of its own or start one
        return False
    joined = re.compile(f"[^{WS}]{WS}")
    skip = (pb.ModelProto.SentencePiece.CONTROL, pb.ModelProto.SentencePiece.BYTE)
    return not any(p.type not in skip and joined.search(p.piece) for p in proto.pieces)


_HOLD = "\x00"  # stands for a space that must not be cut at (next to another space, or at an end)


def split_words(text: str) -> list:
    """The text cut at every single space that has a non-space character on both sides, spaces dropped.

    Spaces that must stay (runs, leading, trailing) are held as NUL first so C-speed ``str.split`` does the
    cutting; parts keep the NULs (``restore`` turns them back). Text with NULs or literal "▁" takes the regex.
    """
    # (returns 1-tuples for text with real NULs; they are cache keys only, see ``restore``)
    if _HOLD in text:  # real NULs: tuple keys keep these words apart from words holding spaces
        return [(w,) for w in _CUT.split(text)]
    if WS in text:
        return _CUT.split(text)
    if "  " in text:
        # pairs left to right, then the odd space a pair leaves at the right end of a run
        text = text.replace("  ", _HOLD * 2).replace(_HOLD + " ", _HOLD * 2)
    if text.startswith(" "):
        text = _HOLD + text[1:]
    if text.endswith(" "):
        text = text[:-1] + _HOLD
    return text.split(" ")


def restore(word) -> str:
    """The text a cache key stands for."""
    if isinstance(word, tuple):
        return word[0]
    return word.replace(_HOLD, " ") if _HOLD in word else word


def _is_simple(word) -> bool:
    return isinstance(word, str) and bool(word) and " " not in word and _HOLD not in word and WS not in word


class SegmentCacheEncoder:
    def __init__(self, sp, max_entries: int = 1 << 19, max_tokens: int = 1 << 23) -> None:
        self._sp = sp
        pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        self._ws_initial = np.array([p.startswith(WS) for p in pieces], dtype=bool)
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._reset()
        for text in _SELF_TEST:
            flat, _ = self.encode_flat([text])
            if flat.tolist() != sp.encode(text, out_type=int):
                raise ValueError(f"segment cache disagrees with sentencepiece on {text!r}")
        self._reset()

    def _reset(self) -> None:
        self._index: dict = {}
        self._offset = np.zeros(1024, dtype=np.int64)
        self._length = np.zeros(1024, dtype=np.int64)
        self._arena = np.zeros(1 << 16, dtype=np.int32)
        self._used = 0

    def _encode_words(self, words: list) -> tuple[list, np.ndarray, np.ndarray]:
        """New words in the order encoded, their tokens back to back, and tokens per word.

        Space-free words are encoded in " "-joined groups (exact by the same cut argument; far fewer
        sentencepiece items); each then starts at the only "▁"-initial piece it contains.
        """
        simple = [w for w in words if _is_simple(w)]
        other = [w for w in words if not _is_simple(w)]
        tokens, lengths = [], []
        if simple:
            groups = [" ".join(simple[i : i + _GROUP]) for i in range(0, len(simple), _GROUP)]
            encoded = self._sp.encode(groups, out_type=int, num_threads=1)
            count = sum(map(len, encoded))
            ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int32, count=count)
            starts = np.flatnonzero(self._ws_initial[ids])
            if starts.size == len(simple) and (starts.size == 0 or starts[0] == 0):
                tokens.append(ids)
                lengths.append(np.diff(starts, append=ids.size))
            else:  # cannot happen for an eligible model; stay exact regardless
                other = simple + other
                simple = []
        if other:
            arrays = self._sp.encode([restore(w) for w in other], out_type=int, num_threads=1)
            lengths.append(np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays)))
            total = int(lengths[-1].sum())
            tokens.append(np.fromiter(itertools.chain.from_iterable(arrays), dtype=np.int32, count=total))
        return simple + other, np.concatenate(tokens), np.concatenate(lengths).astype(np.int64)

    def _add(self, new_words: list) -> None:
        words, tokens, lengths = self._encode_words(new_words)
        first = len(self._index)
        need_words, need_tokens = first + len(words), self._used + tokens.size
        if need_words > self._offset.size:
            size = max(need_words, 2 * self._offset.size)
            self._offset = np.resize(self._offset, size)
            self._length = np.resize(self._length, size)
        if need_tokens > self._arena.size:
            self._arena = np.resize(self._arena, max(need_tokens, 2 * self._arena.size))
        self._arena[self._used : need_tokens] = tokens
        self._length[first:need_words] = lengths
        self._offset[first:need_words] = self._used + np.cumsum(lengths) - lengths
        self._used = need_tokens
        self._index.update(zip(words, range(first, need_words)))

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids of all texts back to back as int32, tokens per text), equal to sentencepiece's own output."""
        if len(self._index) > self.max_entries or self._used > self.max_tokens:
            self._reset()
        per_text = [split_words(t) for t in texts]
        words = list(itertools.chain.from_iterable(per_text))
        index = self._index
        found = list(map(index.get, words))
        if None in found:  # look up again only after adding this chunk's new words
            misses = itertools.compress(words, map(operator.is_, found, itertools.repeat(None)))
            self._add(list(dict.fromkeys(misses)))
            found = list(map(index.__getitem__, words))
        ids = np.array(found, dtype=np.int64)
        lengths = self._length[ids]
        starts = self._offset[ids]
        total = int(lengths.sum())
        flat = self._arena[np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(total)]
        if not texts:
            return flat, np.zeros(0, dtype=np.int64)
        # Every text has at least one word (possibly ""), so the reduceat boundaries strictly increase.
        counts = np.fromiter(map(len, per_text), dtype=np.int64, count=len(per_text))
        return flat, np.add.reduceat(lengths, np.cumsum(counts) - counts)
