"""Preference data (``data.type: "preference"``): records in TRL's four preference formats made into the token ids
and completion masks TRL 1.16's ``DPOTrainer`` trains on, record for record, through our whole path (JSONL ->
cached shards -> padded or packed rows -> micro batches), for three template families, both truncation modes and
TRL's rule that drops pairs whose prompt fills ``max_length``; bad records; the config's checks.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch
from chat_families import OTHER_ANSWER, TOKENIZER, message_records, preference_records, write_templates

from llama_megatron.data.batch import collate
from llama_megatron.data.config import data_config_from_dict
from llama_megatron.data.sft.formats import RecordError
from llama_megatron.data.sft.preference_formats import extract_prompt, parse_preference
from llama_megatron.data.sft.preprocess import preprocess_sft
from llama_megatron.errors import ConfigError, DataError
from llama_megatron.parallel.cross_entropy import IGNORE_INDEX

FAMILY_CASES = ("llama3", "chatml", "mistral")


def explicit(records: list[dict]) -> list[dict]:
    """The same pairs with the prompt given (TRL's explicit-prompt form)."""
    return [dict(zip(("prompt", "chosen", "rejected"), extract_prompt(r["chosen"], r["rejected"]))) for r in records]


def string_records() -> list[dict]:
    """Explicit-prompt string pairs from the same conversations (one chosen already ends with the EOS text)."""
    records = []
    for i, r in enumerate(message_records()):
        prompt, answer = r["messages"][-2]["content"], r["messages"][-1]["content"]
        records.append({"prompt": prompt, "chosen": " " + answer + ("</s>" if i == 3 else ""),
                        "rejected": " " + OTHER_ANSWER})
    return records


def implicit_strings(records: list[dict]) -> list[dict]:
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in records]


FORMATS = {"messages-implicit": lambda: preference_records(),
           "messages-explicit": lambda: explicit(preference_records()),
           "strings-explicit": string_records,
           "strings-implicit": lambda: implicit_strings(string_records())}


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> dict[tuple[str, str], str]:
    return write_templates(str(tmp_path_factory.mktemp("templates")))


@pytest.fixture(scope="module")
def trl_rows(tmp_path_factory):
    """``rows(records, template, max_length, truncation_mode)``: TRL's collated (ids, completion mask) of each kept
    record, by record index."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    logging.getLogger("trl").setLevel(logging.ERROR)
    out = str(tmp_path_factory.mktemp("trl"))
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    reference = LlamaForCausalLM(model.config)

    made: dict[str, dict] = {}  # the padded and the packed case compare with the same rows

    def rows(records: list[dict], template: str | None, max_length: int,
             truncation_mode: str) -> dict[int, list[tuple[list, list]]]:
        key = json.dumps([records, template, max_length, truncation_mode])
        if key not in made:
            made[key] = _rows(records, template, max_length, truncation_mode)
        return made[key]

    def _rows(records: list[dict], template: str | None, max_length: int,
              truncation_mode: str) -> dict[int, list[tuple[list, list]]]:
        tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
        if template:
            with open(template, encoding="utf-8") as fh:
                tokenizer.chat_template = fh.read()
        indexed = [{**r, "index": i} for i, r in enumerate(records)]
        args = DPOConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False, disable_tqdm=True,
                         max_length=max_length, truncation_mode=truncation_mode, remove_unused_columns=False)
        trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=Dataset.from_list(indexed),
                             processing_class=tokenizer)
        data = trainer.train_dataset
        found = {}
        for i in range(len(data)):
            batch = trainer.data_collator([data[i]])
            found[data[i]["index"]] = [(ids[mask.bool()].tolist(), completion[mask.bool()].tolist())
                                       for ids, mask, completion in zip(batch["input_ids"], batch["attention_mask"],
                                                                        batch["completion_mask"])]
        return found

    return rows


def _write(path, records: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return str(path)


def _our_rows(tmp_path, records: list[dict], template: str | None, pack: bool, max_length: int,
              truncation_mode: str) -> dict[int, list[tuple[list, list]]]:
    """Our (ids, completion mask) of each kept record's two sequences, read back from the micro batches."""
    seq_length = 2 * max_length - 1 if pack else max_length - 1
    tmp_path.mkdir(parents=True, exist_ok=True)
    section = {"type": "preference", "path": _write(tmp_path / "pairs.jsonl", records), "split": "100,0,0",
               "pack": pack, "max_length": max_length, "truncation_mode": truncation_mode,
               "cache_dir": str(tmp_path / "cache"), "workers": 1}
    if template:
        section["chat_template"] = template
    data = data_config_from_dict(section)
    data.validate()
    data.prepare(TOKENIZER)
    data.check(4100, False)
    train, _, _ = data.build(seq_length, 7, (2 * len(records), 0, 0), 4100, None)
    items = [train[i] for i in range(train.stats["rows_per_epoch"])]
    found: dict[int, list] = {}
    for lo in range(0, len(items), 3):  # micro batches of three items
        batch = collate(items[lo: lo + 3])
        tokens = torch.cat([batch.input_ids, batch.labels[:, -1:]], dim=1)  # labels' last: the row's last token
        for k, pair in enumerate(batch.pair_ids.tolist()):
            sequences = []
            for s in (2 * k, 2 * k + 1):
                row, cols = (batch.sequence_ids == s).nonzero(as_tuple=True)
                assert row.unique().numel() == 1, "a sequence spans rows"
                row, first, last = int(row[0]), int(cols[0]), int(cols[-1])
                ids = batch.input_ids[row, first: last + 1].tolist() + [int(tokens[row, last + 1])]
                if batch.segment_ids is not None:
                    assert batch.position_ids[row, first] == 0 and len(set(
                        batch.segment_ids[row, first: last + 1].tolist())) == 1, "a sequence is not one document"
                trained = (batch.labels[row, first: last + 1] != IGNORE_INDEX).long().tolist()
                sequences.append((ids, [0] + trained))
            found[pair] = sequences
    return found


