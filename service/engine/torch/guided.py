"""Structured output for the torch engine through xgrammar: each constraint checked and compiled
under limits before its request is admitted, then a per-row token bitmask applied to the logits of
a mixed batch before sampling.

Compiling a request's GuidedDecoding (`GrammarCompiler.prepare`, awaited by TorchEngine.check):

1. Refused at once when larger than NIM_MAX_GUIDED_SPEC_BYTES, and a JSON schema when it uses a
   keyword xgrammar would accept and silently not enforce (`unenforced_keyword`: `not`, `if`,
   `contains`, `uniqueItems`, an assertion beside `$ref` / `const` / `enum` / `anyOf` / `allOf`, a
   string or number bound on a schema without a type, ...).
2. A compile slot is awaited: NIM_GUIDED_COMPILE_WORKERS compiles run at once, the rest wait, and
   a wait ends when the request is cancelled (its client left).
3. A worker process checks it under NIM_GUIDED_COMPILE_TIMEOUT_SECONDS: the spec becomes a grammar,
   which is refused when xgrammar warns that it ignores part of it (allOf of several schemas,
   multipleOf on numbers, a lookahead in a pattern, ...) or when its language is empty (no text
   satisfies it: `root ::= root`, a `$ref` cycle, a pattern matching nothing; `empty_language`),
   and is then compiled. A worker past the limit, or whose request was cancelled, is killed
   (SIGKILL) and reaped, and a replacement is started.
4. Only then does this process compile the same grammar, on a daemon thread that keeps the slot.
5. The result is cached by spec, bounded by NIM_GUIDED_CACHE_BYTES (xgrammar's own estimate of a
   compiled grammar's memory, least recently used out); an entry stays while a request that was
   checked with it lives, so the step thread finds it. Refusals are cached too (by count).

Why a process, and why compile twice. xgrammar compiles in C++, releasing the GIL but never
returning early, so a thread can be neither stopped nor timed out: only a process can be. Its
CompiledGrammar serializes (serialize_json) and reads back with the tokenizer info, but the text
grows out of all proportion for objects with optional properties. Measured with xgrammar 0.2.8 and
this model's 49,152-token vocabulary, one core:

    spec                          compile   memory    serialized   write    read back
    5,000 choices                  0.04 s   0.36 MB      0.35 MB   0.01 s     0.003 s
    200 optional properties        0.04 s    1.5 MB        25 MB    2.2 s      0.36 s
    1,000 optional properties       1.0 s    7.6 MB       637 MB     45 s       10 s
    2,000 optional properties      16.4 s   (57 KB of schema; 20,000 were still going at 14 min)

So the worker answers only "compiles within the limit, and how long it took"; the second compile
here then costs what the first did (milliseconds for ordinary schemas, at most about the limit),
on a thread that releases the GIL (the event loop went at most 21 ms without running during a
1.5 s compile). A worker starts in about 2.5 s (importing xgrammar imports torch), on the first
constrained request; the server's own start-up is unchanged. Workers exit when the server does
(they watch their parent), and are killed when the compiler is collected or the process exits.
xgrammar's memory estimate follows the process's resident memory within ~1.5x (measured: 10
300-property objects, 23.9 MB estimated, 27.2 MB resident; 200 small schemas with maxLength,
375 MB estimated, 351 MB resident), so the cache is bounded by its sum.

Token text for xgrammar is each token's raw bytes (Tokenizer.token_bytes); special tokens other
than the end-of-sequence ones are given no text, so a grammar never lets them through. The runner
keeps one GrammarMatcher per constrained request for as long as it lives (preemption keeps it:
recomputed tokens are not sampled again). Each step, before sampling, the constrained rows' allowed
tokens are written into one bitmask and applied in place (disallowed logits become -inf); after
sampling each matcher accepts its row's token. The end-of-sequence tokens are allowed exactly when
the grammar is complete, so a constrained answer ends with one (unless max_tokens cuts it short,
which OpenAI reports as finish_reason "length"). A constraint with `start_after` (a reasoning
model's `</think>`) leaves its row unmasked, and its matcher untouched, until those tokens have been
generated: the thinking is free, the answer after it is constrained. Where the prompt left it open
whether the model thinks (`opens_with`: its `<think>`), the first token decides: the thinking's
opening, or the grammar's first token, constrained from there (GuidedRow).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pickle
import re
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

from service.engine.config import GuidedLimits
from service.engine.protocol import GuidedDecoding

if TYPE_CHECKING:  # not imported at run time: a compile worker reads its vocabulary before torch loads
    import torch

    from service.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

REFUSALS_KEPT = 256  # refused specs remembered (each at most NIM_MAX_GUIDED_SPEC_BYTES)
WORKER_START_TIMEOUT_S = 120.0  # a worker not ready by then (imports, vocabulary) has failed
WORKER_RSS_LIMIT = 1 << 30  # a worker holding more after a compile is replaced (it starts at ~0.3 GB)
UNKNOWN_GRAMMAR_BYTES = 1 << 20  # the cache's charge for a grammar whose xgrammar reports no size


class GrammarError(ValueError):
    """A schema, regex, grammar or choice list that is refused (it does not compile, cannot be
    enforced, admits no text, or is over a limit); the message says why, in one line."""


class GuidedUnavailableError(RuntimeError):
    """xgrammar is not installed, or its compile worker cannot start: no structured output."""


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


# response_format json_object: any object (arbitrary properties and values), never an array or scalar.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


# --- What a spec may be, told before compiling ------------------------------------------------


def spec_bytes(guided: GuidedDecoding) -> int:
    """The size NIM_MAX_GUIDED_SPEC_BYTES limits: the spec and any literal text around it, in UTF-8."""
    return sum(
        len(text.encode("utf-8", "surrogatepass")) for text in (guided.spec, guided.prefix, guided.suffix)
    )


def check_spec(guided: GuidedDecoding, max_bytes: int) -> None:
    """GrammarError when `guided` is over the size limit, or is a JSON schema that asks for what
    xgrammar would not enforce. Cheap: runs before any compile."""
    name = _NAMES[guided.kind]
    size = spec_bytes(guided)
    if size > max_bytes:
        raise GrammarError(
            f"the {name} is {size} bytes, over NIM_MAX_GUIDED_SPEC_BYTES={max_bytes}; make it smaller"
        )
    if guided.kind != "json_schema":
        return
    try:
        schema = json.loads(guided.spec)
    except RecursionError:
        raise GrammarError("invalid JSON schema: nested too deeply") from None
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None
    found = unenforced_keyword(schema)
    if found is not None:
        raise GrammarError(
            f"JSON schema keyword {found} is not enforced by structured output (xgrammar would "
            "ignore it): remove it or say it another way"
        )


# Keywords xgrammar accepts and ignores wherever they are (checked against the installed version
# by tests/test_guided_keywords.py, which fails when one starts being enforced).
_NEVER_ENFORCED = ("not", "if", "then", "else", "contains", "$dynamicRef", "$recursiveRef")
# Standard formats xgrammar treats as any string (it enforces the others it knows: date-time,
# date, time, duration, email, hostname, ipv4, ipv6, uri, uri-reference, uuid, ...). Formats
# outside the standard are annotations, as JSON Schema says, and pass.
_UNENFORCED_FORMATS = frozenset({"iri", "iri-reference", "idn-email", "idn-hostname", "regex"})
# xgrammar reads the first of these a schema has and drops that schema's other assertions.
_BRANCHES = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_ASSERTIONS = frozenset(
    {
        "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
        "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
        "uniqueItems", "contains", "items", "prefixItems", "additionalItems", "unevaluatedItems",
        "maxProperties", "minProperties", "required", "dependentRequired", "dependencies",
        "dependentSchemas", "properties", "patternProperties", "additionalProperties",
        "unevaluatedProperties", "propertyNames", "allOf", "anyOf", "oneOf", "$ref",
    }
)  # fmt: skip
# Bounds xgrammar applies only once it knows the instance's type: from `type`, or, for arrays and
# objects, from `items` / `prefixItems` and `properties` / `additionalProperties`.
_TYPED = ("pattern", "minLength", "maxLength", "format", "minimum", "maximum", "exclusiveMinimum",
          "exclusiveMaximum", "multipleOf")  # fmt: skip
_ARRAY_BOUNDS = ("minItems", "maxItems")
_OBJECT_BOUNDS = ("required", "minProperties", "maxProperties", "patternProperties", "propertyNames",
                  "dependentRequired", "dependentSchemas")  # fmt: skip
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "unevaluatedItems",
                  "unevaluatedProperties", "propertyNames", "contains", "not", "if", "then",
                  "else")  # fmt: skip
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def unenforced_keyword(schema: Any) -> str | None:
    """The first keyword of `schema` (or of any schema inside it) that xgrammar would accept and not
    enforce, with where it is ("'not' at #/properties/a"); None when there is none."""
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        found = _unenforced_here(node, schema)
        if found is not None:
            return f"{found} at {path}"
        children: list[tuple[Any, str]] = []
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                children += [(sub, f"{path}/{key}/{_escape(name)}") for name, sub in node[key].items()]
        children += [
            (node[key], f"{path}/{key}") for key in _SCHEMA_VALUES if isinstance(node.get(key), dict)
        ]
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                children += [(sub, f"{path}/{key}/{i}") for i, sub in enumerate(node[key])]
        stack += reversed(children)
    return None


def _unenforced_here(node: dict[str, Any], root: Any) -> str | None:
    for key in _NEVER_ENFORCED:
        if key in node:
            return f"'{key}'"
    if node.get("uniqueItems") is True:
        return "'uniqueItems'"
    if node.get("format") in _UNENFORCED_FORMATS:
        return f"'format' {node['format']!r}"
    if isinstance(node.get("oneOf"), list) and not _disjoint(node["oneOf"], root):
        return "'oneOf' (its options may overlap, and xgrammar enforces it as anyOf: say anyOf)"
    branch = next((key for key in _BRANCHES if key in node), None)
    if branch is not None:
        dropped = sorted(key for key in _ASSERTIONS & node.keys() if key != branch)
        if dropped == ["type"] and _type_is_implied(node, branch):
            return None
        return f"'{dropped[0]}' beside '{branch}'" if dropped else None
    if "type" not in node:
        bounds = list(_TYPED)
        if "items" not in node and "prefixItems" not in node:
            bounds += _ARRAY_BOUNDS
        if "properties" not in node and "additionalProperties" not in node:
            bounds += _OBJECT_BOUNDS
        for key in bounds:
            if key in node:
                return f"'{key}' in a schema without 'type'"
    required, properties = node.get("required"), node.get("properties")
    if isinstance(required, list):
        known = properties if isinstance(properties, dict) else {}
        missing = [name for name in required if name not in known]
        if missing:
            return f"'required' (naming {missing[0]!r}, which 'properties' does not define)"
    return None


def _type_is_implied(node: dict[str, Any], branch: str) -> bool:
    """Whether `type` beside `branch` says nothing the branch does not (so dropping it is harmless)."""
    declared = node["type"] if isinstance(node["type"], list) else [node["type"]]
    checks = [_JSON_TYPES[t] for t in declared if isinstance(t, str) and t in _JSON_TYPES]
    if branch in ("const", "enum"):
        values = [node["const"]] if branch == "const" else node["enum"]
        return isinstance(values, list) and all(any(check(v) for check in checks) for v in values)
    if branch in ("anyOf", "oneOf") and isinstance(node[branch], list):
        for option in node[branch]:
            types = option.get("type") if isinstance(option, dict) else None
            types = types if isinstance(types, list) else [types]
            if not all(t in declared or (t == "integer" and "number" in declared) for t in types):
                return False
        return True
    return False


def _disjoint(options: list[Any], root: Any) -> bool:
    """Whether no instance can match two of `options` (so oneOf means anyOf): their types are
    apart, or they all require one property to hold different constants (a discriminator)."""
    resolved = [_resolve(option, root) for option in options]
    if not all(isinstance(option, dict) for option in resolved):
        return False
    kinds = [_types(option) for option in resolved]
    if all(kinds) and all(not (a & b) for i, a in enumerate(kinds) for b in kinds[i + 1 :]):
        return True
    first = resolved[0].get("properties")
    for name in first if isinstance(first, dict) else ():
        constants = []
        for option in resolved:
            properties, required = option.get("properties"), option.get("required")
            value = _resolve(properties.get(name), root) if isinstance(properties, dict) else None
            if not isinstance(required, list) or name not in required or not isinstance(value, dict):
                break
            if "const" not in value:
                break
            constants.append(json.dumps(value["const"], sort_keys=True))
        else:
            if len(set(constants)) == len(constants):
                return True
    return False


def _types(schema: dict[str, Any]) -> frozenset[str]:
    declared = schema.get("type")
    names = set(declared if isinstance(declared, list) else [declared] if isinstance(declared, str) else [])
    if "number" in names:
        names.add("integer")
    return frozenset(names)


def _resolve(node: Any, root: Any) -> Any:
    """`node`, or what its local `$ref` ("#/$defs/a") points at (None when it points nowhere)."""
    for _ in range(32):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not isinstance(ref, str):
            return node
        if not ref.startswith("#"):
            return None
        node = root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
    return None


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


# --- The language of a grammar --------------------------------------------------------------

# xgrammar's GrammarExprType, in the order of its enum (stable since 0.1; later members are
# treated as satisfiable). Each expression in a serialized grammar is [type, length, data...].
_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _RULE_REF, _SEQUENCE, _CHOICES, _TAG_DISPATCH, _REPEAT = range(9)
_MAX_CODEPOINT = 0x10FFFF
_MAX_ALTERNATIVES = 64  # a sequence of choices expanding past this is taken to be satisfiable


def empty_language(grammar: Any) -> str | None:
    """Why no text satisfies `grammar` (an xgrammar Grammar), or None when some text does, or when
    its serialized form is not one this reads (then only generation can tell).

    A rule is productive when one of its alternatives needs only productive rules (a terminal is
    productive unless it is an empty character class; a repetition needs its rule only when it
    must repeat at least once). Productive rules are found by propagation, each alternative waiting
    on a count of the rules it still needs, so the work is linear in the grammar's size; the
    language is empty exactly when the root rule is not productive.
    """
    try:
        data = json.loads(grammar.serialize_json())
        exprs, starts, rules = data["grammar_expr_data"], data["grammar_expr_indptr"], data["rules"]
        root = data["root_rule_id"]
        bodies = [rule[1] for rule in rules]
        names = [str(rule[0]) for rule in rules]
    except (AttributeError, KeyError, TypeError, IndexError, ValueError):
        return None
    memo: dict[int, list[frozenset[int]]] = {}

    def alternatives(expr_id: int) -> list[frozenset[int]]:
        """The sets of rules each way of matching the expression needs; [] when none can match."""
        if expr_id in memo:
            return memo[expr_id]
        start = starts[expr_id]
        kind, length = exprs[start], exprs[start + 1]
        args = exprs[start + 2 : start + 2 + length]
        found: list[frozenset[int]]
        if kind == _CLASS:
            found = [] if _class_is_empty(args) else [frozenset()]
        elif kind == _RULE_REF:
            found = [frozenset(args[:1])]
        elif kind == _REPEAT:
            found = [frozenset()] if args[1] == 0 else [frozenset(args[:1])]
        elif kind == _SEQUENCE:
            found = [frozenset()]
            for child in args:
                found = [a | b for a in found for b in alternatives(child)]
                if len(found) > _MAX_ALTERNATIVES:
                    found = [frozenset()]
                    break
        elif kind == _CHOICES:
            found = [alt for child in args for alt in alternatives(child)]
        else:  # bytes, the empty string, a class star, and what this does not model
            found = [frozenset()]
        memo[expr_id] = found
        return found

    try:
        clauses = [(rule, needs) for rule, body in enumerate(bodies) for needs in alternatives(body)]
    except (IndexError, TypeError, RecursionError):
        return None
    productive: set[int] = set()
    ready = [rule for rule, needs in clauses if not needs]
    waiting: dict[int, list[int]] = {}
    missing = [len(needs) for _, needs in clauses]
    for index, (_, needs) in enumerate(clauses):
        for rule in needs:
            waiting.setdefault(rule, []).append(index)
    while ready:
        rule = ready.pop()
        if rule in productive:
            continue
        productive.add(rule)
        for index in waiting.get(rule, ()):
            missing[index] -= 1
            if missing[index] == 0:
                ready.append(clauses[index][0])
    if root in productive:
        return None
    stuck = [names[rule] for rule in range(len(rules)) if rule not in productive and rule != root]
    detail = f"; rules that can never end: {', '.join(stuck[:4])}" if stuck else ""
    return f"rule '{names[root]}' can never end{detail}"


def _class_is_empty(args: list[int]) -> bool:
    """[negated, lo0, hi0, lo1, hi1, ...]: whether the class admits no code point."""
    negated, ranges = args[0], sorted(zip(args[1::2], args[2::2], strict=True))
    if not negated:
        return not ranges
    covered = 0  # code points below this are all excluded
    for low, high in ranges:
        if low > covered:
            return False
        covered = max(covered, high + 1)
    return covered > _MAX_CODEPOINT


def _grammar(xgrammar: Any, guided: GuidedDecoding) -> Any:
    """The xgrammar Grammar of `guided`; GrammarError when it does not parse."""
    grammar = xgrammar.Grammar
    try:
        if guided.kind == "json_schema":
            parts = [grammar.from_json_schema(guided.spec, any_whitespace=False)]
            if guided.prefix:
                parts.insert(0, grammar.from_ebnf(f"root ::= {json.dumps(guided.prefix)}"))
            if guided.suffix:
                parts.append(grammar.from_ebnf(f"root ::= {json.dumps(guided.suffix)}"))
            return parts[0] if len(parts) == 1 else grammar.concat(*parts)
        if guided.kind == "json_object":  # OpenAI's JSON mode: an object, not any JSON value
            return grammar.from_json_schema(JSON_OBJECT_SCHEMA)
        if guided.kind == "regex":
            return grammar.from_regex(guided.spec)
        if guided.kind == "choice":
            choices = json.loads(guided.spec)
            return grammar.from_ebnf("root ::= " + " | ".join(json.dumps(choice) for choice in choices))
        return grammar.from_ebnf(guided.spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(f"invalid {_NAMES[guided.kind]}: {_first_line(exc)}") from exc


# --- The compile worker process ---------------------------------------------------------------

_HEADER = struct.Struct("<Q")


def _frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _send(fd: int, message: object) -> None:
    _write_all(fd, _frame(message))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _receive(fd: int, deadline: float | None = None) -> Any:
    """One message from `fd`; TimeoutError past `deadline` (monotonic), EOFError when it closes."""
    (length,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exactly(fd, length, deadline))


def _read_exactly(fd: int, size: int, deadline: float | None) -> bytes:
    chunks: list[bytes] = []
    while size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _worker_main() -> None:
    """A compile worker: its vocabulary, then one GuidedDecoding at a time, from its stdin; for each
    ("ok", seconds, grammar bytes, resident bytes) or ("refused", message) on its stdout. It exits
    when stdin closes or its parent is gone (checked twice a second, also while xgrammar compiles:
    it releases the GIL)."""
    commands, answers = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)  # stray prints go to the log, not into the answers
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), name="parent-watch", daemon=True).start()
    vocabulary, vocab_size, stop_token_ids = _receive(commands)
    import xgrammar

    info = xgrammar.TokenizerInfo(
        vocabulary, xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _send(answers, ("ready", os.getpid()))
    with tempfile.TemporaryFile() as warnings:
        while True:
            try:
                guided = _receive(commands)
            except EOFError:
                return
            _send(answers, _compile_checked(xgrammar, compiler, guided, warnings))


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def _compile_checked(
    xgrammar: Any, compiler: Any, guided: GuidedDecoding, warnings: IO[bytes]
) -> tuple[Any, ...]:
    """In the worker: refuse what does not parse, what xgrammar warns it ignores, and what admits no
    text; else compile (the parent compiles again: this is the timed, killable check)."""
    name = _NAMES[guided.kind]
    started = time.perf_counter()
    try:
        with _capture_stderr(warnings):
            grammar = _grammar(xgrammar, guided)
        _refuse_warnings(name, warnings)
        why = empty_language(grammar)
        if why is not None:
            raise GrammarError(
                f"the {name} admits no token sequence that completes it: no text can satisfy it ({why})"
            )
        with _capture_stderr(warnings):
            compiled = compiler.compile_grammar(grammar)
        _refuse_warnings(name, warnings)
    except GrammarError as exc:
        return ("refused", str(exc))
    except (RuntimeError, ValueError, TypeError) as exc:
        return ("refused", f"invalid {name}: {_first_line(exc)}")
    return ("ok", time.perf_counter() - started, _memory_bytes(compiled), _resident_bytes())


@contextlib.contextmanager
def _capture_stderr(into: IO[bytes]) -> Iterator[None]:
    """File descriptor 2 (where xgrammar's C++ code logs its warnings) into `into`, for a while."""
    sys.stderr.flush()
    into.seek(0)
    into.truncate()
    saved = os.dup(2)
    os.dup2(into.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _refuse_warnings(name: str, captured: IO[bytes]) -> None:
    captured.seek(0)
    text = captured.read().decode("utf-8", "replace")
    for line in text.splitlines():
        if "Warning: " in line and "oneOf" not in line:  # oneOf: told apart before (`_disjoint`)
            warning = line.split("Warning: ", 1)[1].strip()[:300]
            raise GrammarError(
                f"the {name} cannot be enforced as written: xgrammar would ignore part of it ({warning})"
            )


def _resident_bytes() -> int:
    """This process's resident memory (0 where /proc does not say)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _memory_bytes(compiled: Any) -> int:
    size = getattr(compiled, "memory_size_bytes", None)
    return int(size) if isinstance(size, int) else UNKNOWN_GRAMMAR_BYTES


_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])
_WORKER_CODE = (
    f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); "
    "from service.engine.torch.guided import _worker_main; _worker_main()"
)


class _WorkerFailedError(RuntimeError):
    """The worker did not start (not the spec's fault: the request gets a 500)."""


class _CompileCrashedError(RuntimeError):
    """The worker died compiling (the spec's doing, or its request's cancel); the exit code."""


class _Worker:
    """One compile process, used by one job at a time (the holder of a compile slot). Started when
    first needed and again after it is killed; `kill` may come from any thread."""

    def __init__(self, init: bytes) -> None:
        self._init = init  # the framed vocabulary message, sent to each process it starts
        self._process: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._lock = threading.Lock()  # held briefly: the process handle against kill() and reap

    @property
    def pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None else None

    @property
    def ready(self) -> bool:
        """Whether a compile can start at once (its start-up is over, or its ready message waits)."""
        process = self._process
        if process is None or process.stdout is None or process.poll() is not None:
            return False
        return self._ready or bool(select.select([process.stdout.fileno()], [], [], 0)[0])

    def start(self) -> None:
        """A fresh process, sent its vocabulary (it reads that before its slow imports)."""
        self.reap()
        process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            close_fds=True,
            start_new_session=True,  # a terminal's ^C is the server's to handle, not the worker's
        )
        with self._lock:
            self._process, self._ready = process, False
        assert process.stdin is not None
        try:
            _write_all(process.stdin.fileno(), self._init)
        except OSError as exc:
            self.reap()
            raise _WorkerFailedError(f"the compile worker did not start: {exc}") from None

    def compile(self, guided: GuidedDecoding, timeout_s: float) -> tuple[Any, ...]:
        """The worker's answer for `guided`; TimeoutError (the worker is killed) past `timeout_s`,
        counted from when the job is sent; _CompileCrashedError when it dies compiling, and
        _WorkerFailedError when it cannot start."""
        process = self._ensure_ready()
        assert process.stdin is not None and process.stdout is not None
        try:
            _send(process.stdin.fileno(), guided)
            return tuple(_receive(process.stdout.fileno(), time.monotonic() + timeout_s))
        except TimeoutError:
            self.reap()
            raise
        except (EOFError, OSError, pickle.UnpicklingError):
            raise _CompileCrashedError(self.reap()) from None

    def _ensure_ready(self) -> subprocess.Popen[bytes]:
        process = self._process
        if process is None or process.poll() is not None:
            self.start()
            process = self._process
        assert process is not None and process.stdout is not None
        if not self._ready:
            try:
                _receive(process.stdout.fileno(), time.monotonic() + WORKER_START_TIMEOUT_S)
            except (TimeoutError, EOFError, OSError, pickle.UnpicklingError):
                code = self.reap()
                raise _WorkerFailedError(f"the compile worker did not start (code {code})") from None
            self._ready = True
        return process

    def kill(self) -> int | None:
        """SIGKILL, from any thread; the job's thread then reaps. The pid killed, if any."""
        with self._lock:
            process = self._process
            if process is None or process.returncode is not None:
                return None
            process.kill()
            return process.pid

    def reap(self) -> int | None:
        """Kill (if alive), wait for and forget the process; its exit code."""
        with self._lock:
            process, self._process, self._ready = self._process, None, False
            if process is None:
                return None
            if process.returncode is None:
                process.kill()
        code = process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()
        return code


def _stop_workers(workers: list[_Worker], closed: threading.Event) -> None:
    closed.set()  # no replacements from here on
    for worker in workers:
        worker.reap()


# --- Slots: a bound on compiles, awaited on any event loop, released from any thread -----------


@dataclass(eq=False)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    granted: bool = False


class _Slots:
    """At most `n` holders. `acquire` waits in arrival order and can be cancelled; `release` may be
    called from any thread (a job's thread releases its slot when it is done)."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._waiters: deque[_Waiter] = deque()
        self._lock = threading.Lock()

    async def acquire(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._free and not self._waiters:
                self._free -= 1
                return
            waiter = _Waiter(loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            with self._lock:
                granted = waiter.granted
                if not granted:
                    self._waiters.remove(waiter)
            if granted:  # the slot came as the wait was cancelled: pass it on
                self.release()
            raise

    def release(self) -> None:
        with self._lock:
            while self._waiters:
                waiter = self._waiters.popleft()
                waiter.granted = True
                try:
                    waiter.loop.call_soon_threadsafe(_wake, waiter.future)
                except RuntimeError:  # its event loop is closed: the next one
                    continue
                return
            self._free += 1


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# --- The compiled grammars kept -----------------------------------------------------------------


@dataclass
class _Entry:
    compiled: Any
    nbytes: int
    pins: int = 0  # requests checked with it that still live


class _GrammarCache:
    """Compiled grammars by spec, least recently used out past `budget` bytes; a pinned entry stays
    (it may take the total over the budget: by at most what the requests in flight use)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.total = 0
        self._entries: OrderedDict[GuidedDecoding, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: GuidedDecoding, pin_for: object | None = None) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            if pin_for is not None:
                self._pin(key, entry, pin_for)
            return entry.compiled

    def put(self, key: GuidedDecoding, compiled: Any, nbytes: int, pin_for: object | None = None) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(compiled, nbytes)
                self.total += nbytes
            self._entries.move_to_end(key)
            if pin_for is not None:
                self._pin(key, entry, pin_for)
            self._evict()

    def _pin(self, key: GuidedDecoding, entry: _Entry, owner: object) -> None:
        entry.pins += 1
        weakref.finalize(owner, self._unpin, key)

    def _unpin(self, key: GuidedDecoding) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.pins -= 1
                self._evict()

    def _evict(self) -> None:
        if self.total <= self.budget:
            return
        for key in [key for key, entry in self._entries.items() if not entry.pins]:
            self.total -= self._entries.pop(key).nbytes
            if self.total <= self.budget:
                return


# --- The compiler ---------------------------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    guided: GuidedDecoding
    owner: object  # the request's own GuidedDecoding: its compiled grammar is pinned while it lives
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    cancelled: bool = False
    worker: _Worker | None = None  # while the worker compiles it


class GrammarCompiler:
    """Checks and compiles GuidedDecoding specs for one tokenizer and vocabulary, under `limits`;
    thread-safe. `prepare` (async, before a request is admitted) is the checked path; `compile`
    and `matcher` (the step thread) find what it cached."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, limits: GuidedLimits | None = None) -> None:
        try:
            import xgrammar
        except ImportError as exc:
            raise GuidedUnavailableError(
                "structured output needs xgrammar, which is not installed "
                "(pip install 'nim-torch[structured]')"
            ) from exc
        self._xgr = xgrammar
        self.limits = limits or GuidedLimits()
        encoded = [
            b"" if tokenizer.is_special(i) and i not in tokenizer.eos_token_ids else tokenizer.token_bytes(i)
            for i in range(tokenizer.vocab_size)
        ]
        stop_token_ids = list(tokenizer.eos_token_ids)
        info = xgrammar.TokenizerInfo(
            encoded, xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache = _GrammarCache(self.limits.cache_bytes)
        self._refused: OrderedDict[GuidedDecoding, str] = OrderedDict()
        self._refused_lock = threading.Lock()
        self._slots = _Slots(self.limits.compile_workers)
        init = _frame((encoded, vocab_size, stop_token_ids))
        self._workers = [_Worker(init) for _ in range(self.limits.compile_workers)]
        self._idle = list(self._workers)
        self._idle_lock = threading.Lock()
        self._closed = threading.Event()
        weakref.finalize(self, _stop_workers, self._workers, self._closed)  # also at exit
        for worker in self._workers:  # each then imports xgrammar (seconds) while requests go on
            self._restart(worker)

    def close(self) -> None:
        """Kill the workers; compiles after this start them again, but no replacement starts."""
        _stop_workers(self._workers, self._closed)

    @property
    def worker_pids(self) -> list[int]:
        return [pid for pid in (worker.pid for worker in self._workers) if pid is not None]

    async def prepare(self, guided: GuidedDecoding) -> None:
        """Refuse `guided` (GrammarError, one line) or compile and cache it, under the limits. Its
        compiled grammar stays cached while this `guided` object lives (the request carries it to
        the step). Cancelling stops the compile (its worker is killed) or the wait for a slot."""
        if self._known(guided):
            return
        check_spec(guided, self.limits.max_spec_bytes)
        await self._slots.acquire()
        try:
            known = self._known(guided)  # compiled (or refused) while this waited: many ask at once
        except GrammarError:
            self._slots.release()
            raise
        if known:
            self._slots.release()
            return
        loop = asyncio.get_running_loop()
        job = _Job(guided, guided, loop, loop.create_future())
        try:
            threading.Thread(target=self._run, args=(job,), name="grammar-compile", daemon=True).start()
        except BaseException:
            self._slots.release()
            raise
        try:
            await job.future
        except asyncio.CancelledError:
            self._cancel(job)
            raise

    def _known(self, guided: GuidedDecoding) -> bool:
        """True when `guided` is compiled already (pinned for this request), GrammarError when it
        was refused already, False when it has still to be compiled."""
        if self._cache.get(guided, pin_for=guided) is not None:
            return True
        with self._refused_lock:
            refused = self._refused.get(guided)
        if refused is not None:
            raise GrammarError(refused)
        return False

    def _cancel(self, job: _Job) -> None:
        job.cancelled = True
        worker = job.worker
        if worker is not None:
            pid = worker.kill()
            if pid is not None:
                log.info("structured output: request cancelled while its %s compiled; worker %d killed",
                         _NAMES[job.guided.kind], pid)  # fmt: skip

    def _run(self, job: _Job) -> None:
        """A job's thread: the worker's check, then this process's compile; holds the slot throughout."""
        with self._idle_lock:  # a ready one, if any: another may still be importing
            ready = [i for i, idle in enumerate(self._idle) if idle.ready]
            worker = self._idle.pop(ready[-1] if ready else -1)
        try:
            result = self._check_and_compile(job, worker)
        except BaseException as exc:  # handed to the request
            _settle(job, exc)
        else:
            _settle(job, result)
        finally:
            if worker.pid is None and not self._closed.is_set():  # killed: a replacement starts now
                self._restart(worker)
            with self._idle_lock:
                self._idle.append(worker)
            self._slots.release()

    def _check_and_compile(self, job: _Job, worker: _Worker) -> Any:
        guided, name = job.guided, _NAMES[job.guided.kind]
        timeout_s = self.limits.compile_timeout_s
        job.worker = worker
        if job.cancelled:  # after publishing the worker: a cancel either sees it or is seen here
            return None
        try:
            answer = worker.compile(guided, timeout_s)
        except TimeoutError:
            message = (
                f"the {name} did not compile within NIM_GUIDED_COMPILE_TIMEOUT_SECONDS={timeout_s:g} s; "
                "make it simpler (fewer optional properties, alternatives or nesting)"
            )
            log.warning("structured output: a %s compile passed %g s and was stopped", name, timeout_s)
            self._remember_refusal(guided, message)
            raise GrammarError(message) from None
        except _CompileCrashedError as exc:
            if job.cancelled:
                return None
            message = (
                f"the grammar compiler failed on this {name} (its process exited with code {exc.args[0]})"
            )
            log.warning("structured output: %s", message)
            self._remember_refusal(guided, message)
            raise GrammarError(message) from None
        except _WorkerFailedError as exc:
            if job.cancelled:
                return None
            log.warning("structured output: %s", exc)
            raise GuidedUnavailableError(f"structured output failed: {exc}") from None
        finally:
            job.worker = None
        if answer[0] == "refused":
            self._remember_refusal(guided, answer[1])
            raise GrammarError(answer[1])
        seconds, nbytes, resident = answer[1], answer[2], answer[3]
        log.debug("structured output: a %s compiled in %.3f s (%d bytes)", name, seconds, nbytes)
        if resident > WORKER_RSS_LIMIT:  # what the allocator kept after a large compile: start afresh
            worker.reap()
        if job.cancelled:
            return None
        compiled = self._compiler.compile_grammar(_grammar(self._xgr, guided))
        self._cache.put(guided, compiled, _memory_bytes(compiled), job.owner)
        return None

    def _restart(self, worker: _Worker) -> None:
        """A worker process started now, for the next compile (which waits for it to be ready)."""
        try:
            worker.start()
        except _WorkerFailedError as exc:
            log.warning("structured output: %s", exc)

    def _remember_refusal(self, guided: GuidedDecoding, message: str) -> None:
        with self._refused_lock:
            self._refused[guided] = message
            while len(self._refused) > REFUSALS_KEPT:
                self._refused.popitem(last=False)

    def compile(self, guided: GuidedDecoding) -> Any:
        """The compiled grammar for `guided`: the one `prepare` cached, else compiled here, at once
        and without limits (a request that did not pass through the engine's check)."""
        found = self._cache.get(guided)
        if found is not None:
            return found
        compiled = self._compiler.compile_grammar(_grammar(self._xgr, guided))
        self._cache.put(guided, compiled, _memory_bytes(compiled))
        return compiled

    def matcher(self, guided: GuidedDecoding) -> GuidedRow:
        return GuidedRow(
            self._xgr.GrammarMatcher(self.compile(guided)), guided.start_after, guided.opens_with
        )

    def bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
        """Disallowed tokens of rows `indices` of logits [R, V] become -inf, in place."""
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=indices)


def _settle(job: _Job, outcome: object) -> None:
    """Hand a job's result (or exception) to its request's event loop, if that is still there."""

    def settle() -> None:
        if job.future.done():
            return
        if isinstance(outcome, BaseException):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
        job.loop.call_soon_threadsafe(settle)


RowState = Literal["deciding", "opening", "thinking", "constrained"]


class GuidedRow:
    """One request's position in its grammar.

    Without `start_after` the grammar constrains from the first token. With it (a reasoning model's
    `</think>` ids, GuidedDecoding.start_after) the answer may think first, freely:

    - "deciding" (only with `opens_with`, the `<think>` ids, when the prompt left it open whether
      the model thinks): the first token is one the grammar allows or the first of `opens_with`.
      The latter, where the grammar would not take it, opens the thinking; any other token is the
      grammar's, which constrains from it on (a model that does not think gets its constraint).
    - "opening": the rest of `opens_with` is forced, one token a step.
    - "thinking": every token is allowed and the matcher neither masks nor advances, until
      `start_after` has been generated, in a row.
    - "constrained": the grammar's mask, and its matcher advances.
    """

    def __init__(
        self, matcher: Any, start_after: tuple[int, ...] = (), opens_with: tuple[int, ...] = ()
    ) -> None:
        self.matcher = matcher
        self.start_after = start_after
        self.opens_with = opens_with
        self.state: RowState = "constrained" if not start_after else "deciding" if opens_with else "thinking"
        self._opened = 0  # tokens of opens_with generated ("opening")
        self._grammar_takes_opening = False  # "deciding": whether the grammar allows opens_with[0]
        self._recent: deque[int] = deque(maxlen=max(len(start_after), 1))  # the last tokens, thinking

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        if self.state == "thinking":
            bitmask[index].fill_(-1)  # every bit set: every token allowed
        elif self.state == "opening":
            _only(bitmask, index, self.opens_with[self._opened])
        else:
            self.matcher.fill_next_token_bitmask(bitmask, index)
            if self.state == "deciding":
                first = self.opens_with[0]
                self._grammar_takes_opening = _allows(bitmask, index, first)
                _allow(bitmask, index, first)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar refuses it (the request must end)."""
        if self.state == "deciding":
            if token_id != self.opens_with[0] or self._grammar_takes_opening:
                self.state = "constrained"
                return bool(self.matcher.accept_token(token_id))
            self.state, self._opened = "opening", 0
        if self.state == "opening":
            if token_id != self.opens_with[self._opened]:
                return False
            self._opened += 1
            if self._opened == len(self.opens_with):
                self.state = "thinking"
            return True
        if self.state == "thinking":
            self._recent.append(token_id)
            if tuple(self._recent) == self.start_after:
                self.state = "constrained"
            return True
        return bool(self.matcher.accept_token(token_id))

    @property
    def finished(self) -> bool:
        return self.state == "constrained" and bool(self.matcher.is_terminated())


def _allows(bitmask: torch.Tensor, index: int, token_id: int) -> bool:
    """Whether row `index` of a token bitmask (int32 words, bit t % 32 of word t // 32) allows it."""
    return bool((int(bitmask[index, token_id >> 5]) >> (token_id & 31)) & 1)


def _allow(bitmask: torch.Tensor, index: int, token_id: int) -> None:
    word = int(bitmask[index, token_id >> 5]) | (1 << (token_id & 31))
    bitmask[index, token_id >> 5] = word - (1 << 32) if word >= 1 << 31 else word  # as int32


def _only(bitmask: torch.Tensor, index: int, token_id: int) -> None:
    bitmask[index].zero_()
    _allow(bitmask, index, token_id)


_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON grammar",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
}


def _first_line(exc: BaseException) -> str:
    """The library's message without its log prefix ("[12:00:00] /path/file.cc:83: ")."""
    text = str(exc).strip() or type(exc).__name__
    return _LOG_PREFIX.sub("", text.splitlines()[0])[:300]


_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
