"""The gateway's HTTP/1.1 protocol: uvicorn's httptools protocol with a bound on the size of a request's head.

httptools keeps a request line and headers of any size in memory (a long header value also grows by
concatenation, costing the event loop quadratic copying: a 200 MB header took over a minute), and uvicorn sets
no limit on it. Here a head (request line and headers) over MAX_HEAD_BYTES is answered 431 in OpenAI's error
shape; the rest of what the client sends is read and dropped for a moment, so that it finishes writing and reads
the answer, then the connection is closed. Bodies are bounded by `RequestContextMiddleware`.
"""

from __future__ import annotations

import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import APIError

MAX_HEAD_BYTES = 64 * 1024  # request line + headers; a Bearer key and proxy headers need a few KiB at most
REFUSED_LINGER_S = 2.0  # how long a refused connection's further bytes are read and dropped before closing


def head_too_large_response() -> bytes:
    """The raw HTTP/1.1 response to a head over MAX_HEAD_BYTES: 431, OpenAI's error body, connection closed."""
    error = APIError(431, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes",
                     code="request_header_fields_too_large")
    body = json.dumps(error.body()).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class BoundedHeadProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that counts the bytes of each request's head and refuses one over MAX_HEAD_BYTES.

    Bytes are counted per received chunk from the start of a request until its headers are complete, and checked
    after each chunk: a head that arrives whole in one read passes (it is at most one read, 256 KiB), a longer
    one is refused once past the limit. Either way at most the limit plus one read is held in memory.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # between requests, and while a request's line and headers arrive
        self._head_bytes = 0
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            self._refuse_head()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0

    def _refuse_head(self) -> None:
        self._refused = True
        self.transport.write(head_too_large_response())
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(REFUSED_LINGER_S, self.transport.close)
