"""SFT masks against TRL's SFTTrainer (the real package) and transformers' assistant mask, record for record.

For five template families (LLaMA-2, LLaMA-3, ChatML/Qwen, Mistral, and one whose generation prompt ends in a space
and that writes text after the end of turn) in three variants (no markers; ``{% generation %}`` around the answer
and its end of turn; around the whole turn), on twelve conversations and their prompt/completion forms:

- with markers, conversations: our ids and trained tokens equal the ``input_ids`` and ``labels`` of TRL's processed
  dataset with ``assistant_only_loss``;
- prompt/completion records: equal TRL's default ``completion_only_loss`` whatever the template marks (with
  ``eot`` markers the text after the end of turn, outside them, is trained too), and under ``masking:
  assistant_only`` TRL with ``assistant_only_loss`` as well (the intersection): multi-turn prompts stay untrained,
  a prompt ending inside a token trains that token; ``assistant_only`` on conversations equals ``assistant``, and
  is refused for a template without markers;
- without markers, conversations: equal transformers' ``assistant_masks`` of the variant marking the whole turn
  (TRL refuses unmarked templates for assistant-only loss, so transformers is the reference there);
- ``masking: last`` trains exactly the last marked turn; packed rows carry the same masks.
Whole runs against SFTTrainer's losses are in tests/test_training_sft.py.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from chat_families import FAMILIES, TOKENIZER, message_records, prompt_completion_records, write_templates

from llama_megatron.data.sft.chat_template import ChatEncoder
from llama_megatron.data.sft.dataset import SFTShards, build_sft_datasets
from llama_megatron.data.sft.formats import parse_record
from llama_megatron.data.sft.preprocess import preprocess_sft


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> dict[tuple[str, str], str]:
    return write_templates(str(tmp_path_factory.mktemp("templates")))


@pytest.fixture(scope="module")
def trl_rows(tmp_path_factory):
    """``rows(records, template_path, assistant_only_loss)``: (input_ids, labels) of TRL's processed dataset."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    logging.getLogger("trl").setLevel(logging.ERROR)  # the prefix-mismatch warning is what some cases are about
    out = str(tmp_path_factory.mktemp("trl"))
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))

    def rows(records: list[dict], template_path: str, assistant_only_loss: bool) -> list[tuple[list, list]]:
        tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
        with open(template_path, encoding="utf-8") as fh:
            tokenizer.chat_template = fh.read()
        args = SFTConfig(output_dir=out, assistant_only_loss=assistant_only_loss, max_length=None, report_to=[],
                         use_cpu=True, bf16=False, disable_tqdm=True)
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records),
                             processing_class=tokenizer)
        data = trainer.train_dataset
        return list(zip(data["input_ids"], data["labels"]))

    return rows


def _ours(encoder: ChatEncoder, record: dict, masking: str = "assistant"):
    conversation = parse_record(record, "auto", masking)
    return encoder.encode(conversation.messages, conversation.trained, conversation.prompt_length,
                          conversation.marked_only)


def _assert_same(encoded, ids: list, trained: np.ndarray, what: str) -> None:
    assert encoded.ids.tolist() == list(ids), what
    # the first token is never a target (nothing precedes it), whatever the reference says of it
    assert encoded.trained[1:].tolist() == trained[1:].astype(np.uint8).tolist(), what


