"""`POST /v1/chat/completions` and `POST /v1/chat/completions/batch` bodies."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from gateway.schemas.common import IGNORE_EXTRA, UINT32_MAX, SamplingFields

# chat_template_kwargs keys a caller may set; anything else could change how the template behaves in ways the
# operator did not intend.
ALLOWED_TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "reasoning_effort", "add_generation_prompt"})


class ContentPart(BaseModel):
    """One part of a multi-part message; only text parts are supported (the models served are text-only)."""

    model_config = IGNORE_EXTRA
    type: str
    text: str | None = None


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
    # OpenAI's reasoning effort: the chat template's `reasoning_effort` (gpt-oss's "Reasoning: <effort>"), and
    # `enable_thinking` false for "none" (Qwen3), unless chat_template_kwargs sets them.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def completion_cap(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens, as in OpenAI's API."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatCompletionRequest(ChatFields):
    messages: list[ChatMessage] = Field(min_length=1)


class BatchChatCompletionRequest(ChatFields):
    """`messages` is a list of conversations, each answered independently (one choice per conversation)."""

    messages: list[list[ChatMessage]] = Field(min_length=1)
