"""Unit tests for the batched sampler, on CPU with tiny vocabularies and hand-computed answers.

Filters are checked on distributions chosen so that the float32 arithmetic is exact (powers of two)
wherever a test sits on a boundary. The statistical tests use fixed seeds, so they are
deterministic; each has a companion that runs a deliberately wrong rule through the same check to
show that the check can fail.
"""

from __future__ import annotations

import math

import pytest
import torch

import engine.sampling.sampler as sampler_mod
from engine.request.sampling_params import SamplingParams
from engine.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    _top_p_keep,
    apply_logits_processors,
    compute_probs,
    sample_from_probs,
)
from engine.sampling.verify import draw

V = 8  # vocabulary size used by most tests
EOS = 7


# -- helpers -------------------------------------------------------------------------------------


def logits_with_argmax(argmax: int, vocab: int = V, high: float = 5.0) -> torch.Tensor:
    """``[vocab]`` float32 logits that are 0 everywhere except ``high`` at ``argmax``."""
    logits = torch.zeros(vocab)
    logits[argmax] = high
    return logits


def logits_from_probs(probs: list[float], temperature: float = 1.0) -> torch.Tensor:
    """``[1, V]`` logits whose temperature-scaled softmax is ``probs`` (``T * log p``)."""
    return (temperature * torch.tensor(probs).log()).unsqueeze(0)


def build(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos: list[int] | None = None,
    vocab: int = V,
) -> SamplingMetadata:
    b = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(b)],
        outputs if outputs is not None else [[] for _ in range(b)],
        generators if generators is not None else [None] * b,
        eos if eos is not None else [EOS],
        vocab,
        torch.device("cpu"),
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 5 categories: 4 degrees of freedom, where P(chi2 > 30) is about 5e-6. Loose on purpose.
CHI2_LIMIT = 30.0
TARGET = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])


def random_md(batch: int, generators: list[torch.Generator | None] | None = None) -> SamplingMetadata:
    """Metadata for ``batch`` plain random rows (T = 1, no filters), built by hand for speed."""
    return SamplingMetadata(
        temperature=torch.ones(batch),
        all_greedy=False,
        all_random=True,
        top_k=None,
        top_p=None,
        min_p=None,
        repetition_penalty=None,
        presence_penalty=None,
        frequency_penalty=None,
        prompt_mask=None,
        output_counts=None,
        logit_bias=None,
        suppress_mask=None,
        generators=generators if generators is not None else [None] * batch,
    )


# -- build ---------------------------------------------------------------------------------------


def test_build_skips_unused_tensors() -> None:
    md = build([SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)])
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.repetition_penalty is None and md.presence_penalty is None and md.frequency_penalty is None
    assert md.prompt_mask is None and md.output_counts is None
    assert md.logit_bias is None and md.suppress_mask is None
    assert not md.needs_processing
    assert md.max_num_logprobs == -1
    assert torch.equal(md.temperature, torch.tensor([0.7, 0.0]))
    assert not md.all_greedy and not md.all_random


def test_build_filters_only_count_for_random_rows() -> None:
    # A greedy row's filters cannot change its argmax, so they alone do not switch the filter on.
    md = build([SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.5), SamplingParams()])
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.all_greedy is False and md.all_random is False

    md = build(
        [
            SamplingParams(top_k=3),
            SamplingParams(top_k=-1),
            SamplingParams(top_k=0),
            SamplingParams(top_k=100),  # larger than the vocabulary: off
            SamplingParams(temperature=0.0, top_k=2),
        ]
    )
    assert md.top_k is not None and md.top_k.dtype == torch.int64
    assert md.top_k.tolist() == [3, V, V, V, V]


def test_build_logprobs_representation() -> None:
    assert build([SamplingParams(), SamplingParams()]).max_num_logprobs == -1
    assert build([SamplingParams(logprobs=0), SamplingParams()]).max_num_logprobs == 0
    assert build([SamplingParams(logprobs=2), SamplingParams(logprobs=5), SamplingParams()]).max_num_logprobs == 5


