"""OpenAI bodies -> ladle.v1 requests and back: the pure conversions of the gateway."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from pydantic import ValidationError

from gateway.batches import lines
from gateway.errors import APIError, validation_param
from gateway.schemas.chat import BatchChatCompletionRequest, ChatCompletionRequest
from gateway.schemas.completions import MAX_PROMPTS, CompletionRequest
from gateway.translate import from_engine, to_engine
from ladle.v1 import engine_pb2, types_pb2

HELLO = [{"role": "user", "content": "Hi"}]
HELLO_MESSAGES = ChatCompletionRequest.model_validate({"model": "m", "messages": HELLO}).messages


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HELLO, **fields})


def test_unset_fields_stay_unset_so_the_engine_applies_its_defaults() -> None:
    params = to_engine.chat_request(chat(), chat().messages, "r").sampling
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty"):
        assert not params.HasField(name), name
    assert params.n == 1 and params.skip_special_tokens


def test_every_route_leaves_omitted_sampling_fields_unset() -> None:
    """The engine's generation defaults (the model's) apply to what a caller omits on every route; only
    completions' max_tokens has OpenAI's documented default, 16."""
    unset = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "seed")
    batch_chat = BatchChatCompletionRequest.model_validate({"model": "m", "messages": [HELLO, HELLO]})
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "Hi"})
    body = {"model": "m", "messages": HELLO}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    requests = [
        *(to_engine.chat_request(batch_chat, conversation, "r") for conversation in batch_chat.messages),
        *lines.engine_requests(lines.parse_line(json.dumps(line).encode(), 1, 0, None, "m"), "r"),
    ]
    for request in requests:
        assert not any(request.sampling.HasField(name) for name in (*unset, "max_tokens"))
    (completion_request,) = to_engine.completion_requests(completion, "r")
    assert not any(completion_request.sampling.HasField(name) for name in unset)
    assert completion_request.sampling.max_tokens == 16


def test_sampling_fields_and_extras_are_carried() -> None:
    body = chat(max_tokens=5, max_completion_tokens=7, temperature=0, top_p=0.5, seed=-1, stop="END", n=2,
                logit_bias={"42": -100}, top_k=3, min_p=0.1, repetition_penalty=1.2, min_tokens=2, ignore_eos=True,
                stop_token_ids=[7], logprobs=True, top_logprobs=4, skip_special_tokens=False)
    params = to_engine.chat_request(body, body.messages, "r").sampling
    assert params.max_tokens == 7  # max_completion_tokens wins
    assert params.HasField("temperature") and params.temperature == 0
    assert params.seed == 2**63 - 1  # a negative seed maps into the engine's [0, 2**63), not onto a refused one
    assert list(params.stop) == ["END"] and list(params.stop_token_ids) == [7]
    assert dict(params.logit_bias) == {42: -100.0}
    assert (params.top_k, params.min_tokens, params.ignore_eos, params.n) == (3, 2, True, 2)
    assert params.logprobs and params.top_logprobs == 4 and not params.skip_special_tokens


@pytest.mark.parametrize(
    ("fields", "kind", "value"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", None),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}},
         "json_schema", {"type": "object"}),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "a+"),
        ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", ["x", "y"]),
        ({"structured_outputs": {"json": {"type": "string"}}}, "json_schema", {"type": "string"}),
        ({"guided_grammar": "root ::= \"a\""}, "grammar", 'root ::= "a"'),
        ({"ebnf": "root ::= \"a\""}, "grammar", 'root ::= "a"'),
        ({"json_schema": '{"type": "integer"}'}, "json_schema", {"type": "integer"}),
    ],
)
def test_every_structured_output_spelling(fields: dict[str, Any], kind: str, value: Any) -> None:
    constraint = to_engine.constraint(chat(**fields))
    assert constraint is not None and constraint.WhichOneof("kind") == kind
    if kind == "json_schema":
        assert json.loads(constraint.json_schema) == value
    elif kind == "choice":
        assert list(constraint.choice.choices) == value
    elif value is not None:
        assert getattr(constraint, kind) == value


def test_text_format_is_no_constraint_and_two_constraints_are_refused() -> None:
    assert to_engine.constraint(chat(response_format={"type": "text"})) is None
    with pytest.raises(APIError) as refused:
        to_engine.constraint(chat(regex="a", guided_choice=["b"]))
    assert refused.value.status == 400


def test_tools_and_tool_choice() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = chat(tools=tools, tool_choice=named)
    request = to_engine.chat_request(body, body.messages, "r")
    assert request.input.chat.tool_choice.function_name == "get_weather"
    assert json.loads(request.input.chat.tools[0].parameters_json) == {"type": "object"}
    with pytest.raises(APIError, match="not in tools") as unknown:
        to_engine.chat_input(chat(tools=tools, tool_choice={"type": "function", "function": {"name": "x"}}), [])
    assert unknown.value.param == "tool_choice"
    required = to_engine.chat_input(chat(tools=tools, tool_choice="required"), [])
    assert required.chat.tool_choice.mode == types_pb2.TOOL_CHOICE_MODE_REQUIRED


def test_messages_developer_role_parts_and_tool_turns() -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    chat_input = to_engine.chat_input(body, body.messages).chat
    assert [m.role for m in chat_input.messages] == ["system", "user", "assistant", "tool"]
    assert chat_input.messages[1].content == "a\nb"
    assert chat_input.messages[2].tool_calls[0].name == "f" and chat_input.messages[3].tool_call_id == "c1"


def test_completion_prompt_forms_become_one_request_each() -> None:
    def requests(prompt: Any) -> list[Any]:
        return to_engine.completion_requests(CompletionRequest.model_validate({"model": "m", "prompt": prompt}), "r")

    assert [r.input.text for r in requests("a")] == ["a"]
    assert [r.request_id for r in requests(["a", "b"])] == ["r-0", "r-1"]
    assert [list(r.input.token_ids.ids) for r in requests([1, 2])] == [[1, 2]]
    assert [list(r.input.token_ids.ids) for r in requests([[1], [2, 3]])] == [[1], [2, 3]]
    assert requests("a")[0].sampling.max_tokens == 16  # OpenAI's completions default
    with pytest.raises(APIError):
        requests([])


def test_validation_param_paths() -> None:
    assert validation_param(("body", "messages", 0, "role")) == "messages[0].role"
    assert validation_param(("body", "tool_choice", "literal['none','auto','required']")) == "tool_choice"
    assert validation_param(("body",)) is None


def test_choices_and_usage_back_to_openai() -> None:
    choice = types_pb2.Choice(index=0, text="", finish_reason=types_pb2.FINISH_REASON_TOOL_CALLS)
    choice.tool_calls.add(id="call_1", name="f", arguments_json='{"a": 1}')
    out = from_engine.chat_choice(choice, 0, want_logprobs=False)
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
    assert out["message"]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
    usage = from_engine.usage([types_pb2.Usage(prompt_tokens=3, completion_tokens=2, cached_prompt_tokens=1),
                               types_pb2.Usage(prompt_tokens=4, completion_tokens=5, reasoning_tokens=3)])
    assert usage == {"prompt_tokens": 7, "completion_tokens": 7, "total_tokens": 14,
                     "prompt_tokens_details": {"cached_tokens": 1},
                     "completion_tokens_details": {"reasoning_tokens": 3}}


def test_reasoning_comes_back_under_both_names_and_content_is_none_without_an_answer() -> None:
    thought = from_engine.chat_choice(types_pb2.Choice(text="4", reasoning_content="2 + 2"), 0, False)["message"]
    assert (thought["content"], thought["reasoning_content"], thought["reasoning"]) == ("4", "2 + 2", "2 + 2")
    cut = from_engine.chat_choice(types_pb2.Choice(reasoning_content="still thinking"), 0, False)["message"]
    assert cut["content"] is None and cut["reasoning_content"] == "still thinking"
    plain = from_engine.chat_choice(types_pb2.Choice(text=""), 0, False)["message"]
    assert plain["content"] == "" and "reasoning_content" not in plain and "reasoning" not in plain
    delta = types_pb2.ChoiceDelta(reasoning_content="Adding")
    (only,) = from_engine.chat_deltas(delta, False)
    assert only["delta"] == {"reasoning_content": "Adding", "reasoning": "Adding"}


def test_each_tool_call_delta_streams_in_a_chunk_choice_of_its_own() -> None:
    calls = [types_pb2.ToolCallDelta(index=0, id="abcdefghi", name="f"),
             types_pb2.ToolCallDelta(index=0, arguments_json_delta="{}"),
             types_pb2.ToolCallDelta(index=1, id="bcdefghij", name="g"),
             types_pb2.ToolCallDelta(index=1, arguments_json_delta="{}")]  # fmt: skip
    delta = types_pb2.ChoiceDelta(index=1, text="Sure.", tool_calls=calls)
    choices = from_engine.chat_deltas(delta, False)
    assert [c["index"] for c in choices] == [1] * 5 and choices[0]["delta"] == {"content": "Sure."}
    entries = [c["delta"]["tool_calls"] for c in choices[1:]]
    assert all(len(e) == 1 for e in entries)
    assert [(e[0]["index"], e[0].get("id"), e[0]["function"]) for e in entries] == [
        (0, "abcdefghi", {"name": "f", "arguments": ""}), (0, None, {"arguments": "{}"}),
        (1, "bcdefghij", {"name": "g", "arguments": ""}), (1, None, {"arguments": "{}"}),
    ]
    assert from_engine.chat_deltas(types_pb2.ChoiceDelta(index=0), False) == []


def test_completion_logprobs_offsets_count_from_the_echo() -> None:
    logprobs = [types_pb2.TokenLogprob(token="ab", logprob=-1.0), types_pb2.TokenLogprob(token="c", logprob=-2.0)]
    out = from_engine.completion_logprobs(logprobs, text_offset=5)
    assert out["text_offset"] == [5, 7] and out["tokens"] == ["ab", "c"]


def test_add_generation_prompt_in_chat_template_kwargs_sets_the_chat_input_field() -> None:
    body = chat(chat_template_kwargs={"add_generation_prompt": False, "enable_thinking": True})
    chat_input = to_engine.chat_request(body, body.messages, "r").input.chat
    assert chat_input.add_generation_prompt is False
    assert json.loads(chat_input.chat_template_kwargs_json) == {"enable_thinking": True}  # what the engine allows
    only = chat(chat_template_kwargs={"add_generation_prompt": False})
    assert to_engine.chat_request(only, only.messages, "r").input.chat.chat_template_kwargs_json == ""
    with pytest.raises(APIError, match="must be true or false") as refused:
        bad = chat(chat_template_kwargs={"add_generation_prompt": "no"})
        to_engine.chat_request(bad, bad.messages, "r")
    assert refused.value.param == "chat_template_kwargs"


def test_reasoning_effort_is_a_template_variable_unless_the_kwargs_set_it() -> None:
    """OpenAI's `reasoning_effort`: the template's `reasoning_effort` (gpt-oss), and thinking off for "none"
    (Qwen3's `enable_thinking`); chat_template_kwargs win where they say otherwise."""

    def variables(**fields: object) -> dict[str, object]:
        body = chat(**fields)
        text = to_engine.chat_request(body, body.messages, "r").input.chat.chat_template_kwargs_json
        return json.loads(text) if text else {}

    assert variables() == {}
    assert variables(reasoning_effort="low") == {"reasoning_effort": "low", "enable_thinking": True}
    assert variables(reasoning_effort="none") == {"reasoning_effort": "none", "enable_thinking": False}
    both = variables(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"})
    assert both == {"reasoning_effort": "low", "enable_thinking": True}
    with pytest.raises(pydantic.ValidationError):
        chat(reasoning_effort="extreme")


def test_a_prompt_list_over_the_cap_is_a_400() -> None:
    at_cap = CompletionRequest.model_validate({"model": "m", "prompt": ["Hi"] * MAX_PROMPTS})
    assert len(to_engine.completion_requests(at_cap, "r")) == MAX_PROMPTS
    for prompt in (["Hi"] * (MAX_PROMPTS + 1), [[1]] * 10_000):
        over = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
        with pytest.raises(APIError, match=f"at most {MAX_PROMPTS} are allowed") as refused:
            to_engine.completion_requests(over, "r")
        assert (refused.value.status, refused.value.param) == (400, "prompt")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_nan_and_infinity_literals_are_not_finite_numbers(literal: str) -> None:
    for field in ("temperature", "top_p", "presence_penalty", "min_p", "max_tokens", "seed"):
        with pytest.raises(ValidationError) as refused:
            ChatCompletionRequest.model_validate_json(f'{{"model": "m", "messages": {json.dumps(HELLO)}, '
                                                      f'"{field}": {literal}}}')
        (error,) = refused.value.errors()
        assert (error["loc"], error["msg"]) == ((field,), "Input should be a finite number")


def test_echo_asks_the_engine_for_the_prompts_tokens_when_it_needs_them() -> None:
    def asked(**fields: Any) -> int | None:
        body = CompletionRequest.model_validate({"model": "m", "max_tokens": 1, **fields})
        params = to_engine.completion_requests(body, "r")[0].sampling
        return params.prompt_logprobs if params.HasField("prompt_logprobs") else None

    assert asked(prompt="hi", echo=True, logprobs=2) == 2  # the echoed prompt's logprobs
    assert asked(prompt=[1, 2], echo=True) == 0  # a token-id prompt's text comes with its tokens
    assert asked(prompt="hi", echo=True) is None and asked(prompt="hi", logprobs=2) is None


def test_an_echoed_prompt_leads_the_legacy_logprobs() -> None:
    found = types_pb2.PromptLogprobs(first_token_id=1, first_token="Hel", tokens=[
        types_pb2.TokenLogprob(token_id=2, token="lo", logprob=-0.5,
                               top_logprobs=[types_pb2.TopLogprob(token="lo", logprob=-0.5)])])
    body = CompletionRequest.model_validate({"model": "m", "prompt": "Hello", "echo": True, "logprobs": 1})
    echo = from_engine.echoed(body, "Hello", found)
    choice = types_pb2.Choice(text="!", logprobs=[types_pb2.TokenLogprob(token="!", logprob=-1.0)])
    out = from_engine.completion_choice(choice, 0, True, echo)
    assert out["text"] == "Hello!"
    assert out["logprobs"] == {"tokens": ["Hel", "lo", "!"], "token_logprobs": [None, -0.5, -1.0],
                               "top_logprobs": [None, {"lo": -0.5}, {}], "text_offset": [0, 3, 5]}
    by_ids = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2], "echo": True})
    assert from_engine.echoed(by_ids, [1, 2], found) == from_engine.Echo("Hello")
    assert from_engine.echoed(CompletionRequest.model_validate({"model": "m", "prompt": "x"}), "x", found).text == ""


