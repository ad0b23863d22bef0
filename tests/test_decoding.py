"""Decoding strategies beyond sampling (engine/decoding): no-repeat n-grams, beam search and contrastive
decoding, each against a reference computed here with Hugging Face transformers, and their OpenAI surface.

The models are tiny random-weight Llamas with ``std=0.3`` weights, peaky enough that beams settle on a
few favourite tokens. One of those favourites is made an extra EOS token of the beam model, so hypotheses
finish mid-search at different lengths. Random weights seldom repeat more than single tokens, so the
no-repeat cases also run with a logit bias that makes greedy text cycle (and every n's ban act).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from test_engine import hf_model, make_engine, prompts
from test_server import assert_error
from transformers import AutoTokenizer

from conftest import build_model_dir
from engine.core.llm_engine import InvalidRequestError
from engine.decoding.contrastive import contrastive_logits
from engine.request.sampling_params import SamplingParams
from engine.request.state import NgramIndex
from engine.sampling.no_repeat import banned_in
from server.app import ServerSettings, create_app
from servers import Served, engine_factory, serve, wait_until

MODEL = "tiny-decoding"
SPECIAL = {0, 1, 2}  # bos, eos, pad of the test tokenizer


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- models -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rep_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """The expert / target of most tests: peaky weights (std 0.3), EOS id 1 only."""
    return build_model_dir(tmp_path_factory.mktemp("rep"), tokenizer_dir, "LlamaForCausalLM", std=0.3)


@pytest.fixture(scope="module")
def amateur_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A different, smaller model over the same vocabulary: contrastive decoding's amateur."""
    return build_model_dir(
        tmp_path_factory.mktemp("amateur"), tokenizer_dir, "LlamaForCausalLM", seed=1, num_hidden_layers=1, std=0.3
    )


@pytest.fixture(scope="module")
def rep_hf(rep_dir):
    return hf_model(rep_dir)


@pytest.fixture(scope="module")
def amateur_hf(amateur_dir):
    return hf_model(amateur_dir)


@pytest.fixture(scope="module")
def rep_engine(rep_dir):
    return make_engine(rep_dir)


@pytest.fixture(scope="module")
def contrast_engine(rep_dir, amateur_dir):
    """Target ``rep_dir`` with the amateur as its draft model (proposer and contrastive amateur)."""
    return make_engine(rep_dir, speculative_method="draft", draft_model=str(amateur_dir), num_speculative_tokens=3)


@pytest.fixture(scope="module")
def beam_eos(rep_hf) -> int:
    """A token the model's beams pick often (EOS left out of the search): the beam model's extra EOS."""
    counts: Counter[int] = Counter()
    for p in BEAM_PROMPTS:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = rep_hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                num_beams=3,
                num_return_sequences=3,
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
        for row in out[:, len(p) :].tolist():
            counts.update(t for t in row if t not in SPECIAL)
    return counts.most_common(1)[0][0]


@pytest.fixture(scope="module")
def beam_dir(tmp_path_factory, tokenizer_dir, beam_eos) -> Path:
    """``rep_dir``'s weights (same seed, same shapes) with ``beam_eos`` as the config's EOS."""
    return build_model_dir(
        tmp_path_factory.mktemp("beam"), tokenizer_dir, "LlamaForCausalLM", std=0.3, eos_token_id=beam_eos
    )


@pytest.fixture(scope="module")
def beam_hf(beam_dir):
    return hf_model(beam_dir)


@pytest.fixture(scope="module")
def beam_engine(beam_dir, beam_eos):
    engine = make_engine(beam_dir)
    assert beam_eos in engine.eos_token_ids and 1 in engine.eos_token_ids
    return engine


# -- references -------------------------------------------------------------------------------------
def hf_generate(model, prompt: list[int], **kw) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=2, **kw)
    return out[0, len(prompt) :].tolist()


