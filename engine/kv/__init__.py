"""Paged KV-cache bookkeeping (no torch): see :mod:`engine.kv.block_manager`."""

from __future__ import annotations

from engine.kv.block_manager import BlockManager

__all__ = ["BlockManager"]
