"""Tool calling over gRPC: forced calls parse and validate every time, streamed or not; auto and history work.

The embedded SmolLM2 template has no tool support, so every request here also goes through the fallback prompt.
Trials vary the question, the tools' order, a system message, temperature and seed, and run concurrently.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeAlias

import grpc
import jsonschema
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.e2e.helpers import sampling

Stub: TypeAlias = engine_pb2_grpc.EngineServiceStub

TRIALS = 20
MAX_TOKENS = 96  # a call of either tool fits whatever the model writes: the strings are bounded
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 32},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 48},
        "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
    },
    "required": ["query"],
}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
TOOLS = [
    types_pb2.Tool(name="get_weather", description="Current weather in a city", parameters_json=json.dumps(WEATHER)),
    types_pb2.Tool(name="search", description="Search the web", parameters_json=json.dumps(SEARCH)),
]
QUESTIONS = [
    "What's the weather in Paris?",
    "Find recent news about solar panels.",
    "Is it cold in Oslo today? Answer in fahrenheit.",
    "Look up the tallest building in the world.",
    "How warm is it in Nairobi right now?",
    "Search for three good pasta recipes.",
    "Do I need an umbrella in London?",
    "Who won the last football world cup?",
]
TEMPERATURES = [0.0, 0.4, 0.7, 1.0]


@dataclass
class Outcome:
    """What a trial got back: content, calls as (id, name, arguments), and the finish reason."""

    text: str = ""
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    finish_reason: int = 0


def _chat(i: int, choice: types_pb2.ToolChoice, messages: list[types_pb2.ChatMessage] | None = None) -> types_pb2.Input:
    if messages is None:
        messages = [types_pb2.ChatMessage(role="user", content=QUESTIONS[i % len(QUESTIONS)])]
        if i % 3 == 0:
            messages.insert(0, types_pb2.ChatMessage(role="system", content="You are a careful assistant."))
    tools = TOOLS if i % 2 == 0 else TOOLS[::-1]
    return types_pb2.Input(chat=types_pb2.ChatInput(messages=messages, tools=tools, tool_choice=choice))


def _sampling(i: int) -> types_pb2.SamplingParams:
    return sampling(MAX_TOKENS, temperature=TEMPERATURES[i % len(TEMPERATURES)], seed=1000 + i)


def _generate(stub: Stub, request: engine_pb2.GenerateRequest) -> Outcome:
    (choice,) = stub.Generate(request, timeout=300).choices
    return Outcome(choice.text, [(c.id, c.name, c.arguments_json) for c in choice.tool_calls], choice.finish_reason)


def _stream(stub: Stub, request: engine_pb2.StreamRequest) -> Outcome:
    """Joins a stream's deltas the way an OpenAI client does; checks each call's first delta has id and name."""
    outcome = Outcome()
    calls: dict[int, list[str]] = {}
    for response in stub.Stream(request, timeout=300):
        for delta in response.choices:
            outcome.text += delta.text
            for piece in delta.tool_calls:
                if piece.index not in calls:
                    assert piece.id.startswith("call_") and piece.name, piece
                    calls[piece.index] = [piece.id, piece.name, ""]
                else:
                    assert not piece.id and not piece.name, piece
                calls[piece.index][2] += piece.arguments_json_delta
            outcome.finish_reason = delta.finish_reason or outcome.finish_reason
    outcome.calls = [(c[0], c[1], c[2]) for _, c in sorted(calls.items())]
    return outcome


def _problems(outcome: Outcome, allowed: set[str], finish: int) -> list[str]:
    """Why a forced trial failed; [] when it gave exactly the calls it must."""
    problems = []
    if outcome.finish_reason != finish:
        problems.append(f"finish_reason {types_pb2.FinishReason.Name(outcome.finish_reason)}")
    if outcome.text or len(outcome.calls) != 1:
        problems.append(f"expected one call and no content, got {len(outcome.calls)} calls, text {outcome.text!r}")
    for _, name, arguments in outcome.calls:
        try:
            assert name in allowed, f"name {name!r}"
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        except Exception as exc:
            problems.append(f"{name}({arguments}): {exc}")
    return problems


@pytest.mark.parametrize("rpc", ["Generate", "Stream"])
def test_forced_tool_calls_parse_and_validate_in_every_trial(stub: Stub, rpc: str) -> None:
    """tool_choice "required" and a named function, TRIALS each: 100% parseable, schema-valid calls."""
    trials: list[tuple[set[str], int, engine_pb2.GenerateRequest | engine_pb2.StreamRequest]] = []
    for i in range(TRIALS):
        required = types_pb2.ToolChoice(mode=types_pb2.TOOL_CHOICE_MODE_REQUIRED)
        name = "get_weather" if i % 2 == 0 else "search"
        named = types_pb2.ToolChoice(function_name=name)
        for choice, allowed, finish in [
            (required, set(SCHEMAS), types_pb2.FINISH_REASON_TOOL_CALLS),
            (named, {name}, types_pb2.FINISH_REASON_STOP),  # OpenAI reports "stop" for a named function
        ]:
            message = engine_pb2.GenerateRequest if rpc == "Generate" else engine_pb2.StreamRequest
            trials.append((allowed, finish, message(input=_chat(i, choice), sampling=_sampling(i))))
    run = _generate if rpc == "Generate" else _stream
    with ThreadPoolExecutor(max_workers=len(trials)) as pool:
        outcomes = list(pool.map(lambda trial: run(stub, trial[2]), trials))
    failures = {
        i: problems
        for i, ((allowed, finish, _), outcome) in enumerate(zip(trials, outcomes, strict=True))
        if (problems := _problems(outcome, allowed, finish))
    }
    assert not failures, f"{len(failures)} of {len(trials)} trials failed: {failures}"
    ids = [call_id for outcome in outcomes for call_id, _, _ in outcome.calls]
    assert len(set(ids)) == len(ids)


def test_auto_gives_content_or_valid_calls_and_a_tool_history_renders(stub: Stub) -> None:
    history = [
        types_pb2.ChatMessage(role="user", content="What's the weather in Paris?"),
        types_pb2.ChatMessage(
            role="assistant",
            tool_calls=[types_pb2.ToolCall(id="call_1", name="get_weather", arguments_json='{"city": "Paris"}')],
        ),
        types_pb2.ChatMessage(role="tool", tool_call_id="call_1", content='{"temperature": 18, "sky": "sunny"}'),
    ]
    auto = types_pb2.ToolChoice(mode=types_pb2.TOOL_CHOICE_MODE_AUTO)
    requests = [
        engine_pb2.GenerateRequest(input=_chat(i, types_pb2.ToolChoice()), sampling=_sampling(i)) for i in range(4)
    ]
    requests.append(engine_pb2.GenerateRequest(input=_chat(0, auto, history), sampling=_sampling(0)))
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        outcomes = list(pool.map(lambda request: _generate(stub, request), requests))
    for outcome in outcomes:
        if outcome.calls:
            assert outcome.finish_reason == types_pb2.FINISH_REASON_TOOL_CALLS
            for _, name, arguments in outcome.calls:
                assert name in SCHEMAS and isinstance(json.loads(arguments), dict)
        else:
            assert outcome.text and outcome.finish_reason in (
                types_pb2.FINISH_REASON_STOP,
                types_pb2.FINISH_REASON_LENGTH,
            )
    # The rendered prompt holds the earlier call and its result, in the fallback's plain-text form.
    rendered = stub.Tokenize(engine_pb2.TokenizeRequest(input=_chat(0, auto, history)), timeout=60).prompt_text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
    assert '<tool_response>\n{"temperature": 18, "sky": "sunny"}\n</tool_response>' in rendered
    # After a tool result the model can be made to call again.
    required = types_pb2.ToolChoice(mode=types_pb2.TOOL_CHOICE_MODE_REQUIRED)
    after = _generate(stub, engine_pb2.GenerateRequest(input=_chat(1, required, history), sampling=_sampling(1)))
    assert not _problems(after, set(SCHEMAS), types_pb2.FINISH_REASON_TOOL_CALLS)


def test_tool_choice_none_never_parses_calls(stub: Stub) -> None:
    none = types_pb2.ToolChoice(mode=types_pb2.TOOL_CHOICE_MODE_NONE)
    outcome = _generate(stub, engine_pb2.GenerateRequest(input=_chat(0, none), sampling=_sampling(0)))
    assert not outcome.calls and outcome.finish_reason != types_pb2.FINISH_REASON_TOOL_CALLS


@pytest.mark.parametrize(
    ("choice", "constraint"),
    [
        (types_pb2.ToolChoice(function_name="launch_rockets"), None),
        (types_pb2.ToolChoice(mode=types_pb2.TOOL_CHOICE_MODE_REQUIRED), types_pb2.Constraint(regex="a+")),
    ],
)
def test_impossible_tool_choices_are_invalid_argument_naming_tool_choice(
    stub: Stub, choice: types_pb2.ToolChoice, constraint: types_pb2.Constraint | None
) -> None:
    request = engine_pb2.GenerateRequest(input=_chat(0, choice), sampling=_sampling(0), constraint=constraint)
    with pytest.raises(grpc.RpcError) as failure:
        stub.Generate(request, timeout=60)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tool_choice" in str(failure.value.details())
    assert ("ladle-param", "tool_choice") in tuple(failure.value.trailing_metadata() or ())
