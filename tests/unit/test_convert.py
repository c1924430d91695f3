"""Proto <-> engine conversions and the status-code mapping (engine_server.server.convert); no model needed."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import empty_pb2

from engine_server.core.request import Priority
from engine_server.errors import EngineUnavailableError, ModelTemplateError, QueueFullError, ValidationError
from engine_server.frontend import ChatPrompt, Choice, GenerationResult, TokenLogprob, TopLogprob, Usage
from engine_server.generation_defaults import GenerationDefaults
from engine_server.output.types import FinishReason
from engine_server.sampling_params import SamplingParams
from engine_server.server import convert, convert_pooling
from engine_server.server.engine_loop import LoadSnapshot
from engine_server.server.serving import RequestDeadlineError
from engine_server.structured import Constraint
from engine_server.tokenizer.chat import ChatToolCall
from engine_server.tools import ToolCallDelta, ToolChoice, ToolChoiceMode
from ladle.v1 import engine_pb2, types_pb2

LADLE = GenerationDefaults()  # OpenAI's defaults: SamplingParams' own

def test_unset_sampling_fields_take_the_openai_defaults() -> None:
    assert convert.sampling_params(types_pb2.SamplingParams(), LADLE) == SamplingParams()


def test_explicit_zeros_are_kept_where_zero_is_not_the_default() -> None:
    message = types_pb2.SamplingParams(temperature=0.0, top_p=0.5, top_k=0, max_tokens=7, seed=0, n=2)
    message.skip_special_tokens = False
    params = convert.sampling_params(message, LADLE)
    assert (params.temperature, params.top_p, params.max_tokens, params.seed, params.n) == (0.0, 0.5, 7, 0, 2)
    assert params.skip_special_tokens is False and params.greedy


def test_every_sampling_field_is_carried() -> None:
    message = types_pb2.SamplingParams(
        min_p=0.25, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.5, logit_bias={5: -2.0},
        min_tokens=3, stop=["\n\n", "END"], stop_token_ids=[7], ignore_eos=True, logprobs=True, top_logprobs=4,
        include_stop_str_in_output=True, top_k=40,
    )
    params = convert.sampling_params(message, LADLE)
    assert params == SamplingParams(
        min_p=0.25, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.5, logit_bias={5: -2.0},
        min_tokens=3, stop=("\n\n", "END"), stop_token_ids=(7,), ignore_eos=True, logprobs=True, top_logprobs=4,
        include_stop_str_in_output=True, top_k=40,
    )


def test_inputs_text_token_ids_and_chat() -> None:
    assert convert.prompt_from_input(types_pb2.Input(text="hi")) == "hi"
    assert convert.prompt_from_input(types_pb2.Input(token_ids=types_pb2.TokenIds(ids=[1, 2]))) == [1, 2]
    chat = types_pb2.ChatInput(
        messages=[
            types_pb2.ChatMessage(role="user", content="weather?"),
            types_pb2.ChatMessage(
                role="assistant", tool_calls=[types_pb2.ToolCall(id="c1", name="get", arguments_json='{"a": 1}')]
            ),
            types_pb2.ChatMessage(role="tool", content="sunny", tool_call_id="c1"),
        ],
        tools=[types_pb2.Tool(name="get", description="d", parameters_json='{"type": "object"}')],
        chat_template_kwargs_json='{"enable_thinking": false}',
    )
    chat.add_generation_prompt = False
    prompt = convert.prompt_from_input(types_pb2.Input(chat=chat))
    assert isinstance(prompt, ChatPrompt)
    assert [m.role for m in prompt.messages] == ["user", "assistant", "tool"]
    assert prompt.messages[1].tool_calls[0].arguments_json == '{"a": 1}' and prompt.messages[2].tool_call_id == "c1"
    assert prompt.tools[0].parameters == {"type": "object"}
    assert prompt.add_generation_prompt is False and prompt.template_kwargs == {"enable_thinking": False}
    default = convert.prompt_from_input(types_pb2.Input(chat=types_pb2.ChatInput()))
    assert isinstance(default, ChatPrompt) and default.add_generation_prompt is True


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (types_pb2.Input(), "input"),
        (types_pb2.Input(chat=types_pb2.ChatInput(chat_template_kwargs_json="{nope")), "chat_template_kwargs"),
        (types_pb2.Input(chat=types_pb2.ChatInput(chat_template_kwargs_json="[1]")), "chat_template_kwargs"),
        # Deeper than Python's JSON parser goes: refused, not an INTERNAL RecursionError.
        (types_pb2.Input(chat=types_pb2.ChatInput(chat_template_kwargs_json="[" * 10**5 + "]" * 10**5)),
         "chat_template_kwargs"),
        (types_pb2.Input(chat=types_pb2.ChatInput(tools=[types_pb2.Tool(name="f", parameters_json="[" * 10**5)])),
         "tools"),
        (types_pb2.Input(chat=types_pb2.ChatInput(tools=[types_pb2.Tool(name="f", parameters_json="{")])), "tools"),
        (types_pb2.Input(chat=types_pb2.ChatInput(tools=[types_pb2.Tool()])), "tools"),
        (
            types_pb2.Input(chat=types_pb2.ChatInput(tool_choice=types_pb2.ToolChoice(function_name="f"))),
            "tool_choice",
        ),
        (
            types_pb2.Input(chat=types_pb2.ChatInput(tool_choice=types_pb2.ToolChoice(function_name=""))),
            "tool_choice",
        ),
        (
            types_pb2.Input(
                chat=types_pb2.ChatInput(
                    tools=[types_pb2.Tool(name="g")], tool_choice=types_pb2.ToolChoice(function_name="f")
                )
            ),
            "tool_choice",
        ),
        (
            types_pb2.Input(
                chat=types_pb2.ChatInput(
                    tool_choice=types_pb2.ToolChoice(mode=types_pb2.TOOL_CHOICE_MODE_REQUIRED)
                )
            ),
            "tool_choice",
        ),
    ],
)
def test_malformed_inputs_name_the_field(message: types_pb2.Input, param: str) -> None:
    with pytest.raises(ValidationError) as error:
        convert.prompt_from_input(message)
    assert error.value.param == param


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (None, None),
        (types_pb2.ToolChoice(), None),
        (types_pb2.ToolChoice(mode=types_pb2.TOOL_CHOICE_MODE_NONE), ToolChoice(ToolChoiceMode.NONE)),
        (types_pb2.ToolChoice(mode=types_pb2.TOOL_CHOICE_MODE_AUTO), ToolChoice(ToolChoiceMode.AUTO)),
        (types_pb2.ToolChoice(mode=types_pb2.TOOL_CHOICE_MODE_REQUIRED), ToolChoice(ToolChoiceMode.REQUIRED)),
        (types_pb2.ToolChoice(function_name="get"), ToolChoice.function("get")),
    ],
)
def test_tool_choice_converts(message: types_pb2.ToolChoice | None, expected: ToolChoice | None) -> None:
    chat = types_pb2.ChatInput(
        messages=[types_pb2.ChatMessage(role="user", content="hi")], tools=[types_pb2.Tool(name="get")]
    )
    if message is not None:
        chat.tool_choice.CopyFrom(message)
    prompt = convert.prompt_from_input(types_pb2.Input(chat=chat))
    assert isinstance(prompt, ChatPrompt) and prompt.tool_choice == expected


def test_tool_calls_go_out_whole_in_a_choice_and_in_pieces_in_a_delta() -> None:
    call = ChatToolCall("call_1", "get", '{"a": 1}')
    done = Choice(0, "", [5, 2], FinishReason.TOOL_CALLS, tool_calls=[call])
    reply = convert.choice_message(done)
    assert reply.finish_reason == types_pb2.FINISH_REASON_TOOL_CALLS and reply.matched_stop.WhichOneof("kind") is None
    assert [(c.id, c.name, c.arguments_json) for c in reply.tool_calls] == [("call_1", "get", '{"a": 1}')]
    deltas = [ToolCallDelta(0, "call_1", "get"), ToolCallDelta(0, arguments_delta="{}")]
    pieces = convert.delta_message(Choice(0, "", [2], tool_call_deltas=deltas)).tool_calls
    assert [(d.index, d.id, d.name, d.arguments_json_delta) for d in pieces] == [
        (0, "call_1", "get", ""),
        (0, "", "", "{}"),
    ]


def test_priority_defaults_depend_on_the_rpc() -> None:
    request = engine_pb2.GenerateRequest(request_id="r", input=types_pb2.Input(text="x"))
    assert convert.generation_input(request, Priority.INTERACTIVE, LADLE).priority is Priority.INTERACTIVE
    assert convert.generation_input(request, Priority.BATCH, LADLE).priority is Priority.BATCH
    request.priority = types_pb2.PRIORITY_INTERACTIVE
    assert convert.generation_input(request, Priority.BATCH, LADLE).priority is Priority.INTERACTIVE


def test_the_cache_salt_is_carried_on_every_rpc_that_fills_the_prefix_cache() -> None:
    text = types_pb2.Input(text="x")
    for message in (engine_pb2.GenerateRequest(input=text), engine_pb2.StreamRequest(input=text)):
        assert convert.generation_input(message, Priority.INTERACTIVE, LADLE).cache_salt == ""
        message.cache_salt = "tenant-a"
        assert convert.generation_input(message, Priority.INTERACTIVE, LADLE).cache_salt == "tenant-a"
    embed = engine_pb2.EmbedRequest(inputs=[text], cache_salt="tenant-a")
    score = engine_pb2.ScoreRequest(query=text, documents=[text], cache_salt="tenant-a")
    assert convert_pooling.embed_input(embed, Priority.INTERACTIVE).cache_salt == "tenant-a"
    assert convert_pooling.score_input(score, Priority.INTERACTIVE).cache_salt == "tenant-a"
    too_long = engine_pb2.GenerateRequest(input=text, cache_salt="s" * (convert.MAX_CACHE_SALT_CHARS + 1))
    with pytest.raises(ValidationError) as raised:
        convert.generation_input(too_long, Priority.INTERACTIVE, LADLE)
    assert raised.value.param == "cache_salt"


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (types_pb2.Constraint(regex="a+"), Constraint.regex("a+")),
        (types_pb2.Constraint(json_schema='{"type": "object"}'), Constraint.json_schema('{"type": "object"}')),
        (types_pb2.Constraint(json_object=empty_pb2.Empty()), Constraint.json_object()),
        (types_pb2.Constraint(choice=types_pb2.ChoiceList(choices=["a", "b"])), Constraint.choice(["a", "b"])),
        (types_pb2.Constraint(grammar='root ::= "x"'), Constraint.grammar('root ::= "x"')),
        (types_pb2.Constraint(), None),
    ],
)
def test_constraints_convert_to_the_engine_type(message: types_pb2.Constraint, expected: Constraint | None) -> None:
    request = engine_pb2.GenerateRequest(input=types_pb2.Input(text="x"), constraint=message)
    assert convert.generation_input(request, Priority.INTERACTIVE, LADLE).params.constraint == expected


def _result() -> GenerationResult:
    logprob = TokenLogprob(5, "a", -0.5, b"a", (TopLogprob(5, "a", -0.5, b"a"), TopLogprob(6, "b", -1.5, b"b")))
    choices = [
        Choice(0, "hi", [5, 2], FinishReason.STOP, 2, [logprob, logprob]),
        Choice(1, "ok", [5], FinishReason.STOP, "END"),
        Choice(2, "long", [5, 5, 5], FinishReason.LENGTH),
    ]
    return GenerationResult("req", [1, 2, 3], choices, Usage(3, 6, 2))


def test_generate_response() -> None:
    reply = convert.generate_response(_result(), "m")
    assert (reply.request_id, reply.model) == ("req", "m")
    first, second, third = reply.choices
    assert first.matched_stop.token_id == 2 and first.matched_stop.WhichOneof("kind") == "token_id"
    assert second.matched_stop.text == "END" and third.matched_stop.WhichOneof("kind") is None
    assert third.finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert first.logprobs[0].top_logprobs[1].token_bytes == b"b"
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, usage.cached_prompt_tokens) == (
        3, 6, 9, 2,
    )


def test_stream_response_has_usage_on_the_last_message_and_usage_so_far_on_every_one() -> None:
    running = Choice(0, "h", [5])
    middle = convert.stream_response("req", [running], "m", Usage(3, 1, cached_prompt_tokens=2))
    assert not middle.HasField("usage")
    so_far = middle.usage_so_far
    assert (so_far.prompt_tokens, so_far.completion_tokens, so_far.total_tokens, so_far.cached_prompt_tokens) == (
        3, 1, 4, 2,
    )
    assert middle.choices[0].finish_reason == types_pb2.FINISH_REASON_UNSPECIFIED
    assert middle.choices[0].matched_stop.WhichOneof("kind") is None
    last = convert.stream_response("req", [Choice(0, "", [2], FinishReason.STOP, 2)], "m", Usage(3, 2), last=True)
    assert last.usage.total_tokens == 5 and last.choices[0].matched_stop.token_id == 2
    assert last.usage_so_far == last.usage


def test_load_response() -> None:
    load = convert.load_response(LoadSnapshot(2, 3, 10, 40, 16), accepting=True)
    assert (load.running, load.waiting, load.kv_blocks_used, load.kv_blocks_total, load.kv_block_size) == (
        2, 3, 10, 40, 16,
    )
    assert load.kv_usage == pytest.approx(0.25) and load.accepting


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ValidationError("top_p must be in (0, 1]", "top_p"), grpc.StatusCode.INVALID_ARGUMENT),
        (QueueFullError("too many queued requests"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (EngineUnavailableError("draining"), grpc.StatusCode.UNAVAILABLE),
        (RequestDeadlineError("late"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (ModelTemplateError("the template is unsafe"), grpc.StatusCode.FAILED_PRECONDITION),
        (KeyError("bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_codes(error: Exception, code: grpc.StatusCode) -> None:
    assert convert.status_for(error)[0] is code
    item = convert.item_error(error)
    assert item.code == code.value[0] and item.message


def test_validation_messages_name_the_field() -> None:
    assert "logit_bias" in convert.status_for(ValidationError("bias out of range", "logit_bias"))[1]
    assert convert.item_error(ValidationError("bad", "n")).param == "n"
    assert "bug" not in convert.status_for(KeyError("bug"))[1]  # internals stay in the log


def test_the_vllm_and_search_fields_are_carried() -> None:
    message = types_pb2.SamplingParams(beam_width=4, length_penalty=0.5, early_stopping=True, best_of=3,
                                       truncate_prompt_tokens=-1, allowed_token_ids=[3, 4], bad_words=["x y"])
    params = convert.sampling_params(message, LADLE)
    assert (params.beam_width, params.length_penalty, params.early_stopping, params.best_of) == (4, 0.5, True, 3)
    assert (params.truncate_prompt_tokens, params.allowed_token_ids, params.bad_words) == (-1, (3, 4), ("x y",))
    assert convert.sampling_params(types_pb2.SamplingParams(), LADLE).allowed_token_ids is None
    chat = types_pb2.ChatInput(messages=[types_pb2.ChatMessage(role="user", content="hi")], continue_final_message=True,
                               documents_json='[{"title": "A", "text": "one"}]')
    prompt = convert.prompt_from_input(types_pb2.Input(chat=chat))
    assert isinstance(prompt, ChatPrompt)
    assert prompt.continue_final_message and prompt.documents == ({"title": "A", "text": "one"},)
    for bad in ('{"a": 1}', '[{"a": 1}]', "[1]", "not json"):
        chat.documents_json = bad
        with pytest.raises(ValidationError) as refused:
            convert.prompt_from_input(types_pb2.Input(chat=chat))
        assert refused.value.param == "documents"
