"""Batch input lines: every way a line can be wrong gets its own code and line number; good lines become the
engine requests the synchronous route would send, at batch priority."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from gateway.batches import lines
from ladle.v1 import types_pb2

CHAT = "/v1/chat/completions"
MODEL = "m"


def chat_line(custom_id: str = "a", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}}


def encoded(*items: Any) -> bytes:
    return b"".join((i if isinstance(i, bytes) else json.dumps(i).encode()) + b"\n" for i in items)


def check(data: bytes, endpoint: str = CHAT, max_lines: int = lines.MAX_LINES) -> tuple[int, list[lines.LineError]]:
    return lines.validate(lines.read_lines(io.BytesIO(data), 4096), endpoint, MODEL, max_lines)


def test_good_lines_validate() -> None:
    total, errors = check(encoded(chat_line("a"), chat_line("b", max_tokens=3)) + b"\n  \n")
    assert (total, errors) == (2, [])


@pytest.mark.parametrize(
    ("item", "code", "param"),
    [
        (b"{not json", "invalid_json_line", None),
        (b"[1, 2]", "invalid_json_line", None),
        ({**chat_line(), "custom_id": ""}, "missing_custom_id", "custom_id"),
        ({k: v for k, v in chat_line().items() if k != "custom_id"}, "missing_custom_id", "custom_id"),
        ({**chat_line(), "custom_id": 7}, "missing_custom_id", "custom_id"),
        ({**chat_line(), "method": "GET"}, "invalid_method", "method"),
        ({**chat_line(), "url": "/v1/completions"}, "invalid_url", "url"),
        ({**chat_line(), "body": "text"}, "invalid_body", "body"),
        (chat_line(temperature=9), "invalid_body", "body.temperature"),
        (chat_line(messages=[]), "invalid_body", "body.messages"),
        (chat_line(stream=True), "invalid_body", "body.stream"),
        (chat_line(model="gpt-4o"), "model_not_found", "body.model"),
        (chat_line(tool_choice="required"), "invalid_body", "body.tool_choice"),  # passes pydantic, not translate
        ({**chat_line(), "url": "/completions"}, "invalid_url", "url"),  # another endpoint, short form
        ({**chat_line(), "url": "v1/chat/completions"}, "invalid_url", "url"),
        ({**chat_line(), "url": "/v1/v1/chat/completions"}, "invalid_url", "url"),
        # Lone surrogates pass json.loads but no UTF-8 result file nor protobuf can hold them.
        (b'{"custom_id": "\\ud800x", "method": "POST", "url": "/v1/chat/completions", "body": {}}',
         "invalid_json_line", "custom_id"),
        (json.dumps(chat_line(messages=[{"role": "user", "content": "a\udfffb"}])).encode(), "invalid_body", "body"),
        (json.dumps(chat_line(user="a\udfffb")).encode(), "invalid_body", "body"),  # never sent, still refused
        (b"[" * 4000, "invalid_json_line", None),  # RecursionError inside json.loads (the issue's 100,000 too)
    ],
)
def test_each_bad_line_is_named(item: Any, code: str, param: str | None) -> None:
    total, errors = check(encoded(chat_line("first"), item))
    assert total == 2
    assert [(e.code, e.line, e.param) for e in errors] == [(code, 2, param)]
    assert errors[0].message


@pytest.mark.parametrize(("url", "endpoint"), [
    ("/chat/completions", "/v1/chat/completions"),  # as SGLang's OpenAI-API tutorial writes its lines
    ("/v1/chat/completions", "/v1/chat/completions"),
    ("/completions", "/v1/completions"),
    ("/v1/completions", "/v1/completions"),
])
def test_a_line_may_name_its_endpoint_without_the_v1_prefix(url: str, endpoint: str) -> None:
    body = {"model": MODEL, "max_tokens": 4}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in endpoint else {"prompt": "hi"})
    raw = encoded({"custom_id": "a", "method": "POST", "url": url, "body": body})
    assert check(raw, endpoint) == (1, [])
    assert lines.parse_line(raw, 1, 0, None, MODEL).body.model == MODEL  # `ladle batch`: any endpoint


def test_the_issues_deep_line_is_a_line_error() -> None:
    deep_object = b'{"custom_id": "b", "x": ' + b'{"y":' * 100_000 + b"1" + b"}" * 100_001
    data = encoded(chat_line("a")) + b"[" * 100_000 + b"\n" + deep_object + b"\n"
    total, errors = lines.validate(lines.read_lines(io.BytesIO(data), 1 << 20), CHAT, MODEL)
    assert total == 3 and [(e.code, e.line) for e in errors] == [("invalid_json_line", 2), ("invalid_json_line", 3)]


def test_an_unexpected_failure_while_checking_a_line_is_that_lines_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = lines.parse_line

    def flaky(raw: bytes, number: int, *args: Any) -> lines.InputLine:
        if number == 2:
            raise KeyError("surprise")
        return real(raw, number, *args)

    monkeypatch.setattr(lines, "parse_line", flaky)
    total, errors = check(encoded(chat_line("a"), chat_line("b"), chat_line("c")))
    assert total == 3 and [(e.code, e.line) for e in errors] == [("invalid_line", 2)]


def test_a_record_that_utf8_cannot_hold_is_still_written() -> None:
    record = lines.unrun_record("batch_req_1", "\ud800x", "batch_failed", "x")
    assert json.loads(lines.encode(record))["custom_id"] == "\ud800x"


def test_duplicate_custom_ids_are_refused_at_their_second_use() -> None:
    _, errors = check(encoded(chat_line("x"), chat_line("y"), chat_line("x")))
    assert [(e.code, e.line) for e in errors] == [("duplicate_custom_id", 3)]


def test_too_many_lines() -> None:
    total, errors = check(encoded(*(chat_line(str(i)) for i in range(4))), max_lines=3)
    assert total == 4 and [(e.code, e.line) for e in errors] == [("too_many_requests", 4)]


def test_a_line_over_the_size_limit_is_refused_without_reading_it_whole() -> None:
    huge = chat_line("big", messages=[{"role": "user", "content": "x" * 10_000}])
    total, errors = check(encoded(chat_line("a"), huge, chat_line("c")))
    assert total == 3 and [(e.code, e.line) for e in errors] == [("line_too_long", 2)]


def test_an_empty_file_fails() -> None:
    assert [e.code for e in check(b"\n\n")[1]] == ["empty_file"]


def test_errors_reported_are_capped() -> None:
    _, errors = check(b"x\n" * (lines.MAX_REPORTED_ERRORS + 5))
    assert len(errors) == lines.MAX_REPORTED_ERRORS


def test_lines_become_batch_priority_engine_requests() -> None:
    raw = json.dumps(chat_line("a", max_tokens=5, temperature=0)).encode()
    line = lines.parse_line(raw, 1, 0, CHAT, MODEL)
    [request] = lines.engine_requests(line, "rid")
    assert request.priority == types_pb2.PRIORITY_BATCH and request.request_id == "rid"
    assert request.sampling.max_tokens == 5 and request.input.chat.messages[0].content == "hi"

    completions = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
                   "body": {"model": MODEL, "prompt": ["one", "two"], "max_tokens": 2}}
    line = lines.parse_line(json.dumps(completions).encode(), 1, 0, "/v1/completions", MODEL)
    assert [r.request_id for r in lines.engine_requests(line, "rid")] == ["rid-0", "rid-1"]


def test_result_line_shapes() -> None:
    ok = lines.output_record("batch_req_1", "a", "req_1", 200, {"x": 1})
    assert ok == {"id": "batch_req_1", "custom_id": "a",
                  "response": {"status_code": 200, "request_id": "req_1", "body": {"x": 1}}, "error": None}
    unrun = lines.unrun_record("batch_req_2", "b", "batch_expired", "late")
    assert unrun["response"] is None and unrun["error"] == {"code": "batch_expired", "message": "late"}
    assert lines.encode(unrun).endswith(b"\n") and b"\n" not in lines.encode(unrun)[:-1]


@pytest.mark.parametrize("field", [{"previous_response_id": "resp_" + "0" * 32},
                                   {"conversation": "conv_" + "0" * 32}, {"background": True}])
def test_a_responses_line_carries_its_whole_conversation(field: dict[str, Any]) -> None:
    body = {"model": MODEL, "input": "hi", **field}
    line = {"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": body}
    _, errors = check(encoded(line), "/v1/responses")
    [name] = field
    assert [(e.code, e.param) for e in errors] == [("invalid_body", f"body.{name}")]
