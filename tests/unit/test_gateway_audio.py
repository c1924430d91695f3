"""Audio in chat messages through the gateway, as `test_gateway_images` tests images: the pure translation (OpenAI's
`input_audio` and vLLM's `audio_url` parts into ordered `content_parts` among text and images, every malformed clip
a 400 naming its field), `MediaFetcher` fetching clips from a real HTTP server on loopback (content types, caps, the
refusal of non-public hosts), and the routes (chat whole and streamed, through the openai SDK too; the batched chat
route; /tokenize) and batch lines that carry clips to the fake engine."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import struct
import threading
import wave
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import openai
import pytest

from gateway.batches import lines
from gateway.batches.line_runner import LineResult, LineRunner
from gateway.config import DEFAULT_MAX_AUDIO_BYTES, GatewayConfig
from gateway.engines import EnginePool
from gateway.errors import APIError
from gateway.media import MediaFetcher
from gateway.schemas.chat import ChatCompletionRequest
from gateway.schemas.pooling import EmbeddingRequest
from gateway.schemas.responses import ResponsesRequest
from gateway.translate import pooling_to_engine, responses_to_engine
from gateway.translate.media_parts import MediaKind, MediaSource, chat_media_sources
from ladle_cli.main import _gateway_config, build_parser
from tests.unit.fake_engine import MODEL, FakeEngine, gateway_client, start_fake_engine
from tests.unit.test_gateway_images import RED, chat_body, data_url, image_part, refusal, text_part, translated


def wav(seconds: float, tone: float = 440.0, rate: int = 16_000) -> bytes:
    """A mono 16-bit WAV file of a sine tone."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * tone * i / rate)))
                                 for i in range(int(seconds * rate))))
    return buffer.getvalue()


TONE, LOW = wav(0.01), wav(0.02, tone=220.0)
MP3 = b"ID3\x04\x00\x00\x00\x00\x00\x00\xff\xfb\x90\x00" + bytes(64)  # the gateway never decodes a clip


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def input_audio(data: bytes | str, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": data if isinstance(data, str) else b64(data),
                                                   "format": fmt}}


def audio_url(url: str) -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": url}}


def echo(*files: tuple[str, bytes] | str) -> str:
    """The fake engine's reply to a turn of these parts: text upper-cased, a file as `<KIND N>`."""
    return "".join(f if isinstance(f, str) else f"<{f[0].upper()} {len(f[1])}>" for f in files)


# --- the pure translation ---


def test_audio_parts_are_sent_as_ordered_parts_among_text_and_images() -> None:
    body = chat_body(text_part("hear"), input_audio(TONE), image_part(data_url(RED)), text_part("and"),
                     audio_url(data_url(LOW, "audio/wav")), input_audio(MP3, "mp3"))
    (message,) = translated(body).messages
    assert message.content == ""
    assert [p.WhichOneof("part") for p in message.content_parts] == ["text", "audio", "image", "text", "audio",
                                                                     "audio"]
    assert [p.audio.data for p in message.content_parts if p.HasField("audio")] == [TONE, LOW, MP3]
    assert [p.image.data for p in message.content_parts if p.HasField("image")] == [RED]


def test_every_audio_format_is_taken_and_the_url_may_be_a_bare_string() -> None:
    body = chat_body(*(input_audio(TONE, fmt) for fmt in ("wav", "mp3", "flac", "ogg")),
                     {"type": "audio_url", "audio_url": data_url(LOW, "audio/ogg")},
                     {"audio_url": data_url(TONE, "audio/mpeg")})
    assert [s.param for s in chat_media_sources(body.messages)][3:] == [
        "messages[0].content[3].input_audio.data", "messages[0].content[4].audio_url",
        "messages[0].content[5].audio_url"]
    assert {s.kind for s in chat_media_sources(body.messages)} == {"audio"}
    assert [p.audio.data for p in translated(body).messages[0].content_parts] == [TONE] * 4 + [LOW, TONE]


