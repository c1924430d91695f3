"""Every conversion between ladle.v1 messages and the engine's own types, as pure functions, plus status codes.

Inbound functions raise ValidationError (naming the field in OpenAI's vocabulary) for input the engine types
cannot express; range checks stay in SamplingParams.validate so every path checks the same things.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any, TypeAlias, cast

import grpc

from engine_server.config import LoraConfig
from engine_server.core.request import Priority
from engine_server.errors import (
    AdapterExistsError,
    AdapterNotFoundError,
    EngineUnavailableError,
    LoraDisabledError,
    ModelTemplateError,
    QueueFullError,
    UnsupportedByModelError,
    ValidationError,
)
from engine_server.frontend import (
    ChatPrompt,
    Choice,
    GenerationResult,
    Prompt,
    PromptLogprobs,
    TokenLogprob,
    Usage,
)
from engine_server.generation_defaults import GenerationDefaults
from engine_server.lora.registry import ServedAdapter
from engine_server.multimodal.transcription import TranscriptionInfo, TranscriptionPrompt, TranscriptionSegment
from engine_server.output.types import FinishReason
from engine_server.sampling_params import MAX_N, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, SamplingParams
from engine_server.server.engine_loop import EngineInternalError, LoadSnapshot
from engine_server.server.serving import GenerationInput, ModelInfo, RequestDeadlineError, TokenizeResult
from engine_server.structured import Constraint
from engine_server.tokenizer.chat import ChatAudio, ChatImage, ChatMessage, ChatTool, ChatToolCall
from engine_server.tools import ToolCall, ToolCallDelta, ToolChoice, ToolChoiceMode
from ladle.v1 import engine_pb2, types_pb2

_FINISH_REASONS = {
    FinishReason.STOP: types_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: types_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: types_pb2.FINISH_REASON_ABORT,
    FinishReason.TOOL_CALLS: types_pb2.FINISH_REASON_TOOL_CALLS,
}
_TOOL_CHOICE_MODES = {
    types_pb2.TOOL_CHOICE_MODE_NONE: ToolChoice(ToolChoiceMode.NONE),
    types_pb2.TOOL_CHOICE_MODE_AUTO: ToolChoice(ToolChoiceMode.AUTO),
    types_pb2.TOOL_CHOICE_MODE_REQUIRED: ToolChoice(ToolChoiceMode.REQUIRED),
}
_PRIORITIES = {types_pb2.PRIORITY_INTERACTIVE: Priority.INTERACTIVE, types_pb2.PRIORITY_BATCH: Priority.BATCH}

GenerationMessage: TypeAlias = engine_pb2.GenerateRequest | engine_pb2.StreamRequest
MAX_CACHE_SALT_CHARS = 1024  # a salt is a namespace's name or secret, not data
# SamplingParams fields that are `optional` in the proto: unset, they take the defaults.
_OPTIONAL_SAMPLING_FIELDS = (
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "skip_special_tokens",
    "prompt_logprobs",
    "beam_width",
    "length_penalty",
    "truncate_prompt_tokens",
    "best_of",
)


# -- inbound ---------------------------------------------------------------------------------------------


def generation_input(
    message: GenerationMessage, default_priority: Priority, defaults: GenerationDefaults
) -> GenerationInput:
    """A Generate/Stream request (or a Batch item's request) in the engine's vocabulary; unset sampling fields
    take `defaults`."""
    params = sampling_params(message.sampling, defaults)
    if message.HasField("constraint"):
        params = dataclasses.replace(params, constraint=constraint(message.constraint))
    return GenerationInput(
        request_id=message.request_id,
        prompt=prompt_from_input(message.input),
        params=params,
        priority=_PRIORITIES.get(message.priority, default_priority),
        cache_salt=cache_salt(message.cache_salt),
        adapter=message.adapter,
    )


def cache_salt(value: str) -> str:
    """A request's `cache_salt` (its prefix-cache namespace), refused when longer than MAX_CACHE_SALT_CHARS."""
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise ValidationError(f"cache_salt is {len(value)} characters; at most {MAX_CACHE_SALT_CHARS} are allowed",
                              "cache_salt")
    return value


def priority(value: types_pb2.Priority.ValueType, default: Priority) -> Priority:
    """The scheduling class a request's `priority` names; `default` for UNSPECIFIED."""
    return _PRIORITIES.get(value, default)


def constraint(message: types_pb2.Constraint) -> Constraint | None:
    """The engine's Constraint for a proto Constraint (None when no kind is set); the spec is checked later."""
    kind = message.WhichOneof("kind")
    if kind == "json_schema":
        return Constraint.json_schema(message.json_schema)
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "regex":
        return Constraint.regex(message.regex)
    if kind == "choice":
        return Constraint.choice(message.choice.choices)
    if kind == "grammar":
        return Constraint.grammar(message.grammar)
    return None


def prompt_from_input(message: types_pb2.Input) -> Prompt:
    """Text, token ids, a ChatPrompt or a TranscriptionPrompt; an Input with nothing set is refused."""
    kind = message.WhichOneof("kind")
    if kind == "text":
        return message.text
    if kind == "token_ids":
        return list(message.token_ids.ids)
    if kind == "chat":
        return chat_prompt(message.chat)
    if kind == "transcription":
        return transcription_prompt(message.transcription)
    raise ValidationError("input must set one of text, chat, token_ids or transcription", "input")


_TASKS = {
    types_pb2.TRANSCRIPTION_TASK_UNSPECIFIED: "transcribe",
    types_pb2.TRANSCRIPTION_TASK_TRANSCRIBE: "transcribe",
    types_pb2.TRANSCRIPTION_TASK_TRANSLATE: "translate",
}


def transcription_prompt(message: types_pb2.Transcription) -> TranscriptionPrompt:
    """A clip to write down; one without audio, or with a task this engine does not know, is refused."""
    if not message.audio.data:
        raise ValidationError("a transcription needs its audio clip (audio.data)", "input.transcription.audio")
    if message.task not in _TASKS:
        raise ValidationError(f"unknown transcription task {message.task}", "input.transcription.task")
    return TranscriptionPrompt(message.audio.data, message.language, _TASKS[message.task], message.prompt,
                               message.timestamps, temperature_fallback=message.temperature_fallback,
                               word_timestamps=message.word_timestamps)


def chat_prompt(chat: types_pb2.ChatInput) -> ChatPrompt:
    """The engine's ChatPrompt; a tool_choice that names an unknown function (or "required" without tools) is
    refused here (param "tool_choice")."""
    kwargs: Any = {}
    if chat.chat_template_kwargs_json:
        kwargs = _json(chat.chat_template_kwargs_json, "chat_template_kwargs")
        if not isinstance(kwargs, dict):
            raise ValidationError("chat_template_kwargs_json must be a JSON object", "chat_template_kwargs")
    tools = [_tool(t) for t in chat.tools]
    choice = tool_choice(chat.tool_choice) if chat.HasField("tool_choice") else None
    if choice is not None:
        choice.validate(tools)
    return ChatPrompt(
        messages=[
            ChatMessage(
                role=m.role,
                content=m.content,
                tool_calls=tuple(ChatToolCall(c.id, c.name, c.arguments_json) for c in m.tool_calls),
                tool_call_id=m.tool_call_id,
                name=m.name,
                content_parts=_content_parts(m, index),
            )
            for index, m in enumerate(chat.messages)
        ],
        tools=tools,
        add_generation_prompt=chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
        continue_final_message=chat.continue_final_message,
        documents=_documents(chat.documents_json),
        template_kwargs=kwargs,
        tool_choice=choice,
    )


def _documents(text: str) -> tuple[dict[str, str], ...]:
    """`ChatInput.documents_json` as the template's documents; ValidationError unless it is a JSON array of objects
    whose values are strings."""
    if not text:
        return ()
    found = _json(text, "documents")
    if not isinstance(found, list) or not all(
        isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in found
    ):
        raise ValidationError("documents must be a JSON array of objects whose values are strings", "documents")
    return tuple(found)


def _content_parts(message: types_pb2.ChatMessage, index: int) -> tuple[str | ChatImage | ChatAudio, ...]:
    """A turn's `content_parts` in the engine's vocabulary; a turn that sets `content` too, or a part that sets
    neither kind, is refused (param `messages[i].content`)."""
    if not message.content_parts:
        return ()
    param = f"messages[{index}].content"
    if message.content:
        raise ValidationError("set a message's content or its content_parts, not both", param)
    parts: list[str | ChatImage | ChatAudio] = []
    for j, part in enumerate(message.content_parts):
        kind = part.WhichOneof("part")
        if kind is None:
            raise ValidationError("a content part must hold text, an image or an audio clip", f"{param}[{j}]")
        parts.append(part.text if kind == "text" else ChatImage(part.image.data) if kind == "image"
                     else ChatAudio(part.audio.data))  # fmt: skip
    return tuple(parts)


def tool_choice(message: types_pb2.ToolChoice) -> ToolChoice | None:
    """The engine's ToolChoice; None (OpenAI's default, from the tools) when neither a mode nor a name is set."""
    if message.WhichOneof("choice") == "function_name":
        if not message.function_name:
            raise ValidationError("tool_choice function_name must not be empty", "tool_choice")
        return ToolChoice.function(message.function_name)
    return _TOOL_CHOICE_MODES.get(message.mode)


def _tool(tool: types_pb2.Tool) -> ChatTool:
    if not tool.name:
        raise ValidationError("every tool needs a name", "tools")
    parameters = _json(tool.parameters_json, "tools") if tool.parameters_json else {}
    if not isinstance(parameters, dict):
        raise ValidationError(f"parameters_json of tool {tool.name!r} must be a JSON object", "tools")
    return ChatTool(tool.name, tool.description, parameters)


def _json(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValidationError(f"{param} is not valid JSON: {exc}", param) from exc
    except RecursionError:  # nested deeper than the parser's stack allows
        raise ValidationError(f"{param} is nested too deeply to parse", param) from None


def sampling_params(message: types_pb2.SamplingParams, defaults: GenerationDefaults) -> SamplingParams:
    """Unset optional fields take the engine's generation `defaults` (temperature, top_p, top_k, min_p,
    repetition_penalty, the max_tokens cap) or SamplingParams' own (OpenAI's); an explicit field always wins.
    proto3 zeros elsewhere mean 'off'."""
    explicit = {name: getattr(message, name) for name in _OPTIONAL_SAMPLING_FIELDS if message.HasField(cast(Any, name))}
    return defaults.sampling_params(
        early_stopping=message.early_stopping,
        min_tokens=message.min_tokens,
        logit_bias=dict(message.logit_bias),
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        allowed_token_ids=tuple(message.allowed_token_ids) or None,
        bad_words=tuple(message.bad_words),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs,
        top_logprobs=message.top_logprobs,
        include_stop_str_in_output=message.include_stop_str_in_output,
        **explicit,
    )


# -- outbound --------------------------------------------------------------------------------------------


def generate_response(
    result: GenerationResult, model: str, prompt_token_ids: bool = False
) -> engine_pb2.GenerateResponse:
    """The whole result; with `prompt_token_ids` (SamplingParams.return_prompt_token_ids), the prompt's ids too."""
    return engine_pb2.GenerateResponse(
        request_id=result.request_id,
        choices=[choice_message(c) for c in result.choices],
        usage=usage_message(result.usage),
        prompt_logprobs=prompt_logprobs_message(result.prompt_logprobs),
        model=model,
        prompt_token_ids=result.prompt_token_ids if prompt_token_ids else (),
        transcription=transcription_info(result.transcription),
    )


def transcription_info(info: TranscriptionInfo | None) -> types_pb2.TranscriptionInfo | None:
    """A transcription's language and clip length (None for other requests)."""
    if info is None:
        return None
    return types_pb2.TranscriptionInfo(language=info.language, duration_seconds=info.duration_seconds)


def stream_response(
    request_id: str, deltas: Sequence[Choice], model: str, usage_so_far: Usage, last: bool = False,
    prompt_logprobs: PromptLogprobs | None = None, prompt_token_ids: Sequence[int] = (),
    transcription: TranscriptionInfo | None = None,
) -> engine_pb2.StreamResponse:
    """One stream message: `usage_so_far` (the request's usage up to this message) on every one, and as `usage`
    too on the `last`; the request's `prompt_logprobs` on the message that first has them, and `prompt_token_ids`
    and `transcription` (the servicer gives them to the first message alone) as they are."""
    so_far = usage_message(usage_so_far)
    response = engine_pb2.StreamResponse(request_id=request_id, choices=[delta_message(d) for d in deltas],
                                         model=model, usage_so_far=so_far,
                                         prompt_logprobs=prompt_logprobs_message(prompt_logprobs),
                                         prompt_token_ids=prompt_token_ids,
                                         transcription=transcription_info(transcription))  # fmt: skip
    if last:
        response.usage.CopyFrom(so_far)
    return response


def choice_message(choice: Choice) -> types_pb2.Choice:
    message = types_pb2.Choice(tool_calls=[tool_call_message(c) for c in choice.tool_calls])
    _set_choice_fields(message, choice)
    _set_matched_stop(message.matched_stop, choice.matched_stop)
    return message


def delta_message(delta: Choice) -> types_pb2.ChoiceDelta:
    message = types_pb2.ChoiceDelta(tool_calls=[tool_call_delta_message(d) for d in delta.tool_call_deltas])
    _set_choice_fields(message, delta)
    if delta.finish_reason is not None:
        _set_matched_stop(message.matched_stop, delta.matched_stop)
    return message


def _set_choice_fields(message: types_pb2.Choice | types_pb2.ChoiceDelta, choice: Choice) -> None:
    """The fields a whole choice and a delta of one share: index, text, reasoning, token ids, finish reason,
    logprobs, a transcription's segments and words."""
    message.index = choice.index
    message.text = choice.text
    message.reasoning_content = choice.reasoning_text
    message.token_ids.extend(choice.token_ids)
    message.finish_reason = finish_reason(choice.finish_reason)
    message.logprobs.extend(logprob_message(lp) for lp in choice.logprobs or ())
    message.segments.extend(segment_message(segment) for segment in choice.segments)
    message.words.extend(types_pb2.TranscriptionWord(word=w.word, start_seconds=w.start, end_seconds=w.end)
                         for w in choice.words)  # fmt: skip


def segment_message(segment: TranscriptionSegment) -> types_pb2.TranscriptionSegment:
    return types_pb2.TranscriptionSegment(start_seconds=segment.start, end_seconds=segment.end, text=segment.text,
                                          token_ids=segment.token_ids, first_token=segment.first_token,
                                          seek=segment.seek, temperature=segment.temperature,
                                          no_speech_prob=segment.no_speech_prob)  # fmt: skip


def tool_call_message(call: ToolCall) -> types_pb2.ToolCall:
    return types_pb2.ToolCall(id=call.id, name=call.name, arguments_json=call.arguments_json)


def tool_call_delta_message(delta: ToolCallDelta) -> types_pb2.ToolCallDelta:
    return types_pb2.ToolCallDelta(
        index=delta.index, id=delta.id, name=delta.name, arguments_json_delta=delta.arguments_delta
    )


def _set_matched_stop(message: types_pb2.MatchedStop, matched: str | int | None) -> None:
    if isinstance(matched, str):
        message.text = matched
    elif isinstance(matched, int):
        message.token_id = matched


def finish_reason(reason: FinishReason | None) -> types_pb2.FinishReason.ValueType:
    return types_pb2.FINISH_REASON_UNSPECIFIED if reason is None else _FINISH_REASONS[reason]


def logprob_message(logprob: TokenLogprob) -> types_pb2.TokenLogprob:
    return types_pb2.TokenLogprob(
        token_id=logprob.token_id,
        token=logprob.token,
        logprob=logprob.logprob,
        token_bytes=logprob.token_bytes,
        rank=logprob.rank,
        top_logprobs=[
            types_pb2.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob, token_bytes=t.token_bytes)
            for t in logprob.top_logprobs
        ],
    )


def prompt_logprobs_message(found: PromptLogprobs | None) -> types_pb2.PromptLogprobs | None:
    if found is None:
        return None
    return types_pb2.PromptLogprobs(first_token_id=found.first_token_id, first_token=found.first_token,
                                    first_token_bytes=found.first_token_bytes,
                                    tokens=[logprob_message(lp) for lp in found.tokens])  # fmt: skip


def usage_message(usage: Usage) -> types_pb2.Usage:
    return types_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        reasoning_tokens=usage.reasoning_tokens,
    )


