"""The speculative methods, one file each, and the registry that builds them by name: this table.

The step never branches on a method name: the engine builds ``proposer_class(name)`` and talks to it
through :class:`~engine.speculative.proposer.Proposer` only. A new method is one file here and one
row below. A method is imported only when it is asked for (or when a ``--draft-model`` directory's
layout is matched against the methods that claim layouts).
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from engine.speculative.proposer import Proposer

# method name -> "module:class", the module a file of this folder
BUILTIN: dict[str, str] = {
    "auto": "auto:AutoProposer",  # the lookups and any --draft-model, chosen per request and step
    "dflash": "dflash:DFlashProposer",  # a block drafter on the target's features: a whole draft in one forward
    "draft": "draft_model:DraftModelProposer",  # a smaller model of the same family
    "eagle": "eagle:EagleProposer",  # an EAGLE-3 head on the target's hidden states, dynamic trees
    "layer-skip": "layer_skip:LayerSkipProposer",  # the target itself with sublayers skipped
    "lookahead": "lookahead:LookaheadProposer",  # a Jacobi window in the verify forward, an n-gram pool
    "medusa": "medusa:MedusaProposer",  # Medusa heads on the last hidden state
    "mtp": "mtp:ChainedHeadsProposer",  # chained multi-token-prediction heads
    "nextn": "nextn:NextNProposer",  # the checkpoint's own multi-token-prediction layer (GLM-4.5's)
    "ngram": "ngram:NgramProposer",  # prompt lookup
    "ouroboros": "ouroboros:OuroborosProposer",  # a draft model drafting by pooled phrases
    "suffix": "suffix:SuffixProposer",  # suffix trees over the context and earlier outputs
}

# Methods defined outside this folder (tests, plugins): :func:`register` adds them.
_EXTRA: dict[str, type[Proposer]] = {}


def register(cls: type[Proposer]) -> type[Proposer]:
    """Class decorator for a method defined outside this folder: buildable by its ``method`` name."""
    if not cls.method:
        raise ValueError(f"{cls.__name__} has no method name")
    if cls.method in BUILTIN:
        raise ValueError(f"{cls.method!r} is a built-in method")
    _EXTRA[cls.method] = cls
    return cls


def known_methods() -> list[str]:
    return sorted({*BUILTIN, *_EXTRA})


def proposer_class(method: str) -> type[Proposer]:
    if method in _EXTRA:
        return _EXTRA[method]
    if method not in BUILTIN:
        raise ValueError(f"unknown speculative method {method!r}; known: {known_methods()}")
    module, name = BUILTIN[method].split(":")
    cls = getattr(import_module(f"{__name__}.{module}"), name)
    assert cls.method == method, f"{BUILTIN[method]} names itself {cls.method!r}"
    return cls


def method_for_draft(path: str | Path) -> str:
    """The method a ``--draft-model`` directory is for: the first (by name) that claims its layout,
    else ``draft``."""
    path = Path(path)
    if path.is_dir():
        for method in known_methods():
            if proposer_class(method).claims(path):
                return method
    return "draft"


def resolve_method(speculative_method: str | None, draft_model: str | None) -> str:
    """The method an engine runs: the one named, or the one a ``--draft-model`` directory's layout
    names, or ``none``; a ValueError for a name nobody knows."""
    if speculative_method is None:
        return method_for_draft(draft_model) if draft_model else "none"
    if speculative_method != "none" and speculative_method not in known_methods():
        raise ValueError(f"speculative_method must be one of {['none', *known_methods()]}, got {speculative_method!r}")
    return speculative_method
