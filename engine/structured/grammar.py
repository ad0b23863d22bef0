"""Constrained decoding: a request's :class:`StructuredOutput` as a grammar, and the grammar's token
masks for every row the request samples or verifies.

The grammar engine is llguidance (docs/structured.md says why): its ``LLMatcher`` follows the output
token by token, computes the mask of tokens that may come next (one bit per token), rolls back, and
copies itself cheaply. What Augur adds is the speculative part:

- :meth:`GrammarState.walk` gives the mask of the root and of every node of a draft tree, each the
  grammar state after that node's path (consume the node's token, recurse, roll back: never a
  recompile), and cuts the nodes the grammar forbids, with their subtrees;
- :meth:`GrammarState.forced` lists the tokens the grammar allows alone (a single allowed token),
  which the step may emit without a forward ("jump-forward"): under the masked distribution such a
  token has probability 1, so emitting it is exactly what sampling it would do.

A grammar is compiled once per distinct spec (:class:`Grammars`, an LRU of validated matchers that
each request copies); compiling has llguidance's resource limits, and the server runs it off the
event loop with a deadline.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.request.checks import InvalidRequestError
from engine.request.structured import ANSWER, Prelude, StructuredOutput, Thinking
from engine.structured.closing import Closing, ClosingText, ClosingVocab, close, ending

MAX_SPEC_CHARS = 256 * 1024  # a schema, regex or grammar longer than this is refused unread
MAX_CHOICES = 4096
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_layout(whitespace_pattern: str | None = None) -> dict:
    """llguidance's JSON options for an answer: by default exactly Python's json.dumps separators
    (", " and ": "), no free whitespace (a model left free to write newlines can write them forever);
    a request's own ``whitespace_pattern`` where it gives one."""
    return {"whitespace_pattern": whitespace_pattern} if whitespace_pattern else JSON_LAYOUT


class GrammarError(InvalidRequestError):
    """A structured-output spec that cannot be compiled (the request is refused with a 400 naming
    ``param``, the field it came from)."""


def _llguidance():
    import llguidance
    import llguidance.hf

    return llguidance


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form, or Lark) for a spec; raises GrammarError for what is not
    even well-formed (the matcher's construction checks the rest)."""
    answer = _answer_grammar(so)
    if so.prelude is not None:
        return _after_prelude(answer, so.prelude)
    return answer if so.thinking is None else _after_thinking(answer, so.thinking, free=so.kind == "text")


def _answer_grammar(so: StructuredOutput) -> str:
    llg = _llguidance()
    if len(so.spec) > MAX_SPEC_CHARS:
        raise GrammarError(f"the {so.kind} is {len(so.spec)} characters long; at most {MAX_SPEC_CHARS}", so.param)
    if so.kind == "json":
        try:
            return llg.LLMatcher.grammar_from_json_schema(so.spec, defaults=json_layout(so.whitespace_pattern))
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}", so.param) from None
    if so.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(so.spec)
    if so.kind == "choice":
        options = json.loads(so.spec)
        if not options or len(options) > MAX_CHOICES or not all(isinstance(o, str) and o for o in options):
            raise GrammarError(f"choice must be 1 to {MAX_CHOICES} non-empty strings", so.param)
        alternatives = " | ".join(json.dumps(o) for o in options)  # Lark string literals take JSON escapes
        return llg.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    if so.kind == "grammar":
        try:  # Lark, or GBNF (llama.cpp's and xgrammar's EBNF), which llguidance converts to Lark
            return llg.grammar_from("grammar", so.spec)
        except ValueError as e:
            raise GrammarError(f"invalid grammar: {e}", so.param) from None
    if so.kind == "text" and so.thinking is not None:
        return ""  # the answer is free: _after_thinking writes it
    raise GrammarError(f"unknown structured output kind {so.kind!r}", so.param)


