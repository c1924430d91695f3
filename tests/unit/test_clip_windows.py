"""`engine_server.multimodal.clip_windows`: a long clip's windows cut at the quietest frame of the last second
before each 30 s boundary, covering every sample once in order; a WAV window reads back to its samples; joined
results."""

from __future__ import annotations

import io
import itertools
from typing import Any

import numpy as np
import pytest

from engine_server.frontend import Choice, GenerationResult, Usage, joined_results, window_separator
from engine_server.multimodal.clip_windows import split_clip, window_wav
from engine_server.multimodal.transcription import TranscriptionInfo
from engine_server.output.types import FinishReason

RATE = 16_000


def noisy(seconds: float, gaps: tuple[tuple[float, float], ...] = (), seed: int = 0) -> np.ndarray[Any, Any]:
    """Loud noise of `seconds` at 16 kHz, silent over each (start, end) second range of `gaps`."""
    samples = np.random.default_rng(seed).uniform(-0.5, 0.5, round(seconds * RATE)).astype(np.float32)
    for start, end in gaps:
        samples[round(start * RATE):round(end * RATE)] = 0.0
    return samples


def covers(windows: list[tuple[int, int]], total: int) -> bool:
    return windows[0][0] == 0 and windows[-1][1] == total and all(
        a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(windows)) and windows[-1][0] < total


def test_the_cut_lands_in_the_quiet_gap() -> None:
    """Gaps in the last second before each boundary: each cut in the middle of the gap's whole frame (frames of
    0.1 s counted from a second before the boundary)."""
    samples = noisy(65.0, ((29.4, 29.6), (58.7, 58.9)))
    windows = split_clip(samples, RATE, 30.0)
    assert windows == [(0, round(29.45 * RATE)), (round(29.45 * RATE), round(58.8 * RATE)),
                       (round(58.8 * RATE), samples.shape[0])]  # fmt: skip
    assert covers(windows, samples.shape[0])


def test_a_gap_before_the_search_span_is_not_taken() -> None:
    """A quiet gap earlier than the last second is not where the window ends: the floor is 29 s."""
    samples = noisy(40.0, ((20.0, 21.0),))
    ((_, end), _) = split_clip(samples, RATE, 30.0)
    assert 29 * RATE <= end <= 30 * RATE


@pytest.mark.parametrize(("samples", "count"), [(30 * RATE, 1), (30 * RATE + 1, 2), (1, 1), (300 * RATE, 11)])
def test_window_counts_and_cover(samples: int, count: int) -> None:
    """Exactly 30 s: one window; a sample more: two; 5 minutes of noise: each window 29-30 s, every sample once."""
    clip = noisy(samples / RATE)
    windows = split_clip(clip, RATE, 30.0)
    assert len(windows) == count and covers(windows, samples)
    assert all(29 * RATE <= end - start <= 30 * RATE for start, end in windows[:-1])
    assert windows[-1][1] - windows[-1][0] <= 30 * RATE


def test_a_window_wav_reads_back_to_its_samples() -> None:
    import soundfile

    samples = noisy(1.5)
    read, rate = soundfile.read(io.BytesIO(window_wav(samples, RATE)), dtype="float32")
    assert rate == RATE and np.array_equal(read, samples)
    assert window_wav(samples, RATE) == window_wav(samples.copy(), RATE)  # (the same bytes: the same digest)


def result(text: str, tokens: list[int], reason: FinishReason, prompt: list[int], seconds: float) -> GenerationResult:
    return GenerationResult("r", prompt, [Choice(0, text, tokens, reason)], Usage(len(prompt), len(tokens)),
                            transcription=TranscriptionInfo("de", seconds))  # fmt: skip


def test_joined_results() -> None:
    """Texts joined so words do not run together, tokens and prompts concatenated, usage summed, length where any
    window ran out of tokens, the whole clip's seconds."""
    parts = [result(" a b", [1, 2], FinishReason.LENGTH, [9, 8], 29.5), result("c", [3], FinishReason.STOP, [9], 2.0),
             result(" d", [4], FinishReason.STOP, [9], 1.0)]  # fmt: skip
    joined = joined_results(parts, 32.5)
    assert joined.choices[0].text == " a b c d" and joined.choices[0].token_ids == [1, 2, 3, 4]
    assert joined.prompt_token_ids == [9, 8, 9, 9]
    assert (joined.usage.prompt_tokens, joined.usage.completion_tokens) == (4, 4)
    assert joined.choices[0].finish_reason == FinishReason.LENGTH
    assert joined.transcription == TranscriptionInfo("de", 32.5)
    assert joined_results(parts[1:], 3.0).choices[0].finish_reason == FinishReason.STOP
    assert (window_separator("a", "b"), window_separator("a ", "b"), window_separator("a", " b"),
            window_separator("", "b")) == (" ", "", "", "")
