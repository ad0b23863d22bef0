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
from dataclasses import dataclass

import numpy as np
import torch

from engine.request.checks import InvalidRequestError
from engine.request.structured import StructuredOutput

MAX_SPEC_CHARS = 256 * 1024  # a schema, regex or grammar longer than this is refused unread
MAX_CHOICES = 4096
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(InvalidRequestError):
    """A structured-output spec that cannot be compiled (the request is refused with a 400 naming
    ``param``, the field it came from)."""


def _llguidance():
    import llguidance
    import llguidance.hf

    return llguidance


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) for a spec; raises GrammarError for what is not even
    well-formed (the matcher's construction checks the rest)."""
    llg = _llguidance()
    if len(so.spec) > MAX_SPEC_CHARS:
        raise GrammarError(f"the {so.kind} is {len(so.spec)} characters long; at most {MAX_SPEC_CHARS}", so.param)
    if so.kind == "json":
        # Whitespace between JSON tokens: by default exactly Python's json.dumps separators (", " and
        # ": "), no free whitespace: a model left free to write newlines can write them forever.
        options = {"whitespace_pattern": so.whitespace_pattern} if so.whitespace_pattern else JSON_LAYOUT
        try:
            return llg.LLMatcher.grammar_from_json_schema(so.spec, defaults=options)
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
    raise GrammarError(f"unknown structured output kind {so.kind!r}", so.param)


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

    def start(self, so: StructuredOutput) -> GrammarState:
        """A request's own grammar state, at the start of its output."""
        return GrammarState(self.compile(so).deep_copy(), self.words)


@dataclass
class Walk:
    """A draft tree under the grammar: the nodes it allows (``kept``, indices into the tree, in order)
    and the mask of every row of the cut tree (``masks[0]`` the root's, ``masks[1 + j]`` after kept
    node ``j``)."""

    kept: list[int]
    masks: torch.Tensor  # [1 + len(kept), words] int32 bitmask: bit t of a row = token t allowed next


class GrammarState:
    """One sequence's grammar state: what it has emitted so far, matched."""

    def __init__(self, matcher, words: int) -> None:
        self.matcher, self.words = matcher, words
        self.masks_computed = 0  # rows masked (metrics: mask work per request)
        # Set when the grammar failed mid-output (a step limit, a refused token): the engine fails the
        # request alone at the end of the step; its rows are left unmasked until then.
        self.error: str | None = None
        self.seconds = 0.0  # host time spent in the grammar for this sequence

    def copy(self) -> GrammarState:
        """An independent state at the same point (a forked choice or beam)."""
        return GrammarState(self.matcher.deep_copy(), self.words)

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
        self.seconds += time.perf_counter() - t0
        return n

    def _fill(self, row: torch.Tensor) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)
        self.masks_computed += 1
        if self.matcher.is_error():  # over a step limit (llguidance's fuel): this request fails alone
            self._failed("the grammar failed")
            row.fill_(-1)  # a harmless row until the engine ends the request, after this step

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

        def visit(node: int) -> None:
            row = out_row[node]
            self._fill(masks[row])
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
                visit(child)
                self.matcher.rollback(1)

        visit(-1)
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
        while (
            len(out) < limit
            and self.error is None
            and not self.matcher.is_stopped()
            and self.matcher.compute_ff_bytes()
        ):
            # Forced bytes are necessary for a forced token, not sufficient (they may be split into
            # tokens more than one way): the mask decides.
            self._fill(row[0])
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
        self.seconds += time.perf_counter() - t0
        return out


def unpack(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, words]`` int32 bitmasks as ``[R, vocab_size]`` bool, True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)
    bits = (masks.unsqueeze(-1) >> shifts) & 1  # [R, words, 32]
    return bits.view(masks.shape[0], -1)[:, :vocab_size].bool()
