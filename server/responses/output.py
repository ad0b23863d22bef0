"""One generation's text, as it grows, made into the Responses API's output items and the events
that announce them.

:class:`OutputBuilder` is fed the text's deltas and its end; it returns the events to send (without
their ``sequence_number``, which the stream adds) and keeps the items. A streamed response and a
collected one run the same builder, so their items are equal by construction.

- **Text** goes out as it comes: a ``message`` item with one ``output_text`` part.
- **Tool calls under** ``auto`` are parsed out of the text (the model's own syntax): text is held back
  from where a call may begin, and the calls are sent when the output ends, since only then is it
  known that the text was a well-formed run of calls (as on chat completions).
- **Reasoning** (a reasoning model's thinking, with ``--reasoning-parser``) comes first, as a
  ``reasoning`` item with one ``reasoning_text`` part, its text sent as it comes; it closes where
  the thinking ends (``incomplete`` if the output was cut inside it).
- **Forced calls** (``required`` or a named function) are written by a grammar in a known layout:
  each ``function_call`` item is announced once its name is written, and its arguments go out as
  they are written (:class:`CallScanner`). A call cut short by ``max_output_tokens`` ends
  ``incomplete``, its arguments a prefix of valid JSON.
"""

from __future__ import annotations

import json

from server.reasoning import HarmonyReasoningStream, ReasoningStream
from server.responses.protocol import new_id
from server.tool_formats import CallSyntax
from server.tools import argument_pieces, scanned_call_id


