"""Preference records (TRL's formats) and their two token sequences, as TRL 1.16's ``DPOTrainer`` makes them.

A record is a JSON object in one of TRL's preference formats:

- explicit prompt: ``{"prompt": ..., "chosen": ..., "rejected": ...}``, three strings, or three message lists
  (``[{"role": ..., "content": ...}, ...]``, roles as in SFT's ``messages`` format);
- implicit prompt: ``{"chosen": ..., "rejected": ...}``, whose shared beginning is the prompt (TRL's
  ``extract_prompt``: the messages, or for strings the characters, before the first difference, a space before it
  left to the completions).

Each record becomes two sequences, prompt + chosen and prompt + rejected, and the completion mask of each, by TRL's
rule (``DPOTrainer._prepare_dataset``): string records get the tokenizer's EOS text appended to each completion that
does not end with it and are tokenised with the tokenizer's special tokens (its BOS); message records are rendered
by the chat template, the prompt alone with the generation prompt, and tokenised as ``apply_chat_template`` does.
The completion starts at the shorter of the common prefixes of the tokenised prompt with the two tokenised whole
sequences (so a template that renders the prompt differently alone, or tokens that merge across the boundary,
move the start as TRL moves it). Where ours differs: a completion that is empty (``""`` or ``[]``) or tokenises to
nothing is a bad record (TRL trains on it as a pair with no completion tokens, a loss with no signal), as is a
record mixing strings and message lists (TRL's format check reads one key at random).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from llama_megatron.data.sft.chat_template import ChatEncoder, Encoded, common_prefix_length
from llama_megatron.data.sft.formats import ROLES, RecordError, _message_list

# the data kind of preference shards (preprocess-sft's --format, the shards' metadata)
PREFERENCE_FORMAT = "preference"
# a preference sample's documents in the shards: the chosen sequence, then the rejected one
PAIR_DOCUMENTS = 2


@dataclass
class PreferenceRecord:
    """A record with its prompt made explicit: three strings, or three message lists."""

    prompt: str | list[dict]
    chosen: str | list[dict]
    rejected: str | list[dict]

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)


def _field(record: dict, key: str, conversational: bool) -> str | list[dict]:
    if key not in record:
        raise RecordError(f"{key!r} is missing (a preference record has chosen and rejected, and optionally prompt)")
    value = record[key]
    if conversational:
        if not isinstance(value, list):
            raise RecordError(f"{key!r} is a {type(value).__name__}, but 'chosen' is a message list: prompt, chosen "
                              "and rejected must all be strings or all message lists")
        if not value and key == "prompt":
            return []
        messages = _message_list(value, key, "role", "content", {r: r for r in ROLES})
        if any("train" in m for m in messages):
            raise RecordError(f"{key!r}: 'train' flags do not apply to preference records (the completions are "
                              "trained, the prompt is not)")
        return messages
    if not isinstance(value, str):
        raise RecordError(f"{key!r} is a {type(value).__name__}, but 'chosen' is a string: prompt, chosen and "
                          "rejected must all be strings or all message lists")
    return value


def extract_prompt(chosen: str | list, rejected: str | list) -> tuple:
    """TRL's ``extract_prompt``: (prompt, chosen, rejected) cut at the first element where chosen and rejected
    differ, one back if the element before it is a space (the space stays with the completions). When one is a prefix
    of the other the cut is one before the shorter one's end, as TRL's loop leaves its index there."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def parse_preference(record: Any) -> PreferenceRecord:
    """The record with an explicit prompt; RecordError if it is malformed or a completion is empty."""
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {type(record).__name__}")
    if "chosen" not in record or "rejected" not in record:
        missing = "chosen" if "chosen" not in record else "rejected"
        raise RecordError(f"{missing!r} is missing (a preference record has chosen and rejected, and optionally "
                          f"prompt; keys: {', '.join(map(str, record)) or 'none'})")
    conversational = isinstance(record["chosen"], list)
    chosen, rejected = (_field(record, k, conversational) for k in ("chosen", "rejected"))
    if chosen == rejected:
        raise RecordError("chosen and rejected are the same: a pair prefers one answer to another")
    if "prompt" in record:
        prompt = _field(record, "prompt", conversational)
    else:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if not value:
            raise RecordError(f"the {key} completion is empty" + ("" if "prompt" in record else
                                                                 " once the shared prompt is taken off"))
    return PreferenceRecord(prompt, chosen, rejected)


def encode_preference(pair: PreferenceRecord, encoder: ChatEncoder) -> tuple[Encoded, Encoded]:
    """The chosen and the rejected sequence (prompt + completion), each with its completion mask (1 from the
    completion's first token; never the first token of the sequence); RecordError if a completion has no token."""
    if pair.conversational:
        tokenize = encoder.tokenize_rendered
        prompt_ids = tokenize(encoder.render(pair.prompt, add_generation_prompt=True))
        sequences = [tokenize(encoder.render(pair.prompt + completion)) for completion in (pair.chosen, pair.rejected)]
    else:
        eos = encoder.tokenizer.eos_token or ""
        prompt_ids = encoder.tokenize_text(pair.prompt)
        sequences = [encoder.tokenize_text(pair.prompt + (c if c.endswith(eos) else c + eos))
                     for c in (pair.chosen, pair.rejected)]
    start = min(common_prefix_length(prompt_ids, ids) for ids in sequences)
    encoded = []
    for name, ids in zip(("chosen", "rejected"), sequences):
        mask = np.zeros(len(ids), dtype=np.uint8)
        mask[max(start, 1):] = 1  # the first token has no context to predict it from
        if not mask.any():
            raise RecordError(f"the {name} completion tokenises to no token after the prompt")
        encoded.append(Encoded(np.asarray(ids, dtype=np.int64), mask))
    return encoded[0], encoded[1]
