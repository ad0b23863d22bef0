"""A drafter's own KV cache beside the target's: what a draft model, an EAGLE head and a DFlash drafter
hold alike, whatever way they draft (level by level, or a block in one forward).

The cache is indexed by the *same* block tables as the target's (one block id names a block in both
pools), so allocation, copy-on-write, preemption and tail release stay in sync by construction.
``Sequence.draft_num_computed`` counts the leading rows whose draft KV is valid; a drafter feeds the
rest (its *catch-up*) before it drafts.

Prefix reuse: the draft's blocks follow the target's hashes. A block whose draft KV the drafter wrote
for a full block with hash ``h`` stays valid as long as the drafter writes nothing else into it, so a
target prefix-cache hit on ``h`` is a draft hit too and the catch-up starts after it.
"""

from __future__ import annotations

from engine.request.sequence import Sequence
from engine.runner.model_runner import ForwardChunk, ModelRunner


class OwnCache:
    """The drafter's runner and which of its blocks hold a cached prefix. ``shift``: draft row ``r``
    holds the sequence's token ``r + shift`` (an EAGLE head's rows lag the tokens by one)."""

    def __init__(self, runner: ModelRunner, shift: int = 0) -> None:
        self.runner = runner
        self.shift = shift
        self._valid: dict[int, int] = {}  # block id → hash of the full block whose draft KV it holds
        self._marked: dict[int, int] = {}  # seq_id → leading full blocks already recorded in _valid

    @property
    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token

    def allocate(self, num_blocks: int) -> None:
        self.runner.allocate_kv(num_blocks)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Mirror the target's copy-on-write copies: a copied block holds no cached prefix of its own."""
        for _, dst in copies:
            self._valid.pop(dst, None)
        self.runner.copy_blocks(copies)

    def skip_cached_prefix(self, seq: Sequence) -> None:
        """Start the catch-up after the leading full blocks whose draft KV is valid for their hash."""
        bs = self.runner.block_size
        n = seq.draft_num_computed // bs  # the blocks before are computed already
        while n < len(seq.block_hashes) and self._valid.get(seq.block_table[n]) == seq.block_hashes[n]:
            n += 1
        n = min(n * bs, seq.num_tokens - 1 - self.shift)  # the root row is always fed
        if n > seq.draft_num_computed:
            seq.draft_num_computed = n

    def mark_valid(self, seq: Sequence) -> None:
        """Record the full blocks whose draft KV is now computed, from where the last call stopped:
        blocks before are final and never written again while the sequence holds them."""
        end = min(len(seq.block_hashes), seq.draft_num_computed // self.runner.block_size)
        for i in range(self._marked.get(seq.seq_id, 0), end):
            self._valid[seq.block_table[i]] = seq.block_hashes[i]
        self._marked[seq.seq_id] = max(end, self._marked.get(seq.seq_id, 0))

    def overwrites(self, chunks: list[ForwardChunk]) -> None:
        """The drafter writes these chunks' slots: their blocks no longer hold a cached prefix."""
        bs = self.runner.block_size
        for c in chunks:
            for b in range(c.ctx_len // bs, (c.ctx_len + len(c.token_ids) - 1) // bs + 1):
                self._valid.pop(c.block_table[b], None)

    def forget(self, seq: Sequence) -> None:
        """``seq`` lost its blocks or left: nothing of it is recorded any more."""
        self._marked.pop(seq.seq_id, None)