def hf_beams(model, prompt: list[int], eos, width: int, n: int, lp, es, max_new: int, bias=None) -> list[list[int]]:
    """transformers' beam search: the ``n`` returned hypotheses' generated tokens, best first (the padding
    after a hypothesis that finished early cut off by its beam indices). ``bias``: a logit bias, which
    transformers adds to the log-probabilities as the engine does (``sequence_bias`` of single tokens)."""
    key = (model, tuple(prompt), tuple(eos or ()), width, n, lp, es, max_new, tuple(sorted((bias or {}).items())))
    if key not in _HF_BEAMS:
        ids = torch.tensor([prompt])
        kw = {"sequence_bias": {(t,): b for t, b in bias.items()}} if bias else {}
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                num_beams=width,
                num_return_sequences=n,
                length_penalty=lp,
                early_stopping=es,
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=2,
                return_dict_in_generate=True,
                **kw,
            )
        lengths = ((out.beam_indices + 1).bool()).sum(1).tolist()
        _HF_BEAMS[key] = [out.sequences[i, len(prompt) : len(prompt) + k].tolist() for i, k in enumerate(lengths)]
    return [list(h) for h in _HF_BEAMS[key]]


_HF_BEAMS: dict[tuple, list[list[int]]] = {}  # references asked for more than once are computed once


def contrastive_reference(expert, amateur, prompt, alpha: float, beta: float, max_new: int, eos) -> list[int]:
    """Contrastive decoding by its definition, one full forward of each model per token."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            x = torch.tensor([ids])
            e = torch.log_softmax(expert(x).logits[0, -1].float(), dim=-1)
            am = torch.log_softmax(amateur(x).logits[0, -1].float(), dim=-1)
            plausible = e >= math.log(alpha) + e.max()
            score = torch.where(plausible, (1 + beta) * e - beta * am, float("-inf"))
            t = int(score.argmax())
            out.append(t)
            ids.append(t)
            if t in eos:
                break
    return out


def first_repeat(history: list[int], n: int, start: int) -> int | None:
    """Index of the first token at or after ``start`` completing an n-gram seen earlier in ``history``."""
    for j in range(max(start, n - 1), len(history)):
        gram = tuple(history[j - n + 1 : j + 1])
        if any(tuple(history[i - n + 1 : i + 1]) == gram for i in range(n - 1, j)):
            return j
    return None


def beams_of(engine, ps, params) -> list[list[list[int]]]:
    return [[c.delta_token_ids for c in o.outputs] for o in engine.generate(ps, params)]


# -- no_repeat_ngram_size ---------------------------------------------------------------------------
NR_PROMPTS = prompts(4, seed=11, lo=4, hi=16)
# A +5 bias on five tokens makes greedy text cycle among them, so bigrams and trigrams repeat and every
# n's ban acts; unbiased, the random model rarely repeats more than single tokens.
NR_BIAS = {t: 5.0 for t in (40, 41, 42, 43, 44)}
NR_CASES = [(p, bias) for p in NR_PROMPTS for bias in (None, NR_BIAS)]


def hf_no_repeat(model, prompt, bias, eos, n: int = 0) -> list[int]:
    kw = {"sequence_bias": {(t,): b for t, b in bias.items()}} if bias else {}
    if n:
        kw["no_repeat_ngram_size"] = n
    return hf_generate(model, prompt, max_new_tokens=16, eos_token_id=eos, **kw)


def test_ngram_index_banned_matches_whole_history():
    """``banned(tokens, path)`` (the history indexed, a draft path above it) is what a fresh index of
    ``tokens + path`` bans; a small alphabet makes n-grams repeat."""
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 4)
        tokens = [rng.randint(0, 3) for _ in range(rng.randint(0, 12))]
        path = [rng.randint(0, 3) for _ in range(rng.randint(0, 5))]
        index = NgramIndex(n)
        cut = rng.randint(0, len(tokens))
        index.sync(tokens[:cut])  # grown in two goes, as a sequence's index is
        index.sync(tokens)
        assert index.banned(tokens, path) == banned_in(tokens + path, n), (n, tokens, path)
    assert banned_in([5, 6, 7, 5, 6], 3) == {7}
    assert banned_in([5, 6, 7, 5, 6], 2) == {7}
    assert banned_in([5, 6, 7, 5, 6], 1) == {5, 6, 7}
    assert banned_in([5, 6, 7, 5, 8], 3) == set()
    assert banned_in([5], 3) == set() and banned_in([], 1) == set()


def check_no_repeat(engine, model, num_draft_tokens=None) -> int:
    """Every case and n against transformers; returns the draft tokens proposed."""
    eos = engine.eos_token_ids
    drafted = 0
    for n in (1, 2, 3):
        plist = [
            SamplingParams(
                temperature=0.0,
                max_tokens=16,
                no_repeat_ngram_size=n,
                logit_bias=bias,
                num_draft_tokens=num_draft_tokens,
            )
            for _, bias in NR_CASES
        ]
        outs = engine.generate([p for p, _ in NR_CASES], plist)
        acted = 0
        for (p, bias), o in zip(NR_CASES, outs):
            got = o.outputs[0].delta_token_ids
            assert got == hf_no_repeat(model, p, bias, eos, n), (n, p, bias)
            assert first_repeat(p + got, n, len(p)) is None, (n, p, got)
            acted += got != hf_no_repeat(model, p, bias, eos)
            drafted += o.stats.num_draft_tokens
        assert acted, f"no_repeat_ngram_size={n} never changed a greedy output: the ban went untested"
    return drafted


def test_no_repeat_matches_transformers(rep_hf, rep_engine):
    check_no_repeat(rep_engine, rep_hf)


def test_no_repeat_under_speculation_matches_transformers(rep_dir, rep_hf):
    """Drafts are forced (the draft model is the target itself, so they are mostly right): verification
    reads the banned distribution, and the output is still transformers'."""
    engine = make_engine(rep_dir, speculative_method="draft", draft_model=str(rep_dir), num_speculative_tokens=3)
    assert check_no_repeat(engine, rep_hf, num_draft_tokens=3) > 0, "nothing was speculated"


