"""The engine core's side of speculative decoding: drafts for each step, and what the verified steps kept.

`EngineCore` calls `propose` before each schedule (drafts for every sequence that decodes next, as many as the
policy finds worth verifying: engine_server.speculative.policy), `observe` after each update of a step that
verified drafts, and `finish` for every request that ends. A draft model proposes inside the runner instead
(its drafts need the device): the speculator then only sizes each sequence's proposal and counts the outcome.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import structlog

from engine_server.config import SpeculativeConfig
from engine_server.core.request import Request
from engine_server.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine_server.speculative.policy import DraftPolicy
from engine_server.speculative.proposer import TokenProposer, make_token_proposer

log = structlog.get_logger(__name__)
LOG_EVERY_S = 10.0  # the speculation figures go to the engine log at most this often (and after the first step)


class SpeculationStats:
    """Counts since start: drafts proposed and kept, verified rows, and rows by how many drafts they kept."""

    def __init__(self, max_drafts: int) -> None:
        self.proposed_tokens = 0
        self.accepted_tokens = 0
        self.verified_rows = 0
        self.kept_histogram = [0] * (max_drafts + 1)  # [i]: rows that kept i drafts

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified row: the kept drafts plus the target's own token (1.0 means nothing was kept)."""
        return 1.0 + self.accepted_tokens / self.verified_rows if self.verified_rows else 0.0

    def add(self, num_drafts: int, num_kept: int) -> None:
        self.proposed_tokens += num_drafts
        self.accepted_tokens += num_kept
        self.verified_rows += 1
        self.kept_histogram[min(num_kept, len(self.kept_histogram) - 1)] += 1


class Speculator:
    """Drafts and their bookkeeping for one engine core. Not thread-safe: the core's thread owns it."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer: TokenProposer | None = make_token_proposer(config)
        self.policy = DraftPolicy(config.num_speculative_tokens, config.adaptive)
        self.stats = SpeculationStats(config.num_speculative_tokens)
        self._logged = (-math.inf, 0)  # (when, verified rows then): the first verified step is logged

    def admit(self, request: Request) -> None:
        """Mark a new request as one whose decoding is proposed for."""
        request.speculative = True

    def propose(self, running: Sequence[Request]) -> None:
        """Set `draft_token_ids` of every running request that decodes next (one token left to compute, none on
        the way); a draft model's requests get placeholders the runner replaces (`config.method`)."""
        threshold = self.policy.threshold(len(running))
        for request in running:
            if request.num_pending_tokens or request.num_tokens - request.num_computed_tokens != 1:
                if request.draft_token_ids:
                    request.draft_token_ids = []
                continue
            # A run yields up to depth + 1 tokens, the last sampled after the last draft's position.
            room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
            depth = min(self.policy.num_drafts(request.request_id, threshold), room)
            if depth <= 0:
                request.draft_token_ids = []
            elif self.proposer is None:
                request.draft_token_ids = [0] * depth  # the draft model writes them at launch
            else:
                request.draft_token_ids = self.proposer.propose(request.request_id, request.all_token_ids, depth)

    def observe_step(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """A completed step's work and duration (the cost model of a draft: policy.DraftPolicy.observe_step)."""
        self.policy.observe_step(
            scheduled.num_prefill_tokens, scheduled.num_draft_tokens, scheduled.num_decode_rows, seconds
        )

    def observe(self, items: Sequence[ScheduledRequest], runs: Sequence[Sequence[int]]) -> None:
        """A verified step: `runs[i]` is what sampling item `items[i]` kept (its drafts that matched, then one)."""
        for item, run in zip(items, runs, strict=True):
            drafts = len(item.draft_token_ids)
            if drafts:
                kept = min(drafts, len(run) - 1)
                self.policy.observe(item.request.request_id, drafts, kept)
                self.stats.add(drafts, kept)
        self._maybe_log()

    def finish(self, request: Request) -> None:
        """A request ended (any way): forget it; a proposer that learns across requests keeps its outputs."""
        self.policy.release(request.request_id)
        if self.proposer is not None:
            self.proposer.finish(request.request_id, request.all_token_ids, request.num_prompt_tokens)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        since, rows_then = self._logged
        if now - since < LOG_EVERY_S or self.stats.verified_rows == rows_then:
            return
        self._logged = (now, self.stats.verified_rows)
        stats = self.stats
        log.info(
            "speculative decoding",
            method=self.config.method,
            proposed=stats.proposed_tokens,
            accepted=stats.accepted_tokens,
            acceptance_rate=round(stats.accepted_tokens / max(1, stats.proposed_tokens), 3),
            mean_acceptance_length=round(stats.mean_acceptance_length, 3),
            kept_histogram=stats.kept_histogram,
        )
