"""A thinking model's reasoning apart from its answer, end to end: an engine started with `--reasoning-parser
qwen3` on the embedded model, made to think by a constraint that spells a reasoning and an answer, seen by the
official OpenAI SDK (chat, streamed and not), the batched-chat route and a gRPC stub."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway

pytestmark = pytest.mark.slow

THOUGHT = "\nTwo and two make four.\n"
ANSWER = "It is 4."
SCRIPT = {"structured_outputs": {"choice": [f"<think>{THOUGHT}</think>\n\n{ANSWER}"]}}
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, GatewayProcess]]:
    root: Path = tmp_path_factory.mktemp("reasoning")
    engine = start_engine(root / "engine.log", "--reasoning-parser", "qwen3")
    gateway = start_gateway(root / "gateway.log", engine.address)
    yield engine, gateway
    assert gateway.stop() == 0 and engine.stop() == 0


@pytest.fixture(scope="module")
def client(thinking: tuple[EngineProcess, GatewayProcess]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=thinking[1].base_url, api_key="unused", max_retries=0, timeout=300) as sdk:
        yield sdk


def test_the_sdk_sees_reasoning_content_and_the_answer(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=96, extra_body=SCRIPT)
    message = reply.choices[0].message
    extra = message.model_extra or {}
    assert (extra["reasoning_content"], extra["reasoning"], message.content) == (THOUGHT, THOUGHT, ANSWER)
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert 0 < (reply.usage.completion_tokens_details.reasoning_tokens or 0) < reply.usage.completion_tokens
    # Sent back in the history, the reasoning is accepted (and dropped).
    history = [*QUESTION, {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}]
    follow_up = [*history, {"role": "user", "content": "And 3 + 3?"}]
    again = client.chat.completions.create(model=MODEL, messages=follow_up, max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length")


def test_streamed_deltas_carry_reasoning_then_content_and_never_a_tag(client: openai.OpenAI) -> None:
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=96, stream=True,
                                                extra_body=SCRIPT):  # fmt: skip
        for choice in chunk.choices:
            piece = (choice.delta.model_extra or {}).get("reasoning_content") or ""
            assert not (piece and choice.delta.content)  # one field a delta
            assert content == "" or not piece  # no reasoning after the answer began
            reasoning += piece
            content += choice.delta.content or ""
    assert (reasoning, content) == (THOUGHT, ANSWER)
    assert "<think>" not in reasoning + content and "</think>" not in reasoning + content


def test_the_batched_chat_route_and_a_grpc_stub_see_it_too(thinking: tuple[EngineProcess, GatewayProcess]) -> None:
    engine, gateway = thinking
    body = {"model": MODEL, "messages": [QUESTION, QUESTION], "max_tokens": 96, **SCRIPT}
    reply = httpx.post(f"{gateway.url}/v1/chat/completions/batch", json=body, timeout=300).json()
    for choice in reply["choices"]:
        assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == (THOUGHT, ANSWER)
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    with grpc.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        chat = types_pb2.ChatInput(messages=[types_pb2.ChatMessage(role="user", content="What is 2 + 2?")])
        request = engine_pb2.GenerateRequest(
            input=types_pb2.Input(chat=chat), sampling=types_pb2.SamplingParams(max_tokens=96),
            constraint=types_pb2.Constraint(choice=types_pb2.ChoiceList(choices=[f"<think>{THOUGHT}</think>\n\n{ANSWER}"])),
        )  # fmt: skip
        response = stub.Generate(request, timeout=300)
    (choice,) = response.choices
    assert (choice.reasoning_content, choice.text) == (THOUGHT, ANSWER) and response.usage.reasoning_tokens > 0
