"""Token ids as the OpenAI API shows them: a token's text (cached), and its own bytes."""

from __future__ import annotations

import weakref

from engine.request.detokenizer import special_ids


class TokenTexts:
    """The served tokenizer's token texts, for logprobs: ``text`` (cached: the same few thousand tokens
    recur) and ``bytes``, a token's own bytes (for part of a multi-byte character, that part, not
    U+FFFD)."""

    MAX_CACHED = 200_000

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._byte_decoder: dict[str, int] | None = None

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._texts) < self.MAX_CACHED:
                self._texts[token_id] = text
        return text

    def bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return []
        if self._byte_decoder is None:
            self._byte_decoder = {}
            decoder = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "decoder", None)
            if decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder):
                from transformers.convert_slow_tokenizer import bytes_to_unicode

                self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        if self._byte_decoder and all(c in self._byte_decoder for c in piece):
            return [self._byte_decoder[c] for c in piece]
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            return [int(piece[3:5], 16)]
        return list(self.text(token_id).encode("utf-8"))


# What special_token_id found, per tokenizer and its size (a token added since is looked up again): a
# request with a Mistral reasoning or tool syntax asks for its markers each time, and encoding is slow.
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def special_token_id(tokenizer, text: str) -> int | None:
    """The id of ``text`` where it is one special token of ``tokenizer`` (one a grammar cannot spell
    with text, and that decoding leaves out unless asked to keep it: ``special_ids``), else None."""
    known = _FOUND.setdefault(tokenizer, {})
    key = (text, len(tokenizer))
    if key not in known:
        ids = tokenizer.encode(text, add_special_tokens=False)
        known[key] = ids[0] if len(ids) == 1 and ids[0] in special_ids(tokenizer) else None
    return known[key]