@pytest.mark.parametrize(("part", "param", "says"), [
    (input_audio("not base64!"), "input_audio.data", "not valid base64"),
    (input_audio("QUJ"), "input_audio.data", "not valid base64"),  # not padded
    (input_audio(""), "input_audio.data", "holds no data"),
    (input_audio(TONE, "m4a"), "input_audio.format", "'m4a' is not one ladle reads; give one of wav, mp3, flac, ogg"),
    (input_audio(TONE, "WAV"), "input_audio.format", "not one ladle reads"),
    (input_audio(TONE, ""), "input_audio.format", "not one ladle reads"),
    ({"type": "input_audio"}, "input_audio", "needs its clip"),
    ({"type": "audio_url"}, "audio_url", "needs its clip"),
    (audio_url(data_url(RED)), "audio_url.url", "media type is image/png, not audio"),
    (audio_url(data_url(b"hi", "text/plain")), "audio_url.url", "text/plain, not audio"),
    (audio_url("data:audio/wav," + b64(TONE)), "audio_url.url", "base64-encoded (data:audio/wav;base64,...)"),
    (audio_url("ftp://example.com/a.wav"), "audio_url.url", "an audio URL must be a data: URL"),
    (audio_url("https:///a.wav"), "audio_url.url", "names no host"),
    (image_part(data_url(TONE, "audio/wav")), "image_url.url", "audio/wav, not an image"),
])
def test_a_malformed_clip_is_a_400_naming_its_field(part: dict[str, Any], param: str, says: str) -> None:
    error = refusal(lambda: translated(chat_body(text_part("x"), part)))
    assert error.param == f"messages[0].content[1].{param}"
    assert says in error.message
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_the_audio_cap_is_the_audio_flags_and_the_image_cap_the_image_flags() -> None:
    clip = MediaSource(f"data:audio/wav;base64,{b64(b'x' * 100)}", "messages[0].content[0].input_audio.data", "audio")
    image = MediaSource(data_url(b"y" * 100), "messages[0].content[1].image_url.url")
    error = refusal(lambda: asyncio.run(MediaFetcher(max_audio_bytes=99).fetch([clip, image])))
    assert error.param == clip.param and "the audio is larger than this server takes (99 bytes)" in error.message
    assert asyncio.run(MediaFetcher(max_bytes=99, max_audio_bytes=100).fetch([clip])) == {clip.url: b"x" * 100}
    assert refusal(lambda: asyncio.run(MediaFetcher(max_bytes=99).fetch([clip, image]))).param == image.param
    assert MediaFetcher().max_audio_bytes == DEFAULT_MAX_AUDIO_BYTES == 25 * 1024 * 1024


def test_one_url_cannot_be_both_an_image_and_audio() -> None:
    body = chat_body(image_part("https://example.com/a"), text_part("x"), audio_url("https://example.com/a"))
    error = refusal(lambda: asyncio.run(MediaFetcher().fetch(chat_media_sources(body.messages))))
    assert error.param == "messages[0].content[2].audio_url.url" and "given as image at messages[0].content[0]" \
        in error.message


def test_a_route_that_reads_no_audio_refuses_it() -> None:
    body = EmbeddingRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": [
        text_part("x"), input_audio(TONE)]}]})
    error = refusal(lambda: pooling_to_engine.embed_request(body, "r"))
    assert error.param == "messages[0].content[1].type" and "audio parts are not read on this route" in error.message


