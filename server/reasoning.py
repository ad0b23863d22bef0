"""Reasoning models: where their thinking is, in a prompt and in an output, and the switches that
turn it on or off.

A reasoning model writes its thinking between two markers (``<think>`` and ``</think>`` for Qwen3,
QwQ and DeepSeek-R1) before its answer. ``--reasoning-parser`` names the convention
(:data:`SYNTAXES`); the server then

- reads from the rendered prompt whether the output starts inside the thinking (the chat template
  opened it: DeepSeek-R1's templates, Qwen3's thinking-only models), may start with it (Qwen3's
  hybrid models, which open it themselves), or has it turned off (the template closed it: Qwen3 with
  ``enable_thinking`` false) — :meth:`ReasoningSyntax.frame`;
- splits each output into ``reasoning_content`` and ``content`` (:meth:`ReasoningSyntax.split`, and
  :class:`ReasoningStream` for a stream: the two agree, chunk by chunk);
- and gives the engine a :class:`~engine.request.structured.Thinking` frame, so that a grammar
  (tool calls, a schema) applies to the answer after the thinking and a thinking budget can force
  its end (engine/structured).

``reasoning_effort`` maps to the template's switch: ``none`` and ``minimal`` turn thinking off, the
other levels on (docs/reasoning.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request.structured import Thinking

# Chat template variables that turn a hybrid model's thinking on or off, by the families that read
# them: Qwen3 and GLM-4.5 ``enable_thinking``, DeepSeek-V3.1 ``thinking``.
SWITCHES = ("enable_thinking", "thinking")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # OpenAI's reasoning_effort values
OFF_EFFORTS = ("none", "minimal")


@dataclass(frozen=True)
class ReasoningFrame:
    """Where a request's output stands in the thinking when it begins."""

    # True: inside it (the prompt opened it); False: the model may open it; None: turned off (the
    # template closed it before the output): no thinking is expected.
    opened: bool | None


