"""A decode step's per-row layout, kept from one decode step to the next and updated by what changed.

In a steady decode batch every row is the same request as in the step before, one token further on, and its
block table has at most grown by a block at its end (the KV cache manager only ever appends to a held table).
Rebuilding the padded block tables from every request's list each step costs host time in proportion to the
batch and its context; here a step that continues the previous decode step reuses the previous layout: the
lengths and slots come from array arithmetic and only the rows that crossed into a new block (about one in
`block_size`) read their table. Anything else — another set or order of requests, a table that is not the
same live list (a request freed and given new blocks), a row that did not advance by exactly one token —
rebuilds the layout from the rows, as `DecodeLayout.build` does.

`continues` also tells the runner whether the step's input tokens are exactly the tokens the previous launch
sampled, row for row (`mark_launched` records whether every row of that launch sampled): then it feeds them
from that launch's device tensor and reads no token from the requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine_server.attention_metadata import DecodeLayout
from engine_server.core.request import Request
from engine_server.core.scheduler_output import ScheduledRequest


class DecodeRows:
    """The last decode step's layout and the rows it was built from. Not thread-safe: the runner owns it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._layout: DecodeLayout | None = None
        self._requests: list[Request] = []
        self._tables: list[list[int]] = []
        self._num_blocks: np.ndarray[Any, np.dtype[np.int64]] = np.zeros(0, dtype=np.int64)  # filled per row
        self._all_sampled = False  # every row of the launch that used the layout sampled

    def invalidate(self) -> None:
        """Forget the layout: the next decode step rebuilds it (call after any step that is not all decode)."""
        self._layout = None
        self._all_sampled = False

    def mark_launched(self, all_sampled: bool) -> None:
        """Record, once a step is launched, whether every one of its rows sampled a token (the next `layout`
        reads it, and forgets it: a step launched without this call never counts as fully sampled)."""
        self._all_sampled = all_sampled

    def layout(self, scheduled: Sequence[ScheduledRequest]) -> tuple[DecodeLayout, bool]:
        """The layout of a decode step (every row one new token) and whether the step continues the previous
        decode step with the tokens it sampled: same requests in the same order, each one token further.

        The returned layout's arrays are the kept ones: valid until the next call, not to be modified.
        ValueError (as `DecodeLayout.build`) when a row's table is too short for its token.
        """
        requests = [item.request for item in scheduled]
        tables = [item.block_ids for item in scheduled]
        starts = np.fromiter([item.start_position for item in scheduled], dtype=np.int64, count=len(scheduled))
        return self.layout_columns(requests, tables, starts)

    def layout_columns(
        self, requests: list[Request], tables: list[list[int]], starts: np.ndarray[Any, np.dtype[np.int64]]
    ) -> tuple[DecodeLayout, bool]:
        """`layout` of the rows given as columns (a steady decode step's): each row's request, live block table and
        start position. The lists are kept until the next call and must not change meanwhile."""
        previous = self._layout
        # List equality tests identity first: the live tables compare in O(1) each.
        if (
            previous is None
            or requests != self._requests
            or tables != self._tables
            or not np.array_equal(starts, previous.seq_lens)
        ):
            return self._rebuild(requests, tables, starts + 1), False
        continues, self._all_sampled = self._all_sampled, False  # until this step's launch is marked
        return self._advance(previous, tables, starts + 1), continues

    def _rebuild(
        self, requests: list[Request], tables: list[list[int]], lens: np.ndarray[Any, np.dtype[np.int64]]
    ) -> DecodeLayout:
        layout = DecodeLayout.build(lens, tables, self.block_size)
        self._layout, self._requests, self._tables = layout, requests, tables
        self._num_blocks = (lens + self.block_size - 1) // self.block_size
        self._all_sampled = False
        return layout

    def _advance(
        self, previous: DecodeLayout, tables: list[list[int]], lens: np.ndarray[Any, np.dtype[np.int64]]
    ) -> DecodeLayout:
        size = self.block_size
        needed = (lens + size - 1) // size
        block_tables = previous.block_tables
        width = int(needed.max(initial=1))
        if width > block_tables.shape[1]:
            wider = np.full((len(lens), width), -1, dtype=np.int32)
            wider[:, : block_tables.shape[1]] = block_tables
            block_tables = wider
        grown = np.flatnonzero(needed > self._num_blocks)
        if len(grown):
            starts, ends = self._num_blocks[grown], needed[grown]
            if bool((ends - starts == 1).all()):  # a decode grows by one block at most: one fancy-index write
                rows, columns = grown.tolist(), starts.tolist()
                try:
                    block_tables[grown, starts] = [tables[r][c] for r, c in zip(rows, columns, strict=True)]
                except IndexError:
                    row = next(r for r, c in zip(rows, columns, strict=True) if len(tables[r]) <= c)
                    raise _too_short(row, lens) from None
            else:
                for row, start, end in zip(grown.tolist(), starts.tolist(), ends.tolist(), strict=True):
                    table = tables[row]
                    if len(table) < end:
                        raise _too_short(row, lens)
                    block_tables[row, start:end] = table[start:end]
        self._num_blocks = np.maximum(self._num_blocks, needed)
        positions = lens - 1
        slots = block_tables[np.arange(len(lens)), positions // size].astype(np.int64) * size + positions % size
        layout = DecodeLayout(lens, block_tables, slots)
        self._layout = layout
        return layout


def _too_short(row: int, lens: np.ndarray[Any, np.dtype[np.int64]]) -> ValueError:
    return ValueError(f"block table of sequence {row} is too short for {int(lens[row])} tokens")
