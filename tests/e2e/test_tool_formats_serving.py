"""Each family's tool-call format end to end: `ladle engine --tool-call-parser auto` on a scripted model (a real
checkpoint whose reply is known, tests/scripted.py) carrying the family's chat template (tests/chat_templates.py)
and special tokens, behind the gateway, through the official OpenAI SDK:
- the calls the model writes come back as `tool_calls`, whole and streamed (each call delta in a chunk of its own),
  with ids in OpenAI's shape, Mistral's 9 characters or the id Kimi K2's model wrote; a call of a tool the request
  did not give stays text; where the markers are special tokens (Mistral, GLM, DeepSeek, Kimi, MiniMax, Seed-OSS,
  Nemotron, LFM2, Cohere) they reach the parser, and a reasoning before the calls (GLM, MiniMax, Seed-OSS, Nemotron,
  Cohere's plan) is split off first;
- calls sent back with their results render through the family's template (Mistral's refuses any id that is not 9
  letters and digits; DeepSeek V3.1's joins the arguments to text; LFM2's does not read tool_calls, so the engine
  writes them in LFM2's layout);
- forced calls (required, named) are written in the family's format;
- the batched-chat route, a batch job and `ladle batch` parse them too;
- the steps of vLLM's tool-calling client example (Mistral-7B-Instruct-v0.3 with its tool template) run against the
  Mistral v3 template.

How each format parses, split at every point of a stream, is tested in tests/unit/test_tool_call_formats.py and
tests/unit/test_tagged_tool_formats.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.chat_templates import (
    COMMAND_R7B,
    DEEPSEEK_V31,
    GEMMA4,
    GLM45,
    HERMES,
    KIMI_K2,
    LFM2,
    LLAMA3_JSON,
    MINIMAX_M2,
    MISTRAL_V3,
    MISTRAL_V11,
    NEMOTRON,
    PYTHONIC,
    QWEN3_CODER,
    SEED_OSS,
    FamilyTemplate,
)
from tests.e2e.engine_process import EngineProcess
from tests.e2e.gateway_process import GatewayProcess, serve_scripted

pytestmark = pytest.mark.slow

# The tool and the conversation of vLLM's examples/online_serving/openai_chat_completion_client_with_tools.py.
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city to find the weather for, e.g. 'San Francisco'"},
                "state": {"type": "string", "description": "the two-letter abbreviation for the state that the city "
                          "is in, e.g. 'CA' which would mean 'California'"},
                "unit": {"type": "string", "description": "The unit to fetch the temperature in",
                         "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "state", "unit"],
        },
    },
}
CONVERSATION: list[Any] = [
    {"role": "user", "content": "Hi! How are you doing today?"},
    {"role": "assistant", "content": "I'm doing well! How can I help you?"},
    {"role": "user", "content": "Can you tell me what the temperate will be in Dallas, in fahrenheit?"},
]
DALLAS = ("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})
AUSTIN = ("get_current_weather", {"city": "Austin", "state": "TX", "unit": "fahrenheit"})
WEATHER_REPORT = "The weather in Dallas, Texas is 85 degrees fahrenheit. It is partly cloudly, with highs in the 90's."
ANSWER = " It is 85 degrees fahrenheit in Dallas, and partly cloudy."
MAX_TOKENS = 64


@dataclass(frozen=True)
class Family:
    """A family's template, what its model writes after the generation prompt, the calls that is, and what it writes
    after a tool result (None: its prompt then ends as any other, so it calls again)."""

    template: FamilyTemplate
    reply: tuple[str, ...]
    calls: tuple[tuple[str, dict[str, str]], ...]
    after_result: tuple[str, ...] | None = None
    ids: str = r"call_[0-9a-f]{24}"  # the calls' ids: OpenAI's shape, or the family's own


def _dallas(open_: str, between: tuple[str, str], close: str) -> tuple[str, ...]:
    """The pieces of the Dallas call: its opening up to the city, the values, and what separates them."""
    return (open_, "Dallas", between[0], "TX", between[1], "fahrenheit", close)


_JSON_BETWEEN = ('", "state": "', '", "unit": "')
FAMILIES: dict[str, Family] = {
    "mistral_v3": Family(
        MISTRAL_V3,
        ("[TOOL_CALLS]", *_dallas(' [{"name": "get_current_weather", "arguments": {"city": "', _JSON_BETWEEN, '"}}]'),
         "</s>"),
        (DALLAS,),
        after_result=(ANSWER, "</s>"),
        ids=r"[A-Za-z0-9]{9}",
    ),
    "mistral_v11": Family(
        MISTRAL_V11,
        ("[TOOL_CALLS]", "get_current_weather", "[ARGS]", json.dumps(DALLAS[1]), "</s>"),
        (DALLAS,),
        after_result=(ANSWER, "</s>"),
        ids=r"[A-Za-z0-9]{9}",
    ),
    "hermes": Family(
        HERMES,
        (*_dallas('<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "', _JSON_BETWEEN,
                  '"}}\n</tool_call>'),
         '\n<tool_call>\n{"name": "get_current_weather", "arguments": ' + json.dumps(AUSTIN[1]) + "}\n</tool_call>",
         "<|im_end|>"),
        (DALLAS, AUSTIN),
    ),
    "llama3_json": Family(
        LLAMA3_JSON,
        (*_dallas('{"name": "get_current_weather", "parameters": {"city": "', _JSON_BETWEEN, '"}}'), "<|eot_id|>"),
        (DALLAS,),
    ),
    "pythonic": Family(
        PYTHONIC,
        (*_dallas('[get_current_weather(city="', ('", state="', '", unit="'), '"), '),
         'get_current_weather(city="Austin", state="TX", unit="fahrenheit")]', "<|eot|>"),
        (DALLAS, AUSTIN),
    ),
    "qwen3_coder": Family(
        QWEN3_CODER,
        (*_dallas("<tool_call>\n<function=get_current_weather>\n<parameter=city>\n",
                  ("\n</parameter>\n<parameter=state>\n", "\n</parameter>\n<parameter=unit>\n"),
                  "\n</parameter>\n</function>\n</tool_call>"),
         "<|im_end|>"),
        (DALLAS,),
    ),
    # The markers are special tokens of these families (kept in the text for the parser); GLM, MiniMax and Seed-OSS
    # reason first (MiniMax's prompt opens the reasoning; Seed-OSS's tags are its own), and Kimi's call id is the
    # one its model wrote.
    "glm45": Family(
        GLM45,
        ("<think>", "The user wants the weather.", "</think>", "<tool_call>",
         *_dallas("get_current_weather\n<arg_key>city</arg_key>\n<arg_value>",
                  ("</arg_value>\n<arg_key>state</arg_key>\n<arg_value>",
                   "</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>"), "</arg_value>\n"),
         "</tool_call>", "<|observation|>"),
        (DALLAS,),
    ),
    "deepseek_v31": Family(
        DEEPSEEK_V31,
        ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "get_current_weather", "<｜tool▁sep｜>",
         *_dallas('{"city": "', _JSON_BETWEEN, '"}'), "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>",
         "<｜end▁of▁sentence｜>"),
        (DALLAS,),
        after_result=(ANSWER, "<｜end▁of▁sentence｜>"),
    ),
    "kimi_k2": Family(
        KIMI_K2,
        ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.get_current_weather:0",
         "<|tool_call_argument_begin|>", *_dallas('{"city": "', _JSON_BETWEEN, '"}'), "<|tool_call_end|>",
         "<|tool_calls_section_end|>", "<|im_end|>"),
        (DALLAS,),
        ids=r"functions\.get_current_weather:0",
    ),
    "minimax_m2": Family(
        MINIMAX_M2,
        ("The user wants the weather.", "</think>", "\n\n", "<minimax:tool_call>",
         *_dallas('\n<invoke name="get_current_weather">\n<parameter name="city">',
                  ('</parameter>\n<parameter name="state">', '</parameter>\n<parameter name="unit">'),
                  "</parameter>\n</invoke>\n"),
         "</minimax:tool_call>", "[e~["),
        (DALLAS,),
    ),
    "seed_oss": Family(
        SEED_OSS,
        ("<seed:think>", "The user wants the weather.", "</seed:think>", "<seed:tool_call>",
         *_dallas("\n<function=get_current_weather>\n<parameter=city>",
                  ("</parameter>\n<parameter=state>", "</parameter>\n<parameter=unit>"), "</parameter>\n</function>\n"),
         "</seed:tool_call>", "<seed:eos>"),
        (DALLAS,),
    ),
    # Nemotron's prompt opens the reasoning; LFM2's template does not read tool_calls (the engine writes them back).
    "nemotron": Family(
        NEMOTRON,
        ("The user wants the weather.", "</think>", "<TOOLCALL>",
         *_dallas('[{"name": "get_current_weather", "arguments": {"city": "', _JSON_BETWEEN, '"}}]'), "</TOOLCALL>",
         "<SPECIAL_12>"),
        (DALLAS,),
    ),
    "lfm2": Family(
        LFM2,
        ("<|tool_call_start|>", *_dallas('[get_current_weather(city="', ('", state="', '", unit="'), '")]'),
         "<|tool_call_end|>", "<|im_end|>"),
        (DALLAS,),
    ),
    # Cohere's plan is a reasoning of its own tags; its actions are a JSON list of tool_name / parameters objects.
    "cohere": Family(
        COMMAND_R7B,
        ("<|START_THINKING|>", "I will look up the weather in Dallas.", "<|END_THINKING|>", "<|START_ACTION|>",
         *_dallas('[{"tool_call_id": "0", "tool_name": "get_current_weather", "parameters": {"city": "',
                  _JSON_BETWEEN, '"}}]'),
         "<|END_ACTION|>", "<|END_OF_TURN_TOKEN|>"),
        (DALLAS,),
    ),
    # Gemma 4 writes its own literals; its prompt closed an empty thought channel.
    "gemma4": Family(
        GEMMA4,
        ("<|tool_call>", *_dallas('call:get_current_weather{city:<|"|>', ('<|"|>,state:<|"|>', '<|"|>,unit:<|"|>'),
                                  '<|"|>}'),
         "<tool_call|>", "<turn|>"),
        (DALLAS,),
    ),
}


@dataclass
class Served:
    family: Family
    model: str
    engine: EngineProcess
    gateway: GatewayProcess
    client: openai.OpenAI


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    family = FAMILIES[request.param]
    root: Path = tmp_path_factory.mktemp(request.param)
    scripts = {family.template.cue: family.reply}
    if family.after_result is not None:
        scripts[family.template.tool_cue] = family.after_result
    with serve_scripted(root, family.template, scripts) as (model, engine, gateway, client):
        yield Served(family, model, engine, gateway, client)


def _calls(tool_calls: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or []]


def _check_ids(served: Served, ids: list[str]) -> None:
    assert all(re.fullmatch(served.family.ids, i) for i in ids), ids
    assert len(set(ids)) == len(ids)


def _streamed(served: Served, **body: Any) -> tuple[list[tuple[str, dict[str, Any]]], list[str], str | None]:
    """The calls, ids and finish reason of a streamed request, with every chunk carrying one choice (clients index
    `choices[0]` of each)."""
    parts: dict[int, list[str]] = {}
    finish = None
    for chunk in served.client.chat.completions.create(model=served.model, stream=True, **body):
        (choice,) = chunk.choices
        assert not choice.delta.content
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            entry = parts.setdefault(delta.index, ["", "", ""])
            if delta.id:
                assert not entry[0], "the id comes once, with a call's first delta"
                entry[0] = delta.id
            if delta.function and delta.function.name:
                entry[1] += delta.function.name
            if delta.function and delta.function.arguments:
                entry[2] += delta.function.arguments
    ordered = [parts[i] for i in sorted(parts)]
    return [(name, json.loads(arguments)) for _, name, arguments in ordered], [p[0] for p in ordered], finish


def test_the_sdk_reads_the_calls_whole_and_streamed(served: Served) -> None:
    body = {"messages": CONVERSATION, "tools": [WEATHER_TOOL], "max_tokens": MAX_TOKENS}
    reply = served.client.chat.completions.create(model=served.model, **body)
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert _calls(choice.message.tool_calls) == list(served.family.calls)
    _check_ids(served, [c.id for c in choice.message.tool_calls or []])
    calls, ids, finish = _streamed(served, **body)
    assert calls == list(served.family.calls) and finish == "tool_calls"
    _check_ids(served, ids)


def test_parallel_tool_calls_false_answers_with_the_first_call(served: Served) -> None:
    """`parallel_tool_calls: false` (OpenAI: at most one call a turn): where the model writes several calls (Hermes',
    pythonic, ...) the answer holds its first, whole and streamed, finishing as `tool_calls`; one call is as before."""
    body = {"messages": CONVERSATION, "tools": [WEATHER_TOOL], "max_tokens": MAX_TOKENS, "parallel_tool_calls": False}
    reply = served.client.chat.completions.create(model=served.model, **body)
    (choice,) = reply.choices
    assert _calls(choice.message.tool_calls) == list(served.family.calls[:1]) and choice.finish_reason == "tool_calls"
    calls, ids, finish = _streamed(served, **body)
    assert calls == list(served.family.calls[:1]) and finish == "tool_calls"
    _check_ids(served, ids)
    # The Responses API likewise, whole and streamed (its flat tools; the same conversation as input items).
    flat = {"type": "function", **WEATHER_TOOL["function"]}
    request = {"model": served.model, "input": CONVERSATION, "tools": [flat], "parallel_tool_calls": False,
               "max_output_tokens": MAX_TOKENS}  # fmt: skip
    whole = served.client.responses.create(**request)
    with served.client.responses.stream(**request) as stream:
        streamed = stream.get_final_response()
    for response in (whole, streamed):
        items = [(i.name, json.loads(i.arguments)) for i in response.output if i.type == "function_call"]
        assert items == list(served.family.calls[:1]) and response.parallel_tool_calls is False, response.output


def test_calls_sent_back_render_through_the_family_template(served: Served) -> None:
    first = served.client.chat.completions.create(model=served.model, messages=CONVERSATION, tools=[WEATHER_TOOL],
                                                  max_tokens=MAX_TOKENS)  # type: ignore[arg-type]  # fmt: skip
    calls = first.choices[0].message.tool_calls or []
    history = [*CONVERSATION, {"role": "assistant", "tool_calls": calls}]
    history += [{"role": "tool", "content": WEATHER_REPORT, "tool_call_id": c.id, "name": c.function.name}
                for c in calls]  # fmt: skip
    again = served.client.chat.completions.create(model=served.model, messages=history, tools=[WEATHER_TOOL],
                                                  max_tokens=MAX_TOKENS)  # type: ignore[arg-type]  # fmt: skip
    message = again.choices[0].message
    if served.family.after_result is not None:
        assert message.content == ANSWER and not message.tool_calls
    else:
        assert _calls(message.tool_calls) == list(served.family.calls)
    # An id the family's template does not take is the client's error, in OpenAI's shape.
    if served.family.template is MISTRAL_V3:
        history[-2] = {**history[-2], "tool_calls": [{**calls[0].to_dict(), "id": "call_0123456789"}]}
        history[-1] = {**history[-1], "tool_call_id": "call_0123456789"}
        with pytest.raises(openai.BadRequestError, match="9 letters and digits"):
            served.client.chat.completions.create(model=served.model, messages=history, max_tokens=4)  # type: ignore[arg-type]


def test_a_call_of_a_tool_not_in_the_request_stays_in_content(served: Served) -> None:
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    reply = served.client.chat.completions.create(model=served.model, messages=CONVERSATION, tools=[other],
                                                  max_tokens=MAX_TOKENS)  # type: ignore[arg-type, list-item]  # fmt: skip
    (choice,) = reply.choices
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert "get_current_weather" in (choice.message.content or "") and "Dallas" in (choice.message.content or "")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_calls_are_written_in_the_family_format(served: Served, stream: bool) -> None:
    named = {"type": "function", "function": {"name": "get_current_weather"}}
    for choice in ("required", named):
        body = {"messages": CONVERSATION, "tools": [WEATHER_TOOL], "tool_choice": choice, "max_tokens": MAX_TOKENS,
                "temperature": 0}  # fmt: skip
        if stream:
            calls, ids, finish = _streamed(served, **body)
        else:
            reply = served.client.chat.completions.create(model=served.model, **body)  # type: ignore[call-overload]
            calls, finish = _calls(reply.choices[0].message.tool_calls), reply.choices[0].finish_reason
            ids = [c.id for c in reply.choices[0].message.tool_calls or []]
        # One call: the grammar ends after the first (the reply's second call, where it has one, is cut).
        assert calls == [served.family.calls[0]] and finish in ("tool_calls", "stop"), (choice, calls, finish)
        _check_ids(served, ids)


def test_the_batched_chat_route_parses_them(served: Served) -> None:
    body = {"model": served.model, "messages": [CONVERSATION, CONVERSATION[2:]], "tools": [WEATHER_TOOL],
            "max_tokens": MAX_TOKENS}  # fmt: skip
    reply = httpx.post(f"{served.gateway.url}/v1/chat/completions/batch", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    for choice in reply.json()["choices"]:
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in choice["message"]["tool_calls"]]  # fmt: skip
        assert calls == list(served.family.calls) and choice["finish_reason"] == "tool_calls"


# The batch paths share the parsing with chat: two formats show it.
@pytest.mark.parametrize("served", ["mistral_v3", "qwen3_coder"], indirect=True)
def test_a_batch_job_and_ladle_batch_parse_them(served: Served, tmp_path: Path) -> None:
    body = {"model": served.model, "messages": CONVERSATION, "tools": [WEATHER_TOOL], "max_tokens": MAX_TOKENS}
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(2)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with source.open("rb") as f:
        file_id = served.client.files.create(file=f, purpose="batch").id
    batch = served.client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                         completion_window="24h")  # fmt: skip
    deadline = time.monotonic() + 240
    while (batch := served.client.batches.retrieve(batch.id)).status != "completed":
        assert batch.status in ("validating", "in_progress", "finalizing") and time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch.output_file_id is not None
    rows = [json.loads(row) for row in served.client.files.content(batch.output_file_id).text.splitlines()]
    output = tmp_path / "out.jsonl"
    offline = [sys.executable, "-m", "ladle_cli", "batch", "-i", str(source), "-o", str(output), "--engine",
               served.engine.address]  # fmt: skip
    run = subprocess.run(offline, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows += [json.loads(row) for row in output.read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        message = row["response"]["body"]["choices"][0]["message"]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
        assert calls == list(served.family.calls)


@pytest.mark.parametrize("served", ["mistral_v3"], indirect=True)
def test_the_vllm_tool_calling_example(served: Served) -> None:
    """The steps of vLLM's tool-calling client example, as it makes them against Mistral-7B-Instruct-v0.3 with the
    Mistral tool template: a completion with tools and no tool_choice, the same streamed (each chunk's
    `choices[0]` read, the arguments gathered by index), then the calls and their results sent back."""
    client, model = served.client, served.client.models.list().data[0].id
    messages = [dict(m) for m in CONVERSATION]
    chat_completion = client.chat.completions.create(messages=messages, model=model, tools=[WEATHER_TOOL])  # type: ignore[arg-type, list-item]
    chunks = list(client.chat.completions.create(messages=messages, model=model, tools=[WEATHER_TOOL], stream=True))  # type: ignore[arg-type, list-item]
    arguments: list[str] = []
    index = -1
    for chunk in chunks:
        if chunk.choices[0].delta.tool_calls:
            tool_call = chunk.choices[0].delta.tool_calls[0]
            if tool_call.index != index:
                index = tool_call.index
                arguments.append("")
            if tool_call.function and tool_call.function.arguments:
                arguments[index] += tool_call.function.arguments
    assert [json.loads(a) for a in arguments] == [DALLAS[1]]
    messages.append({"role": "assistant", "tool_calls": chat_completion.choices[0].message.tool_calls})  # type: ignore[dict-item]

    def get_current_weather(city: str, state: str, unit: str) -> str:
        return WEATHER_REPORT

    for call in chat_completion.choices[0].message.tool_calls or []:
        result = {"get_current_weather": get_current_weather}[call.function.name](**json.loads(call.function.arguments))
        messages.append({"role": "tool", "content": result, "tool_call_id": call.id, "name": call.function.name})
    chat_completion_2 = client.chat.completions.create(messages=messages, model=model, tools=[WEATHER_TOOL],
                                                       stream=False)  # type: ignore[arg-type, list-item]  # fmt: skip
    assert chat_completion_2.choices[0].message.content == ANSWER
