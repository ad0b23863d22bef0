"""Pythonic tool calls: the output is a Python list of calls, each argument a keyword and a literal.

::

    [get_weather(city="Paris", days=3), lookup(query='tides', exact=True)]

Llama 3.2's and Llama 4's zero-shot call format and Gemma 3's as vLLM's tool templates teach it (vLLM
names the parser ``pythonic``; Llama 4's ``<|python_start|>`` wrapper is a special token, left out of
the text). The list is the output's start (after any blank), as Llama-3's bare JSON is. Values are
read as Python reads literals (``True``, ``None``, single quotes, tuples as lists; JSON's ``true`` /
``false`` / ``null`` too, as a template's ``tojson`` writes them into the history); a call whose
arguments are not all literals (a variable, an expression) is no call, and the output is content.

:class:`PythonicCallFormat` is the syntax. Its grammars write each argument by its tool's schema as a
Python literal: a string or number as its JSON (which Python reads alike) held to the schema by
llguidance, a boolean as ``True`` / ``False``, null as ``None``, an ``enum`` as one of its values,
objects and arrays literal by literal down their ``properties`` and ``items`` (keyword arguments and
an object's keys in the schema's order, those not required optional); where a schema says nothing a
value is any literal.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from engine.structured.grammar import JSON_LAYOUT
from server.tool_xml import _resolve, _types
from server.tools import ToolCall, _lit, _skip_ws, call_id

OPEN = "["
# A call's name and the parenthesis that opens its arguments: any function name (``get-weather`` too), read
# as written; a keyword likewise (the parser reads the value after it as a literal).
_CALL_HEAD = re.compile(r"([A-Za-z0-9_.-]+)\s*\(")
_KEYWORD = re.compile(r"\s*([^=()\[\]{}'\",]+?)\s*=(?!=)")  # (a name with blanks inside too)
_SURROGATE = re.compile("[\ud800-\udfff]")
_QUOTES = "'\""
# A string literal as Python reads it: its prefix (r, b, f...), then triple- or single-quoted, in either quote.
_STRING = re.compile(
    r"(?<![A-Za-z0-9_])([rRbBuUfF]{0,2})("
    r'"""(?:[^"\\]|\\[\s\S]|"(?!""))*"""'
    r"|'''(?:[^'\\]|\\[\s\S]|'(?!''))*'''"
    r'|"(?:[^"\\\n]|\\[\s\S])*"'
    r"|'(?:[^'\\\n]|\\[\s\S])*')"
)
_ESCAPED = re.compile(r"\\[\s\S]")  # one escape in a string literal
_DEPTH = 8  # levels of nested schema a grammar follows
# An escape in a string literal: Python's own (one character, octal), \xHH and \uHHHH outside the surrogates
# (which JSON would pair and Python does not).
_ESCAPE = "\\\\([\\\\'\"abfnrtv]|[0-7]{1,3}|x[0-9a-fA-F]{2}|u([0-9a-cA-CefEF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))"
# Any Python literal, where a schema does not say which (strings in either quote, numbers, True / False
# / None, lists, dicts with string keys).
_ANY_RULES = [
    'py_any: PY_STR | PY_NUM | "True" | "False" | "None" | "[" (py_any (", " py_any)*)? "]" '
    '| "{" (PY_STR ": " py_any (", " PY_STR ": " py_any)*)? "}"',
    'PY_STR: /"([^"\\\\\\n\\r\\x00]|' + _ESCAPE + ")*\"/ | /'([^'\\\\\\n\\r\\x00]|" + _ESCAPE + ")*'/",
    "PY_NUM: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]{1,2})?/",  # (a finite float: 1e999 is no JSON)
]


@dataclass(frozen=True)
class PythonicCallFormat:
    name: str = "pythonic"
    marker: str = OPEN
    at_start_only: bool = True  # (the list is the output's start)
    special_ids: tuple[int, ...] = ()
    # (a string's quote first, as ToolFormat.closers; one in single quotes, a call's arguments)
    closers: tuple[str, ...] = ('"', "'", ")")

    # -- the request ------------------------------------------------------------------------------------
    def for_tools(self, functions: list[dict]) -> PythonicCallFormat:
        return self  # (a literal carries its own type)

    def bind(self, tokenizer) -> PythonicCallFormat:
        return self  # (no markup: the brackets are text)

    def new_id(self) -> str:
        return call_id()

    def history(self, messages: list[dict]) -> list[dict]:
        return messages

    def scanner(self) -> PythonicCallScanner:
        return PythonicCallScanner()

    # -- writing ----------------------------------------------------------------------------------------
    def render(self, calls: list[tuple[str, Any]]) -> str:
        """Calls (name, arguments object) as the list a model writes."""
        return "[" + ", ".join(f"{n}({', '.join(f'{k}={_literal(v)}' for k, v in a.items())})" for n, a in calls) + "]"

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """A Lark grammar for the list of one call (several with ``parallel``) of ``tools``, each argument
        held to its schema, with nothing before or after it."""
        calls = 'call (", " call)*' if parallel else "call"
        return "\n".join([f'start: "[" {calls} "]"', *_call_rules(tools, strict_only=False)]) + "\n"

    def auto_grammar(self, tools: list[dict], parallel: bool, answer: str | None = None) -> str:
        """Under ``tool_choice`` auto (as :meth:`~server.tools.ToolFormat.auto_grammar` for a syntax whose
        calls are the whole output): an answer that does not open with ``[``, or the list of calls
        after any blank; a call's name is one of ``tools``, a strict tool's arguments hold to its
        schema and another's are any keyword literals. (A structured answer is not composed with these
        calls: server/routes/chat.py keeps the answer's own constraint.)"""
        calls = 'call (", " call)*' if parallel else "call"
        rules = [f'start: TEXT | BLANK? "[" {calls} "]"', "BLANK: /\\s+/", "TEXT: /(?s:.*)/ & ~/\\s*\\[(?s:.*)/"]
        return "\n".join([*rules, *_call_rules(tools, strict_only=True)]) + "\n"

    # -- reading ----------------------------------------------------------------------------------------
    def start_of_calls(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(OPEN) else -1

    def content_end(self, text: str) -> int:
        start = self.start_of_calls(text)
        return start if start >= 0 else len(text)

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output, as :meth:`~server.tools.ToolFormat.parse` reads a syntax
        whose calls open the output: the calls of a list of calls, and text after the list content.
        With ``cut`` the whole calls before the cut are calls and the one the limit cut is dropped;
        an output that ended by itself with a list that is not one of calls (an item that is no call,
        a list never closed) is content, as vLLM reads it."""
        i = self.start_of_calls(text)
        if i < 0:
            return text, []
        calls, end, closed = self._calls(text, i + 1)
        if not cut and not (closed and calls):
            return text, []
        content = "" if cut else text[end:].strip()
        return content or None, calls

    def _calls(self, text: str, at: int) -> tuple[list[ToolCall], int, bool]:
        """The whole calls of the list whose items begin at ``at`` (past its ``[``), where they end (past
        the ``]`` where it came), and whether the list closed after them (a trailing comma allowed)."""
        out: list[ToolCall] = []
        end = at
        while (m := _CALL_HEAD.match(text, _skip_ws(text, at))) is not None:
            close = closing(text, m.end() - 1)
            args = call_arguments(text, m.end() - 1) if close is not None else None
            if args is None:
                break
            out.append(ToolCall(m.group(1), json.dumps(args, ensure_ascii=False), self.new_id()))
            end = close
            q = _skip_ws(text, close)
            if text.startswith(",", q):  # the next call, or a trailing comma before the "]"
                at = q + 1
                q = _skip_ws(text, at)
            elif not text.startswith("]", q):
                break
            if text.startswith("]", q):
                return out, q + 1, True
        return out, end, False


class PythonicCallScanner:
    """Forced calls read as they are written, with :class:`~server.tools.CallScanner`'s events:
    ``("call", name)`` once ``NAME(`` is written, then the arguments as their JSON in one ``("args",
    text)`` when its parenthesis closes (a literal is known only whole), and ``("end",)``."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # where the next call's name is looked for; inside a call, its "("
        self.start = 0  # where the open call's name begins
        self.name: str | None = None  # the open call's

    def feed(self, delta: str) -> list[tuple]:
        self.text += delta
        events: list[tuple] = []
        while True:
            if self.name is None:
                m = _CALL_HEAD.search(self.text, self.pos)
                if m is None:
                    return events
                self.name, self.start, self.pos = m.group(1), m.start(), m.end() - 1
                events.append(("call", self.name))
            close = closing(self.text, self.pos)
            if close is None:
                return events
            args = call_arguments(self.text, self.pos)
            if args is not None:  # (the grammar writes only literals: a call it cannot read is none)
                events.append(("args", json.dumps(args, ensure_ascii=False)))
            events.append(("end",))
            self.name, self.pos = None, close


# -- reading literals --------------------------------------------------------------------------------------
def _bracket(text: str, pos: int) -> tuple[list[int], int] | None:
    """The bracket at ``pos``: where the commas between its items are, and past where it closes
    (strings in either quote, tripled or not, skipped); None where the text ends first."""
    depth, i, n, commas = 0, pos, len(text), []
    while i < n:
        ch = text[i]
        if ch in _QUOTES:
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            i += len(quote)
            while i < n and not text.startswith(quote, i):
                i += 2 if text[i] == "\\" else 1
            if i >= n:
                return None
            i += len(quote)
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return commas, i + 1
        elif ch == "," and depth == 1:
            commas.append(i)
        i += 1
    return None


def closing(text: str, pos: int) -> int | None:
    """Past the bracket that closes the one at ``pos``; None where the text ends first."""
    found = _bracket(text, pos)
    return found[1] if found is not None else None


def call_arguments(text: str, paren: int) -> dict | None:
    """A call's keyword arguments as a JSON object, from the parenthesis at ``paren`` (``(key=literal,
    ...)``, a trailing comma allowed); None where they are not that (a positional argument, a value that
    is not a literal or has no JSON) or the text ends first. A key is read as written, so a parameter
    named ``from`` or ``user-id`` (which a tool may have, and Python would refuse) reads too."""
    found = _bracket(text, paren)
    if found is None:
        return None
    commas, close = found
    bounds = [paren, *commas, close - 1]
    args = {}
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        part = text[a + 1 : b]
        if not part.strip():
            if k == len(bounds) - 2:  # f() or f(a=1,)
                continue
            return None
        m = _KEYWORD.match(part)
        if m is None:
            return None
        try:
            node = ast.parse(_json_slashes(part[m.end() :].strip()), mode="eval").body
            args[m.group(1)] = _jsonable(ast.literal_eval(_JsonNames().visit(node)))
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None
    return args


def _json_slashes(source: str) -> str:
    """``source`` with JSON's ``\\/`` read as ``/`` in its double-quoted strings: the grammars write a
    schema's strings as JSON, which may escape a slash so, and Python would keep the backslash (every other
    escape both have reads alike)."""
    return _STRING.sub(_json_string, source)


def _json_string(literal: re.Match) -> str:
    prefix, body = literal.group(1), literal.group(2)
    json_like = not prefix and body.startswith('"') and not body.startswith('"""')  # (a raw string keeps its \/)
    return prefix + (_ESCAPED.sub(_slash, body) if json_like else body)


def _slash(escape: re.Match) -> str:
    return "/" if escape.group() == "\\/" else escape.group()


class _JsonNames(ast.NodeTransformer):
    """JSON's ``true`` / ``false`` / ``null`` as the constants they name (a template's ``tojson`` writes
    them into a history's calls, and a model may copy it)."""

    VALUES = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(self.VALUES[node.id]) if node.id in self.VALUES else node


def _jsonable(value: Any) -> Any:
    """A literal's value as JSON has it (tuples as lists); a TypeError where JSON has none."""
    if isinstance(value, str):  # (a surrogate pair as JSON reads it; a lone surrogate has no JSON: a ValueError)
        return value.encode("utf-16", "surrogatepass").decode("utf-16") if _SURROGATE.search(value) else value
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _jsonable(v) for k, v in value.items()}
    raise TypeError(f"no JSON for {type(value).__name__}")


def _literal(value: Any) -> str:
    """A JSON value as a Python literal (a string as its JSON, which Python reads alike)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


# -- grammars ----------------------------------------------------------------------------------------------
def _call_rules(tools: list[dict], strict_only: bool) -> list[str]:
    """``call`` (one call of any of ``tools``) and the rules it uses; ``strict_only``: a tool that does not
    say ``strict`` takes any keyword literals."""
    alternatives, rules = [], []
    for i, fn in enumerate(tools):
        schema = fn.get("parameters") or {}
        if strict_only and not fn.get("strict"):
            params = _members({}, {}, f"t{i}", rules, keywords=True)
        else:
            defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
            params = _members(_resolve(schema, defs), defs, f"t{i}", rules, keywords=True)  # (pydantic's root $ref)
        alternatives.append(" ".join(x for x in (_lit(fn["name"] + "("), params, '")"') if x))
    return ["call: " + " | ".join(alternatives), *rules, *_ANY_RULES]


def _members(schema: dict, defs: dict, tag: str, rules: list[str], keywords: bool, depth: int = 0) -> str:
    """An object's members in its schema's order, those not required optional: a call's keyword
    arguments (``keywords``) or a dict's entries. An object without properties takes any."""
    props = schema.get("properties")
    if not isinstance(props, dict) or not props:
        extra = schema.get("additionalProperties")
        if extra is False:
            return ""
        value = _value(extra, defs, f"{tag}_x", rules, depth) if isinstance(extra, dict) else "py_any"
        entry = f'/[A-Za-z_][A-Za-z0-9_-]*/ "=" {value}' if keywords else f'PY_STR ": " {value}'
        rules.append(f"{tag}_e: {entry}")
        return f'({tag}_e (", " {tag}_e)*)?'

    def head(key: str) -> str:
        return _lit(key + "=") if keywords else _lit(json.dumps(key) + ": ")

    required = set(schema.get("required") or ())
    items = []
    for j, (key, sub) in enumerate(props.items()):
        value = _value(sub if isinstance(sub, dict) else {}, defs, f"{tag}_{j}", rules, depth)
        items.append((f"{head(key)} {value}", key in required))
    return _in_order(items, tag, rules)


def _in_order(items: list[tuple[str, bool]], tag: str, rules: list[str], sep: str = ", ") -> str:
    """A Lark expression for ``items`` (expression, required) in their order, joined by ``sep``, each not
    required one left out or not. Rule ``{tag}_f{i}`` is what may come from item i on with nothing
    written yet, ``{tag}_g{i}`` the same after something (so it leads with ``sep``); each is non-empty,
    and a reference to one is optional where every item from i on is."""
    n = len(items)
    optional_from = [all(not req for _, req in items[i:]) for i in range(n + 1)]

    def ref(kind: str, k: int) -> str:
        return "" if k == n else f"{tag}_{kind}{k}" + ("?" if optional_from[k] else "")

    for i, (expr, req) in enumerate(items):
        for kind, lead in (("f", ""), ("g", json.dumps(sep) + " ")):
            if (kind == "g" and i == 0) or (kind == "f" and any(r for _, r in items[:i])):
                continue  # (referenced by nothing: no item before the first; a required one is never skipped)
            alts = [" ".join(x for x in (lead + expr, ref("g", i + 1)) if x)]
            if not req and i + 1 < n:
                alts.append(f"{tag}_{kind}{i + 1}")
            rules.append(f"{tag}_{kind}{i}: " + " | ".join(alts))
    return ref("f", 0)


def merged_schema(schema: dict, defs: dict) -> dict:
    """``schema`` with its ``$ref`` resolved and its ``allOf`` parts merged into it (pydantic wraps a
    described ``$ref`` so)."""
    schema = _resolve(schema, defs)
    parts = schema.get("allOf")
    if isinstance(parts, list) and all(isinstance(p, dict) for p in parts):
        merged: dict = {}
        for part in parts:
            merged.update(_resolve(part, defs))
        schema = {**merged, **{k: v for k, v in schema.items() if k != "allOf"}}
    return schema


def literal_choices(schema: dict) -> list | None:
    """The values an ``enum`` or ``const`` allows, where each is a scalar; else None."""
    choices = schema.get("enum") if "enum" in schema else [schema["const"]] if "const" in schema else None
    if isinstance(choices, list) and choices and all(v is None or isinstance(v, (str, int, float)) for v in choices):
        return choices
    return None


def array_rule(item: str, schema: dict, tag: str, rules: list[str], sep: str) -> str:
    """A list of ``item`` (a Lark expression) within the schema's ``minItems`` / ``maxItems``, items
    joined by ``sep``; its item rule ``{tag}_a`` added to ``rules``."""
    least, most = int(schema.get("minItems", 0)), schema.get("maxItems")
    if most is not None and int(most) <= 0:
        return '"[" "]"'
    name = f"{tag}_a"
    rules.append(f"{name}: {item}")
    lo, hi = max(least - 1, 0), "" if most is None else str(int(most) - 1)
    joined = f"{json.dumps(sep)} {name}"
    more = name if hi == "0" else f"{name} ({joined})" + ("*" if (lo, hi) == (0, "") else f"{{{lo},{hi}}}")
    return f'"[" {more} "]"' if least > 0 else f'"[" ({more})? "]"'


def _value(schema: dict, defs: dict, tag: str, rules: list[str], depth: int = 0) -> str:
    """A Lark expression for one value held to ``schema``, written as a Python literal. Past
    :data:`_DEPTH` levels (a recursive ``$ref``: a tree of nodes) a value is any literal."""
    if depth >= _DEPTH:
        return "py_any"
    depth += 1
    schema = merged_schema(schema, defs)
    choices = literal_choices(schema)
    if choices is not None:
        return "(" + " | ".join(_lit(_literal(v)) for v in choices) + ")"
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and branches and "type" not in schema:
        alts = [
            _value(b if isinstance(b, dict) else {}, defs, f"{tag}_{k}", rules, depth) for k, b in enumerate(branches)
        ]
        return "(" + " | ".join(alts) + ")"
    types = _types(schema)
    if len(types) > 1:
        alts = [_value({**schema, "type": t}, defs, f"{tag}_{t}", rules, depth - 1) for t in sorted(types)]
        return "(" + " | ".join(alts) + ")"
    kind = next(iter(types), None)
    if kind in ("string", "integer", "number"):  # its JSON, which Python reads alike, held to the schema
        keep = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf", "$defs", "definitions")}
        return f"%json {json.dumps({**keep, 'x-guidance': JSON_LAYOUT})}"
    if kind == "boolean":
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    if kind == "array":
        items = schema.get("items")
        item = _value(items, defs, f"{tag}_i", rules, depth) if isinstance(items, dict) else "py_any"
        return array_rule(item, schema, tag, rules, ", ")
    if kind == "object":
        members = _members(schema, defs, tag, rules, keywords=False, depth=depth)
        return f'"{{" {members} "}}"' if members else '"{" "}"'
    return "py_any"
