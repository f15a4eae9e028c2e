"""Chat templates rendered exactly as ``transformers``' ``apply_chat_template``, plus the spans to train on.

The template is the HF tokenizer's ``chat_template`` (``tokenizer_config.json`` or ``chat_template.jinja`` in its
directory) or a Jinja file named in the config; a tokenizer without one and no file is an error, never a silent
fallback. Rendering uses transformers' environment (sandboxed, ``trim_blocks``/``lstrip_blocks``, loop controls,
``tojson``/``raise_exception``/``strftime_now``, the tokenizer's special tokens as variables, ``None`` values
dropped), and tokenising the rendered text uses the HF tokenizer with ``add_special_tokens=False``, so ids equal
``tokenizer.apply_chat_template(messages)`` (tested).

Which characters an assistant turn owns is read from the template itself, whatever it looks like: rendering the
conversation up to the turn with the generation prompt gives where the turn's text starts, and rendering it up to
and including the turn gives where it ends (its end-of-turn / EOS text included, the role header excluded). Both
renders must be prefixes of the whole conversation's text, else the template cannot be masked this way (an error).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from llama_megatron.data.tokenizer import TOKENIZER_FILES
from llama_megatron.errors import ConfigError


class TemplateRenderError(ValueError):
    """The template rejected a conversation (its ``raise_exception``, or a Jinja error): a bad record."""


def _environment():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag) renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override: Jinja's own tojson escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# Names a message's reasoning is passed under (transformers aliases them all; the first is what templates read).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_message(message: dict) -> dict:
    """The message as transformers hands it to the template: None values dropped, reasoning fields aliased."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _tokenizer_dir(path: str) -> str:
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def load_hf_tokenizer(path: str):
    """The HF tokenizer of a tokenizer directory (or of the directory holding a ``tokenizer.model`` file)."""
    from transformers import AutoTokenizer

    directory = _tokenizer_dir(path)
    if not os.path.isdir(directory):
        raise ConfigError(f"tokenizer not found: {path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load {directory} with transformers.AutoTokenizer: {exc}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"{directory}: SFT masking needs a fast (tokenizers) tokenizer for character offsets")
    return tokenizer


def template_source(tokenizer, tokenizer_path: str, template_file: str | None) -> str:
    """The Jinja text: ``template_file`` if given, else the tokenizer's own template (its ``default`` if several)."""
    if template_file:
        try:
            with open(template_file, encoding="utf-8") as fh:
                return fh.read()
        except OSError as exc:
            raise ConfigError(f"cannot read chat template {template_file}: {exc.strerror}") from None
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise ConfigError(f"tokenizer {tokenizer_path} has no chat_template; name a Jinja file in "
                          "data.chat_template (or add chat_template.jinja to the tokenizer directory)")
    return template


@dataclass
class Encoded:
    """One conversation: its token ids and, per token, 1 if it is trained as a label (a target), else 0."""

    ids: np.ndarray
    trained: np.ndarray


class ChatEncoder:
    """Renders conversations with a chat template and tokenises them with the HF tokenizer, with training masks."""

    def __init__(self, tokenizer_path: str | None, template_file: str | None = None) -> None:
        if not tokenizer_path:
            raise ConfigError("SFT data needs the training config's tokenizer (its chat template renders the data)")
        if template_file and not os.path.isfile(template_file):
            raise ConfigError(f"chat template {template_file} not found (cwd {os.getcwd()})")
        self.tokenizer_path = tokenizer_path
        self.template_file = template_file
        self.tokenizer = load_hf_tokenizer(tokenizer_path)
        self.source = template_source(self.tokenizer, tokenizer_path, template_file)
        try:
            self._template = _environment().from_string(self.source)
        except Exception as exc:  # jinja2.TemplateSyntaxError and friends
            raise ConfigError(f"chat template of {template_file or tokenizer_path} does not compile: {exc}") from None
        self._variables = dict(self.tokenizer.special_tokens_map)

    def __getstate__(self) -> dict:
        # worker processes reload the tokenizer and recompile the template
        return {"tokenizer_path": self.tokenizer_path, "template_file": self.template_file}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["tokenizer_path"], state["template_file"])

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The text ``tokenizer.apply_chat_template(messages, tokenize=False)`` gives."""
        import jinja2

        try:
            return self._template.render(messages=[_template_message(m) for m in messages], tools=None,
                                         documents=None, add_generation_prompt=add_generation_prompt,
                                         **self._variables)
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateRenderError(f"chat template: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise TemplateRenderError(f"chat template failed: {exc}") from None

    def trained_spans(self, messages: Sequence[dict], trained: Sequence[bool], text: str) -> list[tuple[int, int]]:
        """Character ranges of ``text`` (the whole rendered conversation) owned by the trained assistant turns."""
        spans = []
        for i, train in enumerate(trained):
            if not train:
                continue
            start_text = self.render(messages[:i], add_generation_prompt=True)
            end_text = self.render(messages[: i + 1])
            for name, prefix in (("before", start_text), ("through", end_text)):
                if not text.startswith(prefix):
                    raise TemplateRenderError(
                        f"the chat template renders the conversation {name} message {i} differently when later "
                        "messages follow, so its assistant turns cannot be located (use masking: all)")
            if len(end_text) <= len(start_text):
                raise TemplateRenderError(f"message {i} renders to no text")
            spans.append((len(start_text), len(end_text)))
        return spans

    def encode(self, messages: Sequence[dict], trained: Sequence[bool] | None) -> Encoded:
        """Token ids of the rendered conversation; ``trained`` marks the assistant messages whose tokens (content and
        end of turn) are targets, or None to train every token."""
        text = self.render(messages)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        mask = np.zeros(ids.size, dtype=np.uint8)
        if trained is None:
            mask[:] = 1
        else:
            starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
            for lo, hi in self.trained_spans(messages, trained, text):
                mask[(starts >= lo) & (starts < hi)] = 1
        if mask.size:
            mask[0] = 0  # the first token has no context to predict it from
        return Encoded(ids, mask)

    def fingerprint(self) -> dict:
        """What the encoding depends on, for cache keys: the template text and the tokenizer's files."""
        import hashlib

        directory = _tokenizer_dir(self.tokenizer_path)
        h = hashlib.sha256()
        for name in TOKENIZER_FILES:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                h.update(name.encode())
                with open(path, "rb") as fh:
                    h.update(fh.read())
        return {"template_sha256": hashlib.sha256(self.source.encode()).hexdigest(),
                "tokenizer_sha256": h.hexdigest()}