# -- beam search ------------------------------------------------------------------------------------
BEAM_PROMPTS = prompts(3, seed=5, lo=4, hi=12)
BEAM_MAX = 10
# (width, n, length_penalty, early_stopping): every combination, n cycling through 1..width
BEAM_CASES = [
    (w, 1 + i % w, lp, es)
    for i, (w, lp, es) in enumerate(itertools.product((2, 3, 4), (1.0, 0.0, -0.5, 2.0), (False, True, "never")))
]


def test_beam_reference_finishes_mid_search(beam_hf, beam_engine, beam_eos):
    """The beam model's extra EOS ends some returned hypotheses early, so the parity below covers
    searches whose hypotheses finish at different lengths, not only at max_tokens."""
    eos = beam_engine.eos_token_ids
    early = [
        case
        for case in BEAM_CASES
        if any(
            h[-1] == beam_eos and len(h) < BEAM_MAX
            for p in BEAM_PROMPTS
            for h in hf_beams(beam_hf, p, eos, *case, BEAM_MAX)
        )
    ]
    assert len(early) >= len(BEAM_CASES) // 4, early


@pytest.mark.parametrize("eos_bias", [0.0, 3.0], ids=["plain", "eos-biased"])
@pytest.mark.parametrize("width,n,lp,es", BEAM_CASES)
def test_beam_search_matches_transformers(beam_hf, beam_engine, beam_eos, width, n, lp, es, eos_bias):
    """Every returned hypothesis, in order. The EOS-biased runs make most beams want to finish: several
    candidates finish in one step (more than ``width`` candidates must be ranked), and with a length
    penalty above 0, ``early_stopping="never"`` keeps searching where ``False`` would stop."""
    bias = {beam_eos: eos_bias} if eos_bias else None
    params = SamplingParams(
        temperature=0.0,
        use_beam_search=True,
        best_of=width,
        n=n,
        length_penalty=lp,
        early_stopping=es,
        max_tokens=BEAM_MAX,
        logit_bias=bias,
    )
    eos = beam_engine.eos_token_ids
    got = beams_of(beam_engine, BEAM_PROMPTS, params)  # the prompts' searches side by side in one batch
    for p, g in zip(BEAM_PROMPTS, got):
        assert g == hf_beams(beam_hf, p, eos, width, n, lp, es, BEAM_MAX, bias), p
    bm = beam_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_beam_search_matches_transformers_on_the_demo_target(tiny_demo):
    """The demo target (trained, not random; fp32) with its own tokenizer and EOS: the searches of
    held-out code prompts, side by side, equal transformers' one by one."""
    target = tiny_demo / "target"
    engine = make_engine(target)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(target)
    texts = ["def main(", "import os\nimport sys\n", "class Parser:\n    def __init__(self"]
    ps = [tok.encode(t) for t in texts]
    eos = engine.eos_token_ids
    for width, n, lp, es in [(3, 2, 1.0, False), (4, 1, 0.5, True), (2, 2, 2.0, "never")]:
        params = SamplingParams(
            temperature=0.0,
            use_beam_search=True,
            best_of=width,
            n=n,
            length_penalty=lp,
            early_stopping=es,
            max_tokens=12,
        )
        for p, got in zip(ps, beams_of(engine, ps, params)):
            assert got == hf_beams(hf, p, eos, width, n, lp, es, 12), (p, width)


