"""Which LoRA adapter each slot holds, as the scheduler assigns them (engine_server.lora.slots holds the weights).

A running request of an adapter holds its adapter's slot; a slot no running request holds may be given to another
adapter, the least recently used first. So a step never needs more adapters than there are slots, and a request
whose adapter finds no slot waits in its queue (`acquire` returns None) until one is let go. Each assignment of a
slot to another adapter is recorded as a load the runner performs before the step that first runs it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_server.lora.peft_format import LoraAdapter


class AdapterSlots:
    """Slot assignment and per-slot holder counts. Owned by the scheduler (its thread only)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._key_of: list[str | None] = [None] * num_slots
        self._slot_of: dict[str, int] = {}
        self._holders = [0] * num_slots
        self._idle: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(num_slots))  # LRU first
        self._loads: list[tuple[int, LoraAdapter]] = []

    def acquire(self, adapter: LoraAdapter) -> int | None:
        """A slot holding `adapter` for one more running request, or None when every slot is held by others."""
        slot = self._slot_of.get(adapter.key)
        if slot is None:
            if not self._idle:
                return None
            slot = next(iter(self._idle))  # least recently used of the slots no request holds
            old = self._key_of[slot]
            if old is not None:
                del self._slot_of[old]
            self._key_of[slot] = adapter.key
            self._slot_of[adapter.key] = slot
            self._loads.append((slot, adapter))
        self._holders[slot] += 1
        self._idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        """One holder of `slot` no longer runs (finished, preempted or put back in its queue)."""
        self._holders[slot] -= 1
        if self._holders[slot] == 0:
            self._idle[slot] = None  # most recently used: the last to be given away

    def take_loads(self) -> list[tuple[int, LoraAdapter]]:
        """The assignments since the last call, in order: the runner writes each adapter into its slot."""
        loads, self._loads = self._loads, []
        return loads
