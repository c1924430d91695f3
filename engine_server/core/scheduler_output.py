"""What one scheduler step hands to the model runner, as typed frozen records.

The runner reads, for each scheduled request, the token ids
`request.all_token_ids[start_position : start_position + num_new_tokens]` at those positions, writes
their K/V into `block_ids`, attends over positions `[0, start_position + num_new_tokens)`, and samples one
token only where `needs_sample` is set. The scheduler has already advanced `request.num_computed_tokens`
to `start_position + num_new_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_server.core.request import Request


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
    needs_sample: bool  # the chunk ends at request.num_tokens (and its drafts), so its last position yields a token
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
            self.num_new_tokens - len(self.draft_token_ids) > 1
            or self.start_position < self.request.num_prompt_tokens
        )


@dataclass(frozen=True)
class SchedulerOutput:
    """The batch for one engine step, in the order the runner should lay it out."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0  # sum of num_new_tokens; <= max_num_batched_tokens
    preempted_ids: list[str] = field(default_factory=list)  # lost their blocks this step; will recompute
    # Requests that ended inside schedule() without running (e.g. deadline passed in the queue).
    finished: list[Request] = field(default_factory=list)

    num_decode_rows: int = 0  # scheduled requests that are not `is_prefill`
    # num_batched_tokens - num_decode_rows: tokens of the other scheduled requests, and the decodes' drafts
    num_prefill_tokens: int = 0
    num_draft_tokens: int = 0  # draft tokens of the step (speculative decoding), for metrics
    # `scheduled[:num_running_rows]` were running before the step; the rest it admitted from the queues.
    num_running_rows: int = 0

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner to do (there may still be `finished` requests to report)."""
        return not self.scheduled
