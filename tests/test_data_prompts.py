"""Prompt records of online RL (llama_megatron/data/sft/prompts.py) against TRL 1.16's ``GRPOTrainer``: the token
ids of the shipped chat set's prompts, as message lists and as strings, equal to what its own
``_tokenize_prompts`` makes with the same tokenizer and chat template (a stand-in trainer object carries the
settings it reads); the other columns kept for the rewards; every malformed record one line naming file:line. One
process."""

from __future__ import annotations

import json
import os
import types

import pytest
from trl.trainer.grpo_trainer import GRPOTrainer

from llama_megatron.data.sft.chat_template import ChatEncoder, load_hf_tokenizer
from llama_megatron.data.sft.prompts import parse_prompt, read_prompt_records
from llama_megatron.errors import DataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "data", "tokenizer")


def _trl_prompt_ids(prompts: list) -> list[list[int]]:
    trainer = types.SimpleNamespace(processing_class=load_hf_tokenizer(TOKENIZER), _is_vlm=False,
                                    environment_factories=None, tools=None, chat_template=None,
                                    chat_template_kwargs={})
    ids, _, _ = GRPOTrainer._tokenize_prompts(trainer, prompts)
    return [list(row) for row in ids]


def test_prompt_ids_are_trl_grpo_trainers(tmp_path) -> None:
    with open(os.path.join(ROOT, "data", "chat", "chat_prompt_completion.jsonl"), encoding="utf-8") as fh:
        shipped = [json.loads(line) for line in fh][:12]
    as_messages = [{"prompt": ([{"role": "system", "content": r["system"]}] if r.get("system") else [])
                    + [{"role": "user", "content": r["prompt"]}], "answer": r["completion"]} for r in shipped]
    as_strings = [{"prompt": r["prompt"], "answer": r["completion"], "id": i} for i, r in enumerate(shipped)]
    encoder = ChatEncoder(TOKENIZER)
    for name, records in (("messages", as_messages), ("strings", as_strings)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        got = read_prompt_records(str(path), encoder)
        assert [r.ids for r in got] == _trl_prompt_ids([r["prompt"] for r in records]), name
        assert [r.prompt for r in got] == [r["prompt"] for r in records]
        assert [r.columns for r in got] == [{k: v for k, v in r.items() if k != "prompt"} for r in records]


@pytest.mark.parametrize("line, message", [
    ('{"question": "2 + 2?"}', "no 'prompt'"),
    ('{"prompt": ""}', "'prompt' is empty"),
    ('{"prompt": []}', "'prompt' must be a non-empty list of messages"),
    ('{"prompt": [{"role": "wizard", "content": "hi"}]}', "wizard"),
    ('["a", "b"]', "expected a JSON object, got list"),
    ('{"prompt": "unterminated', "not JSON"),
])
def test_a_malformed_prompt_record_is_one_line_naming_its_place(line, message, tmp_path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=f"prompts.jsonl:3: .*{message}") as caught:
        read_prompt_records(str(path), ChatEncoder(TOKENIZER))
    assert "\n" not in str(caught.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match="holds no prompt record"):
        read_prompt_records(str(empty), ChatEncoder(TOKENIZER))


def test_the_recipe_prompts_are_what_their_builder_writes(tmp_path) -> None:
    """data/grpo/numbers.jsonl (the CPU GRPO recipe's) is scripts/make_grpo_data.py's output, record for record, and
    every record reads as a prompt with its answer column."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shipped = os.path.join(root, "data", "grpo", "numbers.jsonl")
    sys.path.insert(0, os.path.join(root, "scripts"))
    try:
        import make_grpo_data
    finally:
        sys.path.pop(0)
    with open(shipped, encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    assert records == make_grpo_data.records() and len(records) == 40
    assert all(parse_prompt(r)[1] == {"answer": r["answer"]} for r in records)