@pytest.mark.parametrize("family", list(FAMILIES))
def test_masks_equal_trl(family, templates, trl_rows) -> None:
    conversations, prompt_completions = message_records(), prompt_completion_records()
    cases = [  # (variant, records, TRL's assistant_only_loss, our maskings)
        ("eot", conversations, True, ("assistant", "assistant_only")),
        ("plain", prompt_completions, False, ("assistant",)),
        ("eot", prompt_completions, False, ("assistant",)),  # TRL's default: everything after the prompt
        ("eot", prompt_completions, True, ("assistant_only",)),  # and what the markers enclose of it
    ]
    for variant, records, assistant_only, maskings in cases:
        encoder = ChatEncoder(TOKENIZER, templates[family, variant])
        rows = trl_rows(records, templates[family, variant], assistant_only)
        for masking in maskings:
            for record, (ids, labels) in zip(records, rows):
                trained = np.asarray(labels) != -100
                _assert_same(_ours(encoder, record, masking), ids, trained,
                             f"{family}-{variant}-{masking}: {record}")
    # the cases these families are here for do occur: an answer's first token straddling the generation prompt,
    # text after the end of turn that markers leave out
    encoder = ChatEncoder(TOKENIZER, templates[family, "eot"])
    jupiter = _ours(encoder, conversations[4])
    first = int(np.flatnonzero(jupiter.trained)[0])
    piece = encoder.tokenizer.convert_ids_to_tokens(int(jupiter.ids[first]))
    if family == "bot":
        assert piece == "\u2581Ju", piece
        assert jupiter.trained[-1] == 0 and encoder.tokenizer.decode(jupiter.ids[-1:]) == "\n"
        # the same answer as a prompt/completion record: the "\n" after the generation block is trained by
        # default (TRL's completion_only_loss) and not under assistant_only (with assistant_only_loss)
        record = prompt_completions[4]
        assert encoder.tokenizer.decode(_ours(encoder, record).ids[-1:]) == "\n"
        assert _ours(encoder, record).trained[-1] == 1 and _ours(encoder, record, "assistant_only").trained[-1] == 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_masks_without_markers_equal_transformers_whole_turn(family, templates) -> None:
    """The rule without markers (the text a turn adds to the render, straddling tokens included at both ends)
    equals transformers' own mask of the same template with the whole turn marked."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    plain = ChatEncoder(TOKENIZER, templates[family, "plain"])
    marked = ChatEncoder(TOKENIZER, templates[family, "turn"]).source
    for record in message_records():
        ref = tokenizer.apply_chat_template(record["messages"], chat_template=marked, return_dict=True,
                                            return_assistant_tokens_mask=True)
        _assert_same(_ours(plain, record), ref["input_ids"], np.asarray(ref["assistant_masks"]) == 1,
                     f"{family}: {record}")


def test_assistant_only_needs_markers(templates, tmp_path) -> None:
    """masking assistant_only on a template without markers: one line naming the template, at once."""
    import json

    from llama_megatron.errors import ConfigError

    plain = templates["bot", "plain"]
    with pytest.raises(ConfigError, match=r"masking assistant_only .*bot-plain\.jinja has none"):
        _ours(ChatEncoder(TOKENIZER, plain), prompt_completion_records()[0], "assistant_only")
    jsonl = tmp_path / "pc.jsonl"
    jsonl.write_text(json.dumps(prompt_completion_records()[0]) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="has none: add them, or use masking assistant$"):
        preprocess_sft([str(jsonl)], TOKENIZER, str(tmp_path / "p"), masking="assistant_only", chat_template=plain,
                       quiet=True)
    assert not list(tmp_path.glob("p_*"))


def test_masking_last_trains_the_last_marked_turn(templates) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    for family in FAMILIES:
        encoder = ChatEncoder(TOKENIZER, templates[family, "eot"])
        for record in message_records():
            ref = tokenizer.apply_chat_template(record["messages"], chat_template=encoder.source, return_dict=True,
                                                return_assistant_tokens_mask=True)
            want = np.asarray(ref["assistant_masks"])
            starts = np.flatnonzero(np.diff(np.concatenate([[0], want])) == 1)
            want[: starts[-1]] = 0
            _assert_same(_ours(encoder, record, "last"), ref["input_ids"], want == 1, f"{family}: {record}")


def test_packed_rows_carry_trl_masks(templates, trl_rows, tmp_path) -> None:
    """preprocess-sft shards of the conversations packed into rows: in its row, each sample's tokens are TRL's
    input_ids and its targets TRL's labels (the row's loss mask is shifted by one: position j predicts j + 1)."""
    import json

    records = message_records()
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    template = templates["bot", "eot"]
    prefix = str(tmp_path / "shards")
    preprocess_sft([str(jsonl)], TOKENIZER, prefix, chat_template=template, quiet=True)
    rows = trl_rows(records, template, True)
    train, _, _ = build_sft_datasets(SFTShards(prefix), "100,0,0", 200, 1, (4, 0, 0), str(tmp_path / "cache"),
                                     True, "truncate", 2, None)
    placed = 0
    for i in range(len(train)):
        item, pos = train[i], 0
        for sample in train.row_samples[train.row_offsets[i]: train.row_offsets[i + 1]]:
            ids, labels = rows[int(sample)]
            n = len(ids)
            assert item["tokens"][pos: pos + n].tolist() == ids
            assert item["loss_mask"][pos: pos + n - 1].tolist() == (np.asarray(labels[1:]) != -100).astype(int).tolist()
            pos += n
            placed += 1
    assert placed >= len(records) and train.row_offsets[1] > 1, "rows should hold several samples"
