"""Verification of drafts: which positions of a step sample, and which drafts the target's samples keep.

A sampling row with d drafts (ScheduledRequest.draft_token_ids) covers the chunk's last d + 1 positions: the
logits at its last known token and at each draft give the target's token for the position after it. The target
samples every one of those positions as decoding would, each with the tokens before it (the drafts up to it) as
its history; the row then keeps its drafts while they equal the target's samples, and the target's sample at the
first difference (or after the last draft). Every kept token is the target's own sample at its position, so the
run is what d + 1 steps of plain decoding would have produced as far as it goes.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_server.core.scheduler_output import ScheduledRequest


def sampled_positions(items: Sequence[ScheduledRequest], last_rows: Sequence[int]) -> list[int]:
    """The rows of the step's hidden states to sample, in order: per sampling item (`last_rows[i]` is the row of
    `items[i]`'s last token), its last row, preceded by the rows of its drafts."""
    rows: list[int] = []
    for item, last in zip(items, last_rows, strict=True):
        if item.needs_sample:
            rows.extend(range(last - len(item.draft_token_ids), last + 1))
    return rows


def num_sampled_positions(items: Sequence[ScheduledRequest]) -> int:
    """How many positions `sampled_positions` gives for these sampling items."""
    return sum(len(item.draft_token_ids) + 1 for item in items)


def accepted_run(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a row keeps: `sampled` (the target's token at each of the row's len(drafts) + 1 positions) up to
    and including the first position where it differs from the draft (all of it when every draft matches)."""
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return list(sampled[: j + 1])
    return list(sampled[: len(drafts) + 1])


def split_runs(items: Sequence[ScheduledRequest], tokens: Sequence[int]) -> list[list[int]]:
    """Per sampling item, its accepted run from the step's sampled tokens (in `sampled_positions` order)."""
    runs: list[list[int]] = []
    row = 0
    for item in items:
        drafts = item.draft_token_ids
        runs.append(accepted_run(drafts, tokens[row : row + len(drafts) + 1]))
        row += len(drafts) + 1
    if row != len(tokens):
        raise ValueError(f"{len(tokens)} sampled tokens for {row} verification positions")
    return runs
