"""Kimi's tool calls (K2's, and K2.5's and K2.6's, which Augur serves; vLLM's parser ``kimi_k2``)::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

(one line, without the break).

The markers are special tokens of Kimi's vocabulary. What a call names is its *id*,
``functions.NAME:INDEX``, the index counting the calls of the whole conversation from 0: the model
writes it, the API returns it as the call's ``id`` (the name is the part between ``functions.`` and
the last ``:``), and the chat template writes each history call by its id and each tool result after
``## Return of`` its ``tool_call_id``. So a conversation's ids must be of that shape: a history whose
calls carry other ids (a client's own, another server's) has them rewritten, each call's to
``functions.NAME:INDEX`` with the first index no other call of the conversation holds, and the tool
results that answer it with it (:meth:`KimiFormat.history`). A forced call's grammar writes
``functions.NAME:`` for one of the tools and lets the model write the index, of at most six digits; an
output whose calls repeat an id gets the later call a free index (ids are how results find their
calls).
"""

from __future__ import annotations

import dataclasses
import re
from collections import deque
from dataclasses import dataclass

from server.tools import CallScanner, ToolCall, ToolFormat, _lit

KIMI = (
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
)
KIMI_ID = re.compile(r"functions\.(.+):(\d+)")  # a call's id: its name, its index in the conversation


def own_call(name: str, call_id: str | None = None) -> tuple[str, str | None]:
    """(name, id) of what a call names: ``functions.NAME:INDEX`` is NAME with that id; anything else
    (a model that wrote a bare name) is the name itself, with ``call_id``."""
    m = KIMI_ID.fullmatch(name)
    return (m.group(1), name) if m else (name, call_id)


@dataclass(frozen=True)
class KimiFormat(ToolFormat):
    def name_lit(self, name: str) -> str:
        return f"{_lit(f'functions.{name}:')} /[0-9]{{1,6}}/"  # (bounded: a model may not end a run of digits)

    def written_name(self, name: str, index: int) -> str:
        return f"functions.{name}:{index}"

    @property
    def markup_closers(self) -> tuple[str, ...]:
        return (self.name_sep, *super().markup_closers)  # (what ends the index the model writes, as the run's end)

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        content, calls = super().parse(text, cut)
        ids, out = Ids(), []
        for c in calls:
            name, call_id = own_call(c.name, c.id)
            out.append(dataclasses.replace(c, name=name, id=ids.take(name, call_id)))
        return content, out

    def scanner(self) -> KimiCallScanner:
        return KimiCallScanner(self)

    def history(self, messages: list[dict]) -> list[dict]:
        """``messages`` with every call's id of Kimi's shape: one that is kept, another replaced by
        ``functions.NAME:INDEX`` with the first index no other call holds, in the tool results too. Calls
        that share a client id (none: ``""``) get one new id each, and the results that say that id
        take them in turn."""
        out: list[dict] = []
        renamed: dict[str, deque[str]] = {}  # a client's id: the new ids not yet answered, in order
        held = {int(m.group(2)) for m in map(KIMI_ID.fullmatch, _history_ids(messages)) if m}
        index = 0
        for m in messages:
            if m.get("tool_calls"):
                calls = []
                for c in m["tool_calls"]:
                    new = old = c.get("id") or ""
                    if not KIMI_ID.fullmatch(old):
                        while index in held:
                            index += 1
                        held.add(index)
                        new = f"functions.{c['function']['name']}:{index}"
                        renamed.setdefault(old, deque()).append(new)
                    calls.append({**c, "id": new})
                m = {**m, "tool_calls": calls}
            elif m.get("role") == "tool" and renamed.get(m.get("tool_call_id") or ""):
                m = {**m, "tool_call_id": renamed[m.get("tool_call_id") or ""].popleft()}
            out.append(m)
        return out


def _history_ids(messages: list[dict]) -> list[str]:
    return [c.get("id") or "" for m in messages for c in m.get("tool_calls") or []]


class Ids:
    """The ids of one output's calls: the model's own, but a repeated one (or none: a bare name) becomes
    ``functions.NAME:INDEX`` with an index past every one the output used."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.top = -1  # the largest index used

    def take(self, name: str, call_id: str | None) -> str:
        m = KIMI_ID.fullmatch(call_id or "")
        if m is None or call_id in self.seen:
            call_id = f"functions.{name}:{self.top + 1}"
            m = KIMI_ID.fullmatch(call_id)
        self.seen.add(call_id)
        self.top = max(self.top, int(m.group(2)))
        return call_id


class KimiCallScanner(CallScanner):
    """:class:`~server.tools.CallScanner`'s events, a call's as ``("call", name, id)``: the id the
    model wrote (a repeated one replaced, as :class:`Ids` replaces it)."""

    def __init__(self, fmt: ToolFormat) -> None:
        super().__init__(fmt)
        self.ids = Ids()

    def feed(self, delta: str) -> list[tuple]:
        out = []
        for e in super().feed(delta):
            if e[0] == "call":
                name, call_id = own_call(e[1])
                e = ("call", name, self.ids.take(name, call_id))
            out.append(e)
        return out


KIMI_K2 = KimiFormat("kimi_k2", KIMI[0], KIMI[1], KIMI[3], "", KIMI[4], "arguments", name_sep=KIMI[2], markup=KIMI)