def tokenize_response(result: TokenizeResult) -> engine_pb2.TokenizeResponse:
    return engine_pb2.TokenizeResponse(token_ids=result.token_ids, tokens=result.tokens, prompt_text=result.prompt_text)


def adapter_info(adapter: ServedAdapter) -> engine_pb2.AdapterInfo:
    return engine_pb2.AdapterInfo(
        name=adapter.name, path=adapter.path, rank=adapter.rank, target_modules=adapter.target_modules
    )


def lora_info(limits: LoraConfig | None, adapters: list[ServedAdapter]) -> engine_pb2.LoraInfo | None:
    """GetModelInfo's `lora`: None (unset) for an engine without LoRA."""
    if limits is None:
        return None
    return engine_pb2.LoraInfo(
        adapters=[adapter_info(a) for a in adapters], max_loras=limits.max_loras, max_lora_rank=limits.max_lora_rank
    )


def model_info_response(info: ModelInfo, lora: engine_pb2.LoraInfo | None = None) -> engine_pb2.GetModelInfoResponse:
    defaults = info.generation_defaults
    return engine_pb2.GetModelInfoResponse(
        lora=lora,
        model_id=info.model_id,
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        has_chat_template=info.has_chat_template,
        defaults=engine_pb2.SamplingDefaults(
            temperature=defaults.temperature,
            top_p=defaults.top_p,
            top_k=defaults.top_k,
            repetition_penalty=defaults.repetition_penalty,
            max_tokens=defaults.max_tokens or 0,  # 0: up to the context
            min_p=defaults.min_p,
        ),
        architecture=info.architecture,
        device=info.device,
        dtype=info.dtype,
        limits=engine_pb2.RequestLimits(
            max_n=MAX_N, max_stop_strings=MAX_STOP_STRINGS, max_top_logprobs=MAX_TOP_LOGPROBS
        ),
        max_num_seqs=info.max_num_seqs,
        pooling=engine_pb2.PoolingInfo(
            method=info.pooling.method.value,
            normalize=info.pooling.normalize,
            dimensions=info.pooling.dimensions,
            cross_encoder=info.pooling.cross_encoder,
        ),
    )


