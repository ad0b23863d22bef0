"""Tool calling: how a model family writes its calls, the grammar that makes it write them, and the
parser that reads them back.

A :class:`ToolFormat` is one family's call syntax (Hermes-style ``<tool_call>{json}</tool_call>``,
Llama-3's bare JSON, Mistral's ``[TOOL_CALLS][...]`` and its v11 tokenizers' ``[TOOL_CALLS]NAME[ARGS]{...}``,
Phi-4-mini's ``functools[...]``);
:class:`HarmonyFormat` is gpt-oss's, where a call is a message addressed ``to=functions.NAME``
(server/harmony.py). Where a piece of the syntax is one special token of the served model's vocabulary
(Mistral's ``[TOOL_CALLS]``), :meth:`ToolFormat.bind` records it: the grammars then name that token,
and the request keeps it in its text (:attr:`ToolFormat.special_ids`), where a special token is
otherwise left out. With ``tool_choice`` ``required`` or a named
function the output is constrained by :meth:`ToolFormat.grammar` (a Lark grammar whose calls are
JSON-schema-checked by llguidance), so the arguments always parse and match the schema; with
``auto`` the model writes what it likes and :meth:`ToolFormat.parse` finds calls in it. Models whose
chat template takes no ``tools`` get them described in a system message, their history rendered in
the Hermes style (:func:`fallback_messages`); docs/structured.md has the text.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
import string
import uuid
from dataclasses import dataclass
from typing import Any

from engine.structured.grammar import JSON_LAYOUT, json_layout
from server.harmony import CALL, CHANNEL, HarmonyStream, call_header, call_lark
from server.tokens import special_token_id

ARGUMENT_PIECE = 16  # characters of a parsed call's arguments per streamed delta


def argument_pieces(arguments: str) -> list[str]:
    """A call's arguments text in the pieces a stream sends them in."""
    return [arguments[j : j + ARGUMENT_PIECE] for j in range(0, len(arguments), ARGUMENT_PIECE)]


def scanned_call_id(fmt, value: list) -> str:
    """The id of a forced call a scanner found (``value``: its ``("call", name[, id])`` event's fields):
    the id the model wrote where the syntax has one (Kimi's), else a new one."""
    return value[1] if len(value) > 1 else fmt.new_id()


def template_call(call_id: str, name: str, arguments: str) -> dict:
    """A call in a history message, as chat templates take it: its arguments text as an object (the
    text itself if it is not JSON, or is nested past the parser's depth)."""
    try:
        value = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        value = arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": value}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's ``function.arguments``
    id: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_ALNUM = string.ascii_letters + string.digits
_SHORT_ID = re.compile(r"[A-Za-z0-9]{9}")


