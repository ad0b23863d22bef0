"""Tests for incremental detokenization and stop strings, on two tokenizers trained here.

* byte-level BPE (GPT-2 / Llama 3 style): every byte is in the alphabet, so unseen characters are
  spelled in bytes, and multi-byte characters are often split over several tokens;
* Metaspace BPE with byte fallback (Llama 2 / Mistral style): "▁" marks spaces, the first token's
  leading space is dropped on decode, and characters never seen in training become ``<0xNN>`` tokens.

The properties are checked by helpers that return the problems they find; each helper is also run
on a deliberately naive stand-in to prove that it can fail.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Iterator

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.request.detokenizer import IncrementalDetokenizer, special_ids
from server.tokens import special_token_id

EOS = "<|eos|>"
CORPUS = [
    "Hello world, héllo wörld! Ça va? naïve café, crème brûlée à la française.",
    "你好世界，中文字符测试。你好你好，世界很大。",
    "emoji 😀😀 🚀 party 🎉🎉 👍🏽 thumbs 👍🏽",
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "Numbers 12345 and symbols #$%&*() [brackets] {braces}",
] * 20

# Characters to draw test text from: ones seen in training, and ones never seen (Cyrillic, Greek,
# Arabic, Devanagari, rare CJK, other emoji, a supplementary-plane letter) that need byte fallback.
SEEN = "abcdefghijklmnopqrstuvwxyz THEQ.,!?é ö ç à ï 你好世界中文字 😀🚀🎉👍🏽"
UNSEEN = "ЖжЩΩλπمرحبाकखग龘齉鱻🦄🧬🫠𝔘ñ€™\t\n"


def _wrap(backend: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS)


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return _wrap(tok)


@pytest.fixture(scope="module")
def metaspace() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    # The trainer knows nothing of byte fallback: add the 256 <0xNN> tokens it falls back to.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    first = max(vocab.values()) + 1
    vocab.update({f"<0x{b:02X}>": first + b for b in range(256)})
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
    )
    return _wrap(tok)


@pytest.fixture(params=["byte_level", "metaspace"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return request.getfixturevalue(request.param)


def random_text(rng: random.Random, max_len: int = 40) -> str:
    pool = rng.choice([SEEN, UNSEEN, SEEN + UNSEEN])
    return "".join(rng.choice(pool) for _ in range(rng.randint(1, max_len)))


def chunked(ids: list[int], rng: random.Random | None, max_chunk: int = 5) -> Iterator[list[int]]:
    """``ids`` in order, one at a time (``rng`` None) or in random chunks of 1..``max_chunk``."""
    i = 0
    while i < len(ids):
        n = 1 if rng is None else rng.randint(1, max_chunk)
        yield ids[i : i + n]
        i += n


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def decode(tok: PreTrainedTokenizerFast, ids: list[int], skip: bool = True) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


class NaiveDetokenizer(IncrementalDetokenizer):
    """Decodes every token on its own and holds nothing back: what the checks must reject."""

    def append(self, new_token_ids: list[int]) -> str | None:
        if self.stop_matched is not None:
            return None
        for t in new_token_ids:
            self.output_text += self._tokenizer.decode([t], skip_special_tokens=True)
            for s in self._stop:
                if s in self.output_text:
                    self.stop_matched = s
                    self.output_text = self.output_text[: self.output_text.index(s)]
                    return s
        return None

    def emittable_text(self, finished: bool) -> str:
        return self.output_text


def stream(
    detok: IncrementalDetokenizer,
    chunks: Iterable[list[int]],
    problems: list[str],
    check_text: Callable[[str], None] | None = None,
) -> tuple[list[str], list[str]]:
    """Feed ``chunks`` as the engine does; return the pieces sent to the client and all it was sent
    after each step. ``check_text`` sees ``output_text`` after every append."""
    sent, pieces, history = "", [], []
    for chunk in chunks:
        finished = detok.append(chunk) is not None
        if check_text is not None:
            check_text(detok.output_text)
        text = detok.emittable_text(finished)
        if not text.startswith(sent):
            problems.append(f"sent {sent!r}, then emittable text became {text!r}")
        pieces.append(text[len(sent) :])
        sent = text
        history.append(sent)
        if finished:
            return pieces, history
    text = detok.emittable_text(True)
    if not text.startswith(sent):
        problems.append(f"sent {sent!r}, then final text became {text!r}")
    pieces.append(text[len(sent) :])
    history.append(text)
    return pieces, history


def decode_problems(
    cls: type[IncrementalDetokenizer],
    tok: PreTrainedTokenizerFast,
    prompt_ids: list[int],
    ids: list[int],
    expected: str,
    rng: random.Random | None,
) -> list[str]:
    """Everything wrong with streaming ``ids`` through ``cls``, given the text it should produce."""
    problems: list[str] = []
    previous = [""]

    def check_text(text: str) -> None:
        if "\ufffd" in text and "\ufffd" not in expected:
            problems.append(f"replacement character in intermediate text {text!r}")
        if not text.startswith(previous[0]):
            problems.append(f"output text {text!r} rewrote {previous[0]!r}")
        previous[0] = text

    detok = cls(tok, prompt_ids)
    pieces, _ = stream(detok, chunked(ids, rng), problems, check_text)
    if "".join(pieces) != expected:
        problems.append(f"streamed {''.join(pieces)!r} != {expected!r}")
    if detok.output_text != expected:
        problems.append(f"output_text {detok.output_text!r} != {expected!r}")
    return problems


# ------------------------------------------------------------------------ decoding


@pytest.mark.parametrize("chunking_seed", [None, 1234])
def test_incremental_decode_matches_full_decode(tokenizer: PreTrainedTokenizerFast, chunking_seed: int | None):
    rng = random.Random(0)
    chunk_rng = None if chunking_seed is None else random.Random(chunking_seed)
    for _ in range(150):
        text = random_text(rng)
        ids = encode(tokenizer, text)
        expected = decode(tokenizer, ids)
        assert "\ufffd" not in expected
        assert decode_problems(IncrementalDetokenizer, tokenizer, [], ids, expected, chunk_rng) == []


def test_windows_decode_through_the_backend_as_through_the_tokenizer(tokenizer: PreTrainedTokenizerFast, monkeypatch):
    """A tokenizers-backed tokenizer's windows are decoded by its backend directly (the test above
    then holds for that path); its text is the tokenizer's own decode of every window, special tokens
    kept or skipped, and a tokenizer whose decode is not the stock one is asked itself."""
    rng = random.Random(5)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        assert detok._backend is tokenizer.backend_tokenizer
        for _ in range(100):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))]
            assert detok._decode(ids) == decode(tokenizer, ids, skip)
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: "own")
    assert IncrementalDetokenizer(tokenizer, [])._decode([3, 4]) == "own"


def test_checks_catch_naive_per_token_decoding(byte_level, metaspace):
    """The random texts must exercise the hard cases, and naive per-token decoding must fail them."""
    rng = random.Random(0)
    texts = [random_text(rng) for _ in range(150)]
    for tok in (byte_level, metaspace):
        pieces = [decode(tok, [i]) for t in texts for i in encode(tok, t)]
        assert any("\ufffd" in p for p in pieces), "no character is split over tokens"
        failures = [
            t
            for t in texts
            if decode_problems(NaiveDetokenizer, tok, [], encode(tok, t), decode(tok, encode(tok, t)), None)
        ]
        assert len(failures) > 10
    # Metaspace: decoding "▁world" on its own loses its space.
    ids = encode(metaspace, "hello world")
    assert "".join(decode(metaspace, [i]) for i in ids) != "hello world"


def test_output_after_prompt(tokenizer: PreTrainedTokenizerFast):
    """Split one text into prompt and output at every token boundary.

    Where the prompt ends on a whole character, the output continues its text (keeping the space
    before the first output word). Where it ends inside a character, the output is the text of the
    output ids alone: the character was begun by the prompt, which shows it as U+FFFD.
    """
    text = "The quick brown fox ЖЩΩλπ jumps 龘齉鱻 over 🦄🧬 the lazy dog. 你好 😀"
    ids = encode(tokenizer, text)
    full = decode(tokenizer, ids)
    whole, inside = 0, 0
    for k in range(1, len(ids)):
        prompt_text = decode(tokenizer, ids[:k])
        if prompt_text.endswith("\ufffd"):
            expected = decode(tokenizer, ids[k:])
            inside += 1
        else:
            assert full.startswith(prompt_text)
            expected = full[len(prompt_text) :]
            whole += 1
        assert decode_problems(IncrementalDetokenizer, tokenizer, ids[:k], ids[k:], expected, None) == []
    assert whole > 10 and inside > 5


def test_space_after_prompt_metaspace(metaspace):
    prompt = encode(metaspace, "The quick brown fox")
    out = encode(metaspace, "The quick brown fox jumps")[len(prompt) :]
    assert decode(metaspace, out) == "jumps"  # decoded alone the space is gone...
    detok = IncrementalDetokenizer(metaspace, prompt)
    for t in out:
        detok.append([t])
    assert detok.emittable_text(True) == " jumps"  # ...but a continuation keeps it


def test_special_tokens(tokenizer: PreTrainedTokenizerFast):
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = encode(tokenizer, "Hello 你好") + [eos] + encode(tokenizer, " world 😀") + [eos]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        for t in ids:
            detok.append([t])
        text = detok.emittable_text(True)
        assert text == decode(tokenizer, ids, skip=skip)
        assert (EOS in text) is not skip
    assert IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True).emittable_text(True) == ""


def test_kept_special_tokens_are_decoded_and_every_other_special_token_skipped(tokenizer: PreTrainedTokenizerFast):
    """Markup a server parser reads (Mistral's [TOOL_CALLS], an added token marked special, as its
    tokenizers have it) is kept in the text under skip_special_tokens; the named special tokens and
    the other special added tokens are left out as before."""
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.backend_tokenizer.to_str()),
                                  eos_token=EOS)  # fmt: skip
    tok.add_tokens(["[TOOL_CALLS]", "[ARGS]", "[INST]"], special_tokens=True)
    calls, args, inst = tok.convert_tokens_to_ids(["[TOOL_CALLS]", "[ARGS]", "[INST]"])
    assert calls not in tok.all_special_ids  # (only the added token's flag says it is special)
    eos = tok.convert_tokens_to_ids(EOS)
    ids = encode(tok, "Hello") + [inst, calls] + encode(tok, " f") + [args, eos] + encode(tok, ' {"a": 1}')
    detok = IncrementalDetokenizer(tok, [], kept_special_ids=(calls, args))
    for t in ids:
        detok.append([t])
    assert detok.emittable_text(True) == 'Hello[TOOL_CALLS] f[ARGS] {"a": 1}'
    plain = IncrementalDetokenizer(tok, [])
    plain.append(ids)
    assert plain.emittable_text(True) == decode(tok, ids, skip=True) == 'Hello f {"a": 1}'
    # The set is read again when the vocabulary grows: a special token added later is special too, to the
    # server's tool and reasoning syntaxes (special_token_id) as to decoding.
    assert special_ids(tok) >= {calls, args, inst, eos} and special_token_id(tok, "[THINK]") is None
    tok.add_tokens(["[THINK]"], special_tokens=True)
    think = tok.convert_tokens_to_ids("[THINK]")
    assert think in special_ids(tok) and special_token_id(tok, "[THINK]") == think
    assert special_token_id(tok, "Hello") is None


def test_skipped_special_token_keeps_following_space(metaspace):
    eos = metaspace.convert_tokens_to_ids(EOS)
    hello, world = encode(metaspace, "Hello"), encode(metaspace, "Hello world")[1:]
    detok = IncrementalDetokenizer(metaspace, [])
    for t in hello + [eos] + world:
        detok.append([t])
    assert detok.emittable_text(True) == decode(metaspace, hello + [eos] + world) == "Hello world"


def test_real_replacement_character(tokenizer: PreTrainedTokenizerFast):
    """A U+FFFD the model really produced is held only until the next token, or the end."""
    for text in ("abc \ufffd", "abc \ufffd def"):
        ids = encode(tokenizer, text)
        expected = decode(tokenizer, ids)
        assert expected == text
        detok = IncrementalDetokenizer(tokenizer, [])
        for t in ids:
            detok.append([t])
        assert detok.output_text == (text if text.endswith("def") else "abc ")
        assert detok.emittable_text(True) == text


def test_window_is_bounded(byte_level, monkeypatch):
    """Each step decodes a window of bounded size, however long the output — even for invalid bytes."""
    sizes: list[int] = []
    real_decode = byte_level.decode

    def counting_decode(ids, *args, **kwargs):
        sizes.append(len(ids))
        return real_decode(ids, *args, **kwargs)

    monkeypatch.setattr(byte_level, "decode", counting_decode)
    rng = random.Random(7)
    valid = encode(byte_level, "".join(random_text(rng) for _ in range(100)))
    garbage = [rng.randrange(1, len(byte_level)) for _ in range(2000)]  # often invalid UTF-8
    for ids in (valid, garbage):
        sizes.clear()
        detok = IncrementalDetokenizer(byte_level, valid[:50])
        for chunk in chunked(ids, random.Random(3), max_chunk=4):
            detok.append(chunk)
        # Bound: context and pending are each at most _MAX_PENDING_TOKENS + a chunk - 1 ids.
        assert len(ids) > 1000 and max(sizes) <= 40, max(sizes)


# ------------------------------------------------------------------------ stop strings


def stop_problems(
    cls: type[IncrementalDetokenizer],
    tok: PreTrainedTokenizerFast,
    text: str,
    stop: list[str],
    include: bool,
    rng: random.Random | None,
) -> tuple[list[str], IncrementalDetokenizer]:
    """Stream ``text`` with stop strings; every piece sent must belong to the final text."""
    problems = []
    detok = cls(tok, [], stop=stop, include_stop_str_in_output=include)
    pieces, history = stream(detok, chunked(encode(tok, text), rng), problems)
    final = detok.output_text
    if "".join(pieces) != final:
        problems.append(f"sent {''.join(pieces)!r} != final {final!r}")
    for sent in history:
        if not final.startswith(sent):
            problems.append(f"sent {sent!r}, which the final text {final!r} does not start with")
    if not include and any(s in "".join(pieces) for s in stop):
        problems.append("a stop string was sent")
    return problems, detok


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunking_seed", [None, 5])
def test_stop_string_across_tokens(tokenizer: PreTrainedTokenizerFast, include: bool, chunking_seed: int | None):
    text = "The quick brown fox jumps over the lazy dog. The dog sleeps."
    stop = "lazy dog"
    assert len(encode(tokenizer, stop)) > 1
    rng = None if chunking_seed is None else random.Random(chunking_seed)
    problems, detok = stop_problems(IncrementalDetokenizer, tokenizer, text, [stop], include, rng)
    assert problems == []
    assert detok.stop_matched == stop
    cut = text.index(stop) + (len(stop) if include else 0)
    assert detok.output_text == text[:cut]
    assert detok.append(encode(tokenizer, " more")) is None and detok.output_text == text[:cut]


def test_stop_string_checks_can_fail(byte_level):
    problems, _ = stop_problems(NaiveDetokenizer, byte_level, "over the lazy dog.", ["lazy dog"], False, None)
    assert problems  # the naive stand-in sends "lazy " before knowing it starts the stop string


def test_stop_string_with_multibyte_characters(tokenizer: PreTrainedTokenizerFast):
    text = "emoji 😀 🚀 party 🎉👍🏽 after"
    problems, detok = stop_problems(IncrementalDetokenizer, tokenizer, text, ["🎉👍"], False, None)
    assert problems == [] and detok.stop_matched == "🎉👍"
    assert detok.output_text == "emoji 😀 🚀 party "


@pytest.mark.parametrize("chunking", ["one by one", "random", "all at once"])
def test_earliest_stop_wins(byte_level, chunking: str):
    def chunks(text: str) -> Iterable[list[int]]:
        ids = encode(byte_level, text)
        return [ids] if chunking == "all at once" else chunked(ids, random.Random(11) if chunking == "random" else None)

    for stop in (["dog", "quick"], ["quick", "dog"]):
        detok = IncrementalDetokenizer(byte_level, [], stop=stop)
        stream(detok, chunks("The quick brown fox jumps over the lazy dog."), [])
        assert detok.stop_matched == "quick" and detok.output_text == "The "
    # Overlapping matches: the one that ends first wins, however the text is grouped into appends.
    detok = IncrementalDetokenizer(byte_level, [], stop=["abcd", "bc"])
    stream(detok, chunks("xx abcd yy"), [])
    assert detok.stop_matched == "bc" and detok.output_text == "xx a"


def test_partial_stop_match_is_released(tokenizer: PreTrainedTokenizerFast):
    text = "over the lazy dog, the lazy dog sleeps"
    problems, detok = stop_problems(IncrementalDetokenizer, tokenizer, text, ["lazy cat", "dog!"], False, None)
    assert problems == [] and detok.stop_matched is None
    assert detok.emittable_text(True) == decode(tokenizer, encode(tokenizer, text))

    # Held back while it may still become a stop string; released when it cannot, or at the end.
    detok = IncrementalDetokenizer(tokenizer, [], stop=["lazy cat"])
    detok.append(encode(tokenizer, "over the lazy"))
    assert detok.output_text.endswith("the lazy")
    assert detok.emittable_text(False) == detok.output_text[: -len("lazy")]
    snapshot = detok.output_text
    detok.append(encode(tokenizer, "over the lazy dog")[len(encode(tokenizer, "over the lazy")) :])
    assert detok.emittable_text(False) == detok.output_text != snapshot

    detok = IncrementalDetokenizer(tokenizer, [], stop=["lazy cat"])
    detok.append(encode(tokenizer, "over the lazy"))
    assert detok.emittable_text(True) == detok.output_text == decode(tokenizer, encode(tokenizer, "over the lazy"))


@pytest.mark.parametrize("include", [False, True])
def test_random_stop_strings_stream_safely(tokenizer: PreTrainedTokenizerFast, include: bool):
    """Stop strings cut from random text at random places, streamed in random chunks."""
    rng = random.Random(42)
    matched = 0
    for _ in range(60):
        text = decode(tokenizer, encode(tokenizer, random_text(rng, 60).lstrip(" ")))
        assert decode(tokenizer, encode(tokenizer, text)) == text
        a = rng.randrange(len(text))
        stop = [text[a : a + rng.randint(1, 6)], random_text(rng, 4)]
        problems, detok = stop_problems(IncrementalDetokenizer, tokenizer, text, stop, include, rng)
        assert problems == []
        # The reference: the stop string that ends first in the text, ties to the earliest start.
        hits = [(text.index(s) + len(s), text.index(s), s) for s in stop if s in text]
        end, begin, s = min(hits)
        assert detok.stop_matched == s
        assert detok.output_text == text[: end if include else begin]
        matched += 1
    assert matched == 60


def test_text_added_before_min_tokens_is_never_searched_for_stop_strings(byte_level):
    """A stop string that ended in text added with ``stops`` false (the output short of its
    ``min_tokens``) stops nothing later, even beside a longer stop string; one ending after does."""
    detok = IncrementalDetokenizer(byte_level, [], stop=["dog", "lazy dog!!"])
    assert detok.append(encode(byte_level, "the dog"), stops=False) is None
    assert detok.append(encode(byte_level, " sleeps")) is None and detok.stop_matched is None
    assert detok.append(encode(byte_level, ", the dog")) == "dog" and detok.output_text == "the dog sleeps, the "
