"""Images and audio clips in chat messages: where a request holds them (`MediaSource`: a URL, the field that names
it, and whether it is an image or audio) and what a data: URL holds. Pure functions; `gateway.media` fetches the
http(s) URLs and hands `to_engine` every URL's bytes (`MediaBytes`, images' and clips' alike), so translation
itself never waits on the network.

An image URL is a base64 data: URL with an image media type (`data:image/png;base64,...`) or an http(s) URL; an
`audio_url` likewise with an audio media type (`data:audio/wav;base64,...`). An `input_audio` part's base64 `data`
stands as the data: URL `data:audio/<format>;base64,<data>` (`input_audio_source`), so it is decoded, capped and
looked up as an inline clip is. Any other scheme, a malformed data: URL, a payload that is not base64, an
`input_audio` format not in AUDIO_FORMATS, or a payload larger than the server takes is a 400 naming the field
(`messages[i].content[j].image_url.url`, `...audio_url.url`, `...input_audio.data`, `...input_audio.format`, or
`...image_url` / `...audio_url` where the URL was given as a bare string).

One URL is one file: the same URL given as an image and as audio in one request is a 400 (no answer can be both).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal
from urllib.parse import urlsplit

from gateway.errors import APIError, invalid
from gateway.schemas.chat import ChatMessage, ContentPart, InputAudio

MediaKind = Literal["image", "audio"]
MediaBytes = Mapping[str, bytes]  # an image or audio URL (`MediaSource.url`) -> the bytes of the file it names
NO_MEDIA: MediaBytes = MappingProxyType({})
DATA_PREFIX = "data:"
MEDIA_PARTS = frozenset({"image_url", "input_audio", "audio_url"})  # the chat part types that carry a file
# OpenAI documents wav and mp3 for input_audio; the engine decodes flac and ogg too. Each as the media type of the
# data: URL its data stands as.
AUDIO_FORMATS: Mapping[str, str] = MappingProxyType(
    {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg"})
# A fetched clip's content type: audio/*, or one of these, which servers give audio files too (Ogg's registered
# type; a bucket's default for a file it knows nothing of). A data: URL's media type must be audio/* itself.
FETCHED_AUDIO_TYPES = frozenset({"application/ogg", "application/octet-stream"})
_PLURAL = {"image": "images", "audio": "audio clips"}
_EXPECTED = {"image": "an image (image/png, image/jpeg, ...)", "audio": "audio (audio/wav, audio/mpeg, ...)"}
_EXAMPLE = {"image": "data:image/png;base64,...", "audio": "data:audio/wav;base64,..."}


@dataclass(frozen=True)
class MediaSource:
    """One image or audio clip of a request: its URL (the key of its bytes in `MediaBytes`), the field that holds
    it (the 400's param), and its kind, which sets the media types taken and the byte cap."""

    url: str
    param: str
    kind: MediaKind = "image"

    @property
    def plural(self) -> str:
        """What the kind's files are called in a message: "images" or "audio clips"."""
        return _PLURAL[self.kind]

    def takes(self, media_type: str, fetched: bool) -> bool:
        """Whether a file of `media_type` (lower case, no parameters) is one of this kind: image/* for an image,
        audio/* for audio, and for fetched audio also FETCHED_AUDIO_TYPES."""
        if self.kind == "image":
            return media_type.startswith("image/")
        return media_type.startswith("audio/") or (fetched and media_type in FETCHED_AUDIO_TYPES)

    def wrong_type(self, what: str, media_type: str) -> APIError:
        """The 400 for a file whose media type is not of this kind; `what` says whose type it is."""
        return invalid(f"{what} is {media_type or 'missing'}, not {_EXPECTED[self.kind]}", self.param)


ImageSource = MediaSource  # an image's source: MediaSource's default kind


def part_source(part: ContentPart, where: str) -> MediaSource | None:
    """The file of an image_url, audio_url or input_audio part at `where` (`messages[i].content[j]`); None for any
    other part and for one without its file (`to_engine` names what is missing). 400 for an input_audio format
    not in AUDIO_FORMATS."""
    if part.type == "image_url":
        found = part.image_source()
        return MediaSource(found[0], f"{where}.{found[1]}") if found is not None else None
    if part.type == "audio_url":
        found = part.audio_url_source()
        return MediaSource(found[0], f"{where}.{found[1]}", "audio") if found is not None else None
    if part.type == "input_audio" and part.input_audio is not None:
        return input_audio_source(part.input_audio, f"{where}.input_audio")
    return None


def input_audio_source(audio: InputAudio, where: str) -> MediaSource:
    """An input_audio clip (`where`: its field, `...content[j].input_audio`) as the data: URL its data stands as,
    named by `where.data`; 400 naming `where.data` when it is missing, `where.format` for a format missing or not
    in AUDIO_FORMATS."""
    formats = ", ".join(AUDIO_FORMATS)
    if audio.data is None:
        raise invalid("an input_audio part needs its data: the file's bytes in base64", f"{where}.data")
    if audio.format is None:
        raise invalid(f"an input_audio part needs its format: one of {formats}", f"{where}.format")
    media_type = AUDIO_FORMATS.get(audio.format)
    if media_type is None:
        raise invalid(f"input_audio.format {audio.format[:40]!r} is not one ladle reads; give one of {formats}",
                      f"{where}.format")
    return MediaSource(f"{DATA_PREFIX}{media_type};base64,{audio.data}", f"{where}.data", "audio")


def chat_media_sources(messages: Sequence[ChatMessage], where: str = "messages") -> list[MediaSource]:
    """Every image and audio part of a conversation that has its file, in order; `where` is the conversation's
    field (`messages`, or `messages[c]` for one conversation of a batched request)."""
    sources = []
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                found = part_source(part, f"{where}[{i}].content[{j}]")
                if found is not None:
                    sources.append(found)
    return sources


def distinct(sources: Sequence[MediaSource]) -> dict[str, MediaSource]:
    """Each URL of `sources` once (its first source); 400 naming the later one for a URL given as both kinds."""
    unique: dict[str, MediaSource] = {}
    for source in sources:
        first = unique.setdefault(source.url, source)
        if first.kind != source.kind:
            raise invalid(f"this URL is given as {first.kind} at {first.param} too; one file cannot be both an "
                          "image and audio", source.param)
    return unique


def url_kind(source: MediaSource) -> Literal["data", "http"]:
    """Whether the file is inline (a data: URL) or to fetch (http or https); a 400 for any other URL."""
    if source.url[:len(DATA_PREFIX)].lower() == DATA_PREFIX:
        return "data"
    try:
        parts = urlsplit(source.url)
    except ValueError as exc:
        raise invalid(f"the {source.kind} URL is malformed ({exc})", source.param) from None
    if parts.scheme.lower() in ("http", "https"):
        if not parts.hostname:
            raise invalid(f"the {source.kind} URL names no host", source.param)
        return "http"
    shown = f"{parts.scheme}:" if parts.scheme else "none"
    raise invalid(f"an {source.kind} URL must be a data: URL ({_EXAMPLE[source.kind]}) or an http(s) URL; its "
                  f"scheme is {shown}", source.param)


def check_host(host: str, source: MediaSource, allowed_domains: frozenset[str]) -> None:
    """400 unless an http(s) URL's `host` is one of `allowed_domains` (exact host names, as vLLM's
    --allowed-media-domains; empty: any host, though `gateway.media` fetches from a host not listed only if its
    addresses are public). Checked for the URL given and for every redirect."""
    if not allowed_domains:
        return
    host = host.lower()
    if host not in allowed_domains:
        raise invalid(f"{source.plural} are fetched only from {', '.join(sorted(allowed_domains))}; this URL's "
                      f"host is {host or 'missing'}", source.param)


def data_url_bytes(source: MediaSource, max_bytes: int | None) -> bytes:
    """The file a data: URL holds (RFC 2397, base64, a media type of the source's kind); 400 for a malformed one,
    a payload that is not base64, another media type, or more than `max_bytes` (None: no cap)."""
    header, comma, payload = source.url[len(DATA_PREFIX):].partition(",")
    example = _EXAMPLE[source.kind]
    if not comma:
        raise invalid(f"the {source.kind}'s data: URL has no ',' before its data ({example})", source.param)
    media_type, *params = (p.strip().lower() for p in header.split(";"))
    if "base64" not in params:
        raise invalid(f"the {source.kind}'s data: URL must be base64-encoded ({example})", source.param)
    if not source.takes(media_type, fetched=False):
        raise source.wrong_type("the data: URL's media type", media_type)
    if max_bytes is not None and len(payload) // 4 * 3 - 2 > max_bytes:  # refused before decoding it
        raise too_large(source, max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"the {source.kind}'s data is not valid base64", source.param) from None
    if not data:
        raise invalid(f"the {source.kind} holds no data", source.param)
    if max_bytes is not None and len(data) > max_bytes:
        raise too_large(source, max_bytes)
    return data


def too_large(source: MediaSource, max_bytes: int) -> APIError:
    return invalid(f"the {source.kind} is larger than this server takes ({max_bytes} bytes)", source.param)


def unfetched(sources: Sequence[MediaSource]) -> dict[str, bytes]:
    """What validating a request needs without the network: each data: URL's bytes (uncapped: the request's size
    bounds them), and each http(s) URL checked and standing for an empty file, fetched only when the request runs.
    400 for a malformed URL, as the request would answer."""
    return {url: data_url_bytes(source, None) if url_kind(source) == "data" else b""
            for url, source in distinct(sources).items()}