@dataclass(frozen=True)
class ReasoningSyntax:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # DeepSeek-R1's convention: the model thinks first even where the prompt did not open the
    # thinking (its older templates leave the opening marker to the model, which may omit it).
    thinks_first: bool = False

    # -- the prompt -------------------------------------------------------------------------------------
    def frame(self, opening: str) -> ReasoningFrame:
        """The frame of an output that follows ``opening``: the text the chat template wrote for this
        turn (its generation prompt, or the final message being continued)."""
        start, end = opening.rfind(self.start), opening.rfind(self.end)
        if start > end:
            return ReasoningFrame(True)
        if end >= 0:
            return ReasoningFrame(None)
        return ReasoningFrame(True if self.thinks_first else False)

    # -- the output -------------------------------------------------------------------------------------
    def split(self, text: str, frame: ReasoningFrame) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning None where the output did not think.
        An output cut inside its thinking is all reasoning."""
        stream = ReasoningStream(self, frame)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning if stream.thought else None), content + more_content

    def thinking(self, tokenizer, frame: ReasoningFrame, budget: int | None) -> Thinking | None:
        """The engine's frame for a grammar behind the thinking (None: thinking is off)."""
        if frame.opened is None:
            return None
        start, end = self.token_ids(tokenizer)
        return Thinking(start, end, self.end, frame.opened, budget)

    def token_ids(self, tokenizer) -> tuple[int, int]:
        """The markers' token ids; ValueError if either is not one token of ``tokenizer``."""
        ids = []
        for marker in (self.start, self.end):
            encoded = tokenizer.encode(marker, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(
                    f"--reasoning-parser {self.name}: {marker!r} is not one token of this tokenizer "
                    f"({len(encoded)} tokens): is this a {self.name} model?"
                )
            ids.append(encoded[0])
        return ids[0], ids[1]


SYNTAXES = {
    "qwen3": ReasoningSyntax("qwen3"),
    "deepseek_r1": ReasoningSyntax("deepseek_r1", thinks_first=True),
}


class ReasoningStream:
    """An output's text, as it grows, split into reasoning and content deltas. Whitespace around
    the reasoning and before the content is dropped, as :meth:`ReasoningSyntax.split` drops it, so
    the deltas joined equal the split of the whole text; text that may still turn out to be a marker
    is held back until it is known."""

    BEFORE, IN, AFTER = 0, 1, 2

    def __init__(self, syntax: ReasoningSyntax, frame: ReasoningFrame) -> None:
        self.syntax = syntax
        self.phase = self.IN if frame.opened else self.BEFORE
        self.opening = True  # IN: the opening marker (or whitespace before it) may still come
        self.held = ""  # text not yet sent: a possible marker, or whitespace that may be dropped
        self.thought = frame.opened is True  # the output has a thinking part
        self.reasoning_started = False  # IN: its first non-whitespace character came
        self.content_started = False

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) new in ``delta``."""
        text = self.held + delta
        self.held = ""
        reasoning = content = ""
        while text:
            if self.phase == self.BEFORE:
                stripped = text.lstrip()
                if self.syntax.start.startswith(stripped):  # the opening marker may still be coming
                    self.held = text
                    return reasoning, content
                if stripped.startswith(self.syntax.start):
                    self.phase, self.thought, self.opening = self.IN, True, False
                    text = stripped[len(self.syntax.start) :]
                    continue
                self.phase = self.AFTER
                continue
            if self.phase == self.IN:
                if self.opening:
                    stripped = text.lstrip()
                    if not stripped or (self.syntax.start.startswith(stripped) and stripped != self.syntax.start):
                        self.held = text
                        return reasoning, content
                    self.opening = False
                    text = stripped[len(self.syntax.start) :] if stripped.startswith(self.syntax.start) else stripped
                    continue
                if not self.reasoning_started:  # whitespace that opens the reasoning is dropped
                    text = text.lstrip()
                    if not text:
                        return reasoning, content
                    self.reasoning_started = True
                end = text.find(self.syntax.end)
                if end >= 0:
                    reasoning += text[:end].rstrip()
                    self.phase = self.AFTER
                    text = text[end + len(self.syntax.end) :]
                    continue
                keep = _unsure_tail(text, self.syntax.end)
                reasoning += text[:keep]
                self.held = text[keep:]
                return reasoning, content
            # AFTER: the content, without the whitespace that opens it
            if not self.content_started:
                text = text.lstrip() if self.thought else text
                if not text:
                    return reasoning, content
                self.content_started = True
            content += text
            text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended: a marker that never came is text."""
        held, self.held = self.held, ""
        if self.phase == self.BEFORE:
            return "", held
        if self.phase == self.IN:
            return (held.strip() if self.opening else held.rstrip()), ""
        return "", held


def _unsure_tail(text: str, marker: str) -> int:
    """Where the part of ``text`` that is surely reasoning ends: before trailing whitespace (dropped
    if the end marker follows) and before a tail that may be the marker's beginning."""
    cut = len(text)
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            cut = len(text) - k
            break
    return len(text[:cut].rstrip())


def reasoning_token_count(token_ids: list[int], end_id: int, thought: bool) -> int:
    """Tokens of an output that belong to its thinking: up to and including the end marker (all of
    them for an output cut inside it); 0 for an output that did not think."""
    if not thought:
        return 0
    return token_ids.index(end_id) + 1 if end_id in token_ids else len(token_ids)


def effort_switch(chat_template: str | None) -> str | None:
    """The template variable that turns thinking on or off, if the template reads one."""
    template = chat_template or ""
    for name in SWITCHES:
        if name in template:
            return name
    return None


@dataclass(frozen=True)
class ReasoningReader:
    """How one request's outputs are read: its convention, where its output starts, and the end
    marker's token id (to count reasoning tokens)."""

    syntax: ReasoningSyntax
    frame: ReasoningFrame
    end_id: int

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.syntax, self.frame)

    def split(self, text: str) -> tuple[str | None, str]:
        return self.syntax.split(text, self.frame)
