"""Images in chat messages through the gateway: the pure translation (data: URLs into ordered `content_parts`, text-only
messages unchanged, every malformed image a 400 naming its field), `MediaFetcher` against a real HTTP server on
loopback, listed as allowed (fetches, redirects, timeouts, caps, content types, allowed domains), the refusal of
hosts that resolve to non-public addresses (against the real server, and a fake resolver and transport where the
test must not touch the network), and the routes and batch lines that carry images to the fake engine."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from PIL import Image

from gateway.batches import lines
from gateway.batches.line_runner import LineResult, LineRunner
from gateway.config import GatewayConfig
from gateway.engines import EnginePool
from gateway.errors import APIError
from gateway.media import MediaFetcher
from gateway.media_hosts import is_public
from gateway.schemas.chat import BatchChatCompletionRequest, ChatCompletionRequest
from gateway.schemas.pooling import EmbeddingRequest
from gateway.translate import pooling_to_engine, responses_to_engine, to_engine
from gateway.translate.media_parts import ImageSource, chat_media_sources, unfetched
from ladle_cli.main import _gateway_config, build_parser
from tests.unit.fake_engine import MODEL, FakeEngine, gateway_client, start_fake_engine


def png(width: int = 3, height: int = 2, color: str = "red") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, "PNG")
    return buffer.getvalue()


RED, BLUE = png(), png(color="blue")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(url: str, detail: str | None = None) -> dict[str, Any]:
    image: dict[str, Any] = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": image}


def text_part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def chat_body(*content: Any, **fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": list(content)}], **fields})


def translated(body: ChatCompletionRequest) -> Any:
    """The engine's chat input of `body`, its images decoded as the routes do for data: URLs."""
    images = unfetched(chat_media_sources(body.messages))
    return to_engine.chat_request(body, body.messages, "r", images=images).input.chat


def refusal(build: Any) -> APIError:
    with pytest.raises(APIError) as raised:
        build()
    assert raised.value.status == 400
    return raised.value


# --- the pure translation ---


def test_a_message_with_images_is_sent_as_ordered_parts_with_the_decoded_bytes() -> None:
    body = chat_body(text_part("look"), image_part(data_url(RED), "low"), text_part("and"), text_part("this"),
                     image_part(data_url(BLUE)))
    (message,) = translated(body).messages
    assert message.content == ""
    kinds = [p.WhichOneof("part") for p in message.content_parts]
    assert kinds == ["text", "image", "text", "text", "image"]  # adjacent text parts stay apart
    assert [p.text for p in message.content_parts if p.HasField("text")] == ["look", "and", "this"]
    assert [p.image.data for p in message.content_parts if p.HasField("image")] == [RED, BLUE]


def test_text_only_messages_are_sent_as_before() -> None:
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [text_part("a"), text_part("b")]},
        {"role": "assistant", "content": None},
    ]})
    messages = to_engine.chat_request(body, body.messages, "r").input.chat.messages
    assert [m.content for m in messages] == ["Be brief.", "a\nb", ""]
    assert not any(m.content_parts for m in messages)


def test_the_url_may_be_a_bare_string_with_or_without_a_type() -> None:
    body = chat_body({"type": "image_url", "image_url": data_url(RED)}, {"image_url": data_url(BLUE)})
    assert [s.param for s in chat_media_sources(body.messages)] == [
        "messages[0].content[0].image_url", "messages[0].content[1].image_url"]
    assert [p.image.data for p in translated(body).messages[0].content_parts] == [RED, BLUE]


