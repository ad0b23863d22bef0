"""What the attention backends share (kept apart from the package's interface, which imports them)."""

from __future__ import annotations

import os


def triton_interpreted() -> bool:
    """Whether Triton kernels run in its interpreter (on CPU tensors) instead of being compiled."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def padded_block_tables(block_tables: list[list[int]], kv_lens: list[int], block_size: int) -> list[list[int]]:
    """Every sequence's block table cut or padded (with block 0, never read) to the blocks the longest
    ``kv_lens`` needs: the rows of one ``[B, max_blocks]`` tensor."""
    n = -(-max(kv_lens) // block_size)
    return [bt[:n] + [0] * (n - min(len(bt), n)) for bt in block_tables]
