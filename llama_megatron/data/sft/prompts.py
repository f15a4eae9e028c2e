"""Prompt records of online RL (GRPO) and their token ids, as TRL 1.16's ``GRPOTrainer`` makes them.

A record is a JSON object with a ``prompt``: a string, or a list of messages (roles as in SFT's ``messages``
format) that the chat template renders with its generation prompt; every other key is a column handed to the reward
functions (:mod:`llama_megatron.data.rewards`), such as the answer a completion is checked against. The token ids
follow ``GRPOTrainer._tokenize_prompts``: a message list is rendered and tokenised as ``apply_chat_template(...,
add_generation_prompt=True, tokenize=True)`` does (no special tokens added to the rendered text), a string is
tokenised with the tokenizer's special tokens (its BOS).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from llama_megatron.data.sft.chat_template import ChatEncoder
from llama_megatron.data.sft.formats import ROLES, RecordError, _message_list
from llama_megatron.errors import ConfigError, DataError


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: what the reward functions see as ``prompts`` (the string or the messages), its token ids and the
    record's other columns."""

    prompt: str | list[dict]
    ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)


def parse_prompt(record: Any) -> tuple[str | list[dict], dict[str, Any]]:
    """The record's prompt (a non-empty string, or its messages) and its other columns; RecordError if malformed."""
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {type(record).__name__}")
    if "prompt" not in record:
        raise RecordError("no 'prompt' (a string, or a list of messages)")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise RecordError("'prompt' is empty")
    else:
        prompt = _message_list(prompt, "prompt", "role", "content", {r: r for r in ROLES})
    return prompt, {key: value for key, value in record.items() if key != "prompt"}


def prompt_ids(encoder: ChatEncoder, prompt: str | list[dict]) -> list[int]:
    """The prompt's token ids as TRL's ``GRPOTrainer`` tokenises it (module docstring)."""
    if isinstance(prompt, str):
        return encoder.tokenize_text(prompt)
    return encoder.tokenize_rendered(encoder.render(prompt, add_generation_prompt=True))


def read_prompt_records(path: str, encoder: ChatEncoder) -> list[PromptRecord]:
    """Every record of the JSONL file ``path`` with its token ids; a DataError naming ``path:line`` for a malformed
    record (a prompt the context cannot hold beside a completion: the grpo objective's check, objectives.py)."""
    records = []
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise DataError(f"cannot open {path}: {exc.strerror}") from None
    with fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                prompt, columns = parse_prompt(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: not JSON ({exc.msg})") from None
            except RecordError as exc:
                raise DataError(f"{path}:{number}: {exc}") from None
            ids = prompt_ids(encoder, prompt)
            records.append(PromptRecord(prompt, ids, columns))
    if not records:
        raise DataError(f"{path} holds no prompt record")
    return records


@dataclass
class PromptData:
    """``data.type: "prompts"``: the prompt records of online RL (the ``grpo`` objective), one JSONL file read whole
    (and tokenised through the chat template) before any process starts: a bad record or an overlong prompt is one
    line then.

        "data": {"type": "prompts", "path": "data/grpo/arithmetic.jsonl"}
    """

    type: ClassVar[str] = "prompts"
    path: str | None = None  # the JSONL of prompt records
    chat_template: str | None = None  # a Jinja file; default: the tokenizer's chat_template
    _records: list[PromptRecord] | None = field(default=None, init=False, repr=False, compare=False)

    per_document_attention: ClassVar[bool] = False

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **{k: v for k, v in (("path", self.path), ("chat_template", self.chat_template))
                                      if v is not None}}

    def validate(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError("data.type prompts needs data.path: a JSONL of prompt records")
        if not os.path.isfile(self.path):
            raise ConfigError(f"data.path {self.path!r} not found (cwd {os.getcwd()})")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ConfigError(f"data.chat_template {self.chat_template!r} not found (cwd {os.getcwd()})")

    def prepare(self, tokenizer: str | None) -> None:
        if self._records is None:
            self._records = read_prompt_records(self.path, ChatEncoder(tokenizer, self.chat_template))

    @property
    def records(self) -> list[PromptRecord]:
        if self._records is None:
            raise RuntimeError("PromptData.prepare(tokenizer) must run before its records are read")
        return self._records

    def check(self, vocab_size: int, need_validation: bool) -> None:
        for number, record in enumerate(self.records, start=1):
            if max(record.ids, default=0) >= vocab_size or min(record.ids, default=0) < 0:
                raise ConfigError(f"{self.path}: prompt {number} has token ids outside the model's vocabulary of "
                                  f"{vocab_size}")
        if need_validation:
            raise ConfigError("data.type prompts has no validation split (online RL scores its own rollouts): set "
                              "eval.interval 0")

    def build(self, seq_length: int, seed: int, num_samples: tuple[int, int, int], vocab_size: int,
              eod_id: int | None) -> tuple:
        return self.records, None, None

    def files(self) -> list[str]:
        return [self.path] + ([self.chat_template] if self.chat_template else [])