@pytest.mark.parametrize(("url", "says"), [
    ("data:image/png;base64" + base64.b64encode(RED).decode(), "no ','"),
    ("data:image/png," + base64.b64encode(RED).decode(), "base64-encoded"),
    ("data:image/png;base64,not base64!", "valid base64"),
    ("data:image/png;base64,", "no data"),
    (data_url(b"hello", "text/plain"), "text/plain, not an image"),
    ("data:;base64,aGk=", "missing, not an image"),
    ("ftp://example.com/a.png", "scheme is ftp:"),
    ("file:///etc/passwd", "scheme is file:"),
    ("a.png", "scheme is none"),
    ("https:///a.png", "no host"),
])
def test_a_malformed_image_url_is_a_400_naming_it(url: str, says: str) -> None:
    body = chat_body(text_part("x"), image_part(url))
    error = refusal(lambda: translated(body))
    assert error.param == "messages[0].content[1].image_url.url"
    assert says in error.message
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_a_data_url_larger_than_the_cap_is_refused_before_and_after_decoding() -> None:
    source = ImageSource(data_url(b"x" * 100), "messages[0].content[0].image_url.url")
    media = MediaFetcher(max_bytes=99)
    error = refusal(lambda: asyncio.run(media.fetch([source])))
    assert error.param == source.param and "larger than this server takes (99 bytes)" in error.message
    assert asyncio.run(MediaFetcher(max_bytes=100).fetch([source])) == {source.url: b"x" * 100}
    far = ImageSource(data_url(b"x" * 10_000), source.param)  # the payload's length alone refuses it
    assert "larger" in refusal(lambda: asyncio.run(media.fetch([far]))).message


