"""`StateSnapshots`: the rows of a hybrid's prefix snapshots (engine_server.core.state_snapshots), by the hash of the
block their states end at; the engine's use of them is tests/unit/test_hybrid_engines.py's."""

from __future__ import annotations

import pytest

from engine_server.core.state_snapshots import StateSnapshots


def test_rows_follow_the_running_slots_and_the_least_recently_used_is_overwritten() -> None:
    snapshots = StateSnapshots(first_row=8, count=2)
    assert [snapshots.reserve(b"a"), snapshots.reserve(b"b")] == [8, 9]
    snapshots.begin_step()
    assert snapshots.find(b"a") == 8  # now the most recently used: b goes first
    assert snapshots.reserve(b"a") is None  # held already: nothing to save
    assert snapshots.reserve(b"c") == 9
    assert snapshots.find(b"b") is None and len(snapshots) == 2
    snapshots.begin_step()
    assert (snapshots.find(b"a"), snapshots.find(b"c")) == (8, 9)


def test_a_snapshot_the_step_writes_is_not_found_in_it() -> None:
    """A save comes after its step's forward and a restore before it: a request admitted in the step that saves a
    prefix's states cannot start from them."""
    snapshots = StateSnapshots(first_row=0, count=4)
    row = snapshots.reserve(b"prefix")
    assert row == 0 and snapshots.find(b"prefix") is None
    snapshots.begin_step()
    assert snapshots.find(b"prefix") == 0


def test_undo_frees_the_steps_rows_and_clear_forgets_all() -> None:
    snapshots = StateSnapshots(first_row=4, count=2)
    snapshots.reserve(b"kept")
    snapshots.begin_step()
    snapshots.reserve(b"undone")
    snapshots.undo()
    assert len(snapshots) == 1 and snapshots.find(b"undone") is None
    assert snapshots.reserve(b"next") == 5  # the undone step's row is free again
    snapshots.clear()
    assert len(snapshots) == 0 and snapshots.find(b"kept") is None and snapshots.reserve(b"x") == 4
    with pytest.raises(ValueError, match="needs rows"):
        StateSnapshots(first_row=0, count=0)
