"""What one scheduler step hands to the model runner, as typed frozen records.

The runner reads, for each scheduled request, the token ids
`request.all_token_ids[start_position : start_position + num_new_tokens]` at those positions, writes
their K/V into `block_ids`, attends over positions `[0, start_position + num_new_tokens)`, and samples one
token only where `needs_sample` is set. The scheduler has already advanced `request.num_computed_tokens`
to `start_position + num_new_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_server.core.request import Request

if TYPE_CHECKING:
    from engine_server.lora.peft_format import LoraAdapter


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: a contiguous chunk of its not yet computed tokens. Read-only once built.

    Not frozen: a frozen dataclass sets each field through `object.__setattr__`, and one of these is built per
    running request per step.
    """

    request: Request
    start_position: int  # num_computed_tokens before this step: the position of the chunk's first token
    num_new_tokens: int  # chunk length, >= 1; 1 for a decode
    # The request's live block table (owned by the KV cache manager; read-only). Covers at least
    # ceil((start_position + num_new_tokens) / block_size) blocks; entries never change while the
    # request holds them, later steps only append.
    block_ids: list[int]
    # The chunk ends at request.num_tokens (and its drafts), so its last position yields a token; never for a pooling
    # request (`request.pooling`), whose last chunk the runner pools instead.
    needs_sample: bool
    num_cached_tokens: int = 0  # tokens served from the prefix cache when admitted this step (else 0)
    # Speculative decoding: tokens proposed to follow the request's last one, verified this step. The chunk is then
    # the last token plus these (num_new_tokens == 1 + len(draft_token_ids)), every position of it samples, and
    # the update keeps the drafts that equal the target's samples (engine_server.speculative).
    draft_token_ids: tuple[int, ...] = ()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_prefill(self) -> bool:
        """True unless this is a decode (one token, with any drafts to verify) after the whole prompt was computed."""
        return (
            self.num_new_tokens - len(self.draft_token_ids) > 1 or self.start_position < self.request.num_prompt_tokens
        )


@dataclass(slots=True)
class SteadyDecode:
    """A steady decode step in columns: every running request, in rank order, decodes one token and samples it.

    The scheduler hands a step over in this form when it continues the step before with the same requests
    (`engine_server.core.scheduler`: its steady record), so that neither it nor the runner nor the engine core
    builds an object per row: row i is `ScheduledRequest(requests[i], starts[i], 1, tables[i], True)`.
    The lists are the scheduler's own, shared by every step of the streak (read-only); `starts` is this step's.
    """

    requests: list[Request]
    tables: list[list[int]]  # each request's live block table (as `ScheduledRequest.block_ids`)
    starts: np.ndarray[Any, np.dtype[np.int64]]  # each row's start position (its token's position)
    all_argmax_only: bool  # every row's request is `argmax_only`
    any_output_history: bool  # some row's request `needs_output_history`
    any_interactive: bool  # some row is INTERACTIVE
    all_final_quiet: bool  # every row's request is `final_only` without log-probabilities: no output per step
    stop_ids: frozenset[int]  # the union of the rows' eos and stop token ids: a token outside it stops no row
    # Rows whose token of this step ends them by length (max_tokens or max_model_len), unless a stop token does first.
    length_end_rows: list[int] = field(default_factory=list)
    finish_epoch: int = 0  # the scheduler's count of finished requests when it scheduled the step

    def rows(self) -> list[ScheduledRequest]:
        """The step's rows as `ScheduledRequest`s (built on demand: the hot path reads the columns)."""
        starts = self.starts.tolist()
        return [
            ScheduledRequest(request, start, 1, table, True)
            for request, start, table in zip(self.requests, starts, self.tables, strict=True)
        ]


@dataclass(frozen=True)
class StateCopies:
    """Rows of the linear-attention layers' state tensors a step copies (`core.state_snapshots`), as (source rows,
    destination rows): `restores` before the step's update of the states (a prefix's snapshot into the slot of the
    request that starts from it), `saves` after it (a slot that reached a prompt's snapshot point into its row)."""

    restores: tuple[list[int], list[int]]
    saves: tuple[list[int], list[int]]


class SchedulerOutput:
    """The batch for one engine step, in the order the runner should lay it out. Read-only once built.

    `scheduled` is the step's rows; for a steady decode step (`steady` set) it is built from the columns on
    first use, so a consumer on the hot path reads `steady` instead.
    """

    __slots__ = (
        "_scheduled",
        "finished",
        "has_pooling",
        "lora_loads",
        "num_batched_tokens",
        "num_decode_rows",
        "num_draft_tokens",
        "num_prefill_tokens",
        "num_running_rows",
        "preempted_ids",
        "reads_prompts",
        "state_copies",
        "steady",
    )

    def __init__(
        self,
        scheduled: list[ScheduledRequest] | None = None,
        *,
        steady: SteadyDecode | None = None,
        lora_loads: list[tuple[int, LoraAdapter]] | None = None,
        num_batched_tokens: int = 0,
        preempted_ids: list[str] | None = None,
        finished: list[Request] | None = None,
        num_decode_rows: int = 0,
        num_prefill_tokens: int = 0,
        num_draft_tokens: int = 0,
        num_running_rows: int = 0,
        has_pooling: bool = False,
        reads_prompts: bool = False,
        state_copies: StateCopies | None = None,
    ) -> None:
        if steady is not None and scheduled is not None:
            raise ValueError("a steady step's rows come from its columns")
        self._scheduled = scheduled if scheduled is not None or steady is not None else []
        self.steady = steady
        # LoRA slots the scheduler gave to other adapters for this step: the runner writes each (slot, adapter)
        # into its slot, in order, before the forward pass (engine_server.core.adapter_slots).
        self.lora_loads = lora_loads or []
        self.num_batched_tokens = num_batched_tokens  # sum of num_new_tokens; <= max_num_batched_tokens
        self.preempted_ids = preempted_ids if preempted_ids is not None else []  # lost their blocks; will recompute
        # Requests that ended inside schedule() without running (e.g. deadline passed in the queue).
        self.finished = finished if finished is not None else []
        self.num_decode_rows = num_decode_rows  # scheduled requests that are not `is_prefill`
        # num_batched_tokens - num_decode_rows: tokens of the other scheduled requests, and the decodes' drafts
        self.num_prefill_tokens = num_prefill_tokens
        self.num_draft_tokens = num_draft_tokens  # draft tokens of the step (speculative decoding), for metrics
        # `scheduled[:num_running_rows]` were running before the step; the rest it admitted from the queues.
        self.num_running_rows = num_running_rows
        # Some row may be a pooling request's (engine_server.pooling): False spares the runner a look at every row.
        self.has_pooling = has_pooling
        # Some row may want its prompt's logprobs (`Request.prompt_logprobs`): False spares the runner that look too.
        self.reads_prompts = reads_prompts
        # A hybrid model's state rows the step copies (engine_server.core.state_snapshots); None: none.
        self.state_copies = state_copies

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        if self._scheduled is None:
            assert self.steady is not None
            self._scheduled = self.steady.rows()
        return self._scheduled

    @property
    def num_rows(self) -> int:
        """len(scheduled), without building a steady step's rows."""
        return len(self.steady.requests) if self.steady is not None else len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner to do (there may still be `finished` requests to report)."""
        return self.num_rows == 0

    def __repr__(self) -> str:
        return (
            f"SchedulerOutput(rows={self.num_rows}, steady={self.steady is not None}, "
            f"tokens={self.num_batched_tokens}, preempted={self.preempted_ids}, finished={len(self.finished)})"
        )
