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

gpt-oss (``--reasoning-parser harmony``) writes no markers around its thinking but messages on channels
(server/harmony.py): :class:`HarmonySyntax` reads its analysis channel as the reasoning, and frames a
grammar with a :class:`~engine.request.structured.Prelude` of analysis messages rather than a
:class:`~engine.request.structured.Thinking`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from engine.request.structured import Prelude, StructuredOutput, Thinking
from server.harmony import CALL, END, HarmonyStream, HarmonyVocab, call_header, prelude_lark
from server.tokens import special_token_id

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
    opening: str = ""  # harmony: the text the prompt wrote for the output's turn, which the output goes on from


@dataclass(frozen=True)
class ReasoningSyntax:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # DeepSeek-R1's convention: the model thinks first even where the prompt did not open the
    # thinking (its older templates leave the opening marker to the model, which may omit it).
    thinks_first: bool = False
    # What the thinking opens with after its start marker and is no part of it (Gemma 4's channel name:
    # ``<|channel>thought\n``), dropped where it comes.
    label: str = ""
    budgets = True  # thinking_token_budget can force the end of thinking (its end marker is one token)

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

    def behind(self, structured: StructuredOutput | None, tokenizer, frame: ReasoningFrame, budget: int | None,
               call: bool) -> StructuredOutput | None:  # fmt: skip
        """A request's grammar applied to the answer, after the thinking (a free-text one where only a
        budget needs the grammar's masks); ``call``: the grammar is a forced tool call's."""
        thinking = self.thinking(tokenizer, frame, budget)
        if thinking is None:
            return structured
        if structured is not None:
            return dataclasses.replace(structured, thinking=thinking)
        return StructuredOutput.free_text(thinking, "thinking_token_budget") if budget is not None else None

    def reader(self, tokenizer, frame: ReasoningFrame, calls: bool) -> ReasoningReader:
        """How a request's outputs are read (``calls`` is for harmony: its calls are messages)."""
        return ReasoningReader(self, frame, self.token_ids(tokenizer)[1])

    def check(self, tokenizer) -> None:
        """ValueError where this is not the tokenizer of a model of this convention."""
        self.token_ids(tokenizer)

    def kept_ids(self, tokenizer) -> tuple[int, ...]:
        """Its markers where they are special tokens (Mistral's ``[THINK]``): an output keeps them in its
        text, where the reader finds them."""
        return tuple(i for i in (special_token_id(tokenizer, m) for m in (self.start, self.end)) if i is not None)

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


class HarmonySyntax:
    """gpt-oss's harmony format: the analysis channel is the thinking, the final channel (and preambles,
    commentary without a recipient) the answer, messages to ``functions.NAME`` calls (server/harmony.py)."""

    name = "harmony"
    budgets = False  # no one token ends the analysis (a message ends with <|end|>, then another starts)

    def frame(self, opening: str) -> ReasoningFrame:
        """Where the output starts: in a new message's header (the generation prompt
        ``<|start|>assistant``: the model may think), inside an analysis message the prompt opened, or
        inside another message (no thinking: the grammar has no prelude)."""
        stream = HarmonyStream(opening)
        if stream.state == stream.HEADER:
            return ReasoningFrame(False, opening)
        inside_analysis = stream.state == stream.BODY and stream.announced and stream.message.kind == "reasoning"
        return ReasoningFrame(True if inside_analysis else None, opening)

    def behind(self, structured: StructuredOutput | None, tokenizer, frame: ReasoningFrame, budget: int | None,
               call: bool) -> StructuredOutput | None:  # fmt: skip
        """The grammar behind a :class:`~engine.request.structured.Prelude` of analysis messages (and
        preambles): a call writes its own header, any other grammar is the final message's."""
        if structured is None or frame.opened is None:
            return structured
        end = HarmonyVocab.of(tokenizer).ids[END]
        word = tokenizer.encode("commentary" if call else "final", add_special_tokens=False)[0]
        return dataclasses.replace(structured, prelude=Prelude(prelude_lark(call, frame.opened), (end, word)))

    def reader(self, tokenizer, frame: ReasoningFrame, calls: bool, visible: bool = True,
               inline: bool = False) -> HarmonyReader:  # fmt: skip
        return HarmonyReader(frame, HarmonyVocab.of(tokenizer), visible, calls, inline)

    def kept_ids(self, tokenizer) -> tuple[int, ...]:
        return ()  # (a harmony output keeps every special token: its reader takes the markers out)

    def check(self, tokenizer) -> None:
        HarmonyVocab.of(tokenizer)


HARMONY = HarmonySyntax()
SYNTAXES = {
    "qwen3": ReasoningSyntax("qwen3"),
    "deepseek_r1": ReasoningSyntax("deepseek_r1", thinks_first=True),
    # GLM-4.5 to 4.7: Qwen3's markers (4.7's generation prompt opens the thinking; enable_thinking false closes it)
    "glm45": ReasoningSyntax("glm45"),
    # MiniMax-M2, M2.1, M2.5: Qwen3's markers, the thinking opened by the generation prompt.
    "minimax_m2": ReasoningSyntax("minimax_m2"),
    # Kimi K2-Thinking, K2.5, K2.6: Qwen3's markers (K2.5's template switch is ``thinking``).
    "kimi_k2": ReasoningSyntax("kimi_k2"),
    # Seed-OSS: its own markers, and it thinks first (its template leaves the opening to the model).
    "seed_oss": ReasoningSyntax("seed_oss", "<seed:think>", "</seed:think>", thinks_first=True),
    # Magistral (2507 on) and Ministral 3's reasoning models: special tokens, kept in the text for the reader.
    "mistral": ReasoningSyntax("mistral", "[THINK]", "[/THINK]"),
    # Gemma 4: a thought channel, <|channel>thought ... <channel|> (special tokens), turned on by enable_thinking.
    "gemma4": ReasoningSyntax("gemma4", "<|channel>", "<channel|>", label="thought\n"),
    "harmony": HARMONY,
}

