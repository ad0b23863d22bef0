"""Which adapters the server knows, which hold a slot, and who holds them.

More adapters may be known (read, checked and kept in host memory: a few MB each at rank 16) than
the ``max_loras`` slots hold. A request takes its adapter's slot for its whole life (:meth:`acquire`,
:meth:`release`): an adapter without one gets a free slot, else the least recently used slot that no
request holds; when every slot is held by others' requests, the request waits (the engine retries
before each step). A slot is written between forwards; the slots a running request holds are never
written. An adapter unloaded while requests hold it or wait for it stays known to them (and only them)
until the last of them ends. Each load has its own number: the prefix cache keys its KV by it
(:meth:`kv_namespace`), so an adapter loaded again under an old name never reuses the old one's KV.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.lora.adapters import Adapter, AdapterError
from engine.lora.layers import LoraSlots


class AdapterRegistry:
    """``write(slot, adapter)`` and ``clear(slot)`` change a slot (default: ``slots``' own methods; a
    tensor-parallel engine sends them to every rank through its runner)."""

    def __init__(self, slots: LoraSlots, write=None, clear=None) -> None:
        self.slots = slots
        self.write = write or slots.load
        self.clear = clear or slots.clear
        self.known: dict[str, Adapter] = {}
        self.slot_of: dict[str, int] = {}  # adapters in a slot
        self.holders: dict[str, int] = {}  # requests holding each adapter's slot
        self.waiting: dict[str, int] = {}  # requests queued for each adapter (no slot yet): they keep it known
        self.recent: OrderedDict[str, None] = OrderedDict()  # adapters in a slot, least recently used first
        self.leaving: set[str] = set()  # unloaded while held or waited for: gone when the last of those ends
        self.loads: dict[str, int] = {}  # each known adapter's load number
        self._loads = 0

    def add(self, adapter: Adapter) -> None:
        """Know ``adapter`` (checked against the model first: :class:`AdapterError` if it does not fit)."""
        if adapter.name in self.leaving:
            raise AdapterError(
                f"the LoRA adapter {adapter.name!r} is being unloaded: requests still run under it or wait for it; "
                "load it again when they end"
            )
        if adapter.name in self.known:
            raise AdapterError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        self.slots.place(adapter)
        self.known[adapter.name] = adapter
        self._loads += 1
        self.loads[adapter.name] = self._loads

    def kv_namespace(self, name: str) -> str:
        """What the prefix cache keys ``name``'s KV by: its name and its load's number."""
        return f"{name}#{self.loads[name]}"

    def remove(self, name: str) -> None:
        """Forget ``name`` (KeyError if unknown): no new request can ask for it; its slot is freed now, or
        when the last request holding it ends."""
        if name not in self.known or name in self.leaving:
            raise KeyError(name)
        if self.holders.get(name) or self.waiting.get(name):
            self.leaving.add(name)
        else:
            self._forget(name)

    def wait(self, name: str) -> None:
        """A request for ``name`` is queued (it keeps ``name`` known until :meth:`unwait`)."""
        self.waiting[name] = self.waiting.get(name, 0) + 1

    def unwait(self, name: str) -> None:
        """A queued request for ``name`` got its slot, or left the queue."""
        self.waiting[name] -= 1
        if not self.waiting[name]:
            del self.waiting[name]
            self._gone_if_unused(name)

    def acquire(self, name: str) -> int | None:
        """The slot for a new request of ``name`` (written now if it has none), or None while every
        slot is held by other adapters' requests."""
        slot = self.slot_of.get(name)
        if slot is None:
            free = sorted(set(range(self.slots.max_loras)) - set(self.slot_of.values()))
            if free:
                slot = free[0]
            else:
                idle = next((n for n in self.recent if not self.holders.get(n)), None)
                if idle is None:
                    return None
                slot = self.slot_of.pop(idle)
                del self.recent[idle]
            self.write(slot, self.known[name])
            self.slot_of[name] = slot
        self.recent[name] = None
        self.recent.move_to_end(name)
        self.holders[name] = self.holders.get(name, 0) + 1
        return slot

    def release(self, name: str) -> None:
        self.holders[name] -= 1
        if not self.holders[name]:
            del self.holders[name]
            self._gone_if_unused(name)

    def _gone_if_unused(self, name: str) -> None:
        if name in self.leaving and not self.holders.get(name) and not self.waiting.get(name):
            self._forget(name)

    def _forget(self, name: str) -> None:
        self.known.pop(name, None)
        self.loads.pop(name, None)
        self.leaving.discard(name)
        self.recent.pop(name, None)
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self.clear(slot)

    def is_known(self, name: str) -> bool:
        return name in self.known and name not in self.leaving
