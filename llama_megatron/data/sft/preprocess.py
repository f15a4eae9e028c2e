"""Tokenise chat / instruction JSONL once into Megatron-format shards: token ids and training masks.

Outputs of ``PREFIX``: ``PREFIX_tokens.bin/.idx`` (each record's rendered conversation, one document per record;
format ``preference``: a pair's chosen then rejected sequence, two documents per record), ``PREFIX_mask.bin/.idx``
(uint8, the same sizes: 1 where the token is a trained target) and ``PREFIX_sft.json`` (how they were made, and
counts). The machinery is ``preprocess``'s: the main process reads ~1 MiB chunks of lines,
worker processes parse, render and tokenise, results are written in input order (identical output for any number
of workers), memory stays bounded, a progress line runs on stderr, and outputs appear by atomic rename only when
every record was good: a bad record stops with ``FILE:LINE: reason`` and nothing is written (unless bad records
are to be skipped, then they are counted).
"""

from __future__ import annotations

import json
import os
import re
import sys
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from llama_megatron.data.indexed_dataset import IndexedDatasetWriter, data_paths, token_dtype
from llama_megatron.data.preprocess import MAX_BAD_SHOWN, ordered_map
from llama_megatron.data.readers import Chunk, iter_jsonl, json_objects
from llama_megatron.data.sft.chat_template import ChatEncoder, TemplateRenderError
from llama_megatron.data.sft.formats import RecordError, parse_record
from llama_megatron.data.sft.preference_formats import (
    PAIR_DOCUMENTS,
    PREFERENCE_FORMAT,
    encode_preference,
    parse_preference,
)
from llama_megatron.errors import DataError
from llama_megatron.progress import Progress
from llama_megatron.temps import reclaim_temps

SFT_VERSION = 3  # 2: transformers' token rule at span ends, generation markers, TRL's completion rule;
# 3: prompt/completion records trained after the prompt whatever the template marks (masking: assistant_only cuts)


def shard_prefixes(prefix: str) -> dict[str, str]:
    return {"tokens": f"{prefix}_tokens", "mask": f"{prefix}_mask"}


def meta_path(prefix: str) -> str:
    return f"{prefix}_sft.json"


def output_paths(prefix: str) -> list[str]:
    return [p for shard in shard_prefixes(prefix).values() for p in data_paths(shard)] + [meta_path(prefix)]


@dataclass
class SFTChunk:
    tokens: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    bad: list[str]
    nbytes: int


_STATE: dict = {}


def _init_worker(encoder: ChatEncoder, fmt: str, masking: str) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _STATE.update(encoder=encoder, fmt=fmt, masking=masking)


