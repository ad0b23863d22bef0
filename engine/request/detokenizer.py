"""Incremental detokenization and stop-string matching for streamed generation.

Why not decode each new token on its own? Two reasons:

* Byte-level BPE (GPT-2, Llama 3, Qwen) and SentencePiece byte fallback (Llama 2, Mistral) can
  spread one character's UTF-8 bytes over several tokens. Decoding only some of them yields
  U+FFFD (the replacement character), which must never reach a client.
* SentencePiece/Metaspace decoders drop the leading space of the *first* token they are given, so
  ``"▁world"`` decoded alone is ``"world"``, not ``" world"``.

Why not re-decode the whole output every step? That costs O(total) per step, O(n²) per request.

The technique (the "prefix offset / read offset" of vLLM and TGI) decodes a small *window* of ids:

* *context* ids — already emitted; decoded only so the pending ids see their left neighbours
  (at the start: the last few prompt tokens);
* *pending* ids — not yet emitted.

Each step decodes ``context + pending`` and ``context``; the new text is the difference. If the
window text ends in U+FFFD, a character may still be incomplete: only the pending ids up to the
last token boundary that falls between whole characters are emitted, and the rest stay pending
(a run of :data:`_MAX_PENDING_TOKENS` with no such boundary is invalid UTF-8 and is emitted as it
is). Emitted ids become the next context and older ids are dropped, so work and memory per step
are bounded by the window, not by the output length.

*Stop strings* are searched in the output text after each append; only the new text plus
``len(longest stop) - 1`` characters before it can hold a match that was not there before.
"""

from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

# How many trailing prompt tokens serve as left context for the first output tokens.
_PROMPT_CONTEXT_TOKENS = 5
# A valid character spans at most 4 bytes, so a run of this many pending tokens with no boundary
# between whole characters is invalid UTF-8, not an incomplete character; holding it longer would
# let the window (and the cost of each step) grow without bound.
_MAX_PENDING_TOKENS = 16
_REPLACEMENT_CHAR = "\ufffd"