def test_build_counts_and_prompt_mask() -> None:
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(),  # no penalty: its history is not scattered at all
    ]
    prompts = [[1, 1, 2], [3, 4], [5]]
    outputs = [[2, 6, 6, 6], [4, 4, 0], [5, 5]]
    md = build(params, prompts, outputs)
    assert md.output_counts is not None and md.prompt_mask is not None
    counts = torch.zeros(3, V)
    counts[0, 2], counts[0, 6] = 1, 3
    counts[1, 4], counts[1, 0] = 2, 1
    assert torch.equal(md.output_counts, counts)
    mask = torch.zeros(3, V, dtype=torch.bool)
    mask[0, [1, 2]] = True  # only the row with a repetition penalty reads its prompt
    assert torch.equal(md.prompt_mask, mask)
    assert md.repetition_penalty.tolist() == [1.5, 1.0, 1.0]
    assert md.presence_penalty.tolist() == [0.0, 0.5, 0.0]
    assert md.frequency_penalty.tolist() == [0.0, 0.0, 0.0]


def test_build_prompt_mask_absent_without_repetition_penalty() -> None:
    md = build([SamplingParams(frequency_penalty=1.0)], prompts=[[1, 2]], outputs=[[3]])
    assert md.prompt_mask is None and md.output_counts is not None


def test_build_ignores_out_of_range_ids() -> None:
    params = [SamplingParams(logit_bias={1: 2.0, V: 5.0, -1: 3.0}, repetition_penalty=2.0)]
    md = build(params, prompts=[[0, V + 3, -2]], outputs=[[V, 2]])
    expected_bias = torch.zeros(1, V)
    expected_bias[0, 1] = 2.0
    assert torch.equal(md.logit_bias, expected_bias)
    assert md.prompt_mask[0].nonzero().flatten().tolist() == [0]
    assert md.output_counts[0].nonzero().flatten().tolist() == [2]


def test_build_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingMetadata.build([SamplingParams()], [[]], [[], []], [None], [EOS], V, torch.device("cpu"))


# -- logits processors ---------------------------------------------------------------------------


def test_repetition_penalty_positive_and_negative_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0, 0.0, 1.0, 1.0]])
    md = build([SamplingParams(repetition_penalty=2.0)], prompts=[[0]], outputs=[[1, 1, 4]])
    out = apply_logits_processors(logits, md)
    # seen: 0 (prompt, positive -> halved), 1 and 4 (output, negative -> doubled); others untouched.
    expected = torch.tensor([[1.0, -2.0, 0.5, 3.0, -8.0, 0.0, 1.0, 1.0]])
    assert torch.equal(out, expected)


def test_presence_and_frequency_penalties() -> None:
    logits = torch.zeros(1, V)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)]
    md = build(params, prompts=[[5, 5, 6]], outputs=[[2, 2, 3]])
    out = apply_logits_processors(logits, md)
    # counts: token 2 twice, token 3 once; prompt tokens 5, 6 are not penalised by these.
    expected = torch.zeros(1, V)
    expected[0, 2] = -(0.5 + 0.25 * 2)  # -1.0
    expected[0, 3] = -(0.5 + 0.25 * 1)  # -0.75
    assert torch.equal(out, expected)


def test_penalties_only_touch_rows_that_ask() -> None:
    logits = torch.full((2, V), 1.0)
    params = [SamplingParams(repetition_penalty=4.0, frequency_penalty=1.0), SamplingParams()]
    md = build(params, prompts=[[0], [0]], outputs=[[1], [1]])
    out = apply_logits_processors(logits, md)
    assert out[0, 0] == pytest.approx(0.25)  # prompt token: 1 / 4
    assert out[0, 1] == pytest.approx(0.25 - 1.0)  # output token: 1 / 4, then frequency 1 * 1
    assert torch.equal(out[1], logits[1])


def test_logit_bias_added() -> None:
    logits = torch.arange(V, dtype=torch.float32).unsqueeze(0).repeat(2, 1)
    md = build([SamplingParams(logit_bias={0: 10.0, 3: -2.5}), SamplingParams()])
    out = apply_logits_processors(logits, md)
    expected = logits.clone()
    expected[0, 0] += 10.0
    expected[0, 3] -= 2.5
    assert torch.equal(out, expected)


