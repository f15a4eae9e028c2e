"""docs/configuration.md's reference of every training-JSON key is what the typed config classes say
(llama_megatron/commands/config_reference.py renders it), every field has its one-line meaning, and
``llama-megatron train --help-config`` prints the same."""

from __future__ import annotations

import dataclasses

import pytest

from llama_megatron import cli
from llama_megatron.commands import config_reference


def test_every_field_has_a_meaning() -> None:
    assert config_reference.missing_docs() == [], (
        "add a comment beside or above these config fields: " + ", ".join(config_reference.missing_docs()))


def test_the_page_is_what_the_code_says() -> None:
    text = open(config_reference.PAGE, encoding="utf-8").read()
    assert config_reference.page_block(text) == config_reference.render(), (
        "docs/configuration.md is stale: run python -m llama_megatron.commands.config_reference --write")


def test_every_section_key_is_listed() -> None:
    rendered = config_reference.render()
    for prefix, _, cls in config_reference.sections():
        for f in dataclasses.fields(cls):
            if f.init and not f.name.startswith("_"):
                assert f"| `{prefix + '.' if prefix else ''}{f.name}` |" in rendered


def test_the_checker_sees_a_missing_comment_and_a_stale_page(tmp_path) -> None:
    @dataclasses.dataclass
    class Section:
        # a comment above
        documented: int = 1
        beside: str = "x"  # a comment beside
        bare: bool = False

    assert config_reference.field_docs(Section) == {"documented": "a comment above", "beside": "a comment beside",
                                                    "bare": ""}
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{config_reference.START}\nold\n{config_reference.END}\nafter\n")
    assert config_reference.page_block(page.read_text()) == "old\n"
    assert config_reference.write(str(page)) is True
    assert config_reference.page_block(page.read_text()) == config_reference.render()
    assert page.read_text().endswith(f"{config_reference.END}\nafter\n")
    assert config_reference.write(str(page)) is False


def test_train_help_config(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["train", "--help-config"])
    assert done.value.code == 0
    assert capsys.readouterr().out == config_reference.render()
