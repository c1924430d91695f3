"""OpenAI Responses API bodies -> the engine's chat requests. Pure functions.

A Responses request is a chat request in other clothes: its `input` items (messages, earlier output items,
function calls and their outputs), after the items of the stored responses it continues (`previous_response_id`)
or of its stored `conversation` (both resolved by the caller), become the conversation; `instructions` its system
message; `text.format`, `tools`, `tool_choice`, `reasoning.effort` and `max_output_tokens` the chat fields they
stand for. The chat request is built with the chat route's own schema and `to_engine.chat_request`, so both routes
check and send the same things. A message's `input_image` parts become the chat's image parts: one with an
`image_url` (a data: or http(s) URL) has its bytes fetched by the route first (`image_sources`, `gateway.media`);
one with a `file_id` (a file of the caller's project) has its file read by the route first (`file_image_sources`,
`gateway.file_images`), its bytes keyed by `file_image_key`. A part gives one of the two, never both. What ladle
cannot do (input files, audio, hosted tools such as web_search, stored prompts) is a 400 naming the field.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic

from gateway.errors import APIError, invalid, invalid_body
from gateway.schemas.chat import ChatCompletionRequest
from gateway.schemas.responses import ResponsesRequest
from gateway.translate import to_engine
from gateway.translate.media_parts import NO_MEDIA, ImageSource, MediaBytes, url_kind
from ladle.v1 import engine_pb2

# OpenAI's `include` values; only the logprobs one changes anything here (the others name tools or media that
# a text-only model with function tools never produces), so they are accepted and have no effect.
INCLUDES = frozenset({
    "message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
    "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs",
})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})
_IMAGE_PART = "input_image"
_AUDIO_PARTS = frozenset({"input_audio", "audio_url"})  # chat's audio parts: refused by name here
_ID_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}
_ROLES = frozenset({"user", "system", "developer", "assistant"})
MAX_ITEM_ID = 128  # characters of an item id a client chooses (the stored column's width)
# The key of a file_id image's bytes in `MediaBytes`: no data: or http(s) URL starts so, so the two never collide.
FILE_IMAGE_KEY_PREFIX = "ladle-file-id:"


@dataclass(frozen=True)
class FileImageSource:
    """An input_image given by `file_id`: the file (of the caller's project) and the field that names it (the
    400's param: `input[i].content[j].file_id`, or previous_response_id / conversation for a stored item)."""

    file_id: str
    param: str


def file_image_key(file_id: str) -> str:
    """The `MediaBytes` key under which the route hands over the bytes of the image file `file_id`."""
    return FILE_IMAGE_KEY_PREFIX + file_id


def new_item_id(kind: str) -> str:
    """A fresh id for an item of `kind` ("message", "function_call", ...), OpenAI's prefix with 32 hex digits."""
    return _ID_PREFIXES.get(kind, "item_") + secrets.token_hex(16)


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as the list of items it is stored and listed as (`GET .../input_items`): a string is
    one user message; every item gets its `type` and an `id`. 400 for an item this gateway cannot read."""
    if isinstance(body.input, str):
        return [{"id": new_item_id("message"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": body.input}]}]
    return checked_items(body.input, "input")


def checked_items(raw_items: Sequence[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    """Input items as they are stored (a response's input, a conversation's items): every item gets its `type`
    and an `id` (a string of at most MAX_ITEM_ID characters), a message's string content becomes one text part.
    400 naming `param[i]` for an item this gateway cannot read."""
    items = []
    for i, raw in enumerate(raw_items):
        item = dict(raw)
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        _check_item(item, f"{param}[{i}]")
        item.setdefault("id", new_item_id(kind))
        if not isinstance(item["id"], str) or not 0 < len(item["id"]) <= MAX_ITEM_ID:
            raise invalid(f"{param}[{i}].id must be a string of 1 to {MAX_ITEM_ID} characters", f"{param}[{i}].id")
        items.append(item)
    return items


def _check_item(item: dict[str, Any], where: str) -> None:
    kind = item["type"]
    if kind == "message":
        if item.get("role") not in _ROLES:
            raise invalid(f"{where}.role must be one of user, system, developer, assistant; got "
                          f"{item.get('role')!r}", f"{where}.role")
        content = item.get("content")
        if not isinstance(content, list):
            raise invalid(f"{where}.content must be a string or a list of content parts", f"{where}.content")
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == _IMAGE_PART:
                _image_url(part, f"{where}.content[{j}]")
            elif isinstance(part, dict) and part.get("type") in _AUDIO_PARTS:
                raise invalid(f"{where}.content[{j}]: audio is not read on the Responses API; send it to "
                              "/v1/chat/completions as an input_audio or audio_url part", f"{where}.content[{j}].type")
            else:
                _text_of_part(part, f"{where}.content[{j}]", "text and input_image")
    elif kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise invalid(f"{where}.{name} must be a string", f"{where}.{name}")
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise invalid(f"{where}.call_id must be a string", f"{where}.call_id")
        output = item.get("output")
        if isinstance(output, list):
            for j, part in enumerate(output):
                _text_of_part(part, f"{where}.output[{j}]")
        elif not isinstance(output, str):
            raise invalid(f"{where}.output must be a string or a list of content parts", f"{where}.output")
    elif kind != "reasoning":
        raise invalid(f"{where}.type {kind!r} is not supported: ladle reads message, function_call, "
                      "function_call_output and reasoning items", f"{where}.type")


def _text_of_part(part: Any, where: str, readable: str = "text") -> str:
    if not isinstance(part, dict) or (part.get("type") not in _TEXT_PARTS and part.get("type") != "refusal"):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise invalid(f"{where}: content part type {kind!r} is not supported here; ladle reads {readable} parts",
                      f"{where}.type")
    text = part.get("refusal") if part.get("type") == "refusal" else part.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text must be a string", f"{where}.text")
    return text


def _image_url(part: dict[str, Any], where: str) -> str:
    """The `MediaBytes` key of an input_image part's bytes: its `image_url`, its scheme checked (data: or
    http(s)), or `file_image_key` of its `file_id` (a non-empty string). 400 naming `where.file_id` when both are
    given (OpenAI takes one), `where.image_url` when neither is, or the one given is malformed."""
    url, file_id = part.get("image_url"), part.get("file_id")
    if url is not None and file_id is not None:
        raise invalid(f"{where}: an input_image gives either image_url or file_id, not both", f"{where}.file_id")
    if file_id is not None:
        if not isinstance(file_id, str) or not file_id:
            raise invalid(f"{where}.file_id must be the id of an uploaded file", f"{where}.file_id")
        return file_image_key(file_id)
    if not isinstance(url, str) or not url:
        raise invalid(f"{where}.image_url must be a data: URL or an http(s) URL (or give file_id)",
                      f"{where}.image_url")
    url_kind(ImageSource(url, f"{where}.image_url"))
    return url


def _joined(parts: Iterable[dict[str, Any]]) -> str:
    return "\n".join(_text_of_part(p, "content") for p in parts)


def _message_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message item's parts as chat content: its text joined, or, with an image among them, chat parts in order."""
    if not any(part.get("type") == _IMAGE_PART for part in parts):
        return _joined(parts)
    return [{"type": "image_url", "image_url": {"url": _image_url(part, "content"), "detail": part.get("detail")}}
            if part.get("type") == _IMAGE_PART else {"type": "text", "text": _text_of_part(part, "content")}
            for part in parts]