@pytest.mark.parametrize("part", [input_audio(TONE), audio_url("https://example.com/a.wav")])
def test_responses_refuses_audio_saying_it_is_not_read_there(part: dict[str, Any]) -> None:
    body = ResponsesRequest.model_validate({"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "x"}, part]}]})
    error = refusal(lambda: responses_to_engine.input_items(body))
    assert error.param == "input[0].content[1].type" and "audio is not read on the Responses API" in error.message


def test_the_schema_documents_both_audio_parts() -> None:
    schema = json.dumps(ChatCompletionRequest.model_json_schema())
    assert '"InputAudio"' in schema and '"AudioURL"' in schema and '"format"' in schema


# --- fetching over HTTP ---


class AudioServer(ThreadingHTTPServer):
    daemon_threads = True
    accepts: list[str]


class Handler(BaseHTTPRequestHandler):
    server: AudioServer
    FILES: ClassVar[dict[str, tuple[str, bytes]]] = {  # path -> (content type, body)
        "/tone.wav": ("audio/wav", TONE), "/low.ogg": ("application/ogg", LOW),
        "/blob": ("application/octet-stream", TONE),
        "/tone.mp3": ("audio/mpeg; charset=binary", MP3), "/page": ("text/html", b"<html></html>"),
        "/red.png": ("image/png", RED), "/big.wav": ("audio/wav", b"x" * 2000), "/empty.wav": ("audio/wav", b""),
    }

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.accepts.append(self.headers.get("accept", ""))
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/tone.wav")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        content_type, body = self.FILES.get(self.path, ("text/plain", b"no such clip"))
        self.send_response(200 if self.path in self.FILES else 404)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def server() -> Iterator[AudioServer]:
    httpd = AudioServer(("127.0.0.1", 0), Handler)
    httpd.accepts = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


LOOPBACK = ("127.0.0.1",)  # the test server's host, listed: a loopback host is refused unless the operator lists it
PARAM = "messages[0].content[0].audio_url.url"


def at(server: AudioServer, path: str) -> str:
    return f"http://127.0.0.1:{server.server_port}{path}"


async def fetch(url: str, kind: MediaKind = "audio", **settings: Any) -> bytes:
    media = MediaFetcher(**{"allowed_domains": LOOPBACK, **settings})
    try:
        found = await media.fetch([MediaSource(url, PARAM, kind)])
    finally:
        await media.aclose()
    return found[url]


async def fetch_refused(url: str, kind: MediaKind = "audio", **settings: Any) -> APIError:
    with pytest.raises(APIError) as raised:
        await fetch(url, kind, **settings)
    assert raised.value.status == 400 and raised.value.param == PARAM
    return raised.value


async def test_a_clip_of_an_audio_content_type_is_fetched_and_a_redirect_followed(server: AudioServer) -> None:
    assert await fetch(at(server, "/tone.wav")) == TONE
    assert await fetch(at(server, "/redirect")) == TONE
    assert await fetch(at(server, "/low.ogg")) == LOW  # application/ogg: Ogg's registered type
    assert await fetch(at(server, "/blob")) == TONE  # application/octet-stream: a bucket's default
    assert await fetch(at(server, "/tone.mp3")) == MP3
    assert server.accepts[-1].startswith("audio/*")
    assert await fetch(at(server, "/red.png"), "image") == RED
    assert server.accepts[-1] == "image/*"


@pytest.mark.parametrize(("path", "kind", "says", "settings"), [
    ("/page", "audio", "the audio URL's content type is text/html, not audio (audio/wav, audio/mpeg, ...)", {}),
    ("/red.png", "audio", "content type is image/png, not audio", {}),
    ("/tone.wav", "image", "the image URL's content type is audio/wav, not an image", {}),
    ("/blob", "image", "content type is application/octet-stream, not an image", {}),
    ("/big.wav", "audio", "the audio is larger than this server takes (1000 bytes)", {"max_audio_bytes": 1000}),
    ("/missing.wav", "audio", "fetching the audio answered HTTP 404 Not Found", {}),
    ("/empty.wav", "audio", "the audio URL answered no data", {}),
])
async def test_a_failed_fetch_is_a_400_saying_why(
    server: AudioServer, path: str, kind: MediaKind, says: str, settings: dict[str, Any]
) -> None:
    assert says in (await fetch_refused(at(server, path), kind, **settings)).message


async def test_the_big_clip_passes_the_image_cap_and_a_non_public_host_is_refused(server: AudioServer) -> None:
    assert await fetch(at(server, "/big.wav"), max_bytes=1000) == b"x" * 2000  # the image cap is not the clip's
    before = len(server.accepts)
    error = await fetch_refused(at(server, "/tone.wav"), allowed_domains=())  # by default loopback is refused
    assert "host 127.0.0.1 resolves to a non-public address" in error.message
    assert "--allowed-media-domains" in error.message and len(server.accepts) == before  # nothing was sent
    network = httpx.MockTransport(lambda request: httpx.Response(200, headers={"content-type": "audio/wav"}))

    async def metadata(host: str, port: int) -> list[str]:
        return ["169.254.169.254"]

    error = await fetch_refused("http://metadata.internal/a.wav", allowed_domains=(), resolver=metadata,
                                transport=network)
    assert "non-public address" in error.message
    listed = await fetch_refused("http://127.0.0.1/a.wav", allowed_domains=["localhost"])
    assert "audio clips are fetched only from localhost; this URL's host is 127.0.0.1" in listed.message


# --- the routes ---


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeEngine, str]]:
    engine = FakeEngine()
    grpc_server, address = await start_fake_engine(engine)
    yield engine, address
    await grpc_server.stop(None)