def _after_thinking(answer: str, t: Thinking, free: bool) -> str:
    """The answer's grammar behind a reasoning model's thinking: the thinking is any text without its
    end marker (the opening marker may come first), closed by the end marker token, then a little
    whitespace and the answer. With ``opened`` the output starts inside the thinking; otherwise the
    model may open it with its first token, or answer at once. A ``free`` answer is any text or
    token but the markers, and the output may end anywhere, in the thinking too (as it may with no
    grammar): only the budget's forcing needs this grammar."""
    s, e = f"<[{t.start_id}]>", f"<[{t.end_id}]>"
    # The body never holds the end marker's text either (written in pieces): where the text reads
    # "</think>", the thinking has ended, for the grammar as for the parser that splits the output.
    lines = ["BODY: /(?s:.*)/ & ~/(?s:.*)" + _regex_literal(t.end_text) + "(?s:.*)/"]
    if free:
        lines += [f"answer: (TEXT | <[^{t.start_id},{t.end_id}]>)*", "TEXT: /(?s:.+)/"]
        thinking = f"{s} BODY ({e} answer)?"
        start = f"{s}? BODY ({e} answer)?" if t.opened else f"answer | {thinking}"
        return json.dumps({"grammars": [{"lark_grammar": "\n".join([f"start: {start}", *lines]) + "\n"}]})
    lines.append("WS: /[ \\t\\r\\n]{0,8}/")
    start = f"{s}? BODY {e} WS @{ANSWER}" if t.opened else f"({s} BODY {e} WS)? @{ANSWER}"
    grammars = _grammar_list(answer)
    grammars[0] = {**grammars[0], "name": ANSWER}
    top = {"lark_grammar": "\n".join([f"start: {start}", *lines]) + "\n"}
    return json.dumps({"grammars": [top, *grammars]})


def _after_prelude(answer: str, prelude: Prelude) -> str:
    """The answer's grammar behind a prelude's rules (which refer to it as ``@augur_answer``)."""
    grammars = _grammar_list(answer)
    grammars[0] = {**grammars[0], "name": ANSWER}
    return json.dumps({"grammars": [{"lark_grammar": prelude.lark}, *grammars]})


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching it literally, inside a Lark ``/.../`` (every other character escaped)."""
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def _grammar_list(text: str) -> list[dict]:
    """A grammar in either of llguidance's forms (its JSON, or bare Lark) as its list of grammars."""
    if text.lstrip().startswith("{"):
        return list(json.loads(text)["grammars"])
    return [{"lark_grammar": text}]


