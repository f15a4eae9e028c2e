"""Chat templates are bounded before they allocate (data/sft/chat_template.py): payloads that would render 1e8-2e8
characters through formatting, padding, joining, indenting or replacing are refused with one line, and ordinary
uses of the same filters and methods still render."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
from launch_utils import ROOT

ONE = SimpleNamespace(rank=0, world_size=1)


@pytest.mark.parametrize("template, message", [
    ("{{ '%0200000000d' % 0 }}", "formats a field of 200000000 characters"),
    ("{{ '%*d' % (200000000, 0) }}", "formats a field of 200000000 characters"),
    ("{{ '%0200000000d'|format(0) }}", "formats a field of 200000000 characters"),
    ("{{ '{:>200000000}'.format('x') }}", "formats a field of 200000000 characters"),
    ("{{ 'x'|center(200000000) }}", "pads a string to a width of 200000000 characters"),
    ("{{ 'x'.rjust(200000000) }}", "pads a string to a width of 200000000 characters"),
    ("{{ (['x' * 16000000] * 13)|join }}", "joins a string of 208000000 characters"),
    ("{{ ''.join(['x' * 16000000] * 13) }}", "joins a string of 208000000 characters"),
    ("{{ ('x\\n' * 2000000)|indent(13) }}", "indents a string of 30000013 characters"),
    ("{{ ('x' * 1000).replace('', 'y' * 100000) }}", "replaces into a string of 100101000 characters"),
], ids=["percent", "percent-star", "format-filter", "str-format", "center", "rjust", "join-filter", "str-join",
        "indent", "replace"])
def test_template_payloads_are_bounded_before_they_allocate(template, message, tmp_path) -> None:
    """Each payload used to render 1e8-2e8 characters before the output bound saw them; now refused before the
    value is built (the peak allocation stays far below it)."""
    import tracemalloc

    from llama_megatron.data.sft.chat_template import ChatEncoder, TemplateRenderError

    jinja = tmp_path / "t.jinja"
    jinja.write_text(template)
    encoder = ChatEncoder(os.path.join(ROOT, "data", "tokenizer"), str(jinja))
    tracemalloc.start()
    try:
        with pytest.raises(TemplateRenderError, match=re.escape(message)):
            encoder.render([{"role": "user", "content": "a"}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20, f"{peak / 2**20:.0f} MiB allocated"


def test_bounded_templates_still_render(tmp_path) -> None:
    """The checks refuse only what is over the bound: ordinary uses of the same filters and methods render."""
    from llama_megatron.data.sft.chat_template import ChatEncoder

    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ '%03d' % 7 }}|{{ 'ab'|center(6) }}|{{ ['a', 'b']|join(',') }}|{{ '{:>4}'.format('z') }}|"
                     "{{ 'x'|indent(2, true) }}|{{ 'aXa'.replace('X', '-') }}|{{ '%s=%d'|format('n', 2) }}")
    encoder = ChatEncoder(os.path.join(ROOT, "data", "tokenizer"), str(jinja))
    assert encoder.render([{"role": "user", "content": "a"}]) == "007|  ab  |a,b|   z|  x|a-a|n=2"
