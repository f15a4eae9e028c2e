"""GPT sample datasets: packing, splits, blending, determinism, DP slicing, resume, caching, errors."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest

from llama_megatron.data import index_cache
from llama_megatron.data.config import data_config_from_dict
from llama_megatron.data.gpt_dataset import (
    build_train_valid_test_datasets,
    document_positions,
    validate_data_config,
)
from llama_megatron.data.index_cache import cached_arrays
from llama_megatron.data.indexed_dataset import write_indexed_dataset
from llama_megatron.data.sample_index import build_blending_index, parse_split, split_document_ranges
from llama_megatron.data.sampler import PretrainingSampler, collate, make_sample_iterator
from llama_megatron.errors import ConfigError, DataError


def unique_token_prefix(
    path, num_docs: int, seed: int = 0, first_token: int = 0, max_len: int = 40
) -> tuple[str, list]:
    """Documents whose tokens are consecutive integers, so every token names its document and position."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, num_docs)
    starts = first_token + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    docs = [list(range(s, s + n)) for s, n in zip(starts.tolist(), lengths.tolist())]
    write_indexed_dataset(str(path), docs, np.int32)
    return str(path), docs


def doc_of_token(docs: list) -> dict[int, int]:
    return {t: d for d, doc in enumerate(docs) for t in doc}


def build(prefix: str, seq: int, samples, seed: int = 1234, **data) -> tuple:
    return build_train_valid_test_datasets({"prefix": prefix, **data}, seq, seed, samples)


def test_packing_covers_each_token_once_per_epoch(tmp_path):
    prefix, docs = unique_token_prefix(tmp_path / "u", 120)
    total = sum(map(len, docs))
    seq = 16
    one_epoch = (total - 1) // seq
    (train, _, _) = build(prefix, seq, (one_epoch, 0, 0), split="1,0,0")
    assert train.num_epochs == 1
    inputs = np.concatenate([train[i]["tokens"][:-1] for i in range(len(train))])
    assert np.unique(inputs).size == inputs.size == one_epoch * seq  # nothing repeated within the epoch
    assert total - inputs.size < seq + 1  # only the tail of the last document is left over
    # consecutive unshuffled samples share exactly one token: labels continue the stream
    order = np.argsort(train.shuffle_idx)
    items = [train[int(i)]["tokens"] for i in order]
    assert all(a[-1] == b[0] and a.size == seq + 1 for a, b in zip(items, items[1:]))
    assert sorted(train.doc_idx.tolist()) == list(range(len(docs)))

    two_epochs = (2 * total - 1) // seq
    (train2, _, _) = build(prefix, seq, (two_epochs, 0, 0), split="1,0,0", cache_dir=str(tmp_path / "c2"))
    assert train2.num_epochs == 2
    counts = np.bincount(np.concatenate([train2[i]["tokens"][:-1] for i in range(len(train2))]))
    assert counts.min() == 1 and counts.max() == 2 and counts.sum() == two_epochs * seq
    first, second = train2.doc_idx[: len(docs)], train2.doc_idx[len(docs) :]
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(len(docs)))
    assert first.tolist() != second.tolist()  # each epoch shuffled on its own


def test_splits_are_isolated_by_document(tmp_path):
    prefix, docs = unique_token_prefix(tmp_path / "s", 200)
    owner = doc_of_token(docs)
    ranges = split_document_ranges(200, parse_split("80,10,10"))
    assert ranges == [(0, 160), (160, 180), (180, 200)]
    splits = build(prefix, 8, (400, 60, 60), split="80,10,10")
    for ds, (lo, hi) in zip(splits, ranges):
        seen = {owner[t] for i in range(len(ds)) for t in ds[i]["tokens"].tolist()}
        assert seen <= set(range(lo, hi)) and len(seen) > (hi - lo) // 2


def test_megatron_split_rounding_and_empty_splits(tmp_path):
    assert split_document_ranges(200, parse_split("969,30,1")) == [(0, 194), (194, 200), (200, 200)]
    assert split_document_ranges(1000, parse_split("98/2")) == [(0, 980), (980, 1000), (1000, 1000)]
    prefix, _ = unique_token_prefix(tmp_path / "e", 200)
    train, valid, test = build(prefix, 8, (10, 10, 10))
    assert len(train) == 10 and len(valid) == 10 and test is None  # no test documents, as in Megatron
    assert build(prefix, 8, (10, 0, 0))[1] is None
    with pytest.raises(ConfigError, match="leaves no documents for training"):
        build(prefix, 8, (10, 0, 0), split="0,1,0")
    for bad in ("a,b", "1,2,3,4", "-1,2", "0,0,0"):
        with pytest.raises(ConfigError, match="data.split"):
            parse_split(bad)