# --reasoning-field: the chat fields a reasoning model's thinking comes back in.
FIELDS = {
    "both": ("reasoning_content", "reasoning"),
    "reasoning_content": ("reasoning_content",),
    "reasoning": ("reasoning",),
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
        self.labelled = not syntax.label  # IN: past where the syntax's label may come
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
                    if not self.labelled:  # (and the label, where it comes)
                        label = self.syntax.label
                        if label.startswith(text) and text != label:
                            self.held = text
                            return reasoning, content
                        self.labelled = True
                        text = text[len(label) :] if text.startswith(label) else text
                        continue
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

    @property
    def ended(self) -> bool:
        """The output is past its thinking (or never had one)."""
        return self.phase == self.AFTER

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended: a marker that never came is text."""
        held, self.held = self.held, ""
        if self.phase == self.BEFORE:
            return "", held
        if self.phase == self.IN:
            if not self.labelled and self.syntax.label.startswith(held.lstrip()):
                return "", ""  # (the output ended inside the label: no reasoning written)
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


class HarmonyReasoningStream:
    """A harmony output's text, as it grows, split as :class:`ReasoningStream` splits: the analysis
    messages' text is the reasoning (left out unless ``visible``), the final message's and preambles'
    the content, each message set apart from the one before by a blank line. With ``calls`` a call's
    message goes into the content as gpt-oss writes it (``<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>ARGS``, then ``<|call|>`` where a marker ended it), for the harmony tool
    parser to read; without, it is dropped, so no marker is ever content. With ``inline`` (SGLang's
    ``separate_reasoning: false``) the analysis is content too, where it was written."""

    def __init__(self, opening: str, visible: bool, calls: bool, inline: bool = False) -> None:
        self.stream = HarmonyStream(opening)
        self.visible, self.calls, self.inline = visible and not inline, calls, inline
        self.kind = self.stream.message.kind if self.stream.state == self.stream.BODY else None  # the open message's
        self.thought = self.visible and self.kind == "reasoning"
        self.said = {"reasoning": False, "content": False}  # a message of each had text
        self.fresh = True  # the open message has had no text yet

    @property
    def ended(self) -> bool:
        return self.kind != "reasoning"

    def feed(self, delta: str) -> tuple[str, str]:
        return self._route(self.stream.feed(delta))

    def finish(self) -> tuple[str, str]:
        return self._route(self.stream.finish())

    def _route(self, events: list[tuple]) -> tuple[str, str]:
        out = {"reasoning": "", "content": ""}
        for event in events:
            if event[0] == "open":
                self.kind, self.fresh = event[1].kind, True
                self.thought = self.thought or (self.visible and self.kind == "reasoning")
                if self.kind == "call" and self.calls:
                    out["content"] += call_header(event[1].function)
            elif event[0] == "text":
                if self.kind == "call" and self.calls:
                    out["content"] += event[1]
                elif self.kind == "content" or (self.kind == "reasoning" and (self.visible or self.inline)):
                    into = "content" if self.inline else self.kind
                    apart = self.fresh and self.said[into]
                    out[into] += ("\n\n" if apart else "") + event[1]
                    self.said[into], self.fresh = True, False
            else:
                if self.kind == "call" and self.calls:
                    out["content"] += CALL
                self.kind = None
        return out["reasoning"], out["content"]


_NAME = r"(?<![\w.'\"]){}(?![\w'\"])"  # a template variable read by itself (not message.thinking, not 'thinking')


def effort_switch(chat_template: str | None) -> str | None:
    """The template variable that turns thinking on or off, if the template reads one."""
    template = chat_template or ""
    for name in SWITCHES:
        if re.search(_NAME.format(name), template):
            return name
    return None


def reads_effort(chat_template: str | None) -> bool:
    """The template reads the level itself, as ``reasoning_effort`` (gpt-oss's: ``Reasoning: high``)."""
    return re.search(_NAME.format("reasoning_effort"), chat_template or "") is not None


@dataclass(frozen=True)
class ReasoningReader:
    """How one request's outputs are read: its convention, where its output starts, and the end
    marker's token id (to count reasoning tokens)."""

    syntax: ReasoningSyntax
    frame: ReasoningFrame
    end_id: int
    visible = True  # the reasoning is shown (and counted in usage)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.syntax, self.frame)

    def split(self, text: str) -> tuple[str | None, str]:
        return self.syntax.split(text, self.frame)

    def count(self, token_ids: list[int], thought: bool) -> int:
        """Reasoning tokens of an output (usage's ``reasoning_tokens``)."""
        return reasoning_token_count(token_ids, self.end_id, thought)


@dataclass(frozen=True)
class HarmonyReader:
    """How one request's harmony outputs are read: where the output starts, the markers' tokens, whether
    the analysis is shown as reasoning (``visible``: --reasoning-parser harmony; otherwise it is left
    out) and whether calls go on to the tool parser (``calls``)."""

    frame: ReasoningFrame
    vocab: HarmonyVocab
    visible: bool
    calls: bool
    inline: bool = False  # the analysis is content, where it was written (separate_reasoning false)

    def stream(self) -> HarmonyReasoningStream:
        return HarmonyReasoningStream(self.frame.opening, self.visible, self.calls, self.inline)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning None where it had no analysis (or it is not shown)."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning if stream.thought else None), content + more_content

    def count(self, token_ids: list[int], thought: bool) -> int:
        return self.vocab.reasoning_tokens(token_ids, self.frame.opening) if thought else 0
