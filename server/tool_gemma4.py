"""Gemma 4's tool calls (vLLM names the parser ``gemma4``): each call a block of its own, after any text::

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:[<|"|>C<|"|>]}<tool_call|>

The arguments are an object in Gemma 4's own notation, not JSON: keys bare, a string between two
``<|"|>`` markers and written raw (no escapes: the marker is what ends it), numbers and ``true`` /
``false`` / ``null`` bare, lists ``[a,b]``, objects ``{key:value}``, no blanks between items. The three
markers (``<|tool_call>``, ``<tool_call|>``, ``<|"|>``) are special tokens of Gemma 4's vocabulary: the
grammars name them by id and a request that reads calls keeps them in its text.

:class:`Gemma4Format` is the syntax, on :class:`~server.tools.ToolFormat`'s runs of calls (content before,
between and after them; a call the limit cut dropped). Its grammars write each argument by its tool's
schema: a string between the markers within its ``minLength`` / ``maxLength`` (its ``pattern`` and
``format`` are not enforced), a number or integer as its JSON held to the schema by llguidance, an
``enum`` as one of its values, objects and lists down their ``properties`` and ``items`` (the schema's
keys only, sorted as the chat template writes them, those not required optional); where a schema
says nothing, any value. Reading is lenient as vLLM's: a bare word that is no number or constant reads as a string.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from engine.structured.grammar import JSON_LAYOUT
from server.tool_pythonic import _in_order, array_rule, literal_choices, merged_schema
from server.tool_xml import _resolve, _types
from server.tools import ToolCall, ToolFormat, _expect, _lit, _regex_lit, _skip_ws

QUOTE = '<|"|>'
GEMMA4 = ("<|tool_call>", "<tool_call|>", QUOTE)
_NAME = re.compile(r"[^\s{}<>\[\],:]+")  # a call's name, up to its arguments' "{"
_KEY = re.compile(r"[^{}<>\[\],:]+")  # a bare key, up to its ":" (blanks inside too: the template writes keys raw)
_BARE = re.compile(r"[^,{}\[\]<]*")  # a bare value: up to the next delimiter or marker
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_CONSTANTS = {"true": True, "false": False, "null": None}
_DEPTH = 8  # levels of nested schema a grammar follows
_NESTING = 64  # levels of nested value the reader follows


# -- reading values -----------------------------------------------------------------------------------------
def read_value(text: str, i: int, depth: int = 0) -> tuple[Any, int] | None:
    """The value at ``i`` and where it ends, or None where there is none (or the text ends first)."""
    i = _skip_ws(text, i)
    if depth > _NESTING or i >= len(text):
        return None
    if text.startswith(QUOTE, i):
        end = text.find(QUOTE, i + len(QUOTE))
        return None if end < 0 else (text[i + len(QUOTE) : end], end + len(QUOTE))
    if text[i] == "{":
        return read_object(text, i, depth)
    if text[i] == "[":
        return _read_items(text, i, "]", depth)
    m = _BARE.match(text, i)
    if m.end() == len(text) or not m.group().strip():  # (it may go on: not known whole yet)
        return None
    return _scalar(m.group().strip()), m.end()


def _scalar(word: str) -> Any:
    if word in _CONSTANTS:
        return _CONSTANTS[word]
    if _NUMBER.fullmatch(word):
        value = json.loads(word)
        if not isinstance(value, float) or math.isfinite(value):
            return value
    return word  # (a bare word: read as the string it spells, as vLLM reads it)


def read_object(text: str, i: int, depth: int = 0) -> tuple[dict, int] | None:
    """The object whose ``{`` is at ``i`` and past where it closes; None where it is not one or not whole."""
    out: dict[str, Any] = {}
    q = _skip_ws(text, i + 1)
    if text.startswith("}", q):
        return out, q + 1
    while True:
        if text.startswith(QUOTE, q):  # (a key written as a string)
            end = text.find(QUOTE, q + len(QUOTE))
            if end < 0:
                return None
            key, q = text[q + len(QUOTE) : end], end + len(QUOTE)
        else:
            m = _KEY.match(text, q)
            if m is None or not m.group().strip():
                return None
            key, q = m.group().strip(), m.end()
        q = _skip_ws(text, q)
        if not text.startswith(":", q):
            return None
        got = read_value(text, q + 1, depth + 1)
        if got is None:
            return None
        out[key], q = got
        q = _skip_ws(text, q)
        if text.startswith("}", q):
            return out, q + 1
        if not text.startswith(",", q):
            return None
        q = _skip_ws(text, q + 1)


def _read_items(text: str, i: int, close: str, depth: int) -> tuple[list, int] | None:
    out: list[Any] = []
    q = _skip_ws(text, i + 1)
    if text.startswith(close, q):
        return out, q + 1
    while True:
        got = read_value(text, q, depth + 1)
        if got is None:
            return None
        value, q = got
        out.append(value)
        q = _skip_ws(text, q)
        if text.startswith(close, q):
            return out, q + 1
        if not text.startswith(",", q):
            return None
        q += 1


def write_value(value: Any) -> str:
    """A JSON value in Gemma 4's notation, keys sorted (as its chat template writes a history's calls)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, list):
        return "[" + ",".join(write_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{write_value(v)}" for k, v in sorted(value.items())) + "}"
    return json.dumps(value)