def naive_megatron_blend(weights: list[float], size: int) -> list[int]:
    taken = np.zeros(len(weights))
    out = []
    for i in range(size):
        err = np.asarray(weights) * max(i, 1) - taken
        d = int(np.argmax(err))  # argmax returns the first maximum, like Megatron's strict ">"
        out.append(d)
        taken[d] += 1
    return out


def test_blending_index_is_megatrons_greedy_rule():
    for weights in ([0.7, 0.3], [0.5, 0.3, 0.2], [0.1, 0.1, 0.8]):
        which, within = build_blending_index(weights, 3000)
        assert which.tolist() == naive_megatron_blend(weights, 3000)
        for d in range(len(weights)):
            assert within[which == d].tolist() == list(range(int((which == d).sum())))


def test_blend_proportions_over_10k_samples(tmp_path):
    a, _ = unique_token_prefix(tmp_path / "web", 300, seed=1)
    b, _ = unique_token_prefix(tmp_path / "code", 300, seed=2, first_token=1_000_000)
    data = {"blend": [[5, a], [3, b], [2, a]], "split": "1,0,0"}
    (blend, _, _) = build_train_valid_test_datasets(data, 8, 7, (10_000, 0, 0))
    ids = np.array([int(blend[i]["dataset_id"]) for i in range(len(blend))])
    for k in (100, 1000, 10_000):
        counts = np.bincount(ids[:k], minlength=3) / k
        assert np.allclose(counts, [0.5, 0.3, 0.2], atol=0.01)
    # the samples really come from the named prefix
    for i in range(0, 10_000, 97):
        tokens = blend[i]["tokens"]
        assert (tokens >= 1_000_000).all() if ids[i] == 1 else (tokens < 1_000_000).all()


def test_deterministic_across_runs_and_cache(tmp_path):
    prefix, _ = unique_token_prefix(tmp_path / "d", 150)
    first = build(prefix, 12, (300, 20, 0), cache_dir=str(tmp_path / "c1"))
    again = build(prefix, 12, (300, 20, 0), cache_dir=str(tmp_path / "c2"))  # rebuilt from scratch
    cached = build(prefix, 12, (300, 20, 0), cache_dir=str(tmp_path / "c1"))  # loaded from the cache
    for x, y, z in zip(first[:2], again[:2], cached[:2]):
        for i in range(len(x)):
            assert np.array_equal(x[i]["tokens"], y[i]["tokens"]) and np.array_equal(
                x[i]["tokens"], z[i]["tokens"]
            )
    other_seed = build(prefix, 12, (300, 20, 0), seed=99, cache_dir=str(tmp_path / "c1"))[0]
    assert any(not np.array_equal(first[0][i]["tokens"], other_seed[i]["tokens"]) for i in range(10))
    assert sorted(os.listdir(tmp_path / "c1")) == sorted(
        n for n in os.listdir(tmp_path / "c1") if not n.endswith(".lock") and ".tmp-" not in n
    )


def test_default_cache_sits_beside_the_data(tmp_path):
    prefix, _ = unique_token_prefix(tmp_path / "beside", 50)
    build(prefix, 8, (20, 0, 0))
    entries = os.listdir(tmp_path / "index-cache")
    assert len(entries) == 1 and entries[0].startswith("beside-train-")


def test_dp_ranks_get_disjoint_contiguous_slices():
    total, mb, dp = 100, 3, 4
    per_rank = [list(PretrainingSampler(total, 0, mb, r, dp)) for r in range(dp)]
    assert all(
        len(batches) == len(PretrainingSampler(total, 0, mb, r, dp)) == 8
        for r, batches in enumerate(per_rank)
    )
    for step in range(8):
        batch = [per_rank[r][step] for r in range(dp)]
        assert sum(batch, []) == list(range(step * 12, step * 12 + 12))  # rank r holds slice r of the chunk
    tail = list(PretrainingSampler(total, 0, mb, 1, dp, drop_last=False))[-1]
    assert tail == [99]