@pytest.mark.parametrize(("part", "param"), [
    ({"type": "file", "file": {"file_id": "file-1"}}, "messages[0].content[1].type"),  # audio: test_gateway_audio
    ({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, "messages[0].content[1].type"),
    ({"type": "image_url"}, "messages[0].content[1].image_url"),
    ({"type": "text"}, "messages[0].content[1].text"),
])
def test_other_parts_are_refused_by_name_beside_an_image_or_not(part: dict[str, Any], param: str) -> None:
    for first in (text_part("x"), image_part(data_url(RED))):
        assert refusal(lambda first=first: translated(chat_body(first, part))).param == param


def test_a_route_that_reads_no_images_refuses_them() -> None:
    body = EmbeddingRequest.model_validate({"model": MODEL, "messages": [
        {"role": "user", "content": [image_part(data_url(RED))]}]})
    error = refusal(lambda: pooling_to_engine.embed_request(body, "r"))
    assert error.param == "messages[0].content[0].type" and "not read on this route" in error.message


def test_the_schema_takes_the_image_url_part_with_detail() -> None:
    part = chat_body(image_part("https://example.com/a.png", "high")).messages[0].content
    assert isinstance(part, list) and part[0].image_source() == ("https://example.com/a.png", "image_url.url")
    schema = json.dumps(ChatCompletionRequest.model_json_schema())
    assert '"detail"' in schema and '"ImageURL"' in schema


# --- fetching over HTTP ---


class ImageServer(ThreadingHTTPServer):
    daemon_threads = True
    hits: Counter[str]


class Handler(BaseHTTPRequestHandler):
    server: ImageServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        path, query = urlsplit(self.path).path, parse_qs(urlsplit(self.path).query)
        self.server.hits[path] += 1
        if path == "/slow.png":
            time.sleep(float(query["delay"][0]))
            path = "/red.png"
        if path in ("/red.png", "/blue.png"):
            self.reply(200, "image/png", RED if path == "/red.png" else BLUE)
        elif path == "/page":
            self.reply(200, "text/html; charset=utf-8", b"<html></html>")
        elif path == "/big.png":
            self.reply(200, "image/png", b"x" * 2000)
        elif path == "/streamed.png":  # no Content-Length: the body ends when the connection closes (HTTP/1.0)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for _ in range(20):
                self.wfile.write(b"x" * 100)
        elif path == "/empty.png":
            self.reply(200, "image/png", b"")
        elif path in ("/redirect", "/loop", "/elsewhere"):
            target = {"/redirect": "/red.png", "/loop": "/loop",
                      "/elsewhere": f"http://127.0.0.1:{self.server.server_port}/red.png"}[path]
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.reply(404, "text/plain", b"no such image")

    def reply(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def server() -> Iterator[ImageServer]:
    httpd = ImageServer(("127.0.0.1", 0), Handler)
    httpd.hits = Counter()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


LOOPBACK = ("127.0.0.1",)  # the test server's host, listed: a loopback host is refused unless the operator lists it


def at(server: ImageServer, path: str, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{server.server_port}{path}"


async def fetch(url: str, allowed_domains: Sequence[str] = LOOPBACK, **settings: Any) -> bytes:
    media = MediaFetcher(allowed_domains=allowed_domains, **settings)
    try:
        found = await media.fetch([ImageSource(url, "messages[0].content[0].image_url.url")])
    finally:
        await media.aclose()
    return found[url]


async def fetch_refused(url: str, **settings: Any) -> APIError:
    with pytest.raises(APIError) as raised:
        await fetch(url, **settings)
    assert raised.value.status == 400 and raised.value.param == "messages[0].content[0].image_url.url"
    return raised.value


async def test_an_http_image_is_fetched_and_a_redirect_followed(server: ImageServer) -> None:
    assert await fetch(at(server, "/red.png")) == RED
    assert await fetch(at(server, "/redirect")) == RED
    assert await fetch(at(server, "/streamed.png")) == b"x" * 2000


async def test_a_requests_images_are_fetched_at_once_and_each_url_once(server: ImageServer) -> None:
    media = MediaFetcher(allowed_domains=LOOPBACK)
    slow = [at(server, f"/slow.png?delay=0.4&n={i}") for i in range(3)]
    sources = [ImageSource(url, f"p{i}") for i, url in enumerate([*slow, slow[0], at(server, "/blue.png")])]
    before = server.hits["/slow.png"]
    started = time.monotonic()
    try:
        found = await media.fetch(sources)
    finally:
        await media.aclose()
    assert time.monotonic() - started < 1.0  # three 0.4 s fetches side by side, not one after another
    assert found == {slow[0]: RED, slow[1]: RED, slow[2]: RED, at(server, "/blue.png"): BLUE}
    assert server.hits["/slow.png"] - before == 3


async def test_a_request_holds_a_bounded_number_of_images() -> None:
    from gateway.media import MAX_MEDIA

    sources = [ImageSource(data_url(bytes([i % 256, i // 256])), f"p{i}") for i in range(MAX_MEDIA + 1)]
    assert len(await MediaFetcher().fetch(sources[:MAX_MEDIA])) == MAX_MEDIA
    with pytest.raises(APIError) as raised:
        await MediaFetcher().fetch(sources)
    assert raised.value.param == f"p{MAX_MEDIA}" and f"at most {MAX_MEDIA} distinct images" in raised.value.message


@pytest.mark.parametrize(("path", "says", "settings"), [
    ("/missing.png", "answered HTTP 404 Not Found", {}),
    ("/page", "content type is text/html, not an image", {}),
    ("/big.png", "larger than this server takes (1000 bytes)", {"max_bytes": 1000}),
    ("/streamed.png", "larger than this server takes (1000 bytes)", {"max_bytes": 1000}),
    ("/empty.png", "answered no data", {}),
    ("/loop", "redirects more than 3 times", {"max_redirects": 3}),
    ("/slow.png?delay=3", "took longer than 0.3 s", {"timeout_s": 0.3}),
])
async def test_a_failed_fetch_is_a_400_saying_why(
    server: ImageServer, path: str, says: str, settings: dict[str, Any]
) -> None:
    started = time.monotonic()
    error = await fetch_refused(at(server, path), **settings)
    assert says in error.message
    assert time.monotonic() - started < 2.5


async def test_an_unreachable_host_is_a_400(server: ImageServer) -> None:
    closed = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = closed.server_port
    closed.server_close()  # nothing listens there now
    assert "could not be fetched (ConnectError" in (await fetch_refused(f"http://127.0.0.1:{port}/a.png")).message
    idna = await fetch_refused("https://xn--/a.png", allowed_domains=())  # a host IDNA refuses
    assert "could not be fetched" in idna.message


async def test_only_the_allowed_domains_are_fetched_from_every_redirect_included(server: ImageServer) -> None:
    before = server.hits["/red.png"]
    error = await fetch_refused(at(server, "/red.png"), allowed_domains=["localhost"])
    assert "fetched only from localhost; this URL's host is 127.0.0.1" in error.message
    assert server.hits["/red.png"] == before  # refused before anything was sent
    assert await fetch(at(server, "/red.png", "localhost"), allowed_domains=["LocalHost"]) == RED
    hop = await fetch_refused(at(server, "/elsewhere", "localhost"), allowed_domains=["localhost"])
    assert "host is 127.0.0.1" in hop.message and server.hits["/red.png"] == before + 1


# --- hosts that resolve to non-public addresses ---


PUBLIC, OTHER_PUBLIC = "93.184.216.34", "2606:4700::1111"


class FakeNetwork:
    """A resolver of made-up names and a transport that records what is sent instead of sending it: the
    path `/to/<url>` answers a 302 to `<url>`, any other a red PNG."""

    def __init__(self, names: dict[str, list[str]]) -> None:
        self.names = names
        self.sent: list[httpx.Request] = []
        self.transport = httpx.MockTransport(self._answer)

    async def resolve(self, host: str, port: int) -> list[str]:
        host = host.encode("idna").decode("ascii")  # as socket.getaddrinfo encodes a name it is given (IDNA 2003)
        if host not in self.names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return self.names[host]

    def _answer(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        if request.url.path.startswith("/to/"):
            return httpx.Response(302, headers={"location": request.url.path.removeprefix("/to/")})
        return httpx.Response(200, headers={"content-type": "image/png"}, content=RED)

    def media(self, allowed_domains: Sequence[str] = ()) -> dict[str, Any]:
        return {"allowed_domains": allowed_domains, "resolver": self.resolve, "transport": self.transport}


@pytest.mark.parametrize(("address", "public"), [
    ("8.8.8.8", True), (PUBLIC, True), (OTHER_PUBLIC, True), ("::ffff:8.8.8.8", True),
    ("127.0.0.1", False), ("127.8.9.10", False), ("::1", False), ("0.0.0.0", False), ("::", False),
    ("10.0.0.1", False), ("172.16.5.4", False), ("192.168.1.1", False), ("100.64.0.1", False),
    ("169.254.169.254", False), ("fe80::1", False), ("fe80::1%eth0", False), ("fd00:ec2::254", False),
    ("224.0.0.1", False), ("ff02::1", False), ("240.0.0.1", False), ("255.255.255.255", False),
    ("192.0.2.1", False), ("2001:db8::1", False), ("::7f00:1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:169.254.169.254", False), ("2002:7f00:1::", False),
    ("64:ff9b::a9fe:a9fe", False), ("64:ff9b::808:808", True),
])
def test_only_globally_routable_addresses_are_public(address: str, public: bool) -> None:
    assert is_public(address) is public


async def test_a_loopback_host_is_refused_by_default_by_address_and_by_name(server: ImageServer) -> None:
    before = sum(server.hits.values())
    for host in ("127.0.0.1", "localhost", "[::ffff:127.0.0.1]"):
        error = await fetch_refused(at(server, "/red.png", host), allowed_domains=())
        assert f"host {host.strip('[]')} resolves to a non-public address" in error.message
        assert "--allowed-media-domains" in error.message
    assert sum(server.hits.values()) == before  # refused before anything was sent
    assert await fetch(at(server, "/red.png")) == RED  # listed, the same host is fetched
    assert await fetch(at(server, "/red.png", "localhost"), allowed_domains=["localhost"]) == RED


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "https://169.254.169.254/", "http://[::ffff:169.254.169.254]/", "http://[fd00:ec2::254]/",
    "http://10.0.0.1/a.png", "http://192.168.0.1:8080/a.png", "http://[::1]/a.png", "http://0.0.0.0/a.png",
    "http://metadata.internal/a.png",  # a name that resolves to the metadata endpoint
    "http://mixed.example/a.png",  # one public address and one private: the connection could use either
])
async def test_a_non_public_host_is_refused_before_anything_is_sent(url: str) -> None:
    network = FakeNetwork({"metadata.internal": ["169.254.169.254"], "mixed.example": [PUBLIC, "10.1.2.3"]})
    error = await fetch_refused(url, **network.media())
    assert "resolves to a non-public address" in error.message and "--allowed-media-domains" in error.message
    assert network.sent == []


async def test_a_redirect_from_a_public_host_to_a_non_public_one_is_refused() -> None:
    network = FakeNetwork({"redirect.example": [PUBLIC], "internal.example": ["10.0.0.7"], "localhost": ["::1"]})
    for target in ("http://127.0.0.1:8080/red.png", "http://internal.example/red.png", "/to/http://localhost/"):
        network.sent.clear()
        error = await fetch_refused(f"http://redirect.example/to/{target}", **network.media())
        assert "resolves to a non-public address" in error.message
        assert [r.headers["host"] for r in network.sent] == ["redirect.example"] * (1 + target.startswith("/"))


async def test_a_public_host_is_fetched_over_http_at_the_address_checked() -> None:
    network = FakeNetwork({"images.example": [OTHER_PUBLIC, PUBLIC], "redirect.example": [PUBLIC]})
    assert await fetch("http://images.example:8080/a.png?x=1", **network.media()) == RED
    (sent,) = network.sent
    assert (str(sent.url), sent.headers["host"]) == (f"http://[{OTHER_PUBLIC}]:8080/a.png?x=1", "images.example:8080")
    network.sent.clear()  # a relative redirect is joined to the name, not to the address it was sent to
    assert await fetch("http://redirect.example/to//b.png", **network.media()) == RED
    assert [(r.url.host, r.url.path, r.headers["host"]) for r in network.sent] == [
        (PUBLIC, "/to//b.png", "redirect.example"), (PUBLIC, "/b.png", "redirect.example")]


async def test_an_https_host_is_checked_but_fetched_by_name() -> None:
    network = FakeNetwork({"images.example": [PUBLIC]})
    assert await fetch("https://images.example/a.png", **network.media()) == RED
    assert [(str(r.url), r.headers["host"]) for r in network.sent] == [("https://images.example/a.png",
                                                                         "images.example")]


async def test_the_name_checked_is_the_one_connected_to() -> None:
    # IDNA 2003 (the socket module's) reads straße.de as strasse.de; httpx sends xn--strae-oqa.de (IDNA 2008)
    network = FakeNetwork({"strasse.de": [PUBLIC], "xn--strae-oqa.de": ["10.0.0.7"]})
    error = await fetch_refused("https://straße.de/a.png", **network.media())
    assert "host xn--strae-oqa.de resolves to a non-public address" in error.message and network.sent == []


async def test_a_listed_host_is_fetched_whatever_it_resolves_to_and_an_unknown_name_is_a_400() -> None:
    network = FakeNetwork({"images.internal": ["10.0.0.7"]})
    assert await fetch("http://images.internal/a.png", **network.media(["images.internal"])) == RED
    assert network.sent[0].url.host == "images.internal"  # fetched by name: the operator vouched for it
    error = await fetch_refused("http://nowhere.example/a.png", **network.media())
    assert "host nowhere.example could not be resolved" in error.message


# --- the routes ---


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeEngine, str]]:
    engine = FakeEngine()
    grpc_server, address = await start_fake_engine(engine)
    yield engine, address
    await grpc_server.stop(None)


async def test_chat_sends_data_and_fetched_images_in_order(
    fake: tuple[FakeEngine, str], server: ImageServer, tmp_path: Path
) -> None:
    content = [text_part("a"), image_part(data_url(RED)), text_part("b"), image_part(at(server, "/blue.png"))]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    async with gateway_client(fake[1], tmp_path, allowed_media_domains=LOOPBACK) as http:
        reply = await http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == f"A<IMAGE {len(RED)}>B<IMAGE {len(BLUE)}>"
        assert fake[0].images == [RED, BLUE]
        streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
            f"A<IMAGE {len(RED)}>B<IMAGE {len(BLUE)}>"
        text_only = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": [text_part("plain"), text_part("text")]}]})
        assert text_only.json()["choices"][0]["message"]["content"] == "PLAIN\nTEXT"


async def test_chat_answers_a_failed_image_in_openais_shape_before_calling_the_engine(
    fake: tuple[FakeEngine, str], server: ImageServer, tmp_path: Path
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [
        image_part(data_url(RED)), text_part("x"), image_part(at(server, "/missing.png"))]}]}
    async with gateway_client(fake[1], tmp_path, allowed_media_domains=("localhost",)) as http:
        reply = await http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == "messages[0].content[2].image_url.url" and "host is 127.0.0.1" in error["message"]
        assert fake[0].generated == 0
    async with gateway_client(fake[1], tmp_path, allowed_media_domains=LOOPBACK) as http:
        reply = await http.post("/v1/chat/completions", json=body)
        assert reply.json()["error"]["param"] == "messages[0].content[2].image_url.url"
        assert "HTTP 404" in reply.json()["error"]["message"]
    async with gateway_client(fake[1], tmp_path) as http:  # by default, a loopback host is refused
        reply = await http.post("/v1/chat/completions", json=body)
        assert reply.json()["error"]["param"] == "messages[0].content[2].image_url.url"
        assert "non-public address" in reply.json()["error"]["message"] and fake[0].generated == 0


async def test_a_text_models_engine_refusal_of_an_image_reaches_the_caller(tmp_path: Path) -> None:
    engine = FakeEngine(reads_images=False)
    grpc_server, address = await start_fake_engine(engine)
    try:
        async with gateway_client(address, tmp_path) as http:
            reply = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
                {"role": "user", "content": [text_part("x"), image_part(data_url(RED))]}]})
    finally:
        await grpc_server.stop(None)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "messages[0].content[1]" and "text only" in error["message"]