def test_max_tokens_0_echoes_the_prompt_alone() -> None:
    def request(**fields: Any) -> Any:
        body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "max_tokens": 0, **fields})
        return to_engine.completion_requests(body, "r")[0]

    with pytest.raises(APIError) as refused:
        request()
    assert refused.value.param == "max_tokens"
    assert request(echo=True).sampling.max_tokens == 1  # the engine makes one token, which is left out
    reply = types_pb2.Choice(text="!", token_ids=[5], finish_reason=types_pb2.FINISH_REASON_STOP,
                             logprobs=[types_pb2.TokenLogprob(token="!", logprob=-1.0)])
    whole = engine_pb2.GenerateResponse(choices=[reply], usage=types_pb2.Usage(
        prompt_tokens=3, completion_tokens=1, total_tokens=4, cached_prompt_tokens=2))
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "max_tokens": 0, "echo": True})
    out = from_engine.text_completion(body, [whole], "cmpl-1", "m")
    assert out["choices"][0]["text"] == "hi" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["total_tokens"] == 3
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 2


def test_vllms_extras_reach_the_engine_and_echo_prefixes_the_answer() -> None:
    """vLLM's generation extras become the engine's fields; echo (an assistant turn last) puts that turn's text before
    each choice's content, also on a batch line's answer."""
    begun = [*HELLO, {"role": "assistant", "content": [{"type": "text", "text": "It"}, {"type": "text", "text": "is"}]}]
    body = chat(messages=begun, echo=True, continue_final_message=True, truncate_prompt_tokens=-1, bad_words=["x"],
                allowed_token_ids=[3, 4], use_beam_search=True, n=2, length_penalty=0.5, early_stopping=True,
                documents=[{"title": "A", "text": "one"}])
    request = to_engine.chat_request(body, body.messages, "r")
    params = request.sampling
    assert params.truncate_prompt_tokens == -1
    assert (list(params.bad_words), list(params.allowed_token_ids)) == (["x"], [3, 4])
    assert (params.beam_width, params.n, params.length_penalty, params.early_stopping) == (2, 2, 0.5, True)
    one = to_engine.chat_request(chat(use_beam_search=True, temperature=0.9), HELLO_MESSAGES, "r").sampling
    assert one.beam_width == 1 and one.temperature == 0.0  # one beam: the greedy decode, as vLLM's search of one
    assert request.input.chat.continue_final_message and not request.input.chat.add_generation_prompt
    assert json.loads(request.input.chat.documents_json) == [{"title": "A", "text": "one"}]
    assert body.echoed() == "It\nis" and chat(echo=True).echoed() == "" and chat(messages=begun).echoed() == ""
    reply = engine_pb2.GenerateResponse()
    reply.choices.add(index=0, text=" Paris.", finish_reason=types_pb2.FINISH_REASON_STOP)
    answer = from_engine.chat_completion(body, reply, "chatcmpl-r", "m", body.echoed())
    assert answer["choices"][0]["message"]["content"] == "It\nis Paris."
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": begun, "echo": True, "continue_final_message": True}}
    parsed = lines.parse_line(json.dumps(line).encode(), 1, 0, None, "m")
    assert lines.response_body(parsed, [reply], "r", "m")["choices"][0]["message"]["content"] == "It\nis Paris."


def test_sglangs_extras_on_chat() -> None:
    """SGLang's no_stop_trim keeps the matched stop string; its defaults (return_hidden_states false, separate and
    stream reasoning true) are taken as sent."""
    kept = to_engine.chat_request(chat(no_stop_trim=True, return_hidden_states=False, separate_reasoning=True),
                                  HELLO_MESSAGES, "r").sampling  # fmt: skip
    assert kept.include_stop_str_in_output
    assert not to_engine.chat_request(chat(), HELLO_MESSAGES, "r").sampling.include_stop_str_in_output


def test_a_batch_line_names_its_adapter_in_model_not_lora_path() -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": HELLO, "lora_path": "first"}}
    with pytest.raises(lines.InvalidLineError) as refused:
        lines.parse_line(json.dumps(line).encode(), 1, 0, None, "m")
    assert refused.value.error.param == "body.lora_path"
