"""Cumulative speculative-decoding counters, read by the server's metrics."""

from __future__ import annotations


class SpecStats:
    def __init__(self, max_depth: int) -> None:
        self.num_drafts = 0  # verify steps that carried a draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * max(max_depth, 1)
        # proposer → [verify steps it drafted, draft tokens, accepted tokens] (auto holds several)
        self.by_method: dict[str, list[int]] = {}

    def record(self, drafted: int, accepted: int, method: str = "") -> None:
        tally = self.by_method.setdefault(method, [0, 0, 0])
        tally[0] += 1
        tally[1] += drafted
        tally[2] += accepted
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for j in range(min(accepted, len(self.accepted_per_pos))):
            self.accepted_per_pos[j] += 1