def test_apply_logits_processors_never_modifies_input() -> None:
    logits = torch.randn(2, V, generator=seeded(0))
    before = logits.clone()
    md = build(
        [SamplingParams(repetition_penalty=1.3, logit_bias={1: 3.0}, min_tokens=2), SamplingParams()],
        outputs=[[1], []],
    )
    out = apply_logits_processors(logits, md)
    assert torch.equal(logits, before)
    assert out.data_ptr() != logits.data_ptr()
    # Even with nothing to apply, the result is a new tensor.
    plain = apply_logits_processors(logits, build([SamplingParams(), SamplingParams()]))
    assert torch.equal(plain, logits) and plain.data_ptr() != logits.data_ptr()


def test_min_tokens_suppresses_eos_and_stop_ids_until_enough_outputs() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3], ignore_eos=True)
    logits = logits_with_argmax(EOS).unsqueeze(0)
    logits[0, 3] = 4.0  # second best: a stop id; third best (all zeros) -> token 0

    md = build([params], outputs=[[1]])  # one output so far: still below min_tokens
    assert md.suppress_mask is not None
    assert md.suppress_mask[0].nonzero().flatten().tolist() == [3, EOS]
    out = apply_logits_processors(logits, md)
    assert out[0, EOS] == float("-inf") and out[0, 3] == float("-inf")
    assert Sampler()(logits, md).token_ids.tolist() == [0]

    md = build([params], outputs=[[1, 2]])  # min_tokens reached: nothing suppressed any more
    assert md.suppress_mask is None
    assert Sampler()(logits, md).token_ids.tolist() == [EOS]


def test_min_tokens_suppression_is_per_row() -> None:
    params = [SamplingParams(min_tokens=1), SamplingParams(min_tokens=1), SamplingParams()]
    md = build(params, outputs=[[], [4], []])
    assert md.suppress_mask is not None
    assert md.suppress_mask.sum(dim=1).tolist() == [1, 0, 0]
    assert bool(md.suppress_mask[0, EOS])


# -- filters -------------------------------------------------------------------------------------


def test_top_k_with_temperature() -> None:
    logits = torch.tensor([[1.0, 4.0, 0.0, 3.0, 2.0]])
    md = build([SamplingParams(temperature=2.0, top_k=2)], vocab=5)
    probs = compute_probs(logits, md)
    # Keep tokens 1 and 3; at T = 2 their logits are 2.0 and 1.5.
    p1 = 1.0 / (1.0 + math.exp(-0.5))
    expected = torch.tensor([[0.0, p1, 0.0, 1.0 - p1, 0.0]])
    torch.testing.assert_close(probs, expected)


def test_top_k_ties_keep_lowest_ids() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    probs = compute_probs(logits, build([SamplingParams(top_k=2)], vocab=5))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]]))


DYADIC = [0.5, 0.25, 0.125, 0.125]


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.01, [0]),  # below the top token's own mass: the top token is always kept
        (0.5, [0]),  # exact boundary: the top token alone reaches 0.5
        (0.6, [0, 1]),
        (0.75, [0, 1]),  # exact boundary: 0.5 + 0.25 reaches 0.75, no third token needed
        (0.76, [0, 1, 2]),
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keep_boundaries(top_p: float, kept: list[int]) -> None:
    keep = _top_p_keep(torch.tensor([DYADIC]), torch.tensor([top_p]))
    assert keep[0].nonzero().flatten().tolist() == kept


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.01, [1.0, 0.0, 0.0, 0.0]),
        (0.6, [2 / 3, 1 / 3, 0.0, 0.0]),
        (0.75, [2 / 3, 1 / 3, 0.0, 0.0]),
        (0.8, [4 / 7, 2 / 7, 1 / 7, 0.0]),
    ],
)
def test_top_p_with_temperature(top_p: float, expected: list[float]) -> None:
    # Logits T * log(p): at T = 0.5 the scaled distribution is DYADIC; at T = 1 it would be
    # [0.66, 0.17, 0.08, 0.08], where top_p = 0.6 keeps only the first token.
    logits = logits_from_probs(DYADIC, temperature=0.5)
    probs = compute_probs(logits, build([SamplingParams(temperature=0.5, top_p=top_p)], vocab=4))
    torch.testing.assert_close(probs, torch.tensor([expected]))


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [
        (0.3, [2 / 3, 1 / 3, 0.0, 0.0]),  # threshold 0.15: drops the 0.125s
        (0.25, DYADIC),  # threshold exactly 0.125: equal is kept
        (0.6, [1.0, 0.0, 0.0, 0.0]),  # threshold 0.3: only the top token
    ],
)
def test_min_p_with_temperature(min_p: float, expected: list[float]) -> None:
    logits = logits_from_probs(DYADIC, temperature=2.0)
    probs = compute_probs(logits, build([SamplingParams(temperature=2.0, min_p=min_p)], vocab=4))
    torch.testing.assert_close(probs, torch.tensor([expected]))


