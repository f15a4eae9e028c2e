"""SFT data: formats, chat-template rendering and masks against transformers, shards, padding, packing, bad input.

The reference is ``tokenizer.apply_chat_template`` of transformers on the same messages: our rendered text and ids
must equal it, and our trained tokens must equal the ``assistant_masks`` transformers itself computes for a template
whose assistant turns are wrapped in ``{% generation %}`` (an independent way of locating them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from chat_families import template
from launch_utils import ROOT, run_command

from llama_megatron.cli import main as cli_main
from llama_megatron.data.batch import collate
from llama_megatron.data.sft.chat_template import ChatEncoder
from llama_megatron.data.sft.config import SFTData
from llama_megatron.data.sft.dataset import SFTShards, build_sft_datasets
from llama_megatron.data.sft.formats import RecordError, template_messages, to_messages, trained_turns
from llama_megatron.data.sft.packing import first_fit, pack_rows
from llama_megatron.data.sft.preprocess import preprocess_sft
from llama_megatron.errors import ConfigError, DataError

TOKENIZER = os.path.join(ROOT, "data", "tokenizer")
CHAT = Path(ROOT) / "data" / "chat"
FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion")
SHIPPED = (Path(TOKENIZER) / "chat_template.jinja").read_text(encoding="utf-8")
ASSISTANT_TURN = "{{- ' ' ~ (message['content'] | trim) ~ ' ' ~ eos_token -}}"
def shipped_tagged() -> str:
    assert ASSISTANT_TURN in SHIPPED
    return SHIPPED.replace(ASSISTANT_TURN, "{%- generation -%}" + ASSISTANT_TURN + "{%- endgeneration -%}")


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("templates")
    paths = {}
    for name, text in (("shipped", shipped_tagged()), ("chatml", template("chatml", "turn")),
                       ("llama3", template("llama3", "turn"))):
        paths[name] = str(out / f"{name}.jinja")
        Path(paths[name]).write_text(text, encoding="utf-8")
    return paths


def read_jsonl(path: Path, limit: int | None = None) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in list(fh)[:limit]]


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_formats_give_the_same_messages() -> None:
    system = {"role": "system", "content": "Be brief."}
    user, assistant = {"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}
    records = {
        "messages": {"messages": [system, user, assistant]},
        "sharegpt": {"system": "Be brief.", "conversations": [{"from": "human", "value": "Q?"},
                                                               {"from": "gpt", "value": "A."}]},
        "alpaca": {"system": "Be brief.", "instruction": "Q?", "input": "", "output": "A."},
        "prompt_completion": {"system": "Be brief.", "prompt": "Q?", "completion": "A."},
    }
    for fmt, record in records.items():
        assert to_messages(record) == to_messages(record, fmt) == [system, user, assistant], fmt
    alpaca = to_messages({"instruction": "Add.", "input": "2 and 3", "output": "5", "history": [["Hi", "Hello"]]})
    assert [m["content"] for m in alpaca] == ["Hi", "Hello", "Add.\n\n2 and 3", "5"]
    conversational = to_messages({"prompt": [user, assistant, user], "completion": [assistant]})
    assert trained_turns(conversational, "assistant") == [False, False, False, True]  # the prompt is context


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "narrator", "content": "x"}]}, "message 0: unknown role 'narrator'"),
    ({"conversations": [{"from": "human", "value": 3}]}, "'value' must be a string"),
    ({"text": "plain"}, "not a messages, sharegpt, alpaca or prompt/completion record (keys: text)"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"instruction": "x"}, "'output' is missing"),
    ({"messages": [{"role": "user", "content": "x", "train": "yes"}]}, "'train' must be true or false"),
])
def test_malformed_records(record, message) -> None:
    with pytest.raises(RecordError, match=message.replace("(", r"\(").replace(")", r"\)")):
        to_messages(record)


def test_masking_modes_and_train_flag() -> None:
    conv = to_messages({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                     {"role": "user", "content": "c"},
                                     {"role": "assistant", "content": "d", "train": False},
                                     {"role": "user", "content": "e"}, {"role": "assistant", "content": "f"}]})
    assert trained_turns(conv, "assistant") == [False, True, False, False, False, True]
    assert trained_turns(conv, "last") == [False, False, False, False, False, True]
    assert trained_turns(conv, "all") is None
    with pytest.raises(RecordError, match="no trained token"):
        trained_turns(conv[:4][:1] + [{"role": "assistant", "content": "x", "train": False}], "assistant")
    with pytest.raises(RecordError, match="only assistant messages can be trained"):
        trained_turns([{"role": "user", "content": "x", "train": True}], "assistant")


@pytest.mark.parametrize("fmt", FORMATS)
def test_rendering_and_masks_equal_transformers(fmt, hf_tok, templates) -> None:
    """Per format (the shipped chat set) and template: text and ids equal apply_chat_template; trained tokens equal
    transformers' own assistant mask; with the shipped template each trained run decodes to the assistant's content
    plus " </s>" (its end of turn)."""
    records = read_jsonl(CHAT / f"chat_{fmt}.jsonl", 60)
    for name, path in templates.items():
        encoder = ChatEncoder(TOKENIZER, path)
        for record in records:
            messages = to_messages(record, fmt)
            plain = template_messages(messages)
            assert encoder.render(plain) == hf_tok.apply_chat_template(plain, tokenize=False, chat_template=encoder.source)
            ref = hf_tok.apply_chat_template(plain, chat_template=encoder.source, return_dict=True,
                                             return_assistant_tokens_mask=True)
            encoded = encoder.encode(plain, trained_turns(messages, "assistant"))
            assert encoded.ids.tolist() == ref["input_ids"], (name, record)
            want = np.asarray(ref["assistant_masks"])
            if fmt == "prompt_completion" and isinstance(record["prompt"], list):
                # TRL's conversational prompt is context: only the completion's turn is trained
                last = np.flatnonzero(np.diff(np.concatenate([[0], want])) == 1)[-1]
                want[:last] = 0
            assert encoded.trained.tolist() == want.tolist(), (name, record)
    encoder = ChatEncoder(TOKENIZER)  # the shipped template, as the tokenizer directory holds it
    assert encoder.source == SHIPPED == hf_tok.chat_template
    for record in records:
        messages = to_messages(record, fmt)
        encoded = encoder.encode(template_messages(messages), trained_turns(messages, "assistant"))
        runs = np.split(encoded.ids, np.flatnonzero(np.diff(encoded.trained.astype(int)) != 0) + 1)
        trained_runs = [hf_tok.decode(run) for run, flag in zip(runs, _run_flags(encoded.trained)) if flag]
        targets = [m["content"] + " </s>" for m, t in zip(messages, trained_turns(messages, "assistant")) if t]
        assert trained_runs == targets, record


def _run_flags(mask: np.ndarray) -> list[bool]:
    """The value of each run of equal values in ``mask``."""
    starts = np.concatenate([[0], np.flatnonzero(np.diff(mask.astype(int)) != 0) + 1])
    return [bool(mask[s]) for s in starts]


def test_the_four_shipped_files_make_the_same_samples(tmp_path) -> None:
    """The shipped set holds the same conversations in each format: identical tokens, and identical masks when
    only the last turn is trained (the conversational prompt/completion form keeps earlier turns as context)."""
    shards = {}
    for fmt in FORMATS:
        prefix = str(tmp_path / fmt)
        preprocess_sft([str(CHAT / f"chat_{fmt}.jsonl")], TOKENIZER, prefix, fmt, "last", quiet=True)
        shards[fmt] = SFTShards(prefix)
    ref = shards["messages"]
    assert len(ref) == 372
    for fmt, other in shards.items():
        assert np.array_equal(other.tokens.tokens, ref.tokens.tokens), fmt
        assert np.array_equal(other.mask.tokens, ref.mask.tokens), fmt
        assert np.array_equal(other.sizes, ref.sizes), fmt


@pytest.mark.launched
def test_build_chat_script_reproduces_the_shipped_files(tmp_path) -> None:
    subprocess.run([sys.executable, str(CHAT / "build_chat.py"), str(tmp_path)], check=True, capture_output=True)
    for fmt in (*FORMATS, "preference"):
        assert (tmp_path / f"chat_{fmt}.jsonl").read_bytes() == (CHAT / f"chat_{fmt}.jsonl").read_bytes(), fmt
    provenance = (CHAT / "README.md").read_text(encoding="utf-8")
    assert "build_chat.py" in provenance and "public domain" in provenance.lower()


@pytest.mark.launched
def test_workers_write_identical_shards(tmp_path) -> None:
    src = [str(CHAT / "chat_sharegpt.jsonl")]
    for workers in (1, 2):  # 4 KiB chunks: many chunks, so the order of results matters
        preprocess_sft(src, TOKENIZER, str(tmp_path / f"w{workers}"), workers=workers, quiet=True, chunk_bytes=4096)
    for name in ("_tokens.bin", "_tokens.idx", "_mask.bin", "_mask.idx"):
        assert (tmp_path / f"w1{name}").read_bytes() == (tmp_path / f"w2{name}").read_bytes(), name


def test_first_fit_packing() -> None:
    # 5 -> row 0; 3 -> row 0 (full); 4 -> row 1; 2 -> row 1; 1 -> row 1 (7 of 8); 6 -> row 2
    assert first_fit(np.array([5, 3, 4, 2, 1, 6]), 8).tolist() == [0, 0, 1, 1, 1, 2]
    offsets, samples = pack_rows(np.array([10, 11, 12, 13, 14, 15]), np.arange(16) % 8 + 1, 8, window=3)
    # lengths 3,4,5 | 6,7,8: windows never share a row
    assert offsets.tolist() == [0, 2, 3, 4, 5, 6] and samples.tolist() == [10, 11, 12, 13, 14, 15]


def _shards(tmp_path: Path, records: list, masking: str = "assistant") -> SFTShards:
    prefix = str(tmp_path / "shards")
    preprocess_sft([write_jsonl(tmp_path / "in.jsonl", records)], TOKENIZER, prefix, masking=masking, quiet=True)
    return SFTShards(prefix)


def _conv(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def test_padded_and_packed_rows(tmp_path) -> None:
    records = [_conv(f"What is {i} + {i}?", f"{i} + {i} = {2 * i}.") for i in range(12)]
    shards = _shards(tmp_path, records)
    seq = 40
    sizes = shards.sizes
    assert sizes.max() <= seq + 1
    padded, _, _ = build_sft_datasets(shards, "100,0,0", seq, 3, (12, 0, 0), str(tmp_path / "cache"), False,
                                      "truncate", 2, 4096)
    seen = set()
    for i in range(12):
        item = padded[i]
        assert set(item) == {"tokens", "loss_mask"} and item["tokens"].size == seq + 1
        (sample,) = padded.row_samples[padded.row_offsets[i]:padded.row_offsets[i + 1]]
        n = sizes[sample]
        assert item["tokens"][:n].tolist() == shards.tokens[sample].tolist()
        assert (item["tokens"][n:] == 2).all() and not item["loss_mask"][n - 1:].any()
        assert item["loss_mask"][: n - 1].tolist() == shards.mask[sample][1:].tolist()
        seen.add(int(sample))
    assert seen == set(range(12))  # one epoch: every sample once

    seq = 80
    assert 2 * sizes.max() <= seq + 1 < 3 * sizes.min()  # exactly two samples per packed row
    packed, _, _ = build_sft_datasets(shards, "100,0,0", seq, 3, (6, 0, 0), str(tmp_path / "cache"), True,
                                      "truncate", 2, 4096)
    assert packed.stats["rows_per_epoch"] == 6 and packed.stats["epochs"] == 1
    batch = collate([packed[i] for i in range(6)])
    for row in range(6):
        a, b = packed.row_samples[packed.row_offsets[row]:packed.row_offsets[row + 1]]
        la, lb = int(sizes[a]), int(sizes[b])
        item = packed[row]
        assert item["tokens"][: la + lb].tolist() == shards.tokens[a].tolist() + shards.tokens[b].tolist()
        assert item["position_ids"][: la + lb].tolist() == list(range(la)) + list(range(lb))
        assert item["segment_ids"].tolist() == [0] * la + [1] * lb + [2] * (seq - la - lb)
        assert item["position_ids"][la + lb:].tolist() == list(range(seq - la - lb))
        mask = item["loss_mask"]
        assert mask[la - 1] == 0  # the label of a's last token is b's first token: never trained
        assert mask[: la - 1].tolist() == shards.mask[a][1:].tolist()
        assert mask[la: la + lb - 1].tolist() == shards.mask[b][1:].tolist()
        labels = batch.labels[row]
        assert (labels[mask == 0] == -100).all() and (labels[mask == 1] >= 0).all()
    assert batch.segment_ids is not None and batch.position_ids.shape == (6, seq)


def test_overlong_samples_are_truncated_or_dropped_and_counted(tmp_path) -> None:
    long_answer = _conv("Count.", " ".join(str(i) for i in range(40)))  # trained tokens start early, run long
    long_prompt = _conv(" ".join(["word"] * 60), "Done.")               # the answer lies beyond the first 33
    short = _conv("Hi?", "Hello.")
    shards = _shards(tmp_path, [long_answer, long_prompt, short])
    seq = 32
    assert shards.sizes[0] > seq + 1 and shards.sizes[1] > seq + 1 and shards.sizes[2] <= seq + 1
    cache = str(tmp_path / "cache")
    train, _, _ = build_sft_datasets(shards, "100,0,0", seq, 1, (2, 0, 0), cache, False, "truncate", 2, 4096)
    assert (train.stats["truncated"], train.stats["dropped_untrained"], train.stats["dropped_overlong"]) == (1, 1, 0)
    assert sorted(train.row_samples.tolist()) == [0, 2]
    row = [i for i in range(2) if train.row_samples[train.row_offsets[i]] == 0][0]
    assert train[row]["tokens"].tolist() == shards.tokens[0][: seq + 1].tolist()
    assert "1 truncated" in train.describe() and "1 dropped with no trained token" in train.describe()
    dropped, _, _ = build_sft_datasets(shards, "100,0,0", seq, 1, (2, 0, 0), cache, True, "drop", 2, 4096)
    assert (dropped.stats["truncated"], dropped.stats["dropped_overlong"]) == (0, 2)
    assert dropped.row_samples.tolist() == [2, 2]  # one sample left: two epochs of one row


def test_config_tokenises_jsonl_once_into_the_cache(tmp_path, capsys) -> None:
    src = write_jsonl(tmp_path / "chat.jsonl", read_jsonl(CHAT / "chat_alpaca.jsonl", 30))
    data = SFTData(path=src, pack=True, split="90,10,0", workers=1)
    data.validate()
    data.prepare(TOKENIZER)
    assert "preprocess-sft: 30 docs" in capsys.readouterr().err
    (entry,) = [p for p in (tmp_path / "sft-cache").iterdir() if p.is_dir()]
    assert sorted(os.listdir(entry)) == ["chat_mask.bin", "chat_mask.idx", "chat_sft.json", "chat_tokens.bin",
                                         "chat_tokens.idx", "description.json"]
    again = SFTData(path=src, pack=True, split="90,10,0", workers=1)
    again.prepare(TOKENIZER)
    assert capsys.readouterr().err == ""  # built once
    train, valid, _ = again.build(64, 5, (8, 4, 0), 4096, 2)
    assert train.stats["samples"] == 27 and valid.stats["samples"] == 3 and train.pack
    assert sorted(p.name.split("-")[2] for p in (tmp_path / "sft-cache").iterdir() if p.name.startswith("chat-sft"))\
        == ["train", "valid"]  # the rows of each split, cached beside the shards
    last = SFTData(path=src, masking="last", workers=1)
    last.prepare(TOKENIZER)  # another masking: other shards
    assert len(list((tmp_path / "sft-cache").glob("*/chat_sft.json"))) == 2


@pytest.mark.parametrize("section, message", [
    ({"path": "x.jsonl", "prefix": "p"}, "exactly one of path"),
    ({"path": "nope.jsonl"}, "data.path 'nope.jsonl' not found"),
    ({"path": "data/chat/chat_messages.jsonl", "masking": "prompt"},
     "data.masking 'prompt': choose one of assistant, all, last, assistant_only$"),
    ({"path": "data/chat/chat_messages.jsonl", "overlong": "wrap"}, "data.overlong 'wrap'"),
    ({"path": "data/chat/chat_messages.jsonl", "pack": "yes"}, "data.pack must be true or false"),
    ({"prefix": "p", "masking": "all"}, "data.masking is fixed when the shards are made"),
    ({"path": "data/chat/chat_messages.jsonl", "packing": True}, "unknown keys for data.type 'sft': packing"),
])
def test_config_errors(section, message, monkeypatch) -> None:
    from llama_megatron.data.config import data_config_from_dict

    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match=message):
        data_config_from_dict({"type": "sft", **section}).validate()


def _bad_input_case(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """(preprocess-sft arguments, expected message) for each kind of bad input."""
    good = _conv("Hi?", "Hello.")
    src = tmp_path / "in.jsonl"
    tokenizer = TOKENIZER
    if case == "malformed":
        write_jsonl(src, [good, good, '{"messages": [', good])
        message = f"{src}:3: invalid JSON"
    elif case == "role":
        write_jsonl(src, [good, {"messages": [{"role": "narrator", "content": "Once."}]}])
        message = f"{src}:2: message 0: unknown role 'narrator'"
    elif case == "untrained":
        write_jsonl(src, [good, good, {"messages": [{"role": "user", "content": "Anyone?"}]}])
        message = f"{src}:3: no trained token"
    elif case == "template":
        write_jsonl(src, [{"messages": [{"role": "assistant", "content": "I speak first."}]}])
        message = f"{src}:1: chat template: turn 0 is assistant, expected user"
    else:  # a tokenizer without a chat template, and no template file
        write_jsonl(src, [good])
        tokenizer = str(tmp_path / "bare-tokenizer")
        os.makedirs(tokenizer)
        for name in ("tokenizer.model", "tokenizer_config.json"):
            shutil.copy(os.path.join(TOKENIZER, name), tokenizer)
        message = f"tokenizer {tokenizer} has no chat_template"
    return ["--input", str(src), "--tokenizer", tokenizer, "--output-prefix", str(tmp_path / "out" / "sft")], message


@pytest.mark.parametrize("case", ["malformed", "role", "untrained", "template", "no-template"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tmp_path, capsys) -> None:
    args, message = _bad_input_case(tmp_path, case)
    assert cli_main(["preprocess-sft", "--quiet", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    out = tmp_path / "out"
    assert not out.exists() or not list(out.iterdir())


@pytest.mark.launched
def test_bad_record_stops_train_before_launch(tmp_path) -> None:
    """`train` on a JSONL with a malformed record: one error line naming file:line, exit 2, no cache entry."""
    args, message = _bad_input_case(tmp_path, "malformed")
    config = json.loads(Path(ROOT, "configs", "finetune", "sft-tiny-cpu.json").read_text())
    config["data"]["path"] = args[1]
    config["parallel"] = {"tensor": 1, "pipeline": 1}  # one process: the record must stop it before launch
    config["checkpoint"] = {}
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    result = run_command(1, ["-m", "llama_megatron.train"], ["--config", str(config_path), "--set",
                                                               f"output_dir={tmp_path / 'run'}"], check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    cache = tmp_path / "sft-cache"
    assert not cache.exists() or not [p for p in cache.iterdir() if p.is_dir()]


def test_skip_bad_lines_counts_them(tmp_path, capsys) -> None:
    args, _ = _bad_input_case(tmp_path, "role")
    assert cli_main(["preprocess-sft", "--quiet", "--skip-bad-lines", *args]) == 0
    assert "1 samples" in capsys.readouterr().out
    meta = json.loads((tmp_path / "out" / "sft_sft.json").read_text())
    assert (meta["samples"], meta["skipped_records"]) == (1, 1)
    with pytest.raises(DataError, match="exists; pass --overwrite"):
        preprocess_sft([args[1]], TOKENIZER, str(tmp_path / "out" / "sft"), skip_bad=True, quiet=True)


@pytest.mark.launched
def test_preprocess_sft_verb_makes_what_data_path_caches(tmp_path, capsys) -> None:
    """`preprocess-sft` shards named by data.prefix give the same rows as data.path's cache."""
    src = write_jsonl(tmp_path / "chat.jsonl", read_jsonl(CHAT / "chat_sharegpt.jsonl", 40))
    prefix = str(tmp_path / "processed" / "chat")
    assert cli_main(["preprocess-sft", "--input", src, "--tokenizer", TOKENIZER, "--output-prefix", prefix,
                     "--workers", "2", "--quiet"]) == 0
    assert "40 samples" in capsys.readouterr().out
    from_prefix = SFTData(prefix=prefix, pack=True, cache_dir=str(tmp_path / "c1"))
    from_prefix.validate()
    from_path = SFTData(path=src, pack=True, workers=1, cache_dir=str(tmp_path / "c2"))
    rows = []
    for data in (from_prefix, from_path):
        data.prepare(TOKENIZER)
        train, _, _ = data.build(96, 7, (12, 0, 0), 4096, 2)
        rows.append([train[i] for i in range(12)])
    for a, b in zip(*rows):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path) -> None:
    """A generation prompt unlike the header a finished turn gets (Qwen3-style thinking): without markers its turns
    cannot be located by rendering prefixes (refused); with markers they can, as transformers' own mask."""
    from transformers import AutoTokenizer

    from llama_megatron.data.sft.chat_template import TemplateRenderError

    messages = template_messages(to_messages(_conv("Hi?", "Hello.")))
    for variant in ("plain", "eot"):
        path = tmp_path / f"{variant}.jinja"
        path.write_text(template("chatml", variant).replace("{{- '<|im_start|>assistant\\n' -}}{%- endif",
                                                            "{{- '<|im_start|>assistant\\n<think>' -}}{%- endif"),
                        encoding="utf-8")
        encoder = ChatEncoder(TOKENIZER, str(path))
        assert encoder.render([], add_generation_prompt=True).endswith("<think>")
        assert encoder.encode(messages, None).trained[1:].all()  # masking: all needs no spans
        if variant == "plain":
            with pytest.raises(TemplateRenderError, match="before message 1 differently"):
                encoder.encode(messages, [False, True])
            continue
        ref = AutoTokenizer.from_pretrained(TOKENIZER).apply_chat_template(
            messages, chat_template=encoder.source, return_dict=True, return_assistant_tokens_mask=True)
        assert encoder.encode(messages, [False, True]).trained[1:].tolist() == ref["assistant_masks"][1:]
        assert sum(ref["assistant_masks"]) > 0
