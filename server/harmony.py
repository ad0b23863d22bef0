"""OpenAI's harmony format (gpt-oss's): an output read as messages on channels.

After the prompt's ``<|start|>assistant`` gpt-oss writes messages such as

    <|channel|>analysis<|message|>THINKING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

A *message* is a header (a role, ``<|channel|>`` and the channel's name, ``to=RECIPIENT``, a content type,
``<|constrain|>`` and a constraint, in either order), ``<|message|>``, then its body, which ends at
``<|end|>``, ``<|call|>`` or ``<|return|>``. The last two also end generation (they are end-of-sequence
tokens of gpt-oss), so they are not in an output's text: there a message ends with the output. What a
message is for follows from its header (:attr:`Header.kind`):

- addressed ``to=functions.NAME``: a call of that function, its body the arguments (JSON);
- addressed to anything else (a built-in tool such as ``browser.search`` or ``python``): not part of the
  answer, and not read;
- on the ``analysis`` channel: reasoning;
- on ``final``, ``commentary`` (a preamble, which is meant for the user) or no channel: content.

The markers are special tokens of gpt-oss's tokenizer (o200k_harmony): a request read as harmony is
detokenized with them kept, and :class:`HarmonyStream` takes them out. The same marker written in
pieces by ordinary tokens reads as the marker (as ``</think>`` does for Qwen3's parser); the grammars
of :func:`prelude_lark` never let a body hold one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from engine.request.structured import ANSWER

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ENDS = (END, RETURN, CALL)  # what closes a message's body
FUNCTIONS = "functions."  # the namespace of the request's tools, as recipients name them

_LONGEST = max(map(len, MARKERS))
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|(?<=[\s>]))to=([^\s<]+)")


@dataclass(frozen=True)
class Header:
    """A message's header, as far as it decides what the message is."""

    channel: str | None = None
    recipient: str | None = None

    @classmethod
    def read(cls, text: str) -> Header:
        channel, recipient = _CHANNEL.search(text), _RECIPIENT.search(text)
        return cls(channel.group(1) if channel else None, recipient.group(1) if recipient else None)

    @property
    def kind(self) -> str:
        """``call``, ``other`` (addressed to something that is not a function), ``reasoning`` or ``content``."""
        if self.recipient is not None:
            return "call" if self.recipient.startswith(FUNCTIONS) and len(self.recipient) > len(FUNCTIONS) else "other"
        return "reasoning" if self.channel == "analysis" else "content"

    @property
    def function(self) -> str:
        return (self.recipient or "")[len(FUNCTIONS) :]


def call_header(name: str) -> str:
    """The header gpt-oss writes for a call of function ``name`` (after the turn's ``<|start|>assistant``)."""
    return f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"


class HarmonyStream:
    """Harmony text, as it grows, read into events: ``("open", header)`` when a message's header is
    complete (or, for text outside any header, when its first character comes), ``("text", piece)`` for
    its body, ``("close", marker)`` when a marker ends it. A message the output ends inside gets no
    close. Text that may still turn out to be a marker is held back until it is known; the events of
    any chunking of a text are those of the whole text, with its pieces joined."""

    HEADER, BODY, BETWEEN = 0, 1, 2

    def __init__(self, opening: str = "") -> None:
        """``opening``: the text the prompt wrote for the output's turn (gpt-oss's generation prompt is
        ``<|start|>assistant``): the output goes on from there. Without a ``<|start|>`` in it, the output
        goes on inside a body without a header (content)."""
        self.state = self.BODY
        self.header = ""  # HEADER: the header so far
        self.message = Header()  # BODY: the open message's header
        self.announced = False  # BODY: its open event went out
        self.held = ""
        self.primed = 0  # how much of ``header`` the prompt wrote
        start = opening.rfind(START)
        if start >= 0:
            self.feed(opening[start:])
            self._flush([])  # the prompt's opening does not end in half a marker
            self.primed = len(self.header)

    def feed(self, delta: str) -> list[tuple]:
        text, self.held = self.held + delta, ""
        events: list[tuple] = []
        while text:
            m = _MARKER.search(text)
            if m is None:
                keep = _marker_prefix_start(text)
                self._text(text[:keep], events)
                self.held = text[keep:]
                break
            self._text(text[: m.start()], events)
            self._marker(m.group(), events)
            text = text[m.end() :]
        return events

    def finish(self) -> list[tuple]:
        """The events of what was held back, once the output has ended: half a marker is text, and a
        header that never got its ``<|message|>`` is content if it names nothing (a model that wrote
        plain text), else dropped."""
        events: list[tuple] = []
        self._flush(events)
        if self.state == self.HEADER:
            written = self.header[self.primed :]
            if written.strip() and _MARKER.search(written) is None and "to=" not in written:
                self.state, self.message, self.announced = self.BODY, Header(), False
                self._text(written, events)
            self.header = ""
        return events

    # -- the state machine ------------------------------------------------------------------------------
    def _flush(self, events: list[tuple]) -> None:
        held, self.held = self.held, ""
        self._text(held, events)

    def _text(self, text: str, events: list[tuple]) -> None:
        if not text:
            return
        if self.state == self.HEADER:
            self.header += text
            return
        if self.state == self.BETWEEN:  # text outside any message: content, without the space before it
            text = text.lstrip()
            if not text:
                return
            self.state, self.message, self.announced = self.BODY, Header(), False
        if not self.announced:
            events.append(("open", self.message))
            self.announced = True
        events.append(("text", text))

    def _marker(self, marker: str, events: list[tuple]) -> None:
        if self.state == self.HEADER:
            if marker == MESSAGE:
                self.state, self.message, self.announced = self.BODY, Header.read(self.header), True
                events.append(("open", self.message))
            elif marker in (CHANNEL, CONSTRAIN):
                self.header += marker
            elif marker == START:
                self.header = ""
            else:  # a header that ended before its message: nothing
                self.state = self.BETWEEN
            return
        if marker in ENDS or marker in (START, CHANNEL):
            if self.state == self.BODY and self.announced:
                events.append(("close", marker if marker in ENDS else None))
            self.state = self.BETWEEN
            if marker in (START, CHANNEL):
                self.state, self.header, self.primed = self.HEADER, marker if marker == CHANNEL else "", 0
        # <|message|> or <|constrain|> inside a body: not text, and nothing else either