async def test_chat_sends_inline_and_fetched_clips_in_order_whole_and_streamed(
    fake: tuple[FakeEngine, str], server: AudioServer, tmp_path: Path
) -> None:
    content = [text_part("a"), input_audio(TONE), image_part(data_url(RED)), text_part("b"),
               audio_url(at(server, "/low.ogg")), audio_url(data_url(MP3, "audio/mpeg"))]
    expected = echo("A", ("audio", TONE), ("image", RED), "B", ("audio", LOW), ("audio", MP3))
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    async with gateway_client(fake[1], tmp_path, allowed_media_domains=LOOPBACK) as http:
        reply = await http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == expected
        assert fake[0].audio == [TONE, LOW, MP3] and fake[0].images == [RED]
        streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == expected
        assert fake[0].audio == [TONE, LOW, MP3] * 2


async def test_the_openai_sdk_sends_input_audio_and_reads_the_errors(
    fake: tuple[FakeEngine, str], tmp_path: Path
) -> None:
    async with gateway_client(fake[1], tmp_path) as http:
        client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="x", http_client=http, max_retries=0)
        reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this"},
            {"type": "input_audio", "input_audio": {"data": b64(TONE), "format": "wav"}}]}])
        assert reply.choices[0].message.content == echo("WHAT IS THIS", ("audio", TONE))
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": "@@@@", "format": "mp3"}}]}])
        assert bad.value.param == "messages[0].content[0].input_audio.data"
    assert fake[0].audio == [TONE] and fake[0].generated == 1


@pytest.mark.parametrize(("part", "param", "says"), [
    (input_audio("%%%"), "input_audio.data", "not valid base64"),
    (input_audio(TONE, "aac"), "input_audio.format", "'aac' is not one ladle reads"),
    (input_audio(b"x" * 200), "input_audio.data", "larger than this server takes (100 bytes)"),
    (audio_url(data_url(b"x" * 200, "audio/wav")), "audio_url.url", "larger than this server takes (100 bytes)"),
    ({"type": "input_audio", "input_audio": {"format": "wav"}}, "input_audio.data", "needs its data"),
    ({"type": "input_audio", "input_audio": {"data": b64(TONE)}}, "input_audio.format", "needs its format: one of wav"),
    ("page", "audio_url.url", "content type is text/html, not audio"),
    ("loopback", "audio_url.url", "non-public address"),
])
async def test_chat_answers_a_bad_clip_in_openais_shape_before_calling_the_engine(
    fake: tuple[FakeEngine, str], server: AudioServer, tmp_path: Path, part: Any, param: str, says: str
) -> None:
    allowed: tuple[str, ...] = LOOPBACK
    if part == "page":
        part = audio_url(at(server, "/page"))
    elif part == "loopback":
        part, allowed = audio_url(at(server, "/tone.wav")), ()
    body = {"model": MODEL, "messages": [{"role": "user", "content": [text_part("x"), part]}]}
    async with gateway_client(fake[1], tmp_path, allowed_media_domains=allowed, max_audio_bytes=100) as http:
        reply = await http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == f"messages[0].content[1].{param}" and says in error["message"]
    assert fake[0].generated == 0 and fake[0].audio == []


async def test_a_model_that_hears_no_audio_refuses_a_clip_through_the_gateway(tmp_path: Path) -> None:
    engine = FakeEngine(reads_audio=False)
    grpc_server, address = await start_fake_engine(engine)
    try:
        async with gateway_client(address, tmp_path) as http:
            reply = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
                {"role": "user", "content": [text_part("x"), input_audio(TONE)]}]})
    finally:
        await grpc_server.stop(None)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "messages[0].content[1]" and "no audio" in error["message"]