def load_response(load: LoadSnapshot, accepting: bool, adapters: list[str] | None = None) -> engine_pb2.GetLoadResponse:
    return engine_pb2.GetLoadResponse(
        adapters=adapters or [],
        running=load.running,
        waiting=load.waiting,
        kv_blocks_used=load.kv_blocks_used,
        kv_blocks_total=load.kv_blocks_total,
        kv_block_size=load.kv_block_size,
        kv_usage=load.kv_usage,
        accepting=accepting,
        speculative_proposed_tokens=load.speculative_proposed_tokens,
        speculative_accepted_tokens=load.speculative_accepted_tokens,
        speculative_verified_rows=load.speculative_verified_rows,
        speculative_kept_histogram=load.speculative_kept_histogram,
    )


# -- errors ----------------------------------------------------------------------------------------------


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call reports; anything unrecognised is INTERNAL."""
    if isinstance(exc, ValidationError):
        message = exc.message
        if exc.param and exc.param not in message:
            message = f"{exc.param}: {message}"
        return grpc.StatusCode.INVALID_ARGUMENT, message
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry later"
    if isinstance(exc, EngineUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, RequestDeadlineError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, ModelTemplateError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, UnsupportedByModelError):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc)
    if isinstance(exc, AdapterNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, AdapterExistsError):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, LoraDisabledError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, EngineInternalError):
        return grpc.StatusCode.INTERNAL, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); the engine keeps serving"


def item_error(exc: BaseException) -> engine_pb2.ItemError:
    """A Batch item's failure, with the status code it would have had as a single call."""
    code, message = status_for(exc)
    param = (exc.param or "") if isinstance(exc, ValidationError) else ""
    return engine_pb2.ItemError(code=code.value[0], message=message, param=param)
