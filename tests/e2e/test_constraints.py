"""Constrained output over gRPC: every kind parses, bad specs fail alone with INVALID_ARGUMENT."""

from __future__ import annotations

import json
import re
from typing import TypeAlias

import grpc
import jsonschema
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.e2e.helpers import chat_input, joined_stream, sampling

Stub: TypeAlias = engine_pb2_grpc.EngineServiceStub

# Integers bounded, as the other e2e schemas bound them: an unbounded one lets a 135M model run digits to the
# token limit (the embedded GGUF under greedy decoding wrote "age": 1234567890... here).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
}


def _generate(question: str, constraint: types_pb2.Constraint, max_tokens: int = 64) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        input=chat_input(question), sampling=sampling(max_tokens), constraint=constraint
    )


def test_every_constraint_kind_holds_through_generate(stub: Stub) -> None:
    cases = [
        (types_pb2.Constraint(json_schema=json.dumps(PERSON)), "Describe a person as JSON."),
        (types_pb2.Constraint(regex="(yes|no)"), "Is the sky blue? Answer yes or no."),
        (types_pb2.Constraint(choice=types_pb2.ChoiceList(choices=["red", "green", "blue"])), "Pick a color."),
        (types_pb2.Constraint(grammar='root ::= "The answer is " [0-9]+ "."'), "What is 6 times 7?"),
    ]
    for constraint, question in cases:
        (choice,) = stub.Generate(_generate(question, constraint), timeout=120).choices
        assert choice.finish_reason == types_pb2.FINISH_REASON_STOP, (question, choice.text)
        kind = constraint.WhichOneof("kind")
        if kind == "json_schema":
            jsonschema.validate(json.loads(choice.text), PERSON)
        elif kind == "regex":
            assert re.fullmatch("(yes|no)", choice.text)
        elif kind == "choice":
            assert choice.text in {"red", "green", "blue"}
        else:
            assert re.fullmatch(r"The answer is [0-9]+\.", choice.text)


def test_a_constrained_stream_yields_valid_json(stub: Stub) -> None:
    request = engine_pb2.StreamRequest(
        input=chat_input("Give me a JSON object about a cat."),
        sampling=sampling(96),
        constraint=types_pb2.Constraint(json_schema=json.dumps(PERSON)),
    )
    text, _, finish = joined_stream(list(stub.Stream(request, timeout=120)))[0]
    assert finish == types_pb2.FINISH_REASON_STOP
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    "constraint",
    [
        types_pb2.Constraint(regex="(unclosed"),
        types_pb2.Constraint(json_schema="{not json"),
        types_pb2.Constraint(grammar="root ::= undefined_rule"),
        types_pb2.Constraint(choice=types_pb2.ChoiceList()),
    ],
)
def test_a_bad_spec_fails_alone_with_invalid_argument(stub: Stub, constraint: types_pb2.Constraint) -> None:
    with pytest.raises(grpc.RpcError) as error:
        stub.Generate(_generate("Hi", constraint), timeout=60)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details()
    reply = stub.Generate(_generate("Pick one.", types_pb2.Constraint(regex="(a|b)")), timeout=60)
    assert reply.choices[0].text in {"a", "b"}