def _marker_prefix_start(text: str) -> int:
    """Where a tail of ``text`` that may be the beginning of a marker starts (``len(text)``: none)."""
    for k in range(min(len(text), _LONGEST - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in MARKERS):
            return len(text) - k
    return len(text)


# -- tokens ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HarmonyVocab:
    """The markers' token ids in a tokenizer, and its decoding (for the few tokens of a header)."""

    ids: dict  # marker text -> token id
    decode: Callable[[list[int]], str]

    @classmethod
    def of(cls, tokenizer, flag: str = "--reasoning-parser harmony") -> HarmonyVocab:
        """ValueError, naming ``flag``, where a marker is not one token of ``tokenizer``."""
        ids = {}
        for marker in MARKERS:
            encoded = tokenizer.encode(marker, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(
                    f"{flag}: {marker!r} is not one token of this tokenizer ({len(encoded)} tokens): is this "
                    "a gpt-oss model (harmony format)?"
                )
            ids[marker] = encoded[0]

        def decode(token_ids: list[int]) -> str:
            return tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        return cls(ids, decode)

    def reasoning_tokens(self, token_ids: list[int], opening: str) -> int:
        """Tokens of an output that belong to its analysis messages: header, body and end marker (and the
        ``<|start|>`` that began one). The same reading as :class:`HarmonyStream`, on token ids."""
        stream = HarmonyStream(opening)
        state, header = stream.state, stream.header
        kind = stream.message.kind if state == stream.BODY else "content"
        ends = {self.ids[m] for m in ENDS}
        start, channel, message = self.ids[START], self.ids[CHANNEL], self.ids[MESSAGE]
        count = began = 0  # began: the message began with <|start|>
        header_ids: list[int] = []
        for tok in token_ids:
            if state == stream.HEADER:
                if tok == message:
                    kind = Header.read(header + self.decode(header_ids)).kind
                    count += (began + len(header_ids) + 1) if kind == "reasoning" else 0
                    state = stream.BODY
                elif tok == start:
                    header, header_ids, began = "", [], 1
                elif tok in ends:
                    state = stream.BETWEEN
                else:
                    header_ids.append(tok)
            elif tok in (start, channel):  # a new message
                state, header, header_ids, began = stream.HEADER, "", [tok] if tok == channel else [], int(tok == start)
            elif tok in ends:
                count += state == stream.BODY and kind == "reasoning"
                state = stream.BETWEEN
            elif state == stream.BODY:
                count += kind == "reasoning"
            else:  # text outside any message is content
                state, kind = stream.BODY, "content"
        return count


# -- grammars -------------------------------------------------------------------------------------------------
# A body: any text without a marker in it (special tokens are never text to llguidance; this also keeps the
# markers' text, written in pieces, out).
_BODY = "BODY: /(?s:.*)/ & ~/(?s:.*)" + "(" + "|".join(re.escape(m) for m in MARKERS) + ")" + "(?s:.*)/"


def prelude_lark(answer_is_call: bool, opened: bool) -> str:
    """Lark rules for what a harmony output may write before the answer a grammar constrains: any
    number of analysis messages and preambles (commentary without a recipient), each followed by the
    next message's ``<|start|>assistant``; then the answer: a call (its grammar writes its own header)
    or the final message's body. ``opened``: the prompt opened an analysis message, so the output starts
    inside its body.

    The answer's end marker (``<|return|>``, ``<|call|>``) is not in the grammar: it is an end-of-sequence
    token, which a complete grammar allows by itself (llguidance takes no end-of-sequence token as a
    forced one, so an ending within max_tokens could not be found through it)."""
    message = f'message: {CHANNEL} ("analysis" | "commentary") {MESSAGE} BODY {END} {START} "assistant"'
    answer = f"@{ANSWER}" if answer_is_call else f'{CHANNEL} "final" {MESSAGE} @{ANSWER}'
    inside = f'BODY {END} {START} "assistant" ' if opened else ""
    return f"start: {inside}message* {answer}\n{message}\n{_BODY}\n"


def call_lark(tools: list[dict], json_layout: dict) -> str:
    """A Lark grammar (llguidance's dialect) for one call of one of ``tools`` (OpenAI function objects),
    as gpt-oss writes it: its header and its arguments (JSON-schema checked); the output ends there (with
    ``<|call|>``, an end-of-sequence token: see :func:`prelude_lark`)."""
    calls = []
    for fn in tools:
        schema = {**(fn.get("parameters") or {"type": "object"}), "x-guidance": json_layout}
        head = json.dumps(f"commentary to={FUNCTIONS}{fn['name']} ")
        calls.append(f'{CHANNEL} {head} {CONSTRAIN} "json" {MESSAGE} %json {json.dumps(schema)}')
    return "start: " + " | ".join(calls) + "\n"
