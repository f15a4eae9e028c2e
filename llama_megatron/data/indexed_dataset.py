"""Megatron-LM's memory-mapped ``PREFIX.bin`` + ``PREFIX.idx`` format: reader and streaming writer.

Byte layout of ``PREFIX.idx`` (little endian; identical to Megatron-LM / Megatron-DeepSpeed ``MMapIndexedDataset``
and megatron-core ``IndexedDataset``, so data preprocessed by either loads unchanged):

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    <Q        version, always 1
    <B        dtype code of the tokens in .bin (DTYPE_CODES)
    <Q        N, number of sequences
    <Q        M, number of entries of doc_idx (= documents + 1)
    int32[N]  sizes: tokens per sequence
    int64[N]  pointers: byte offset of each sequence in .bin
    int64[M]  doc_idx: index of the first sequence of each document, then N

``PREFIX.bin`` is the sequences' tokens back to back. Preprocess writes one sequence per document.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterable

import numpy as np

from llama_megatron.errors import DataError
from llama_megatron.temps import reclaim_temps

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, M: 34 bytes
_CHECK_CHUNK = 1 << 22  # sequences per vectorised validation step: bounds temporary memory


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (any LLaMA-1/2 vocab), else int32 (LLaMA-3's 128k)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def data_paths(prefix: str) -> tuple[str, str]:
    return prefix + ".bin", prefix + ".idx"


def prefix_exists(prefix: str) -> bool:
    return all(os.path.isfile(p) for p in data_paths(prefix))


class MMapIndexedDataset:
    """Read-only view of a ``.bin``/``.idx`` pair; items are numpy views into the memory map (no copies)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        bin_path, idx_path = data_paths(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DataError(f"data prefix {prefix!r}: {path} does not exist")
        self._read_index(idx_path)
        self._check_bin(bin_path)

    def _corrupt(self, why: str) -> DataError:
        return DataError(f"corrupt index {self.prefix}.idx: {why}")

    def _read_index(self, idx_path: str) -> None:
        file_size = os.path.getsize(idx_path)
        if file_size < _HEADER.size:
            raise self._corrupt(f"{file_size} bytes is shorter than the {_HEADER.size}-byte header")
        with open(idx_path, "rb") as f:
            magic, version, code, n, m = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise self._corrupt(
                f"bad magic {magic!r} (expected {MAGIC!r}); not a Megatron MMapIndexedDataset"
            )
        if version != VERSION:
            raise self._corrupt(f"unsupported version {version} (expected {VERSION})")
        if code not in DTYPE_CODES:
            raise self._corrupt(f"unknown dtype code {code}")
        expected = _HEADER.size + 12 * n + 8 * m
        if file_size != expected:
            raise self._corrupt(
                f"{file_size} bytes but the header ({n} sequences, {m} doc_idx) needs {expected}"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        raw = np.memmap(idx_path, mode="r", dtype=np.uint8) if file_size else np.zeros(0, np.uint8)
        off = _HEADER.size
        self._sizes = np.frombuffer(raw, dtype=np.int32, count=n, offset=off)
        self._pointers = np.frombuffer(raw, dtype=np.int64, count=n, offset=off + 4 * n)
        self._doc_idx = np.frombuffer(raw, dtype=np.int64, count=m, offset=off + 12 * n)
        if m < 1 or self._doc_idx[0] != 0 or self._doc_idx[-1] != n:
            raise self._corrupt(f"doc_idx must run from 0 to {n}")
        itemsize = self.dtype.itemsize
        for lo in range(0, max(n, m), _CHECK_CHUNK):
            sizes = self._sizes[lo : lo + _CHECK_CHUNK + 1].astype(np.int64)
            ptrs = self._pointers[lo : lo + _CHECK_CHUNK + 1]
            if (sizes < 0).any():
                raise self._corrupt("negative sequence size")
            if ptrs.size and lo == 0 and ptrs[0] != 0:
                raise self._corrupt("first pointer is not 0")
            if ptrs.size > 1 and (ptrs[1:] != ptrs[:-1] + sizes[:-1] * itemsize).any():
                raise self._corrupt("pointers disagree with sizes")
            docs = self._doc_idx[lo : lo + _CHECK_CHUNK + 1]
            if docs.size > 1 and (np.diff(docs) < 0).any():
                raise self._corrupt("doc_idx is not sorted")
        self._num_tokens = int(self._pointers[-1]) // itemsize + int(self._sizes[-1]) if n else 0

    def _check_bin(self, bin_path: str) -> None:
        size = os.path.getsize(bin_path)
        want = self._num_tokens * self.dtype.itemsize
        if size != want:
            raise DataError(
                f"data prefix {self.prefix!r}: {bin_path} has {size} bytes, the index says {want}"
            )
        # np.memmap cannot map an empty file.
        self._bin = np.memmap(bin_path, mode="r", dtype=self.dtype) if size else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return int(self._sizes.shape[0])

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset:offset+length`` of sequence ``idx`` (Megatron's signature)."""
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {n} sequences")
        size = int(self._sizes[idx])
        if length is None:
            length = size - offset
        start = int(self._pointers[idx]) // self.dtype.itemsize + offset
        return self._bin[start : start + length]

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def pointers(self) -> np.ndarray:
        return self._pointers

    @property
    def doc_idx(self) -> np.ndarray:
        return self._doc_idx

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the file as one flat array (sequences are contiguous: checked at open)."""
        return self._bin

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_documents(self) -> int:
        return int(self._doc_idx.shape[0]) - 1

    def document_bounds(self) -> np.ndarray:
        """int64[num_documents + 1]: token offset where each document starts in ``tokens``, then the total.

        Documents with zero sequences (Megatron writes them for empty texts) get zero length.
        """
        starts = np.empty(len(self) + 1, dtype=np.int64)
        starts[:-1] = self._pointers // self.dtype.itemsize
        starts[-1] = self._num_tokens
        return starts[self._doc_idx]


class IndexedDatasetWriter:
    """Streams documents to ``PREFIX.bin``/``PREFIX.idx`` in bounded memory.

    Tokens go straight to a temporary ``.bin``; sizes and doc_idx are spooled to temporary files and only
    assembled into the index at ``finalize``. Outputs appear by atomic rename, so a crash or an error never
    leaves a half-written ``PREFIX.bin``/``.idx``; use it as a context manager to remove temporaries on error.
    """

    def __init__(self, prefix: str, dtype) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise DataError(f"dtype {self.dtype} has no Megatron dtype code")
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        tag = f".tmp-{os.getpid()}"
        self._bin_path, self._idx_path = data_paths(prefix)
        # a killed writer's temps for the same prefix (its pid gone): otherwise they would stay forever
        base = re.escape(os.path.basename(prefix))
        reclaim_temps(os.path.dirname(os.path.abspath(prefix)),
                      rf"{base}\.(?:bin|idx)\.tmp-(?P<pid>\d+)(?:\.sizes|\.docs)?")
        self._tmp = {name: path + tag for name, path in (("bin", self._bin_path), ("idx", self._idx_path))}
        self._tmp["sizes"] = self._idx_path + tag + ".sizes"
        self._tmp["docs"] = self._idx_path + tag + ".docs"
        self._files = {k: open(self._tmp[k], "wb") for k in ("bin", "sizes", "docs")}
        self._files["docs"].write(np.zeros(1, np.int64).tobytes())
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0
        self._done = False

    def _check_range(self, tokens: np.ndarray) -> None:
        if self._info is not None and tokens.size:
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < self._info.min or hi > self._info.max:
                raise DataError(
                    f"token id {hi if hi > self._info.max else lo} does not fit {self.dtype} ({self.prefix})"
                )

    def add_documents(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Many one-sequence documents at once: ``flat`` is their tokens back to back."""
        lengths = np.asarray(lengths, dtype=np.int64)
        flat = np.asarray(flat)
        if int(lengths.sum()) != flat.size:
            raise ValueError("lengths do not add up to the number of tokens")
        if lengths.size and int(lengths.max()) > np.iinfo(np.int32).max:
            raise DataError(f"a document of {int(lengths.max())} tokens exceeds the int32 size field")
        self._check_range(flat)
        self._files["bin"].write(flat.astype(self.dtype, copy=False).tobytes())
        self._files["sizes"].write(lengths.astype(np.int32).tobytes())
        ends = self.num_sequences + np.arange(1, lengths.size + 1, dtype=np.int64)
        self._files["docs"].write(ends.tobytes())
        self.num_sequences += int(lengths.size)
        self.num_documents += int(lengths.size)
        self.num_tokens += int(flat.size)

    def add_document(
        self, tokens: Iterable[int] | np.ndarray, sequence_lengths: list[int] | None = None
    ) -> None:
        """One document, optionally made of several sequences (Megatron's sentence-split layout)."""
        arr = np.asarray(tokens)
        lengths = np.asarray([arr.size] if sequence_lengths is None else sequence_lengths, dtype=np.int64)
        if int(lengths.sum()) != arr.size:
            raise ValueError("sequence_lengths do not add up to the document length")
        self._check_range(arr)
        self._files["bin"].write(arr.astype(self.dtype, copy=False).tobytes())
        self._files["sizes"].write(lengths.astype(np.int32).tobytes())
        self.num_sequences += int(lengths.size)
        self.num_documents += 1
        self.num_tokens += int(arr.size)
        self._files["docs"].write(np.int64(self.num_sequences).tobytes())

    def finalize(self) -> None:
        for f in self._files.values():
            f.close()
        n, m = self.num_sequences, self.num_documents + 1
        code = CODE_OF_DTYPE[self.dtype]
        with open(self._tmp["idx"], "wb") as out:
            out.write(_HEADER.pack(MAGIC, VERSION, code, n, m))
            _copy_file(self._tmp["sizes"], out)
            offset = 0  # running byte offset carries the pointers across chunks
            with open(self._tmp["sizes"], "rb") as sizes_file:
                while chunk := sizes_file.read(4 * _CHECK_CHUNK):
                    sizes = np.frombuffer(chunk, dtype=np.int32).astype(np.int64) * self.dtype.itemsize
                    ends = np.cumsum(sizes) + offset
                    out.write((ends - sizes).tobytes())
                    offset = int(ends[-1])
            _copy_file(self._tmp["docs"], out)
        os.replace(self._tmp["bin"], self._bin_path)
        os.replace(self._tmp["idx"], self._idx_path)
        self._done = True
        self._cleanup()

    def abort(self) -> None:
        for f in self._files.values():
            f.close()
        self._cleanup(everything=True)

    def _cleanup(self, everything: bool = False) -> None:
        names = ("bin", "idx", "sizes", "docs") if everything else ("sizes", "docs")
        for name in names:
            try:
                os.remove(self._tmp[name])
            except FileNotFoundError:
                pass

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            self.abort()


def _copy_file(path: str, out) -> None:
    with open(path, "rb") as src:
        while block := src.read(1 << 24):
            out.write(block)


def write_indexed_dataset(prefix: str, documents: Iterable[Iterable[int]], dtype) -> None:
    """Convenience for small data (tests, synthetic corpora): one sequence per document."""
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
        writer.finalize()
