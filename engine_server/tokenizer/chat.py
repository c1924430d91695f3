"""Render chat messages with the model's own chat template (transformers' sandboxed jinja environment).

Templates are never taken from a request: only the model's template renders, with a short allow-list of extra
variables a caller may set.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2.exceptions import SecurityError

from engine_server.errors import ModelTemplateError, ValidationError

# Extra template variables a request may set; anything else (notably a template of its own) is refused.
ALLOWED_TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "reasoning_effort"})
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# A turn's text no template writes of itself (`content_as_parts`), and what each template was found to take.
_CONTENT_PROBE = "ladle-content-probe-5f1c"
_PARTS_TEMPLATES: dict[str, bool] = {}


@dataclass(frozen=True)
class ChatToolCall:
    """A tool call made by an earlier assistant turn."""

    id: str
    name: str
    arguments_json: str


@dataclass(frozen=True)
class ChatImage:
    """An image of a chat turn: its encoded file's bytes (`engine_server.multimodal` reads them)."""

    data: bytes


@dataclass(frozen=True)
class ChatAudio:
    """An audio clip of a chat turn: its encoded file's bytes (`engine_server.multimodal.audio` hears them)."""

    data: bytes


@dataclass(frozen=True)
class ChatMessage:
    """One conversation turn, in the engine's own vocabulary (independent of proto and OpenAI JSON). A turn that holds
    images or audio has its text, images and clips in order in `content_parts` (its `content` then empty); templates
    take those as OpenAI's parts, an image as `{"type": "image"}`, a clip as `{"type": "audio"}` (transformers'
    processors' form, where a template writes the model's image or audio token)."""

    role: str
    content: str = ""
    tool_calls: tuple[ChatToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""
    content_parts: tuple[str | ChatImage | ChatAudio, ...] = ()

    @property
    def images(self) -> list[tuple[int, ChatImage]]:
        """The turn's images with their index among its parts."""
        return [(index, part) for index, part in enumerate(self.content_parts) if isinstance(part, ChatImage)]

    @property
    def audio(self) -> list[tuple[int, ChatAudio]]:
        """The turn's audio clips with their index among its parts."""
        return [(index, part) for index, part in enumerate(self.content_parts) if isinstance(part, ChatAudio)]


@dataclass(frozen=True)
class ChatTool:
    """A function the model may call; `parameters` is its JSON Schema."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)


def _arguments(call: ChatToolCall, as_text: bool) -> Any:
    """A call's arguments for the template: the caller's JSON text `as_text`, else the parsed object, which
    templates index into (e.g. `tool_call.arguments | tojson`), or the text when it is not JSON."""
    raw = call.arguments_json
    if as_text:
        return raw or "{}"
    try:
        return json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return raw


def _message_dict(message: ChatMessage, text_arguments: bool = False, parts: bool = False) -> dict[str, Any]:
    """A turn as templates take it; its content a list of OpenAI's text parts (one, or none for no text) where
    `parts`, else the string; a turn with images or audio always its parts (`ChatMessage`)."""
    if message.role not in CHAT_ROLES:
        raise ValidationError(f"unknown chat role {message.role!r}; expected one of {sorted(CHAT_ROLES)}", "messages")
    content: Any = message.content
    if message.content_parts:
        content = [
            {"type": "text", "text": part} if isinstance(part, str)
            else {"type": "image"} if isinstance(part, ChatImage) else {"type": "audio"}
            for part in message.content_parts
        ]  # fmt: skip
    elif parts:
        content = [{"type": "text", "text": message.content}] if message.content else []
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c, text_arguments)}}
            for c in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    return out


def content_as_parts(tokenizer: Any) -> bool:
    """Whether the model's chat template reads a turn's content as OpenAI's list of parts alone (LLaVA's and
    Idefics's: `for part in message['content']`), so that a string's text would not reach the prompt: a probe turn
    rendered as a string does not show, as one text part it does (vLLM's "openai" content format, which it finds
    in the template's syntax). Worked out once per template."""
    template = getattr(tokenizer, "chat_template", None)
    key = template if isinstance(template, str) else repr(template)  # (a str's hash is kept: no copy a request)
    if key not in _PARTS_TEMPLATES:
        as_string = _probe(tokenizer, _CONTENT_PROBE)
        _PARTS_TEMPLATES[key] = _CONTENT_PROBE not in as_string and _CONTENT_PROBE in _probe(
            tokenizer, [{"type": "text", "text": _CONTENT_PROBE}]
        )
    return _PARTS_TEMPLATES[key]


def _probe(tokenizer: Any, content: Any) -> str:
    """The template's rendering of one user turn of `content`; "" where it fails."""
    try:
        return str(tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True))  # fmt: skip
    except Exception:  # a template that cannot take this form renders none of it
        return ""


def render_chat(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    tools: Sequence[ChatTool] = (),
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
    continue_final_message: bool = False,
    documents: Sequence[Mapping[str, str]] = (),
) -> str:
    """Return the prompt text the model's chat template produces for `messages`; with `continue_final_message`, cut
    right after the last message's content (transformers' `continue_final_message`: the output continues it);
    `documents` go to a template that reads them (transformers' `documents`).

    Raises ValidationError for an empty conversation, an unknown role, a model without a chat template, or a
    template variable outside ALLOWED_TEMPLATE_KWARGS; ModelTemplateError when the template attempts what its
    sandbox forbids (reaching Python internals, mutating its inputs): nothing of that runs.
    """
    if not messages:
        raise ValidationError("messages must not be empty", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise ValidationError("this model has no chat template; send text or token ids instead", "messages")
    if continue_final_message and add_generation_prompt:
        raise ValidationError("continue_final_message continues the last message: add_generation_prompt must be "
                              "false with it", "add_generation_prompt")  # fmt: skip
    extra = dict(template_kwargs or {})
    refused = sorted(set(extra) - ALLOWED_TEMPLATE_KWARGS)
    if refused:
        raise ValidationError(
            f"chat_template_kwargs keys {refused} are not allowed; allowed: {sorted(ALLOWED_TEMPLATE_KWARGS)}",
            "chat_template_kwargs",
        )
    tool_dicts = [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in tools
    ]

    parts = content_as_parts(tokenizer)

    def apply(text_arguments: bool) -> Any:
        return tokenizer.apply_chat_template(
            [_message_dict(m, text_arguments, parts) for m in messages],
            tools=tool_dicts or None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            documents=[dict(d) for d in documents] or None,
            tokenize=False,
            **extra,
        )

    try:
        try:
            text = apply(text_arguments=False)
        except TypeError as first:
            # A template that joins a call's arguments to text ('<｜tool▁sep｜>' + arguments: DeepSeek V3's and
            # V3.1's) takes them as the caller's JSON text; if that fails too, the first error stands.
            if not any(m.tool_calls for m in messages):
                raise
            try:
                text = apply(text_arguments=True)
            except Exception:
                raise first from None
    except ValidationError:
        raise
    except SecurityError as exc:  # the template itself, not the caller's input, is at fault
        raise ModelTemplateError(
            f"the model's chat template attempted an operation its sandbox forbids ({exc}); this model cannot "
            "render chat messages until its template is fixed: send text or token ids"
        ) from exc
    except Exception as exc:  # a template's own `raise_exception(...)` lands here: the caller's input is at fault
        raise ValidationError(f"the chat template rejected the messages: {exc}", "messages") from exc
    return str(text)
