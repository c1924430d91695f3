"""Every image URL of a request as its file's bytes, before the request is translated: `MediaFetcher.images`.

A data: URL is decoded (`translate.images.data_url_bytes`; a large one in a thread); an http(s) URL is fetched
with one shared httpx client: all of a request's images at once, each within the timeout (redirects included,
at most MAX_REDIRECTS of them, every hop's host checked against the allowed media domains), its body streamed and
cut off at the byte cap, its content type an image's. Whatever fails is a 400 naming the image's field and saying
what went wrong, and nothing is sent to the engine. The URLs are checked (scheme, host) before anything is
fetched, and the first that fails is the one reported; the same URL twice is fetched once, and a request holds at
most MAX_IMAGES distinct ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx

from gateway.config import DEFAULT_IMAGE_FETCH_TIMEOUT_S, DEFAULT_MAX_IMAGE_BYTES, GatewayConfig
from gateway.errors import invalid
from gateway.translate import images
from gateway.translate.images import ImageSource

MAX_REDIRECTS = 5
MAX_IMAGES = 500  # distinct image URLs in one request (OpenAI's per-request limit): bounds the fetches it starts
_THREAD_DECODE_CHARS = 1 << 20  # a data: URL longer than this is decoded off the event loop
_HEADERS = {"accept": "image/*", "user-agent": "ladle-gateway"}


class MediaFetcher:
    """Fetches and decodes images for the routes (one per app: its httpx client is opened on the first fetch
    and closed by `aclose`). `allowed_domains`: the hosts images may come from (empty: any)."""

    def __init__(
        self,
        timeout_s: float = DEFAULT_IMAGE_FETCH_TIMEOUT_S,
        max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        allowed_domains: Sequence[str] = (),
        max_redirects: int = MAX_REDIRECTS,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.allowed_domains = frozenset(domain.lower() for domain in allowed_domains)
        self.max_redirects = max_redirects
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
                images.check_host(source.url, source.param, self.allowed_domains)
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
        url = source.url
        try:
            async with asyncio.timeout(self.timeout_s):
                for _ in range(self.max_redirects + 1):
                    images.check_host(url, source.param, self.allowed_domains)
                    async with self._client().stream("GET", url) as response:
                        redirect = response.next_request
                        if redirect is None:
                            return await self._body(response, source)
                    url = str(redirect.url)
                    if redirect.url.scheme not in ("http", "https"):
                        raise invalid(f"the image URL redirects to a URL that is not http(s): {url[:100]}",
                                      source.param)
        except (TimeoutError, httpx.TimeoutException):
            raise invalid(f"fetching the image took longer than {self.timeout_s:g} s", source.param) from None
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:  # ValueError: a host IDNA cannot encode
            raise invalid(f"the image could not be fetched ({type(exc).__name__}: {exc})", source.param) from None
        raise invalid(f"the image URL redirects more than {self.max_redirects} times", source.param)

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
            self._http = httpx.AsyncClient(headers=_HEADERS, timeout=self.timeout_s, follow_redirects=False)
        return self._http
