"""XML tool calls, one element per argument with its value as written: Qwen3-Coder's and Qwen3.5's,
Seed-OSS's, GLM-4.5's, 4.6's and 4.7's, and MiniMax-M2's.

::

    <tool_call>                             <tool_call>get_weather
    <function=get_weather>                  <arg_key>city</arg_key>
    <parameter=city>                        <arg_value>Paris</arg_value>
    Paris                                   <arg_key>days</arg_key>
    </parameter>                            <arg_value>3</arg_value>
    <parameter=days>                        </tool_call>
    3
    </parameter>
    </function>
    </tool_call>

(GLM-4.7 writes its calls without the line ends; Seed-OSS writes Qwen's elements in ``<seed:tool_call>``,
each value on its tags' line.) MiniMax-M2 (M2.1, M2.5) writes its calls, each an
``<invoke name="...">`` element of ``<parameter name="...">`` elements, in one ``<minimax:tool_call>``
block. A string argument is its text as it is (newlines and
quotes included); any other value is its JSON (the templates write objects and lists with ``tojson``,
other values as their text). So a call's arguments can only be read back with the tool's schema
beside them: ``"3"`` is a string where the parameter is one and the number 3 where it is a number.
:class:`XmlCallFormat` is the syntax, :class:`XmlMarkup` where each family puts a call's name and its
arguments; :meth:`~XmlCallFormat.for_tools` gives it a request's tools, whose schemas its parser then
reads values by and its grammars write them by (a string as text without the tag that closes it,
within its ``minLength`` / ``maxLength`` or as one of its ``enum``; any other value as JSON held to its
schema). vLLM names these parsers ``qwen3_coder``, ``seed_oss``, ``glm45``, ``glm47`` and ``minimax_m2``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from engine.structured.grammar import JSON_LAYOUT
from server.tokens import special_token_id
from server.tools import ToolCall, _lit, _regex_lit, _skip_ws, before_marker, call_id, read_runs, special_lit

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class XmlMarkup:
    """Where one family's XML syntax puts a call's name and each argument: how its templates write
    them (``head``, ``param`` and ``tail`` are formatted with the name and key) and how they are read
    back (whitespace between elements is free)."""

    head: str  # after <tool_call>: the name's line, "{name}" in it
    param: str  # an argument's opening up to its value, "{key}" in it
    value_close: str  # what follows a value
    tail: str  # after the last argument, before </tool_call>
    between: str  # between two calls
    name_re: re.Pattern  # a call's name (group 1), where the head begins
    key_re: re.Pattern  # an argument's opening, its key group 1
    value_tag: str  # the tag that ends a value: at its first "\n" + tag where value_line, else its first tag
    value_line: bool
    body_end: str  # the closing tag of the arguments ("" where </tool_call> closes them)
    pieces: tuple[str, ...] = ()  # tags besides the calls' own that may be special tokens
    open: str = OPEN  # a call's opening, up to its head
    close: str = CLOSE  # a call's closing
    # Where a run of calls is one block (MiniMax-M2's): what opens it before the first call and closes it
    # after the last ("" where each call stands alone).
    block_open: str = ""
    block_close: str = ""

    @property
    def value_end(self) -> str:
        return ("\n" if self.value_line else "") + self.value_tag

    @property
    def marker(self) -> str:
        """Where a run of calls begins: the block's tag, or a call's opening."""
        return self.block_open.strip() or self.open


QWEN3_CODER = XmlMarkup(
    head="\n<function={name}>\n",
    param="<parameter={key}>\n",
    value_close="\n</parameter>\n",
    tail="</function>\n",
    between="\n",
    name_re=re.compile(r"<function=([^>\n]+)>\r?\n?"),
    key_re=re.compile(r"<parameter=([^>\n]+)>\r?\n?"),
    value_tag="</parameter>",
    value_line=True,
    body_end="</function>",
)
SEED_OSS = dataclasses.replace(  # Seed-OSS's: Qwen's elements, a value on its tags' line, in <seed:tool_call>
    QWEN3_CODER,
    param="<parameter={key}>",
    value_close="</parameter>\n",
    key_re=re.compile(r"<parameter=([^>\n]+)>"),
    value_line=False,
    open="<seed:tool_call>",
    close="</seed:tool_call>",
)
_GLM = dict(
    name_re=re.compile(r"([^<>\n]+)\r?\n?"),
    key_re=re.compile(r"<arg_key>([^<>\n]*)</arg_key>\s*<arg_value>"),
    value_tag="</arg_value>",
    value_line=False,
    body_end="",
    pieces=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
)
GLM45 = XmlMarkup(  # GLM-4.5's and 4.6's templates: an element a line
    head="{name}\n", param="<arg_key>{key}</arg_key>\n<arg_value>", value_close="</arg_value>\n", tail="",
    between="\n", **_GLM,
)  # fmt: skip
GLM47 = XmlMarkup(  # GLM-4.7's: no line ends
    head="{name}", param="<arg_key>{key}</arg_key><arg_value>", value_close="</arg_value>", tail="", between="",
    **_GLM,
)  # fmt: skip
MINIMAX_M2 = XmlMarkup(  # MiniMax-M2's: the calls in one block, each an <invoke> element
    head='"{name}">\n',
    param='<parameter name="{key}">',
    value_close="</parameter>\n",
    tail="",
    between="\n",
    name_re=re.compile(r'"([^"<>\n]+)">\r?\n?'),
    key_re=re.compile(r'<parameter name="([^"<>\n]*)">'),
    value_tag="</parameter>",
    value_line=False,
    body_end="",
    open="<invoke name=",
    close="</invoke>",
    block_open="<minimax:tool_call>\n",
    block_close="\n</minimax:tool_call>",
)


@dataclass(frozen=True)
class XmlCallFormat:
    name: str = "qwen3_coder"
    markup: XmlMarkup = QWEN3_CODER
    at_start_only: bool = False  # (calls may follow text)
    schemas: tuple[tuple[str, dict], ...] = ()  # the request's tools: name -> parameters schema (for_tools)
    specials: tuple[tuple[str, int], ...] = ()  # markup that is one special token of the vocabulary (bind)

    # -- the request ------------------------------------------------------------------------------------
    def for_tools(self, functions: list[dict]) -> XmlCallFormat:
        """This syntax reading and writing the given tools' arguments (OpenAI function objects)."""
        return dataclasses.replace(self, schemas=tuple((f["name"], f.get("parameters") or {}) for f in functions))

    @property
    def marker(self) -> str:
        return self.markup.marker

    def bind(self, tokenizer) -> XmlCallFormat:
        m = self.markup
        tags = (m.open, m.close, m.block_open.strip(), m.block_close.strip(), *m.pieces)
        found = ((piece, special_token_id(tokenizer, piece)) for piece in tags if piece)
        return dataclasses.replace(self, specials=tuple((p, i) for p, i in found if i is not None))

    @property
    def special_ids(self) -> tuple[int, ...]:
        return tuple(i for _, i in self.specials)

    def new_id(self) -> str:
        return call_id()

    def history(self, messages: list[dict]) -> list[dict]:
        return messages

    def scanner(self) -> XmlCallScanner:
        return XmlCallScanner(self)

    @property
    def closers(self) -> tuple[str, ...]:
        """What closes a value, a key and its (empty) value, a call and a block of calls (as
        :attr:`~server.tools.ToolFormat.closers`): a value as text ends only at its closing tag, and a key
        that is not the schema's (any text but tags) only at the tag that closes it."""
        m = self.markup
        key_close = m.param.split("{key}")[1]
        texts = (m.value_close, key_close + m.value_close, m.tail + m.close, m.block_close)
        return tuple(x for x in texts if x.strip())

    # -- writing ----------------------------------------------------------------------------------------
    def render(self, calls: list[tuple[str, Any]]) -> str:
        """Calls (name, arguments object) as the templates write them."""
        m, out = self.markup, []
        for name, args in calls:
            params = "".join(m.param.format(key=k) + _written(v) + m.value_close for k, v in args.items())
            out.append(m.open + m.head.format(name=name) + params + m.tail + m.close)
        return m.block_open + m.between.join(out) + m.block_close

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """A Lark grammar for one call (several with ``parallel``) of ``tools``, each argument held to its
        schema, with nothing before or after them."""
        m = self.markup
        # (The separator and the next call's opening are one literal: none is then a prefix of another,
        # as a lone "\n" would be of MiniMax-M2's "\n</minimax:tool_call>".)
        calls = f"call ({self._lit(m.between + m.open)} body)*" if parallel else "call"
        start = " ".join(x for x in (self._lit(m.block_open), calls, self._lit(m.block_close)) if x)
        return "\n".join([f"start: {start}", *self._call_rules(tools, strict_only=False)]) + "\n"

    def auto_grammar(self, tools: list[dict], parallel: bool, answer: str | None = None) -> str:
        """Under ``tool_choice`` auto, as :meth:`~server.tools.ToolFormat.auto_grammar`: an answer, or
        text then calls; a call's name is one of ``tools``, a strict tool's arguments hold to its
        schema and another's are any parameters. The text ends, lazily, where a call opens (where the
        opening tag is a special token, no text holds it: the text ends where it comes)."""
        m = self.markup
        rules = self._call_rules(tools, strict_only=True)
        # The next call's separator and opening are one literal, which the lexer follows beside the text
        # after the calls (as ToolFormat.auto_grammar does).
        more = f" ({self._lit(m.between + m.open)} body)*" if parallel else ""
        block_open, block_close = (f" {self._lit(x)}" if x else "" for x in (m.block_open, m.block_close))
        if answer is not None:
            return "\n".join([f"start: {answer} |{block_open} call{more}{block_close}", *rules]) + "\n"
        if m.marker in dict(self.specials):
            start = f"start: TEXT | TEXT{block_open} call{more}{block_close} TEXT"
            return "\n".join([start, "TEXT: /(?s:.*)/", *rules]) + "\n"
        # The text ends at the marker (lazily); what the calls' opening holds past it is then a literal.
        lead = m.block_open + m.open
        after = self._lit(lead[lead.index(m.marker) + len(m.marker) :])
        marker = _regex_lit(m.marker)
        start = " ".join(x for x in ("start: TEXT | head", after, f"body{more}{block_close} TEXT") if x)
        lines = [start, f"head[lazy]: /(?s:.*){marker}/", f"TEXT: /(?s:.*)/ & ~/(?s:.*){marker}(?s:.*)/"]
        return "\n".join([*lines, *rules]) + "\n"

    def _lit(self, text: str) -> str:
        return special_lit(text, self.specials)

    def _call_rules(self, tools: list[dict], strict_only: bool) -> list[str]:
        """``call`` (one call of any of ``tools``), ``body`` (a call past its opening tag) and the rules
        they use; ``strict_only``: a tool that does not say ``strict`` takes any parameters."""
        m = self.markup
        alternatives, rules = [], []
        for i, fn in enumerate(tools):
            schema = fn.get("parameters") or {}
            free = strict_only and not fn.get("strict")
            params = "any_param*" if free else self._params(schema, f"t{i}", rules)
            parts = (self._lit(m.head.format(name=fn["name"])), params, self._lit(m.tail + m.close))
            alternatives.append(" ".join(x for x in parts if x))
        key_open, key_close = m.param.split("{key}")
        any_key = " ".join(x for x in (self._lit(key_open), "ANY_NAME", self._lit(key_close)) if x)
        self._text_value("any_value", "0,", rules)
        # A key holds no tag and no line end, nor what closes it (MiniMax-M2's closing quote).
        stop = "" if key_close[:1] in ("", "<", ">") else re.escape(key_close[0]).replace("/", "\\/")
        return [f"call: {self._lit(m.open)} body", "body: " + " | ".join(alternatives), *rules,
                f"any_param: {any_key} any_value", f"ANY_NAME: /[^<>\\n{stop}]+/"]  # fmt: skip

    def _text_value(self, name: str, bounds: str, rules: list[str]) -> str:
        """Rule ``name`` (added to ``rules``): a value as text, ``bounds`` a regex repetition's (its
        characters), and what closes it. The text holds no tag that would end it sooner: a lazy lexeme
        ends it at the first; where the tag is a special token, the text's lexeme ends where it comes."""
        m = self.markup
        end = _regex_lit(m.value_end)
        if m.value_tag in dict(self.specials):  # (a special token cannot be part of a lexeme)
            text = f"{name.upper()}_TEXT"
            rules += [
                f"{text}: /(?s:.{{{bounds}}})/ & ~/(?s:.*){end}(?s:.*)/",
                f"{name}: {text} {self._lit(m.value_close)}",
            ]
        else:
            close = _regex_lit(m.value_close)
            rules.append(f"{name}[lazy]: /(?s:.{{{bounds}}}){close}/ & ~/(?s:.*){end}(?s:.*){close}/")
        return name

    def _params(self, schema: dict, tag: str, rules: list[str]) -> str:
        """The parameters of one tool, in its schema's order (those not required may be left out), then
        any others unless its schema says ``additionalProperties: false`` (a tool with no properties
        takes any)."""
        required = set(schema.get("required") or ())
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # what its $refs point to
        parts = []
        for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
            value = self._value(sub if isinstance(sub, dict) else {}, defs, f"{tag}_p{j}", rules)
            part = f"{self._lit(self.markup.param.format(key=key))} {value}"
            parts.append(part if key in required else f"({part})?")
        if schema.get("additionalProperties") is not False:
            parts.append("any_param*")
        return " ".join(parts)

    # -- reading ----------------------------------------------------------------------------------------
    def start_of_calls(self, text: str) -> int:
        return text.find(self.marker)

    def content_end(self, text: str) -> int:
        return before_marker(text, self.marker)

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output, as :meth:`~server.tools.ToolFormat.parse` reads its syntax:
        every whole call in a run of calls is a call (the first run's, and a later one's after more
        text), the text around the runs content, and with ``cut`` a call the limit cut is dropped. A
        call is read element by element, so a value may hold ``</function>`` or ``</tool_call>`` (code
        about this very syntax)."""
        i, m = text.find(self.marker), self.markup
        if i < 0:
            return text, []
        return read_runs(text, i, self.marker, self._run, cut, close=m.block_close.strip(), unfinished=self._unfinished)

    def _unfinished(self, text: str, j: int) -> bool:
        """Whether the call that opens at ``j`` (its ``<tool_call>``) runs on to the end of ``text``, read
        as :meth:`elements` reads it: the text ends inside its name, a value (no tag ends it yet), an
        argument's tags or its closing tags. A call written inside a value is then text of that value, and
        a marker followed by anything else is prose. Where the calls are one block (``j`` its opening
        tag), whether the block does: the text ends in one of its calls, or between them, or inside
        the tag that would open the next or close the block."""
        m = self.markup
        if not m.block_open:
            return self._call_unfinished(text, j)
        q = _skip_ws(text, j + len(m.marker))
        while q < len(text) and text.startswith(m.open, q):
            whole = self._call_end(text, q)
            if whole is None:
                return self._call_unfinished(text, q)
            q = self._next_in_block(text, _skip_ws(text, whole[2]), True)
        rest, block_close = _squash(text[q:]), _squash(m.block_close)
        return _squash(m.open).startswith(rest) or (block_close.startswith(rest) and rest != block_close)

    def _call_unfinished(self, text: str, j: int) -> bool:
        """:meth:`_unfinished` of the one call that opens at ``j``."""
        m = self.markup
        q = _skip_ws(text, j + len(m.open))
        name = m.name_re.match(text, q)
        if name is None:  # the text ends inside the opening, or a marker in prose
            return _cut_in(text[q:], m.head, "name")
        pos, closing = name.end(), _squash(m.body_end + m.close)
        while True:
            at = _skip_ws(text, pos)
            key = m.key_re.match(text, at)
            if key is None:  # the text ends inside the closing tags or an argument's opening, or is no call
                rest = _squash(text[at:])
                return (closing.startswith(rest) and rest != closing) or _cut_in(text[at:], m.param, "key")
            end = text.find("\n" + m.value_tag, key.end() - 1) if m.value_line else -1
            end = end if end >= 0 else text.find(m.value_tag, key.end())
            if end < 0:
                return True  # (inside a value)
            pos = text.index(m.value_tag, end) + len(m.value_tag)

    def _run(self, text: str, end: int) -> tuple[list[ToolCall], int]:
        """The whole calls of the run from ``end`` (where a call, or the block of calls, opens) and where
        the run ends (past the block's closing tag where it came)."""
        m, calls = self.markup, []
        if m.block_open:
            at = _skip_ws(text, end)
            if not text.startswith(m.marker, at):
                return [], end
            end = at + len(m.marker)
        while text.startswith(m.open, at := self._next_in_block(text, _skip_ws(text, end), bool(calls))):
            whole = self._call_end(text, at)
            if whole is None:
                break
            name, pairs, end = whole
            calls.append(ToolCall(name, json.dumps(self.arguments(name, pairs), ensure_ascii=False), self.new_id()))
        block_close = m.block_close.strip()
        if calls and block_close:  # the block's end, past any text before it (neither call nor content)
            stop, nxt = text.find(block_close, end), text.find(m.open, end)
            if stop >= 0 and (nxt < 0 or stop < nxt):
                end = stop + len(block_close)
        return calls, end

    def _call_end(self, text: str, at: int) -> tuple[str, list[tuple[str, str]], int] | None:
        """The whole call that opens at ``at``: its name, its argument elements and where it ends (past
        its closing tag); None where it is not whole."""
        m = self.markup
        name = m.name_re.match(text, _skip_ws(text, at + len(m.open)))
        if name is None:
            return None
        pairs, done = self.elements(text, name.end())
        close = _skip_ws(text, done) if done is not None else -1
        if done is None or not text.startswith(m.close, close):
            return None
        return name.group(1).strip(), pairs, close + len(m.close)

    def _next_in_block(self, text: str, at: int, after_a_call: bool) -> int:
        """Where the calls are one block, the next call's opening from ``at`` (past a call of the block)
        when other text stands before it inside the block (text between a block's calls is neither call
        nor content: vLLM reads every call of the block); else ``at``. Before the block's first call
        nothing is skipped: a marker in prose opens no block."""
        m = self.markup
        if not m.block_open or not after_a_call or text.startswith(m.open, at):
            return at
        nxt, stop = text.find(m.open, at), text.find(m.block_close.strip(), at)
        return nxt if nxt >= 0 and (stop < 0 or nxt < stop) else at

    def arguments(self, name: str, pairs: list[tuple[str, str]] | str) -> dict:
        """A function's arguments from its parameter elements ((key, text) pairs, or the text between its
        name's line and the tag that closes them), each value read by the tool's schema."""
        if isinstance(pairs, str):
            pairs = self.elements(pairs + (self.markup.body_end or self.markup.close), 0)[0]
        schema = dict(self.schemas).get(name) or {}
        props = schema.get("properties") or {}
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        args: dict[str, Any] = {}
        for key, raw in pairs:
            sub = props.get(key)
            args[key] = _read(raw, _resolve(sub, defs) if isinstance(sub, dict) else None)
        return args

    def elements(self, text: str, pos: int) -> tuple[list[tuple[str, str]], int | None]:
        """The argument elements of a call from ``pos`` (past its name): (key, value text) pairs, and
        where they end (past ``</function>``; at ``</tool_call>`` where that closes them; None: the text
        ends before, or is no call). A value ends at the first :attr:`XmlMarkup.value_end`: Qwen's at the
        first ``\n</parameter>`` (the templates write that line after it; a model that writes
        ``</parameter>`` on the value's line ends it there when no such line follows), GLM's at the first
        ``</arg_value>``."""
        m, pairs = self.markup, []
        while True:
            at = _skip_ws(text, pos)
            if m.body_end and text.startswith(m.body_end, at):
                return pairs, at + len(m.body_end)
            if not m.body_end and text.startswith(m.close, at):
                return pairs, at
            key = m.key_re.match(text, at)
            if key is None:
                return pairs, None
            end = text.find("\n" + m.value_tag, key.end() - 1) if m.value_line else -1
            if end < 0:
                end = text.find(m.value_tag, key.end())
                if end < 0:
                    return pairs, None
            raw = text[key.end() : end] if end >= key.end() else ""
            pairs.append((key.group(1).strip(), raw.removesuffix("\r")))
            pos = text.index(m.value_tag, end) + len(m.value_tag)

    def _value(self, schema: dict, defs: dict, tag: str, rules: list[str]) -> str:
        """A Lark expression for one parameter's value and what closes it (``defs``: the tool's own,
        which a ``$ref`` in it points into)."""
        close = self._lit(self.markup.value_close)
        schema = _resolve(schema, defs)
        types = _types(schema)
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) and "\n" not in v for v in enum):
            return "(" + " | ".join(_lit(v) for v in enum) + f") {close}"
        if types == {"boolean"}:  # JSON's, or Python's as a template's ``| string`` writes it
            return f'("true" | "false" | "True" | "False") {close}'
        name = "v_" + tag  # (a rule: llguidance takes [lazy] on rules)
        if types in ({"string"}, {"string", "null"}):  # text without the closing tag, within its length bounds
            least, most = int(schema.get("minLength", 0)), schema.get("maxLength")
            bounds = f"{least},{int(most)}" if most is not None else f"{least},"
            return self._text_value(name, bounds, rules)
        if "string" in types or not (types or any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref", "const"))):
            return self._text_value(name, "0,", rules)  # text or another type, or none: any text
        return f"%json {json.dumps({**schema, **defs, 'x-guidance': JSON_LAYOUT})} {close}"


class XmlCallScanner:
    """Forced calls read as they are written, with :class:`~server.tools.CallScanner`'s events:
    ``("call", name)`` once its name is complete (its line ends, or the next tag begins), then the
    arguments as their JSON in one ``("args", text)`` when the call's arguments close (a value is known
    only when its element closes), and ``("end",)``."""

    def __init__(self, fmt: XmlCallFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.pos = 0  # where the next call is looked for
        self.name: str | None = None  # the open call's

    def feed(self, delta: str) -> list[tuple]:
        self.text += delta
        events: list[tuple] = []
        while True:
            if self.name is None:
                markup = self.fmt.markup
                at = self.text.find(markup.open, self.pos)
                m = None if at < 0 else markup.name_re.match(self.text, _skip_ws(self.text, at + len(markup.open)))
                if m is None or (m.end() == len(self.text) and not m.group(0).endswith("\n")):
                    return events
                self.name, self.pos = m.group(1).strip(), m.end()
                events.append(("call", self.name))
            pairs, end = self.fmt.elements(self.text, self.pos)
            if end is None:
                return events
            args = self.fmt.arguments(self.name, pairs)
            events += [("args", json.dumps(args, ensure_ascii=False)), ("end",)]
            self.name, self.pos = None, end


def _squash(text: str) -> str:
    return "".join(text.split())


def _cut_in(text: str, template: str, field: str) -> bool:
    """Whether ``text`` (whitespace aside) is where ``template`` begins, any name in place of its
    ``{field}``, and ends before the template does: tags the limit cut."""
    pre, post = (_squash(part) for part in template.split("{" + field + "}"))
    rest = _squash(text)
    if pre.startswith(rest):
        return True
    if not rest.startswith(pre):
        return False
    k = len(pre)
    while k < len(rest) and rest[k] not in "<>":
        k += 1
    return post.startswith(rest[k:]) and rest[k:] != post


# -- values ------------------------------------------------------------------------------------------------
def _written(value: Any) -> str:
    """An argument's value as the templates write it: a string as itself, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _read(raw: str, schema: dict | None) -> Any:
    """A value as written, read by its parameter's schema: text where it is a string, else its JSON
    (Python's ``True`` / ``False`` / ``None`` too, as a template's ``| string`` writes them); text
    that does not parse stays text."""
    types = _types(schema)
    if "string" in types and not types - {"string", "null"}:
        return None if raw == "null" and "null" in types else raw
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        pass
    python = {"True": True, "False": False, "None": None}
    return python[raw.strip()] if raw.strip() in python else raw


def _types(schema: dict | None) -> set[str]:
    """The JSON types a schema admits, where it says them plainly (a ``type``, a string ``enum``, or
    ``anyOf`` / ``oneOf`` branches that do: pydantic's ``Optional[str]``); empty where it does not."""
    if not schema:
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return {"string"}
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and branches:
        found = [_types(b) if isinstance(b, dict) else set() for b in branches]
        return set().union(*found) if all(found) else set()
    return set()


def _resolve(schema: dict, defs: dict) -> dict:
    """``schema`` with a local ``$ref`` to the tool's own definitions replaced by what it points to."""
    ref = schema.get("$ref")
    m = re.fullmatch(r"#/(\$defs|definitions)/(.+)", ref) if isinstance(ref, str) else None
    target = (defs.get(m.group(1)) or {}).get(m.group(2)) if m else None
    if not isinstance(target, dict):
        return schema
    return {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
