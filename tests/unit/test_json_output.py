"""Non-finite floats never make invalid JSON: a batch result line, an SSE event and an HTTP reply holding a logprob
of -inf or a NaN embedding are parsed by a strict JSON parser (no `NaN`/`Infinity` tokens), the values mapped to
-9999.0 / 9999.0 / null; the embeddings route answers such a reply 200 (it was a 500)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gateway import json_output, sse
from gateway.batches.lines import encode
from ladle.v1 import engine_pb2
from tests.unit.fake_engine import MODEL, FakeEngine, gateway_client, start_fake_engine

NAN, INF = math.nan, math.inf


def strict(text: str | bytes) -> Any:
    """json.loads that refuses NaN, Infinity and -Infinity, as every other JSON parser does."""

    def refuse(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_result_line_with_non_finite_floats_is_valid_json() -> None:
    record = {"custom_id": "a", "response": {"body": {
        "choices": [{"logprobs": {"content": [{"token": "x", "logprob": -INF, "top_logprobs": [
            {"token": "y", "logprob": -INF}, {"token": "z", "logprob": -0.5}]}]}}],
        "data": [{"embedding": [NAN, INF, -INF, 0.25]}], "score": (NAN, 1.0)}}}
    line = encode(record)
    assert line.endswith(b"\n") and b"NaN" not in line and b"Infinity" not in line
    body = strict(line)["response"]["body"]
    content = body["choices"][0]["logprobs"]["content"][0]
    assert content["logprob"] == -9999.0 and [t["logprob"] for t in content["top_logprobs"]] == [-9999.0, -0.5]
    assert body["data"][0]["embedding"] == [None, 9999.0, -9999.0, 0.25] and body["score"] == [None, 1.0]


def test_finite_values_are_written_as_before() -> None:
    record = {"a": [0.1, 1e300, -2.5e-308, 3], "b": "\u00e9", "c": None, "d": True}
    assert json_output.dumps(record) == json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    assert encode({"s": "\ud800"}) == b'{"s":"\\ud800"}\n'  # a lone surrogate, escaped as before


def test_an_sse_event_with_non_finite_floats_is_valid_json() -> None:
    event = sse.event({"choices": [{"logprobs": {"content": [{"logprob": -INF}]}}]})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert strict(event[6:-2])["choices"][0]["logprobs"]["content"][0]["logprob"] == -9999.0


class NaNEngine(FakeEngine):
    """Answers every Embed with a vector holding NaN and both infinities."""

    async def Embed(self, request: engine_pb2.EmbedRequest, context: Any) -> engine_pb2.EmbedResponse:
        reply = engine_pb2.EmbedResponse(request_id=request.request_id)
        reply.embeddings.add(index=0, values=[NAN, INF, -INF, 0.5], num_tokens=3)
        return reply


async def test_the_embeddings_route_answers_a_nan_vector_as_valid_json(tmp_path: Path) -> None:
    server, address = await start_fake_engine(NaNEngine())
    try:
        async with gateway_client(address, tmp_path) as http:
            reply = await http.post("/v1/embeddings", json={"model": MODEL, "input": "alpha"})
    finally:
        await server.stop(None)
    assert reply.status_code == 200, reply.text
    assert strict(reply.text)["data"][0]["embedding"] == [None, 9999.0, -9999.0, 0.5]