def _backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The ``tokenizers.Tokenizer`` that ``tokenizer.decode`` comes down to, where it does so with
    nothing around it: a tokenizers-backed transformers tokenizer whose class changes neither
    ``decode`` nor ``_decode``, which then return the backend's own decode once the cleanup of
    spaces is off (as :meth:`IncrementalDetokenizer._decode` asks). Called directly it skips
    transformers' argument conversion: 1.3 µs a window against 4.3 µs, two windows a token, for
    every token of every request. Else None (the tokenizer's own ``decode``)."""
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls, backend = type(tokenizer), getattr(tokenizer, "_tokenizer", None)
    plain = cls.decode is PreTrainedTokenizerBase.decode and cls._decode is TokenizersBackend._decode
    return backend if plain and isinstance(backend, Tokenizer) and "decode" not in vars(tokenizer) else None


# special_ids' sets, per tokenizer, with the vocabulary size they were read at (a token added since
# reads them again).
_SPECIAL_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every token ``tokenizer.decode`` leaves out under ``skip_special_tokens``: its named special
    tokens and its added tokens marked special (Mistral's control tokens are only the latter). The one
    definition of a special token: the server's tool and reasoning syntaxes ask it too."""
    size = len(tokenizer)
    known = _SPECIAL_IDS.get(tokenizer)
    if known is None or known[0] != size:
        added = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        known = _SPECIAL_IDS[tokenizer] = (size, frozenset(tokenizer.all_special_ids) | frozenset(added))
    return known[1]


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, step by step, and watches for stop strings.

    ``output_text`` is the text of the output tokens so far: what ``tokenizer.decode(output_ids)``
    gives, except that the first output token keeps the leading space it has after the prompt. It
    may lag the tokens by a few ids while a multi-byte character is incomplete, and is truncated at a
    matched stop string (``stop_matched``).

    A stop string *matches* when it occurs in ``output_text``; when several do, the one that ends
    first wins, ties going to the one that starts first. "Ends first" makes the result the same
    however the tokens are grouped into :meth:`append` calls (one per step, or several accepted
    speculative tokens at once): it is where generation one character at a time would have stopped.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        kept_special_ids: tuple[int, ...] = (),
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._backend = _backend(tokenizer)
        # Filtering special ids before they enter the window (and not only inside decode) keeps a
        # skipped token from becoming the first of a window, where a Metaspace decoder would strip
        # the space of the token after it.
        self._skip_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        if skip_special_tokens and kept_special_ids:
            # Every other special token is filtered here, so decoding may keep what is left: the kept ones.
            self._skip_ids = special_ids(tokenizer) - frozenset(kept_special_ids)
            self._skip_special_tokens = False
        self._stop = [s for s in (stop or []) if s]
        self._include_stop = include_stop_str_in_output

        self.output_text = ""
        self.stop_matched: str | None = None

        self._ids = self._prompt_context(prompt_ids)  # window: context ids, then pending ids
        self._num_context = len(self._ids)
        self._context_text: str | None = None  # decode(context ids), computed when first needed

    def append(self, new_token_ids: list[int], stops: bool = True) -> str | None:
        """Decode newly generated tokens (one or several at once — speculative decoding appends several).

        Returns the matched stop string if this append completed one (``output_text`` is then
        already truncated), else None. After a match, further appends are ignored. With ``stops``
        false (the output is still short of its ``min_tokens``) the text is added unsearched: a stop
        string it completes does not stop the output, now or later (only one that ends in text added
        afterwards does), as vLLM ignores stop strings until ``min_tokens``.
        """
        if self.stop_matched is not None:
            return None
        kept = [t for t in new_token_ids if t not in self._skip_ids]
        if not kept:
            return None
        self._ids.extend(kept)
        return self._add_text(self._decode_pending(force=False), stops)

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy (a forked beam goes on from the same text)."""
        twin = copy.copy(self)
        twin._ids = list(self._ids)
        return twin

    def finish(self) -> str | None:
        """Release text held back for an incomplete character: no more tokens will complete it.

        Returns the stop string if the released text completed one, like :meth:`append`.
        Idempotent; :meth:`emittable_text` calls it when ``finished``.
        """
        if self.stop_matched is not None:
            return None
        return self._add_text(self._decode_pending(force=True))

    def emittable_text(self, finished: bool) -> str:
        """The prefix of ``output_text`` that is safe to send to a client.

        While the sequence runs, the longest suffix that is a proper prefix of some stop string is
        held back, since the next tokens may complete the stop string, which must not be shown. Once
        finished (or a stop string matched) everything is final and returned.
        """
        if finished:
            self.finish()
        if finished or self.stop_matched is not None:
            return self.output_text
        return self.output_text[: len(self.output_text) - self._stop_prefix_len()]

    # ------------------------------------------------------------------ decoding

    def _decode(self, ids: list[int]) -> str:
        # No cleanup of tokenization spaces: it rewrites text across token boundaries (" ." -> ".")
        # and so cannot be applied to a window consistently with the whole text.
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The last few prompt ids, trimmed so that their text starts and ends on whole characters.

        A context starting inside a character decodes to leading U+FFFD, and with byte fallback its
        stray bytes would merge with the next ones into one invalid run; a context ending inside a
        character would have that character completed by the output, shifting the difference we
        take. Either way the safe answer is less (or no) context.
        """
        context: list[int] = []
        for token_id in reversed(prompt_ids):
            if len(context) == _PROMPT_CONTEXT_TOKENS:
                break
            if token_id not in self._skip_ids:
                context.append(token_id)
        context.reverse()
        # Trim the start first: with byte fallback, stray leading bytes make their whole run of byte
        # tokens U+FFFD, up to the end of a context that itself ends on a whole character.
        text = self._decode(context)
        while text.startswith(_REPLACEMENT_CHAR):
            del context[0]
            text = self._decode(context)
        return [] if text.endswith(_REPLACEMENT_CHAR) else context

    def _decode_pending(self, force: bool) -> str:
        """Text of the pending ids that is known to be whole characters (all of it when ``force``)."""
        num_pending = len(self._ids) - self._num_context
        if num_pending == 0:
            return ""
        if self._context_text is None:
            self._context_text = self._decode(self._ids[: self._num_context])
        end, text = len(self._ids), self._decode(self._ids)
        if text.endswith(_REPLACEMENT_CHAR) and not force:
            split = self._last_whole_char_boundary()
            if split is not None:
                end, text = split
            elif num_pending < _MAX_PENDING_TOKENS:
                return ""
            # else: invalid UTF-8, not an incomplete character: emit it as it is
        new_text = text[len(self._context_text) :]
        # The emitted ids become the next context; older context is no longer needed.
        del self._ids[: self._num_context]
        self._num_context = end - self._num_context
        self._context_text = None
        return new_text

    def _last_whole_char_boundary(self) -> tuple[int, str] | None:
        """The last pending token boundary where the window text ends on a whole character, with
        that text; None if there is none.

        The text comes from decoding the shorter window, not from slicing the full one: with byte
        fallback an incomplete tail turns its whole run of byte tokens into U+FFFD.
        """
        for end in range(len(self._ids) - 1, self._num_context, -1):
            text = self._decode(self._ids[:end])
            if not text.endswith(_REPLACEMENT_CHAR):
                return end, text
        return None

    # ------------------------------------------------------------------ stop strings

    def _add_text(self, new_text: str, stops: bool = True) -> str | None:
        if not new_text:
            return None
        old_len = len(self.output_text)
        # Appending copies the string (CPython cannot extend an attribute's str in place): a memcpy,
        # the only part of a step that grows with the output.
        self.output_text += new_text
        if not self._stop or not stops:
            return None
        # A match ends in the new text: none ended in the old one, or that one was before min_tokens.
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self._stop:
            i = self.output_text.find(s, max(0, old_len - len(s) + 1))
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is None:
            return None
        end, begin, s = best
        self.output_text = self.output_text[: end if self._include_stop else begin]
        self.stop_matched = s
        self._ids.clear()  # nothing more will be decoded
        self._num_context = 0
        return s

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of ``output_text`` that is a proper prefix of a stop string."""
        text = self.output_text
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
