"""Snapshots of linear-attention states at block boundaries, so that a hybrid model (Qwen3.5, Qwen3-Next) serves
prefixes from the cache (`layers.gated_deltanet`).

A linear-attention layer keeps one state per sequence for its whole prefix, not a K/V row per token, so cached KV
blocks are of use only with the layers' states at their end. The scheduler ends a prompt's prefill chunk at the
prompt's last block boundary before its last token (`Scheduler`'s snapshot point) and has that step copy the
sequence's states there into a snapshot row, keyed by the hash of the block that ends there (which chains the whole
prefix: `kv_cache_manager.hash_block`). A later request whose cached blocks reach such a boundary starts from that
snapshot, copied into its own slot, and computes only what follows: the next turn of a chat, a different question
after a shared system prompt or document, or the same prompt's last tokens again.

The snapshot rows follow the running slots in each layer's state tensor (`[slots + snapshots, state_size]`). When
every row is taken the least recently used one is overwritten; a snapshot whose blocks were evicted is simply never
found (a hit is the longest cached prefix that ends at a snapshot). Owned by the scheduler (its thread only).
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    """Snapshot rows `[first_row, first_row + count)` by the hash of the block their states end at."""

    def __init__(self, first_row: int, count: int) -> None:
        if count <= 0:
            raise ValueError(f"a snapshot store needs rows, got {count}")
        self.first_row, self.count = first_row, count
        self._rows: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free: list[int] = []  # popped from the end: lowest first
        self._step: dict[bytes, int] = {}  # reserved since `begin_step`: written by that step, after its forward
        self.clear()

    def __len__(self) -> int:
        return len(self._rows)

    def begin_step(self) -> None:
        """Start a step's record of reservations (the scheduler calls it as each step's scheduling begins)."""
        self._step.clear()

    def find(self, block_hash: bytes) -> int | None:
        """The row holding the states at the end of the block `block_hash`, now the most recently used; None when
        there is none, or it is written only by the step being scheduled (its copy comes after that step's
        forward, a restore before it)."""
        row = self._rows.get(block_hash)
        if row is None or block_hash in self._step:
            return None
        self._rows.move_to_end(block_hash)
        return row

    def reserve(self, block_hash: bytes) -> int | None:
        """A row for the states at the end of the block `block_hash`, which the step being scheduled writes: a free
        one, else the least recently used one's; None when a row holds (or this step writes) them already."""
        if block_hash in self._rows:
            self._rows.move_to_end(block_hash)
            return None
        row = self._free.pop() if self._free else self._rows.popitem(last=False)[1]
        self._rows[block_hash] = self._step[block_hash] = row
        return row

    def undo(self) -> None:
        """Forget the rows reserved since `begin_step`, whose step never ran (those they displaced stay lost)."""
        for block_hash, row in self._step.items():
            if self._rows.pop(block_hash, None) is not None:
                self._free.append(row)
        self._step.clear()

    def clear(self) -> None:
        """Forget every snapshot (as the prefix cache is reset)."""
        self._rows.clear()
        self._step.clear()
        self._free = list(range(self.first_row + self.count - 1, self.first_row - 1, -1))
