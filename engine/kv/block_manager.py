"""Bookkeeping for a paged KV cache: ref counts, free pool, copy-on-write and prefix caching.

Terms used throughout:

* A *block* holds the keys and values of ``block_size`` consecutive token positions (*slots*) of
  one sequence. Blocks are named by an integer id in ``[0, num_blocks)``; the model runner owns the
  tensors and indexes them by that id. This module never touches a tensor, so it can be unit-tested
  on CPU in milliseconds.
* A *block table* (owned by the sequence, mutated here in place) lists the blocks holding slot
  ``i`` at index ``i // block_size``.
* A block's *ref count* is the number of block tables that list it. Forked sequences (``n > 1``,
  beam-like sampling) share blocks; a shared block is copied before it is written
  (*copy-on-write*), and the manager hands the runner the ``(src, dst)`` pairs to copy.
* The *free pool* holds every block at ref count 0, ready for reuse.
* *Prefix caching*: a block full of *final* tokens (tokens whose KV will never be rewritten) is
  registered under a key ``(parent_hash, tokens_of_block)``, where ``parent_hash`` is the hash of
  the previous block's key (a hash chain, so a block's identity covers the whole prefix before it).
  A freed block keeps its content and its key while it waits in the free pool, so a later request
  with the same prefix can pick it up again instead of recomputing it. The key keeps the token
  tuple itself, so a lookup compares tokens exactly; only the parent link is a 64-bit hash.

Eviction order: the free pool is an LRU. A block reaching ref 0 that carries a cached key goes to
the most-recently-freed end; one with no key holds nothing worth keeping, so it goes to the front
and is reused first. Fresh allocations pop the front, and reusing a block forgets its key.

Every operation costs O(1) per block it touches (plus O(block_size) per block it hashes).
"""

from __future__ import annotations

from collections import OrderedDict

# A block's cache key: (hash of the previous block's key, or ROOT_PARENT_HASH; its token ids).
BlockKey = tuple[int, tuple[int, ...]]

# Parent hash of the first block of every sequence.
ROOT_PARENT_HASH = 0


def chain_root(namespace: str | None, salt: str | None = None, tenant: str | None = None) -> int:
    """The parent hash a sequence's first block chains from: the base model's for None, else one of
    its own for ``namespace`` (a LoRA adapter's load), so the cache never hands one model's KV to
    another's sequence with the same tokens; with ``salt`` (a request's ``cache_salt``), one of that
    salt's own too, shared only with requests that carry it; with ``tenant`` (an API key's digest, under
    ``--prefix-cache-scope api-key``), one of that key's own, shared only with its requests."""
    if tenant is not None:
        return hash(("tenant", namespace, salt, tenant))
    if salt is not None:
        return hash(("salted", namespace, salt))
    return ROOT_PARENT_HASH if namespace is None else hash(("namespace", namespace))


