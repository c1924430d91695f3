"""A multipart/form-data body's parts as python-multipart's push parser reports them (`PartReader`): each part's
Content-Disposition gathered from its headers and its `name` handed to the reader, which says what the part is."""

from __future__ import annotations

from abc import ABC, abstractmethod

from python_multipart.multipart import parse_options_header


class PartReader(ABC):
    """Callbacks for MultipartParser (`callbacks()`). Once a part's headers are read, `part_named(name, params)` (its
    Content-Disposition's `name` and every parameter) says what it is: "file", a field's name, or None to skip it;
    `_part` holds that while its bytes come to `_part_data` and until `_part_end`. `_buffer` is a scratch buffer,
    emptied at each part's start."""

    def __init__(self) -> None:
        self._header_name = b""
        self._header_value = b""
        self._disposition = b""
        self._part: str | None = None
        self._buffer = bytearray()

    def callbacks(self) -> dict[str, object]:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda data, start, end: self._append_header(data[start:end], True),
            "on_header_value": lambda data, start, end: self._append_header(data[start:end], False),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }

    @abstractmethod
    def part_named(self, name: str, params: dict[bytes, bytes]) -> str | None:
        """What the part named `name` is ("file", a field's name, None to skip it); may raise APIError."""

    @abstractmethod
    def _part_data(self, data: bytes, start: int, end: int) -> None:
        """Bytes `data[start:end]` of the current part (`_part`)."""

    @abstractmethod
    def _part_end(self) -> None:
        """The current part has ended."""

    def _part_begin(self) -> None:
        self._disposition = b""
        self._part = None
        self._buffer.clear()

    def _append_header(self, data: bytes, is_name: bool) -> None:
        if is_name:
            self._header_name += data
        else:
            self._header_value += data

    def _header_end(self) -> None:
        if self._header_name.strip().lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name = self._header_value = b""

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._disposition)
        self._part = self.part_named(params.get(b"name", b"").decode("utf-8", "replace"), params)