def test_beam_search_preempted_and_parked(beam_dir, beam_hf, beam_engine):
    """A KV pool far too small for the beams in flight: beams are preempted (and parked while their
    mates catch up), and every search still ends as transformers' does; a greedy request beside them
    gets its solo output; every block comes back."""
    engine = make_engine(
        beam_dir,
        num_kv_blocks=16,
        block_size=4,
        max_num_batched_tokens=8,
        max_model_len=64,
        enable_prefix_caching=False,
    )
    preempted = []
    preempt = engine.scheduler.preempt

    def counting(seq):
        preempted.append(seq.parked)  # a parked beam: its logits row waits for its mates'
        preempt(seq)

    engine.scheduler.preempt = counting
    ps = prompts(4, seed=9, lo=5, hi=12)
    cases = [(3, 2, 1.0, False), (2, 2, 0.0, True), (3, 3, 2.0, "never"), (2, 1, -0.5, False)]
    plist = [
        SamplingParams(use_beam_search=True, best_of=w, n=n, length_penalty=lp, early_stopping=es, max_tokens=8)
        for w, n, lp, es in cases
    ]
    solo_prompt = prompts(1, seed=10, lo=8, hi=9)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    solo = beam_engine.generate([solo_prompt], greedy)[0].outputs[0].delta_token_ids
    outs = engine.generate(ps + [solo_prompt], plist + [greedy])
    eos = engine.eos_token_ids
    for p, (w, n, lp, es), o in zip(ps, cases, outs):
        assert [c.delta_token_ids for c in o.outputs] == hf_beams(beam_hf, p, eos, w, n, lp, es, 8), (p, w)
    assert outs[-1].outputs[0].delta_token_ids == solo
    assert any(preempted), f"no parked beam was preempted ({len(preempted)} preemptions): the test lost its point"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests() and not engine.scheduler.running and not engine.scheduler.waiting


def test_beam_search_beside_speculating_requests(beam_dir, beam_hf, beam_engine):
    """An engine that speculates (the model drafting for itself): beam requests never draft and still
    equal transformers', while greedy requests in the same steps draft and keep their solo output."""
    engine = make_engine(beam_dir, speculative_method="draft", draft_model=str(beam_dir), num_speculative_tokens=3)
    beam = SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=BEAM_MAX)
    greedy = SamplingParams(temperature=0.0, max_tokens=BEAM_MAX, ignore_eos=True, num_draft_tokens=3)
    solo = [o.outputs[0].delta_token_ids for o in beam_engine.generate(BEAM_PROMPTS, greedy)]
    outs = engine.generate(BEAM_PROMPTS * 2, [beam] * len(BEAM_PROMPTS) + [greedy] * len(BEAM_PROMPTS))
    eos = engine.eos_token_ids
    for p, o in zip(BEAM_PROMPTS, outs):
        assert [c.delta_token_ids for c in o.outputs] == hf_beams(beam_hf, p, eos, 3, 2, 1.0, False, BEAM_MAX), p
        assert o.stats.num_draft_tokens == 0
    assert [o.outputs[0].delta_token_ids for o in outs[len(BEAM_PROMPTS) :]] == solo
    assert all(o.stats.num_draft_tokens > 0 for o in outs[len(BEAM_PROMPTS) :])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_one_beam_is_greedy_decoding(beam_hf, beam_engine):
    params = SamplingParams(use_beam_search=True, max_tokens=BEAM_MAX)
    assert not params.use_beam_search and params.greedy
    eos = beam_engine.eos_token_ids
    got = [o.outputs[0].delta_token_ids for o in beam_engine.generate(BEAM_PROMPTS, params)]
    assert got == [hf_generate(beam_hf, p, max_new_tokens=BEAM_MAX, eos_token_id=eos) for p in BEAM_PROMPTS]


