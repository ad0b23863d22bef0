"""Structured outputs: grammars from requests' specs, and their token masks (see grammar.py)."""

from engine.structured.grammar import GrammarError, Grammars, GrammarState, Walk, unpack

__all__ = ["GrammarError", "GrammarState", "Grammars", "Walk", "unpack"]
