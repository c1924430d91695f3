"""Per-choice output processing: token ids from the core in, text deltas and the finish decision out.

Runs off the step loop (in the RPC layer or the offline API), one `OutputProcessor` per choice. It owns
the choice's incremental detokenizer and stop-string matcher, and decides when a stop string ends a choice
the core is still generating; the caller then aborts the request in the core (`ChoiceDelta.abort_core`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine_server.output.detokenizer import IncrementalDetokenizer
from engine_server.output.stop_strings import StopStringMatcher
from engine_server.output.types import ChoiceDelta, FinishReason
from engine_server.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class OutputProcessor:
    """Turns one choice's token ids into `ChoiceDelta`s.

    Rules:
    - A stop string ends the choice with STOP, matched_stop the string, abort_core True while the core
      had not finished the request itself; token_ids stop at the token that completed the stop string.
      Stop strings are only looked for once `min_tokens` tokens exist (text before that is emitted as is).
    - When the core finishes the request (STOP with `stop_token_id` for eos / a stop token id, LENGTH,
      ABORT) all held-back text is flushed; a stop string found in that last text still wins.
    - The stop token itself (the last id, equal to `stop_token_id`) is reported in token_ids but its text
      is left out, unless include_stop_str_in_output.
    - Once finished, further calls (tokens the core produced before the abort landed) are ignored: they
      return an empty delta repeating the final finish_reason and matched_stop with abort_core False.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        silent_from: int | None = None,
    ) -> None:
        """`silent_from`: token ids from it up give no text (a transcription's timestamp tokens); None: every id's."""
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens, silent_from)
        self._stops = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_tokens = 0
        self._finish_reason: FinishReason | None = None
        self._matched_stop: str | int | None = None

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None

    def process(
        self,
        new_token_ids: list[int],
        finish_reason_from_core: FinishReason | None,
        stop_token_id: int | None = None,
    ) -> ChoiceDelta:
        """Consumes the tokens the core produced for this choice since the last call."""
        if self._finish_reason is not None:
            return ChoiceDelta("", [], True, self._finish_reason, self._matched_stop, False)
        text_ids = new_token_ids
        if (
            finish_reason_from_core is FinishReason.STOP
            and stop_token_id is not None
            and new_token_ids
            and new_token_ids[-1] == stop_token_id
            and not self._include_stop
        ):
            text_ids = new_token_ids[:-1]
        text, consumed, matched = self._consume(text_ids)
        if matched is not None:
            self._finish(FinishReason.STOP, matched)
            return ChoiceDelta(
                text, new_token_ids[:consumed], True, FinishReason.STOP, matched, finish_reason_from_core is None
            )
        if finish_reason_from_core is None:
            return ChoiceDelta(text, list(new_token_ids), False, None, None, False)

        tail, tail_matched = self._check_stops(self._detokenizer.flush())
        text += tail
        if tail_matched is not None:
            self._finish(FinishReason.STOP, tail_matched)
        else:
            if self._stops is not None:
                text += self._stops.flush()
            self._finish(
                finish_reason_from_core,
                stop_token_id if finish_reason_from_core is FinishReason.STOP else None,
            )
        return ChoiceDelta(text, list(new_token_ids), True, self._finish_reason, self._matched_stop, False)

    def _consume(self, ids: list[int]) -> tuple[str, int, str | None]:
        """Detokenizes `ids`; returns (text to emit, number of ids consumed, matched stop string)."""
        if self._stops is None:
            self._num_tokens += len(ids)
            return self._detokenizer.add(ids), len(ids), None
        # One token at a time, so a match reports exactly the tokens up to the one that completed it.
        pieces: list[str] = []
        for n, token_id in enumerate(ids, start=1):
            self._num_tokens += 1
            emit, matched = self._check_stops(self._detokenizer.add((token_id,)))
            pieces.append(emit)
            if matched is not None:
                return "".join(pieces), n, matched
        return "".join(pieces), len(ids), None

    def _check_stops(self, text: str) -> tuple[str, str | None]:
        if self._stops is None or self._num_tokens < self._min_tokens:
            return text, None
        return self._stops.feed(text)

    def _finish(self, reason: FinishReason, matched: str | int | None) -> None:
        self._finish_reason = reason
        self._matched_stop = matched
