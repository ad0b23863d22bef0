"""Closing a structure within ``max_tokens``: a grammar-constrained output that would be cut mid-structure
(a tool call's arguments, a JSON object) is closed instead.

At each row the request masks, with ``left`` tokens still allowed (this row's among them), the grammar
state's *ending* is the token sequence that completes the grammar from there: the text the grammar
forces where it forces one, else the first closing token it allows (inside a reasoning model's thinking
its end marker), else the first of the request's closing texts that closes something (its tokens taken
whole, after which the grammar forces text, accepts, or allows at most :data:`FEW` tokens: the next
element or the end, not more of a value; a tool call syntax's ``</parameter>``, its run of calls'
closing marker), else the first closing character it allows (``"``, ``}``, ``]``), else the first short
value or character it allows that this ending has not used yet (``0``, ``null``, ``false``, ... then any
printable character), else (mid-character: the grammar allows only a UTF-8 sequence's next byte) the
first token it allows, until the grammar accepts. Then

- where ``left`` is no more than the ending's length, the row allows only the ending's first token: the
  output finishes the structure in the tokens it has (and the ending, forced outright, is emitted without
  forwards);
- at a row of few choices (the end of a call: another call or the end; the end of an item: another
  item or the list's end), a choice is allowed only if its own ending fits in what is left after it:
  another call is not started unless it can be finished;
- at a row of many choices (inside a string or a number) within :data:`MARGIN` tokens of it, tokens that
  open structure (``{``, ``[``, ``,``, ``"``, ``\\``, ``<``) or end in a character's first bytes are left
  out, so the ending cannot grow there.

Every rule is a function of the row's grammar state and ``left`` alone, so a draft tree's rows get the
masks plain decoding's rows would: speculation stays exact. An ending that completes a grammar which
would take more (another call could follow) ends with the end-of-text token, so the output stops by
itself, not at the budget. A row whose ending is not found within :data:`MAX_ENDING` tokens is left as it
is, and a grammar with no ending from its start (one beyond these closers) is not closed at all. The
request field ``close_at_max_tokens: false`` turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# Tokens an ending tries where the grammar forces nothing: first what closes strings, objects and lists
# (again and again), then the shortest values and what a pattern may need, each preferred until this
# ending has used it (a pattern that takes one token again and again, as digits before an "@", would
# never get on otherwise), then any printable character.
CLOSERS = ('"', "}", "]")
VALUES = ("0", "null", "false", "true", '""', "[]", "{}", "1", "a", " ", "\n", ",")
OPENING_BYTES = frozenset(b'{[,"\\<')  # a token holding one of these may open structure
MARGIN = 4  # ... at which a row of many choices leaves out tokens that open structure
SMALL = 16  # a row allowing at most this many tokens is a row of few choices
FEW = 256  # a closing text closes where the grammar then allows at most this many tokens (not a value's)
HORIZON = 256  # the most tokens from the budget at which a row is checked (nor is an ending longer sought)
MAX_ENDING = HORIZON  # an ending longer than this is not looked for: it could not fit anyway


class ClosingVocab:
    """What closing needs of a tokenizer, built once per :class:`~engine.structured.grammar.Grammars`: the
    closing tokens, the single printable characters (the last resort of an ending), the end-of-text ids
    and, lazily, the bitmask of tokens that may open structure."""

    def __init__(self, llg_tokenizer, eos_ids: list[int], words: int) -> None:
        self.tokenizer, self.eos, self.words = llg_tokenizer, list(eos_ids), words
        self.closers = self._single_tokens(CLOSERS)
        self.values = [t for t in self._single_tokens(VALUES) if t not in self.closers]
        chars = self._single_tokens([chr(c) for c in range(0x20, 0x7F)])
        self.chars = [t for t in chars if t not in self.closers and t not in self.values]
        self._opening: np.ndarray | None = None

    def _single_tokens(self, texts) -> list[int]:
        out = []
        for text in texts:
            ids = self.tokenizer.tokenize_str(text)
            if len(ids) == 1 and ids[0] not in out:
                out.append(ids[0])
        return out

    @property
    def opening(self) -> np.ndarray:
        """``[words]`` uint32: bit t set where token t's bytes hold one of :data:`OPENING_BYTES` (built on
        first use: a pass over the vocabulary, about 0.3 s for 150k tokens)."""
        if self._opening is None:
            words = np.zeros(self.words, dtype=np.uint32)
            tok = self.tokenizer
            for t in range(min(tok.vocab_size, self.words * 32)):
                if not tok.is_special_token(t) and _opens(tok.decode_bytes([t])):
                    words[t >> 5] |= np.uint32(1 << (t & 31))
            self._opening = words
        return self._opening


@dataclass(frozen=True)
class ClosingText:
    """A text that closes what a grammar opens where JSON's closers do not (StructuredOutput.closers): its
    tokens, its bytes, and the tokens of each of its rests (the text less its first k bytes: what
    continues it once those are written), made as they are first asked for."""

    tokens: tuple[int, ...]
    data: bytes
    rests: dict = field(default_factory=dict, compare=False)

    @classmethod
    def all_of(cls, tokenizer, texts: tuple[str, ...]) -> tuple[ClosingText, ...]:
        """``texts`` tokenized by the grammar's tokenizer (a special token's text as that token)."""
        made = (cls(tuple(tokenizer.tokenize_str(x, parse_special=True)), x.encode()) for x in texts)
        return tuple(t for t in made if t.tokens)

    def rest(self, tokenizer, k: int) -> tuple[int, ...]:
        """The tokens of the text past its first ``k`` bytes: its own tokens from there where ``k`` ends
        one of them (so that an ending begun with this text goes on as it began), else those bytes
        tokenized."""
        if k not in self.rests:
            ends, at = {}, 0
            for i, t in enumerate(self.tokens):
                at += len(tokenizer.decode_bytes([t]))
                ends[at] = i + 1
            i = ends.get(k)
            self.rests[k] = self.tokens[i:] if i is not None else tuple(tokenizer.tokenize_bytes(self.data[k:]))
        return self.rests[k]


@dataclass
class Closing:
    """A sequence's closing within its token budget: the tokenizer's closing tokens, the tokens its
    endings try first (a thinking's end marker), the closing texts they try next (tokenized), and
    ``left``, the tokens it may still emit."""

    vocab: ClosingVocab
    first: list[int]
    left: int
    # Rows with more tokens left than this are not checked: twice the grammar's shortest output (its
    # ending from the start) and some, so the ending of any choice's new structure (another call, another
    # item) is weighed before it is due, up to HORIZON.
    horizon: int = 0
    texts: tuple[ClosingText, ...] = ()
    # The output's last bytes, as many as a closing text's head may need: where it ends with a text's
    # first bytes, the ending continues that text (see :func:`_closing_text`).
    recent: bytes = b""

    def __post_init__(self) -> None:
        self.keep = max((len(t.data) - 1 for t in self.texts), default=0)  # the bytes recent holds at most

    def after(self, recent: bytes, token: int) -> bytes:
        """``recent`` then ``token``'s bytes, as much of it as :attr:`recent` keeps."""
        keep = self.keep
        return (recent + self.vocab.tokenizer.decode_bytes([token]))[-keep:] if keep else b""

    @staticmethod
    def horizon_for(shortest: int) -> int:
        return min(HORIZON, 2 * shortest + 32)


def allowed(row: torch.Tensor, token: int) -> bool:
    word, bit = token >> 5, token & 31
    return word < row.shape[-1] and bool((int(row[word]) >> bit) & 1)


def only(row: torch.Tensor, tokens: list[int]) -> None:
    """Narrow ``row`` to those of ``tokens`` it allows."""
    keep = [t for t in tokens if allowed(row, t)]
    row.zero_()
    for t in keep:
        word, bit = t >> 5, t & 31
        value = (int(row[word]) & 0xFFFFFFFF) | (1 << bit)
        row[word] = value - (1 << 32) if value >= 1 << 31 else value


def _set_bits(words: np.ndarray):
    """The token ids whose bits are set in ``words``, in order."""
    for w in np.flatnonzero(words):
        value = int(words[w])
        while value:
            low = value & -value
            yield int(w) * 32 + low.bit_length() - 1
            value ^= low


def tokens_of(row: torch.Tensor, limit: int) -> list[int] | None:
    """The tokens ``row`` allows, if there are at most ``limit`` of them (None: more)."""
    words = row.numpy().view(np.uint32)
    if np.count_nonzero(words) > limit:
        return None
    out = []
    for t in _set_bits(words):
        out.append(t)
        if len(out) > limit:
            return None
    return out


def ending(matcher, closing: Closing, scratch: torch.Tensor, recent: bytes | None = None) -> list[int] | None:
    """The tokens that complete the grammar from ``matcher``'s state, with the end-of-text token where
    the grammar would still take more (tool calls: another call could follow), so that the output ends
    by itself (``stop``), not at the budget; ``[]`` where it is complete already. None if no ending is
    found within :data:`MAX_ENDING`; the matcher is left as it was. ``recent``: the output's last bytes
    there (:attr:`Closing.recent` where not given)."""
    vocab, first = closing.vocab, closing.first
    tail = closing.recent if recent is None else recent
    out: list[int] = []
    used: set[int] = set()
    try:
        while len(out) <= MAX_ENDING:
            if matcher.is_stopped():
                return out
            if matcher.is_accepting():
                return out + vocab.eos[:1]
            forced = matcher.compute_ff_tokens()
            if forced:
                n = matcher.try_consume_tokens(forced)
                if n == 0:
                    return None
                out += forced[:n]
                used.update(forced[:n])
                tail = _follow(closing, tail, forced[:n])
                continue
            matcher.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * 4)
            if matcher.is_error():
                return None
            words = scratch.numpy().view(np.uint32)
            tok = next((t for t in first if (int(words[t >> 5]) >> (t & 31)) & 1), None)
            if tok is None:
                text = _closing_text(matcher, closing, scratch, tail)
                if text is not None:
                    out += text
                    used.update(text)
                    tail = _follow(closing, tail, text)
                    continue
                tok = next((t for t in vocab.closers if (int(words[t >> 5]) >> (t & 31)) & 1), None)
            if tok is None:
                again = None
                for t in (*vocab.values, *vocab.chars):
                    if (int(words[t >> 5]) >> (t & 31)) & 1:
                        if t not in used:
                            tok = t
                            break
                        again = t if again is None else again
                tok = tok if tok is not None else again
            if tok is None:  # none of those: mid-character (a UTF-8 sequence's next byte), the first allowed
                tok = next((t for t in _set_bits(words) if t not in vocab.eos), None)
            if tok is None or tok in vocab.eos or not matcher.consume_token(tok):
                return None
            out.append(tok)
            used.add(tok)
            tail = _follow(closing, tail, [tok])
        return None
    finally:
        if out:
            matcher.rollback(len(out))


