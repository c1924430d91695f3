"""Structured-output specs built to fail: invalid schemas, regexes and grammars (a good schema right after a bad
one still works), schemas nested past the limit, and a regex whose compile is catastrophic — refused at the
engine's --grammar-timeout while other requests keep streaming."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import grpc
import httpx
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.adversarial.conftest import GRAMMAR_TIMEOUT_S
from tests.adversarial.helpers import HELLO, assert_rpc_error, rpc_error, still_serves_grpc, still_serves_http
from tests.e2e.helpers import assert_error, chat_input, sampling, stream

pytestmark = pytest.mark.slow

Stub = engine_pb2_grpc.EngineServiceStub
INVALID = grpc.StatusCode.INVALID_ARGUMENT
GOOD_SCHEMA = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}
# xgrammar turns each bounded repetition into states; ~3 s of compiling on this CPU, far past the 1 s limit.
CATASTROPHIC_REGEX = "(a|aa)*(b|bb)*" * 30 + "[a-z]{1,1000}" * 20


def nested_schema(levels: int) -> dict[str, Any]:
    """An object schema nesting `levels` objects (2 JSON levels each) around a string."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def chat(http: httpx.Client, model: str, **fields: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": model, "messages": HELLO, "max_tokens": 16,
                                                   "temperature": 0, **fields})


def json_schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def constrained(constraint: types_pb2.Constraint, max_tokens: int = 16) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(input=chat_input("Give me a number."), sampling=sampling(max_tokens),
                                      constraint=constraint)


def message(error: dict[str, Any]) -> str:
    text: str = error["message"]
    return text


def test_invalid_schema_regex_and_grammar_then_a_good_schema(http: httpx.Client, stub: Stub, model_id: str) -> None:
    bad_http = [
        ({"response_format": json_schema_format({"type": "nonsense"})}, "json_schema",
         'invalid json_schema: Unsupported type "nonsense"'),
        ({"response_format": json_schema_format({"$ref": "#/nowhere"})}, "json_schema", "invalid json_schema:"),
        ({"guided_json": "{not json"}, "json_schema", "json_schema is not valid JSON"),
        ({"response_format": {"type": "json_schema"}}, "response_format",
         "response_format.json_schema.schema is required for type json_schema"),
        ({"structured_outputs": {"regex": "(a"}}, "regex",
         "invalid regex: Regex parsing error at position 3: The parenthesis is not closed."),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "grammar",
         'invalid grammar: EBNF parser error at line 1, column 10: Rule "undefined_rule" is not defined'),
        ({"structured_outputs": {"choice": []}}, "choice", "choice must list at least one option"),
        ({"regex": "a", "guided_grammar": 'root ::= "a"'}, "guided_grammar",
         "give one structured-output constraint, not several"),
    ]
    for fields, param, fragment in bad_http:
        assert fragment in message(assert_error(chat(http, model_id, **fields), 400, param))
        if param in ("json_schema", "regex", "grammar") and "not valid JSON" not in fragment:  # right after one
            good = chat(http, model_id, response_format=json_schema_format(GOOD_SCHEMA))
            assert good.status_code == 200, good.text
            assert isinstance(json.loads(good.json()["choices"][0]["message"]["content"])["answer"], bool)

    bad_grpc = [
        (types_pb2.Constraint(json_schema='{"type": "nonsense"}'), "json_schema", "invalid json_schema"),
        (types_pb2.Constraint(json_schema="[1, 2]"), "json_schema", "json_schema must be a JSON object, got list"),
        (types_pb2.Constraint(regex="[z-a]"), "regex", "invalid regex"),
        (types_pb2.Constraint(grammar="root ::= ("), "grammar", "invalid grammar: EBNF parser error"),
        (types_pb2.Constraint(grammar=""), "grammar", "grammar must be a non-empty string"),
    ]
    for spec, param, fragment in bad_grpc:
        assert_rpc_error(rpc_error(stub.Generate, constrained(spec), timeout=60), INVALID, param, fragment)
    good = stub.Generate(constrained(types_pb2.Constraint(json_schema=json.dumps(GOOD_SCHEMA))), timeout=60)
    assert isinstance(json.loads(good.choices[0].text)["answer"], bool)
    still_serves_grpc(stub)


