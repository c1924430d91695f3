"""`POST /v1/chat/completions` and `POST /v1/chat/completions/batch` bodies."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from gateway.schemas.common import IGNORE_EXTRA, UINT32_MAX, SamplingFields

# chat_template_kwargs keys a caller may set; anything else could change how the template behaves in ways the
# operator did not intend.
ALLOWED_TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "reasoning_effort", "add_generation_prompt"})


class ImageURL(BaseModel):
    """An `image_url` part's image: a data: URL (`data:image/png;base64,...`) or an http(s) URL the gateway fetches."""

    model_config = IGNORE_EXTRA
    url: str
    detail: str | None = None  # OpenAI's "auto", "low", "high": taken and ignored (the model's processor decides)


class InputAudio(BaseModel):
    """An `input_audio` part's clip (OpenAI's form): the file's bytes in base64 and its format. Both are checked
    when the message is translated (`translate.media_parts.input_audio_source`: present, base64, a format of
    AUDIO_FORMATS), so a 400 names the exact field (pydantic's would name the union `content` is)."""

    model_config = IGNORE_EXTRA
    data: str | None = None
    format: str | None = None


class AudioURL(BaseModel):
    """An `audio_url` part's clip (vLLM's form): a data: URL (`data:audio/wav;base64,...`) or an http(s) URL the
    gateway fetches."""

    model_config = IGNORE_EXTRA
    url: str


class ContentPart(BaseModel):
    """One part of a multi-part message: text; an image (`image_url`: {"url", "detail"}, or the URL alone as a
    string, vLLM's simple form, with or without `"type": "image_url"`); or an audio clip (OpenAI's `input_audio`:
    {"data": base64, "format"}, or vLLM's `audio_url`: {"url"} or the URL alone, with or without
    `"type": "audio_url"`). Other types are refused when the message is translated, naming the part."""

    model_config = IGNORE_EXTRA
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None
    input_audio: InputAudio | None = None
    audio_url: AudioURL | str | None = None

    @model_validator(mode="before")
    @classmethod
    def _typeless_media(cls, value: Any) -> Any:
        """vLLM's `{"image_url": "..."}` and `{"audio_url": "..."}`: a part with an image (or a clip's URL) and no
        type is an image_url (audio_url) part."""
        if isinstance(value, dict) and "type" not in value:
            for kind in ("image_url", "audio_url"):
                if kind in value:
                    return {**value, "type": kind}
        return value

    def image_source(self) -> tuple[str, str] | None:
        """(the image's URL, its field below the part: "image_url.url" or "image_url") of an image_url part that
        has one; None otherwise."""
        if isinstance(self.image_url, ImageURL):
            return self.image_url.url, "image_url.url"
        if isinstance(self.image_url, str):
            return self.image_url, "image_url"
        return None

    def audio_url_source(self) -> tuple[str, str] | None:
        """(the clip's URL, its field below the part: "audio_url.url" or "audio_url") of an audio_url part that has
        one; None otherwise."""
        if isinstance(self.audio_url, AudioURL):
            return self.audio_url.url, "audio_url.url"
        if isinstance(self.audio_url, str):
            return self.audio_url, "audio_url"
        return None


class FunctionCall(BaseModel):
    model_config = IGNORE_EXTRA
    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    """A tool call of an earlier assistant turn."""

    model_config = IGNORE_EXTRA
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = IGNORE_EXTRA
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(BaseModel):
    model_config = IGNORE_EXTRA
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = IGNORE_EXTRA
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = IGNORE_EXTRA
    name: str


class NamedToolChoice(BaseModel):
    model_config = IGNORE_EXTRA
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatFields(SamplingFields):
    """What a chat request carries besides its messages."""

    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # vLLM's: continue the last message (an assistant turn begun) instead of answering it; add_generation_prompt is
    # then false unless set true (refused).
    continue_final_message: bool = False
    # vLLM's: the answer's content starts with the last message's, where that is an assistant turn (`echoed`).
    echo: bool = False
    # vLLM's chat extras that would change the answer and are not served: refused when set (`to_engine.chat_input`).
    chat_template: Any = None
    # vLLM's: documents for a template that reads them (a RAG template), each an object of strings.
    documents: list[dict[str, str]] | None = None
    mm_processor_kwargs: Any = None
    add_special_tokens: bool = False
    # SGLang's chat extras not served: refused when set to other than their defaults (`to_engine.chat_input`).
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    input_ids: Any = None
    session_params: Any = None
    # OpenAI's reasoning effort: the chat template's `reasoning_effort` (gpt-oss's "Reasoning: <effort>"), and
    # `enable_thinking` false for "none" (Qwen3), unless chat_template_kwargs sets them.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def completion_cap(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens, as in OpenAI's API."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatCompletionRequest(ChatFields):
    messages: list[ChatMessage] = Field(min_length=1)

    def echoed(self) -> str:
        """What vLLM's `echo` puts before each choice's content: the last message's text (its text parts joined by
        newlines) where it is an assistant turn, as the answer's is; "" without echo or otherwise."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant" or last.content is None:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "\n".join(part.text or "" for part in last.content if part.type == "text")


class BatchChatCompletionRequest(ChatFields):
    """`messages` is a list of conversations, each answered independently (one choice per conversation)."""

    messages: list[list[ChatMessage]] = Field(min_length=1)
