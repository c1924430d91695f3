"""The Conversations API through the official OpenAI SDK against the real engine (the embedded model): a
conversation's lifecycle and its items (create, retrieve, update, list both ways, add, retrieve and delete an item,
delete); responses in a conversation, whole, streamed and in the background, read its items (greedy output equal to
the chat route's over the same turns) and add their input and output to it; input token counts see it; the errors
in OpenAI's shape; and another project's key sees none of it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.engine_process import EngineProcess
from tests.e2e.gateway_process import start_gateway

pytestmark = pytest.mark.slow


def texts(client: openai.OpenAI, conversation_id: str) -> list[tuple[str, str]]:
    """(role, text) of every message item of the conversation, oldest first."""
    items = client.conversations.items.list(conversation_id, order="asc", limit=100).data
    return [(item.role, "".join(part.text for part in item.content))  # type: ignore[union-attr]
            for item in items if item.type == "message"]


def test_a_conversation_and_its_items(openai_client: openai.OpenAI) -> None:
    created = openai_client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "Hello!"},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]}],
        metadata={"topic": "demo"})
    assert created.object == "conversation" and created.id.startswith("conv_") and created.metadata == {"topic": "demo"}
    assert openai_client.conversations.retrieve(created.id).model_dump() == created.model_dump()
    updated = openai_client.conversations.update(created.id, metadata={"topic": "other"})
    assert updated.metadata == {"topic": "other"} and openai_client.conversations.retrieve(created.id).metadata == {
        "topic": "other"}

    added = openai_client.conversations.items.create(
        created.id, items=[{"type": "message", "role": "user", "content": "How are you?"}])
    assert added.object == "list" and len(added.data) == 1 and added.first_id == added.data[0].id
    assert texts(openai_client, created.id) == [("user", "Hello!"), ("assistant", "Hi."), ("user", "How are you?")]
    newest = openai_client.conversations.items.list(created.id, limit=2)  # newest first by default
    assert newest.data[0].id == added.data[0].id and newest.has_more
    rest = openai_client.conversations.items.list(created.id, after=newest.data[-1].id)
    assert len(rest.data) == 1 and not rest.has_more
    first = rest.data[0]
    assert openai_client.conversations.items.retrieve(first.id, conversation_id=created.id).model_dump() == (
        first.model_dump())
    assert openai_client.conversations.items.delete(first.id, conversation_id=created.id).id == created.id
    assert texts(openai_client, created.id) == [("assistant", "Hi."), ("user", "How are you?")]
    with pytest.raises(openai.NotFoundError):
        openai_client.conversations.items.retrieve(first.id, conversation_id=created.id)

    deleted = openai_client.conversations.delete(created.id)
    assert deleted.deleted and deleted.id == created.id
    for call in (lambda: openai_client.conversations.retrieve(created.id),
                 lambda: openai_client.conversations.items.list(created.id),
                 lambda: openai_client.conversations.delete(created.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_responses_in_a_conversation_read_it_and_add_to_it(openai_client: openai.OpenAI, model_id: str) -> None:
    """Each response reads the conversation so far (its greedy text equals the chat route's over the same turns)
    and adds its input and output to it; whole, streamed and background responses alike."""
    conversation = openai_client.conversations.create(
        items=[{"role": "system", "content": "Answer in one short sentence."}])
    turns: list[dict[str, Any]] = [{"role": "system", "content": "Answer in one short sentence."}]
    questions = ["What is the capital of France?", "And of Italy?", "And of Spain?"]
    for kind, question in zip(("whole", "streamed", "background"), questions, strict=True):
        turns.append({"role": "user", "content": question})
        chat = openai_client.chat.completions.create(model=model_id, temperature=0, max_tokens=16,
                                                     messages=turns)  # type: ignore[arg-type]
        counted = openai_client.responses.input_tokens.count(model=model_id, input=question,
                                                             conversation=conversation.id)
        assert counted.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
        body: dict[str, Any] = {"model": model_id, "temperature": 0, "max_output_tokens": 16, "input": question,
                                "conversation": conversation.id}
        if kind == "whole":
            response = openai_client.responses.create(**body)
        elif kind == "streamed":
            with openai_client.responses.stream(**body) as stream:
                response = stream.get_final_response()
        else:
            queued = openai_client.responses.create(**body, background=True)
            deadline = time.monotonic() + 120
            while (response := openai_client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
                assert time.monotonic() < deadline
                time.sleep(0.2)
            # the runner adds the items right after it records the end: the turns so far and the answer
            while len(texts(openai_client, conversation.id)) < len(turns) + 1:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert response.conversation is not None and response.conversation.id == conversation.id, kind
        answer = chat.choices[0].message.content or ""
        assert response.output_text == answer, (kind, response.output_text, answer)
        turns.append({"role": "assistant", "content": answer})
        assert texts(openai_client, conversation.id) == [(t["role"], t["content"]) for t in turns], kind
    items = openai_client.conversations.items.list(conversation.id, order="asc", limit=100).data
    assert items[-1].id == response.output[-1].id  # the output items are added as they are


def test_errors_in_openais_shape(openai_client: openai.OpenAI, model_id: str) -> None:
    conversation = openai_client.conversations.create()
    first = openai_client.responses.create(model=model_id, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as both:
        openai_client.responses.create(model=model_id, input="Hi", max_output_tokens=2, conversation=conversation.id,
                                       previous_response_id=first.id)
    assert both.value.body["param"] == "conversation"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as unknown:
        openai_client.responses.create(model=model_id, input="Hi", conversation="conv_" + "0" * 32)
    assert unknown.value.body["param"] == "conversation"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as too_many:
        openai_client.conversations.create(items=[{"role": "user", "content": "x"}] * 21)
    assert too_many.value.body["param"] == "items"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as unreadable:
        openai_client.conversations.items.create(conversation.id, items=[{"type": "web_search_call", "id": "ws_1"}])
    assert unreadable.value.body["param"].startswith("items[0]")  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        openai_client.conversations.update(conversation.id, metadata={f"k{i}": "v" for i in range(17)})
    with pytest.raises(openai.NotFoundError):
        openai_client.conversations.retrieve("conv_made_up")


def test_another_projects_key_sees_none_of_it(engine: EngineProcess, model_id: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-alpha alpha\nsk-beta beta\n")
    gateway = start_gateway(tmp_path / "gateway.log", engine.address, "--api-keys-file", str(keys))
    try:
        alpha, beta = (openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=120)
                       for key in ("sk-alpha", "sk-beta"))
        conversation = alpha.conversations.create(items=[{"role": "user", "content": "A secret."}])
        item_id = alpha.conversations.items.list(conversation.id).data[0].id
        for call in (lambda: beta.conversations.retrieve(conversation.id),
                     lambda: beta.conversations.items.list(conversation.id),
                     lambda: beta.conversations.items.retrieve(item_id, conversation_id=conversation.id),
                     lambda: beta.conversations.delete(conversation.id),
                     lambda: beta.responses.create(model=model_id, input="x", conversation=conversation.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        assert json.loads(alpha.conversations.retrieve(conversation.id).model_dump_json())["id"] == conversation.id
    finally:
        assert gateway.stop() == 0
