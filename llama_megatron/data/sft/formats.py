"""The JSONL record formats of instruction and chat data, each turned into one list of chat messages.

- ``messages``: ``{"messages": [{"role": "user", "content": "..."}, ...]}`` (OpenAI / TRL style); roles system,
  user, assistant, tool; an assistant message with ``"train": false`` is context, not a target.
- ``sharegpt``: ``{"conversations": [{"from": "human", "value": "..."}, ...], "system": "..."?}``; ``from`` is
  human/user, gpt/assistant, system, tool/observation.
- ``alpaca``: ``{"instruction": ..., "input": ...?, "output": ..., "system": ...?, "history": [[q, a], ...]?}``;
  the user turn is the instruction, then a blank line and the input when there is one.
- ``prompt_completion``: ``{"prompt": ..., "completion": ..., "system": ...?}``, strings (one user and one assistant
  turn) or lists of messages (TRL's conversational form). The prompt is context and the completion the target, as
  TRL's ``completion_only_loss`` (``Conversation.prompt_length``), whatever the template marks; ``train`` flags do
  not apply.

Masking (``MASKING``): ``assistant`` (default) trains the assistant turns (prompt/completion records: the
completion), ``last`` the last of them, ``all`` every token, and ``assistant_only`` what ``assistant`` does, cut to
what the template's ``{% generation %}`` markers enclose (TRL's ``assistant_only_loss``; in prompt/completion records
the completion's marked text; ``Conversation.marked_only``).

``auto`` picks the format of each record by its keys, in that order. Messages keep their other keys (the template
may read them); ``train`` is removed before rendering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt_completion")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "observation": "tool"}
MASKING = ("assistant", "all", "last", "assistant_only")


class RecordError(ValueError):
    """A record that cannot be used; the message names what is wrong (the caller adds file:line)."""


def detect_format(record: dict) -> str:
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record:
        return "alpaca"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    raise RecordError(f"not a messages, sharegpt, alpaca or prompt/completion record "
                      f"(keys: {', '.join(map(str, record)) or 'none'})")


def _text(record: dict, key: str, optional: bool = False) -> str | None:
    value = record.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        what = "missing" if key not in record else f"a {type(value).__name__}, not a string"
        raise RecordError(f"{key!r} is {what}")
    return value


def _message(raw: Any, index: int, role_key: str, content_key: str, roles: dict[str, str]) -> dict:
    if not isinstance(raw, dict):
        raise RecordError(f"message {index} is a {type(raw).__name__}, not an object")
    role = raw.get(role_key)
    if role not in roles:
        raise RecordError(f"message {index}: unknown role {role!r} (known: {', '.join(roles)})")
    content = raw.get(content_key)
    if not isinstance(content, str):
        raise RecordError(f"message {index}: {content_key!r} must be a string")
    train = raw.get("train")
    if train is not None and not isinstance(train, bool):
        raise RecordError(f"message {index}: 'train' must be true or false")
    message = {k: v for k, v in raw.items() if k not in (role_key, content_key, "train")}
    message.update(role=roles[role], content=content)
    if train is not None:
        message["train"] = train
    return message


def _message_list(value: Any, key: str, role_key: str, content_key: str, roles: dict[str, str]) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RecordError(f"{key!r} must be a non-empty list of messages")
    return [_message(m, i, role_key, content_key, roles) for i, m in enumerate(value)]


def _with_system(record: dict, messages: list[dict]) -> list[dict]:
    system = _text(record, "system", optional=True)
    return ([{"role": "system", "content": system}] if system else []) + messages


def to_messages(record: Any, fmt: str = "auto") -> list[dict]:
    """The record's chat messages (role, content, other keys, optional ``train``); RecordError if malformed."""
    return _parse(record, fmt)[0]


def _parse(record: Any, fmt: str) -> tuple[list[dict], int | None]:
    """(messages, prompt_length): the number of prompt messages of a prompt/completion record, else None."""
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {type(record).__name__}")
    if fmt == "auto":
        fmt = detect_format(record)
    identity = {r: r for r in ROLES}
    if fmt == "messages":
        return _message_list(record.get("messages"), "messages", "role", "content", identity), None
    if fmt == "sharegpt":
        return _with_system(record, _message_list(record.get("conversations"), "conversations", "from", "value",
                                                  SHAREGPT_ROLES)), None
    if fmt == "alpaca":
        instruction, extra = _text(record, "instruction"), _text(record, "input", optional=True)
        messages = []
        history = record.get("history") or []
        if not isinstance(history, list):
            raise RecordError("'history' must be a list of [instruction, response] pairs")
        for i, pair in enumerate(history):
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
                raise RecordError(f"history entry {i} is not an [instruction, response] pair of strings")
            messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
        user = f"{instruction}\n\n{extra}" if extra else instruction
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": _text(record, "output")}]
        return _with_system(record, messages), None
    if fmt == "prompt_completion":
        prompt, completion = record.get("prompt"), record.get("completion")
        if isinstance(prompt, list) or isinstance(completion, list):
            context = _message_list(prompt, "prompt", "role", "content", identity)
            target = _message_list(completion, "completion", "role", "content", identity)
        else:
            context = [{"role": "user", "content": _text(record, "prompt")}]
            target = [{"role": "assistant", "content": _text(record, "completion")}]
        if any("train" in m for m in context + target):
            raise RecordError("'train' flags do not apply to prompt/completion records: the completion is trained, "
                              "the prompt is not (use the messages format to choose turns)")
        for m in context:  # the prompt is context: its assistant turns are not targets
            if m["role"] == "assistant":
                m["train"] = False
        messages = _with_system(record, context + target)
        return messages, len(messages) - len(target)
    raise RecordError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")


def trained_turns(messages: list[dict], masking: str) -> list[bool] | None:
    """Which messages are targets under ``masking`` (None: every token is); RecordError if none is.
    ``assistant_only`` picks the messages ``assistant`` does (the markers then cut them)."""
    if masking == "all":
        return None
    for i, m in enumerate(messages):
        if m.get("train") and m["role"] != "assistant":
            raise RecordError(f"message {i}: only assistant messages can be trained ('train' on a {m['role']} "
                              "message; masking: all trains every token)")
    flags = [m["role"] == "assistant" and m.get("train", True) for m in messages]
    if masking == "last" and any(flags):
        last = max(i for i, f in enumerate(flags) if f)
        flags = [i == last for i in range(len(flags))]
    if not any(flags):
        raise RecordError("no trained token: the record has no assistant message to train on "
                          "(every one is missing or has \"train\": false)")
    return flags


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as the chat template sees them (without our ``train`` flag)."""
    return [{k: v for k, v in m.items() if k != "train"} for m in messages]


@dataclass
class Conversation:
    """One record ready to encode: messages as the template sees them, which messages are trained (None: every
    token), for prompt/completion records how many messages the prompt has, and whether only what the template's
    generation markers enclose is trained (``masking: assistant_only``)."""

    messages: list[dict]
    trained: list[bool] | None
    prompt_length: int | None = None
    marked_only: bool = False


def parse_record(record: Any, fmt: str, masking: str) -> Conversation:
    """The record as a Conversation under ``masking``; RecordError if it is malformed or trains nothing."""
    messages, prompt_length = _parse(record, fmt)
    return Conversation(template_messages(messages), trained_turns(messages, masking), prompt_length,
                        masking == "assistant_only")
