"""Kimi K2's tool calls (Kimi-K2-Instruct, K2-Instruct-0905, K2-Thinking: ``DeepseekV3ForCausalLM``
checkpoints; vLLM's parser ``kimi_k2``)::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

(one line, without the break).

The markers are special tokens of Kimi's vocabulary. What a call names is its *id*,
``functions.NAME:INDEX``, the index counting the calls of the whole conversation from 0: the model
writes it, the API returns it as the call's ``id`` (the name is the part between ``functions.`` and
the last ``:``), and the chat template writes each history call by its id and each tool result after
``## Return of`` its ``tool_call_id``. So a conversation's ids must be of that shape: a history whose
calls carry other ids (a client's own, another server's) has them rewritten, each call's to the id
its place in the conversation gives, and the tool results that answer it with it
(:meth:`KimiFormat.history`). A forced call's grammar writes ``functions.NAME:`` for one of the tools
and lets the model write the index, of at most six digits.
"""

from __future__ import annotations

import dataclasses
import re
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

    def _calls(self, text: str, pos: int) -> tuple[list[ToolCall], int]:
        calls, end = super()._calls(text, pos)
        return [_own(c) for c in calls], end

    def scanner(self) -> KimiCallScanner:
        return KimiCallScanner(self)

    def history(self, messages: list[dict]) -> list[dict]:
        """``messages`` with every call's id of Kimi's shape: one that is kept, another replaced by the id
        the call's place in the conversation gives (``functions.NAME:INDEX``), in the tool results too."""
        out: list[dict] = []
        renamed: dict[str, str] = {}
        index = 0
        for m in messages:
            if m.get("tool_calls"):
                calls = []
                for c in m["tool_calls"]:
                    old = c.get("id") or ""
                    new = old if KIMI_ID.fullmatch(old) else f"functions.{c['function']['name']}:{index}"
                    renamed[old] = new
                    calls.append({**c, "id": new})
                    index += 1
                m = {**m, "tool_calls": calls}
            elif m.get("role") == "tool" and (m.get("tool_call_id") or "") in renamed:
                m = {**m, "tool_call_id": renamed[m.get("tool_call_id") or ""]}
            out.append(m)
        return out


def _own(call: ToolCall) -> ToolCall:
    name, call_id = own_call(call.name, call.id)
    return dataclasses.replace(call, name=name, id=call_id)


class KimiCallScanner(CallScanner):
    """:class:`~server.tools.CallScanner`'s events, a call's as ``("call", name, id)``: the id the
    model wrote."""

    def feed(self, delta: str) -> list[tuple]:
        return [
            ("call", *own_call(e[1])) if e[0] == "call" and KIMI_ID.fullmatch(e[1]) else e for e in super().feed(delta)
        ]


KIMI_K2 = KimiFormat("kimi_k2", KIMI[0], KIMI[1], KIMI[3], "", KIMI[4], "arguments", name_sep=KIMI[2], markup=KIMI)
