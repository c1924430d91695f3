"""The ladle.v1 contract: round-trips, field presence and the generated stubs (Python, TypeScript) being fresh."""

from __future__ import annotations

import filecmp
import subprocess
from pathlib import Path

import pytest
from google.protobuf import json_format

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2

ROOT = Path(__file__).resolve().parents[2]


def _full_request() -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id="req-1",
        input=types_pb2.Input(
            chat=types_pb2.ChatInput(
                messages=[
                    types_pb2.ChatMessage(role="system", content="Be brief."),
                    types_pb2.ChatMessage(
                        role="assistant",
                        tool_calls=[types_pb2.ToolCall(id="call_1", name="f", arguments_json='{"x": 1}')],
                    ),
                    types_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="42"),
                ],
                tools=[types_pb2.Tool(name="f", parameters_json='{"type": "object"}')],
                tool_choice=types_pb2.ToolChoice(function_name="f"),
            )
        ),
        sampling=types_pb2.SamplingParams(
            max_tokens=16, temperature=0.0, top_k=-1, logit_bias={7: -100.0}, seed=0, stop=["\n\n"], n=2,
            logprobs=True, top_logprobs=5,
        ),
        constraint=types_pb2.Constraint(choice=types_pb2.ChoiceList(choices=["yes", "no"])),
        priority=types_pb2.PRIORITY_BATCH,
    )


def test_binary_and_json_round_trip() -> None:
    request = _full_request()
    assert engine_pb2.GenerateRequest.FromString(request.SerializeToString()) == request
    as_json = json_format.MessageToJson(request)
    assert json_format.Parse(as_json, engine_pb2.GenerateRequest()) == request


def test_optional_fields_distinguish_unset_from_zero() -> None:
    zero = types_pb2.SamplingParams(temperature=0.0, top_k=0, n=0)
    unset = types_pb2.SamplingParams()
    assert zero.HasField("temperature") and zero.HasField("top_k") and zero.HasField("n")
    assert not unset.HasField("temperature") and not unset.HasField("max_tokens")
    decoded = types_pb2.SamplingParams.FromString(zero.SerializeToString())
    assert decoded.HasField("temperature") and decoded.temperature == 0.0
    # Plain proto3 fields whose zero is the semantic default carry no presence.
    with pytest.raises(ValueError):
        unset.HasField("min_tokens")


def test_input_and_constraint_are_exclusive() -> None:
    value = types_pb2.Input(text="hello")
    value.token_ids.ids.extend([1, 2, 3])
    assert value.WhichOneof("kind") == "token_ids"
    constraint = types_pb2.Constraint(regex="(yes|no)")
    constraint.json_object.SetInParent()
    assert constraint.WhichOneof("kind") == "json_object"


def test_enum_zero_values_are_unspecified() -> None:
    assert types_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
    assert types_pb2.Priority.Name(0) == "PRIORITY_UNSPECIFIED"
    assert types_pb2.ToolChoiceMode.Name(0) == "TOOL_CHOICE_MODE_UNSPECIFIED"
    assert engine_pb2.GenerateResponse().choices == []


def test_batch_response_carries_result_or_error() -> None:
    ok = engine_pb2.BatchResponse(item_id="a", result=engine_pb2.GenerateResponse(request_id="r"))
    bad = engine_pb2.BatchResponse(item_id="b", error=engine_pb2.ItemError(code=3, message="bad", param="n"))
    assert ok.WhichOneof("outcome") == "result"
    assert bad.WhichOneof("outcome") == "error" and bad.error.param == "n"


def test_service_has_the_rpcs_of_the_design() -> None:
    service = engine_pb2.DESCRIPTOR.services_by_name["EngineService"]
    methods = {m.name: m for m in service.methods}
    assert set(methods) >= {"Generate", "Stream", "Batch", "Tokenize", "GetModelInfo", "GetLoad"}
    assert methods["Stream"].server_streaming and not methods["Stream"].client_streaming
    assert methods["Batch"].server_streaming and methods["Batch"].client_streaming
    assert hasattr(engine_pb2_grpc, "EngineServiceStub") and hasattr(engine_pb2_grpc, "EngineServiceServicer")


def test_every_message_and_field_is_documented() -> None:
    """grpcurl users read these comments: every message, field, enum value and RPC has one."""
    undocumented: list[str] = []
    for proto in sorted((ROOT / "proto" / "ladle" / "v1").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            declares = stripped.startswith(("message ", "enum ", "rpc ", "oneof ", "service ")) or (
                "=" in stripped and stripped.endswith(";") and not stripped.startswith(("syntax", "option"))
            )
            if declares and not lines[i - 1].strip().startswith("//"):
                undocumented.append(f"{proto.name}:{i + 1}: {stripped}")
    assert undocumented == []


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    """Editing a .proto without `make proto` fails CI here."""
    import sys

    sys.path.insert(0, str(ROOT / "clients"))
    try:
        from generate_stubs import generate
    finally:
        sys.path.pop(0)
    fresh = generate(tmp_path)
    committed_dir = ROOT / "clients" / "ladle" / "v1"
    committed = sorted(p.name for p in committed_dir.iterdir() if p.name.endswith((".py", ".pyi")) and "_pb2" in p.name)
    assert committed == [p.name for p in fresh], "stub set differs: run `make proto`"
    stale = [p.name for p in fresh if not filecmp.cmp(p, committed_dir / p.name, shallow=False)]
    assert stale == [], f"stale stubs {stale}: run `make proto` and commit the result"


def test_committed_typescript_is_fresh(tmp_path: Path) -> None:
    """Editing a .proto without `make proto` fails CI here too: buf.gen.yaml's TypeScript (clients/typescript)."""
    buf = ROOT / ".tools" / "node_modules" / ".bin" / "buf"
    plugin = ROOT / "clients" / "typescript" / "node_modules" / ".bin" / "protoc-gen-es"
    assert buf.exists() and plugin.exists(), "buf or protoc-gen-es is missing: run `make setup`"
    generated = subprocess.run(
        [str(buf), "generate", "--output", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert generated.returncode == 0, generated.stderr
    gen = Path("clients") / "typescript" / "src" / "gen"
    fresh = sorted(p.relative_to(tmp_path / gen) for p in (tmp_path / gen).rglob("*") if p.is_file())
    committed = sorted(p.relative_to(ROOT / gen) for p in (ROOT / gen).rglob("*") if p.is_file())
    assert committed == fresh, "generated file set differs: run `make proto`"
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / gen / p, ROOT / gen / p, shallow=False)]
    assert stale == [], f"stale TypeScript {stale}: run `make proto` and commit the result"
