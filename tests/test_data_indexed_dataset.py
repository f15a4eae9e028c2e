"""The .bin/.idx format against Megatron-LM's byte layout, written by hand here, in both directions."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from llama_megatron.data.indexed_dataset import (
    IndexedDatasetWriter,
    MMapIndexedDataset,
    token_dtype,
    write_indexed_dataset,
)
from llama_megatron.errors import DataError

# Megatron-LM's dtype codes, restated independently of the module under test.
MEGATRON_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def megatron_bytes(sequences: list[list[int]], doc_idx: list[int], dtype, code: int) -> tuple[bytes, bytes]:
    """What Megatron-LM's MMapIndexedDatasetBuilder writes, spelled out field by field."""
    sizes = [len(s) for s in sequences]
    itemsize = np.dtype(dtype).itemsize
    pointers, offset = [], 0
    for size in sizes:
        pointers.append(offset)
        offset += size * itemsize
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx))
    idx += struct.pack(f"<{len(sizes)}i", *sizes)
    idx += struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    binary = b"".join(np.asarray(s, dtype=dtype).tobytes() for s in sequences)
    return binary, idx


def write_raw(prefix: str, binary: bytes, idx: bytes) -> None:
    with open(prefix + ".bin", "wb") as f:
        f.write(binary)
    with open(prefix + ".idx", "wb") as f:
        f.write(idx)


@pytest.mark.parametrize("code", sorted(MEGATRON_CODES))
def test_reads_hand_written_megatron_files(tmp_path, code):
    dtype = MEGATRON_CODES[code]
    # Two documents: the first made of two sequences (Megatron's sentence-split layout), then an empty one.
    sequences = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    doc_idx = [0, 2, 3]
    prefix = str(tmp_path / "meg")
    write_raw(prefix, *megatron_bytes(sequences, doc_idx, dtype, code))
    ds = MMapIndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == 3
    assert ds.sizes.tolist() == [3, 2, 4]
    assert ds.doc_idx.tolist() == doc_idx
    assert ds.pointers.tolist() == [0, 3 * np.dtype(dtype).itemsize, 5 * np.dtype(dtype).itemsize]
    assert [ds[i].tolist() for i in range(3)] == sequences
    assert [a.tolist() for a in ds[0:2]] == sequences[:2]
    assert ds.get(2, offset=1, length=2).tolist() == [7, 8]
    assert ds.get(-1).tolist() == [6, 7, 8, 9]
    assert ds.document_bounds().tolist() == [0, 5, 9]
    assert ds.num_documents == 2


def test_writer_output_is_byte_identical_to_megatron(tmp_path):
    sequences = [[10, 11, 12], [13], [14, 15], [65535, 0]]
    doc_idx = [0, 1, 3, 4]  # documents: [s0], [s1, s2], [s3]
    prefix = str(tmp_path / "ours")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_document(sequences[0])
        w.add_document(sequences[1] + sequences[2], sequence_lengths=[1, 2])
        w.add_documents(np.array(sequences[3]), np.array([2]))
        w.finalize()
    want_bin, want_idx = megatron_bytes(sequences, doc_idx, np.uint16, 8)
    assert open(prefix + ".bin", "rb").read() == want_bin
    assert open(prefix + ".idx", "rb").read() == want_idx


def test_round_trip_many_documents_and_int32(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 128_256, rng.integers(0, 50)).tolist() for _ in range(300)]
    docs = [d for d in docs if d]
    prefix = str(tmp_path / "rt")
    write_indexed_dataset(prefix, docs, token_dtype(128_256))
    ds = MMapIndexedDataset(prefix)
    assert ds.dtype == np.int32
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert ds.num_tokens == sum(map(len, docs))
    assert ds.tokens.tolist() == [t for d in docs for t in d]


def test_empty_dataset_round_trip(tmp_path):
    prefix = str(tmp_path / "empty")
    write_indexed_dataset(prefix, [], np.uint16)
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0


def test_token_dtype_boundaries():
    assert token_dtype(32_000) == np.uint16
    assert token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.int32
    assert token_dtype(128_256) == np.int32


def test_writer_rejects_ids_outside_dtype_and_leaves_no_files(tmp_path):
    prefix = str(tmp_path / "bad")
    with pytest.raises(DataError, match="65536 does not fit uint16"):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document([1, 65536])
            w.finalize()
    assert os.listdir(tmp_path) == []


def test_missing_prefix_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match=r"nothere.*\.idx does not exist"):
        MMapIndexedDataset(str(tmp_path / "nothere"))
    write_indexed_dataset(str(tmp_path / "half"), [[1, 2]], np.uint16)
    os.remove(tmp_path / "half.bin")
    with pytest.raises(DataError, match=r"half\.bin does not exist"):
        MMapIndexedDataset(str(tmp_path / "half"))


def _corrupt(tmp_path, mutate) -> str:
    prefix = str(tmp_path / "c")
    write_indexed_dataset(prefix, [[1, 2, 3], [4, 5]], np.uint16)
    raw = bytearray(open(prefix + ".idx", "rb").read())
    raw = mutate(raw)
    with open(prefix + ".idx", "wb") as f:
        f.write(raw)
    return prefix


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b"NOTMEGA!!" + b[9:], "bad magic"),
        (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "unsupported version 2"),
        (lambda b: b[:17] + bytes([9]) + b[18:], "unknown dtype code 9"),
        (lambda b: b[:-8], r"\d+ bytes but the header .* needs"),
        (lambda b: b[:20], "20 bytes is shorter than"),
        (lambda b: b[:5], "5 bytes is shorter than"),
        (lambda b: b[:-8] + struct.pack("<q", 1), "doc_idx must run"),
        # pointer of sequence 1 points into the middle of sequence 0
        (lambda b: b[: 34 + 8 + 8] + struct.pack("<q", 2) + b[34 + 8 + 16 :], "pointers disagree"),
        (lambda b: b[:34] + struct.pack("<i", -1) + b[38:], "negative"),
    ],
)
def test_corrupt_index_is_a_clear_error(tmp_path, mutate, message):
    prefix = _corrupt(tmp_path, mutate)
    with pytest.raises(DataError, match="corrupt index .*c.idx: " + message):
        MMapIndexedDataset(prefix)


def test_truncated_bin_is_a_clear_error(tmp_path):
    prefix = str(tmp_path / "t")
    write_indexed_dataset(prefix, [[1, 2, 3], [4, 5]], np.uint16)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(6)
    with pytest.raises(DataError, match=r"t\.bin has 6 bytes, the index says 10"):
        MMapIndexedDataset(prefix)
