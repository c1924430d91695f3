"""`/v1/audio/*` bodies: multipart/form-data read into memory as it arrives (python-multipart's push parser).

The audio routes cap their own bodies (they sit in the middleware's OWN_BODY_LIMIT): a clip may be larger than
`--max-request-mib`, up to `--max-audio-mib`. The `file` part is kept in memory and refused (413, param `file`)
the moment it passes `max_audio_bytes`; every other part is a small text field, kept up to MAX_FIELD_BYTES, at
most MAX_FIELDS of them; the whole body may not pass the clip's cap plus FORM_OVERHEAD_BYTES (413). A field name
ending in `[]` (the SDK's spelling of a list, `timestamp_granularities[]`) is kept under its name without the
brackets, every value in order; any field may come more than once (`AudioForm.fields` keeps every value), and
the schema (`schemas.audio`) says which may.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from python_multipart.multipart import MultipartParseError, MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from gateway.errors import APIError, invalid
from gateway.multipart import PartReader

MAX_FIELD_BYTES = 64 * 1024  # a prompt of Whisper's 224 tokens is about 1 KiB; this leaves room for any language
MAX_FIELDS = 64
FORM_OVERHEAD_BYTES = 1024 * 1024  # boundaries, part headers and the text fields around the file


@dataclass
class AudioForm:
    """A received audio form: the `file` part's bytes (None: the body had none; its file name is not used, the
    engine finds the format in the bytes), the text fields (name -> every value given, in order) and the body's
    size."""

    file: bytes | None = None
    fields: dict[str, list[str]] = field(default_factory=dict)
    body_bytes: int = 0

    def values(self, list_fields: frozenset[str]) -> dict[str, str | list[str]]:
        """The fields as a schema reads them: each of `list_fields` as the list of its values, every other field's
        one value; 400 naming a field other than those given more than once."""
        values: dict[str, str | list[str]] = {}
        for name, given in self.fields.items():
            if name in list_fields:
                values[name] = given
            elif len(given) > 1:
                raise invalid(f"`{name}` is given {len(given)} times; send it once", name)
            else:
                values[name] = given[0]
        return values

    @property
    def text_bytes(self) -> int:
        """The body's bytes less the clip's: what the request's text (prompt, options) weighs."""
        return self.body_bytes - len(self.file or b"")


def file_too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the audio file is larger than this server takes ({max_bytes} bytes; --max-audio-mib)",
                    param="file", code="file_too_large")


class _FormReader(PartReader):
    """Each part of an audio form to the file or to a field."""

    def __init__(self, form: AudioForm, max_audio_bytes: int) -> None:
        super().__init__()
        self.form = form
        self.max_audio_bytes = max_audio_bytes
        self._fields = 0

    def part_named(self, name: str, params: dict[bytes, bytes]) -> str | None:
        if name == "file":
            if self.form.file is not None:
                raise invalid("send one `file` part", "file")
            self.form.file = b""
            return "file"
        if not name:
            return None
        self._fields += 1
        if self._fields > MAX_FIELDS:
            raise invalid(f"the form has more than {MAX_FIELDS} fields")
        return name.removesuffix("[]")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._part is None:
            return
        self._buffer += data[start:end]
        if self._part == "file":
            if len(self._buffer) > self.max_audio_bytes:
                raise file_too_large(self.max_audio_bytes)
        elif len(self._buffer) > MAX_FIELD_BYTES:
            raise invalid(f"form field `{self._part}` is longer than {MAX_FIELD_BYTES} bytes", self._part)

    def _part_end(self) -> None:
        if self._part == "file":
            self.form.file = bytes(self._buffer)
        elif self._part is not None:
            self.form.fields.setdefault(self._part, []).append(self._buffer.decode("utf-8", "replace"))
        self._buffer.clear()


async def receive_audio_form(request: Request, max_audio_bytes: int) -> AudioForm:
    """Read a multipart/form-data body into an AudioForm; APIError 400 for a body that is not one (or a malformed
    one), 413 for a clip over `max_audio_bytes` or a body over it plus FORM_OVERHEAD_BYTES."""
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise invalid("the body must be multipart/form-data with the audio in a `file` part", "file")
    max_body = max_audio_bytes + FORM_OVERHEAD_BYTES
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_body:
        raise file_too_large(max_audio_bytes)
    form = AudioForm()
    parser = MultipartParser(boundary, _FormReader(form, max_audio_bytes).callbacks())  # type: ignore[arg-type]
    try:
        async for chunk in request.stream():
            form.body_bytes += len(chunk)
            if form.body_bytes > max_body:
                raise file_too_large(max_audio_bytes)
            parser.write(chunk)
        parser.finalize()
    except MultipartParseError as exc:
        raise invalid(f"the multipart body is malformed: {exc}") from None
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the audio") from None
    return form
