"""Whisper's temperature fallback (`TranscriptionPrompt.temperature_fallback`): how OpenAI's whisper judges a decode of
one 30 s window and whether it decodes again hotter. Pure: the engine runs the decodes (`server.serving`, `llm`) and
joins them (`frontend.fallback_answer`).

A window is decoded at each of `TEMPERATURES` in turn until one passes: its text not too repetitive (its zlib
compression ratio at most `COMPRESSION_RATIO_THRESHOLD`) and its tokens not too unlikely (their mean log-probability,
of the processed distribution, the end token's included and counted as one more, at least `LOGPROB_THRESHOLD`). A
window whose `<|nospeech|>` probability is over `NO_SPEECH_THRESHOLD` while its tokens are that unlikely is silence:
not decoded again, and answered with no text. These are `whisper.transcribe`'s defaults.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
COMPRESSION_RATIO_THRESHOLD = 2.4
LOGPROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6


def compression_ratio(text: str) -> float:
    """Whisper's measure of a repetitive decode: the text's UTF-8 bytes over their zlib-compressed length."""
    data = text.encode()
    return len(data) / len(zlib.compress(data))


@dataclass(frozen=True)
class DecodeCheck:
    """What Whisper reads of one decode of a window: its tokens' mean log-probability, its text's compression ratio
    and the window's `<|nospeech|>` probability (None: not measured, the vocabulary has no such token)."""

    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float | None

    @classmethod
    def of(cls, text: str, logprobs: Sequence[float], ended_on_stop: bool, no_speech_prob: float | None) -> DecodeCheck:
        """The check of a decode whose text is `text`, its tokens' processed `logprobs` in order (its end token's last
        where it `ended_on_stop`), as Whisper's decoder sums them: over every token, divided by the tokens before the
        end plus one."""
        before_end = len(logprobs) - (1 if ended_on_stop else 0)
        return cls(sum(logprobs) / (before_end + 1), compression_ratio(text.strip()), no_speech_prob)

    @property
    def unlikely(self) -> bool:
        return self.avg_logprob < LOGPROB_THRESHOLD

    @property
    def passes(self) -> bool:
        """Whether this decode answers (none hotter follows): neither too repetitive nor too unlikely, or silence."""
        fails = self.compression_ratio > COMPRESSION_RATIO_THRESHOLD or self.unlikely
        silent = self.no_speech_prob is not None and self.no_speech_prob > NO_SPEECH_THRESHOLD and self.unlikely
        return not fails or silent

    @property
    def silence(self) -> bool:
        """Whether the answered decode's window is silence (it answers no text): `<|nospeech|>` over its threshold and
        the tokens not above theirs."""
        return (self.no_speech_prob is not None and self.no_speech_prob > NO_SPEECH_THRESHOLD
                and not self.avg_logprob > LOGPROB_THRESHOLD)  # fmt: skip