def encode_record(record, encoder: ChatEncoder, fmt: str, masking: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """The documents of one parsed JSON record, (ids, mask) each: one conversation, or a preference pair's chosen
    and rejected sequences (``fmt`` preference); RecordError or TemplateRenderError when it cannot be used."""
    if fmt == PREFERENCE_FORMAT:
        return [(e.ids, e.trained) for e in encode_preference(parse_preference(record), encoder)]
    conversation = parse_record(record, fmt, masking)
    encoded = encoder.encode(conversation.messages, conversation.trained, conversation.prompt_length,
                             conversation.marked_only)
    if not encoded.trained.any():
        raise RecordError("no trained token: the trained turns render to no tokens after the first")
    return [(encoded.ids, encoded.trained)]


def encode_chunk(chunk: Chunk) -> SFTChunk:
    encoder, fmt, masking = _STATE["encoder"], _STATE["fmt"], _STATE["masking"]
    ids, masks, bad = [], [], []
    for lineno, record in json_objects(chunk, bad):
        try:
            documents = encode_record(record, encoder, fmt, masking)
        except (RecordError, TemplateRenderError) as exc:
            bad.append(f"{chunk.file}:{lineno}: {exc}")
            continue
        for tokens, mask in documents:
            ids.append(tokens)
            masks.append(mask)
    lengths = np.fromiter((a.size for a in ids), dtype=np.int64, count=len(ids))
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    flat_mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
    return SFTChunk(flat, flat_mask, lengths, bad, chunk.nbytes)


def preprocess_sft(inputs: list[str], tokenizer: str, output_prefix: str, fmt: str = "auto",
                   masking: str = "assistant", chat_template: str | None = None, workers: int = 1,
                   skip_bad: bool = False, overwrite: bool = False, log_interval: float = 2.0,
                   quiet: bool = False, chunk_bytes: int = 1 << 20) -> dict:
    """Tokenise ``inputs`` (JSONL, .gz ok) into ``output_prefix``'s shards; returns the counts written to its json."""
    if workers < 1:
        raise DataError("workers must be >= 1")
    for path in inputs:
        if not os.path.isfile(path):
            raise DataError(f"input not found: {path}")
    encoder = ChatEncoder(tokenizer, chat_template)
    if masking == "assistant_only" and fmt != PREFERENCE_FORMAT:
        encoder.require_markers()
    for path in output_paths(output_prefix):
        if os.path.exists(path) and not overwrite:
            raise DataError(f"{path} exists; pass --overwrite to replace it")
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    # a killed run's meta temp (its pid gone), as the shards' writers reclaim theirs
    reclaim_temps(os.path.dirname(os.path.abspath(output_prefix)),
                  rf"{re.escape(os.path.basename(meta_path(output_prefix)))}\.tmp-(?P<pid>\d+)")
    shards = shard_prefixes(output_prefix)
    progress = Progress("preprocess-sft", log_interval, enabled=not quiet)
    bad_total = trained = 0
    with ExitStack() as stack:
        tokens_out = stack.enter_context(IndexedDatasetWriter(shards["tokens"], token_dtype(len(encoder.tokenizer))))
        mask_out = stack.enter_context(IndexedDatasetWriter(shards["mask"], np.uint8))
        chunks = (chunk for path in inputs for chunk in iter_jsonl(path, chunk_bytes))
        results = ordered_map(encode_chunk, chunks, workers, _init_worker, (encoder, fmt, masking))
        stack.callback(results.close)  # on error: stop the pool before the writers delete their temp files
        for res in results:
            for message in res.bad:
                if not skip_bad:
                    raise DataError(message)
                if bad_total < MAX_BAD_SHOWN:
                    print(f"skipping {message}", file=sys.stderr)
                bad_total += 1
            tokens_out.add_documents(res.tokens, res.lengths)
            mask_out.add_documents(res.mask, res.lengths)
            trained += int(res.mask.sum())
            progress.update(int(res.lengths.size), int(res.tokens.size), res.nbytes)
        if tokens_out.num_documents == 0:
            raise DataError(f"no usable records in {', '.join(inputs)}")
        documents = documents_per_sample(fmt)
        meta = {"version": SFT_VERSION, "format": fmt, "masking": None if fmt == PREFERENCE_FORMAT else masking,
                "inputs": [os.path.basename(p) for p in inputs], "tokenizer": tokenizer,
                "chat_template": chat_template, **encoder.fingerprint(), "documents_per_sample": documents,
                "samples": tokens_out.num_documents // documents, "tokens": tokens_out.num_tokens,
                "trained_tokens": trained, "skipped_records": bad_total}
        tmp = meta_path(output_prefix) + f".tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=1)
        stack.callback(lambda: os.path.exists(tmp) and os.remove(tmp))
        tokens_out.finalize()
        mask_out.finalize()
        os.replace(tmp, meta_path(output_prefix))
    progress.close()
    return {**meta, "outputs": [shards["tokens"], shards["mask"]], "seconds": progress.elapsed}


def documents_per_sample(fmt: str) -> int:
    """Documents the shards hold per sample: a preference pair's two sequences, else one conversation."""
    return PAIR_DOCUMENTS if fmt == PREFERENCE_FORMAT else 1


def read_meta(prefix: str) -> dict:
    path = meta_path(prefix)
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise DataError(f"{path} not found: SFT shards are written by `llama-megatron preprocess-sft`") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    version = meta.get("version") if isinstance(meta, dict) else None
    if isinstance(version, int) and version < SFT_VERSION:
        raise DataError(f"{path}: made by an older preprocess-sft (version {version}) whose masks follow another "
                        "rule; run llama-megatron preprocess-sft again")
    if version != SFT_VERSION:
        raise DataError(f"{path}: not SFT shard metadata of version {SFT_VERSION}")
    return meta
