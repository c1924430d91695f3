"""A thinking model's reasoning apart from its answer, end to end: `ladle engine` on a small random model whose
chat template opens `<think>` in the prompt, as DeepSeek-R1's does (so `--reasoning-parser auto` turns the split on
and every output starts inside the reasoning), cut by max_tokens before it closes: the official OpenAI SDK (chat,
streamed and not), the batched-chat route and a gRPC stub all see the reasoning, no content, and its tokens
counted. How a reasoning and an answer are told apart, and a constraint on the answer after it, are tested
through the engine in tests/unit/test_reasoning_engine.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway
from tests.families import save_family

pytestmark = pytest.mark.slow

R1_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, EngineProcess, GatewayProcess]]:
    root: Path = tmp_path_factory.mktemp("reasoning")
    folder = save_family(root / "model", "mistral-window")
    (folder / "chat_template.jinja").write_text(R1_TEMPLATE)
    engine = start_engine(root / "engine.log", "--model", str(folder), "--quantization", "none", threads=1)
    gateway = start_gateway(root / "gateway.log", engine.address)
    with openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0) as sdk:
        model = sdk.models.list().data[0].id
    yield model, engine, gateway
    assert gateway.stop() == 0 and engine.stop() == 0


@pytest.fixture(scope="module")
def client(thinking: tuple[str, EngineProcess, GatewayProcess]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=thinking[2].base_url, api_key="unused", max_retries=0, timeout=300) as sdk:
        yield sdk


def test_the_sdk_sees_the_reasoning_and_its_tokens(
    client: openai.OpenAI, thinking: tuple[str, EngineProcess, GatewayProcess]
) -> None:
    reply = client.chat.completions.create(model=thinking[0], messages=QUESTION, max_tokens=MAX_TOKENS,
                                           temperature=0)  # type: ignore[arg-type]  # fmt: skip
    choice = reply.choices[0]
    extra = choice.message.model_extra or {}
    assert choice.finish_reason == "length" and choice.message.content is None
    assert extra["reasoning_content"] == extra["reasoning"] != ""
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == reply.usage.completion_tokens == MAX_TOKENS
    # Sent back in the history, the reasoning is accepted (and dropped).
    history = [*QUESTION, {"role": "assistant", "content": "4", "reasoning_content": extra["reasoning_content"]},
               {"role": "user", "content": "And 3 + 3?"}]  # fmt: skip
    again = client.chat.completions.create(model=thinking[0], messages=history, max_tokens=4)  # type: ignore[arg-type]
    assert again.choices[0].finish_reason == "length"


def test_streamed_deltas_carry_the_reasoning_and_no_content(
    client: openai.OpenAI, thinking: tuple[str, EngineProcess, GatewayProcess]
) -> None:
    whole = client.chat.completions.create(model=thinking[0], messages=QUESTION, max_tokens=MAX_TOKENS,
                                           temperature=0)  # type: ignore[arg-type]  # fmt: skip
    reasoning = ""
    for chunk in client.chat.completions.create(model=thinking[0], messages=QUESTION, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True):  # type: ignore[arg-type]  # fmt: skip
        for choice in chunk.choices:
            assert not choice.delta.content
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    assert reasoning == (whole.choices[0].message.model_extra or {})["reasoning_content"]


def test_the_batched_chat_route_and_a_grpc_stub_see_it_too(thinking: tuple[str, EngineProcess, GatewayProcess]) -> None:
    model, engine, gateway = thinking
    body = {"model": model, "messages": [QUESTION, QUESTION], "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = httpx.post(f"{gateway.url}/v1/chat/completions/batch", json=body, timeout=300).json()
    first = reply["choices"][0]["message"]
    assert first["reasoning_content"] and first["content"] is None
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2 * MAX_TOKENS
    with grpc.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        chat = types_pb2.ChatInput(messages=[types_pb2.ChatMessage(role="user", content="What is 2 + 2?")])
        request = engine_pb2.GenerateRequest(
            input=types_pb2.Input(chat=chat), sampling=types_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        )
        response = stub.Generate(request, timeout=300)
    (choice,) = response.choices
    assert choice.reasoning_content == first["reasoning_content"] and choice.text == ""
    assert response.usage.reasoning_tokens == MAX_TOKENS


def test_a_batch_job_and_ladle_batch_carry_the_reasoning_and_count_its_tokens(
    client: openai.OpenAI, thinking: tuple[str, EngineProcess, GatewayProcess], tmp_path: Path
) -> None:
    model, engine, _ = thinking
    body = {"model": model, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0}
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(3)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with source.open("rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 240
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert batch.status in ("validating", "in_progress", "finalizing") and time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch.output_file_id is not None
    results = [json.loads(row) for row in client.files.content(batch.output_file_id).text.splitlines()]
    for result in results:
        assert result["response"]["body"]["choices"][0]["message"]["reasoning_content"]
    usage = batch.to_dict()["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == 3 * MAX_TOKENS == usage["output_tokens"]

    output = tmp_path / "out.jsonl"
    offline = [sys.executable, "-m", "ladle_cli", "batch", "-i", str(source), "-o", str(output), "--engine",
               engine.address]  # fmt: skip
    run = subprocess.run(offline, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for row in output.read_text().splitlines():
        reply = json.loads(row)["response"]["body"]
        assert reply["choices"][0]["message"]["reasoning_content"]
        assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == MAX_TOKENS