class BlockManager:
    """Allocates KV blocks to block tables and tracks which of them hold reusable prefixes.

    The manager only keeps books. Callers (the scheduler) pass in the sequence's own
    ``block_table`` and ``block_hashes`` lists, which are updated in place; the model runner performs
    the block copies that :meth:`reserve` returns before it runs the forward pass that writes them.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

        self._ref_counts: list[int] = [0] * num_blocks
        # Blocks at ref 0, least recently freed first. Values are unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Prefix cache: key -> block id. A block is in it iff _block_key[block] is not None.
        self._cache: dict[BlockKey, int] = {}
        self._block_key: list[BlockKey | None] = [None] * num_blocks
        # hash(_block_key[b]), kept so that matching does not rehash token tuples.
        self._block_hash: list[int | None] = [None] * num_blocks

        self._queried_blocks = 0
        self._hit_blocks = 0
        # Blocks the latest match_prefix could have hit; take_prefix counts it, so a waiting
        # sequence that is matched every step but admitted once is counted once.
        self._last_query_blocks = 0

    # -- views ------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks at ref count 0, including those still holding a cached prefix (they are evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one block table."""
        return (self.num_blocks - len(self._free)) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    @property
    def prefix_cache_stats(self) -> tuple[int, int]:
        """(queried blocks, hit blocks), cumulative over admissions, for the hit-rate metric."""
        return self._queried_blocks, self._hit_blocks

    # -- admission --------------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], root: int = ROOT_PARENT_HASH) -> tuple[list[int], list[int]]:
        """Longest chain of cached full blocks that is a prefix of ``token_ids``, in the chain that
        starts at ``root`` (:func:`chain_root`: KV computed under another model, a LoRA adapter, is
        another chain).

        The match covers at most ``len(token_ids) - 1`` tokens: the last token must still go through
        the model so that there are logits to sample from. Returns ``(block_ids, block_hashes)``.
        Allocation state is unchanged (the scheduler may call this every step for a request it
        cannot admit yet); only the number of blocks queried is noted for :meth:`take_prefix`.
        """
        if not self.enable_prefix_caching or not token_ids:
            self._last_query_blocks = 0
            return [], []
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        self._last_query_blocks = max_blocks
        block_ids: list[int] = []
        hashes: list[int] = []
        parent = root
        for i in range(max_blocks):
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            block = self._cache.get(key)
            if block is None:
                break
            parent = self._block_hash[block]  # type: ignore[assignment]  # cached => hashed
            block_ids.append(block)
            hashes.append(parent)
        return block_ids, hashes

    def blocks_needed(self, num_held_blocks: int, num_tokens: int) -> int:
        """New blocks needed to hold ``num_tokens`` slots when ``num_held_blocks`` are already held."""
        return max(0, -(-num_tokens // self.block_size) - num_held_blocks)

    def can_allocate(self, prefix_blocks: list[int], num_new_blocks: int) -> bool:
        """Whether taking ``prefix_blocks`` plus ``num_new_blocks`` fresh blocks fits.

        Matched blocks at ref 0 sit in the free pool, so taking them shrinks what is left for the
        fresh ones; matched blocks already in use cost nothing.
        """
        from_pool = sum(1 for b in prefix_blocks if self._ref_counts[b] == 0)
        return from_pool + num_new_blocks <= len(self._free)

    def take_prefix(
        self,
        block_table: list[int],
        block_hashes: list[int],
        prefix_blocks: list[int],
        prefix_hashes: list[int],
    ) -> None:
        """Start an empty ``block_table`` with the cached blocks :meth:`match_prefix` returned.

        Each block gains a ref; one at ref 0 leaves the free pool but keeps its cached content.
        Call it on every admission, with empty lists on a miss, so the hit-rate stats see every
        query. Raises ``ValueError`` if a block was evicted since it was matched.
        """
        if block_table or block_hashes:
            raise ValueError("take_prefix needs an empty block table and hash list")
        if len(prefix_blocks) != len(prefix_hashes):
            raise ValueError("prefix_blocks and prefix_hashes differ in length")
        for block, h in zip(prefix_blocks, prefix_hashes, strict=True):
            self._check_id(block)
            if self._block_hash[block] != h:
                raise ValueError(f"block {block} no longer caches hash {h}; match_prefix again")
        for block in prefix_blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        block_table.extend(prefix_blocks)
        block_hashes.extend(prefix_hashes)
        self._queried_blocks += max(self._last_query_blocks, len(prefix_blocks))
        self._hit_blocks += len(prefix_blocks)
        self._last_query_blocks = 0

    # -- writing ----------------------------------------------------------------------------------
    def reserve(self, block_table: list[int], start: int, end: int) -> list[tuple[int, int]] | None:
        """Make token slots ``[start, end)`` writable for this table.

        Appends fresh blocks until the table covers ``end`` slots, and gives the table a private
        copy of every block overlapping ``[start, end)`` that other tables share (ref count > 1).
        Returns the ``(src_block, dst_block)`` pairs whose content the runner must copy before
        writing. All or nothing: if the free pool is too small for all of it, nothing changes and
        the result is ``None``.
        """
        if start < 0 or end < start:
            raise ValueError(f"bad slot range [{start}, {end})")
        bs = self.block_size
        num_new = max(0, -(-end // bs) - len(block_table))
        shared: list[int] = []  # indices into block_table needing a private copy
        exclusive_cached: list[int] = []
        if end > start:
            for i in range(start // bs, min((end - 1) // bs + 1, len(block_table))):
                block = block_table[i]
                if self._ref_counts[block] > 1:
                    shared.append(i)
                elif self._block_key[block] is not None:
                    exclusive_cached.append(block)
        if num_new + len(shared) > len(self._free):
            return None

        # A cached block is about to be overwritten in place: the cache must forget it. (Only
        # final tokens are hashed and final slots are not rewritten, so this is a safety net.)
        for block in exclusive_cached:
            self._uncache(block)
        copies: list[tuple[int, int]] = []
        for i in shared:
            src = block_table[i]
            dst = self._allocate()
            self._ref_counts[src] -= 1  # stays >= 1: it was > 1
            block_table[i] = dst
            copies.append((src, dst))
        for _ in range(num_new):
            block_table.append(self._allocate())
        return copies

    def commit(
        self,
        block_table: list[int],
        block_hashes: list[int],
        token_ids: list[int],
        num_final_tokens: int,
        root: int = ROOT_PARENT_HASH,
    ) -> None:
        """Register in the prefix cache every full block of final tokens that has no hash yet.

        ``num_final_tokens`` leading tokens have KV that will never be rewritten (speculative drafts
        that may still be rejected are not final). ``len(block_hashes)`` blocks are already hashed.
        If another block already caches the same key, that entry is kept and this block stays
        uncached, but its hash is still appended so the chain continues. A no-op when prefix
        caching is disabled.
        """
        if not self.enable_prefix_caching:
            return
        if num_final_tokens > len(token_ids):
            raise ValueError(f"num_final_tokens={num_final_tokens} exceeds {len(token_ids)} tokens")
        bs = self.block_size
        num_full = num_final_tokens // bs
        if num_full > len(block_table):
            raise ValueError(f"{num_full} full blocks of final tokens but the table holds {len(block_table)}")
        for i in range(len(block_hashes), num_full):
            parent = block_hashes[-1] if block_hashes else root
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            h = hash(key)
            block = block_table[i]
            if key not in self._cache and self._block_key[block] is None:
                self._cache[key] = block
                self._block_key[block] = key
                self._block_hash[block] = h
            block_hashes.append(h)

    # -- sharing and release ----------------------------------------------------------------------
    def fork(self, block_table: list[int]) -> list[int]:
        """A child's block table sharing every block of ``block_table`` (ref counts +1)."""
        for block in block_table:
            if self._ref_counts[block] < 1:
                raise ValueError(f"fork of block {block}, which no table holds")
        for block in block_table:
            self._ref_counts[block] += 1
        return type(block_table)(block_table)  # a table that tracks its changes stays one

    def free(self, block_table: list[int]) -> None:
        """Drop one ref on each block and clear the list.

        Refs are dropped tail first, so among a sequence's cached blocks its tail is evicted before
        its prefix (which other requests are likelier to share). A block reaching ref 0 keeps its
        content and cached key until it is reused. Raises ``ValueError`` on a double free, before
        changing anything.
        """
        for block in block_table:
            if self._ref_counts[block] < 1:
                raise ValueError(f"double free: block {block} has ref count 0")
        for block in reversed(block_table):
            self._decref(block)
        block_table.clear()

    def release_tail(self, block_table: list[int], block_hashes: list[int], num_tokens: int) -> None:
        """Keep only the blocks needed for the first ``num_tokens`` slots and release the rest.

        Speculative decoding calls this every step to drop the slots of rejected draft tokens, so
        it costs O(released blocks), not O(table length). ``block_hashes`` is cut to the blocks
        that stay full within ``num_tokens``. A kept, now partial block that is cached and held by
        this table alone is uncached, since its tail slots will be rewritten; released blocks keep
        their cached content (it is still valid).
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        bs = self.block_size
        keep = -(-num_tokens // bs)
        num_full = num_tokens // bs
        if len(block_hashes) > num_full:
            del block_hashes[num_full:]
        if keep < len(block_table):
            released = block_table[keep:]
            for block in released:
                if self._ref_counts[block] < 1:
                    raise ValueError(f"double free: block {block} has ref count 0")
            del block_table[keep:]
            for block in reversed(released):
                self._decref(block)
        if num_full < keep <= len(block_table):
            partial = block_table[keep - 1]
            if self._ref_counts[partial] == 1 and self._block_key[partial] is not None:
                self._uncache(partial)

    def reset_prefix_cache(self) -> None:
        """Forget the cached keys of every block at ref 0 (e.g. after the weights change)."""
        for block in self._free:
            self._uncache(block)

    def check_invariants(self) -> None:
        """Assert internal consistency (O(num_blocks)); meant for tests and debugging."""
        for block in range(self.num_blocks):
            ref = self._ref_counts[block]
            assert ref >= 0, f"block {block}: negative ref count {ref}"
            is_free = block in self._free
            assert (ref == 0) == is_free, f"block {block}: ref {ref} but free={is_free}"
            key = self._block_key[block]
            if key is None:
                assert self._block_hash[block] is None, f"block {block}: hash without key"
            else:
                assert self._cache.get(key) == block, f"block {block}: key not mapped to it"
                assert self._block_hash[block] == hash(key), f"block {block}: stale hash"
        assert len(self._free) == sum(1 for r in self._ref_counts if r == 0)
        for key, block in self._cache.items():
            assert self._block_key[block] == key, f"cache entry for block {block} does not match its key"

    # -- internals --------------------------------------------------------------------------------
    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")

    def _allocate(self) -> int:
        """Pop the front of the free pool, forgetting any prefix it cached; ref count becomes 1."""
        block, _ = self._free.popitem(last=False)
        if self._block_key[block] is not None:
            self._uncache(block)
        self._ref_counts[block] = 1
        return block

    def _decref(self, block: int) -> None:
        ref = self._ref_counts[block]
        if ref < 1:
            raise ValueError(f"double free: block {block} has ref count 0")
        self._ref_counts[block] = ref - 1
        if ref == 1:
            self._free[block] = None
            if self._block_key[block] is None:
                self._free.move_to_end(block, last=False)  # nothing cached: reuse it first

    def _uncache(self, block: int) -> None:
        key = self._block_key[block]
        if key is None:
            return
        del self._cache[key]
        self._block_key[block] = None
        self._block_hash[block] = None