def test_filter_order_top_k_then_top_p_then_min_p() -> None:
    base = [0.4, 0.3, 0.2, 0.1]
    logits = logits_from_probs(base)
    # top-k 2 renormalises to [4/7, 3/7]; top-p 0.5 on that keeps only the first token. (Top-p on
    # the unfiltered distribution would have kept two, since 0.4 < 0.5.)
    probs = compute_probs(logits, build([SamplingParams(top_k=2, top_p=0.5)], vocab=4))
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    # top-k 3 -> [4/9, 3/9, 2/9]; top-p 0.9 keeps all three; min-p 0.6 drops 2/9 < 0.6 * 4/9.
    params = SamplingParams(top_k=3, top_p=0.9, min_p=0.6)
    probs = compute_probs(logits, build([params], vocab=4))
    torch.testing.assert_close(probs, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


def test_filters_are_per_row() -> None:
    logits = logits_from_probs(DYADIC).repeat(4, 1)
    # The unfiltered row gets logits whose softmax does not sum to exactly 1 in float32, so a stray
    # renormalisation of it would show up in the bit-for-bit comparison below.
    logits[3] = torch.tensor([0.3, -1.7, 2.9, 0.1])
    params = [
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.6),
        SamplingParams(min_p=0.3),
        SamplingParams(),  # no filter: plain softmax, untouched by its mates' filters
    ]
    probs = compute_probs(logits, build(params, vocab=4))
    expected = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2 / 3, 1 / 3, 0.0, 0.0], [2 / 3, 1 / 3, 0.0, 0.0]])
    torch.testing.assert_close(probs[:3], expected)
    assert torch.equal(probs[3], torch.softmax(logits[3:], dim=-1)[0])  # bit for bit


def test_top_p_one_keeps_tokens_lost_to_rounding() -> None:
    # Adding 1e-9 to a float32 running sum of 1.0 changes nothing, so by the cumulative rule alone
    # the tail tokens would lie "past" the whole mass even for top_p = 1. A row that asked for no
    # top-p must keep its whole distribution (it may share the sort with rows that did ask).
    sorted_probs = torch.tensor([[0.5, 0.5, 1e-9, 1e-9]]).repeat(2, 1)
    keep = _top_p_keep(sorted_probs, torch.tensor([1.0, 0.99]))
    assert keep[0].tolist() == [True, True, True, True]
    assert keep[1].tolist() == [True, True, False, False]


def test_probs_sum_to_one() -> None:
    logits = torch.randn(6, 50, generator=seeded(3)) * 3
    params = [
        SamplingParams(temperature=0.3, top_k=5),
        SamplingParams(temperature=1.5, top_p=0.3),
        SamplingParams(temperature=0.9, min_p=0.2),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=10, top_p=0.8, min_p=0.05),
        SamplingParams(),
    ]
    probs = compute_probs(logits, build(params, vocab=50))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(6))
    assert bool((probs >= 0).all())


# -- greedy and mixed batches --------------------------------------------------------------------