def _follow(closing: Closing, tail: bytes, tokens) -> bytes:
    for t in tokens:
        tail = closing.after(tail, t)
    return tail


def _closing_text(matcher, closing: Closing, scratch: torch.Tensor, tail: bytes) -> tuple[int, ...] | None:
    """The tokens of the first closing text the grammar takes here and that closes something
    (:func:`_take`), left consumed; None if none does. The rest of a text the output ends with the
    first bytes of comes before any whole text: an ending that began with a text's first tokens goes on
    with its others, so that each row's ending is the one before it less its first token. (Also what
    follows a forced run that holds a text's first bytes, the ``<`` common to ``</invoke>`` and another
    ``<parameter``, where a whole text no longer fits.) ``scratch`` holds the mask at ``matcher``'s state,
    ``tail`` the output's last bytes. The texts come in the request's order: a syntax whose values are
    JSON strings lists ``"`` first, so that no marker is written into a string a quote ends."""
    if not closing.texts:
        return None
    words = scratch.numpy().view(np.uint32)
    tokenizer, n_words = closing.vocab.tokenizer, closing.vocab.words

    def fits(tokens) -> bool:
        return bool(tokens) and (int(words[tokens[0] >> 5]) >> (tokens[0] & 31)) & 1 and _take(matcher, tokens, n_words)

    for text in closing.texts:
        for k in range(min(len(tail), len(text.data) - 1), 0, -1):
            if tail.endswith(text.data[:k]) and fits(rest := text.rest(tokenizer, k)):
                return rest
    return next((text.tokens for text in closing.texts if fits(text.tokens)), None)