class Grammars:
    """The engine's grammar compiler: the tokenizer in llguidance's form (built once, lazily) and an
    LRU of compiled grammars, keyed by spec. Thread-safe: the server compiles in worker threads while
    the engine thread starts requests from the cache."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256) -> None:
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.cache_size = cache_size
        self._tokenizer = None
        self._unavailable: str | None = None  # why this tokenizer cannot have grammars, if it cannot
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self.limits = None  # llguidance.LLParserLimits, built with the tokenizer
        self._closing: ClosingVocab | None = None  # what closing structures needs of the tokenizer
        self.seconds_compiling = 0.0

    @property
    def words(self) -> int:
        """32-bit words in one mask row (one bit per token of the model's vocabulary)."""
        return (self.vocab_size + 31) // 32

    def tokenizer(self):
        """The tokenizer in llguidance's form. The engine builds it at start-up, on its own thread
        (27 ms for 4k tokens, 1.3 s for 128k), so that no request waits for it and no other thread
        reads the Hugging Face tokenizer the engine detokenizes with."""
        with self._lock:
            if self._tokenizer is None and self._unavailable is None:
                llg = _llguidance()
                try:
                    self._tokenizer = llg.hf.from_tokenizer(
                        self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                    )
                except ValueError as e:
                    self._unavailable = f"structured outputs need a fast (Rust) tokenizer, which this model lacks: {e}"
                # Bounds on what one grammar may cost to build and to step (llguidance's fuel).
                self.limits = llg.LLParserLimits(
                    initial_lexer_fuel=2_000_000,
                    step_lexer_fuel=500_000,
                    max_grammar_size=200_000,
                    verbose_errors=False,
                )
            if self._unavailable is not None:
                raise GrammarError(self._unavailable, "structured_outputs")
            return self._tokenizer

    def compile(self, so: StructuredOutput):
        """The compiled grammar for ``so`` (a matcher in its initial state, never stepped: requests
        copy it); raises GrammarError naming ``so.param`` if it is invalid or over the limits."""
        key = so.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        tokenizer = self.tokenizer()
        llg = _llguidance()
        t0 = time.perf_counter()
        matcher = llg.LLMatcher(tokenizer, grammar_text(so), log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(f"invalid {so.kind}: {matcher.get_error()}", so.param)
        with self._lock:
            self.seconds_compiling += time.perf_counter() - t0
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def start(self, so: StructuredOutput, left: int | None = None) -> GrammarState:
        """A request's own grammar state, at the start of its output. ``left``: the tokens it may
        generate, for closing its structure within them (engine/structured/closing.py; None: not)."""
        budget = ThinkingBudget.of(so.thinking)
        matcher = self.compile(so).deep_copy()
        closing = None
        if left is not None and so.kind != "text":  # free text has no structure to close
            first = [so.thinking.end_id] if so.thinking is not None else []
            first += list(so.prelude.first) if so.prelude is not None else []
            texts = ClosingText.all_of(self.tokenizer(), so.closers)
            closing = Closing(self.closing_vocab(), first, left, texts=texts)
            shortest = ending(matcher, closing, torch.empty(self.words, dtype=torch.int32))
            if shortest is None:  # a grammar beyond the closers: not closed
                closing = None
            else:
                closing.horizon = Closing.horizon_for(len(shortest))
        return GrammarState(matcher, self.words, budget, closing)

    def closing_vocab(self) -> ClosingVocab:
        with self._lock:
            if self._closing is None:
                self._closing = ClosingVocab(self._tokenizer, self.eos_token_ids, self.words)
            return self._closing


@dataclass(frozen=True)
class ThinkingBudget:
    """Where one path of the output stands in a reasoning model's thinking, for a budget on it:
    ``phase`` BEFORE (the model may still open it), IN or AFTER it, and ``tokens`` the thinking
    tokens so far. Once they reach the budget inside the thinking, the end marker is the only token
    a row allows, so the end of thinking is forced (where the grammar allows it: the thinking is
    whole characters, so a budget spent in the middle of one ends a token or three later), on every
    row of a draft tree as on a plain decoding row, and emitted without a forward where it is forced
    outright (jump-forward)."""

    thinking: Thinking
    phase: int
    tokens: int = 0

    BEFORE, IN, AFTER = 0, 1, 2

    @classmethod
    def of(cls, thinking: Thinking | None) -> ThinkingBudget | None:
        if thinking is None or thinking.budget is None:
            return None
        return cls(thinking, cls.IN if thinking.opened else cls.BEFORE)

    def after(self, token: int) -> ThinkingBudget:
        t = self.thinking
        if self.phase == self.BEFORE:
            return replace(self, phase=self.IN if token == t.start_id else self.AFTER)
        if self.phase == self.IN:
            if token == t.end_id:
                return replace(self, phase=self.AFTER)
            if token == t.start_id and self.tokens == 0:  # an opened thinking's own opening marker
                return self
            return replace(self, tokens=self.tokens + 1)
        return self

    @property
    def spent(self) -> bool:
        return self.phase == self.IN and self.tokens >= self.thinking.budget

    def restrict(self, row: torch.Tensor) -> bool:
        """Narrow a spent budget's mask row to the end marker, if the row allows it; True if it did."""
        end = self.thinking.end_id
        word, bit = end >> 5, end & 31
        if word >= row.shape[-1] or not (int(row[word]) >> bit) & 1:
            return False
        row.zero_()
        row[word] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # the int32 word with that bit alone
        return True


@dataclass
class Walk:
    """A draft tree under the grammar: the nodes it allows (``kept``, indices into the tree, in order)
    and the mask of every row of the cut tree (``masks[0]`` the root's, ``masks[1 + j]`` after kept
    node ``j``)."""

    kept: list[int]
    masks: torch.Tensor  # [1 + len(kept), words] int32 bitmask: bit t of a row = token t allowed next


class GrammarState:
    """One sequence's grammar state: what it has emitted so far, matched."""

    def __init__(self, matcher, words: int, budget: ThinkingBudget | None = None,
                 closing: Closing | None = None) -> None:  # fmt: skip
        self.matcher, self.words = matcher, words
        self.budget = budget  # a thinking budget's count, at the emitted output's end
        self.closing = closing  # closing its structure within its tokens (None: not asked)
        self.masks_computed = 0  # rows masked (metrics: mask work per request)
        # Set when the grammar failed mid-output (a step limit, a refused token): the engine fails the
        # request alone at the end of the step; its rows are left unmasked until then.
        self.error: str | None = None
        self.seconds = 0.0  # host time spent in the grammar for this sequence

    def copy(self) -> GrammarState:
        """An independent state at the same point (a forked choice or beam)."""
        closing = None if self.closing is None else replace(self.closing)
        return GrammarState(self.matcher.deep_copy(), self.words, self.budget, closing)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and admits nothing more (only the end of the output)."""
        return self.matcher.is_stopped()

    def advance(self, tokens: list[int]) -> int:
        """Emitted tokens, each allowed by the mask it was drawn under. Returns how many belong to the
        output: all of them, or those up to the one that completed the grammar (the output ends
        there, as plain decoding would end it; what follows can only be the end-of-text token)."""
        t0 = time.perf_counter()
        n = 0
        for tok in tokens:
            if self.matcher.is_stopped():
                break
            if not self.matcher.consume_token(tok):
                self._failed(f"the grammar refused emitted token {tok}")
                break
            n += 1
            self._step(tok)
        self.seconds += time.perf_counter() - t0
        return n

    def _step(self, tok: int) -> None:
        """The counts that follow the emitted output: the thinking's, the tokens left."""
        if self.budget is not None:
            self.budget = self.budget.after(tok)
        if self.closing is not None:
            self.closing.left -= 1
            self.closing.recent = self.closing.after(self.closing.recent, tok)

    @property
    def left(self) -> int | None:
        return None if self.closing is None else self.closing.left

    @property
    def recent(self) -> bytes:
        return b"" if self.closing is None else self.closing.recent

    def _fill(self, row: torch.Tensor, budget: ThinkingBudget | None = None, left: int | None = None,
              recent: bytes = b"") -> list[int] | None:  # fmt: skip
        """The row's mask at the matcher's state (``budget``: the thinking count there; ``left``: the
        tokens left there; ``recent``: the output's last bytes there): the grammar's, narrowed by a spent
        thinking budget (to the end marker) or by closing within the tokens left. Returns the ending
        where closing forces it."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)
        self.masks_computed += 1
        if self.matcher.is_error():  # over a step limit (llguidance's fuel): this request fails alone
            self._failed("the grammar failed")
            row.fill_(-1)  # a harmless row until the engine ends the request, after this step
            return None
        if budget is not None and budget.spent and budget.restrict(row):
            return None
        if self.closing is not None and left is not None:
            return close(self.matcher, row, left, self.closing, recent)
        return None

    def _failed(self, what: str) -> None:
        if self.error is None:
            self.error = f"{what}: {self.matcher.get_error() or 'unknown error'}"

    def walk(self, tokens: list[int], parents: list[int], cut: bool = True) -> Walk:
        """Masks of a draft tree's rows. ``cut``: every node the grammar forbids is left out, with its
        subtree; otherwise such nodes stay (the target, masked, gives them probability 0) and the rows
        under them, which verification never reaches, allow everything."""
        t0 = time.perf_counter()
        n = len(tokens)
        children: list[list[int]] = [[] for _ in range(n + 1)]
        for i, p in enumerate(parents):
            children[p + 1].append(i)
        masks = torch.full((n + 1, self.words), -1, dtype=torch.int32)
        bits = masks.numpy()
        kept: list[int] = []
        out_row = {-1: 0}  # tree node → its row in masks (the root is -1)

        def keep(node: int) -> None:
            kept.append(node)
            out_row[node] = len(kept)

        def unreachable(node: int) -> None:
            keep(node)
            for child in children[node + 1]:
                unreachable(child)

        def visit(node: int, budget: ThinkingBudget | None, left: int | None, recent: bytes) -> None:
            row = out_row[node]
            self._fill(masks[row], budget, left, recent)
            for child in children[node + 1]:
                tok = tokens[child]
                if not 0 <= tok < self.words * 32 or not (int(bits[row, tok >> 5]) >> (tok & 31)) & 1:
                    if not cut:
                        unreachable(child)
                    continue
                if self.error is not None or not self.matcher.consume_token(tok):
                    self._failed(f"the grammar refused allowed token {tok}")
                    continue
                keep(child)
                after = None if budget is None else budget.after(tok)
                if left is None:
                    visit(child, after, None, b"")
                else:
                    visit(child, after, left - 1, self.closing.after(recent, tok))
                self.matcher.rollback(1)

        visit(-1, self.budget, self.left, self.recent)
        order = sorted(range(len(kept)), key=lambda j: kept[j])  # the cut tree keeps the tree's order
        if order != list(range(len(kept))):
            rows = [0] + [out_row[kept[j]] for j in order]
            kept = [kept[j] for j in order]
            masks = masks[rows]
        self.seconds += time.perf_counter() - t0
        return Walk(kept, masks[: len(kept) + 1].contiguous())

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar allows alone, one after another from the current state,
        consumed as they are found (the caller emits them). Stops at the end of the grammar."""
        if limit <= 0:
            return []
        t0 = time.perf_counter()
        out: list[int] = []
        row = torch.empty(1, self.words, dtype=torch.int32)
        while len(out) < limit and self.error is None and not self.matcher.is_stopped():
            # Forced bytes are necessary for a forced token, not sufficient (they may be split into
            # tokens more than one way): the mask decides. A spent thinking budget forces its end;
            # closing, the ending of a structure that has just the tokens left for it.
            spent = self.budget is not None and self.budget.spent
            closing = self.closing is not None and self.left <= self.closing.horizon
            if not spent and not closing and not self.matcher.compute_ff_bytes():
                break
            end = self._fill(row[0], self.budget, self.left, self.recent)
            if end is not None:  # all of it is forced: each of its rows allows its next token alone
                end = end[: limit - len(out)]
                if not self.matcher.consume_tokens(end):
                    self._failed("the grammar refused its own ending")
                    break
                out += end
                for tok in end:
                    self._step(tok)
                continue
            words = row[0].numpy().view(np.uint32)
            nonzero = np.flatnonzero(words)
            if len(nonzero) != 1:
                break
            word = int(words[nonzero[0]])
            if word & (word - 1):
                break  # two tokens or more in the one word
            tok = int(nonzero[0]) * 32 + word.bit_length() - 1
            if not self.matcher.consume_token(tok):
                self._failed(f"the grammar refused its own forced token {tok}")
                break
            out.append(tok)
            self._step(tok)
        self.seconds += time.perf_counter() - t0
        return out


def unpack(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, words]`` int32 bitmasks as ``[R, vocab_size]`` bool, True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)
    bits = (masks.unsqueeze(-1) >> shifts) & 1  # [R, words, 32]
    return bits.view(masks.shape[0], -1)[:, :vocab_size].bool()
