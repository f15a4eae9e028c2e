"""Chat templates rendered exactly as ``transformers``' ``apply_chat_template``, plus the tokens to train on.

The template is the HF tokenizer's ``chat_template`` (``tokenizer_config.json`` or ``chat_template.jinja`` in its
directory) or a Jinja file named in the config; a tokenizer without one and no file is an error, never a silent
fallback. Rendering uses transformers' environment (sandboxed, ``trim_blocks``/``lstrip_blocks``, loop controls,
``tojson``/``raise_exception``/``strftime_now``, the tokenizer's special tokens as variables, ``None`` values
dropped), and tokenising the rendered text uses the HF tokenizer with ``add_special_tokens=False``, so ids equal
``tokenizer.apply_chat_template(messages)`` (tested).

Which tokens are trained (docs/data.md, "Rendering and masks"), the same rule as transformers' and TRL's:

- a template with ``{% generation %}`` markers: exactly what the markers enclose (transformers'
  ``return_assistant_tokens_mask``, TRL's ``assistant_only_loss``), for the trained assistant turns;
- a template without markers: the characters a trained assistant turn adds to the render (from the end of the
  render up to it with the generation prompt to the end of the render through it: content, end of turn and
  whatever the turn writes after it; never the header);
- prompt/completion records: every token after the longest common prefix of the tokenised prompt (with the
  generation prompt) and the tokenised whole record (TRL's ``completion_only_loss``), whatever the template marks;
  with ``marked_only`` (``masking: assistant_only``, TRL's ``assistant_only_loss`` as well) only what the markers
  enclose of it.

Characters become tokens by transformers' rule: from the token holding a span's first character through the token
holding its last, so a token straddling either end of a span (``"▁Ju"`` after a generation prompt ending in a
space) is trained.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llama_megatron.data.sft.template_sandbox import (
    MAX_RENDER_CHARS,
    RENDER_SECONDS,
    RenderTimeout,
    TemplateRenderError,
    bounded_join,
    sandboxed_environment,
    time_limit,
)
from llama_megatron.data.tokenizer import TOKENIZER_FILES
from llama_megatron.errors import ConfigError

# How transformers and TRL recognise a template with assistant markers.
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


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
            raise ConfigError("chat data (SFT, preference pairs, prompts) needs the training config's tokenizer "
                              "(its chat template renders the data)")
        if template_file and not os.path.isfile(template_file):
            raise ConfigError(f"chat template {template_file} not found (cwd {os.getcwd()})")
        self.tokenizer_path = tokenizer_path
        self.template_file = template_file
        self.tokenizer = load_hf_tokenizer(tokenizer_path)
        self.source = template_source(self.tokenizer, tokenizer_path, template_file)
        self.has_markers = bool(GENERATION_MARKER.search(self.source))
        self._tracker: dict = {}
        try:
            self._template = sandboxed_environment(self._tracker).from_string(self.source)
        except Exception as exc:  # jinja2.TemplateSyntaxError and friends
            raise ConfigError(f"chat template of {template_file or tokenizer_path} does not compile: {exc}") from None
        # ``a ~ b`` compiles to a call of ``str_join`` in the template's own globals, out of reach of the sandbox's
        # operator hooks: bound it there (this template only)
        namespace = getattr(self._template.root_render_func, "__globals__", {})
        if "str_join" in namespace:
            namespace["str_join"] = bounded_join
        self._variables = dict(self.tokenizer.special_tokens_map)

    def __getstate__(self) -> dict:
        # worker processes reload the tokenizer and recompile the template
        return {"tokenizer_path": self.tokenizer_path, "template_file": self.template_file}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["tokenizer_path"], state["template_file"])

    def _render(self, messages: Sequence[dict], add_generation_prompt: bool, rendered: list[str] | None,
                blocks: list[tuple[int, int]] | None) -> str:
        import jinja2

        self._tracker.update(rendered=rendered, blocks=blocks)
        pieces = [] if rendered is None else rendered
        size = 0
        try:
            with time_limit(RENDER_SECONDS):
                for piece in self._template.generate(
                        messages=[_template_message(m) for m in messages], tools=None, documents=None,
                        add_generation_prompt=add_generation_prompt, **self._variables):
                    size += len(piece)
                    if size > MAX_RENDER_CHARS:
                        raise TemplateRenderError(f"chat template output exceeds {MAX_RENDER_CHARS} characters")
                    pieces.append(piece)
        except TemplateRenderError:
            raise
        except RenderTimeout:
            raise TemplateRenderError(f"chat template did not finish within {RENDER_SECONDS:g} s") from None
        except MemoryError:
            raise TemplateRenderError("chat template ran out of memory") from None
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateRenderError(f"chat template: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
            raise TemplateRenderError(f"chat template failed: {exc}") from None
        finally:
            self._tracker.update(rendered=None, blocks=None)
        return "".join(pieces)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The text ``tokenizer.apply_chat_template(messages, tokenize=False)`` gives."""
        return self._render(messages, add_generation_prompt, None, None)

    def render_with_generation_blocks(self, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character ranges its ``{% generation %}`` blocks produced."""
        blocks: list[tuple[int, int]] = []
        return self._render(messages, False, [], blocks), blocks

    def trained_spans(self, messages: Sequence[dict], trained: Sequence[bool], text: str) -> list[tuple[int, int]]:
        """Character ranges of ``text`` (the whole rendered conversation) that the trained assistant turns add to
        the render: from the end of the render before the turn (with the generation prompt) to the end of the
        render through it. For templates without markers."""
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
                        "messages follow, so its assistant turns cannot be located (add {% generation %} markers "
                        "to the template, or use masking: all)")
            if len(end_text) <= len(start_text):
                raise TemplateRenderError(f"message {i} renders to no text")
            spans.append((len(start_text), len(end_text)))
        return spans

    @staticmethod
    def marked_spans(messages: Sequence[dict], trained: Sequence[bool],
                     blocks: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The generation blocks of the trained assistant turns: all of them when every assistant turn is trained
        (transformers' mask), else one block per assistant message, in order."""
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if all(trained[i] for i in assistants):
            return blocks
        if len(blocks) != len(assistants):
            raise TemplateRenderError(
                f"the chat template renders {len(blocks)} {{% generation %}} block(s) for {len(assistants)} "
                "assistant message(s), so untrained assistant turns cannot be told apart (train every assistant "
                "turn, or use masking: all)")
        return [block for block, i in zip(blocks, assistants) if trained[i]]

    def require_markers(self) -> None:
        """ConfigError unless the template has ``{% generation %}`` markers (``masking: assistant_only``)."""
        if not self.has_markers:
            raise ConfigError(f"masking assistant_only trains what the chat template's {{% generation %}} markers "
                              f"enclose, and the template of {self.template_file or self.tokenizer_path} has none: "
                              "add them, or use masking assistant")

    def completion_start(self, messages: Sequence[dict], prompt_length: int, ids: Sequence[int]) -> int:
        """TRL's start of the completion in ``ids`` (the whole record's tokens): the length of the common prefix
        of ``ids`` and the tokenised prompt rendered with the generation prompt."""
        return common_prefix_length(
            self.tokenize_rendered(self.render(messages[:prompt_length], add_generation_prompt=True)), ids)

    def tokenize_rendered(self, text: str) -> list[int]:
        """Ids of rendered chat text: no special tokens added (the template wrote them), as
        ``apply_chat_template(..., tokenize=True)``."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def tokenize_text(self, text: str) -> list[int]:
        """Ids of plain text with the tokenizer's special tokens (its BOS), as ``tokenizer(text=...)``."""
        return self.tokenizer(text=text)["input_ids"]

    def encode(self, messages: Sequence[dict], trained: Sequence[bool] | None,
               prompt_length: int | None = None, marked_only: bool = False) -> Encoded:
        """Token ids of the rendered conversation and its training mask. ``trained`` flags the assistant messages
        that are targets (None: every token is); ``prompt_length`` makes it a prompt/completion record whose first
        ``prompt_length`` messages are the prompt (the flags then only say whether every token is trained), trained
        after the prompt whatever the template marks (TRL's ``completion_only_loss``). ``marked_only`` trains only
        what the ``{% generation %}`` markers enclose of that (TRL's ``assistant_only_loss``; ConfigError without
        markers); conversations are cut to the markers whenever the template has them, with or without it."""
        if marked_only and trained is not None:
            self.require_markers()
        text, blocks = self.render_with_generation_blocks(messages)
        enc = self.tokenizer(text, add_special_tokens=False)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        if trained is None:
            mask = np.ones(ids.size, dtype=np.uint8)
        elif prompt_length is not None:
            mask = np.zeros(ids.size, dtype=np.uint8)
            mask[self.completion_start(messages, prompt_length, enc["input_ids"]):] = 1
            if marked_only:  # TRL applies both masks: their intersection
                mask &= _token_mask(enc, blocks, ids.size)
        elif self.has_markers:
            mask = _token_mask(enc, self.marked_spans(messages, trained, blocks), ids.size)
        else:
            mask = _token_mask(enc, self.trained_spans(messages, trained, text), ids.size)
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


def common_prefix_length(ids: Sequence[int], other: Sequence[int]) -> int:
    """How many leading ids the two sequences share."""
    common = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        common += 1
    return common


def _token_mask(encoding, spans: Sequence[tuple[int, int]], size: int) -> np.ndarray:
    """1 from the token holding each span's first character through the token holding its last (transformers'
    ``return_assistant_tokens_mask``: a span starting with no token stops the scan, one ending with none runs to the
    end). transformers also runs to the end when the last character lies in token 0, which no turn can."""
    mask = np.zeros(size, dtype=np.uint8)
    for lo, hi in spans:
        first, last = encoding.char_to_token(lo), encoding.char_to_token(hi - 1)
        if first is None:
            break
        mask[first: size if last is None else last + 1] = 1
    return mask