def image_sources(
    history: Sequence[dict[str, Any]], items: Sequence[dict[str, Any]], history_param: str
) -> list[ImageSource]:
    """Every input_image of a conversation, in order: those of the stored `history` it continues named by the
    field that brought them (`history_param`: previous_response_id or conversation), then the body's own `items`'
    (`input[i].content[j].image_url`)."""
    sources = [ImageSource(url, history_param) for url in _image_urls(history)]
    for i, item in enumerate(items):
        for j, url in _indexed_image_urls(item):
            sources.append(ImageSource(url, f"input[{i}].content[{j}].image_url"))
    return sources


def file_image_sources(
    history: Sequence[dict[str, Any]], items: Sequence[dict[str, Any]], history_param: str
) -> list[FileImageSource]:
    """Every input_image given by file_id of a conversation, in order, named as `image_sources` names URLs: those
    of the stored `history` by `history_param`, then the body's own `items`' (`input[i].content[j].file_id`)."""
    sources = [FileImageSource(file_id, history_param) for item in history for _, file_id in _indexed_file_ids(item)]
    for i, item in enumerate(items):
        for j, file_id in _indexed_file_ids(item):
            sources.append(FileImageSource(file_id, f"input[{i}].content[{j}].file_id"))
    return sources


def _indexed_file_ids(item: dict[str, Any]) -> list[tuple[int, str]]:
    if item["type"] != "message":
        return []
    return [(j, part["file_id"]) for j, part in enumerate(item["content"])
            if part.get("type") == _IMAGE_PART and isinstance(part.get("file_id"), str)]


def _image_urls(items: Iterable[dict[str, Any]]) -> Iterable[str]:
    for item in items:
        for _, url in _indexed_image_urls(item):
            yield url


