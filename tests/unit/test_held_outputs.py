"""HeldOutputs: a choice's outputs merged until it finishes, then handed over once, tokens in step order."""

from __future__ import annotations

from engine_server.core.engine_core import CoreOutput, HeldOutputs
from engine_server.core.request import RequestStatus
from engine_server.model_runner import SampledToken


def step(request_id: str, token: int, status: RequestStatus | None = None, cached: int = 0) -> CoreOutput:
    return CoreOutput(request_id, [SampledToken(token)], status=status, stop_token_id=None, num_cached_tokens=cached)


def test_outputs_are_merged_until_the_finish() -> None:
    held = HeldOutputs()
    assert held.add(step("a-0", 1, cached=16)) is None
    assert held.add(step("b-0", 7)) is None
    assert held.add(step("a-0", 2)) is None
    merged = held.add(step("a-0", 3, RequestStatus.FINISHED_LENGTH))
    assert merged is not None and [t.token_id for t in merged.new_tokens] == [1, 2, 3]
    assert merged.status is RequestStatus.FINISHED_LENGTH and merged.num_cached_tokens == 16
    assert held.add(step("a-0", 9)) is None  # a new request of the same id starts from nothing
    again = held.add(CoreOutput("a-0", [], status=RequestStatus.FINISHED_ABORTED))
    assert again is not None and [t.token_id for t in again.new_tokens] == [9]


def test_a_finish_without_earlier_steps_passes_through_and_drop_forgets() -> None:
    held = HeldOutputs()
    done = step("x-0", 5, RequestStatus.FINISHED_STOPPED)
    assert held.add(done) is done
    held.add(step("y-0", 1))
    held.drop(["y-0"])
    merged = held.add(step("y-0", 2, RequestStatus.FINISHED_LENGTH))
    assert merged is not None and [t.token_id for t in merged.new_tokens] == [2]
