"""Every image URL of a request as its file's bytes, before the request is translated: `MediaFetcher.images`.

A data: URL is decoded (`translate.images.data_url_bytes`; a large one in a thread); an http(s) URL is fetched
with one shared httpx client: all of a request's images at once, each within the timeout (redirects included,
at most MAX_REDIRECTS of them), its body streamed and cut off at the byte cap, its content type an image's.
Whatever fails is a 400 naming the image's field and saying what went wrong, and nothing is sent to the engine.
The URLs are checked (scheme, host) before anything is fetched, and the first that fails is the one reported; the
same URL twice is fetched once, and a request holds at most MAX_IMAGES distinct ones.

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
from gateway.config import DEFAULT_IMAGE_FETCH_TIMEOUT_S, DEFAULT_MAX_IMAGE_BYTES, GatewayConfig
from gateway.errors import invalid
from gateway.translate import images
from gateway.translate.images import ImageSource

MAX_REDIRECTS = 5
MAX_IMAGES = 500  # distinct image URLs in one request (OpenAI's per-request limit): bounds the fetches it starts
_THREAD_DECODE_CHARS = 1 << 20  # a data: URL longer than this is decoded off the event loop
_HEADERS = {"accept": "image/*", "user-agent": "ladle-gateway"}
_DEFAULT_PORTS = {"http": 80, "https": 443}


class MediaFetcher:
    """Fetches and decodes images for the routes (one per app: its httpx client is opened on the first fetch
    and closed by `aclose`). `allowed_domains`: the hosts images may come from, trusted whatever they resolve to
    (empty: any host whose addresses are all public). `resolver` and `transport` are the network's two ends,
    swapped by tests for fakes (by default the system resolver and httpx's own transport)."""

    def __init__(
        self,
        timeout_s: float = DEFAULT_IMAGE_FETCH_TIMEOUT_S,
        max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        allowed_domains: Sequence[str] = (),
        max_redirects: int = MAX_REDIRECTS,
        resolver: media_hosts.Resolver = media_hosts.resolve,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.allowed_domains = frozenset(domain.lower() for domain in allowed_domains)
        self.max_redirects = max_redirects
        self.resolver = resolver
        self._transport = transport
        self._http: httpx.AsyncClient | None = None

    @classmethod
    def from_config(cls, config: GatewayConfig) -> MediaFetcher:
        return cls(config.image_fetch_timeout_s, config.max_image_bytes, config.allowed_media_domains)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def images(self, sources: Sequence[ImageSource]) -> dict[str, bytes]:
        """The bytes of each distinct URL of `sources` (`translate.images.ImageBytes`); APIError (400) naming
        the first image, in order, whose URL is refused, else the first whose fetch fails."""
        unique: dict[str, ImageSource] = {}
        for source in sources:
            unique.setdefault(source.url, source)
        if len(unique) > MAX_IMAGES:
            raise invalid(f"a request may hold at most {MAX_IMAGES} distinct images", list(unique.values())[-1].param)
        for source in unique.values():
            if images.url_kind(source) == "http":
                images.check_host(urlsplit(source.url).hostname or "", source.param, self.allowed_domains)
        if not unique:
            return {}
        tasks = [asyncio.ensure_future(self._bytes(source)) for source in unique.values()]
        try:
            found = await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # after the first failure (or the caller's cancellation) the others are not wanted
                task.cancel()
        return dict(zip(unique, found, strict=True))

    async def _bytes(self, source: ImageSource) -> bytes:
        if images.url_kind(source) == "http":
            return await self._fetch(source)
        if len(source.url) > _THREAD_DECODE_CHARS:
            return await asyncio.to_thread(images.data_url_bytes, source, self.max_bytes)
        return images.data_url_bytes(source, self.max_bytes)

    async def _fetch(self, source: ImageSource) -> bytes:
        try:
            async with asyncio.timeout(self.timeout_s):
                url = httpx.URL(source.url)
                for _ in range(self.max_redirects + 1):
                    target, headers = await self._route(url, source.param)
                    async with self._client().stream("GET", target, headers=headers) as response:
                        if not response.has_redirect_location:
                            return await self._body(response, source)
                        url = url.join(response.headers["location"])  # against the name, not a pinned address
                    if url.scheme not in ("http", "https"):
                        raise invalid(f"the image URL redirects to a URL that is not http(s): {str(url)[:100]}",
                                      source.param)
        except (TimeoutError, httpx.TimeoutException):
            raise invalid(f"fetching the image took longer than {self.timeout_s:g} s", source.param) from None
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:  # ValueError: a host IDNA cannot encode
            raise invalid(f"the image could not be fetched ({type(exc).__name__}: {exc})", source.param) from None
        raise invalid(f"the image URL redirects more than {self.max_redirects} times", source.param)

    async def _route(self, url: httpx.URL, param: str) -> tuple[httpx.URL, dict[str, str]]:
        """Where one hop's GET goes, and the headers that say what it is for: a 400 naming `param` unless its host
        is allowed (module docstring). A listed host is fetched by name; another is checked, and a plain-http one
        sent to the address checked with its name in the Host header."""
        host = url.host  # httpx's parse, the one it connects by (lowercase; an IPv6 literal without brackets)
        images.check_host(host, param, self.allowed_domains)
        if host in self.allowed_domains:
            return url, {}
        # the name as httpx sends it (IDNA 2008): the socket module would encode `host` by IDNA 2003, which reads
        # some names (straße.de) as another host than the one an https hop then connects to
        wire_host = url.raw_host.decode("ascii")
        address = await media_hosts.public_address(wire_host, url.port or _DEFAULT_PORTS[url.scheme], param,
                                                   self.resolver)
        if url.scheme == "https":
            return url, {}
        return url.copy_with(host=address), {"host": url.netloc.decode("ascii")}

    async def _body(self, response: httpx.Response, source: ImageSource) -> bytes:
        if not response.is_success:
            raise invalid(f"fetching the image answered HTTP {response.status_code} {response.reason_phrase}",
                          source.param)
        media_type = response.headers.get("content-type", "").partition(";")[0].strip().lower()
        if not media_type.startswith("image/"):
            raise invalid(f"the image URL's content type is {media_type or 'missing'}, not an image (image/png, "
                          "image/jpeg, ...)", source.param)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise images.too_large(source.param, self.max_bytes)
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) > self.max_bytes:
                raise images.too_large(source.param, self.max_bytes)
        if not data:
            raise invalid("the image URL answered no data", source.param)
        return bytes(data)

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(headers=_HEADERS, timeout=self.timeout_s, follow_redirects=False,
                                           transport=self._transport)
        return self._http