def _take(matcher, tokens, words: int) -> bool:
    """Consume ``tokens`` if the grammar takes them all and then forces text, accepts, or allows at most
    :data:`FEW` tokens: they close something (not more of a value, which any text may be)."""
    n = matcher.try_consume_tokens(list(tokens))
    if n == len(tokens) and _closed(matcher, words):
        return True
    if n:
        matcher.rollback(n)
    return False


def _closed(matcher, n_words: int) -> bool:
    """Whether the grammar, at ``matcher``'s state, forces text, accepts, or allows at most :data:`FEW`
    tokens, and at most an eighth of the vocabulary (its own mask buffer: the caller's holds the state
    before)."""
    if matcher.is_stopped() or matcher.is_accepting() or matcher.compute_ff_tokens():
        return True
    mask = np.zeros(n_words, dtype=np.uint32)
    matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    few = min(FEW, n_words * 4)  # (an eighth of a small vocabulary: a test model's)
    if matcher.is_error() or np.count_nonzero(mask) > few:  # (more words than `few` hold a bit each)
        return False
    return int(np.unpackbits(mask.view(np.uint8)).sum()) <= few


def _opens(data: bytes) -> bool:
    """Whether a token's bytes may open structure: they hold one of :data:`OPENING_BYTES`, or end in a
    character's first bytes (its remaining bytes then lengthen the ending, as an open string would)."""
    if OPENING_BYTES.intersection(data):
        return True
    for back in range(1, min(4, len(data)) + 1):  # the last lead byte, and whether its bytes all follow it
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte
            need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
            return back < need
    return False


