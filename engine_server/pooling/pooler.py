"""`Pooler`: the runner's side of pooling — each pooling request's vector from the hidden states of its chunks.

A pooling request runs as a prefill that samples nothing; its prompt may be split over several steps (chunked
prefill), so the pooler keeps what a method needs between chunks (the running sum for mean, the first token's
state for cls) and hands out the vector at the chunk that ends the prompt. A chunk that starts at position 0
starts over (a preempted request recomputes from the beginning). Sums run in float32 whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from engine_server.core.scheduler_output import ScheduledRequest
from engine_server.pooling.params import PoolingMethod, PoolingParams


class Pooler:
    """Pools the pooling rows of the runner's steps. Not thread-safe: the runner's step loop owns it."""

    def __init__(self, classify: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`classify`: a cross-encoder's scores `[N]` of pooled states `[N, hidden]` (`PoolingParams.classify`)."""
        self._partial: dict[str, torch.Tensor] = {}  # request id -> float32 sum (mean) or first state (cls)
        self._classify = classify

    def pool(
        self, items: Sequence[ScheduledRequest], hidden: torch.Tensor, last_rows: Sequence[int] | None
    ) -> dict[str, torch.Tensor]:
        """The vectors of the pooling requests whose prompt this step ends, by request id (1-D float32 tensors on
        `hidden`'s device), after taking in every pooling chunk of the step.

        `hidden` is the step's final hidden states `[T, hidden]`; `last_rows[i]` is the row of item i's last token
        (None: row i, a step of one-token chunks).
        """
        pooled: dict[str, torch.Tensor] = {}
        for i, item in enumerate(items):
            request = item.request
            params = request.pooling
            if params is None:
                continue
            last = last_rows[i] if last_rows is not None else i
            first = last - item.num_new_tokens + 1
            ends = item.start_position + item.num_new_tokens == request.num_prompt_tokens
            request_id = request.request_id
            if params.method is PoolingMethod.LAST:
                if ends:
                    pooled[request_id] = self._finish(hidden[last].float(), params)
                continue
            if params.method is PoolingMethod.MEAN:
                chunk_sum = hidden[first : last + 1].float().sum(dim=0)
                earlier = None if item.start_position == 0 else self._partial.get(request_id)
                self._partial[request_id] = chunk_sum if earlier is None else earlier + chunk_sum
            elif item.start_position == 0:  # cls: the first token's state
                self._partial[request_id] = hidden[first].float()
            if ends:
                state = self._partial.pop(request_id)
                if params.method is PoolingMethod.MEAN:
                    state = state / request.num_prompt_tokens
                pooled[request_id] = self._finish(state, params)
        return pooled

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's partial state."""
        self._partial.pop(request_id, None)

    def _finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """A cross-encoder's score (one value) of the state; else the state truncated to the requested dimensions,
        then L2-normalized if asked (as sentence-transformers' Normalize)."""
        if params.classify:
            if self._classify is None:
                raise RuntimeError("a pair to classify, but the model has no classifier")
            return self._classify(vector[None])
        return _truncate_and_normalize(vector, params)


def _truncate_and_normalize(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = F.normalize(vector, p=2.0, dim=0)
    return vector
