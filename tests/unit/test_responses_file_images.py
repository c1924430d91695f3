"""Responses input_image parts given by `file_id`: a file uploaded through the real Files route is read from the
caller's project and reaches the fake engine as the image's bytes, in order among text; a continuation
(previous_response_id, conversation) reads it again; another project's file, an unknown id, a file over the image
cap, one not uploaded for images, a deleted one and a part giving both image_url and file_id are 400s naming the
field; a batch line refuses file_id images."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.batches import lines
from gateway.schemas.responses import ResponsesRequest
from gateway.translate import responses_to_engine
from tests.unit.fake_engine import MODEL, FakeEngine, gateway_client, start_fake_engine
from tests.unit.test_gateway_images import BLUE, RED, data_url, refusal

KEYS = {"key-a": "alpha", "key-b": "beta"}
A = {"authorization": "Bearer key-a"}
B = {"authorization": "Bearer key-b"}


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeEngine, str]]:
    engine = FakeEngine()
    grpc_server, address = await start_fake_engine(engine)
    yield engine, address
    await grpc_server.stop(None)


def gateway(address: str, tmp_path: Path, **config: Any) -> Any:
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{key} {project}\n" for key, project in KEYS.items()))
    return gateway_client(address, tmp_path, api_keys_file=keys, **config)


async def upload(http: httpx.AsyncClient, data: bytes, headers: dict[str, str], purpose: str = "vision") -> str:
    reply = await http.post("/v1/files", files={"file": ("image.png", data, "image/png")}, data={"purpose": purpose},
                            headers=headers)
    assert reply.status_code == 200, reply.text
    file_id: str = reply.json()["id"]
    return file_id


def by_file(file_id: str) -> dict[str, Any]:
    return {"type": "input_image", "file_id": file_id, "detail": "auto"}


def user(*content: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(content)}]


def text(value: str) -> dict[str, str]:
    return {"type": "input_text", "text": value}


async def respond(http: httpx.AsyncClient, headers: dict[str, str] = A, **body: Any) -> httpx.Response:
    return await http.post("/v1/responses", json={"model": MODEL, **body}, headers=headers)


def error_of(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 400, reply.text
    error: dict[str, Any] = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


async def test_a_file_image_reaches_the_engine_in_order_and_a_continuation_reads_it_again(
    fake: tuple[FakeEngine, str], tmp_path: Path
) -> None:
    engine, address = fake
    async with gateway(address, tmp_path) as http:
        file_id = await upload(http, RED, A)
        input_ = user(text("a"), by_file(file_id), text("b"), {"type": "input_image", "image_url": data_url(BLUE)})
        reply = await respond(http, input=input_)
        assert reply.status_code == 200, reply.text
        assert reply.json()["output"][0]["content"][0]["text"] == f"A<IMAGE {len(RED)}>B<IMAGE {len(BLUE)}>"
        assert engine.images == [RED, BLUE]
        follow = await respond(http, input="and now?", previous_response_id=reply.json()["id"])
        assert follow.status_code == 200, follow.text
        assert engine.images == [RED, BLUE, RED, BLUE]
        counted = await http.post("/v1/responses/input_tokens", json={"model": MODEL, "input": input_}, headers=A)
        assert counted.status_code == 200, counted.text
        # deleted meanwhile: the continuation names the field that brought the stored item
        assert (await http.delete(f"/v1/files/{file_id}", headers=A)).status_code == 200
        generated = engine.generated
        error = error_of(await respond(http, input="again", previous_response_id=follow.json()["id"]))
        assert error["param"] == "previous_response_id" and f"{file_id} was not found" in error["message"]
        assert engine.generated == generated


async def test_a_conversation_holding_a_file_image_reads_it_when_continued(
    fake: tuple[FakeEngine, str], tmp_path: Path
) -> None:
    engine, address = fake
    async with gateway(address, tmp_path) as http:
        file_id = await upload(http, BLUE, A, purpose="user_data")
        made = await http.post("/v1/conversations", json={"items": user(text("see"), by_file(file_id))}, headers=A)
        assert made.status_code == 200, made.text
        reply = await respond(http, input="well?", conversation=made.json()["id"])
        assert reply.status_code == 200, reply.text
        assert engine.images == [BLUE]
        await http.delete(f"/v1/files/{file_id}", headers=A)
        error = error_of(await respond(http, input="again", conversation=made.json()["id"]))
        assert error["param"] == "conversation" and "was not found" in error["message"]


async def test_another_projects_file_reads_as_an_unknown_one(fake: tuple[FakeEngine, str], tmp_path: Path) -> None:
    engine, address = fake
    async with gateway(address, tmp_path) as http:
        theirs = await upload(http, RED, B)
        error = error_of(await respond(http, input=user(text("x"), by_file(theirs))))
        assert error["param"] == "input[0].content[1].file_id"
        assert error["message"] == f"the image file {theirs} was not found"
        unknown = "file-" + "0" * 24
        for missing in (unknown, "not-a-file-id"):
            error = error_of(await respond(http, input=[*user(text("y")), *user(by_file(missing))]))
            assert error["param"] == "input[1].content[0].file_id"
            assert error["message"] == f"the image file {missing} was not found"
        assert engine.generated == 0 and engine.images == []
        assert (await respond(http, B, input=user(by_file(theirs)))).status_code == 200  # its own project reads it


async def test_a_file_over_the_image_cap_or_not_for_images_is_a_400(
    fake: tuple[FakeEngine, str], tmp_path: Path
) -> None:
    engine, address = fake
    async with gateway(address, tmp_path, max_image_bytes=len(RED) - 1) as http:
        large = await upload(http, RED, A)
        error = error_of(await respond(http, input=user(by_file(large))))
        assert error["param"] == "input[0].content[0].file_id"
        assert f"larger than this server takes ({len(RED) - 1} bytes)" in error["message"]
        batch_file = await upload(http, b"x", A, purpose="batch")
        error = error_of(await respond(http, input=user(by_file(batch_file))))
        assert error["param"] == "input[0].content[0].file_id" and "purpose 'vision' or 'user_data'" in error["message"]
        assert engine.generated == 0


async def test_a_part_giving_both_image_url_and_file_id_is_a_400(
    fake: tuple[FakeEngine, str], tmp_path: Path
) -> None:
    both = {"type": "input_image", "image_url": data_url(RED), "file_id": "file-1"}
    async with gateway(fake[1], tmp_path) as http:
        error = error_of(await respond(http, input=user(text("x"), both)))
    assert error["param"] == "input[0].content[1].file_id" and "not both" in error["message"]


@pytest.mark.parametrize(("part", "param"), [
    ({"type": "input_image", "image_url": data_url(RED), "file_id": "file-1"}, "input[0].content[0].file_id"),
    ({"type": "input_image", "file_id": ""}, "input[0].content[0].file_id"),
    ({"type": "input_image", "file_id": 7}, "input[0].content[0].file_id"),
])
def test_malformed_file_image_parts_are_refused_by_name(part: dict[str, Any], param: str) -> None:
    body = ResponsesRequest.model_validate({"model": MODEL, "input": user(part)})
    assert refusal(lambda: responses_to_engine.input_items(body)).param == param


def test_file_image_sources_name_the_field_or_the_history_that_brought_them() -> None:
    history = responses_to_engine.checked_items(user(by_file("file-h")), "items")
    items = responses_to_engine.checked_items([*user(text("t")), *user(text("u"), by_file("file-i"))], "input")
    sources = responses_to_engine.file_image_sources(history, items, "conversation")
    assert [(s.file_id, s.param) for s in sources] == [
        ("file-h", "conversation"), ("file-i", "input[1].content[1].file_id")]
    assert responses_to_engine.image_sources(history, items, "conversation") == []


def test_a_batch_line_refuses_a_file_image() -> None:
    line = {"custom_id": "c", "method": "POST", "url": "/v1/responses",
            "body": {"model": MODEL, "input": user(text("x"), by_file("file-1"))}}
    with pytest.raises(lines.InvalidLineError) as bad:
        lines.parse_line(json.dumps(line).encode(), 1, 0, None, MODEL)
    assert bad.value.error.param == "body.input[0].content[1].file_id"
    assert "not read in a batch line" in bad.value.error.message
