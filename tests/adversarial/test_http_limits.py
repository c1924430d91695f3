"""The gateway's HTTP edge under attack: a 100 MB body, a 1 MB header, and every route without the API key or with
a key one character off."""

from __future__ import annotations

import inspect
import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from gateway import deps, keys
from tests.adversarial.helpers import HELLO, still_serves_http
from tests.e2e.engine_process import EngineProcess
from tests.e2e.gateway_process import GatewayProcess, start_gateway
from tests.e2e.helpers import assert_error

pytestmark = pytest.mark.slow

KEY = "sk-adversarial-0123456789"
PUBLIC_ROUTES = {("GET", "/health"), ("GET", "/version")}  # answered without a key (and /openapi.json)


def test_a_100_mb_body(http: httpx.Client, model_id: str) -> None:
    head = json.dumps({"model": model_id, "messages": [{"role": "user", "content": "@"}]}).encode()
    big = head.replace(b"@", b"x" * (100 * 1024 * 1024))
    headers = {"content-type": "application/json"}
    limit = "the request body is larger than 16777216 bytes"
    sized = http.post("/v1/chat/completions", content=big, headers=headers)  # Content-Length: refused unread
    assert assert_error(sized, 413, None, "request_too_large")["message"] == limit

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(big), 1 << 20):
            yield big[start:start + (1 << 20)]

    chunked = http.post("/v1/chat/completions", content=chunks(), headers=headers)  # read until past the limit
    assert assert_error(chunked, 413, None, "request_too_large")["message"] == limit
    still_serves_http(http, model_id)


def test_a_1_mb_header(http: httpx.Client, gateway: GatewayProcess, model_id: str) -> None:
    body = {"model": model_id, "messages": HELLO, "max_tokens": 2}
    expected = "the request line and headers exceed 65536 bytes"
    one_header = http.post("/v1/chat/completions", json=body, headers={"x-big": "a" * (1 << 20)})
    assert assert_error(one_header, 431, None, "request_header_fields_too_large")["message"] == expected
    many = {f"x-h{i}": "a" * 100 for i in range(10_000)}
    assert assert_error(http.post("/v1/chat/completions", json=body, headers=many), 431)["message"] == expected
    # A 1 MB request line (past what httpx will send), and a header that never ends: each answered once past the
    # limit, the client's further bytes dropped unread.
    for head in (b"GET /v1/models?q=" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nHost: x\r\nX-Endless: " + b"a" * (20 << 20)):
        answer = raw_exchange(gateway, head)
        assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert (error["message"], error["code"]) == (expected, "request_header_fields_too_large")
    assert http.post("/v1/chat/completions", json=body, headers={"x-fine": "a" * 16_000}).status_code == 200
    still_serves_http(http, model_id)


def raw_exchange(gateway: GatewayProcess, data: bytes) -> bytes:
    """Send `data` on a new connection and return the first bytes of the answer."""
    address = urlsplit(gateway.url)
    assert address.hostname is not None and address.port is not None
    with socket.create_connection((address.hostname, address.port), timeout=30) as raw:
        raw.sendall(data)
        return raw.recv(4096)


@pytest.fixture(scope="module")
def keyed(engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = start_gateway(tmp_path_factory.mktemp("keyed") / "gateway.log", engine.address, "--api-key", KEY)
    yield process
    assert process.stop() == 0


def routes(gateway: GatewayProcess, model: str) -> list[tuple[str, str]]:
    """Every (method, path) of the gateway's OpenAPI document, with placeholder ids in the paths."""
    document = httpx.get(gateway.url + "/openapi.json", timeout=30).json()
    ids = {"{model}": model, "{file_id}": "file-abc", "{batch_id}": "batch_abc"}
    found = []
    for path, methods in document["paths"].items():
        for name, value in ids.items():
            path = path.replace(name, value)
        found += [(method.upper(), path) for method in methods]
    return found


def test_every_route_without_a_key_and_with_a_key_one_character_off(keyed: GatewayProcess, model_id: str) -> None:
    every = routes(keyed, model_id)
    assert len(every) >= 16 and ("POST", "/v1/chat/completions") in every
    off_by_one = KEY[:-1] + chr(ord(KEY[-1]) + 1)
    with httpx.Client(base_url=keyed.url, timeout=60) as http:
        for method, path in every:
            if (method, path) in PUBLIC_ROUTES:
                assert http.request(method, path).status_code == 200
                continue
            body = json.dumps({"model": model_id, "messages": HELLO}).encode() if method == "POST" else None
            for headers in ({}, {"Authorization": f"Bearer {off_by_one}"}, {"Authorization": f"Basic {KEY}"},
                            {"Authorization": f"Bearer {KEY[:-1]}"}, {"Authorization": KEY}):
                # The key is checked before the body is read: an unparsable body is a 401 too, not a 400.
                for content in (body, b"{not json") if body else (None,):
                    response = http.request(method, path, content=content,
                                            headers={**headers, "content-type": "application/json"})
                    error = assert_error(response, 401, None, "invalid_api_key")
                    assert error["message"] == (
                        "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.")
        assert_error(http.post("/v1/no-such-route", content=b"x" * (32 << 20)), 401, None, "invalid_api_key")
        ok = http.post("/v1/chat/completions", json={"model": model_id, "messages": HELLO, "max_tokens": 2},
                       headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, ok.text
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_the_key_is_never_compared_byte_by_byte() -> None:
    """A compare that stops at the first differing byte leaks the key byte by byte through response times. The
    presented key is hashed (SHA-256) before anything is compared: what a lookup's time depends on is its digest,
    which says nothing about how many leading bytes of a guess are right."""
    assert "authenticate(" in inspect.getsource(deps.request_project)  # the middleware calls it too
    assert "project_of(" in inspect.getsource(deps.authenticate)
    source = inspect.getsource(keys.KeyRing.project_of)
    assert "_digest(key)" in source and "== key" not in source and "key ==" not in source
    assert "sha256" in inspect.getsource(keys._digest)
