"""The greedy rule's fast path: where no row needs a logits processor it takes the raw logits'
argmax without building sampling metadata, and gives what the full path gives; every processor's
request still goes through the full path (a fast path that ignored one would pick the wrong token)."""

from __future__ import annotations

import pytest
import torch

import engine.sampling.accept as accept_mod
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import SequenceGroup
from engine.sampling.accept import RowsMetadata, accept_greedy
from engine.sampling.batch import Sample
from engine.sampling.tree import DraftTree

V, EOS = 8, 7


def sample_at(params: SamplingParams, tree: DraftTree, row: int, prompt=(1, 2, 3)) -> Sample:
    return Sample(SequenceGroup(f"r{row}", list(prompt), params, 0.0).seqs[0], tree, row=row, tok=row)


def rows_md() -> RowsMetadata:
    return RowsMetadata(V, torch.device("cpu"), [EOS])


def test_fast_path_matches_the_full_path_on_random_trees(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    trees = [DraftTree([], []), DraftTree([3, 4, 5], [-1, 0, -1]), DraftTree([2, 2], [-1, 0])]
    for trial in range(30):
        samples, row = [], 0
        for tree in trees:
            samples.append(sample_at(SamplingParams(temperature=0.0), tree, row))
            row += len(tree) + 1
        logits = torch.randn(row + 2, V, generator=gen)  # rows past the samples' are never read
        # Make some drafted tokens the argmax of their parent's row so that paths get accepted.
        if trial % 2:
            logits[samples[1].row, 3] = logits[samples[1].row + 1, 4] = 10.0
        assert rows_md().plain_rows(samples) is not None
        fast = accept_greedy(samples, logits, rows_md())
        monkeypatch.setattr(RowsMetadata, "plain_rows", lambda self, s: None)
        full = accept_greedy(samples, logits, rows_md())
        monkeypatch.undo()
        assert fast == full


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, logit_bias={EOS: -100.0}),
        SamplingParams(temperature=0.0, repetition_penalty=50.0),
        SamplingParams(temperature=0.0, presence_penalty=2.0),
        SamplingParams(temperature=0.0, frequency_penalty=2.0),
        SamplingParams(temperature=0.0, no_repeat_ngram_size=1),
    ],
    ids=["min_tokens", "logit_bias", "repetition", "presence", "frequency", "no_repeat"],
)
def test_every_processor_takes_the_full_path(params):
    # The raw argmax is EOS, which is also the prompt's (and, for the output penalties, the output's)
    # token: each processor must move the choice off it.
    sample = sample_at(params, DraftTree([], []), 0, prompt=(EOS, EOS))
    if params.presence_penalty or params.frequency_penalty:
        sample.seq.token_ids.append(EOS)  # one output token: EOS
    assert rows_md().plain_rows([sample]) is None
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 1] = 5.0, 4.0
    [(path, final)] = accept_greedy([sample], logits, rows_md())
    assert path == [] and final == 1


def test_a_met_min_tokens_is_plain():
    sample = sample_at(SamplingParams(temperature=0.0, min_tokens=1), DraftTree([], []), 0)
    assert rows_md().plain_rows([sample]) is None  # no output yet: EOS is banned this step
    sample.seq.token_ids.append(4)  # one output token
    assert sample.seq.num_output_tokens >= 1
    assert rows_md().plain_rows([sample]) == [0]


def test_fast_path_is_taken(monkeypatch):
    """The plain request really skips the metadata (else the fast path would be dead code)."""
    calls = []
    monkeypatch.setattr(RowsMetadata, "__call__", lambda self, s: calls.append(s))
    sample = sample_at(SamplingParams(temperature=0.0), DraftTree([6], [-1]), 0)
    logits = torch.zeros(2, V)
    logits[0, 6] = logits[1, 2] = 1.0
    assert accept_mod.accept_greedy([sample], logits, rows_md()) == [([0], 2)]
    assert calls == []