def test_greedy_ties_go_to_lowest_index() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    md = build([SamplingParams(temperature=0.0)], vocab=4)
    assert Sampler()(logits, md).token_ids.tolist() == [1]
    torch.testing.assert_close(compute_probs(logits, md), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_greedy_rows_mixed_with_random_rows() -> None:
    greedy_argmax = {0: 3, 2: 6}
    rows = [
        logits_with_argmax(3, high=0.5),
        torch.zeros(V),  # random, uniform
        logits_with_argmax(6, high=0.5),
        torch.zeros(V),
    ]
    logits = torch.stack(rows)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=4),
        SamplingParams(temperature=0.0, top_p=0.1),  # filters on a greedy row change nothing
        SamplingParams(temperature=1.0),
    ]
    md = build(params)
    probs = compute_probs(logits, md)
    for row, token in greedy_argmax.items():
        assert torch.equal(probs[row], torch.nn.functional.one_hot(torch.tensor(token), V).float())
    torch.testing.assert_close(probs[1], torch.tensor([0.25] * 4 + [0.0] * 4))
    torch.testing.assert_close(probs[3], torch.full((V,), 1 / V))

    torch.manual_seed(0)
    seen: list[set[int]] = [set() for _ in rows]
    for _ in range(200):
        tokens = Sampler()(logits, md).token_ids.tolist()
        for row, token in enumerate(tokens):
            seen[row].add(token)
    assert seen[0] == {3} and seen[2] == {6}
    assert seen[1] == {0, 1, 2, 3}  # random, and within its top-k
    assert len(seen[3]) == V


def test_all_greedy_fast_path_and_processed_greedy_path() -> None:
    logits = torch.stack([logits_with_argmax(2), logits_with_argmax(5)])
    md = build([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)])
    assert md.all_greedy and not md.needs_processing
    assert Sampler()(logits, md).token_ids.tolist() == [2, 5]
    # With a processor the argmax moves: a repetition penalty of 10 on token 2 (logit 5 -> 0.5).
    logits[0, 4] = 1.0
    md = build([SamplingParams(temperature=0.0, repetition_penalty=10.0), SamplingParams(temperature=0.0)], [[2], []])
    assert md.all_greedy and md.needs_processing
    assert Sampler()(logits, md).token_ids.tolist() == [4, 5]


def test_greedy_seeded_row_consumes_no_randomness() -> None:
    gen = seeded(7)
    state = gen.get_state()
    logits = torch.randn(2, V, generator=seeded(1))
    md = build([SamplingParams(temperature=0.0, seed=7), SamplingParams()], generators=[gen, None])
    assert md.generators == [None, None]
    Sampler()(logits, md)
    assert torch.equal(gen.get_state(), state)


# -- the draw ------------------------------------------------------------------------------------


def test_sample_from_probs_follows_distribution() -> None:
    n = 20_000
    probs = TARGET.repeat(n, 1)  # [n, 5]
    torch.manual_seed(1234)
    tokens = sample_from_probs(probs, random_md(n))
    counts = torch.bincount(tokens, minlength=5).float()
    assert chi_square(counts, TARGET) < CHI2_LIMIT


def test_frequency_check_can_fail() -> None:
    # Same draws, wrong race (argmax(p * E) instead of argmax(p / E)): the check must reject it.
    n = 20_000
    probs = TARGET.repeat(n, 1)
    gen = seeded(1234)
    wrong = (probs * torch.empty_like(probs).exponential_(generator=gen)).argmax(dim=-1)
    counts = torch.bincount(wrong, minlength=5).float()
    assert chi_square(counts, TARGET) > CHI2_LIMIT


def test_seeded_row_follows_distribution(monkeypatch) -> None:
    # A row with its own generator, drawn step by step the way the engine does.
    def seeded_counts() -> torch.Tensor:
        md = random_md(1, generators=[seeded(99)])
        tokens = torch.cat([sample_from_probs(TARGET.unsqueeze(0), md) for _ in range(4000)])
        return torch.bincount(tokens, minlength=5).float()

    assert chi_square(seeded_counts(), TARGET) < CHI2_LIMIT
    # The same draws in the wrong race (argmax(p * E) instead of argmax(p / E)), at this test's n: rejected.
    noise = sampler_mod.exponential_noise
    monkeypatch.setattr(sampler_mod, "exponential_noise", lambda probs, generators: 1 / noise(probs, generators))
    assert chi_square(seeded_counts(), TARGET) > CHI2_LIMIT


