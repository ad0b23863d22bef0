"""One request's failure stays its own: the guard around a step's per-request host work.

A step does most of its work for all its requests at once (the schedule, one forward, one batched
acceptance) and some for one request at a time on the host: a beam search's step, contrastive
search's pick, a grammar's advance, logprobs, stop checks and detokenizing. Each such piece runs
through :meth:`Confine.run`. One that raises marks its request *failed* (``group.error``: its own
exception) and is logged; every later stage of the step passes the failed request by
(:meth:`Confine.ok`) and commits the rest. The engine ends the failed requests once the step is over
(:meth:`Confine.take`): their KV blocks are freed once, and none of their sequences is left in the
scheduler. Ending one in the middle of the step would pull blocks from under a batch that still
refers to them.

A failure of the step's shared work (the schedule, the forward, a batched kernel) is not any one
request's: the engine fails the requests in that step (``LLMEngine.step``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from engine.request.sequence import SequenceGroup

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Confine:
    def __init__(self) -> None:
        self.failed: dict[str, SequenceGroup] = {}  # request id → a request failed in this step, not yet ended

    def run(self, group: SequenceGroup, work: Callable[..., T], *args) -> T | None:
        """``work(*args)`` for ``group``'s request; None, with the request failed, if it raises (or if the
        request failed already: nothing more is done for it)."""
        if group.error is not None:
            return None
        try:
            return work(*args)
        except Exception as e:
            logger.exception("request %s failed in the step; the others go on", group.request_id)
            self.fail(group, f"{type(e).__name__}: {e}")
            return None

    def fail(self, group: SequenceGroup, error: str) -> None:
        if group.error is None:
            group.error = error
        self.failed[group.request_id] = group

    @staticmethod
    def ok(group: SequenceGroup) -> bool:
        """Whether the request is still going (the step does its work for it)."""
        return group.error is None

    def take(self) -> list[SequenceGroup]:
        """The requests failed since the last call, for the engine to end."""
        failed, self.failed = list(self.failed.values()), {}
        return failed