def test_resume_at_the_exact_sample(tmp_path):
    prefix, _ = unique_token_prefix(tmp_path / "r", 100)
    (train, _, _) = build(prefix, 8, (200, 0, 0), split="1,0,0")
    mb, dp = 2, 3
    for rank in range(dp):
        full = list(make_sample_iterator(train, 0, mb, rank, dp))
        resumed = list(make_sample_iterator(train, 5 * mb * dp, mb, rank, dp))
        assert resumed == full[5:]
        assert all(
            np.array_equal(collate([train[i] for i in a])["tokens"], collate([train[i] for i in b])["tokens"])
            for a, b in zip(resumed, full[5:])
        )
    with pytest.raises(ConfigError, match="consumed_samples 201"):
        PretrainingSampler(200, 201, 1, 0, 1)
    with pytest.raises(ConfigError, match="dp_rank 3"):
        PretrainingSampler(200, 0, 1, 3, 3)


def test_document_positions_by_hand():
    starts = np.array([0, 0, 0, 1, 0, 1, 1, 0], dtype=bool)
    out = document_positions(starts)
    assert out["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 0, 1]
    assert out["segment_ids"].tolist() == [0, 0, 0, 1, 1, 2, 3, 3]


def test_per_document_positions_follow_boundaries_and_eod(tmp_path):
    prefix, docs = unique_token_prefix(tmp_path / "p", 80, max_len=12)
    owner = doc_of_token(docs)
    eod = docs[10][len(docs[10]) // 2]  # pretend a token in the middle of document 10 is an EOD
    (train, _, _) = build(prefix, 16, (60, 0, 0), split="1,0,0", per_document_attention=True, eod_id=eod)
    saw_eod = False
    for i in range(len(train)):
        item = train[i]
        tokens = item["tokens"]
        assert item["position_ids"].shape == item["segment_ids"].shape == (16,)
        inputs = tokens[:-1].tolist()
        new_doc = [
            k > 0 and (owner[inputs[k]] != owner[inputs[k - 1]] or inputs[k - 1] == eod) for k in range(16)
        ]
        saw_eod |= eod in inputs[:-1]
        expected_pos, expected_seg = [], []
        for k in range(16):
            expected_pos.append(0 if k == 0 or new_doc[k] else expected_pos[-1] + 1)
            expected_seg.append(0 if k == 0 else expected_seg[-1] + int(new_doc[k]))
        assert item["position_ids"].tolist() == expected_pos
        assert item["segment_ids"].tolist() == expected_seg
    assert saw_eod
    (plain, _, _) = build(prefix, 16, (60, 0, 0), split="1,0,0")
    assert set(plain[0]) == {"tokens"} and plain[0]["tokens"].dtype == np.int64


def test_many_epochs_over_tiny_data(tmp_path):
    write_indexed_dataset(str(tmp_path / "tiny"), [[1, 2, 3], [4, 5, 6, 7], [8, 9]], np.uint16)
    (train, _, _) = build(str(tmp_path / "tiny"), 4, (50, 0, 0), split="1,0,0")
    assert train.num_epochs == 23  # ceil((50 * 4 + 1) / 9)
    assert all(train[i]["tokens"].size == 5 for i in range(50))
    with pytest.raises(IndexError):
        train[50]


def _build_in_process(args) -> list:
    prefix, cache = args
    (train, _, _) = build(prefix, 8, (500, 0, 0), split="1,0,0", cache_dir=cache)
    return train.shuffle_idx.tolist()


@pytest.mark.launched
def test_many_ranks_starting_at_once_build_one_cache_entry(tmp_path):
    prefix, _ = unique_token_prefix(tmp_path / "m", 200)
    cache = str(tmp_path / "cache")
    with mp.get_context("spawn").Pool(2) as pool:
        results = pool.map(_build_in_process, [(prefix, cache)] * 4)
    assert all(r == results[0] for r in results)
    assert len(os.listdir(cache)) == 1  # one entry, no temporaries, no lock left behind


def test_cache_builds_once_under_concurrency(tmp_path):
    calls = []

    def slow_build():
        calls.append(1)
        time.sleep(0.2)
        return {"x": np.arange(10)}

    out = []
    threads = [
        threading.Thread(target=lambda: out.append(cached_arrays(str(tmp_path), "t", {"k": 1}, slow_build)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(out) == 4
    assert all(o["x"].tolist() == list(range(10)) for o in out)


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"data prefix 'nowhere/web'.*nowhere/web\.bin"):
        validate_data_config({"prefix": "nowhere/web"})
    prefix, _ = unique_token_prefix(tmp_path / "ok", 20)
    validate_data_config({"prefix": prefix, "split": "98,2,0", "per_document_attention": True})
    with pytest.raises(ConfigError, match=r"data prefix .*missing"):
        validate_data_config({"blend": [[0.5, prefix], [0.5, str(tmp_path / "missing")]]})
    bad_configs = [
        ({"prefix": prefix, "blend": [[1, prefix]]}, "exactly one of prefix or blend"),
        ({}, "exactly one of"),
        ({"prefix": prefix, "per_doc_attention": True}, "unknown data keys per_doc_attention"),
        ({"blend": [[prefix, 0.5]]}, "is not \\[weight, prefix\\]"),
        ({"blend": [[0, prefix]]}, "must be positive"),
        ({"blend": []}, "non-empty list"),
        ({"prefix": prefix, "split": "x"}, "data.split"),
        ({"prefix": prefix, "per_document_attention": "yes"}, "true or false"),
        ({"prefix": prefix, "eod_id": -1}, "eod_id"),
    ]
    for config, message in bad_configs:
        with pytest.raises(ConfigError, match=message):
            validate_data_config(config)


def test_corrupt_index_through_the_builder(tmp_path):
    prefix, _ = unique_token_prefix(tmp_path / "bad", 20)
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"garbage!!")
    with pytest.raises(DataError, match="corrupt index .*bad.idx: bad magic"):
        build(prefix, 8, (10, 0, 0))


def test_synthetic_data():
    config = data_config_from_dict({"type": "synthetic", "per_document_attention": True})
    train, valid, test = config.build(32, 5, (100, 10, 0), 4096, None)
    assert test is None and len(train) == 100 and len(valid) == 10
    item = train[3]
    assert item["tokens"].shape == (33,) and item["tokens"].dtype == np.int64
    assert 0 <= item["tokens"].min() and item["tokens"].max() < 4096
    assert item["position_ids"].tolist() == list(range(32)) and not item["segment_ids"].any()
    again = config.build(32, 5, (100, 10, 0), 4096, None)[0]
    assert np.array_equal(again[3]["tokens"], item["tokens"])
    assert not np.array_equal(valid[3]["tokens"], item["tokens"])
    assert data_config_from_dict({"synthetic": True}) == config.__class__()  # the earlier spelling
    with pytest.raises(ConfigError, match="vocab_size"):
        config.build(32, 5, (1, 0, 0), 0, None)


def test_damaged_or_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch):
    prefix, _ = unique_token_prefix(tmp_path / "dc", 30)
    cache = tmp_path / "cache"
    build(prefix, 8, (20, 0, 0), cache_dir=str(cache))
    (entry,) = os.listdir(cache)
    (cache / entry / "shuffle_idx.npy").write_bytes(b"\x93NUMPY broken")
    with pytest.raises(ConfigError, match="is unreadable .*delete that directory"):
        build(prefix, 8, (20, 0, 0), cache_dir=str(cache))

    def read_only(*_args, **_kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(index_cache.os, "makedirs", read_only)
    with pytest.raises(ConfigError, match=r"\(Read-only file system\); set data.cache_dir to a writable dir"):
        build(prefix, 8, (20, 0, 0), cache_dir=str(tmp_path / "elsewhere"))


def test_tokens_outside_the_model_vocab_are_caught(tmp_path):
    write_indexed_dataset(str(tmp_path / "v"), [[1, 2, 3, 4000], [5, 6, 7, 8]], np.uint16)
    data = {"prefix": str(tmp_path / "v"), "split": "1,0,0"}
    (train, _, _) = build_train_valid_test_datasets(data, 3, 0, (2, 0, 0), vocab_size=4096)
    assert all(train[i]["tokens"].max() < 4096 for i in range(2))
    (small, _, _) = build_train_valid_test_datasets(data, 3, 0, (2, 0, 0), vocab_size=1000)
    with pytest.raises(DataError, match="holds token id 4000, outside the model's vocab_size 1000"):
        [small[i] for i in range(2)]


def test_longer_run_sees_the_same_samples_first(tmp_path):
    """The shuffle covers the whole epoch, so more train steps (same epoch count) keep the early samples."""
    prefix, docs = unique_token_prefix(tmp_path / "u", 120)
    (short, _, _) = build(prefix, 16, (40, 0, 0), split="1,0,0")
    (long, _, _) = build(prefix, 16, (90, 0, 0), split="1,0,0")
    assert short.num_epochs == long.num_epochs == 1
    for i in range(40):
        assert np.array_equal(short[i]["tokens"], long[i]["tokens"])