def test_zero_probability_tokens_are_never_drawn() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(5000, 1)
    torch.manual_seed(5)
    tokens = sample_from_probs(probs, random_md(5000))
    assert set(tokens.tolist()) == {1, 3}


def test_inverse_cdf_draw_follows_each_rows_distribution() -> None:
    # Rows of different, unnormalized distributions with massless tokens, drawn at once (verify's final
    # draws and plain sampling's): each row's counts follow its own distribution.
    rows = torch.tensor([[0.2, 0.4, 0.6, 0.3, 0.5], [0.0, 3.0, 0.0, 1.0, 0.0], [1e-3, 0.0, 0.0, 0.0, 0.999]])
    n = 20_000
    torch.manual_seed(7)
    tokens = draw(rows.repeat_interleave(n, 0), torch.rand(3 * n, dtype=torch.float64)).view(3, n)
    for row, toks in zip(rows, tokens):
        counts = torch.bincount(toks, minlength=5).float()
        assert (counts[row == 0] == 0).all()
        kept = row > 0
        assert chi_square(counts[kept], row[kept] / row.sum()) < CHI2_LIMIT


def test_inverse_cdf_draw_at_the_ends_of_the_unit_interval_takes_tokens_with_mass() -> None:
    P = torch.tensor([[0.0, 0.0, 2.0, 1.0, 0.0, 0.0]] * 2)
    u = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)
    assert draw(P, u).tolist() == [2, 3]


def test_inverse_cdf_check_can_fail() -> None:
    # The same draws by a wrong rule (the point not scaled by the row's total, so an unnormalized row
    # is drawn from its first half): the check must reject it.
    row = TARGET * 2
    n = 20_000
    torch.manual_seed(7)
    u = torch.rand(n, dtype=torch.float64)
    cdf = row.double().cumsum(0)
    wrong = torch.searchsorted(cdf, u, right=True)
    counts = torch.bincount(wrong, minlength=5).float()
    assert chi_square(counts, TARGET) > CHI2_LIMIT
    right = draw(row.repeat(n, 1), u)
    assert chi_square(torch.bincount(right, minlength=5).float(), TARGET) < CHI2_LIMIT


def _seeded_run(position: int, mates: list[tuple[SamplingParams, torch.Generator | None]]) -> list[int]:
    """Tokens of the target row (seed 42, T = 0.8) over 6 steps, placed at ``position`` among mates."""
    target = SamplingParams(temperature=0.8, seed=42)
    gen = seeded(42)
    step_logits = torch.randn(6, 50, generator=seeded(0)) * 2  # the target row's logits per step
    noise = seeded(123)  # mates' logits: different in every scenario
    tokens = []
    for step in range(6):
        rows = [(params, g, torch.randn(50, generator=noise) * 3) for params, g in mates]
        rows.insert(position, (target, gen, step_logits[step]))
        md = build([r[0] for r in rows], generators=[r[1] for r in rows], vocab=50)
        out = Sampler()(torch.stack([r[2] for r in rows]), md)
        tokens.append(int(out.token_ids[position]))
    return tokens


def test_seeded_row_is_reproducible_whatever_its_batch_mates() -> None:
    alone = _seeded_run(0, [])
    assert len(set(alone)) > 1  # it does sample, not just take an argmax
    scenarios = {
        "seeded mates": (1, [(SamplingParams(seed=1), seeded(1)), (SamplingParams(seed=2), seeded(2))]),
        "unseeded mates": (2, [(SamplingParams(), None), (SamplingParams(temperature=1.3), None)]),
        "greedy mates": (1, [(SamplingParams(temperature=0.0), None)]),
        "filtered mates": (
            2,
            [(SamplingParams(top_k=3), None), (SamplingParams(top_p=0.5, min_p=0.1), seeded(5))],
        ),
        "penalised mates": (0, [(SamplingParams(presence_penalty=1.0, logit_bias={3: 2.0}), None)]),
    }
    for name, (position, mates) in scenarios.items():
        torch.manual_seed(len(name))  # the default RNG state must not matter either
        assert _seeded_run(position, mates) == alone, name