def _assert_equal(ours: dict, theirs: dict, what: str) -> None:
    assert sorted(ours) == sorted(theirs), f"{what}: kept records differ"
    for index, pair in theirs.items():
        for (our_ids, our_mask), (ids, mask), name in zip(ours[index], pair, ("chosen", "rejected")):
            assert our_ids == ids, f"{what}: record {index} {name} ids"
            # the first token is never a target (nothing precedes it to predict it from)
            assert our_mask[1:] == mask[1:], f"{what}: record {index} {name} completion mask"


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_sequences_equal_trl(fmt, pack, templates, trl_rows, tmp_path) -> None:
    records = FORMATS[fmt]()
    families = FAMILY_CASES if fmt.startswith("messages") else (None,)
    for family in families:
        template = templates[family, "plain"] if family else None
        whole = trl_rows(records, template, 4096, "keep_start")
        _assert_equal(_our_rows(tmp_path / f"{family}-whole", records, template, pack, 4096, "keep_start"), whole,
                      f"{fmt} {family}")
        # a max_length one past the median prompt: the longer half of the prompts fill it (those pairs are dropped),
        # the other pairs are cut inside their completions
        prompts = sorted(pair[0][1].index(1) for pair in whole.values())
        max_length = prompts[len(prompts) // 2] + 1
        theirs = trl_rows(records, template, max_length, "keep_start")
        assert 0 < len(theirs) < len(records), "the case should drop some pairs and keep others"
        assert any(len(pair[0][0]) < len(whole[i][0][0]) for i, pair in theirs.items()), "no kept pair is cut"
        ours = _our_rows(tmp_path / f"{family}-{max_length}", records, template, pack, max_length, "keep_start")
        _assert_equal(ours, theirs, f"{fmt} {family} max_length {max_length}")


def test_keep_end_equals_trl(templates, trl_rows, tmp_path) -> None:
    records = preference_records()
    template = templates["chatml", "plain"]
    theirs = trl_rows(records, template, 20, "keep_end")
    assert len(theirs) == len(records)
    for pack in (False, True):
        _assert_equal(_our_rows(tmp_path / str(pack), records, template, pack, 20, "keep_end"), theirs,
                      f"keep_end pack {pack}")


def test_extract_prompt_is_trls() -> None:
    pytest.importorskip("trl")
    from trl.data_utils import extract_prompt as trl_extract

    cases = [("The sky is blue.", "The sky is green."), ("Same", "Same but longer"), ("ab", "cd"),
             ("x ", "y "), *[(r["chosen"], r["rejected"]) for r in preference_records()[:3]]]
    for chosen, rejected in cases:
        expected = trl_extract({"chosen": chosen, "rejected": rejected})
        assert dict(zip(("prompt", "chosen", "rejected"), extract_prompt(chosen, rejected))) == expected


@pytest.mark.parametrize("record, message", [
    ({"prompt": "p", "chosen": "c"}, "'rejected' is missing"),
    ({"prompt": "p", "chosen": "", "rejected": "r"}, "the chosen completion is empty"),
    ({"chosen": "same", "rejected": "same"}, "chosen and rejected are the same"),
    ({"prompt": "p ", "chosen": [{"role": "assistant", "content": "c"}],
      "rejected": [{"role": "assistant", "content": "r"}]}, "'prompt' is a str, but 'chosen' is a message list"),
    ({"chosen": "", "rejected": "x"}, "the chosen completion is empty once the shared prompt"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": "c", "rejected": "r"}, "must all be strings or all"),
    ({"prompt": "p", "chosen": [{"role": "assistant", "content": "c"}], "rejected": "r"}, "must all be strings"),
    ({"chosen": [{"role": "robot", "content": "c"}], "rejected": []}, "unknown role 'robot'"),
    ({"prompt": [], "chosen": [{"role": "assistant", "content": "c", "train": False}],
      "rejected": [{"role": "assistant", "content": "r"}]}, "'train' flags do not apply"),
    (["not", "an", "object"], "expected a JSON object"),
])
def test_bad_records_say_why(record, message) -> None:
    with pytest.raises(RecordError, match=message):
        parse_preference(record)


def test_bad_records_stop_preprocessing_with_file_and_line(tmp_path, templates) -> None:
    good = explicit(preference_records())[:2]
    raising = tmp_path / "raise.jinja"
    raising.write_text("{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('no boom') }}"
                       "{% endif %}{{ m['content'] }}{% endfor %}")
    path = _write(tmp_path / "pairs.jsonl", [good[0], {"prompt": "p", "chosen": "c"}, good[1],
                                             {**good[1], "rejected": [{"role": "assistant", "content": "boom"}]}])
    out = str(tmp_path / "out" / "pairs")
    with pytest.raises(DataError, match=r"pairs\.jsonl:2: 'rejected' is missing"):
        preprocess_sft([path], TOKENIZER, out, "preference", quiet=True, chat_template=str(raising))
    assert not os.path.exists(os.path.dirname(out)) or not os.listdir(os.path.dirname(out)), "nothing is written"
    stats = preprocess_sft([path], TOKENIZER, out, "preference", quiet=True, chat_template=str(raising),
                           skip_bad=True)
    assert (stats["samples"], stats["skipped_records"], stats["documents_per_sample"]) == (2, 2, 2)


def test_the_config_checks_its_keys_and_its_shards(tmp_path) -> None:
    records = _write(tmp_path / "pairs.jsonl", string_records())
    for section, message in [
        ({"truncation_mode": "keep_middle"}, "data.truncation_mode 'keep_middle'"),
        ({"max_length": 1}, "data.max_length must be an integer >= 2"),
        ({"masking": "all"}, "unknown keys for data.type 'preference': masking"),
    ]:
        with pytest.raises(ConfigError, match=message):
            data_config_from_dict({"type": "preference", "path": records, **section}).validate()
    sft = str(tmp_path / "sft" / "chat")
    preprocess_sft([_write(tmp_path / "chat.jsonl", message_records())], TOKENIZER, sft, quiet=True)
    with pytest.raises(ConfigError, match="holds SFT samples, not preference pairs"):
        data_config_from_dict({"type": "preference", "prefix": sft}).validate()
    pairs = str(tmp_path / "pref" / "pairs")
    preprocess_sft([records], TOKENIZER, pairs, "preference", quiet=True)
    with pytest.raises(ConfigError, match="holds preference pairs: train on them with data.type preference"):
        data_config_from_dict({"type": "sft", "prefix": pairs}).validate()
    data = data_config_from_dict({"type": "preference", "prefix": pairs, "pack": True, "max_length": 40,
                                  "split": "100,0,0"})
    data.validate()
    data.prepare(TOKENIZER)
    with pytest.raises(ConfigError, match="data.max_length 40 does not fit rows of seq_length \\+ 1 = 64 tokens twice"):
        data.build(63, 1, (4, 0, 0), 4100, None)


@pytest.mark.launched
def test_micro_batches_number_pairs_across_items(tmp_path) -> None:
    """Pair k of a micro batch owns sequences 2k (chosen) and 2k + 1 (rejected), padded or packed."""
    records = _write(tmp_path / "pairs.jsonl", string_records())
    for pack in (False, True):
        data = data_config_from_dict({"type": "preference", "path": records, "pack": pack, "split": "100,0,0",
                                      "cache_dir": str(tmp_path / "cache")})
        data.prepare(TOKENIZER)
        train, _, _ = data.build(127, 3, (8, 0, 0), 4100, None)
        batch = collate([train[i] for i in range(4)])
        pairs = batch.pair_ids.numel()
        assert sorted(set(batch.sequence_ids.unique().tolist()) - {-1}) == list(range(2 * pairs))
        if not pack:
            assert batch.input_ids.shape[0] == 2 * pairs == 8
        trained = batch.labels != IGNORE_INDEX
        assert (batch.sequence_ids[trained] >= 0).all(), "a trained label outside every sequence"
        assert np.array_equal(np.unique(batch.pair_ids.numpy()).size, pairs), "a pair twice in one micro batch"
