"""The decode layout kept from step to step (`engine_server.decode_rows`) against one built from scratch."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine_server.attention_metadata import DecodeLayout
from engine_server.core.scheduler_output import ScheduledRequest
from engine_server.decode_rows import DecodeRows
from tests.unit.factories import make_request

BS = 4


class Rows:
    """Decode rows as the scheduler hands them out: live tables that only grow, positions that advance."""

    def __init__(self, count: int, rng: random.Random) -> None:
        self.rng = rng
        self.next_block = 0
        self.requests = [make_request(f"r{i}", 3) for i in range(count)]
        self.positions = [rng.randrange(2, 30) for _ in range(count)]
        self.tables = [self.blocks(-(-(p + 1) // BS)) for p in self.positions]

    def blocks(self, count: int) -> list[int]:
        self.next_block += count
        return list(range(self.next_block - count, self.next_block))

    def advance(self) -> None:
        for i, table in enumerate(self.tables):
            self.positions[i] += 1
            while len(table) * BS < self.positions[i] + 1:
                table.extend(self.blocks(1))  # in place: the live list grows

    def scheduled(self) -> list[ScheduledRequest]:
        return [
            ScheduledRequest(request, position, 1, table, True)
            for request, position, table in zip(self.requests, self.positions, self.tables, strict=True)
        ]


def check(layout: DecodeLayout, scheduled: list[ScheduledRequest]) -> None:
    expected = DecodeLayout.build([i.start_position + 1 for i in scheduled], [i.block_ids for i in scheduled], BS)
    np.testing.assert_array_equal(layout.seq_lens, expected.seq_lens)
    np.testing.assert_array_equal(layout.slots, expected.slots)
    for row, item in enumerate(scheduled):  # every block a row's tokens use; columns beyond them are not read
        used = -(-(item.start_position + 1) // BS)
        assert layout.block_tables[row, :used].tolist() == item.block_ids[:used]


def test_a_steady_batch_continues_and_matches_a_fresh_build_as_rows_cross_blocks() -> None:
    rows, kept = Rows(9, random.Random(0)), DecodeRows(BS)
    layout, continues = kept.layout(rows.scheduled())
    check(layout, rows.scheduled())
    assert not continues  # nothing before it
    for step in range(3 * BS + 2):
        kept.mark_launched(all_sampled=True)
        rows.advance()
        layout, continues = kept.layout(rows.scheduled())
        check(layout, rows.scheduled())
        assert continues, step


@pytest.mark.parametrize("change", ["reordered", "one_fewer", "new_table", "not_advanced", "skipped", "not_sampled"])
def test_anything_but_the_same_rows_one_token_on_rebuilds_and_does_not_continue(change: str) -> None:
    rows, kept = Rows(6, random.Random(1)), DecodeRows(BS)
    kept.layout(rows.scheduled())
    kept.mark_launched(all_sampled=change != "not_sampled")
    rows.advance()
    if change == "reordered":
        rows.requests.reverse(), rows.positions.reverse(), rows.tables.reverse()
    elif change == "one_fewer":
        del rows.requests[2], rows.positions[2], rows.tables[2]
    elif change == "new_table":
        # Preempted and readmitted between two decode steps with every token but one from the prefix cache:
        # the same request at the same position, with other blocks in a new list.
        rows.tables[3] = rows.blocks(len(rows.tables[3]))
    elif change == "not_advanced":
        rows.positions[0] -= 1
    elif change == "skipped":
        rows.positions[4] += 1
        rows.tables[4].extend(rows.blocks(1))
    layout, continues = kept.layout(rows.scheduled())
    check(layout, rows.scheduled())
    assert not continues
    kept.mark_launched(all_sampled=True)
    rows.advance()
    layout, continues = kept.layout(rows.scheduled())  # and from the rebuilt layout it goes on again
    check(layout, rows.scheduled())
    assert continues


def test_a_step_launched_without_being_marked_never_continues() -> None:
    """A decode step in which no row sampled returns before the runner marks it: the next one must not read
    that launch's tokens (there are none)."""
    rows, kept = Rows(3, random.Random(2)), DecodeRows(BS)
    kept.layout(rows.scheduled())
    kept.mark_launched(all_sampled=True)
    rows.advance()
    assert kept.layout(rows.scheduled())[1]
    rows.advance()  # launched, not marked
    assert not kept.layout(rows.scheduled())[1]


def test_an_invalidated_layout_is_rebuilt_and_a_short_table_is_refused() -> None:
    rows, kept = Rows(4, random.Random(3)), DecodeRows(BS)
    kept.layout(rows.scheduled())
    kept.mark_launched(all_sampled=True)
    kept.invalidate()  # a prefill step ran in between
    rows.advance()
    layout, continues = kept.layout(rows.scheduled())
    check(layout, rows.scheduled())
    assert not continues
    with pytest.raises(ValueError, match="too short"):  # on the kept path: one token on, but no block given
        for _ in range(BS):
            rows.positions = [position + 1 for position in rows.positions]
            kept.layout(rows.scheduled())
    with pytest.raises(ValueError, match="too short"):  # and on a rebuild
        DecodeRows(BS).layout(rows.scheduled())