def test_beam_search_stop_string(beam_engine):
    """A hypothesis whose text reaches a stop string ends there, the string cut off its text."""
    tok = beam_engine.tokenizer
    free = SamplingParams(use_beam_search=True, best_of=3, n=3, max_tokens=BEAM_MAX)
    stops = []
    for o in beam_engine.generate(BEAM_PROMPTS, free):
        text = o.outputs[0].text
        # a short printable ASCII piece of the best hypothesis's text, past its first character
        pieces = [text[i : i + 2] for i in range(1, len(text) - 1)]
        pieces = [s for s in pieces if s.isascii() and s.isprintable() and s.strip() == s]
        assert pieces, text
        stops.append(pieces[len(pieces) // 2])
    stopped = 0
    for p, stop in zip(BEAM_PROMPTS, stops):
        params = SamplingParams(use_beam_search=True, best_of=3, n=3, max_tokens=BEAM_MAX, stop=[stop])
        for c in beam_engine.generate([p], params)[0].outputs:
            assert stop not in c.text, (stop, c.text)
            if c.finish_reason == "stop" and c.stop_reason == stop:
                stopped += 1
                full = tok.decode(c.delta_token_ids, skip_special_tokens=True)
                assert full.startswith(c.text) and full.find(stop) == len(c.text), (stop, c.text, full)
    assert stopped, "no hypothesis ended at its stop string"
    bm = beam_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


# -- contrastive decoding ---------------------------------------------------------------------------
CD_PROMPTS = prompts(3, seed=13, lo=4, hi=14)
CD_MAX = 12


@pytest.mark.parametrize("alpha,beta", [(0.1, 0.5), (0.01, 1.0), (0.3, 2.0), (0.001, 0.1)])
def test_contrastive_matches_reference(rep_hf, amateur_hf, contrast_engine, alpha, beta):
    eos = contrast_engine.eos_token_ids
    params = SamplingParams(temperature=0.0, max_tokens=CD_MAX, contrastive=(alpha, beta))
    for p, o in zip(CD_PROMPTS, contrast_engine.generate(CD_PROMPTS, params)):
        ref = contrastive_reference(rep_hf, amateur_hf, p, alpha, beta, CD_MAX, eos)
        assert o.outputs[0].delta_token_ids == ref, (alpha, beta, p)


def test_contrastive_alpha_and_beta(rep_engine, contrast_engine):
    """alpha = 1 keeps only the expert's favourite, and beta = 0 is the expert's own ranking: both are
    plain greedy; a real contrast (beta > 0, room under alpha) changes some output."""
    greedy = [
        o.outputs[0].delta_token_ids
        for o in rep_engine.generate(CD_PROMPTS, SamplingParams(temperature=0.0, max_tokens=CD_MAX))
    ]

    def run(alpha, beta):
        params = SamplingParams(temperature=0.0, max_tokens=CD_MAX, contrastive=(alpha, beta))
        return [o.outputs[0].delta_token_ids for o in contrast_engine.generate(CD_PROMPTS, params)]

    assert run(1.0, 0.5) == greedy
    assert run(1.0, 5.0) == greedy
    assert run(1e-6, 0.0) == greedy
    assert run(0.01, 1.0) != greedy


def test_contrastive_logits_plausibility_mask():
    g = torch.Generator().manual_seed(0)
    expert = torch.randn(4, 64, generator=g) * 3
    amateur = torch.randn(4, 64, generator=g) * 3
    probs = expert.softmax(-1)
    top = probs.max(-1, keepdim=True).values
    e, am = expert.log_softmax(-1), amateur.log_softmax(-1)
    masked_before = torch.zeros_like(expert, dtype=torch.bool)
    for alpha in (1e-4, 0.01, 0.1, 0.5, 0.9, 1.0):
        beta = torch.tensor([0.0, 0.5, 1.0, 3.0])
        out = contrastive_logits(expert, amateur, torch.full((4,), alpha), beta)
        masked = torch.isneginf(out)
        assert not torch.isnan(out).any() and not torch.isposinf(out).any()
        assert masked[probs < alpha * top * (1 - 1e-4)].all(), alpha  # clearly below alpha x the top: out
        assert not masked[probs > alpha * top * (1 + 1e-4)].any(), alpha  # clearly above: in
        assert not masked.gather(1, probs.argmax(-1, keepdim=True)).any()  # the favourite always stays
        assert (masked | ~masked_before).all(), "a larger alpha must mask a superset"
        want = (1 + beta.unsqueeze(1)) * e - beta.unsqueeze(1) * am
        torch.testing.assert_close(out[~masked], want[~masked])
        masked_before = masked
    assert (~masked).sum(-1).tolist() == [1, 1, 1, 1]  # alpha = 1: the favourite alone
    # Per-row parameters in one batch: each row is its own.
    alphas, betas = torch.tensor([1e-4, 0.5, 1.0, 0.1]), torch.tensor([2.0, 0.0, 1.0, 0.5])
    both = contrastive_logits(expert, amateur, alphas, betas)
    for i in range(4):
        one = contrastive_logits(expert[i : i + 1], amateur[i : i + 1], alphas[i : i + 1], betas[i : i + 1])
        torch.testing.assert_close(both[i : i + 1], one)


def test_contrastive_beside_speculating_greedy(rep_hf, amateur_hf, contrast_engine):
    """Contrastive rows and speculated greedy rows in the same steps: each is what it is alone."""
    greedy_prompts = prompts(3, seed=14, lo=6, hi=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=CD_MAX, ignore_eos=True, num_draft_tokens=3)
    solo = [o.outputs[0].delta_token_ids for o in contrast_engine.generate(greedy_prompts, greedy)]
    cd = SamplingParams(temperature=0.0, max_tokens=CD_MAX, contrastive=(0.05, 1.0))
    mixed = contrast_engine.generate(
        [x for pair in zip(CD_PROMPTS, greedy_prompts) for x in pair], [cd, greedy] * len(CD_PROMPTS)
    )
    eos = contrast_engine.eos_token_ids
    for i, p in enumerate(CD_PROMPTS):
        ref = contrastive_reference(rep_hf, amateur_hf, p, 0.05, 1.0, CD_MAX, eos)
        assert mixed[2 * i].outputs[0].delta_token_ids == ref, p
        assert mixed[2 * i].stats.num_draft_tokens == 0  # contrastive requests are never speculated
        assert mixed[2 * i + 1].outputs[0].delta_token_ids == solo[i], greedy_prompts[i]
    assert sum(o.stats.num_draft_tokens for o in mixed[1::2]) > 0, "the greedy requests did not speculate"
    assert solo == [hf_generate(rep_hf, p, max_new_tokens=CD_MAX, eos_token_id=None) for p in greedy_prompts]


def test_contrastive_needs_a_draft_model(rep_engine):
    with pytest.raises(InvalidRequestError, match="draft model"):
        rep_engine.add_request("cd", [5, 6, 7], SamplingParams(temperature=0.0, contrastive=(0.1, 0.5)))
    assert not rep_engine.has_unfinished_requests()


def test_decoding_params_validation():
    bad = [
        (dict(use_beam_search=True, best_of=2, n=3), r"n \(3\) must not exceed the number of beams"),
        (dict(best_of=2, n=1), "best_of other than n needs use_beam_search"),
        (dict(use_beam_search=True, best_of=2, top_p=0.9), "top_p does not apply to beam search"),
        (dict(use_beam_search=True, best_of=2, logprobs=1), "logprobs are not reported for beam search"),
        (dict(use_beam_search=True, best_of=2, early_stopping="sometimes"), "early_stopping must be true, false"),
        (dict(contrastive=(0.0, 0.5)), r"contrastive alpha must be in \(0, 1\], got 0.0"),
        (dict(contrastive=(1.5, 0.5)), r"contrastive alpha must be in \(0, 1\], got 1.5"),
        (dict(contrastive=(0.1, -1.0)), r"contrastive beta must be in \[0, 10\], got -1.0"),
        (dict(contrastive=(0.1, 0.5), use_beam_search=True), "contrastive decoding and beam search do not combine"),
        (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be non-negative, got -1"),
    ]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    assert SamplingParams(use_beam_search=True, best_of=4, n=2).beam_width == 4
    assert SamplingParams(contrastive=(0.1, 0.5)).speculative is False


# -- the server -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(rep_dir, amateur_dir) -> Iterator[Served]:
    factory = engine_factory(
        rep_dir, speculative_method="draft", draft_model=str(amateur_dir), num_speculative_tokens=3
    )
    with serve(create_app(ServerSettings(served_model_name=MODEL), factory)) as s:
        yield s


@pytest.fixture(scope="module")
def plain_srv(rep_dir) -> Iterator[Served]:
    with serve(create_app(ServerSettings(served_model_name=MODEL), engine_factory(rep_dir))) as s:
        yield s


def wait_idle(s: Served) -> None:
    """Until the served engine holds no request and every KV block (the beams' forks too) is free."""
    eng, bm = s.engine, s.engine.block_manager
    wait_until(lambda: not eng.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks, "the engine to idle")


def test_server_beam_search(srv, client, rep_engine):
    p = BEAM_PROMPTS[0]
    extra = {"use_beam_search": True, "length_penalty": 0.5, "early_stopping": "never"}
    resp = client.completions.create(model=MODEL, prompt=p, n=2, best_of=3, max_tokens=BEAM_MAX, extra_body=extra)
    mine = SamplingParams(
        use_beam_search=True, n=2, best_of=3, max_tokens=BEAM_MAX, length_penalty=0.5, early_stopping="never"
    )
    want = rep_engine.generate([p], mine)[0].outputs
    got = sorted(resp.choices, key=lambda c: c.index)
    assert [(c.index, c.text, c.finish_reason) for c in got] == [(c.index, c.text, c.finish_reason) for c in want]
    assert resp.usage.completion_tokens == sum(len(c.delta_token_ids) for c in want)
    wait_idle(srv)


def test_server_contrastive(client, contrast_engine):
    p = CD_PROMPTS[1]
    extra = {"contrastive": {"alpha": 0.05, "beta": 1.0}}
    resp = client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=CD_MAX, extra_body=extra)
    want = contrast_engine.generate([p], SamplingParams(temperature=0.0, max_tokens=CD_MAX, contrastive=(0.05, 1.0)))
    assert resp.choices[0].text == want[0].outputs[0].text


def test_server_chat_no_repeat(client, rep_engine, rep_dir):
    messages = [{"role": "user", "content": "def wrap(text, width):"}]
    extra = {"no_repeat_ngram_size": 2, "ignore_eos": True}
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=16, extra_body=extra
    )
    tok = AutoTokenizer.from_pretrained(rep_dir)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(rendered, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, no_repeat_ngram_size=2, ignore_eos=True)
    out = rep_engine.generate([prompt], params)[0].outputs[0]
    assert first_repeat(prompt + out.delta_token_ids, 2, len(prompt)) is None
    assert resp.choices[0].message.content == out.text
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 16


@pytest.mark.parametrize(
    "body,param,reason",
    [
        ({"use_beam_search": True, "best_of": 2, "stream": True}, None, "stream"),
        ({"use_beam_search": True, "n": 3, "best_of": 2}, None, "best_of"),
        ({"best_of": 3, "n": 1}, "best_of", "use_beam_search"),
        ({"use_beam_search": True, "best_of": 2, "top_p": 0.5}, None, "top_p"),
        ({"use_beam_search": True, "best_of": 2, "logprobs": 1}, None, "logprobs"),
        ({"use_beam_search": True, "best_of": 2, "early_stopping": "sometimes"}, "early_stopping", "early_stopping"),
        ({"contrastive": {"alpha": 1.5, "beta": 0.5}}, "contrastive", "alpha"),
        ({"contrastive": {"alpha": 0.0, "beta": 0.5}}, "contrastive", "alpha"),
        ({"contrastive": {"alpha": 0.1, "beta": 11}}, "contrastive", "beta"),
        ({"contrastive": {"alpha": 0.1, "beta": 0.5, "gamma": 1}}, "contrastive", "gamma"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size", "no_repeat_ngram_size"),
    ],
)
def test_server_rejects_bad_decoding_requests(http, body, param, reason):
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "def", "max_tokens": 4, **body})
    assert_error(resp, 400, param=param, contains=reason)


def test_server_contrastive_without_draft_model(plain_srv):
    body = {"model": MODEL, "prompt": "def", "max_tokens": 4, "contrastive": {"alpha": 0.1, "beta": 0.5}}
    with httpx.Client(base_url=plain_srv.base, timeout=120) as http:
        assert_error(http.post("/v1/completions", json=body), 400, contains="draft model")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "contrastive": body["contrastive"]}
        assert_error(http.post("/v1/chat/completions", json=chat), 400, contains="draft model")
        ok = http.post("/v1/completions", json={**body, "contrastive": None})
        assert ok.status_code == 200, ok.text
