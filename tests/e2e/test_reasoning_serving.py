"""A thinking model's reasoning apart from its answer, end to end: `ladle engine` (`--reasoning-parser auto`) on a
scripted model (a real checkpoint whose reply is known, tests/scripted.py) carrying Qwen3's chat template (the
output opens `<think>`; `enable_thinking: false` closes an empty one in the prompt), an R1-style one (the prompt
opens `<think>`), Magistral's (`[THINK]...[/THINK]`, special tokens) or Cohere's (a plan in its tags, the answer
in its response markers), behind the gateway: the official OpenAI
SDK (chat, streamed and not), the batched-chat route, a batch job, `ladle batch` and a gRPC stub all see the
reasoning under `reasoning_content` and `reasoning`, the answer alone in `content`, and the reasoning's tokens
counted; a json_schema answer after the reasoning validates; a reply cut inside its reasoning has no content. How
the split works at every split point of a stream is tested in tests/unit/test_reasoning.py, and through the engine
in tests/unit/test_reasoning_engine.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.chat_templates import COMMAND_R7B, DEEPSEEK_R1, MAGISTRAL, QWEN3, FamilyTemplate
from tests.e2e.engine_process import EngineProcess
from tests.e2e.gateway_process import GatewayProcess, serve_scripted

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
ANSWER = '{"answer": 4}'
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}  # fmt: skip
MAX_TOKENS = 32


@dataclass(frozen=True)
class Thinker:
    """A family's template, what its model writes (by cue), and the reasoning and token counts that reply has (its
    completion tokens include the end-of-sequence token, as vLLM counts them)."""

    template: FamilyTemplate
    scripts: dict[str, tuple[str, ...]]
    reasoning: str
    reasoning_tokens: int
    completion_tokens: int


THINKERS = {
    # Qwen3: the reply opens <think> itself; without thinking (the prompt ends "</think>\n\n") it answers at once.
    "qwen3": Thinker(
        QWEN3,
        {"\n": ("<think>", "\nTwo and two make four.\n", "</think>", "\n\n" + ANSWER, "<|im_end|>"),
         "\n\n": (ANSWER, "<|im_end|>")},
        reasoning="\nTwo and two make four.\n", reasoning_tokens=3, completion_tokens=5,
    ),
    # R1-style: the prompt opened <think>, so the reply starts inside the reasoning.
    "deepseek_r1": Thinker(
        DEEPSEEK_R1,
        {"\n": ("Two and two make four.\n", "</think>", "\n\n" + ANSWER, "<|im_end|>")},
        reasoning="Two and two make four.\n", reasoning_tokens=2, completion_tokens=4,
    ),
    # Magistral: its own tags, special tokens of its vocabulary (decoded with the special tokens kept).
    "mistral": Thinker(
        MAGISTRAL,
        {"[/INST]": ("[THINK]", "Two and two make four.", "[/THINK]", ANSWER, "</s>")},
        reasoning="Two and two make four.", reasoning_tokens=3, completion_tokens=5,
    ),
    # Cohere: a plan in its own tags, then the answer in its response markers (both dropped from the content).
    "cohere": Thinker(
        COMMAND_R7B,
        {"<|CHATBOT_TOKEN|>": ("<|START_THINKING|>", "Two and two make four.", "<|END_THINKING|>",
                               "<|START_RESPONSE|>", ANSWER, "<|END_RESPONSE|>", "<|END_OF_TURN_TOKEN|>")},
        reasoning="Two and two make four.", reasoning_tokens=3, completion_tokens=7,
    ),
}


@dataclass
class Served:
    thinker: Thinker
    model: str
    engine: EngineProcess
    gateway: GatewayProcess
    client: openai.OpenAI


@pytest.fixture(scope="module", params=list(THINKERS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    thinker = THINKERS[request.param]
    root: Path = tmp_path_factory.mktemp(request.param)
    with serve_scripted(root, thinker.template, thinker.scripts) as (model, engine, gateway, client):
        yield Served(thinker, model, engine, gateway, client)


def _check_message(served: Served, message: dict[str, Any], usage: dict[str, Any], eos: int = 1) -> None:
    """`eos`: 0 when the reply ended without its end-of-sequence token (a grammar that is complete ends it)."""
    thinker = served.thinker
    assert message["content"] == ANSWER
    assert message["reasoning_content"] == message["reasoning"] == thinker.reasoning
    assert usage["completion_tokens"] == thinker.completion_tokens - 1 + eos
    assert usage["completion_tokens_details"]["reasoning_tokens"] == thinker.reasoning_tokens


def test_the_sdk_sees_the_reasoning_the_answer_and_the_reasoning_tokens(served: Served) -> None:
    reply = served.client.chat.completions.create(model=served.model, messages=QUESTION, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
    assert reply.choices[0].finish_reason == "stop"
    _check_message(served, reply.choices[0].message.to_dict(), reply.to_dict()["usage"])
    # Sent back in the history, the reasoning is accepted (and dropped).
    extra = reply.choices[0].message.model_extra or {}
    history = [*QUESTION, {"role": "assistant", "content": ANSWER, "reasoning_content": extra["reasoning_content"],
                           "reasoning": extra["reasoning"]}, {"role": "user", "content": "And 3 + 3?"}]  # fmt: skip
    again = served.client.chat.completions.create(model=served.model, messages=history, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
    assert again.choices[0].message.content == ANSWER


def test_streamed_deltas_carry_the_reasoning_then_the_answer(served: Served) -> None:
    reasoning, content, usage = "", "", None
    stream = served.client.chat.completions.create(model=served.model, messages=QUESTION, max_tokens=MAX_TOKENS,
                                                   stream=True, stream_options={"include_usage": True})  # type: ignore[arg-type]  # fmt: skip
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            piece = extra.get("reasoning_content") or ""
            assert piece == (extra.get("reasoning") or "")
            assert not (piece and content), "reasoning after the answer began"
            reasoning += piece
            content += choice.delta.content or ""
    assert "think>" not in reasoning + content
    assert usage is not None
    _check_message(served, {"content": content, "reasoning_content": reasoning, "reasoning": reasoning},
                   usage.to_dict())  # fmt: skip


def test_a_json_schema_answer_after_the_reasoning_validates(served: Served) -> None:
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA, "strict": True}}
    reply = served.client.chat.completions.create(model=served.model, messages=QUESTION, max_tokens=MAX_TOKENS,
                                                  temperature=0, response_format=response_format)  # type: ignore[arg-type]  # fmt: skip
    message = reply.choices[0].message
    jsonschema.validate(json.loads(message.content or ""), SCHEMA)
    _check_message(served, message.to_dict(), reply.to_dict()["usage"], eos=0)


@pytest.mark.parametrize("served", ["qwen3"], indirect=True)  # the template that reads enable_thinking
def test_without_thinking_nothing_is_split(served: Served) -> None:
    reply = served.client.chat.completions.create(
        model=served.model, messages=QUESTION, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = reply.choices[0].message.to_dict()
    assert message["content"] == ANSWER and "reasoning_content" not in message and "reasoning" not in message
    assert reply.usage is not None and reply.usage.completion_tokens == 2  # the answer and the eos
    assert reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_reply_cut_inside_its_reasoning_has_no_content(served: Served) -> None:
    cut = served.thinker.reasoning_tokens - 1
    reply = served.client.chat.completions.create(model=served.model, messages=QUESTION, max_tokens=cut)  # type: ignore[arg-type]
    choice = reply.choices[0]
    extra = choice.message.model_extra or {}
    assert choice.finish_reason == "length" and choice.message.content is None
    assert extra["reasoning_content"] == extra["reasoning"] and served.thinker.reasoning.startswith(
        extra["reasoning_content"]
    )
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == cut


def test_the_batched_chat_route_and_a_grpc_stub_see_it_too(served: Served) -> None:
    body = {"model": served.model, "messages": [QUESTION, QUESTION], "max_tokens": MAX_TOKENS}
    reply = httpx.post(f"{served.gateway.url}/v1/chat/completions/batch", json=body, timeout=300).json()
    for choice in reply["choices"]:
        assert choice["message"]["content"] == ANSWER
        assert choice["message"]["reasoning_content"] == served.thinker.reasoning
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2 * served.thinker.reasoning_tokens
    with grpc.insecure_channel(served.engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        chat = types_pb2.ChatInput(messages=[types_pb2.ChatMessage(role="user", content="What is 2 + 2?")])
        sampling = types_pb2.SamplingParams(max_tokens=MAX_TOKENS)
        response = stub.Generate(
            engine_pb2.GenerateRequest(input=types_pb2.Input(chat=chat), sampling=sampling), timeout=300
        )
        streamed = list(stub.Stream(engine_pb2.StreamRequest(input=types_pb2.Input(chat=chat), sampling=sampling),
                                    timeout=300))  # fmt: skip
    (choice,) = response.choices
    assert (choice.reasoning_content, choice.text) == (served.thinker.reasoning, ANSWER)
    assert response.usage.reasoning_tokens == served.thinker.reasoning_tokens
    deltas = [d for message in streamed for d in message.choices]
    assert "".join(d.reasoning_content for d in deltas) == served.thinker.reasoning
    assert "".join(d.text for d in deltas) == ANSWER


def test_a_batch_job_and_ladle_batch_carry_the_reasoning_and_count_its_tokens(
    served: Served, tmp_path: Path
) -> None:
    client = served.client
    body = {"model": served.model, "messages": QUESTION, "max_tokens": MAX_TOKENS}
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
    for row in client.files.content(batch.output_file_id).text.splitlines():
        reply = json.loads(row)["response"]["body"]
        _check_message(served, reply["choices"][0]["message"], reply["usage"])
    usage = batch.to_dict()["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == 3 * served.thinker.reasoning_tokens

    output = tmp_path / "out.jsonl"
    offline = [sys.executable, "-m", "ladle_cli", "batch", "-i", str(source), "-o", str(output), "--engine",
               served.engine.address]  # fmt: skip
    run = subprocess.run(offline, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for row in output.read_text().splitlines():
        reply = json.loads(row)["response"]["body"]
        _check_message(served, reply["choices"][0]["message"], reply["usage"])


def test_the_responses_api_gives_a_reasoning_item_then_the_answer(served: Served) -> None:
    """/v1/responses: a `reasoning` item holding the reasoning, then the answer's message, whole and streamed;
    on Qwen3, `reasoning.effort: "none"` switches the template's thinking off."""
    thinker = served.thinker
    whole = served.client.responses.create(model=served.model, input=QUESTION, max_output_tokens=MAX_TOKENS)  # type: ignore[arg-type]
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    reasoning = whole.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == thinker.reasoning and whole.output_text == ANSWER
    assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens == thinker.reasoning_tokens
    with served.client.responses.stream(model=served.model, input=QUESTION, max_output_tokens=MAX_TOKENS) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_response()
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, answer) == (thinker.reasoning, ANSWER) and final.output_text == ANSWER
    if thinker.template is QWEN3:
        direct = served.client.responses.create(model=served.model, input=QUESTION, max_output_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                                                reasoning={"effort": "none"})
        assert [item.type for item in direct.output] == ["message"] and direct.output_text == ANSWER
