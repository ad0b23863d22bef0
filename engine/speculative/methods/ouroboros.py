"""Ouroboros (``--speculative-method ouroboros`` with ``--draft-model``; Zhao et al., 2024): the draft
model drafts phrase by phrase, and what verification throws away becomes its next phrases.

*Phrase drafting.* A draft forward feeds the pending draft token and, after it, the newest pooled
phrase that followed it (keyed by the two tokens before the phrase, else by one); the step's
catch-up forward, which ends at the root, feeds the phrase after the root the same way. One forward
checks the whole phrase, the draft keeping the phrase's tokens up to the first it would not have
drawn itself (its argmax, or for a sampled request its draw from ``q`` with the noise of that output
position, as every drafter's) and drawing the next token there. So the chain is exactly the chain
token-by-token drafting gives, in fewer forwards wherever the pool guesses what the draft would say;
each forward writes the draft KV of what it keeps at its final slots.

*Phrase alternatives.* Where the draft turned a phrase down, the rest of the phrase rides in the
target's verify forward as a branch beside the draft's own token (at most ``branches`` a step,
within the draft's depth): the target may well say what the pool said. Branch nodes are
deterministic, so greedy verification keeps the target's argmax path and sampled verification
rejects against a one-hot draft there (lossless; the draft's own nodes carry the ``q`` they were
drawn from).

*The pool* (per request, bounded: ``PHRASES_PER_KEY`` a key, ``MAX_KEYS`` keys, least recently
touched out; freed with the request, copied on a fork) takes the request's own text as it becomes
final (the prompt's last ``PROMPT_SEED_TOKENS`` tokens on), and after each verification what the
step would otherwise discard, keyed by the token the target put in place of the draft's first
rejected one (what the step emitted there): the draft's tokens after it, and the target's own outputs
over those rows (argmax; each kept while the draft's next token agreed with it). Text is added last,
so it is tried first.

The controller plans this method's depth like the draft model's (the verified tree is never deeper
than the planned depth); its cost model times the draft forwards as they run, phrases and all.
Differences from the paper: no pool shared across requests (its warm start), chains only
(``--spec-tree-topk`` is ignored), no confidence exit.
"""

from __future__ import annotations

import torch

from engine.attention.staging import take_rows, to_device
from engine.request.sequence import Sequence
from engine.runner.model_runner import ForwardChunk, ModelRunner
from engine.sampling.sampler import SamplingMetadata, exponential_noise, processed_probs
from engine.sampling.tree import DraftTree
from engine.speculative.methods.draft_model import DraftModelProposer, load_draft_runner
from engine.speculative.ngram_pool import NgramPool
from engine.speculative.proposer import ProposeContext, VerifyRows

PHRASES_PER_KEY = 20
MAX_KEYS = 4096
PROMPT_SEED_TOKENS = 1024


