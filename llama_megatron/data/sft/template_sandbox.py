"""The sandbox chat templates render in (data/sft/chat_template.py): transformers' sandboxed Jinja environment and its
helpers, with bounds a hostile template meets before it allocates (a field width, a padding, a join, an indent or a
replace that would build more than ``MAX_RENDER_CHARS`` characters is refused with one line) and a time limit on
each render (``RENDER_SECONDS``): a template is untrusted input.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
import time
from datetime import datetime


class TemplateRenderError(ValueError):
    """The template rejected a conversation (its ``raise_exception``, or a Jinja error): a bad record."""


def sandboxed_environment(tracker: dict):
    """transformers' chat-template environment. While ``tracker["rendered"]`` is a list (the pieces
    ``Template.generate`` has yielded so far), each ``{% generation %}`` block appends its (start, end) character
    range to ``tracker["blocks"]``, measured as transformers does (the length of what was yielded before it)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            text = caller()
            if tracker.get("rendered") is not None:
                start = sum(len(piece) for piece in tracker["rendered"])
                tracker["blocks"].append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override: Jinja's own tojson escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """transformers' sandbox, with the operators, methods and filters that build big values bounded (an
        untrusted template): each is checked before it runs, so nothing over the bound is ever allocated."""

        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
            if isinstance(getattr(__obj, "__self__", None), str):
                _check_str_method(__obj.__self__, __obj.__name__, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):
            # str.format is wrapped at attribute access (any call of it, not only through call above)
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None

            def checked(*args, **kwargs):
                _check_str_method(value.__self__, value.__name__, args, kwargs)
                return wrapped(*args, **kwargs)

            return checked

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    _bound_filters(env.filters)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# Bounds on an untrusted template (a chat template ships with a downloaded tokenizer): what one render may produce,
# and how long it may take. A conversation renders to about its own length; these are far above any real one.
MAX_RENDER_CHARS = 1 << 24
RENDER_SECONDS = 10.0


def _check_binop(operator: str, left, right) -> None:
    sized = (str, list, tuple)
    if operator == "*" and isinstance(left, sized + (int,)) and isinstance(right, sized + (int,)):
        seq, times = (left, right) if isinstance(left, sized) else (right, left)
        if isinstance(seq, sized) and isinstance(times, int) and len(seq) * times > MAX_RENDER_CHARS:
            raise TemplateRenderError(f"chat template builds a value of {len(seq) * times} items (limit "
                                      f"{MAX_RENDER_CHARS})")
    elif operator == "**" and isinstance(right, int) and abs(right) > 4096 and isinstance(left, (int, float)):
        raise TemplateRenderError(f"chat template raises to the power {right} (limit 4096)")
    elif operator == "%" and isinstance(left, str):
        _check_format(left, right)
    elif operator == "+" and isinstance(left, sized) and isinstance(right, sized) and \
            len(left) + len(right) > MAX_RENDER_CHARS:
        raise TemplateRenderError(f"chat template builds a value of {len(left) + len(right)} items (limit "
                                  f"{MAX_RENDER_CHARS})")


def _too_big(size: int, what: str) -> None:
    if size > MAX_RENDER_CHARS:
        raise TemplateRenderError(f"chat template {what} of {size} characters (limit {MAX_RENDER_CHARS})")


# The widths and precisions of printf-style fields, and the format specs of str.format fields
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*:([^{}]*)\}")


def _check_format(fmt: str, args) -> None:
    """A format string's widths (``'%0200000000d'``, ``'{:>200000000}'``) bounded; a width taken from the
    arguments (``%*d``, ``{:{}}``) bounded by the integers among them."""
    widths = [w for match in _PERCENT_FIELD.finditer(fmt) for w in match.groups() if w]
    widths += [w for match in _BRACE_SPEC.finditer(fmt) for w in re.findall(r"\d+", match.group(1))]
    sizes = [int(w) for w in widths if w.isdigit()]
    if "*" in widths or re.search(r"\{[^{}]*\{", fmt):
        values = args.values() if isinstance(args, dict) else args if isinstance(args, (tuple, list)) else [args]
        sizes += [v for v in values if isinstance(v, int)]
    _too_big(max(sizes, default=0), "formats a field")


def _check_str_method(text: str, name: str, args, kwargs) -> None:
    """str methods a template may call that build long strings from short ones."""
    ints = [a for a in (*args, *kwargs.values()) if isinstance(a, int)]
    if name in ("center", "ljust", "rjust", "zfill"):
        _too_big(max(ints, default=0), "pads a string to a width")
    elif name == "expandtabs":
        _too_big(len(text) + text.count("\t") * max(ints, default=8), "expands tabs to a string")
    elif name in ("format", "format_map"):
        _check_format(text, kwargs or (args[0] if name == "format_map" and args else args))
    elif name == "join" and args:
        _too_big(_joined_size(text, args[0]), "joins a string")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _too_big(len(text) + (text.count(args[0]) if args[0] else len(text) + 1) * len(args[1]),
                 "replaces into a string")


def _joined_size(separator: str, items) -> int:
    items = list(items) if not isinstance(items, (list, tuple)) else items
    return sum(len(str(item)) for item in items) + len(separator) * max(len(items) - 1, 0)


def _bound_filters(filters: dict) -> None:
    """Jinja's filters that pad, indent, format or join, each checked before it runs (filters are called
    directly, out of reach of the sandbox's call hook)."""
    import jinja2

    center, indent, fmt, join = filters["center"], filters["indent"], filters["format"], filters["join"]

    def bounded_center(value, width=80):
        _too_big(int(width) if isinstance(width, int) else 0, "pads a string to a width")
        return center(value, width)

    def bounded_indent(value, width=4, first=False, blank=False):
        step = width if isinstance(width, str) else " " * int(width) if isinstance(width, int) else ""
        _too_big(len(str(value)) + (str(value).count("\n") + 1) * len(step), "indents a string")
        return indent(value, width, first, blank)

    def bounded_format(value, *args, **kwargs):
        _check_format(str(value), kwargs or args)
        return fmt(value, *args, **kwargs)

    @jinja2.pass_eval_context
    def bounded_join(eval_ctx, value, d="", attribute=None):
        if attribute is None:
            value = list(value)
            _too_big(_joined_size(str(d), value), "joins a string")
        return join(eval_ctx, value, d, attribute)

    filters.update(center=bounded_center, indent=bounded_indent, format=bounded_format, join=bounded_join)


def bounded_join(values) -> str:
    parts = [str(v) for v in values]
    if sum(map(len, parts)) > MAX_RENDER_CHARS:
        raise TemplateRenderError(f"chat template builds a string of more than {MAX_RENDER_CHARS} characters")
    return "".join(parts)


class RenderTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Interrupt the block after ``seconds`` (SIGALRM; in the main thread only, and restoring any timer already
    set, e.g. pytest-timeout's)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise RenderTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if old_delay:
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - start), 1e-3), old_interval)