async def test_the_batched_chat_route_names_the_conversation_of_a_failed_image(
    fake: tuple[FakeEngine, str], server: ImageServer, tmp_path: Path
) -> None:
    def conversation(url: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [text_part("q"), image_part(url)]}]

    good = {"model": MODEL, "messages": [conversation(data_url(RED)), conversation(at(server, "/blue.png"))]}
    BatchChatCompletionRequest.model_validate(good)
    async with gateway_client(fake[1], tmp_path, allowed_media_domains=LOOPBACK) as http:
        reply = await http.post("/v1/chat/completions/batch", json=good)
        assert reply.status_code == 200, reply.text
        assert [c["message"]["content"] for c in reply.json()["choices"]] == [
            f"Q<IMAGE {len(RED)}>", f"Q<IMAGE {len(BLUE)}>"]
        bad = {**good, "messages": [conversation(data_url(RED)), conversation(at(server, "/page"))]}
        error = (await http.post("/v1/chat/completions/batch", json=bad)).json()["error"]
        assert error["param"] == "messages[1][0].content[1].image_url.url"


async def test_the_responses_route_takes_input_images(
    fake: tuple[FakeEngine, str], server: ImageServer, tmp_path: Path
) -> None:
    content = [{"type": "input_text", "text": "what"}, {"type": "input_image", "image_url": data_url(RED)},
               {"type": "input_image", "image_url": at(server, "/blue.png"), "detail": "auto"}]
    async with gateway_client(fake[1], tmp_path, allowed_media_domains=LOOPBACK) as http:
        reply = await http.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": content}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["output"][0]["content"][0]["text"] == f"WHAT<IMAGE {len(RED)}><IMAGE {len(BLUE)}>"
        # the next turn reads the stored one's images again
        follow = await http.post("/v1/responses", json={"model": MODEL, "input": "and now?",
                                                         "previous_response_id": reply.json()["id"]})
        assert follow.status_code == 200, follow.text
        assert fake[0].images == [RED, BLUE, RED, BLUE]
        missing = [{"role": "user", "content": [{"type": "input_image", "image_url": at(server, "/missing.png")}]}]
        error = (await http.post("/v1/responses", json={"model": MODEL, "input": missing})).json()["error"]
        assert error["param"] == "input[0].content[0].image_url" and "HTTP 404" in error["message"]


