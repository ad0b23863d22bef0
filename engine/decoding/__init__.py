"""Decoding strategies beyond sampling: no-repeat n-grams, beam search, contrastive search and
contrastive decoding (see docs/decoding.md). Each is one module; the step (``engine/core/step.py``)
hands each the rows of the sequences that use it."""
