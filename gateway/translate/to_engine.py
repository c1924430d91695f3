"""OpenAI (and vLLM) chat and completions bodies -> ladle.v1 GenerateRequests. Pure functions; a request the
engine cannot express is a 400 naming the field.

Fields left unset in the OpenAI body stay unset in the proto, so the engine applies its generation defaults (the
model's, see engine_server.generation_defaults); completions' max_tokens keeps OpenAI's documented default, 16.
The pooling bodies (embeddings, score, rerank) are `pooling_to_engine`'s; it shares this module's input helpers.

A message whose parts hold an image or an audio clip is sent as ordered `content_parts` (text, images and
clips); one of text parts alone is joined into `content`, as before images were taken. A file's bytes come from
`images` (`translate.media_parts`), which the route fills before translating: every image and audio URL of the request
(an `input_audio` part's data standing as a data: URL), data: URLs decoded and http(s) URLs fetched
(`gateway.media`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel

from gateway.errors import APIError, invalid
from gateway.schemas.chat import (
    ALLOWED_TEMPLATE_KWARGS,
    ChatFields,
    ChatMessage,
    ContentPart,
    NamedToolChoice,
    ToolDefinition,
)
from gateway.schemas.common import UINT32_MAX, SamplingFields
from gateway.schemas.completions import MAX_PROMPTS, CompletionRequest
from gateway.translate.cache_salt import request_cache_salt
from gateway.translate.media_parts import MEDIA_PARTS, NO_MEDIA, MediaBytes, part_source
from ladle.v1 import engine_pb2, types_pb2

MAX_BEAMS = 16  # the engine's beam_width cap (engine_server.sampling_params.MAX_BEAM_WIDTH)
ENGINE_SEEDS = 2**63  # the engine takes seeds in [0, 2**63) (engine_server.sampling_params.SEED_LIMIT)
_NEEDS = {  # what a media part without its file lacks
    "image_url": 'an image_url part needs its image: {"image_url": {"url": "data:..." or "https://..."}}',
    "input_audio": 'an input_audio part needs its clip: {"input_audio": {"data": "<base64>", "format": "wav"}}',
    "audio_url": 'an audio_url part needs its clip: {"audio_url": {"url": "data:audio/...;base64,..." or '
                 '"https://..."}}',
}
_TOOL_MODES = {
    "none": types_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": types_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": types_pb2.TOOL_CHOICE_MODE_REQUIRED,
}


def refuse_unserved(body: BaseModel, reasons: Mapping[str, str], prefix: str = "") -> None:
    """400 naming the first field of `reasons` (name: why it is not served) that `body` sets to a value other than
    null and its own default (the param named after `prefix`, where given)."""
    for name, why in reasons.items():
        value = getattr(body, name)
        if value is not None and value != type(body).model_fields[name].default:
            param = f"{prefix}.{name}" if prefix else name
            shown = f" {str(value).lower()}" if isinstance(value, bool) else ""  # (a flag: which setting)
            raise invalid(f"{param}{shown} is not served: {why}", param)


_UNSERVED = {  # vLLM's request extras that ladle does not serve, and why
    "logits_processors": "ladle runs no caller-supplied code",
    "vllm_xargs": "ladle has no custom logits processors to pass them to",
    "kv_transfer_params": "ladle does not transfer KV caches between engines",
    "stop_regex": "send stop strings",  # (SGLang's, as are the three below)
    "custom_logit_processor": "ladle runs no caller-supplied code",
    "custom_params": "ladle runs no custom logit processors",
    "return_hidden_states": "ladle returns no hidden states",
}
_UNSERVED_CHAT = {  # and the chat route's (vLLM's, then SGLang's)
    "chat_template": "templates cannot be supplied; the model's own renders the conversation",
    "mm_processor_kwargs": "images and audio are prepared as the model's own processor prepares them by default",
    "add_special_tokens": "the chat template writes the special tokens",
    "separate_reasoning": "a reasoning parser's reasoning is always split off",
    "stream_reasoning": "a reasoning parser's reasoning is streamed as it comes",
    "input_ids": "send the messages, or token ids to /v1/completions",
    "session_params": "ladle keeps no sessions; send the whole conversation",
}


def sampling(
    body: SamplingFields, max_tokens: int | None, logprobs: bool, top_logprobs: int
) -> types_pb2.SamplingParams:
    """The engine's sampling parameters for a chat or completions body; with use_beam_search, a beam search over
    best_of (a completions body's, where given) or n beams, answering the n best; else a completions body's best_of
    samples that many and answers the n best. 400 for a vLLM extra that is not served (`_UNSERVED`)."""
    refuse_unserved(body, _UNSERVED)
    params = types_pb2.SamplingParams(
        n=body.n,
        min_tokens=body.min_tokens,
        stop=body.stop_list(),
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output or body.no_stop_trim,
    )
    optional: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
    }
    for name, value in optional.items():
        if value is not None:
            setattr(params, name, value)
    if body.prompt_logprobs is not None:
        params.prompt_logprobs = body.prompt_logprobs
    params.bad_words.extend(body.bad_words or [])
    if body.allowed_token_ids is not None:
        if not body.allowed_token_ids:
            raise invalid("allowed_token_ids must name at least one token", "allowed_token_ids")
        params.allowed_token_ids.extend(body.allowed_token_ids)
    if body.truncate_prompt_tokens is not None:
        params.truncate_prompt_tokens = body.truncate_prompt_tokens
    best_of = getattr(body, "best_of", None)
    if best_of is not None and not body.use_beam_search:
        params.best_of = best_of  # (the engine refuses one below n)
    if body.use_beam_search:
        params.beam_width = best_of or body.n
        if params.beam_width > MAX_BEAMS:
            raise invalid(f"use_beam_search keeps at most {MAX_BEAMS} beams, not {params.beam_width}",
                          "best_of" if best_of else "n")  # fmt: skip
        if params.beam_width == 1:  # one beam is the greedy decode (the engine searches from two beams up)
            params.temperature = 0.0
        params.early_stopping = body.early_stopping
        if body.length_penalty is not None:
            params.length_penalty = body.length_penalty
    params.return_prompt_token_ids = bool(body.return_token_ids)
    if body.seed is not None:
        params.seed = body.seed % ENGINE_SEEDS  # OpenAI's seeds are int64, negative ones too
    for key, bias in (body.logit_bias or {}).items():
        params.logit_bias[int(key)] = bias  # keys are token ids in [0, UINT32_MAX] (SamplingFields)
    return params


def constraint(body: SamplingFields) -> types_pb2.Constraint | None:
    """The one structured-output constraint the body asks for, in any of its spellings; 400 if several."""
    found: list[tuple[str, types_pb2.Constraint]] = []

    def add(param: str, **kind: Any) -> None:
        found.append((param, types_pb2.Constraint(**kind)))

    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        add("response_format", json_object={})
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise invalid("response_format.json_schema.schema is required for type json_schema", "response_format")
        add("response_format", json_schema=json.dumps(fmt.json_schema.json_schema))
    so = body.structured_outputs
    if so is not None:
        if so.json_ is not None:
            add("structured_outputs", json_schema=_schema_text(so.json_))
        if so.json_object:
            add("structured_outputs", json_object={})
        if so.regex is not None:
            add("structured_outputs", regex=so.regex)
        if so.choice is not None:
            add("structured_outputs", choice=types_pb2.ChoiceList(choices=so.choice))
        if so.grammar is not None:
            add("structured_outputs", grammar=so.grammar)
    for param, value in (("guided_json", body.guided_json), ("json_schema", body.json_schema)):
        if value is not None:
            add(param, json_schema=_schema_text(value))
    for param, regex in (("guided_regex", body.guided_regex), ("regex", body.regex)):
        if regex is not None:
            add(param, regex=regex)
    for param, grammar in (("guided_grammar", body.guided_grammar), ("ebnf", body.ebnf)):
        if grammar is not None:
            add(param, grammar=grammar)
    if body.guided_choice is not None:
        add("guided_choice", choice=types_pb2.ChoiceList(choices=body.guided_choice))
    if len(found) > 1:
        names = ", ".join(sorted({p for p, _ in found}))
        raise invalid(f"give one structured-output constraint, not several ({names})", found[1][0])
    return found[0][1] if found else None


def _schema_text(value: dict[str, Any] | str) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def chat_input(body: ChatFields, messages: list[ChatMessage], images: MediaBytes = NO_MEDIA) -> types_pb2.Input:
    """A conversation with its tools and template options as the engine's chat input; `images` holds the bytes of
    its image and audio URLs."""
    chat = types_pb2.ChatInput(
        messages=[chat_message(m, i, images) for i, m in enumerate(messages)],
        tools=[_tool(t) for t in body.tools or []],
        add_generation_prompt=body.add_generation_prompt,
    )
    refuse_unserved(body, _UNSERVED_CHAT)
    if body.documents:
        chat.documents_json = json.dumps(body.documents)
    if body.continue_final_message:
        if body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
            raise invalid("continue_final_message continues the last message: add_generation_prompt must be false "
                          "with it", "add_generation_prompt")  # fmt: skip
        chat.continue_final_message, chat.add_generation_prompt = True, False
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in body.tools or []}:
            raise invalid(f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice")
        chat.tool_choice.function_name = choice.function.name
    elif choice is not None:
        if choice != "none" and not body.tools:
            raise invalid(f"tool_choice {choice!r} needs tools", "tool_choice")
        chat.tool_choice.mode = _TOOL_MODES[choice]
    effort = body.reasoning_effort
    kwargs = {"reasoning_effort": effort, "enable_thinking": effort != "none"} if effort is not None else {}
    kwargs.update(body.chat_template_kwargs or {})
    if kwargs:
        template_kwargs(kwargs, chat)
    return types_pb2.Input(chat=chat)


def template_kwargs(kwargs: dict[str, Any], chat: types_pb2.ChatInput) -> None:
    """Allowed template variables into `chat`; 400 for any other. add_generation_prompt is a ChatInput field of
    its own (the engine refuses it as a template variable), so it sets that field."""
    refused = sorted(set(kwargs) - ALLOWED_TEMPLATE_KWARGS)
    if refused:
        allowed = ", ".join(sorted(ALLOWED_TEMPLATE_KWARGS))
        raise invalid(f"chat_template_kwargs keys {refused} are not allowed (allowed: {allowed})",
                      "chat_template_kwargs")
    variables = dict(kwargs)
    if "add_generation_prompt" in variables:
        add = variables.pop("add_generation_prompt")
        if not isinstance(add, bool):
            raise invalid("chat_template_kwargs.add_generation_prompt must be true or false", "chat_template_kwargs")
        chat.add_generation_prompt = add
    if variables:
        chat.chat_template_kwargs_json = json.dumps(variables)


def chat_message(message: ChatMessage, index: int, images: MediaBytes = NO_MEDIA) -> types_pb2.ChatMessage:
    """One message of a conversation (the `index`-th, for the 400's field name); developer is a system message.
    Its image and audio parts take their bytes from `images` (a file missing there is a 400: a route that reads
    no images or audio passes none)."""
    out = types_pb2.ChatMessage(
        role="system" if message.role == "developer" else message.role,
        name=message.name or "",
        tool_call_id=message.tool_call_id or "",
    )
    if isinstance(message.content, list) and any(part.type in MEDIA_PARTS for part in message.content):
        out.content_parts.extend(_content_parts(message.content, f"messages[{index}].content", images))
    else:
        out.content = _text(message, index)
    for call in message.tool_calls or []:
        out.tool_calls.add(id=call.id, name=call.function.name, arguments_json=call.function.arguments)
    return out


def _text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise _unsupported_part(part, f"messages[{index}].content[{j}]")
        texts.append(part.text)
    return "\n".join(texts)


def _content_parts(parts: list[ContentPart], where: str, images: MediaBytes) -> Iterator[types_pb2.ContentPart]:
    """Text, image and audio parts in their order (adjacent text parts stay apart: the template joins them)."""
    for j, part in enumerate(parts):
        if part.type == "text" and part.text is not None:
            yield types_pb2.ContentPart(text=part.text)
            continue
        if part.type not in MEDIA_PARTS:
            raise _unsupported_part(part, f"{where}[{j}]")
        source = part_source(part, f"{where}[{j}]")
        if source is None:
            raise invalid(_NEEDS[part.type], f"{where}[{j}].{part.type}")
        data = images.get(source.url)
        if data is None:
            raise invalid(f"{source.kind} parts are not read on this route", f"{where}[{j}].type")
        if source.kind == "audio":
            yield types_pb2.ContentPart(audio=types_pb2.Audio(data=data))
        else:
            yield types_pb2.ContentPart(image=types_pb2.Image(data=data))


def _unsupported_part(part: ContentPart, where: str) -> APIError:
    if part.type == "text":
        return invalid("a text part needs its text", f"{where}.text")
    return invalid(f"content part type {part.type!r} is not supported; ladle reads text, image_url, input_audio "
                   "and audio_url parts", f"{where}.type")


def _tool(tool: ToolDefinition) -> types_pb2.Tool:
    fn = tool.function
    return types_pb2.Tool(
        name=fn.name,
        description=fn.description or "",
        parameters_json=json.dumps(fn.parameters or {"type": "object", "properties": {}}),
        strict=bool(fn.strict),
    )


@contextlib.contextmanager
def unicode_text() -> Iterator[None]:
    """Proto strings are UTF-8, so text holding a lone surrogate (JSON's "\\ud800" escape decodes to one) cannot
    be sent to the engine: a 400 rather than protobuf's UnicodeEncodeError."""
    try:
        yield
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start:exc.end] if isinstance(exc.object, str) else ""
        raise invalid(f"the request holds text that is not valid Unicode (a lone surrogate {bad!r}); "
                      "send UTF-8 text without unpaired \\ud800-\\udfff escapes") from None


def chat_request(
    body: ChatFields, messages: list[ChatMessage], request_id: str, *, cache_salt: str = "", adapter: str = "",
    images: MediaBytes = NO_MEDIA,
) -> engine_pb2.GenerateRequest:
    """One engine request for one conversation of a chat body. `cache_salt` is the caller's project's
    (`cache_salt.project_cache_salt`); the request carries it combined with the body's own `cache_salt`.
    `adapter`: the LoRA adapter the body's `model` names ("" for the base model). `images`: the bytes of every
    image and audio URL in `messages` (`gateway.media.MediaFetcher.fetch`)."""
    with unicode_text():
        return _chat_request(body, messages, request_id, cache_salt, adapter, images)


def _chat_request(
    body: ChatFields, messages: list[ChatMessage], request_id: str, cache_salt: str, adapter: str,
    images: MediaBytes,
) -> engine_pb2.GenerateRequest:
    logprobs = body.logprobs
    if body.top_logprobs and not logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    request = engine_pb2.GenerateRequest(
        request_id=request_id,
        input=chat_input(body, messages, images),
        sampling=sampling(body, body.completion_cap(), logprobs, body.top_logprobs or 0),
        cache_salt=request_cache_salt(cache_salt, body.cache_salt),
        adapter=adapter,
    )
    spec = constraint(body)
    if spec is not None:
        request.constraint.CopyFrom(spec)
    return request


def completion_requests(
    body: CompletionRequest, request_id: str, *, cache_salt: str = "", adapter: str = ""
) -> list[engine_pb2.GenerateRequest]:
    """One engine request per prompt of a completions body (ids `{request_id}-{i}` when there are several), each
    with the salt and adapter `chat_request` puts on its request."""
    with unicode_text():
        return _completion_requests(body, request_id, cache_salt, adapter)


def _completion_requests(
    body: CompletionRequest, request_id: str, cache_salt: str, adapter: str
) -> list[engine_pb2.GenerateRequest]:
    if body.suffix:
        raise invalid("suffix is not supported", "suffix")
    prompts = body.prompts()
    if not prompts:
        raise invalid("prompt must not be empty", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise invalid(f"prompt holds {len(prompts)} prompts; at most {MAX_PROMPTS} are allowed in one request",
                      "prompt")
    want_logprobs = body.logprobs is not None
    if body.max_tokens == 0 and not body.echo:
        raise invalid("max_tokens 0 needs echo: true (the answer is then the prompt alone)", "max_tokens")
    # The engine generates at least one token; with max_tokens 0 the answer leaves it out (from_engine.prompt_only).
    engine_max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
    params = sampling(body, engine_max_tokens, want_logprobs, body.logprobs or 0)
    if body.echo and (want_logprobs or not isinstance(prompts[0], str)):
        # The echoed prompt's tokens (and their logprobs), from the engine: a token-id prompt's text is theirs too.
        params.prompt_logprobs = max(body.logprobs or 0, body.prompt_logprobs or 0)
    spec = constraint(body)
    salt = request_cache_salt(cache_salt, body.cache_salt)
    requests = []
    for i, prompt in enumerate(prompts):
        one_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        request = engine_pb2.GenerateRequest(
            request_id=one_id, input=prompt_input(prompt), sampling=params, cache_salt=salt, adapter=adapter
        )
        if spec is not None:
            request.constraint.CopyFrom(spec)
        requests.append(request)
    return requests


def prompt_input(prompt: str | list[int], where: str = "prompt") -> types_pb2.Input:
    """A text or token-id prompt as the engine's input; `where` names the field in the 400 for a bad token id."""
    if isinstance(prompt, str):
        return types_pb2.Input(text=prompt)
    if any(not 0 <= t <= UINT32_MAX for t in prompt):
        raise invalid(f"{where} token ids must be token ids (>= 0 and within the vocabulary)", where)
    return types_pb2.Input(token_ids=types_pb2.TokenIds(ids=prompt))
