"""Train a LLaMA-style sentencepiece BPE from the same inputs as ``preprocess`` (the ``train-tokenizer`` verb).

LLaMA-1/2 trainer settings: BPE, byte fallback (no <unk> on unseen characters), digits split one per piece,
unk/bos/eos = 0/1/2, no pad piece, no normalisation (identity, whitespace kept), a dummy "▁" prefix.
Writes ``OUT/tokenizer.model`` plus a ``tokenizer_config.json`` so ``transformers.AutoTokenizer`` loads the
directory too.
"""

from __future__ import annotations

import argparse
import io
import json
import os
from collections.abc import Iterator

from llama_megatron.data.readers import decode_chunk, iter_chunks
from llama_megatron.errors import DataError

# sentencepiece drops longer "sentences"; LLaMA used 4192 bytes.
MAX_SENTENCE_BYTES = 4192
# Printable ASCII always gets its own piece, even when rare in the corpus (digits 3-9 are rare in Shakespeare);
# everything else unseen falls back to bytes.
REQUIRED_CHARS = "".join(chr(c) for c in range(33, 127))


def _sentences(args: argparse.Namespace) -> Iterator[str]:
    """Non-empty lines of every document: sentencepiece trains on lines, and a scene is far too long for one."""
    for chunk in iter_chunks(
        args.input, args.input_format, args.json_keys, 1 << 20, args.text_unit, args.hf_split
    ):
        texts, bad = decode_chunk(chunk, args.json_keys)
        if bad:
            raise DataError(bad[0])
        for key_texts in texts.values():
            for doc in key_texts:
                for line in doc.split("\n"):
                    if line.strip():
                        yield line


def train(args: argparse.Namespace) -> str:
    import sentencepiece as spm

    model_path = os.path.join(args.output_dir, "tokenizer.model")
    if os.path.exists(model_path) and not args.overwrite:
        raise DataError(f"{model_path} exists; pass --overwrite to replace it")
    if not 260 <= args.vocab_size <= 1 << 20:
        raise DataError(f"--vocab-size {args.vocab_size} must cover 256 byte pieces plus specials (>= 260)")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(args),
            model_writer=model,
            model_type="bpe",
            vocab_size=args.vocab_size,
            character_coverage=args.character_coverage,
            byte_fallback=True,
            split_digits=True,
            split_by_unicode_script=True,
            split_by_whitespace=True,
            allow_whitespace_only_pieces=True,
            add_dummy_prefix=True,
            remove_extra_whitespaces=False,
            normalization_rule_name="identity",
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            required_chars=REQUIRED_CHARS,
            max_sentence_length=MAX_SENTENCE_BYTES,
            input_sentence_size=args.max_sentences,
            shuffle_input_sentence=True,
            num_threads=args.threads,
            minloglevel=2,
        )
    except RuntimeError as exc:  # e.g. "Vocabulary size too high" on a small corpus
        raise DataError(f"sentencepiece training failed: {exc}") from None
    os.makedirs(args.output_dir, exist_ok=True)
    tmp = model_path + f".tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp, model_path)
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 4096,
    }
    with open(os.path.join(args.output_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return model_path