@pytest.mark.parametrize(("part", "param"), [
    ({"type": "input_image", "file_id": "file-1", "image_url": "u"}, "input[0].content[0].file_id"),
    ({"type": "input_image", "image_url": "u"}, "input[0].content[0].image_url"),
    ({"type": "input_image"}, "input[0].content[0].image_url"),
    ({"type": "input_file", "file_id": "file-1"}, "input[0].content[0].type"),
])
def test_responses_refuses_images_it_cannot_read_by_name(part: dict[str, Any], param: str) -> None:
    from gateway.schemas.responses import ResponsesRequest

    body = ResponsesRequest.model_validate({"model": MODEL, "input": [{"role": "user", "content": [part]}]})
    assert refusal(lambda: responses_to_engine.input_items(body)).param == param


def test_the_gateway_flags_and_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["gateway"])
    config = _gateway_config(args, "127.0.0.1:1")
    assert (config.image_fetch_timeout_s, config.max_image_bytes, config.allowed_media_domains) == (
        10.0, 20 * 1024 * 1024, ())
    args = build_parser().parse_args(["gateway", "--image-fetch-timeout", "2.5", "--max-image-mib", "0.5",
                                      "--allowed-media-domains", "Images.example.com, cdn.example.org,"])
    config = _gateway_config(args, "127.0.0.1:1")
    assert (config.image_fetch_timeout_s, config.max_image_bytes, config.allowed_media_domains) == (
        2.5, 512 * 1024, ("images.example.com", "cdn.example.org"))
    monkeypatch.setenv("LADLE_ALLOWED_MEDIA_DOMAINS", "a.example")
    monkeypatch.setenv("LADLE_MAX_IMAGE_MIB", "1")
    config = _gateway_config(build_parser().parse_args(["serve"]), "127.0.0.1:1")
    assert (config.allowed_media_domains, config.max_image_bytes) == (("a.example",), 1024 * 1024)
    with pytest.raises(ValueError, match="max_image_bytes"):
        GatewayConfig(engines=("127.0.0.1:1",), max_image_bytes=0)


