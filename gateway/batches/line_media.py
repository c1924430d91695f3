"""A batch's lines with their images and audio fetched a few lines ahead of the runner: `LinesWithMedia`.

A chat or responses line's image URLs (and a chat line's audio: `lines.image_sources`) are fetched by the gateway's
`MediaFetcher` while the lines before it are sent, up to `ahead` lines at once; the lines come out in their order,
each carrying its files' bytes (`InputLine.images`) or, when they could not be had, the 400 that becomes its error
line (`InputLine.media_error`, raised by `lines.engine_requests`). A line without images or audio is passed on as
soon as the lines before it are, and nothing is read ahead while the next line is ready.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import replace

from gateway.batches import lines
from gateway.batches.lines import InputLine
from gateway.errors import APIError
from gateway.media import MediaFetcher
from gateway.translate.media_parts import MediaSource

AHEAD = 8  # lines whose images are fetched at once: each line's images are fetched together


class LinesWithMedia:
    """An async iterator over `source`'s lines, images and audio fetched; `close` cancels the fetches still
    running."""

    def __init__(self, source: AsyncIterator[InputLine], media: MediaFetcher, ahead: int = AHEAD) -> None:
        self._source = source
        self._media = media
        self._ahead = ahead
        self._pending: deque[asyncio.Future[InputLine]] = deque()
        self._ended = False

    def __aiter__(self) -> LinesWithMedia:
        return self

    async def __anext__(self) -> InputLine:
        pending = self._pending
        while not self._ended and len(pending) < self._ahead and not (pending and pending[0].done()):
            line = await anext(self._source, None)
            if line is None:
                self._ended = True
            else:
                pending.append(self._start(line))
        if not pending:
            raise StopAsyncIteration
        line = await asyncio.shield(pending[0])  # a reader cancelled here leaves the line (and its fetch) in place
        pending.popleft()
        return line

    def close(self) -> None:
        for future in self._pending:
            future.cancel()

    def _start(self, line: InputLine) -> asyncio.Future[InputLine]:
        try:
            sources = lines.image_sources(line)
        except APIError as error:  # not for a validated line; its error line all the same
            sources, line = [], replace(line, media_error=error)
        if sources:
            return asyncio.ensure_future(self._fetched(line, sources))
        ready: asyncio.Future[InputLine] = asyncio.get_running_loop().create_future()
        ready.set_result(line)
        return ready

    async def _fetched(self, line: InputLine, sources: list[MediaSource]) -> InputLine:
        try:
            return replace(line, images=await self._media.fetch(sources))
        except APIError as error:
            return replace(line, media_error=error)
