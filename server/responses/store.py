"""Stored responses (``store: true``): what ``previous_response_id``, ``GET`` and ``DELETE
/v1/responses/{id}`` read.

Bounded by count and by bytes; when either bound is passed, the oldest responses go first (in the
order they were stored; reading one does not renew it). A response keeps the conversation it ended
(the messages before it, its input, its output), so continuing it needs no walk back through its
ancestors, and evicting an ancestor never breaks a descendant. Each response is counted with its
whole conversation: the messages are shared between a response and those continuing it, but one that
outlives the response that added a message keeps it alive, so only this count bounds what is held.
Under ``--api-key`` a response belongs to the key that made it; any other key is told it does not exist.

Everything here runs on the event loop's thread.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Stored:
    response: dict  # the response object, as returned
    history: tuple[dict, ...]  # the conversation up to and with this response's output, as chat messages
    input_items: tuple[dict, ...]  # this request's input items (GET .../input_items)
    owner: str | None  # digest of the API key that made it (None: no key)
    size: int  # bytes counted against the store


class ResponseStore:
    def __init__(self, max_count: int = 1024, max_bytes: int = 128 * 2**20) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, history: list[dict], input_items: list[dict], owner: str | None) -> None:
        """Keep ``response`` with ``history``, the conversation it ended."""
        size = _size(response) + _size(input_items) + sum(_size(m) for m in history)
        if size > self.max_bytes or self.max_count <= 0:
            return  # could never be kept: storing it would only empty the store
        self.delete(response["id"])
        self._items[response["id"]] = Stored(response, tuple(history), tuple(input_items), owner, size)
        self.bytes += size
        while len(self._items) > self.max_count or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size
            self.evicted += 1

    def get(self, response_id: str, owner: str | None) -> Stored | None:
        item = self._items.get(response_id)
        return item if item is not None and item.owner == owner else None

    def delete(self, response_id: str) -> None:
        """Remove it if kept (whoever owns it: callers check with :meth:`get` first)."""
        item = self._items.pop(response_id, None)
        if item is not None:
            self.bytes -= item.size


def _size(obj) -> int:
    return len(json.dumps(obj, ensure_ascii=False).encode())
