"""Value types of output processing: why a choice finished and what one processing step produced."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a choice stopped; the values are OpenAI's `finish_reason` strings."""

    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled by the caller or the engine
    TOOL_CALLS = "tool_calls"  # set by the tool-call parser, never by the output processor


@dataclass(frozen=True)
class ChoiceDelta:
    """What one `OutputProcessor.process` call adds to a choice.

    text: newly stable text (never a partial character, never any part of a matched stop string unless
        include_stop_str_in_output). token_ids: the tokens consumed by this call; when a stop string
        matched, only those up to and including the one that completed it. finished: the choice is over
        (no later delta carries text). matched_stop: the stop string, or the stop token id, that ended it.
    abort_core: the core is still generating this request and the caller must abort it there.
    """

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    matched_stop: str | int | None
    abort_core: bool
