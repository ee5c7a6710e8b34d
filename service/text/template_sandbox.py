"""The Jinja environment chat templates run in, and the bounds on what a template may build.

The environment is transformers': Jinja's `ImmutableSandboxedEnvironment` with `trim_blocks`,
`lstrip_blocks` and the loop-control extension; the globals `raise_exception`, `strftime_now`,
`dict` and a `namespace` that refuses underscore-prefixed attributes; a `tojson` filter that does
not HTML-escape (service.text.chat_template says why each matters).

A template is code, from a model's author or (where the operator trusts requests with it) from a
client, and Jinja lets one operation build a value of any size: `'x'|center(1000000000)`,
`'%1000000000d' % 1`, `messages|tojson(indent=300000000)`, `'{:>1000000000}'.format(x)`. One such
operation is one long C call: it holds the interpreter lock (the server's event loop and its health
probes wait) and takes gigabytes before anything can look at its size. So, here:

1. Nothing is evaluated while compiling. Jinja folds constant expressions when it compiles (its
   optimizer, and the compiler's own constant output), outside any render's limits and into the
   compiled code a cache keeps. The optimizer is off; every binary operator is intercepted and every
   filter and the output step take the render's context, which makes Jinja leave each to run time.
   A compiled template holds the template's literals and the code Jinja writes for it, no more.
2. Every operation that can build a value larger than its operands checks, before building it, an
   upper bound of its size: the operators `+ * % **` and `~`, every filter, the methods of strings,
   bytes and integers a template can call (`center`, `zfill`, `expandtabs`, `replace`, `join`,
   `translate`, `split`, `to_bytes`, ...), `str.format` (each field once its width and precision
   are resolved), printf-style `%` (`*` widths included), and the text of a value (output, `~`,
   `string`, `%s`, `join`). No value may hold more than MAX_VALUE_CHARS characters or, for a list,
   tuple or dict, MAX_VALUE_ITEMS items.
3. Each value so built, and each piece of output (literal text included: output gathered by a
   `{% set %}` block or a macro is held until it is joined), is charged to the render's budget:
   MAX_BUILT_CHARS characters and MAX_BUILT_ITEMS items in all. What a render holds beside its
   input is what it built, so at most MAX_BUILT_CHARS characters (4 bytes each at most) and
   MAX_BUILT_ITEMS items (a slot, and an object where the item is a new one).

Sizes are upper bounds from the operands (`text_size`: exact for a string, from the digits of a
number, summed over a container's items with room for their quoting); an operation that only
rewrites its input (case, escaping, trimming) is bounded by a small multiple of it, and its result
is checked and charged when it exists. With service.text.render_limit's CPU-time watchdog this
bounds a render: every operation is a bounded one (tens of milliseconds of one C call at most, on a
value of MAX_VALUE_CHARS), so the interpreter lock changes hands between them and the server answers
while a template runs; a render stops at its CPU seconds or the first bound it passes, and what it
built is freed then. A render runs inside `bounded_render`, which gives it its budget.

This module is the environment, wired to its parts: template_budget.py (the bounds and the render's
budget), template_sizes.py (upper bounds of sizes) and template_guards.py (the checks on str.format,
methods, filters and operators).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.nodes import Concat
from jinja2.runtime import Context, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, pass_context
from markupsafe import Markup

from service.text.template_budget import (
    MAX_MESSAGE_CHARS,
    MAX_POWER_BITS,
    ChatTemplateError,
    charge,
    charged,
    check_size,
)
from service.text.template_guards import (
    FILTER_CHECKS,
    BoundedEscapeFormatter,
    BoundedFormatter,
    BoundedFormatting,
    bounded_add,
    bounded_filter,
    bounded_pprint,
    bounded_sum,
    bounded_wordcount,
    check_call,
    power_bits,
)
from service.text.template_sizes import as_number, checked_items, printf_size, text_size

__all__ = [
    "TemplateEnvironment",
    "jinja_env",
]


class _CodeGenerator(CodeGenerator):
    """Jinja's compiler, with `~` joined by the environment (which bounds it) and literal output
    charged to the render (it may be gathered, many times over, by a loop in a `{% set %}` block)."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.join_text(context, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def _output_const_repr(self, group: Iterable[Any]) -> str:
        return f"environment.literal({super()._output_const_repr(group)})"


class TemplateEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox whose every value-building operation is bounded (see the module)."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})  # none is folded at compile

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":
            return bounded_add(left, right)
        if operator == "*":
            for value, times in ((left, right), (right, left)):
                if isinstance(value, (str, bytes, list, tuple)) and isinstance(times, int):
                    size = len(value) * max(times, 0)
                    charge(
                        **({"chars": size} if isinstance(value, (str, bytes)) else {"items": size}), what="*"
                    )
        elif operator == "%" and isinstance(left, (str, bytes, bytearray)):
            charge(chars=printf_size(left, right), what="%")
        elif operator == "**" and power_bits(left, right) > MAX_POWER_BITS:
            raise ChatTemplateError(f"chat template computed a power of over {MAX_POWER_BITS} bits; stopped")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = check_call(__obj, args, kwargs)
        return charged(super().call(__context, __obj, *args, **kwargs), getattr(__obj, "__name__", "call"))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """str.format and format_map through the bounded formatter (Jinja's own, sandboxed)."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        owner: str = value.__self__
        formatter: BoundedFormatting
        if isinstance(owner, Markup):
            formatter = BoundedEscapeFormatter(self, escape=owner.escape)
        else:
            formatter = BoundedFormatter(self)
        is_map = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            if not is_map:
                return type(owner)(formatter.vformat(owner, args, kwargs))
            if kwargs or len(args) != 1:
                raise TypeError("format_map() takes exactly one argument and no keywords")
            return type(owner)(formatter.vformat(owner, (), args[0]))

        bounded.__name__ = value.__name__
        return bounded

    def handle_exception(self, source: str | None = None) -> NoReturn:
        """Re-raise a render's exception as it is. Jinja rewrites its traceback to show template
        lines, with frames made to hold the template's variables, tied to the exception in a cycle:
        all the render built would stay in memory until the cyclic collector ran (our refusals
        name no template line)."""
        raise  # the exception being handled: this runs inside Jinja's except

    def join_text(self, context: Context, parts: Sequence[Any]) -> str:
        """`a ~ b ~ ...`: each part's text, joined."""
        charge(chars=sum(text_size(p) for p in parts), what="~")
        return markup_join(parts) if context.eval_ctx.autoescape else str_join(parts)

    @staticmethod
    def literal(text: str) -> str:
        """A piece of the template's own text, output."""
        charge(chars=len(text), items=1, what="output")
        return text


@pass_context
def _output(context: Context, value: Any) -> Any:
    """The finalize step: an output value's text is checked and charged before it is written."""
    charge(chars=text_size(value), items=1, what="output")
    return value


def _raise_exception(message: Any) -> None:
    text = str(message) if isinstance(message, str) else "raise_exception"
    raise ChatTemplateError(text[:MAX_MESSAGE_CHARS])


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # Jinja's own `tojson` HTML-escapes; templates are written against transformers' version, which does not.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: Any) -> str:
    # strftime writes up to 256 characters per format character (Python's time.strftime stops there)
    check_size(chars=256 * text_size(fmt), what="strftime_now")
    return datetime.now().strftime(fmt)


def _lipsum(n: Any = 5, html: Any = True, min: Any = 20, max: Any = 100) -> Any:
    check_size(chars=as_number(n) * (as_number(max) * 16 + 32), items=as_number(n), what="lipsum")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


class _TemplateDict:
    """`dict(...)` for templates without handing them the `dict` type itself (as transformers does)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*(checked_items(a, "dict") for a in args), **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict[Any, Any]:
        return dict.fromkeys(checked_items(keys, "dict.fromkeys"), value)


class _TemplateNamespace(Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})"
            )


_ENV: TemplateEnvironment | None = None
_ENV_LOCK = threading.Lock()


def jinja_env() -> TemplateEnvironment:
    """The environment transformers renders chat templates in (less its `{% generation %}` tag),
    bounded."""
    global _ENV
    with _ENV_LOCK:
        if _ENV is None:
            env = TemplateEnvironment(
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=[jinja2.ext.loopcontrols],
                optimized=False,
                finalize=_output,
            )
            env.filters["tojson"] = _tojson
            env.filters["pprint"] = bounded_pprint
            env.filters["sum"] = pass_context(
                lambda context, *a, **k: bounded_sum(context.environment, *a, **k)
            )
            env.filters["wordcount"] = bounded_wordcount
            env.filters = {
                name: bounded_filter(name, original, FILTER_CHECKS.get(name))
                for name, original in env.filters.items()
            }
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            env.globals["lipsum"] = _lipsum
            env.globals["dict"] = _TemplateDict()
            env.globals["namespace"] = _TemplateNamespace
            _ENV = env
        return _ENV
