"""Which row of the linear-attention layers' state tensors each running request holds (`layers.gated_deltanet`).

A model with linear attention keeps a fixed-size state per running sequence instead of K/V blocks. There are as many
slots as running seats (`max_num_seqs`), so a request admitted to run always finds one; it holds it until it
finishes or is preempted (a preempted request recomputes from its first token, so from a zero state, in whichever
slot it gets next).
"""

from __future__ import annotations


class StateSlots:
    """Free slots, lowest first. Owned by the scheduler (its thread only)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    def acquire(self) -> int:
        """A free slot; RuntimeError when every slot is held (more running requests than seats)."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are held: more requests run than max_num_seqs")
        return self._free.pop()

    def release(self, slot: int) -> None:
        """`slot`'s request no longer runs."""
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)