# --- batch lines ---


def batch_line(custom_id: str, url: str, **body: Any) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}}).encode()


def chat_line(custom_id: str, *content: Any) -> bytes:
    return batch_line(custom_id, "/v1/chat/completions", messages=[{"role": "user", "content": list(content)}])


def test_validating_a_line_checks_its_images_without_fetching_them(server: ImageServer) -> None:
    before = sum(server.hits.values())
    line = lines.parse_line(chat_line("a", image_part(at(server, "/red.png")), image_part(data_url(RED))), 1, 0,
                            None, MODEL)
    assert sum(server.hits.values()) == before and not line.images
    with pytest.raises(lines.InvalidLineError) as bad:
        lines.parse_line(chat_line("b", text_part("x"), image_part("data:image/png;base64,@@")), 2, 1, None, MODEL)
    assert (bad.value.error.param, bad.value.error.line) == ("body.messages[0].content[1].image_url.url", 2)
    with pytest.raises(lines.InvalidLineError) as scheme:
        lines.parse_line(batch_line("c", "/v1/responses", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "s3://bucket/a.png"}]}]), 3, 2, None, MODEL)
    assert scheme.value.error.param == "body.input[0].content[0].image_url"


async def test_the_line_runner_fetches_each_lines_images_and_errs_the_line_whose_fetch_fails(
    fake: tuple[FakeEngine, str], server: ImageServer
) -> None:
    raw = [
        chat_line("fetched", text_part("x"), image_part(at(server, "/slow.png?delay=0.2"))),
        chat_line("missing", image_part(at(server, "/missing.png"))),
        chat_line("inline", image_part(data_url(BLUE)), text_part("y")),
        batch_line("responses", "/v1/responses", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "r"}, {"type": "input_image", "image_url": at(server, "/blue.png")}]}]),
        chat_line("text", text_part("plain")),
    ]

    async def source() -> AsyncIterator[lines.InputLine]:
        for index, item in enumerate(raw):
            yield lines.parse_line(item, index + 1, index, None, MODEL)

    pool = EnginePool(GatewayConfig(engines=(fake[1],), health_interval_s=0.05))
    await pool.start()
    media = MediaFetcher(allowed_domains=LOOPBACK)
    results: list[LineResult] = []
    try:
        assert await pool.wait_ready(10)
        assert await LineRunner(pool, MODEL, media=media).run(source(), results.append, asyncio.Event())
    finally:
        await media.aclose()
        await pool.close()
    by_id = {r.line.custom_id: r.record["response"] for r in results}
    assert by_id["fetched"]["body"]["choices"][0]["message"]["content"] == f"X<IMAGE {len(RED)}>"
    assert by_id["inline"]["body"]["choices"][0]["message"]["content"] == f"<IMAGE {len(BLUE)}>Y"
    assert by_id["responses"]["body"]["output"][0]["content"][0]["text"] == f"R<IMAGE {len(BLUE)}>"
    assert by_id["text"]["body"]["choices"][0]["message"]["content"] == "PLAIN"
    missing = by_id["missing"]
    assert missing["status_code"] == 400
    assert missing["body"]["error"]["param"] == "messages[0].content[0].image_url.url"
    assert "HTTP 404" in missing["body"]["error"]["message"]
