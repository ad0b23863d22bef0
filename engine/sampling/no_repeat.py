"""``no_repeat_ngram_size``: a token that would complete an n-gram the sequence already holds is banned.

The ban is a logits processor (the token's logit becomes ``-inf``, as transformers'
``NoRepeatNGramLogitsProcessor`` does over the prompt and the output), applied to every row the same
way: a plain decode, a node of a draft tree (whose history is its sequence plus the path above it)
and a beam. Speculation therefore stays exact with respect to the banned distribution: a drafted
token that is banned is simply never the target's choice.

Each sequence keeps an index of its n-grams (prefix of ``n - 1`` tokens → the tokens that followed
it), grown with the tokens it gains, so a row costs O(n + its path) and never O(context).
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from typing import TYPE_CHECKING

from engine.request.state import NgramIndex

if TYPE_CHECKING:
    from engine.request.sequence import Sequence


_NOTHING: frozenset[int] = frozenset()


def banned_tokens(seq: Sequence, path: Tokens[int] = ()) -> frozenset[int] | set[int]:
    """What ``seq``'s next token (after ``path``) may not be; empty without ``no_repeat_ngram_size``
    (one shared empty set: every row of every step asks)."""
    n = seq.params.no_repeat_ngram_size
    if not n:
        return _NOTHING
    if seq.ngrams is None or seq.ngrams.n != n:
        seq.ngrams = NgramIndex(n)
    seq.ngrams.sync(seq.token_ids)
    return seq.ngrams.banned(seq.token_ids, path)


def banned_in(history: Tokens[int], n: int) -> set[int]:
    """The banned next tokens of a whole history at once (for callers without a sequence)."""
    index = NgramIndex(n)
    index.sync(history)
    return index.banned(history)
