"""Tool calls through the RequestTracker: content, OpenAI-style call deltas per step, the result, finish reasons."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine_server.core.engine_core import CoreOutput
from engine_server.core.request import RequestStatus
from engine_server.frontend import Choice, GenerationResult, RequestTracker
from engine_server.model_runner import SampledToken
from engine_server.output.types import FinishReason
from engine_server.sampling_params import SamplingParams
from engine_server.tools import ToolFormat, ToolParsing

EOS = 2
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
AUTO = ToolParsing(ToolFormat.HERMES, frozenset({"get_weather", "search"}))
NAMED = ToolParsing(ToolFormat.HERMES, frozenset({"get_weather"}), FinishReason.STOP)


def _run(
    tokenizer: Any,
    text: str,
    parsing: ToolParsing | None,
    status: RequestStatus = RequestStatus.FINISHED_STOPPED,
    chunk: int = 3,
) -> tuple[list[Choice], GenerationResult]:
    """Feed `text`'s tokens (then eos when stopped) `chunk` at a time; returns the step deltas and the result."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if status is RequestStatus.FINISHED_STOPPED:
        ids.append(EOS)
    tracker = RequestTracker(tokenizer, "r", [1, 2, 3], SamplingParams(), tool_parsing=parsing)
    steps = []
    for start in range(0, len(ids), chunk):
        last = start + chunk >= len(ids)
        output = CoreOutput(
            "r/0",
            [SampledToken(t) for t in ids[start : start + chunk]],
            status if last else None,
            EOS if last and status is RequestStatus.FINISHED_STOPPED else None,
        )
        steps.append(tracker.update(0, output)[0])
    return steps, tracker.result


def test_a_call_streams_as_a_header_delta_then_its_arguments(smollm2_tokenizer: Any) -> None:
    steps, result = _run(smollm2_tokenizer, "Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"), AUTO)
    (choice,) = result.choices
    assert choice.text == "Let me look." and "".join(s.text for s in steps) == choice.text
    assert [c.name for c in choice.tool_calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.arguments_json)["city"] for c in choice.tool_calls] == ["Paris", "Oslo"]
    assert choice.finish_reason is FinishReason.TOOL_CALLS and choice.matched_stop is None
    deltas = [d for s in steps for d in s.tool_call_deltas]
    for index, call in enumerate(choice.tool_calls):
        mine = [d for d in deltas if d.index == index]
        assert (mine[0].id, mine[0].name, mine[0].arguments_delta) == (call.id, call.name, "")
        assert all(d.id == "" and d.name == "" for d in mine[1:])
        assert "".join(d.arguments_delta for d in mine) == call.arguments_json
    assert choice.tool_calls[0].id.startswith("call_") and choice.tool_calls[0].id != choice.tool_calls[1].id
    assert steps[-1].finish_reason is FinishReason.TOOL_CALLS
    assert all(s.finish_reason is None for s in steps[:-1])
    assert result.usage.completion_tokens == sum(len(s.token_ids) for s in steps)


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_the_deltas_do_not_depend_on_how_tokens_arrive(smollm2_tokenizer: Any, chunk: int) -> None:
    steps, result = _run(smollm2_tokenizer, CALL, AUTO, chunk=chunk)
    (choice,) = result.choices
    assert choice.text == "" and all(s.text == "" for s in steps)
    assert [c.arguments_json for c in choice.tool_calls] == ['{"city": "Paris", "unit": "celsius"}']


def test_a_named_function_call_finishes_with_stop_as_openai_does(smollm2_tokenizer: Any) -> None:
    _, result = _run(smollm2_tokenizer, CALL, NAMED)
    assert result.choices[0].finish_reason is FinishReason.STOP and len(result.choices[0].tool_calls) == 1


def test_a_cut_off_call_is_content_and_length_stays(smollm2_tokenizer: Any) -> None:
    text = CALL[:40]
    _, result = _run(smollm2_tokenizer, text, AUTO, status=RequestStatus.FINISHED_LENGTH)
    (choice,) = result.choices
    assert choice.finish_reason is FinishReason.LENGTH and choice.tool_calls == [] and choice.text == text


def test_output_without_calls_is_plain_content_and_stop(smollm2_tokenizer: Any) -> None:
    text = "The weather in Paris is mild. <tags> stay."
    steps, result = _run(smollm2_tokenizer, text, AUTO)
    assert result.choices[0].text == text and result.choices[0].finish_reason is FinishReason.STOP
    assert result.choices[0].matched_stop == EOS and not any(s.tool_call_deltas for s in steps)


def test_without_tool_parsing_calls_stay_text(smollm2_tokenizer: Any) -> None:
    _, result = _run(smollm2_tokenizer, CALL, None)
    assert result.choices[0].text == CALL and result.choices[0].tool_calls == []
    assert result.choices[0].finish_reason is FinishReason.STOP
