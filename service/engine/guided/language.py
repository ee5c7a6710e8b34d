"""Whether a grammar's language is empty: no text satisfies it (`root ::= root`, a `$ref` cycle, a
pattern that matches nothing), told from xgrammar's own printed grammar before anything compiles."""

from __future__ import annotations

import json
from typing import Any

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
