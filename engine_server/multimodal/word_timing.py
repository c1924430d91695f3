"""Whisper's word timings (`Transcription.word_timestamps`), as transformers' `return_token_timestamps` computes them
(OpenAI's whisper `word_timestamps` likewise): the cross-attention of the checkpoint's `alignment_heads` from each
output token's query (as the token is fed back: its last token's never is) over the clip's frames
(`multimodal.whisper.WhisperCrossStates.alignment`), normalized over the tokens, median-filtered over the frames,
averaged over the heads and aligned to the frames by dynamic time warping; each token starts where its row first
takes a frame (the last token where the one before it does). Tokens are grouped into words as transformers' Whisper
tokenizer groups them (`_combine_tokens_into_words`: at spaces, or at each character for languages written without
them; punctuation joined to its word). A word runs from its first token's start to the start of the token after its
last. Runs in the frontend, off the step loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

TIME_PRECISION = 0.02  # seconds an encoder frame (Whisper's 30 s over 1,500)


@dataclass(frozen=True)
class TranscriptionWord:
    """One word of a transcription (its leading space kept) and its seconds into the clip."""

    word: str
    start: float
    end: float


@dataclass(frozen=True)
class WordTiming:
    """How a transcription's output is read as words: its median filter's width, its language's name (transformers'
    `LANGUAGES` values: "english"), and its window's start in the clip."""

    median_filter_width: int
    language: str
    offset_seconds: float = 0.0

    def words(
        self, tokenizer: Any, token_ids: Sequence[int], stop_token: int | None, attention: torch.Tensor
    ) -> list[TranscriptionWord]:
        """The words of a decode's `token_ids` (its `stop_token` last, where it ended on one: in no word) and their
        times from its alignment heads' `attention` `[heads, rows, frames]` (`token_times`). Only its text's tokens
        (below the end-of-text id: no timestamp or special token) make words; a token's time is its place's in the
        whole decode."""
        from transformers.models.whisper.tokenization_whisper import _combine_tokens_into_words

        times = token_times(attention, self.median_filter_width, len(token_ids))
        ends = len(token_ids) - 1 if stop_token is not None and token_ids and token_ids[-1] == stop_token \
            else len(token_ids)  # fmt: skip
        special = int(tokenizer.eos_token_id)
        places = [i for i in range(ends) if token_ids[i] < special]  # (its text's tokens)
        if not places:
            return []
        words, _, indices = _combine_tokens_into_words(tokenizer, [token_ids[i] for i in places], self.language)
        found = []
        for word, where in zip(words, indices, strict=True):
            if not where:  # (punctuation joined to a neighbour)
                continue
            first, last = places[where[0]], places[where[-1]]
            end = times[last + 1] if last + 1 < len(times) else times[last]
            found.append(TranscriptionWord(word, round(self.offset_seconds + times[first], 3),
                                           round(self.offset_seconds + end, 3)))  # fmt: skip
        return found


def token_times(attention: torch.Tensor, median_filter_width: int, tokens: int) -> list[float]:
    """Each of `tokens` output tokens' start in seconds from its alignment heads' `attention` `[heads, rows, frames]`
    (row i: token i's query; `tokens - 1` rows at most), as transformers' `_extract_token_timestamps` reads it: every
    token 0 where there is no row; else the times of the rows' jumps in the warping path, the last repeated."""
    if attention.shape[1] == 0 or tokens == 0:
        return [0.0] * tokens
    weights = attention.float()
    std = torch.std(weights, dim=-2, keepdim=True, unbiased=False)
    mean = torch.mean(weights, dim=-2, keepdim=True)
    weights = median_filter((weights - mean) / std, median_filter_width)
    matrix = weights.mean(dim=0)
    text_indices, time_indices = dynamic_time_warping(-matrix.double().numpy())
    jumps = np.pad(np.diff(text_indices), (1, 0), constant_values=1).astype(bool)
    times = [float(t) for t in time_indices[jumps] * TIME_PRECISION]
    return (times + [times[-1]] * tokens)[:tokens]


def median_filter(values: torch.Tensor, width: int) -> torch.Tensor:
    """`values` median-filtered along the last dimension over `width` (odd) entries, its edges reflected; as it is
    where that dimension holds no more than half the width."""
    half = width // 2
    if values.shape[-1] <= half:
        return values
    padded = torch.nn.functional.pad(values, (half, half, 0, 0), mode="reflect")
    return padded.unfold(-1, width, 1).sort()[0][..., half]


def dynamic_time_warping(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through `matrix` `[tokens, frames]` (float64), as (token, frame) indices from the
    start: transformers' `_dynamic_time_warping` (its float32 costs and its order of preference among equal costs:
    the diagonal, then the token's step, then the frame's), each anti-diagonal of cells computed at once."""
    rows, cols = matrix.shape
    cost = np.full((rows + 1, cols + 1), np.inf, dtype=np.float32)
    trace = np.full((rows + 1, cols + 1), -1, dtype=np.int8)
    cost[0, 0] = 0
    for diagonal in range(2, rows + cols + 1):
        i = np.arange(max(1, diagonal - cols), min(rows, diagonal - 1) + 1)
        j = diagonal - i
        c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2)).astype(np.int8)
        cost[i, j] = matrix[i - 1, j - 1] + np.choose(step, (c0, c1, c2))
        trace[i, j] = step
    trace[0, :] = 2
    trace[:, 0] = 1
    i, j = rows, cols
    text, time = [], []
    while i > 0 or j > 0:
        text.append(i - 1)
        time.append(j - 1)
        move = trace[i, j]
        if move == 0:
            i, j = i - 1, j - 1
        elif move == 1:
            i -= 1
        else:
            j -= 1
    return np.array(text)[::-1], np.array(time)[::-1]
