"""Grammar state during decoding: one xgrammar matcher per constrained request, token bitmasks, accepts.

Owned by the model runner and used only from the step loop. A request's matcher is created the first time
the request samples and advances only on tokens the request actually sampled, so preemption by recompute
(which re-runs the prompt and outputs without sampling) leaves it exactly where it was. `release` drops it
when the request finishes or is aborted.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np
import structlog
import torch
import xgrammar as xgr

from engine_server.core.request import Request

log = structlog.get_logger(__name__)


class GrammarState(enum.Enum):
    """Where a request's grammar stands after it accepted a sampled token."""

    OPEN = "open"  # more tokens may (or must) follow
    COMPLETE = "complete"  # the output is a full sentence and only a stop token may follow: end it now
    TERMINATED = "terminated"  # the token was a stop token the grammar accepted after a full sentence
    REJECTED = "rejected"  # the token broke the grammar (it cannot happen under the bitmask; reported)


class GrammarMatchers:
    """Per-request matchers and the bitmasks that keep each constrained request inside its grammar."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._width = xgr.get_bitmask_shape(1, vocab_size)[1]
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._filler = xgr.BatchGrammarMatcher()
        self._host = self._allocate(8)  # grown on demand; reused every step
        self._scratch = xgr.allocate_token_bitmask(1, vocab_size)
        self._non_stop: dict[tuple[int, ...], torch.Tensor] = {}  # stop ids -> mask of every other token

    def __len__(self) -> int:
        return len(self._matchers)

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's matcher. Unknown ids are ignored."""
        self._matchers.pop(request_id, None)

    def bitmasks(self, requests: Sequence[Request]) -> list[torch.Tensor | None]:
        """Per request, its allowed-token bitmask for the next token ([ceil(V/32)] int32 on the device, bit 1 =
        allowed), or None when it has no grammar. Fills every row with one batched xgrammar call and copies
        them to the device at once. The tensors are views valid until the next call."""
        picked = [i for i, r in enumerate(requests) if r.grammar is not None]
        result: list[torch.Tensor | None] = [None] * len(requests)
        if not picked:
            return result
        matchers = [self._matcher(requests[i]) for i in picked]
        if self._host.shape[0] < len(picked):
            self._host = self._allocate(max(len(picked), 2 * self._host.shape[0]))
        host = self._host[: len(picked)]
        self._filler.batch_fill_next_token_bitmask(matchers, host)
        device = host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host
        for row, i in enumerate(picked):
            result[i] = device[row]
        return result

    def draft_bitmasks(self, request: Request, drafts: Sequence[int]) -> list[torch.Tensor]:
        """The request's masks for the len(drafts) + 1 positions a step verifies (speculative decoding): the mask
        of each position after the drafts before it. The matcher walks the drafts and is rolled back, so it stands
        where it was; from the first draft its grammar refuses (which verification cannot keep: the target's
        token there is another) the masks repeat the last one. Fresh tensors on the device."""
        matcher = self._matcher(request)
        host = xgr.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        walked = 0
        for j in range(len(drafts) + 1):
            live = j == walked and not (j and matcher.is_terminated())
            if live:
                matcher.fill_next_token_bitmask(host, j)
            else:
                host[j] = host[j - 1]
            if live and j < len(drafts) and matcher.accept_token(drafts[j]):
                walked += 1
        if walked:
            matcher.rollback(walked)
        device = host.to(self.device) if self.device.type != "cpu" else host
        return list(device)

    def accept(self, request_id: str, token_id: int) -> GrammarState:
        """Advance the request's matcher by its sampled token; says whether the grammar ends the choice."""
        matcher = self._matchers[request_id]
        if not matcher.accept_token(token_id):
            log.error("sampled token outside its grammar", request_id=request_id, token_id=token_id)
            return GrammarState.REJECTED
        if matcher.is_terminated():
            return GrammarState.TERMINATED
        if matcher.is_completed() and self._only_stop_allowed(matcher):
            return GrammarState.COMPLETE
        return GrammarState.OPEN

    def _matcher(self, request: Request) -> xgr.GrammarMatcher:
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            assert request.grammar is not None
            matcher = xgr.GrammarMatcher(request.grammar.grammar)
            self._matchers[request.request_id] = matcher
        return matcher

    def _only_stop_allowed(self, matcher: xgr.GrammarMatcher) -> bool:
        """Whether the next token can only be a stop token: the sentence cannot grow any more, so the choice
        ends here instead of spending one more forward pass on sampling eos."""
        matcher.fill_next_token_bitmask(self._scratch, 0)
        stops = tuple(matcher.stop_token_ids)
        non_stop = self._non_stop.get(stops)
        if non_stop is None:
            non_stop = self._non_stop[stops] = _mask_without(stops, self._width)
        return not bool((self._scratch[0] & non_stop).any())

    def _allocate(self, rows: int) -> torch.Tensor:
        host = xgr.allocate_token_bitmask(rows, self.vocab_size)
        # Pinned on CUDA so the per-step copy overlaps the forward pass instead of waiting for it.
        return host.pin_memory() if self.device.type == "cuda" else host


def _mask_without(token_ids: Sequence[int], width: int) -> torch.Tensor:
    """A [width] int32 bitmask with every bit set except those of `token_ids`."""
    words = np.full(width, 0xFFFFFFFF, dtype=np.uint32)
    for token_id in token_ids:
        if 0 <= token_id < width * 32:
            words[token_id // 32] &= ~np.uint32(1 << (token_id % 32))
    return torch.from_numpy(words.view(np.int32))
