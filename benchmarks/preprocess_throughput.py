"""Tokens/s of ``llama-megatron preprocess`` against ``datasets.Dataset.map`` on the same corpus, same run.

Both sides use the same tokenizer (``load_tokenizer`` on the same model, one sentencepiece thread per process)
and the same number of worker processes. ``preprocess`` is timed end to end (read JSONL, parse, tokenise, write
.bin/.idx, start workers); ``Dataset.map`` is timed for the map alone (batched, num_proc equal, writing its Arrow
cache), the JSONL already loaded into Arrow beforehand, so the comparison leans towards datasets. The map function
calls ``encode_batch`` (what a datasets user writes); a second figure runs the map with ``encode_flat``, the exact
word-cache path preprocess uses, to separate the tokeniser speed-up from the pipeline. The corpus is repeated, which
warms the word cache more than fresh text would; ``cold_x1_1worker`` is one pass over the corpus as shipped.
Best of ``--repeats``.

    python benchmarks/preprocess_throughput.py [--repeat-corpus 8] [--repeats 2]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llama_megatron.commands.preprocess import add_arguments  # noqa: E402
from llama_megatron.data.indexed_dataset import MMapIndexedDataset  # noqa: E402
from llama_megatron.data.preprocess import preprocess  # noqa: E402
from llama_megatron.data.tokenizer import load_tokenizer  # noqa: E402


def make_corpus(src: Path, dst: Path, repeat: int) -> None:
    data = src.read_bytes()
    with open(dst, "wb") as f:
        for _ in range(repeat):
            f.write(data)


def time_preprocess(corpus: Path, tokenizer: str, workers: int, out_dir: str) -> tuple[float, int]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--input", str(corpus), "--tokenizer", tokenizer, "--output-prefix", os.path.join(out_dir, "bench"),
            "--append-eod", "--workers", str(workers), "--overwrite", "--quiet",
        ]
    )  # fmt: skip
    start = time.perf_counter()
    stats = preprocess(args)
    elapsed = time.perf_counter() - start
    assert MMapIndexedDataset(stats["outputs"][0]).num_tokens == stats["tokens"]
    return elapsed, stats["tokens"]


class Encode:
    """The map function: a picklable callable holding the same tokenizer object preprocess uses.

    ``fast=False`` calls ``encode_batch`` (what a datasets user writes); ``fast=True`` uses the same exact
    word-cache path as preprocess (``encode_flat``), to show how much of the gain is the pipeline alone.
    """

    def __init__(self, tokenizer, fast: bool) -> None:
        self.tokenizer = tokenizer
        self.fast = fast

    def __call__(self, batch: dict) -> dict:
        if not self.fast:
            return {"input_ids": self.tokenizer.encode_batch(batch["text"], eos=True)}
        flat, lengths = self.tokenizer.encode_flat(batch["text"])
        flat = np.insert(flat, np.cumsum(lengths), self.tokenizer.eos_id)
        return {"input_ids": np.split(flat, np.cumsum(lengths + 1)[:-1])}


def time_datasets_map(
    corpus: Path, tokenizer_path: str, workers: int, cache_dir: str, fast: bool
) -> tuple[float, int]:
    import datasets

    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=cache_dir)
    # A fresh tokenizer per run, as preprocess loads its own: no word cache carried over from an earlier run.
    tokenizer = load_tokenizer(tokenizer_path)
    start = time.perf_counter()
    out = ds.map(
        Encode(tokenizer, fast),
        batched=True,
        batch_size=1000,
        num_proc=workers if workers > 1 else None,
        remove_columns=ds.column_names,
        load_from_cache_file=False,
        new_fingerprint=f"bench-{workers}-{time.time_ns()}",
    )
    elapsed = time.perf_counter() - start
    tokens = sum(len(ids) for ids in out.with_format("arrow")["input_ids"].to_pylist())
    return elapsed, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=str(REPO / "data/corpus/shakespeare.jsonl"))
    parser.add_argument("--tokenizer", default=str(REPO / "data/tokenizer"))
    parser.add_argument("--repeat-corpus", type=int, default=8, help="concatenate the corpus this many times")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many timings per configuration")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()

    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    # Other work on the machine skews every figure: record how busy it was.
    result: dict = {
        "benchmark": "preprocess_throughput",
        "cpus": os.cpu_count(),
        "load_1min": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp, "corpus.jsonl")
        make_corpus(Path(args.corpus), corpus, args.repeat_corpus)
        result["corpus_mb"] = round(corpus.stat().st_size / 1e6, 2)
        ours, theirs, theirs_fast = {}, {}, {}
        hf_cache = os.path.join(tmp, "hf")
        for workers in args.workers:
            w = str(workers)
            t, n = min(time_preprocess(corpus, args.tokenizer, workers, tmp) for _ in range(args.repeats))
            result["tokens"] = n
            ours[w] = round(n / t)
            for fast, table in ((False, theirs), (True, theirs_fast)):
                t_map, n_map = min(
                    time_datasets_map(corpus, args.tokenizer, workers, hf_cache, fast)
                    for _ in range(args.repeats)
                )
                if n_map != n:
                    raise SystemExit(f"token counts differ: preprocess {n}, datasets.map {n_map}")
                table[w] = round(n_map / t_map)
        # Cold word cache: the shipped corpus once, one process, both sides.
        t_cold, n_cold = time_preprocess(Path(args.corpus), args.tokenizer, 1, tmp)
        t_map_cold, _ = time_datasets_map(Path(args.corpus), args.tokenizer, 1, hf_cache, False)
        result["preprocess_tokens_per_s"] = ours
        result["datasets_map_tokens_per_s"] = theirs
        result["ratio"] = {w: round(ours[w] / theirs[w], 2) for w in ours}
        result["datasets_map_fastpath_tokens_per_s"] = theirs_fast
        result["ratio_vs_map_fastpath"] = {w: round(ours[w] / theirs_fast[w], 2) for w in ours}
        result["cold_x1_1worker"] = {
            "preprocess": round(n_cold / t_cold),
            "datasets_map": round(n_cold / t_map_cold),
            "ratio": round(t_map_cold / t_cold, 2),
        }
        result["goal_met"] = all(r >= 1.5 for r in result["ratio"].values())
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
