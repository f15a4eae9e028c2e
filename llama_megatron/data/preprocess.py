"""Tokenise a corpus into Megatron ``.bin``/``.idx`` files (the ``preprocess`` verb).

One output per key, named like Megatron-LM's ``tools/preprocess_data.py``: ``PREFIX_{key}_document.bin/.idx``.
The main process reads files into ~1 MiB chunks and writes results in input order; ``--workers`` processes parse
and tokenise. At most a few chunks per worker are in flight, so memory is bounded whatever the corpus size.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from llama_megatron.data.indexed_dataset import IndexedDatasetWriter, data_paths, token_dtype
from llama_megatron.data.readers import Chunk, decode_chunk, iter_chunks
from llama_megatron.data.tokenizer import Tokenizer, load_tokenizer
from llama_megatron.errors import DataError
from llama_megatron.progress import Progress

MAX_BAD_SHOWN = 5


@dataclass
class ChunkResult:
    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    bad: list[str]
    empty: int
    nbytes: int


# Per-worker state, set once by _init_worker (process pools pickle only the chunk per task).
_STATE: dict = {}


def _init_worker(tokenizer: Tokenizer, keys: list[str], append_eod: bool) -> None:
    # A tokenizers (Rust) thread pool per worker would oversubscribe the cores the pool already uses.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _STATE.update(tokenizer=tokenizer, keys=keys, append_eod=append_eod)


def encode_chunk(chunk: Chunk) -> ChunkResult:
    tok: Tokenizer = _STATE["tokenizer"]
    texts, bad = decode_chunk(chunk, _STATE["keys"])
    tokens, lengths, empty = {}, {}, 0
    for key, key_texts in texts.items():
        flat, lens = tok.encode_flat(key_texts)
        keep = lens > 0  # empty texts make no document (Megatron keeps them as zero-sequence documents)
        empty += int((~keep).sum())
        lens = lens[keep]
        if _STATE["append_eod"] and lens.size:
            flat = np.insert(flat, np.cumsum(lens), tok.eos_id)
            lens = lens + 1
        tokens[key], lengths[key] = flat, lens
    return ChunkResult(tokens, lengths, bad, empty, chunk.nbytes)


def ordered_map(
    fn: Callable,
    items: Iterable,
    workers: int,
    initializer: Callable,
    initargs: tuple,
    in_flight_per_worker: int = 3,
) -> Iterator:
    """``map`` in input order over a process pool, never more than a few tasks ahead of the consumer.

    ``Pool.imap`` would read the whole input ahead of the workers; this keeps memory bounded.
    """
    if workers <= 1:
        initializer(*initargs)
        for item in items:
            yield fn(item)
        return
    with _pool_context().Pool(workers, initializer, initargs) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= workers * in_flight_per_worker:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _pool_context():
    """fork (workers start in milliseconds) while this process runs one thread, else spawn.

    Forking a multi-threaded parent (e.g. preprocess called from a program that started threads) can
    deadlock a child. Forked workers end with os._exit, so they never flush the parent's open writers.
    """
    if "fork" in mp.get_all_start_methods() and threading.active_count() == 1:
        return mp.get_context("fork")
    return mp.get_context("spawn")


def output_prefixes(prefix: str, keys: list[str]) -> dict[str, str]:
    return {key: f"{prefix}_{key}_document" for key in keys}


def _check_outputs(prefixes: dict[str, str], overwrite: bool) -> None:
    for prefix in prefixes.values():
        for path in data_paths(prefix):
            if os.path.exists(path) and not overwrite:
                raise DataError(f"{path} exists; pass --overwrite to replace it")
    parent = os.path.dirname(next(iter(prefixes.values()))) or "."
    os.makedirs(parent, exist_ok=True)


def preprocess(args: argparse.Namespace) -> dict:
    """Tokenise ``args.input`` into one .bin/.idx per key; returns counts (docs, tokens, bad, empty)."""
    if args.workers < 1:
        raise DataError("--workers must be >= 1")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise DataError("--json-keys lists a key twice")
    tokenizer = load_tokenizer(args.tokenizer, args.tokenizer_backend)
    prefixes = output_prefixes(args.output_prefix, args.json_keys)
    _check_outputs(prefixes, args.overwrite)
    dtype = token_dtype(tokenizer.vocab_size)
    progress = Progress("preprocess", args.log_interval, enabled=not args.quiet)
    bad_total, empty_total = 0, 0
    with ExitStack() as stack:
        writers = {k: stack.enter_context(IndexedDatasetWriter(p, dtype)) for k, p in prefixes.items()}
        chunks = iter_chunks(
            args.input, args.input_format, args.json_keys, args.chunk_bytes, args.text_unit, args.hf_split
        )
        results = ordered_map(
            encode_chunk, chunks, args.workers, _init_worker, (tokenizer, args.json_keys, args.append_eod)
        )
        stack.callback(results.close)  # on error: stop the pool before the writers delete their temp files
        for res in results:
            for message in res.bad:
                if not args.skip_bad_lines:
                    raise DataError(f"{message} (pass --skip-bad-lines to skip malformed records)")
                if bad_total < MAX_BAD_SHOWN:
                    print(f"skipping {message}", file=sys.stderr)
                bad_total += 1
            empty_total += res.empty
            for key, writer in writers.items():
                writer.add_documents(res.tokens[key], res.lengths[key])
            docs = int(res.lengths[args.json_keys[0]].size)
            progress.update(docs, sum(int(t.size) for t in res.tokens.values()), res.nbytes)
        for writer in writers.values():
            writer.finalize()
    progress.close()
    first = writers[args.json_keys[0]]
    return {
        "outputs": list(prefixes.values()),
        "documents": first.num_documents,
        "tokens": sum(w.num_tokens for w in writers.values()),
        "bad_records": bad_total,
        "empty_documents": empty_total,
        "dtype": str(dtype),
        "seconds": progress.elapsed,
    }
