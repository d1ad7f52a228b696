"""Chat templates rendered as transformers renders them, in jinja2's immutable sandbox, under a time and size limit.

A template comes with the model file: it may loop for hours or build a string of gigabytes. A thread cannot
be killed in Python and a deadline checked from outside does not stop the render, so the limits are checked
from inside it: the template is compiled from a rewritten syntax tree in which every `for` iterates through
a guard filter (the deadline, each item), every output goes through one (characters produced) and every `~`
through one (its size); the sandbox's hooks check the deadline on each call and filter, refuse a
repetition (`*`, `**`), a string method or a filter whose arguments multiply past the limit before it runs,
and check every result's size after. Between two loop items or calls a template runs only its own source
once, so these checks bound its time. Constant folding is off: no template code runs while compiling.
"""
from __future__ import annotations

import functools
import json
import math
import re
import threading
import time
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_TIMEOUT_S = 3.0          # a real template renders a long chat in milliseconds
MAX_OUTPUT_CHARS = 1 << 20      # what the template itself writes (contents are passed as short placeholders)
MAX_SOURCE_CHARS = 1 << 20      # real templates are a few KiB
MAX_INT_BITS = 1 << 16
WORK_FACTOR = 64                # a method or filter may do this many times the size limit in work


class TemplateLimit(jinja2.exceptions.TemplateRuntimeError):
    """The template ran past its time or size limit."""


class _Limits(threading.local):
    deadline = math.inf
    timeout_s = RENDER_TIMEOUT_S
    max_chars = MAX_OUTPUT_CHARS
    produced = 0


_limits = _Limits()


def _tick() -> None:
    if time.monotonic() > _limits.deadline:
        raise TemplateLimit(f"ran past its {_limits.timeout_s:g} s limit (a loop or a recursion that does not end?)")


# the methods and filters whose integer arguments are widths or counts of what they make
SIZING = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap", "slice", "batch"})


def _size(value, ints: bool) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) if ints else 1
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 1


def _sized(value):
    """value, refused when it is a string, list or number past the limits."""
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > _limits.max_chars:
        raise TemplateLimit(f"built a value of {len(value):,} characters or items (the limit is {_limits.max_chars:,})")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise TemplateLimit(f"built a number of {value.bit_length():,} bits")
    return value


def _check_work(name: str, values) -> None:
    """Refuse a call whose arguments' sizes multiply past the limit (s.replace(s, s), s.center(10**9))."""
    work, ints = 1, name in SIZING
    for value in values:
        work *= max(1, _size(value, ints))
    if work > WORK_FACTOR * _limits.max_chars:
        raise TemplateLimit(f"asked for about {work:,} characters of work in one step "
                            f"(the limit is {WORK_FACTOR * _limits.max_chars:,})")


_WIDE_SPEC = re.compile(r"%[^a-zA-Z%]*(\*|\d{7})|\{[^{}]*:[^{}]*(\{|\d{7})")


def _check_format(fmt) -> None:
    """A width or precision in a format string allocates before any result can be checked."""
    if isinstance(fmt, str) and _WIDE_SPEC.search(fmt):
        raise TemplateLimit("asked for a format width past the size limit")


def _check_binop(operator: str, left, right) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > _limits.max_chars:
                raise TemplateLimit(f"repeated a value to {len(seq) * n:,} characters or items "
                                    f"(the limit is {_limits.max_chars:,})")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimit("multiplied numbers past the size limit")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0 and \
                left.bit_length() * right > MAX_INT_BITS:
            raise TemplateLimit(f"raised a number to the power {right:,}")
    elif operator == "%":
        _check_format(left)


class LimitedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator, left, right):
        if operator != "+":
            _check_binop(operator, left, right)
        return _sized(self.binop_table[operator](left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - the sandbox's own signature
        _tick()
        method = getattr(__obj, "__wrapped__", __obj)
        if isinstance(getattr(method, "__self__", None), str):
            _check_work(method.__name__, (method.__self__, *args, *kwargs.values()))
        return _sized(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format(value.__self__)
        return wrapped


# The guards are filters, not calls: a filter is called directly (a sandboxed call costs ten times more) and a
# template cannot rebind its name. pass_context keeps jinja2 from running them once at compile time on a
# constant (literal text in a loop would then never be counted).
@jinja2.pass_context
def _guard_loop(_context, iterable):
    for item in iterable:
        _tick()
        yield item


@jinja2.pass_context
def _guard_output(_context, value):
    _limits.produced += len(str(value)) if not isinstance(value, jinja2.Undefined) else 0
    if _limits.produced > _limits.max_chars:
        raise TemplateLimit(f"wrote more than {_limits.max_chars:,} characters")
    return value


@jinja2.pass_context
def _guard_value(_context, value):
    return _sized(value)


GUARDS = {"kvchat_guard_loop": _guard_loop, "kvchat_guard_output": _guard_output, "kvchat_guard_value": _guard_value}


def _limited_filter(name: str, func):
    skip = 2 if getattr(func, "jinja_pass_arg", None) is not None else 1    # (context,) value, args...

    @functools.wraps(func)
    def limited(*args, **kwargs):
        _tick()
        _check_work(name, (*args[skip - 1:], *kwargs.values()))
        if name == "format" and len(args) >= skip:
            _check_format(args[skip - 1])
        return _sized(func(*args, **kwargs))
    return limited


def _guarded(tree: nodes.Template, env: LimitedEnvironment) -> nodes.Template:
    def guard(name: str, node: nodes.Expr) -> nodes.Filter:
        return nodes.Filter(node, f"kvchat_guard_{name}", [], [], None, None,
                            lineno=node.lineno).set_environment(env)

    for loop in tree.find_all(nodes.For):
        loop.iter = guard("loop", loop.iter)
    for concat in list(tree.find_all(nodes.Concat)):
        concat.nodes = [guard("value", nodes.Concat(concat.nodes, lineno=concat.lineno))]
    for output in tree.find_all(nodes.Output):
        output.nodes = [guard("output", child) for child in output.nodes]
    return tree


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): rendered as is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Namespace(jinja2.utils.Namespace):
    """namespace(): no underscore-named attributes (nothing of CPython's internals reachable)."""
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-named attributes ({name!r})")


class _Dict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    if len(source) > MAX_SOURCE_CHARS:
        raise TemplateLimit(f"is {len(source):,} characters long; chat templates are a few thousand")
    env = LimitedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols],
                             optimized=False)
    env.filters["tojson"] = _tojson
    env.filters = {name: _limited_filter(name, f) for name, f in env.filters.items()} | GUARDS
    env.globals.pop("lipsum", None)     # lipsum(10**9) would run in one call, out of the deadline's reach
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_Dict(), namespace=_Namespace)
    return env.from_string(_guarded(env.parse(source), env))


def plain(value):
    """What a template sees is rebuilt from plain JSON types (str, int, float, bool, None, dict, list, tuple):
    another object's methods are out of the sandbox's sight, so it becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):      # subclasses (enums, numpy scalars) back to the base type
        if isinstance(value, base):
            return base(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return f"<{type(value).__name__}>"


def render(source: str, conversation: list[dict], add_generation_prompt: bool = False, *, tools=None,
           documents=None, timeout_s: float = RENDER_TIMEOUT_S, max_chars: int | None = None, **variables) -> str:
    """The template's text for a conversation; jinja2's exceptions (TemplateLimit among them) as they come.
    max_chars: what it may write, by default MAX_OUTPUT_CHARS plus four times the messages' text and 512 characters
    of framing a message."""
    template = compile_template(source)
    messages = [{k: v for k, v in m.items() if v is not None} for m in plain(list(conversation))]
    if max_chars is None:
        max_chars = MAX_OUTPUT_CHARS + 512 * len(messages) + 4 * sum(
            len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    _limits.deadline, _limits.timeout_s = time.monotonic() + timeout_s, timeout_s
    _limits.max_chars, _limits.produced = max_chars, 0
    try:
        return template.render(messages=messages, tools=plain(tools), documents=plain(documents),
                               add_generation_prompt=add_generation_prompt, **plain(variables))
    except RecursionError:
        raise TemplateLimit("calls itself without end") from None
    except MemoryError:
        raise TemplateLimit("ran out of memory") from None
    finally:
        _limits.deadline = math.inf
