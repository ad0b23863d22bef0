"""What a request's output must match: a JSON schema, a regular expression, a choice of strings or a
grammar (constrained decoding). This is the request's statement only; ``engine/structured`` compiles
it into a grammar whose token masks shape every row the request samples or verifies."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

Kind = Literal["json", "regex", "choice", "grammar", "text"]
ANSWER = "augur_answer"  # the answer's grammar, as a frame around it refers to it (``@augur_answer``)


@dataclass(frozen=True)
class Thinking:
    """A reasoning model's thinking before the answer that a grammar constrains: the grammar applies
    after the thinking ends, and the thinking itself is free text (up to ``budget`` tokens). The
    markers are single tokens of the vocabulary (``<think>`` and ``</think>`` for Qwen3 and
    DeepSeek-R1)."""

    start_id: int  # the token that opens thinking
    end_id: int  # the token that closes it
    end_text: str  # its text (never part of the thinking, even written in pieces)
    # True: the prompt opened thinking, so the output starts inside it (DeepSeek-R1's templates,
    # Qwen3's thinking-only models); False: the model may open it with ``start_id`` as its first token.
    opened: bool
    # Thinking tokens (after the opening one) before ``end_id`` is forced (None: no bound). The budget
    # shapes the masks, not the grammar: it is not part of the compiled grammar's key.
    budget: int | None = None


@dataclass(frozen=True)
class Prelude:
    """Output a grammar lets come before the answer it constrains, written as Lark rules whose
    ``start`` takes the answer as ``@augur_answer``: a harmony model's (gpt-oss's) analysis messages
    before its final message or its call. Unlike :class:`Thinking` it has no single end token and no
    budget."""

    lark: str
    # Tokens an ending tries first from inside the prelude, when the output is closed within
    # max_tokens (engine/structured/closing.py): the token that ends a message, the first token of
    # the answer's header.
    first: tuple[int, ...] = ()


@dataclass(frozen=True)
class StructuredOutput:
    """``kind`` and its ``spec``:

    - ``json``: a JSON schema as JSON text (``{"type": "object"}`` for OpenAI's ``json_object``);
    - ``regex``: a regular expression the whole output matches;
    - ``choice``: a JSON list of strings, the output being exactly one of them;
    - ``grammar``: a Lark grammar (GBNF, with ``::=`` rules, is converted to Lark);
    - ``text``: any text (``spec`` empty): for a ``thinking`` budget on an unconstrained answer.

    ``param`` names the request field it came from, so that an invalid one is refused by name.
    ``thinking``: the output starts with a reasoning model's thinking, which the grammar leaves free;
    ``prelude``: it starts with what those rules allow (a harmony model's analysis), the answer after.
    ``closers``: texts that close the grammar's structures where JSON's closers do not (an XML call
    syntax's ``</parameter>``, a run of calls' closing marker), which closing an output within
    ``max_tokens`` tries, each whole, before them (engine/structured/closing.py).
    """

    kind: Kind
    spec: str
    whitespace_pattern: str | None = None  # json only: the whitespace allowed between tokens
    param: str = "structured_outputs"
    thinking: Thinking | None = None
    prelude: Prelude | None = None
    closers: tuple[str, ...] = ()  # (they shape the masks near the budget, not the grammar: not in the key)

    @classmethod
    def json_schema(cls, schema: dict | bool, param: str, whitespace_pattern: str | None = None) -> StructuredOutput:
        # Key order is kept: a schema's property order is the order the output writes them in.
        return cls("json", json.dumps(schema, separators=(",", ":")), whitespace_pattern, param)

    @classmethod
    def choice(cls, options: list[str], param: str) -> StructuredOutput:
        return cls("choice", json.dumps(list(options)), None, param)

    @classmethod
    def free_text(cls, thinking: Thinking, param: str) -> StructuredOutput:
        """No constraint on the answer: only the thinking's budget (which needs the grammar's masks)."""
        return cls("text", "", None, param, thinking)

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (the field it came from and a thinking budget do not)."""
        t = self.thinking
        frame = None if t is None else (t.start_id, t.end_id, t.end_text, t.opened)
        return (self.kind, self.spec, self.whitespace_pattern, frame, self.prelude)