class PhrasePool:
    """Phrases (up to ``length`` tokens) by the two tokens before them and by the one before them."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.phrases = NgramPool(length + 1, PHRASES_PER_KEY, MAX_KEYS)
        self.pos = 0  # text of the request already taken

    def add(self, prev: int, key: int, phrase: list[int]) -> None:
        phrase = tuple(phrase[: self.length])
        if phrase:
            self.phrases.add(key, phrase)
            self.phrases.add((prev, key), phrase)

    def add_text(self, tokens: list[int]) -> None:
        """The phrases of ``tokens`` (a request's text) after each token from ``pos`` on."""
        end = len(tokens) - self.length
        for i in range(max(self.pos, 1), end):
            self.add(tokens[i - 1], tokens[i], tokens[i + 1 : i + 1 + self.length])
        self.pos = max(self.pos, end)

    def lookup(self, prev: int, key: int) -> tuple[int, ...]:
        return self.phrases.newest((prev, key)) or self.phrases.newest(key) or ()

    def copy(self) -> PhrasePool:
        other = PhrasePool(self.length)
        other.phrases, other.pos = self.phrases.copy(), self.pos
        return other


class _Draft:
    """One sequence's draft this step: its chain (the last token pending, not yet fed to the draft),
    each chain token's ``q`` row (sampled requests), and the phrase tails it turned down."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.q: list[torch.Tensor | None] = []
        self.branches: list[tuple[int, list[int]]] = []  # (chain node it hangs under, -1: the root; tokens)
        self.fed = 0  # chain tokens fed at their final slots


class OuroborosProposer(DraftModelProposer):
    method = "ouroboros"
    fuses_chains = False  # it drafts by phrases, not level by level
    reads_verify_logits = True

    def __init__(
        self,
        runner: ModelRunner,
        target_vocab_size: int,
        eos_token_ids: list[int],
        phrase: int = 4,
        branches: int = 1,
        catch_up_budget: int = 2048,
        max_depth: int = 0,
    ) -> None:
        super().__init__(
            runner, target_vocab_size, eos_token_ids, tree=False, catch_up_budget=catch_up_budget, max_depth=max_depth
        )
        if phrase < 1 or branches < 0:
            raise ValueError(
                f"ouroboros needs a phrase of at least 1 token and branches >= 0, got {phrase}, {branches}"
            )
        self.phrase, self.branches = phrase, branches
        self._pools: dict[int, PhrasePool] = {}
        self.num_phrase_tokens = 0  # draft tokens a phrase gave (drawn by the draft in a forward it shared)

    @classmethod
    def build(cls, config, target: ModelRunner, *, tokenizer, eos_token_ids: list[int]) -> OuroborosProposer:
        runner = load_draft_runner(config, target, tokenizer, cls.method)
        # On a CPU every verified row costs matmul time: one alternative a step; on a GPU they ride nearly free.
        branches = config.ouroboros_branches
        if branches is None:
            branches = 3 if target.device.type == "cuda" else 1
        return cls(
            runner, target.vocab_size, eos_token_ids, config.ouroboros_phrase, branches,
            config.max_num_batched_tokens, config.num_speculative_tokens,
        )  # fmt: skip

    # -- shape ----------------------------------------------------------------------------------
    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        # The chain and its branches; the draft writes no further than the chain's last slot but one.
        return max(depth, 0) + self.branches * min(self.phrase, max(depth - 1, 0))

    # -- the pool -------------------------------------------------------------------------------
    def _pool(self, seq: Sequence) -> PhrasePool:
        pool = self._pools.get(seq.seq_id)
        if pool is None:
            pool = self._pools[seq.seq_id] = PhrasePool(self.phrase)
            pool.pos = max(seq.num_tokens - PROMPT_SEED_TOKENS, 0)
        return pool

    def on_verify_logits(self, rows: list[VerifyRows], logits: torch.Tensor) -> None:
        """What verification discards, as phrases after the token the target put in its place."""
        todo = []
        for r in rows:
            chain = _chain_length(r.tree)
            a = next((i for i, node in enumerate(r.accepted) if node != i), len(r.accepted))
            if a < chain:  # the draft's token at node a was turned down
                todo.append((r, a, chain))
        if not todo:
            return
        index = [r.row + 1 + a + i for r, a, chain in todo for i in range(chain - a)]
        said = take_rows(logits, index).argmax(-1).tolist()
        at = 0
        for r, a, chain in todo:
            out = said[at : at + chain - a]  # the target's argmax after nodes a, a + 1, ... chain - 1
            at += len(out)
            pool = self._pool(r.seq)
            tree, correction = r.tree.tokens, r.emitted[a]  # what the step put where node a was turned down
            prev = tree[a - 1] if a > 0 else r.seq.token_ids[r.seq.num_computed_tokens - len(r.accepted) - 1]
            pool.add(prev, correction, tree[a + 1 : chain])  # the draft's tokens after the rejected one
            # The target's, after the draft's rejected token (a guess that one token's change leaves
            # what follows as it was), kept while the draft's next token agreed with it.
            said_after = [out[0]]
            for i in range(a + 1, chain):
                if tree[i] != said_after[-1]:
                    break
                said_after.append(out[i - a])
            pool.add(prev, correction, said_after)

    # -- drafting -------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], depths: list[int], ctx: ProposeContext) -> list[DraftTree]:
        phrases = []
        for s, depth in zip(seqs, depths):
            pool = self._pool(s)
            pool.add_text(s.token_ids)
            phrases.append(self._phrase(pool, s.token_ids[-2] if s.num_tokens > 1 else -1, s.token_ids[-1], depth - 1))
        # The catch-up forward already feeds the phrase after the root: the first draft tokens need no forward more.
        ready, logits, _ = self._root_logits(seqs, ctx, after_root=phrases)
        trees = [DraftTree() for _ in seqs]
        if not ready:
            return trees
        group, want = [seqs[i] for i in ready], [depths[i] for i in ready]
        drafts = [_Draft() for _ in group]
        self._take(group, drafts, list(range(len(group))), [phrases[i] for i in ready], logits)
        active = [a for a in range(len(group)) if len(drafts[a].tokens) < want[a]]
        while active:  # one draft forward each: the pending token, then the phrase the pool has after it
            chunks, fed_phrases = [], []
            for a in active:
                s, d = group[a], drafts[a]
                offset = len(d.tokens)  # the pending token's place past the root
                prev = d.tokens[-2] if offset > 1 else s.token_ids[-1]
                phrase = self._phrase(self._pool(s), prev, d.tokens[-1], want[a] - 1 - offset)
                chunks.append(
                    ForwardChunk([d.tokens[-1], *phrase], s.num_tokens - 1 + offset, s.block_table, 1 + len(phrase))
                )
                fed_phrases.append(phrase)
            logits, _ = self._forward(self.runner.prepare(chunks), chunks)
            self._take(group, drafts, active, fed_phrases, logits)
            active = [a for a in active if len(drafts[a].tokens) < want[a]]
        for i, s, d, depth in zip(ready, group, drafts, want):
            trees[i] = self._tree(s, d, depth)
        return trees

    def _phrase(self, pool: PhrasePool, prev: int, key: int, room: int) -> list[int]:
        return list(pool.lookup(prev, key)[: max(room, 0)])

    def _take(self, seqs, drafts: list[_Draft], members: list[int], phrases: list[list[int]], logits) -> None:
        """Extend each member's draft from its rows of ``logits``: those of its last fed token (the
        pending one, or the root) and of each phrase token after it. The draft keeps the phrase up to
        the first token it would not have drawn itself, and the token it draws there is the new pending
        one; the phrase's rest is kept as a branch."""
        row_of, ahead = [], []
        for a, phrase in zip(members, phrases):
            base = len(drafts[a].tokens)  # the fed token's place past the root (0: the root)
            row_of += [a] * (1 + len(phrase))
            ahead += range(base, base + 1 + len(phrase))  # row j draws the token base + 1 + j past the root
        picks, q = self._pick(seqs, logits, row_of, ahead)
        r = 0
        for a, phrase in zip(members, phrases):
            d = drafts[a]
            k = 0
            while k < len(phrase) and picks[r + k] == phrase[k]:
                k += 1
            d.fed = len(d.tokens) + k  # the pending token (if any) and the phrase's tokens the draft agreed with
            d.tokens += [*phrase[:k], picks[r + k]]
            d.q += [None] * (k + 1) if q is None else list(q[r : r + k + 1])
            self.num_phrase_tokens += k
            if k < len(phrase) and len(d.branches) < self.branches:
                d.branches.append((d.fed - 1, phrase[k:]))  # beside the new pending token (-1: under the root)
            r += len(phrase) + 1

    def _pick(self, seqs: list[Sequence], logits: torch.Tensor, row_of: list[int], ahead: list[int]):
        """Each row's draft token (host ints) and, if any row samples, each row's ``q`` ``[R, V]``: the
        argmax for a greedy request, else a draw from ``q`` with the noise of that output position
        (``ahead`` places past what the request emitted), as level-by-level drafting draws it."""
        params = [seqs[b].params for b in row_of]
        if all(p.greedy for p in params):  # (penalties would shape the draft's guesses only: not worth a copy)
            return logits.argmax(-1).tolist(), None
        md = SamplingMetadata.from_state(
            params,
            [seqs[b].num_output_tokens for b in row_of],
            [seqs[b].token_counts for b in row_of],
            [seqs[b].prompt_mask for b in row_of],
            [seqs[b].noise_key() for b in row_of],
            self.eos_token_ids,
            self.vocab_size,
            self.device,
        )
        q = processed_probs(logits, md)
        noise = [None if seqs[b].params.greedy else seqs[b].noise_key(j) for b, j in zip(row_of, ahead)]
        return (q / exponential_noise(q, noise)).argmax(-1).tolist(), q

    def _tree(self, seq: Sequence, d: _Draft, depth: int) -> DraftTree:
        """The chain cut to ``depth``, then the phrase tails it turned down, cut to ``depth`` too."""
        chain = d.tokens[:depth]
        tokens, parents = list(chain), list(range(-1, len(chain) - 1))
        qrows = list(d.q[:depth])
        for under, tail in d.branches:
            tail = tail[: max(depth - 1 - under, 0)]  # node `under` sits at depth under + 1
            parent = under
            for t in tail:
                parents.append(parent)
                tokens.append(t)
                qrows.append(None)
                parent = len(tokens) - 1
        self._written[seq.seq_id] = list(range(min(d.fed, len(chain))))
        # Greedy and seeded verification never read q (a seeded request's draws are keyed).
        if seq.params.greedy or seq.seed is not None or qrows[0] is None:
            return DraftTree(tokens, parents)
        q = torch.zeros(len(tokens), self.vocab_size, device=qrows[0].device)
        q[: len(chain)] = torch.stack(qrows[: len(chain)])
        if len(tokens) > len(chain):  # a branch's nodes are certain: q is one-hot at its token
            branch = to_device(tokens[len(chain) :], q.device, torch.int64)
            q[len(chain) :].scatter_(1, branch[:, None], 1.0)
        return DraftTree(tokens, parents, q)

    # -- lifecycle ------------------------------------------------------------------------------
    def on_fork(self, parent: Sequence, child: Sequence) -> None:
        super().on_fork(parent, child)
        pool = self._pools.get(parent.seq_id)
        if pool is not None:
            self._pools[child.seq_id] = pool.copy()

    def on_free(self, seq: Sequence) -> None:
        super().on_free(seq)
        self._pools.pop(seq.seq_id, None)


def _chain_length(tree: DraftTree) -> int:
    """The nodes ``0 .. n - 1`` that form a chain from the root (the draft's own; branches follow)."""
    n = 0
    while n < len(tree) and tree.parents[n] == n - 1:
        n += 1
    return n