class OutputBuilder:
    def __init__(self, tools: CallSyntax | None, forced: bool,
                 reasoning: ReasoningStream | HarmonyReasoningStream | None = None,
                 one_call: bool = False) -> None:  # fmt: skip
        self.one_call = one_call  # parallel_tool_calls false: the output's first call alone (as vLLM keeps)
        self.reasoning = reasoning  # splits a reasoning model's thinking off (None: no reasoning parser)
        self.thinking: dict | None = None  # the open reasoning item
        self.tools = tools  # calls are read from the text (None: plain text)
        self.scanner = tools.scanner() if tools is not None and forced else None
        self.items: list[dict] = []
        self.index: dict[str, int] = {}  # item id -> output_index
        self.text = ""  # the whole output so far
        self.message: dict | None = None  # the open message item
        self.sent = 0  # how much of the text went out as message content
        self.call: dict | None = None  # the open function_call item (forced calls)

    # -- feeding ---------------------------------------------------------------------------------------
    def feed(self, delta: str) -> list[dict]:
        if self.reasoning is None:
            return self._answer(delta)
        thought, delta = self.reasoning.feed(delta)
        events = self._think(thought)
        if delta:
            events += self._close_thinking("completed")
        return events + self._answer(delta)

    def _answer(self, delta: str) -> list[dict]:
        """The events for a delta of the answer (the text after any thinking)."""
        if not delta:
            return []
        self.text += delta
        if self.scanner is not None:
            return self._forced(self.scanner.feed(delta))
        if self.tools is None:
            return self._say(delta)
        safe = len(self.text[: self.tools.content_end(self.text)].rstrip())  # whitespace before a call is not
        events = self._say(self.text[self.sent : safe]) if safe > self.sent else []
        self.sent = max(self.sent, safe)
        return events

    def finish(self, reason: str | None) -> list[dict]:
        """The closing events; ``reason`` is the engine's finish reason."""
        status = "completed" if reason == "stop" else "incomplete"
        events: list[dict] = []
        if self.reasoning is not None:
            thought, rest = self.reasoning.finish()
            events += self._think(thought)
            ended = self.reasoning.ended
            events += self._close_thinking("completed" if ended or reason == "stop" else "incomplete")
            events += self._answer(rest)
        if self.scanner is not None:
            # Calls only, by grammar: a call cut short ends incomplete; text before any call is none.
            return events + (self._end_call(status) if self.call is not None else [])
        if self.tools is not None:
            content, calls = self.tools.parse(self.text, cut=reason == "length")
            calls = calls[:1] if self.one_call else calls
            if calls:  # the text before and after the calls is the message (as chat's content), then the calls
                events += self._say((content or "")[self.sent :])
                events += self._close_message("completed")
                for call in calls:
                    events += self._open_call(call.name, call.id)
                    for piece in argument_pieces(call.arguments):
                        events += self._args(piece)
                    events += self._end_call("completed")
                return events
            events += self._say((content or "")[self.sent :])  # a call cut short is no content
        if self.message is None and not self.items:  # nothing was said: an empty message still answers
            events += self._open_message()
        return events + self._close_message(status)

    # -- items -----------------------------------------------------------------------------------------
    def _think(self, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        if self.thinking is None:
            self.thinking = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                             "encrypted_content": None, "status": "in_progress"}  # fmt: skip
            self.index[self.thinking["id"]] = len(self.items)
            self.items.append(self.thinking)
            events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                           "item": _copy(self.thinking)})  # fmt: skip
            part = {"type": "reasoning_text", "text": ""}
            self.thinking["content"].append(part)
            events.append({"type": "response.content_part.added", **self._where(self.thinking), "content_index": 0,
                           "part": _copy(part)})  # fmt: skip
        self.thinking["content"][0]["text"] += text
        events.append({"type": "response.reasoning_text.delta", **self._where(self.thinking), "content_index": 0,
                       "delta": text})  # fmt: skip
        return events

    def _close_thinking(self, status: str) -> list[dict]:
        item, self.thinking = self.thinking, None
        if item is None:
            return []
        item["status"] = status
        part = item["content"][0]
        where = self._where(item)
        return [
            {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": part["text"]},
            {"type": "response.content_part.done", **where, "content_index": 0, "part": _copy(part)},
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": _copy(item)},
        ]

    def _say(self, text: str) -> list[dict]:
        if not text:
            return []
        events = self._open_message() if self.message is None else []
        part = self.message["content"][0]
        part["text"] += text
        events.append({"type": "response.output_text.delta", **self._where(), "content_index": 0, "delta": text,
                       "logprobs": []})  # fmt: skip
        return events

    def _open_message(self) -> list[dict]:
        self.message = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}  # fmt: skip
        self.index[self.message["id"]] = len(self.items)
        self.items.append(self.message)
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(self.message)}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.message["content"].append(part)
        part_added = {"type": "response.content_part.added", **self._where(), "content_index": 0, "part": _copy(part)}
        return [added, part_added]

    def _close_message(self, status: str) -> list[dict]:
        if self.message is None:
            return []
        self.message["status"] = status
        part = self.message["content"][0]
        where = self._where()
        events = [
            {"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"], "logprobs": []},
            {"type": "response.content_part.done", **where, "content_index": 0, "part": _copy(part)},
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": _copy(self.message)},
        ]
        self.message = None
        return events

    def _forced(self, found: list[tuple]) -> list[dict]:
        events: list[dict] = []
        for kind, *value in found:
            if kind == "call":
                events += self._open_call(value[0], scanned_call_id(self.tools, value))
            elif kind == "args":
                events += self._args(value[0])
            else:
                events += self._end_call("completed")
        return events

    def _open_call(self, name: str, call_id: str) -> list[dict]:
        self.call = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                     "name": name, "arguments": ""}  # fmt: skip
        self.index[self.call["id"]] = len(self.items)
        self.items.append(self.call)
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(self.call)}]

    def _args(self, piece: str) -> list[dict]:
        self.call["arguments"] += piece
        return [{"type": "response.function_call_arguments.delta", **self._where(self.call), "delta": piece}]

    def _end_call(self, status: str) -> list[dict]:
        call, self.call = self.call, None
        call["status"] = status
        where = self._where(call)
        done = {"type": "response.function_call_arguments.done", **where, "name": call["name"],
                "arguments": call["arguments"]}  # fmt: skip
        return [done, {"type": "response.output_item.done", "output_index": where["output_index"], "item": _copy(call)}]

    def _where(self, item: dict | None = None) -> dict:
        item = item if item is not None else self.message
        return {"item_id": item["id"], "output_index": self.index[item["id"]]}


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))
