"""A long clip cut into the windows Whisper's encoder hears (`split_clip`), each re-encoded as a WAV file
(`window_wav`); the windows' results are joined into the clip's by `frontend.joined_results`.

A window ends at the quietest frame (`FRAME_SECONDS` = 0.1 s, the lowest RMS energy) among the frames of the last
`SEARCH_SECONDS` (1 s) before its nominal end (its start plus the model's window, 30 s); the cut falls in that frame's
middle, so every window but the last is at least `window - SEARCH_SECONDS` long (the floor: 29 s for Whisper) and at
most `window`. The windows cover every sample exactly once, in order. Pure: no model, no state.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

FRAME_SECONDS = 0.1  # the frame whose RMS energy is compared
SEARCH_SECONDS = 1.0  # the span before a window's nominal end searched for its quietest frame


def split_clip(samples: np.ndarray[Any, Any], rate: int, window_seconds: float) -> list[tuple[int, int]]:
    """The windows of `samples` (1-D, at `rate` Hz) as [start, end) sample ranges: one window where the clip is at
    most `window_seconds` long; else consecutive windows of at most `window_seconds`, each but the last cut in the
    middle of the quietest `FRAME_SECONDS` frame of the last `SEARCH_SECONDS` before its nominal end (the earliest
    such frame on a tie), so none but the last is shorter than `window_seconds - SEARCH_SECONDS`."""
    total = int(samples.shape[0])
    window = round(window_seconds * rate)
    frame = max(1, round(FRAME_SECONDS * rate))
    search = min(window - 1, max(frame, round(SEARCH_SECONDS * rate)))
    windows: list[tuple[int, int]] = []
    start = 0
    while total - start > window:
        span_start = start + window - search
        count = search // frame
        span = samples[span_start:span_start + count * frame].astype(np.float64).reshape(count, frame)
        quietest = int(np.argmin(np.sqrt(np.mean(span * span, axis=1))))
        end = span_start + quietest * frame + frame // 2
        windows.append((start, end))
        start = end
    windows.append((start, total))
    return windows


def window_wav(samples: np.ndarray[Any, Any], rate: int) -> bytes:
    """`samples` (1-D float32 at `rate`) as a mono 32-bit float WAV file (a 16-byte `fmt ` chunk of format 3, IEEE
    float, and the `data` chunk: nothing else, so the same samples give the same bytes and digest), which
    `decoded_clip` reads back to the same samples (no resampling at the model's own rate)."""
    data = np.ascontiguousarray(samples, dtype="<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    return b"".join([b"RIFF", struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)), b"WAVE", b"fmt ",
                     struct.pack("<I", len(fmt)), fmt, b"data", struct.pack("<I", len(data)), data])  # fmt: skip