async def test_the_batched_chat_route_sends_clips_and_names_the_conversation_of_a_failed_one(
    fake: tuple[FakeEngine, str], server: AudioServer, tmp_path: Path
) -> None:
    def conversation(part: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [text_part("q"), part]}]

    good = {"model": MODEL, "messages": [conversation(input_audio(TONE)),
                                         conversation(audio_url(at(server, "/low.ogg")))]}
    async with gateway_client(fake[1], tmp_path, allowed_media_domains=LOOPBACK) as http:
        reply = await http.post("/v1/chat/completions/batch", json=good)
        assert reply.status_code == 200, reply.text
        assert [c["message"]["content"] for c in reply.json()["choices"]] == [
            echo("Q", ("audio", TONE)), echo("Q", ("audio", LOW))]
        bad = {**good, "messages": [conversation(input_audio(TONE)), conversation(audio_url(at(server, "/page")))]}
        error = (await http.post("/v1/chat/completions/batch", json=bad)).json()["error"]
        assert error["param"] == "messages[1][0].content[1].audio_url.url" and "not audio" in error["message"]


async def test_tokenize_renders_a_conversation_with_its_clips(
    fake: tuple[FakeEngine, str], server: AudioServer, tmp_path: Path
) -> None:
    content = [text_part("abc"), input_audio(TONE), audio_url(at(server, "/tone.mp3"))]
    async with gateway_client(fake[1], tmp_path, allowed_media_domains=LOOPBACK) as http:
        reply = await http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": content}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["count"] == 3 + 2  # the fake engine's count: a token per character and per clip
        assert fake[0].audio == [TONE, MP3]
        missing = [{"role": "user", "content": [audio_url(at(server, "/missing.wav"))]}]
        error = (await http.post("/tokenize", json={"messages": missing})).json()["error"]
        assert error["param"] == "messages[0].content[0].audio_url.url" and "HTTP 404" in error["message"]


def test_the_audio_flag_and_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _gateway_config(build_parser().parse_args(["gateway"]), "127.0.0.1:1").max_audio_bytes == 25 * 1024 * 1024
    args = build_parser().parse_args(["gateway", "--max-audio-mib", "0.5"])
    assert _gateway_config(args, "127.0.0.1:1").max_audio_bytes == 512 * 1024
    monkeypatch.setenv("LADLE_MAX_AUDIO_MIB", "1")
    assert _gateway_config(build_parser().parse_args(["serve"]), "127.0.0.1:1").max_audio_bytes == 1024 * 1024
    with pytest.raises(ValueError, match="max_audio_bytes"):
        GatewayConfig(engines=("127.0.0.1:1",), max_audio_bytes=0)
    config = GatewayConfig(engines=("127.0.0.1:1",), max_audio_bytes=7)
    assert MediaFetcher.from_config(config).max_audio_bytes == 7


# --- batch lines ---


def chat_line(custom_id: str, *content: Any) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "messages": [{"role": "user", "content": list(content)}]}}).encode()


def test_validating_a_line_checks_its_clips_without_fetching_them(server: AudioServer) -> None:
    before = len(server.accepts)
    line = lines.parse_line(chat_line("a", audio_url(at(server, "/tone.wav")), input_audio(TONE)), 1, 0, None, MODEL)
    assert len(server.accepts) == before and not line.images
    for index, (part, param) in enumerate([(input_audio("@@"), "input_audio.data"),
                                           (input_audio(TONE, "aiff"), "input_audio.format"),
                                           (audio_url("s3://bucket/a.wav"), "audio_url.url")]):
        with pytest.raises(lines.InvalidLineError) as bad:
            lines.parse_line(chat_line("b", text_part("x"), part), index + 2, index + 1, None, MODEL)
        assert bad.value.error.param == f"body.messages[0].content[1].{param}"


async def test_the_line_runner_fetches_each_lines_clips_and_errs_the_line_whose_fetch_fails(
    fake: tuple[FakeEngine, str], server: AudioServer
) -> None:
    raw = [
        chat_line("fetched", text_part("x"), audio_url(at(server, "/low.ogg"))),
        chat_line("wrong", audio_url(at(server, "/red.png"))),
        chat_line("inline", input_audio(TONE), image_part(data_url(RED)), text_part("y")),
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
    assert by_id["fetched"]["body"]["choices"][0]["message"]["content"] == echo("X", ("audio", LOW))
    assert by_id["inline"]["body"]["choices"][0]["message"]["content"] == echo(("audio", TONE), ("image", RED), "Y")
    wrong = by_id["wrong"]
    assert wrong["status_code"] == 400 and wrong["body"]["error"]["param"] == "messages[0].content[0].audio_url.url"
    assert "content type is image/png, not audio" in wrong["body"]["error"]["message"]
