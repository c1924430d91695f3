"""Images in chat messages: where a request holds them (`ImageSource`: a URL and the field that names it) and what
a data: URL holds. Pure functions; `gateway.media` fetches the http(s) URLs and hands `to_engine` every image URL's
bytes (`ImageBytes`), so translation itself never waits on the network.

An image URL is a base64 data: URL with an image media type (`data:image/png;base64,...`) or an http(s) URL; any
other scheme, a malformed data: URL, or a data: URL whose payload is larger than the server takes is a 400 naming
the field (`messages[i].content[j].image_url.url`, or `...image_url` where the URL was given as a bare string).
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
from gateway.schemas.chat import ChatMessage

ImageBytes = Mapping[str, bytes]  # an image URL -> the bytes of the file it names
NO_IMAGES: ImageBytes = MappingProxyType({})
DATA_PREFIX = "data:"


@dataclass(frozen=True)
class ImageSource:
    """One image of a request: its URL, and the field that holds it (the 400's param)."""

    url: str
    param: str


def chat_image_sources(messages: Sequence[ChatMessage], where: str = "messages") -> list[ImageSource]:
    """Every image part of a conversation that has a URL, in order; `where` is the conversation's field
    (`messages`, or `messages[c]` for one conversation of a batched request)."""
    sources = []
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                found = part.image_source() if part.type == "image_url" else None
                if found is not None:
                    sources.append(ImageSource(found[0], f"{where}[{i}].content[{j}].{found[1]}"))
    return sources


def url_kind(source: ImageSource) -> Literal["data", "http"]:
    """Whether the image is inline (a data: URL) or to fetch (http or https); a 400 for any other URL."""
    if source.url[:len(DATA_PREFIX)].lower() == DATA_PREFIX:
        return "data"
    try:
        parts = urlsplit(source.url)
    except ValueError as exc:
        raise invalid(f"the image URL is malformed ({exc})", source.param) from None
    if parts.scheme.lower() in ("http", "https"):
        if not parts.hostname:
            raise invalid("the image URL names no host", source.param)
        return "http"
    shown = f"{parts.scheme}:" if parts.scheme else "none"
    raise invalid(f"an image URL must be a data: URL (data:image/png;base64,...) or an http(s) URL; its scheme is "
                  f"{shown}", source.param)


def check_host(host: str, param: str, allowed_domains: frozenset[str]) -> None:
    """400 unless an http(s) URL's `host` is one of `allowed_domains` (exact host names, as vLLM's
    --allowed-media-domains; empty: any host, though `gateway.media` fetches from a host not listed only if its
    addresses are public). Checked for the URL given and for every redirect."""
    if not allowed_domains:
        return
    host = host.lower()
    if host not in allowed_domains:
        raise invalid(f"images are fetched only from {', '.join(sorted(allowed_domains))}; this URL's host is "
                      f"{host or 'missing'}", param)


def data_url_bytes(source: ImageSource, max_bytes: int | None) -> bytes:
    """The file a data: URL holds (RFC 2397, base64, an image media type); 400 for a malformed one, a payload that
    is not base64, another media type, or more than `max_bytes` (None: no cap)."""
    header, comma, payload = source.url[len(DATA_PREFIX):].partition(",")
    if not comma:
        raise invalid("the image's data: URL has no ',' before its data (data:image/png;base64,...)", source.param)
    media_type, *params = (p.strip().lower() for p in header.split(";"))
    if "base64" not in params:
        raise invalid("the image's data: URL must be base64-encoded (data:image/png;base64,...)", source.param)
    if not media_type.startswith("image/"):
        raise invalid(f"the data: URL's media type is {media_type or 'missing'}, not an image (image/png, "
                      "image/jpeg, ...)", source.param)
    if max_bytes is not None and len(payload) // 4 * 3 - 2 > max_bytes:  # refused before decoding it
        raise too_large(source.param, max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid("the image's data: URL does not hold valid base64", source.param) from None
    if not data:
        raise invalid("the image's data: URL holds no data", source.param)
    if max_bytes is not None and len(data) > max_bytes:
        raise too_large(source.param, max_bytes)
    return data


def too_large(param: str, max_bytes: int) -> APIError:
    return invalid(f"the image is larger than this server takes ({max_bytes} bytes)", param)


def unfetched(sources: Sequence[ImageSource]) -> dict[str, bytes]:
    """What validating a request needs without the network: each data: URL's bytes (uncapped: the request's size
    bounds them), and each http(s) URL checked and standing for an empty file, fetched only when the request runs.
    400 for a malformed URL, as the request would answer."""
    images: dict[str, bytes] = {}
    for source in sources:
        if source.url not in images:
            images[source.url] = data_url_bytes(source, None) if url_kind(source) == "data" else b""
    return images