def _base62(n: int, width: int) -> str:
    return "".join(_ALNUM[(n // 62**k) % 62] for k in range(width))


def short_id(previous: str | None = None) -> str:
    """A call id of 9 letters and digits, the only ids Mistral's chat templates take: a new one, or the
    one that stands for ``previous`` (itself if it is such an id, else 9 characters of its digest, the
    same wherever it occurs: in a call and in the result that answers it)."""
    if previous is None:
        return _base62(uuid.uuid4().int, 9)
    if _SHORT_ID.fullmatch(previous):
        return previous
    return _base62(int.from_bytes(hashlib.sha256(previous.encode()).digest()[:8], "big"), 9)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str  # before the first call
    call_open: str  # before each call
    call_close: str  # after each call
    sep: str  # between two calls
    close: str  # after the last call
    args_key: str  # the key the arguments object goes under
    at_start_only: bool = False  # calls only as the whole output (Llama-3's bare JSON)
    # Between a call's name and its arguments where the name stands outside them (Mistral v11+'s
    # ``[TOOL_CALLS]NAME[ARGS]{...}``); "": the call is one JSON object, ``{"name": ..., <args_key>: ...}``.
    name_sep: str = ""
    # Before the id a model writes between the name and ``name_sep`` (Mistral Small 3.2's ``[CALL_ID]``).
    id_sep: str = ""
    short_ids: bool = False  # call ids of 9 letters and digits (Mistral's templates refuse any other)
    # The template joins a call's arguments to its text with ``+`` (DeepSeek's own): the history passes
    # them as their JSON text, where other templates take the object (and write it with ``tojson``).
    text_arguments: bool = False
    markup: tuple[str, ...] = ()  # pieces of the syntax that may be one special token of a vocabulary
    specials: tuple[tuple[str, int], ...] = ()  # those that are in the served model's, with their ids (bind)

    @property
    def marker(self) -> str:
        """The text that starts the calls: a stream holds text back while it may be starting. Where the
        calls open with a piece of markup (Mistral's ``[TOOL_CALLS]``), that piece."""
        lead = (self.open + self.call_open).strip()
        return next((p for p in self.markup if lead.startswith(p)), lead) or "{"

    @property
    def closers(self) -> tuple[str, ...]:
        """Texts that close what a forced call's grammar opens where JSON's closers do not, in the order
        an ending tries them, for closing an output within ``max_tokens`` (StructuredOutput.closers): the
        markup that ends a run of calls (DeepSeek's and Kimi's: another call could follow, and the ending
        must not start one), after a string's quote (so that no marker is written into a string the
        quote ends, a non-special marker being text a string may hold); none where JSON's closers do."""
        ends = self.markup_closers
        return ('"', *ends) if ends else ()

    @property
    def markup_closers(self) -> tuple[str, ...]:
        return tuple(p for p in (self.close,) if p and p in self.markup)

    def scanner(self) -> CallScanner:
        """A reader of forced calls as they are written."""
        return CallScanner(self)

    def bind(self, tokenizer) -> ToolFormat:
        """This format for a model whose vocabulary is ``tokenizer``'s: the pieces of its markup that are
        special tokens there, which its grammars name by id and its requests keep in their text."""
        found = ((piece, special_token_id(tokenizer, piece)) for piece in self.markup)
        return dataclasses.replace(self, specials=tuple((p, i) for p, i in found if i is not None))

    @property
    def special_ids(self) -> tuple[int, ...]:
        """The special tokens a request that reads or writes calls keeps in its text (its parser reads them)."""
        return tuple(i for _, i in self.specials)

    def for_tools(self, functions: list[dict]) -> ToolFormat:
        """This syntax for a request offering ``functions`` (its calls carry their own types: the same)."""
        return self

    def new_id(self) -> str:
        """A new call's id."""
        return short_id() if self.short_ids else call_id()

    def history(self, messages: list[dict]) -> list[dict]:
        """``messages`` with call ids this format's templates take (:func:`short_id` where it needs them),
        and the calls' arguments as text where the template joins them to text (``text_arguments``)."""
        if not self.short_ids and not self.text_arguments:
            return messages
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [self._history_call(c) for c in m["tool_calls"]]}
            if m.get("role") == "tool" and self.short_ids:
                m = {**m, "tool_call_id": short_id(m.get("tool_call_id") or "")}
            out.append(m)
        return out

    def _history_call(self, call: dict) -> dict:
        if self.short_ids:
            call = {**call, "id": short_id(call.get("id") or "")}
        args = (call.get("function") or {}).get("arguments")
        if self.text_arguments and not isinstance(args, str):
            call = {**call, "function": {**call["function"], "arguments": json.dumps(args, ensure_ascii=False)}}
        return call

    # -- writing --------------------------------------------------------------------------------------
    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) for one call, or several with ``parallel``, of the
        given tools (``tools``: OpenAI function objects), with nothing before or after them."""
        lit = self._lit
        call = " ".join(x for x in (lit(self.call_open), self._call_body(tools), lit(self.call_close)) if x)
        body = f"call ({lit(self.sep)} call)*" if parallel and self.sep else "call+" if parallel else "call"
        start = " ".join(x for x in (lit(self.open), body, lit(self.close)) if x)
        return f"start: {start}\ncall: {call}\n"

    def auto_grammar(self, tools: list[dict], parallel: bool, answer: str | None = None) -> str:
        """Under ``tool_choice`` auto: the output is an answer, or calls (after any text, where the
        format lets calls follow text), each call's name one of ``tools`` and its arguments held to
        the tool's schema where the tool says ``strict`` (else any JSON object). ``answer``: a Lark
        expression the answer must match (a response_format's ``%json``), else any text without the
        calls' marker. llguidance's lazy lexeme ends the text at the first marker (where the marker is
        a special token, no text holds it: the text ends where it comes)."""
        lit = self._lit
        args = f"args: {self._call_body(tools, strict_only=True)}"
        marker = _regex_lit(self.marker)
        if self.at_start_only:  # calls are the whole output (after a blank), or there are none
            call = " ".join(x for x in (lit(self.call_open), "args", lit(self.call_close)) if x)
            more = f" ({lit(self.sep)} call)*" if parallel else ""
            calls = " ".join(x for x in (lit(self.open), "call" + more, lit(self.close)) if x)
            if answer is not None:
                return "\n".join([f"start: {answer} | {calls}", f"call: {call}", args]) + "\n"
            rules = [f"start: TEXT | BLANK? {calls}", "BLANK: /\\s+/", f"TEXT: /(?s:.*)/ & ~/\\s*{marker}(?s:.*)/",
                     f"call: {call}"]  # fmt: skip
            return "\n".join([*rules, args]) + "\n"
        # Any text up to the first marker, then the calls; each further call's separator and opening are
        # one literal, which the lexer follows beside the text after the calls (text without a marker).
        lead = self.open + self.call_open
        after = lead[lead.index(self.marker) + len(self.marker) :]
        first = " ".join(x for x in (lit(after), "args", lit(self.call_close)) if x)
        again = " ".join(x for x in (lit(self.sep + self.call_open), "args", lit(self.call_close)) if x)
        calls = " ".join(x for x in (first, f"({again})*" if parallel else "", lit(self.close)) if x)
        if answer is not None:  # a structured answer, or calls with no text before or after them
            return "\n".join([f"start: {answer} | {lit(self.marker)} {calls}", args]) + "\n"
        if self.marker in dict(self.specials):  # text cannot hold a special token: it ends where the marker comes
            return "\n".join([f"start: TEXT | TEXT {lit(self.marker)} {calls} TEXT", "TEXT: /(?s:.*)/", args]) + "\n"
        text = f"TEXT: /(?s:.*)/ & ~/(?s:.*){marker}(?s:.*)/"
        return "\n".join([f"start: TEXT | head {calls} TEXT", f"head[lazy]: /(?s:.*){marker}/", text, args]) + "\n"

    def _call_body(self, tools: list[dict], strict_only: bool = False) -> str:
        """One call of one of ``tools``, between its opening and closing (a Lark expression): its JSON
        object (:meth:`_call_json`), or where the name stands outside the arguments, the name, the
        model's own id where the format has one, ``name_sep`` and the arguments."""
        if not self.name_sep:
            return self._call_json(tools, strict_only)
        alternatives = []
        for fn in tools:
            params = fn.get("parameters") or {"type": "object"}
            if strict_only and not fn.get("strict"):
                params = {"type": "object"}
            schema = {**params, "x-guidance": JSON_LAYOUT} if isinstance(params, dict) else params
            own_id = f"{self._lit(self.id_sep)} /[A-Za-z0-9]{{9}}/" if self.id_sep else ""
            parts = (self.name_lit(fn["name"]), own_id, self._lit(self.name_sep), "%json " + json.dumps(schema))
            alternatives.append(" ".join(x for x in parts if x))
        return "(" + " | ".join(alternatives) + ")"

    def _lit(self, text: str) -> str:
        return special_lit(text, self.specials)

    def name_lit(self, name: str) -> str:
        """A call's name as the grammars write it where it stands outside the arguments."""
        return _lit(name)

    def written_name(self, name: str, index: int) -> str:
        """The ``index``-th call's name as :meth:`render` writes it where it stands outside the arguments."""
        return name

    def _call_json(self, tools: list[dict], strict_only: bool = False) -> str:
        """``%json`` of one call's object: ``{"name": <one of tools>, <args_key>: <its parameters>}``.
        ``strict_only``: a tool that does not say ``strict`` takes any object as its arguments."""
        defs: dict[str, Any] = {}
        alternatives = []
        for i, fn in enumerate(tools):
            params = fn.get("parameters") or {"type": "object"}
            if strict_only and not fn.get("strict"):
                params = {"type": "object"}
            params = _hoist_defs(params, f"t{i}_", defs)
            alternatives.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": fn["name"]}, self.args_key: params},
                    "required": ["name", self.args_key],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
        schema = {**schema, "x-guidance": JSON_LAYOUT}
        if defs:
            schema["$defs"] = defs
        return "%json " + json.dumps(schema)

    def render(self, calls: list[tuple[str, Any]]) -> str:
        """Calls (name, arguments object) as this format writes them (for history)."""

        def body(name: str, args: Any, index: int) -> str:
            if self.name_sep:
                return self.written_name(name, index) + self.name_sep + json.dumps(args, ensure_ascii=False)
            return json.dumps({"name": name, self.args_key: args}, ensure_ascii=False)

        parts = [self.call_open + body(n, a, i) + self.call_close for i, (n, a) in enumerate(calls)]
        return self.open + self.sep.join(parts) + self.close

    # -- reading --------------------------------------------------------------------------------------
    def content_end(self, text: str) -> int:
        """How much of a growing ``text`` is surely content: up to where calls begin, or may begin
        (its tail might be the start of :attr:`marker`)."""
        start = self.start_of_calls(text)
        return start if start >= 0 else before_tail(text, self.marker)

    def start_of_calls(self, text: str) -> int:
        """Where the calls begin in ``text`` (-1: none)."""
        if self.at_start_only:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith(self.marker) else -1
        return text.find(self.marker)

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output. Every whole call in the run of calls that begins where
        the calls begin is a call, never content, however the output ended, and so is every whole call
        of a later run after more text (vLLM reads every call in an output); the text after a run is
        content. ``cut``: the output was cut short (``max_tokens``); a call it was writing is dropped,
        neither call nor content (its markup is no answer), and words it cut are content. An
        output that ended by itself with no whole call is content (a model that only talks about
        calling)."""
        i = self.start_of_calls(text)
        if i < 0:
            return text, []
        return read_runs(text, i, self.marker, self._calls, cut, not self.at_start_only, self.close, self._unfinished)

    def _calls(self, text: str, pos: int) -> tuple[list[ToolCall], int]:
        """The whole calls of the run from ``pos`` (where the calls begin) and where they end (past
        the closing text, where it came)."""
        dec = json.JSONDecoder()
        head = self.name_head()
        out: list[ToolCall] = []
        at = _expect(text, pos, self.open, self.markup)
        end = pos
        while at is not None:
            q = _expect(text, at, self.call_open, self.markup) if not out else _expect(text, at, self.sep)
            if out and q is not None:
                q = _expect(text, q, self.call_open, self.markup)
            name = None
            if q is not None and head is not None:  # the name before the arguments
                m = head.match(text, _skip_ws(text, q))
                name, q = (m.group(1), m.end()) if m else (None, None)
            if q is None or not text.startswith("{", _skip_ws(text, q)):
                break
            try:
                obj, q = dec.raw_decode(text, _skip_ws(text, q))
            except (json.JSONDecodeError, RecursionError):
                break
            if head is not None:
                obj = {"name": name, self.args_key: obj}
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                break
            args = obj.get(self.args_key, obj.get("arguments", obj.get("parameters")))
            q = _expect(text, q, self.call_close, self.markup)
            if q is None or not isinstance(args, dict):
                break
            out.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), self.new_id()))
            at = end = q
        if out:
            close = _expect(text, end, self.close, self.markup)
            end = close if close is not None else end
        return out, end

    def _unfinished(self, text: str, j: int) -> bool:
        """Whether the run of calls that opens at ``j`` (its marker) runs on to the end of ``text``: the
        text ends inside its opening, its name or its arguments' JSON (a marker in prose is followed by
        words)."""
        lead = self.open + self.call_open
        q = _expect(text, j, lead, self.markup)
        if q is None:  # (the text may end inside the opening)
            return "".join(lead.split()).startswith("".join(text[j:].split()))
        head = self.name_head()
        if head is not None:
            m = head.match(text, _skip_ws(text, q))
            if m is None:
                return "{" not in text[q:]  # (the text ends inside the name or before its arguments)
            q = m.end()
        q = _skip_ws(text, q)
        if q == len(text) or text[q] != "{":
            return q == len(text)
        end = json_end(text, q)  # (whole arguments: the text may end inside the call's closing piece)
        return end is None or "".join((self.call_close + self.close).split()).startswith("".join(text[end:].split()))

    def name_head(self) -> re.Pattern | None:
        """Where the name stands outside the arguments: what comes before them (the name in group 1, a
        model's own id, ``name_sep``), after the call's opening. None for the JSON-object layout."""
        if not self.name_sep:
            return None
        own_id = rf"(?:{re.escape(self.id_sep.strip())}\s*[A-Za-z0-9]*\s*)?" if self.id_sep else ""
        return re.compile(rf"([^\s\[\]{{}}]+)\s*{own_id}{re.escape(self.name_sep.strip())}\s*")


# DeepSeek's calls' markers: the calls' opening, a call's, the one between its name and its arguments, a
# call's closing, the calls'
DEEPSEEK = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)
FORMATS = {
    "hermes": ToolFormat(
        "hermes", "", "<tool_call>\n", "\n</tool_call>", "\n", "", "arguments", markup=("<tool_call>", "</tool_call>")
    ),  # fmt: skip
    "llama3_json": ToolFormat("llama3_json", "", "", "", "; ", "", "parameters", at_start_only=True),
    # Mistral's tokenizers before v11 (Mistral 7B v0.3, Nemo): one JSON list of calls.
    "mistral": ToolFormat(
        "mistral", "[TOOL_CALLS][", "", "", ", ", "]", "arguments", short_ids=True, markup=("[TOOL_CALLS]",)
    ),  # fmt: skip
    # Phi-4-mini's: one JSON list after ``functools`` (vLLM's ``phi4_mini_json``; the arguments may come
    # under "parameters" too, as the parser reads them).
    "phi4_mini_json": ToolFormat("phi4_mini_json", "functools[", "", "", ", ", "]", "arguments"),
    # Granite 3's (vLLM's ``granite``): one JSON list after its <|tool_call|> token.
    "granite": ToolFormat("granite", "<|tool_call|>[", "", "", ", ", "]", "arguments", markup=("<|tool_call|>",)),
    # v11 and later (Mistral Small 3.2, Magistral, Devstral, Ministral 3): each call its own, its name
    # outside its arguments.
    "mistral_v11": ToolFormat(
        "mistral_v11",
        "",
        "[TOOL_CALLS]",
        "",
        "",
        "",
        "arguments",
        name_sep="[ARGS]",
        short_ids=True,
        markup=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    ),  # fmt: skip
    # DeepSeek's, between markers that are special tokens of its vocabulary: V3's and R1's, each call its
    # type, its name and its arguments in a fenced JSON block, a line between calls; V3.1's, the name and
    # the arguments alone.
    "deepseek_v3": ToolFormat(
        "deepseek_v3",
        DEEPSEEK[0],
        DEEPSEEK[1] + "function" + DEEPSEEK[2],
        "\n```" + DEEPSEEK[3],
        "\n",
        DEEPSEEK[4],
        "arguments",
        name_sep="\n```json\n",
        markup=DEEPSEEK,
    ),  # fmt: skip
    "deepseek_v31": ToolFormat(
        "deepseek_v31",
        DEEPSEEK[0],
        DEEPSEEK[1],
        DEEPSEEK[3],
        "",
        DEEPSEEK[4],
        "arguments",
        name_sep=DEEPSEEK[2],
        markup=DEEPSEEK,
    ),  # fmt: skip
}


class HarmonyFormat:
    """gpt-oss's calls: a message on the commentary channel addressed ``to=functions.NAME``, its body the
    arguments, ended by ``<|call|>`` (an end of generation: one call per output). It reads the content
    a :class:`~server.reasoning.HarmonyReasoningStream` leaves (the answer's text, and the call messages
    as written); text outside any message is content, and a body's JSON is kept as written."""

    name = "harmony"
    marker = CHANNEL
    special_ids: tuple[int, ...] = ()  # (a harmony request keeps every marker: server/routes/chat.py)
    closers: tuple[str, ...] = ()  # (a call's JSON closes it: <|call|> is then forced)
    # Arguments as gpt-oss writes them (compact JSON).
    layout = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """One call of one of ``tools``: gpt-oss ends its output with a call, so ``parallel`` gives one too."""
        return call_lark(tools, self.layout)

    def render(self, calls: list[tuple[str, Any]]) -> str:
        return "".join(call_header(n) + json.dumps(a, ensure_ascii=False) + CALL for n, a in calls)

    def scanner(self) -> HarmonyCallScanner:
        return HarmonyCallScanner()

    def bind(self, tokenizer) -> HarmonyFormat:
        return self

    def for_tools(self, functions: list[dict]) -> HarmonyFormat:
        return self

    def new_id(self) -> str:
        return call_id()

    def history(self, messages: list[dict]) -> list[dict]:
        return messages

    def start_of_calls(self, text: str) -> int:
        return text.find(CHANNEL)

    def content_end(self, text: str) -> int:
        return before_marker(text, CHANNEL)

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content, calls), as :meth:`ToolFormat.parse`: a call whose message a marker ended is whole, and
        so is the one the output ended inside unless ``cut`` (then it is dropped, neither call nor content)."""
        stream = HarmonyStream()
        content: list[str] = []
        calls: list[ToolCall] = []
        call: list[str] | None = None  # the open call: name, arguments so far
        for event in stream.feed(text) + stream.finish():
            if event[0] == "open":
                call = [event[1].function, ""] if event[1].kind == "call" else None
                if event[1].kind == "content":
                    content.append("")
            elif event[0] == "text":
                if call is not None:
                    call[1] += event[1]
                elif content:
                    content[-1] += event[1]
            elif call is not None:
                calls.append(ToolCall(call[0], call[1].strip() or "{}", call_id()))
                call = None
        if call is not None and not cut:
            calls.append(ToolCall(call[0], call[1].strip() or "{}", call_id()))
        joined = "\n\n".join(x for x in content if x)
        if not calls and not cut:
            return joined, []
        return (joined if joined.strip() else None), calls


class HarmonyCallScanner:
    """Forced harmony calls read as they are written, with :class:`CallScanner`'s events: ``("call", name)``
    once a call's header is complete, ``("args", text)`` for each piece of its body, ``("end",)`` where a
    marker ends it."""

    def __init__(self) -> None:
        self.stream = HarmonyStream()
        self.open = False

    def feed(self, delta: str) -> list[tuple]:
        events: list[tuple] = []
        for event in self.stream.feed(delta):
            if event[0] == "open":
                self.open = event[1].kind == "call"
                if self.open:
                    events.append(("call", event[1].function))
            elif event[0] == "text" and self.open:
                events.append(("args", event[1]))
            elif event[0] == "close" and self.open:
                events.append(("end",))
                self.open = False
        return events


class CallScanner:
    """Forced calls read as they are written: ``feed`` returns ``("call", name)`` once a call's name
    is complete, ``("args", text)`` for each new piece of its arguments (the exact text written), and
    ``("end",)`` when its arguments value closes. The grammar guarantees the layout
    (``{"name": ..., "<args_key>": <value>}`` in the format's wrapping), so no text is held back."""

    def __init__(self, fmt: ToolFormat) -> None:
        key = re.escape(fmt.args_key)
        self.header = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + key + r'"\s*:\s*(?=\S)')
        self.quoted = True  # the name is a JSON string's text
        if fmt.name_sep:  # the opening, the name, (the model's id,) name_sep: then the arguments
            self.header = re.compile(re.escape(fmt.call_open.strip()) + r"\s*" + fmt.name_head().pattern + r"(?=\S)")
            self.quoted = False
        self.text = ""
        self.pos = 0  # where the next call's header is looked for
        self.open = False  # inside a call's arguments
        self.scanned = 0  # how far its arguments were scanned
        self.sent = 0  # how far its arguments went out
        self.depth, self.in_string, self.escaped, self.started = 0, False, False, False

    def feed(self, delta: str) -> list[tuple]:
        self.text += delta
        events: list[tuple] = []
        while True:
            if not self.open:
                m = self.header.search(self.text, self.pos)
                if m is None:
                    return events
                events.append(("call", json.loads(f'"{m.group(1)}"') if self.quoted else m.group(1)))
                self.open, self.scanned, self.sent = True, m.end(), m.end()
                self.depth, self.in_string, self.escaped, self.started = 0, False, False, False
            end = self._scan()
            upto = len(self.text) if end is None else end
            if upto > self.sent:
                events.append(("args", self.text[self.sent : upto]))
                self.sent = upto
            if end is None:
                return events
            events.append(("end",))
            self.open, self.pos = False, end

    def _scan(self) -> int | None:
        """Where the open call's arguments value ends (past its last character), or None if not yet."""
        text = self.text
        for i in range(self.scanned, len(text)):
            ch = text[i]
            if not self.in_string and self.depth == 0 and self.started and (ch in ",}]" or ch.isspace()):
                self.scanned = i
                return i  # a bare scalar (a number, true, false, null) ended
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:  # a string value
                        self.scanned = i + 1
                        return i + 1
            elif ch == '"':
                self.in_string, self.started = True, True
            elif ch in "{[":
                self.depth, self.started = self.depth + 1, True
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.scanned = i + 1
                    return i + 1
            elif not ch.isspace():
                self.started = True
        self.scanned = len(text)
        return None


# -- models whose chat template takes no tools ---------------------------------------------------------------
FALLBACK_SYSTEM = (
    "You may call functions to answer. To call one, write exactly\n"
    "<tool_call>\n"
    '{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n'
    "</tool_call>\n"
    "once per call, and nothing after the calls. Results come back in <tool_response> tags.\n"
    "The functions, as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>"
)


def fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template that knows only system/user/assistant: the tools described in the
    system message, assistant calls written in the Hermes style, tool results as user turns."""
    fmt = FORMATS["hermes"]
    out: list[dict] = []
    if tools:
        text = FALLBACK_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append({**messages[0], "content": messages[0]["content"] + "\n\n" + text})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": text})
    for m in messages:  # every other key (a name, replayed reasoning) stays for the template
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            content = ((m.get("content") or "") + "\n" + fmt.render(calls)).strip()
            out.append({**{k: v for k, v in m.items() if k != "tool_calls"}, "content": content})
        elif m["role"] == "tool":  # (its call id and function name are no user's)
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({**m, "content": m.get("content") or ""})
    return out


# -- helpers -----------------------------------------------------------------------------------------------
def read_runs(
    text: str, i: int, marker: str, run, cut: bool, later: bool = True, close: str = "", unfinished=None
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of an output whose calls begin at ``i``, as the syntaxes' ``parse`` reads them:
    ``run(text, pos)`` gives the whole calls of the run of calls at ``pos`` and where it ends. The text
    before the calls as written (a stream sent it so) less the blank before them, the text between runs
    (``later``: calls after more text, where ``marker`` comes again, and calls after a marker that
    opened none, as in prose about the syntax) and after the last are content;
    ``cut``: the output ends in a call the limit cut, neither call nor content. It begins at the first
    marker after the whole calls (or at a start of one that the limit cut); with none, inside the last run
    where that run is still open (``close`` ends a run, as a list's ``]``), else the words the limit cut
    are content. Without ``later`` (the calls are the whole output) all after the whole calls is dropped.
    ``unfinished(text, j)``, where the syntax can tell: the call at marker ``j`` runs on to the end of the
    text (the one the limit cut: the first such marker is where it begins, a marker before it is prose,
    and a call written inside its arguments is none)."""

    def held(j: int) -> bool:  # the call the limit cut opens at j
        return cut and unfinished is not None and unfinished(text, j)

    calls, end = run(text, i)
    while later and not calls and not held(i) and (j := text.find(marker, i + len(marker))) >= 0:  # (prose)
        i = j
        calls, end = run(text, i)
    if not calls and not cut:
        return text, []
    parts, pos = [text[:i].rstrip()], end
    while later and calls and (j := text.find(marker, pos)) >= 0:
        more, after = run(text, j)
        if not more and held(j):
            break
        if not more:  # (a marker in the text between: it stays text)
            pos = j + len(marker)
            continue
        parts.append(text[end:j].strip())
        calls, end = calls + more, after
        pos = end
    tail = text[end:]
    if cut:
        k = text.find(marker, end)
        while k >= 0 and unfinished is not None and not held(k):
            k = text.find(marker, k + len(marker))
        k = k if k >= 0 else max(end, before_tail(text, marker))
        open_run = bool(close) and not text[:end].endswith(close)
        tail = "" if not calls or not later or open_run else text[end:k]
    content = "\n".join(x for x in [*parts, tail.strip()] if x)
    return content or None, calls


def json_end(text: str, pos: int) -> int | None:
    """Where the JSON object or array that opens at ``pos`` closes (past it), following strings and their
    escapes; None where it is still open when ``text`` ends."""
    depth, in_string, escaped = 0, False, False
    for k, ch in enumerate(text[pos:]):
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return pos + k + 1
    return None


def before_marker(text: str, marker: str) -> int:
    """How much of a growing ``text`` is surely not ``marker``: up to where it first comes, or up to a
    tail that may be its start."""
    start = text.find(marker)
    return start if start >= 0 else before_tail(text, marker)


def before_tail(text: str, marker: str) -> int:
    """``text``'s length, less a tail that may be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _lit(s: str) -> str:
    return json.dumps(s) if s else ""  # a Lark string literal (JSON escapes are Lark's)


def special_lit(text: str, specials: tuple[tuple[str, int], ...]) -> str:
    """``text`` as a Lark expression: the pieces of it that are special tokens (``specials``: text, id) by
    id, the rest as strings."""
    parts: list[str] = []
    while text:
        hits = [(text.find(piece), piece, i) for piece, i in specials if piece in text]
        if not hits:
            parts.append(_lit(text))
            break
        at, piece, i = min(hits)
        parts += [_lit(text[:at]), f"<[{i}]>"]
        text = text[at + len(piece) :]
    return " ".join(x for x in parts if x)


def _regex_lit(s: str) -> str:
    """``s`` as itself inside a Lark ``/.../`` regex (a line end as ``\\n``: the regex is one line)."""
    return re.escape(s).replace("/", "\\/").replace("\\\n", "\\n").replace("\\\r", "\\r")


def json_answer(schema: dict, whitespace_pattern: str | None = None) -> str:
    """A response_format's JSON schema as a Lark ``%json`` expression, laid out as its own grammar
    would be."""
    return "%json " + json.dumps({**schema, "x-guidance": json_layout(whitespace_pattern)})


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _expect(text: str, pos: int, lit: str, markup: tuple[str, ...] = ()) -> int | None:
    """Past ``lit`` at ``pos`` (whitespace around it and within it is free, and beside a piece of
    ``markup`` in it: a SentencePiece model writes "[TOOL_CALLS] [" where a template wrote "[TOOL_CALLS]["),
    or None if it is not there."""
    for piece in markup:
        lit = lit.replace(piece, f" {piece} ")
    for want in lit.split():
        pos = _skip_ws(text, pos)
        if not text.startswith(want, pos):
            return None
        pos += len(want)
    return pos


_REF = re.compile(r"^#/(\$defs|definitions)/(.+)$")


def _hoist_defs(schema: Any, prefix: str, defs: dict) -> Any:
    """``schema`` with its ``$defs`` / ``definitions`` moved into ``defs`` under prefixed names and its
    ``$ref``s rewritten to them: a tool's parameters keep their references once nested in the call's
    schema (pydantic writes nested models as ``$defs``)."""
    schema = copy.deepcopy(schema)
    if not isinstance(schema, dict):
        return schema
    own = {**schema.pop("definitions", {}), **schema.pop("$defs", {})}

    def rewrite(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (m := _REF.match(ref)) and m.group(2) in own:
                node = {**node, "$ref": f"#/$defs/{prefix}{m.group(2)}"}
            return {k: rewrite(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for name, d in own.items():
        defs[prefix + name] = rewrite(d)
    return rewrite(schema)