def _indexed_image_urls(item: dict[str, Any]) -> list[tuple[int, str]]:
    if item["type"] != "message":
        return []
    return [(j, part["image_url"]) for j, part in enumerate(item["content"])
            if part.get("type") == _IMAGE_PART and isinstance(part.get("image_url"), str)]


def chat_messages(instructions: str | None, items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat messages: `instructions` first as the system message, then `items` in order
    (every item already checked by `input_items`, or an output item ladle made). Consecutive assistant output
    (a message, function calls) is one assistant turn; a function call's output is a tool message naming its
    call; reasoning items are left out, as chat templates leave out earlier turns' reasoning."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    call_names: dict[str, str] = {}
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": _message_content(item["content"])})
        elif kind == "function_call":
            call_names[item["call_id"]] = item["name"]
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item["output"]
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "name": call_names.get(item["call_id"]),
                             "content": output if isinstance(output, str) else _joined(output)})
    return messages


def chat_body(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request the Responses body stands for, over `messages` (`chat_messages`)."""
    if body.prompt is not None:
        raise invalid("prompt (stored prompt templates) is not supported; send the prompt as instructions and input "
                      "items", "prompt")
    for value in body.include or []:
        if value not in INCLUDES:
            raise invalid(f"include value {value!r} is not one of OpenAI's: {', '.join(sorted(INCLUDES))}",
                          "include")
    if not messages:
        raise invalid("input must hold at least one item", "input")
    logprobs = wants_logprobs(body)
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "top_k": body.top_k,
        "min_p": body.min_p, "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "user": body.user, "cache_salt": body.cache_salt, "logprobs": logprobs, "top_logprobs": body.top_logprobs,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise invalid("text.format.schema is required for type json_schema", "text.format.schema")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.json_schema, "strict": fmt.strict}}
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["chat_template_kwargs"] = {"reasoning_effort": body.reasoning.effort,
                                        "enable_thinking": body.reasoning.effort != "none"}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except pydantic.ValidationError as exc:
        raise invalid_body(exc) from None


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether the output text carries its tokens' logprobs: `include` asks for them, or `top_logprobs` is set."""
    return "message.output_text.logprobs" in (body.include or []) or body.top_logprobs is not None


def _tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """A Responses function tool (flat: name, parameters...) as a chat tool; 400 for any other tool type."""
    where = f"tools[{index}]"
    kind = tool.get("type")
    if kind != "function":
        raise invalid(f"{where}.type {kind!r} is not supported: ladle runs function tools only (hosted tools such "
                      "as web_search, file_search or code_interpreter are OpenAI's)", f"{where}.type")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise invalid(f"{where}.name must be a non-empty string", f"{where}.name")
    function = {"name": tool["name"], "description": tool.get("description"), "parameters": tool.get("parameters"),
                "strict": tool.get("strict", True)}  # the Responses API's default, unlike chat's
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid(f"tool_choice must be none, auto, required or a function, got {choice!r}", "tool_choice")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise invalid(f"tool_choice of type {choice.get('type')!r} is not supported: name a function as "
                      '{"type": "function", "name": ...}', "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def generate_request(
    body: ResponsesRequest, items: Sequence[dict[str, Any]], request_id: str, *, cache_salt: str = "",
    adapter: str = "", images: MediaBytes = NO_MEDIA,
) -> engine_pb2.GenerateRequest:
    """The engine request for `body` over the conversation `items` (a stored chain's items, then the body's own
    `input_items`), with its `instructions` first, on LoRA `adapter` ("" for the base model), its images' bytes
    from `images` (`image_sources`, fetched); 400 (naming the Responses field where it differs from chat's) for
    anything the engine request cannot express."""
    chat = chat_body(body, chat_messages(body.instructions, items))
    try:
        return to_engine.chat_request(chat, chat.messages, request_id, cache_salt=cache_salt, adapter=adapter,
                                      images=images)
    except APIError as error:
        error.param = _RENAMED.get(error.param or "", error.param)
        raise


_RENAMED = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens", "messages": "input"}


def conversation_id(body: ResponsesRequest) -> str | None:
    """The id of the stored conversation `body` continues (`conversation`: its id, or {"id": ...}), or None; 400
    for a malformed value, or one beside previous_response_id (a response continues one or the other)."""
    value = body.conversation
    if value is None:
        return None
    found = value.get("id") if isinstance(value, dict) else value
    if not isinstance(found, str) or not found:
        raise invalid("conversation must be a conversation id or {\"id\": \"conv_...\"}", "conversation")
    if body.previous_response_id is not None:
        raise invalid("conversation and previous_response_id cannot be used together", "conversation")
    return found