def test_a_deeply_nested_schema(http: httpx.Client, stub: Stub, model_id: str) -> None:
    """Past 128 JSON levels a schema is refused at once (xgrammar's work grows with the cube of the depth: 900
    levels took 40 s of CPU); past what Python's JSON parser can hold, the body or spec is refused as such."""
    deep = assert_error(chat(http, model_id, response_format=json_schema_format(nested_schema(100))), 400,
                        "json_schema")
    assert message(deep) == "json_schema is nested 201 levels deep; at most 128 are allowed"
    too_deep_to_parse = ('{"model": "m", "messages": [], "response_format": '
                         + '{"a": ' * 5000 + "1" + "}" * 5000 + "}")
    unparsable = http.post("/v1/chat/completions", content=too_deep_to_parse.encode(),
                           headers={"content-type": "application/json"})
    assert message(assert_error(unparsable, 400, None)) == "There was an error parsing the body"
    within = chat(http, model_id, response_format=json_schema_format(nested_schema(20)), max_tokens=4)
    assert within.status_code == 200, within.text

    nested = types_pb2.Constraint(json_schema=json.dumps(nested_schema(300)))
    assert_rpc_error(rpc_error(stub.Generate, constrained(nested), timeout=60), INVALID, "json_schema",
                     "json_schema is nested 601 levels deep; at most 128 are allowed")
    unparsable_spec = types_pb2.Constraint(json_schema='{"a": ' * 2000 + "1" + "}" * 2000)
    assert_rpc_error(rpc_error(stub.Generate, constrained(unparsable_spec), timeout=60), INVALID, "json_schema",
                     "json_schema is nested too deeply; at most 128 levels are allowed")
    # A forced tool call turns the tool's parameters into a grammar on the engine's tokenizer thread, with no
    # time limit: the same depth limit keeps that thread (every other request's tokenizing) free.
    tool_input = chat_input("Call f.")
    tool_input.chat.tools.add(name="f", parameters_json=json.dumps(nested_schema(300)))
    tool_input.chat.tool_choice.mode = types_pb2.TOOL_CHOICE_MODE_REQUIRED
    tool_call = engine_pb2.GenerateRequest(input=tool_input, sampling=sampling(4))
    assert_rpc_error(rpc_error(stub.Generate, tool_call, timeout=60), INVALID, "tools",
                     "tools is nested 601 levels deep; at most 128 are allowed")
    still_serves_http(http, model_id)
    still_serves_grpc(stub)


def test_a_catastrophic_regex_is_time_limited_while_others_stream(
    http: httpx.Client, stub: Stub, model_id: str
) -> None:
    streams = [stub.Stream(stream(f"Story {i}:", 2000, ignore_eos=True), timeout=300) for i in range(2)]
    arrivals: list[list[float]] = [[] for _ in streams]

    def read(i: int) -> None:
        try:
            for _ in streams[i]:
                arrivals[i].append(time.monotonic())
        except grpc.RpcError:
            pass  # cancelled at the end

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(streams))]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 120
        while not all(arrivals) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(arrivals), "the streams never started"
        windows = []
        # The HTTP and gRPC specs differ, so the second is not served by the first's compile (cached once done).
        started = time.monotonic()
        refused = chat(http, model_id, structured_outputs={"regex": CATASTROPHIC_REGEX + "x"})
        windows.append((started, time.monotonic()))
        assert message(assert_error(refused, 400, "regex")) == (
            f"regex did not compile within {GRAMMAR_TIMEOUT_S:g} s; simplify it")
        started = time.monotonic()
        error = rpc_error(stub.Generate, constrained(types_pb2.Constraint(regex=CATASTROPHIC_REGEX + "y")),
                          timeout=60)
        windows.append((started, time.monotonic()))
        assert_rpc_error(error, INVALID, "regex", f"regex did not compile within {GRAMMAR_TIMEOUT_S:g} s")
        for started, failed in windows:
            assert GRAMMAR_TIMEOUT_S <= failed - started < GRAMMAR_TIMEOUT_S + 3.0
        # A compile cannot be stopped: each goes on for a few seconds after its caller is answered. Were the step
        # loop held while one runs, no token would arrive until a second after the last answer. (A finer window
        # is too short a sample on a loaded 2-core machine, where one step can take a second.)
        first, last = windows[0][0], windows[-1][1] + 1.0
        while time.monotonic() < last:
            time.sleep(0.1)
        for i, times in enumerate(arrivals):
            assert any(first < t < last for t in times), (
                f"stream {i} stalled while the regexes compiled", [round(t - first, 2) for t in times[-8:]], windows)
        still_serves_http(http, model_id)
        still_serves_grpc(stub)
    finally:
        for call in streams:
            call.cancel()
        for reader in readers:
            reader.join(10)