def close(matcher, row: torch.Tensor, left: int, closing: Closing, recent: bytes) -> list[int] | None:
    """Narrow a row's mask (computed at ``matcher``'s state, ``left`` tokens still allowed, the output
    ending with bytes ``recent``) by the rules of this module's docstring. Returns the ending where it
    is due (the row then allows its first token alone, and the rest of it is forced in turn)."""
    if left > closing.horizon:
        return None
    vocab = closing.vocab
    scratch = torch.empty_like(row)
    end = ending(matcher, closing, scratch, recent)  # [] where the output is complete
    if end is None or (end and not allowed(row, end[0])):
        return None
    if end and left <= len(end):
        only(row, end[:1])
        return end
    choices = tokens_of(row, SMALL)
    if choices is not None:  # e.g. another call or the end: each choice only if its own ending fits
        keep = []
        for t in choices:
            if (end and t == end[0]) or t in vocab.eos:
                keep.append(t)
                continue
            if not matcher.consume_token(t):
                continue
            after = ending(matcher, closing, scratch, closing.after(recent, t))
            matcher.rollback(1)
            if after is not None and 1 + len(after) <= left:
                keep.append(t)
        only(row, keep)
        return None
    elif end and left <= len(end) + MARGIN:
        words = row.numpy().view(np.uint32)
        first_word, first_bit = end[0] >> 5, end[0] & 31
        keep_first = (int(words[first_word]) >> first_bit) & 1
        words &= ~vocab.opening
        if keep_first:
            words[first_word] |= np.uint32(1 << first_bit)
    return None