def test_different_seeds_give_different_tokens() -> None:
    # Guards the reproducibility test against a sampler that ignores generators entirely.
    logits = torch.zeros(1, 1000)
    md_a = random_md(1, generators=[seeded(1)])
    md_b = random_md(1, generators=[seeded(2)])
    a = [int(Sampler()(logits, md_a).token_ids) for _ in range(5)]
    b = [int(Sampler()(logits, md_b).token_ids) for _ in range(5)]
    assert a != b


# -- logprobs ------------------------------------------------------------------------------------


def test_no_logprobs_unless_asked() -> None:
    out = Sampler()(torch.randn(2, V), build([SamplingParams(), SamplingParams(temperature=0.0)]))
    assert isinstance(out, SamplerOutput)
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (2,)


def test_sampled_logprob_is_from_raw_logits() -> None:
    logits = torch.tensor([[0.0, 5.0, 3.0, 4.0, 1.0, 2.0, -1.0, 0.5]])
    # The bias forces token 6, the least likely token of the raw distribution; the reported logprob
    # is still the raw one, not ~0 from the biased distribution.
    md = build([SamplingParams(temperature=0.5, top_p=0.9, logit_bias={6: 100.0}, logprobs=0)])
    out = Sampler()(logits, md)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids.tolist() == [6]
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs, raw[:, 6])
    assert out.top_token_ids is None and out.top_logprobs is None  # logprobs=0: sampled token only


def test_top_logprobs_ordering_and_widest_request() -> None:
    logits = torch.stack(
        [
            torch.tensor([0.0, 5.0, 3.0, 4.0, 1.0, 2.0, -1.0, 0.5]),
            logits_with_argmax(EOS),
            torch.tensor([2.0, 1.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]),
        ]
    )
    params = [SamplingParams(logprobs=3), SamplingParams(temperature=0.0), SamplingParams(logprobs=1)]
    md = build(params)
    assert md.max_num_logprobs == 3
    out = Sampler()(logits, md)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.top_token_ids is not None and out.top_logprobs is not None and out.logprobs is not None
    assert out.top_token_ids.shape == (3, 3) and out.top_token_ids.dtype == torch.int64
    assert out.top_token_ids[0].tolist() == [1, 3, 2]
    assert out.top_token_ids[1, 0].item() == EOS
    assert out.top_token_ids[2].tolist() == [3, 0, 1]
    torch.testing.assert_close(out.top_logprobs, raw.gather(1, out.top_token_ids))
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())  # best first
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert out.token_ids[1].item() == EOS


# -- device --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_and_seeds_reproduce() -> None:
    cuda = torch.device("cuda")
    logits = torch.randn(4, 1000, generator=seeded(0)) * 2
    params = [
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(min_p=0.05, frequency_penalty=0.5, logprobs=2),
        SamplingParams(logit_bias={5: 3.0}, min_tokens=2),
    ]
    prompts, outputs = [[1, 2], [3], [4, 4], [5]], [[6], [7, 7], [8], []]

    def run(device: torch.device, gen_seed: int) -> tuple[torch.Tensor, SamplerOutput]:
        gens = [torch.Generator(device=device).manual_seed(gen_seed), None, None, None]
        md = SamplingMetadata.build(params, prompts, outputs, gens, [EOS], 1000, device)
        processed = apply_logits_processors(logits.to(device), md)
        return compute_probs(processed, md), Sampler()(logits.to(device), md)

    cpu_probs, _ = run(torch.device("cpu"), 3)
    gpu_probs, out = run(cuda, 3)
    torch.testing.assert_close(gpu_probs.cpu(), cpu_probs, atol=1e-5, rtol=1e-4)
    assert out.token_ids.device.type == "cuda" and out.top_token_ids.shape == (4, 2)
    assert out.token_ids[1].item() == int(cpu_probs[1].argmax())
    _, again = run(cuda, 3)
    assert again.token_ids[0].item() == out.token_ids[0].item()