# -- the syntax ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gemma4Format(ToolFormat):
    @property
    def closers(self) -> tuple[str, ...]:
        """A string's closing marker (JSON's ``"`` does not close it), then a call's closing."""
        return (QUOTE, self.call_close)

    def scanner(self) -> Gemma4CallScanner:
        return Gemma4CallScanner(self)

    def render(self, calls: list[tuple[str, Any]]) -> str:
        return "".join(f"{self.call_open}{n}{write_value(a)}{self.call_close}" for n, a in calls)

    # -- grammars ------------------------------------------------------------------------------------------
    def _call_body(self, tools: list[dict], strict_only: bool = False) -> str:
        """One call of one of ``tools`` between ``call:`` and its closing: the name and the arguments,
        held to the tool's schema (where ``strict_only``, only a tool that says ``strict``; another takes
        any object). The rules it names are :meth:`_call_rules`'."""
        return self._body(tools, strict_only)[0]

    def _call_rules(self, tools: list[dict], strict_only: bool) -> list[str]:
        return self._body(tools, strict_only)[1]

    def _body(self, tools: list[dict], strict_only: bool) -> tuple[str, list[str]]:
        rules: list[str] = []
        alternatives = []
        for i, fn in enumerate(tools):
            schema = fn.get("parameters") or {}
            if strict_only and not fn.get("strict"):
                schema = {}
            defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
            members = self._members(_resolve(schema, defs), defs, f"g{i}", rules)
            alternatives.append(" ".join(x for x in (_lit(fn["name"] + "{"), members, '"}"') if x))
        return "(" + " | ".join(alternatives) + ")", [*rules, *self._any_rules()]

    def _q(self) -> str:
        return self._lit(QUOTE)

    def _any_rules(self) -> list[str]:
        """``g_any``: any value; ``g_str``: any string (markers and all)."""
        rules = [
            'g_any: g_str | G_NUM | "true" | "false" | "null" | "[" (g_any ("," g_any)*)? "]" '
            '| "{" (G_KEY ":" g_any ("," G_KEY ":" g_any)*)? "}"',
            "G_NUM: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]{1,2})?/",
            "G_KEY: /[^\\s{}<>\\[\\],:]([^{}<>\\[\\],:\\n]*[^\\s{}<>\\[\\],:])?/",  # (what the reader reads as a key)
        ]
        self._string("g_str", "0,", rules)
        return rules

    def _string(self, name: str, bounds: str, rules: list[str]) -> str:
        """Rule ``name``: a string, its characters' count ``bounds`` (a regex repetition's), between the
        markers: where the marker is a special token the text's lexeme ends where it comes; else a lazy
        lexeme ends the text at the first marker."""
        q = self._q()
        end = _regex_lit(QUOTE)
        if QUOTE in dict(self.specials):
            text = f"{name.upper()}_T"
            rules += [f"{text}: /(?s:.{{{bounds}}})/ & ~/(?s:.*){end}(?s:.*)/", f"{name}: {q} {text} {q}"]
        else:
            rules += [
                f"{name}: {q} {name}_t",
                f"{name}_t[lazy]: /(?s:.{{{bounds}}}){end}/ & ~/(?s:.*){end}(?s:.*){end}/",
            ]
        return name

    def _members(self, schema: dict, defs: dict, tag: str, rules: list[str], depth: int = 0) -> str:
        """An object's members between its braces: the schema's keys sorted (as Gemma 4's template writes
        them: ``dictsort``), those not required optional; where it names none, any keys (of values its
        ``additionalProperties`` holds)."""
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            extra = schema.get("additionalProperties")
            if extra is False:
                return ""
            value = self._value(extra, defs, f"{tag}_x", rules, depth) if isinstance(extra, dict) else "g_any"
            rules.append(f'{tag}_e: G_KEY ":" {value}')
            return f'({tag}_e ("," {tag}_e)*)?'
        required = set(schema.get("required") or ())
        items = []
        for j, (key, sub) in enumerate(sorted(props.items())):  # (the template writes keys sorted: dictsort)
            value = self._value(sub if isinstance(sub, dict) else {}, defs, f"{tag}_{j}", rules, depth)
            items.append((f"{_lit(key + ':')} {value}", key in required))
        return _in_order(items, tag, rules, sep=",")

    def _value(self, schema: dict, defs: dict, tag: str, rules: list[str], depth: int = 0) -> str:
        """A Lark expression for one value held to ``schema``; past :data:`_DEPTH` levels, any value."""
        if depth >= _DEPTH:
            return "g_any"
        depth += 1
        schema = merged_schema(schema, defs)
        choices = literal_choices(schema)
        if choices is not None:
            return "(" + " | ".join(self._lit(write_value(v)) for v in choices) + ")"
        branches = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(branches, list) and branches and "type" not in schema:
            alts = [self._value(b if isinstance(b, dict) else {}, defs, f"{tag}_{k}", rules, depth)
                    for k, b in enumerate(branches)]  # fmt: skip
            return "(" + " | ".join(alts) + ")"
        types = _types(schema)
        if len(types) > 1:
            alts = [self._value({**schema, "type": t}, defs, f"{tag}_{t}", rules, depth - 1) for t in sorted(types)]
            return "(" + " | ".join(alts) + ")"
        kind = next(iter(types), None)
        if kind == "string":
            least, most = int(schema.get("minLength", 0)), schema.get("maxLength")
            return self._string(f"{tag}_s", f"{least},{'' if most is None else int(most)}", rules)
        if kind in ("integer", "number"):  # a bare number: its JSON, held to the schema
            keep = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf", "$defs", "definitions")}
            return f"%json {json.dumps({**keep, 'x-guidance': JSON_LAYOUT})}"
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "array":
            items = schema.get("items")
            item = self._value(items, defs, f"{tag}_i", rules, depth) if isinstance(items, dict) else "g_any"
            return array_rule(item, schema, tag, rules, ",")
        if kind == "object":
            members = self._members(schema, defs, tag, rules, depth)
            return f'"{{" {members} "}}"' if members else '"{" "}"'
        return "g_any"

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        return super().grammar(tools, parallel) + "\n".join(self._call_rules(tools, False)) + "\n"

    def auto_grammar(self, tools: list[dict], parallel: bool, answer: str | None = None) -> str:
        return super().auto_grammar(tools, parallel, answer) + "\n".join(self._call_rules(tools, True)) + "\n"

    # -- reading -------------------------------------------------------------------------------------------
    def _calls(self, text: str, pos: int) -> tuple[list[ToolCall], int]:
        """The whole calls of the run of blocks from ``pos`` and where it ends (past the last block)."""
        out: list[ToolCall] = []
        at = end = pos
        while True:
            head = self._head(text, at)
            if head is None:
                break
            name, q = head
            got = read_object(text, q)
            if got is None:
                break
            args, q = got
            q = _expect(text, q, self.call_close, self.markup)
            if q is None:
                break
            out.append(ToolCall(name, json.dumps(args, ensure_ascii=False), self.new_id()))
            at = end = q
        return out, end

    def _head(self, text: str, at: int) -> tuple[str, int] | None:
        """A call's name and where its arguments' ``{`` is, for a block opening at ``at``."""
        q = _expect(text, at, self.call_open, self.markup)
        m = None if q is None else _NAME.match(text, _skip_ws(text, q))
        if m is None:
            return None
        q = _skip_ws(text, m.end())
        return (m.group(), q) if text.startswith("{", q) else None

    def _unfinished(self, text: str, j: int) -> bool:
        """Whether the block at marker ``j`` runs on to the end of ``text`` (the text ends inside its
        opening, its name, its arguments or its closing marker)."""
        q = _expect(text, j, self.call_open, self.markup)
        if q is None:
            return "".join(self.call_open.split()).startswith("".join(text[j:].split()))
        m = _NAME.match(text, _skip_ws(text, q))
        if m is None:
            return not text[q:].strip()
        q = _skip_ws(text, m.end())
        if q == len(text):
            return True
        if text[q] != "{":
            return False
        got = read_object(text, q)
        return got is None or self.call_close.startswith(text[got[1] :].strip())


class Gemma4CallScanner:
    """Forced calls read as they are written, with :class:`~server.tools.CallScanner`'s events:
    ``("call", name)`` once ``call:NAME{`` is written, the arguments as their JSON in one ``("args",
    text)`` when their object closes (a value is known only whole), and ``("end",)``."""

    def __init__(self, fmt: Gemma4Format) -> None:
        self.fmt = fmt
        self.text = ""
        self.pos = 0  # where the next call is looked for; inside a call, its arguments' "{"
        self.name: str | None = None  # the open call's

    def feed(self, delta: str) -> list[tuple]:
        self.text += delta
        events: list[tuple] = []
        while True:
            if self.name is None:
                at = self.text.find(GEMMA4[0], self.pos)
                head = None if at < 0 else self.fmt._head(self.text, at)
                if head is None:
                    return events
                self.name, self.pos = head
                events.append(("call", self.name))
            got = read_object(self.text, self.pos)
            if got is None:
                return events
            args, self.pos = got
            events += [("args", json.dumps(args, ensure_ascii=False)), ("end",)]
            self.name = None


GEMMA4_FORMAT = Gemma4Format("gemma4", "", GEMMA4[0] + "call:", GEMMA4[1], "", "", "arguments", markup=GEMMA4)
