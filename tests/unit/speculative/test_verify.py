"""Which drafts verification keeps (engine_server.speculative.verify)."""

from __future__ import annotations

import pytest

from engine_server.core.scheduler_output import ScheduledRequest
from engine_server.speculative.verify import accepted_run, num_sampled_positions, sampled_positions, split_runs
from tests.unit.factories import make_request


def item(drafts: tuple[int, ...], needs_sample: bool = True) -> ScheduledRequest:
    request = make_request("r", 4)
    return ScheduledRequest(request, 3, 1 + len(drafts), [0], needs_sample, 0, drafts)


@pytest.mark.parametrize(
    ("drafts", "sampled", "run"),
    [
        ((5, 6, 7), (5, 6, 7, 8), [5, 6, 7, 8]),  # every draft kept, plus the token after the last
        ((5, 6, 7), (5, 9, 7, 8), [5, 9]),  # the first difference is the target's token, and the end
        ((5, 6, 7), (1, 6, 7, 8), [1]),
        ((), (4,), [4]),
    ],
)
def test_accepted_run(drafts: tuple[int, ...], sampled: tuple[int, ...], run: list[int]) -> None:
    assert accepted_run(drafts, sampled) == run


def test_sampled_positions_cover_each_rows_drafts_then_its_last_token() -> None:
    items = [item((1, 2)), item((), needs_sample=False), item(())]
    assert sampled_positions(items, [5, 9, 12]) == [3, 4, 5, 12]
    sampling = [items[0], items[2]]
    assert num_sampled_positions(sampling) == 4
    assert split_runs(sampling, [1, 7, 0, 4]) == [[1, 7], [4]]
    with pytest.raises(ValueError):
        split_runs(sampling, [1, 7, 0])
