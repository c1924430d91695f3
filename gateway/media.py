"""Every image and audio URL of a request as its file's bytes, before the request is translated:
`MediaFetcher.fetch`.

A data: URL (an input_audio part's data stands as one) is decoded (`translate.media_parts.data_url_bytes`; a large one
in a thread); an http(s) URL is fetched with one shared httpx client: all of a request's files at once, each within
the timeout (redirects included, at most MAX_REDIRECTS of them), its body streamed and cut off at its kind's byte
cap (images' or audio's), its content type of its kind (`MediaSource.takes`: image/* for an image; audio/*,
application/ogg or application/octet-stream for a clip). Whatever fails is a 400 naming the file's field and
saying what went wrong, and nothing is sent to the engine. The URLs are checked (scheme, host) before anything is
fetched, and the first that fails is the one reported; the same URL twice is fetched once, and a request holds at
most MAX_MEDIA distinct ones, images and clips together.

Every hop (the URL given and each redirect's) is checked before it is sent: its host must be one of the allowed
media domains when they are set, and a host the operator did not list must resolve to public addresses only
(`media_hosts.public_address`: no loopback, private network or metadata endpoint). A plain-http hop is then
pinned: sent to the address just checked, its host name in the Host header, so a second DNS answer cannot move
it. An https hop is not pinned — httpx connects by name, resolving it again — because pinning it (the address
in the URL, the name as SNI through httpcore's `sni_hostname`) is not clean: through an HTTPS proxy from the
environment the certificate would be checked against the address and every fetch fail, and the pool, keyed by
address, would reuse a TLS connection verified for one name for another. That leaves a DNS-rebinding window on
https: a name that answers a public address to the check and a private one to the connection gets a TCP connection
and a TLS handshake to the private address, which fail certificate verification (no internal server holds a
certificate for the caller's name) before any request is sent; what leaks is whether that address and port
answer (a refused connection and a failed handshake read differently in the 400).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx

from gateway import media_hosts
from gateway.config import (
    DEFAULT_IMAGE_FETCH_TIMEOUT_S,
    DEFAULT_MAX_AUDIO_BYTES,
    DEFAULT_MAX_IMAGE_BYTES,
    GatewayConfig,
)
from gateway.errors import invalid
from gateway.translate import media_parts
from gateway.translate.media_parts import MediaSource

MAX_REDIRECTS = 5
MAX_MEDIA = 500  # distinct URLs in one request (OpenAI's per-request image limit): bounds the fetches it starts
_THREAD_DECODE_CHARS = 1 << 20  # a data: URL longer than this is decoded off the event loop
_HEADERS = {"user-agent": "ladle-gateway"}
_ACCEPT = {"image": "image/*", "audio": "audio/*, application/ogg;q=0.9, application/octet-stream;q=0.5"}
_DEFAULT_PORTS = {"http": 80, "https": 443}


class MediaFetcher:
    """Fetches and decodes images and audio clips for the routes (one per app: its httpx client is opened on the
    first fetch and closed by `aclose`). `max_bytes` caps an image, `max_audio_bytes` a clip. `allowed_domains`:
    the hosts files may come from, trusted whatever they resolve to (empty: any host whose addresses are all
    public). `resolver` and `transport` are the network's two ends, swapped by tests for fakes (by default the
    system resolver and httpx's own transport)."""

    def __init__(
        self,
        timeout_s: float = DEFAULT_IMAGE_FETCH_TIMEOUT_S,
        max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        allowed_domains: Sequence[str] = (),
        max_redirects: int = MAX_REDIRECTS,
        resolver: media_hosts.Resolver = media_hosts.resolve,
        transport: httpx.AsyncBaseTransport | None = None,
        max_audio_bytes: int = DEFAULT_MAX_AUDIO_BYTES,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_audio_bytes = max_audio_bytes
        self.allowed_domains = frozenset(domain.lower() for domain in allowed_domains)
        self.max_redirects = max_redirects
        self.resolver = resolver
        self._transport = transport
        self._http: httpx.AsyncClient | None = None

    @classmethod
    def from_config(cls, config: GatewayConfig) -> MediaFetcher:
        return cls(config.image_fetch_timeout_s, config.max_image_bytes, config.allowed_media_domains,
                   max_audio_bytes=config.max_audio_bytes)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def fetch(self, sources: Sequence[MediaSource]) -> dict[str, bytes]:
        """The bytes of each distinct URL of `sources` (`translate.media_parts.MediaBytes`); APIError (400) naming
        the first file, in order, whose URL is refused (or that gives a URL already given as the other kind),
        else the first whose fetch fails."""
        unique = media_parts.distinct(sources)
        if len(unique) > MAX_MEDIA:
            raise invalid(f"a request may hold at most {MAX_MEDIA} distinct images and audio clips",
                          list(unique.values())[-1].param)
        for source in unique.values():
            if media_parts.url_kind(source) == "http":
                media_parts.check_host(urlsplit(source.url).hostname or "", source, self.allowed_domains)
        if not unique:
            return {}
        tasks = [asyncio.ensure_future(self._bytes(source)) for source in unique.values()]
        try:
            found = await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # after the first failure (or the caller's cancellation) the others are not wanted
                task.cancel()
        return dict(zip(unique, found, strict=True))

    def _cap(self, source: MediaSource) -> int:
        return self.max_audio_bytes if source.kind == "audio" else self.max_bytes

    async def _bytes(self, source: MediaSource) -> bytes:
        if media_parts.url_kind(source) == "http":
            return await self._fetch(source)
        if len(source.url) > _THREAD_DECODE_CHARS:
            return await asyncio.to_thread(media_parts.data_url_bytes, source, self._cap(source))
        return media_parts.data_url_bytes(source, self._cap(source))

    async def _fetch(self, source: MediaSource) -> bytes:
        try:
            async with asyncio.timeout(self.timeout_s):
                url = httpx.URL(source.url)
                for _ in range(self.max_redirects + 1):
                    target, headers = await self._route(url, source)
                    headers["accept"] = _ACCEPT[source.kind]
                    async with self._client().stream("GET", target, headers=headers) as response:
                        if not response.has_redirect_location:
                            return await self._body(response, source)
                        url = url.join(response.headers["location"])  # against the name, not a pinned address
                    if url.scheme not in ("http", "https"):
                        raise invalid(f"the {source.kind} URL redirects to a URL that is not http(s): "
                                      f"{str(url)[:100]}", source.param)
        except (TimeoutError, httpx.TimeoutException):
            raise invalid(f"fetching the {source.kind} took longer than {self.timeout_s:g} s", source.param) from None
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:  # ValueError: a host IDNA cannot encode
            raise invalid(f"the {source.kind} could not be fetched ({type(exc).__name__}: {exc})",
                          source.param) from None
        raise invalid(f"the {source.kind} URL redirects more than {self.max_redirects} times", source.param)

    async def _route(self, url: httpx.URL, source: MediaSource) -> tuple[httpx.URL, dict[str, str]]:
        """Where one hop's GET goes, and the headers that say what it is for: a 400 naming the source unless its
        host is allowed (module docstring). A listed host is fetched by name; another is checked, and a plain-http
        one sent to the address checked with its name in the Host header."""
        host = url.host  # httpx's parse, the one it connects by (lowercase; an IPv6 literal without brackets)
        media_parts.check_host(host, source, self.allowed_domains)
        if host in self.allowed_domains:
            return url, {}
        # the name as httpx sends it (IDNA 2008): the socket module would encode `host` by IDNA 2003, which reads
        # some names (straße.de) as another host than the one an https hop then connects to
        wire_host = url.raw_host.decode("ascii")
        address = await media_hosts.public_address(wire_host, url.port or _DEFAULT_PORTS[url.scheme],
                                                   source.param, self.resolver)
        if url.scheme == "https":
            return url, {}
        return url.copy_with(host=address), {"host": url.netloc.decode("ascii")}

    async def _body(self, response: httpx.Response, source: MediaSource) -> bytes:
        if not response.is_success:
            raise invalid(f"fetching the {source.kind} answered HTTP {response.status_code} "
                          f"{response.reason_phrase}", source.param)
        media_type = response.headers.get("content-type", "").partition(";")[0].strip().lower()
        if not source.takes(media_type, fetched=True):
            raise source.wrong_type(f"the {source.kind} URL's content type", media_type)
        cap = self._cap(source)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise media_parts.too_large(source, cap)
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) > cap:
                raise media_parts.too_large(source, cap)
        if not data:
            raise invalid(f"the {source.kind} URL answered no data", source.param)
        return bytes(data)

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(headers=_HEADERS, timeout=self.timeout_s, follow_redirects=False,
                                           transport=self._transport)
        return self._http
