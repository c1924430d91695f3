"""A validated batch input file read back for running: the lines still to run, read and parsed off the event loop.

A resumed batch may have most of its lines done: every one of them is read and skipped (by its custom_id) in a
worker thread, a chunk at a time, so the event loop only ever receives lines to run, however many are done. A
line may be as long as the file (the replica that validated it may have allowed longer lines than this one).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Collection, Iterator
from pathlib import Path
from typing import BinaryIO

from gateway.batches import lines
from gateway.batches.lines import InputLine

CHUNK_LINES = 64  # lines to run handed to the event loop at a time
SCAN_LINES = 4096  # lines read per thread hop at most, done or not, so a hop stays short


class _Reader:
    """The file's lines to run, in order, a chunk per `next_chunk` call (blocking: call it in a thread)."""

    def __init__(self, path: Path, endpoint: str | None, done: Collection[str]) -> None:
        self._file: BinaryIO = path.open("rb")
        size = path.stat().st_size
        self._lines: Iterator[tuple[int, bytes | None]] = lines.read_lines(self._file, max(size, 1))
        self._endpoint = endpoint
        self._done = done
        self._index = 0

    def next_chunk(self) -> list[InputLine] | None:
        """Up to CHUNK_LINES lines to run (after reading at most SCAN_LINES); None at the end of the file."""
        chunk: list[InputLine] = []
        for _ in range(SCAN_LINES):
            item = next(self._lines, None)
            if item is None:
                return chunk or None
            number, raw = item
            index, self._index = self._index, self._index + 1
            if raw is None:  # cannot happen: no line is longer than its file
                raise ValueError(f"line {number} of a validated batch could not be read")
            if self._done and json.loads(raw)["custom_id"] in self._done:
                continue
            chunk.append(lines.parse_line(raw, number, index, self._endpoint, None))
            if len(chunk) >= CHUNK_LINES:
                break
        return chunk

    def close(self) -> None:
        self._file.close()


async def pending_lines(path: Path, endpoint: str | None, done: Collection[str]) -> AsyncIterator[InputLine]:
    """The lines of the validated file at `path` whose custom_id is not in `done`, in file order; `done` must not
    change while this runs."""
    reader = await asyncio.to_thread(_Reader, path, endpoint, done)
    try:
        while (chunk := await asyncio.to_thread(reader.next_chunk)) is not None:
            for line in chunk:
                yield line
    finally:
        reader.close()
