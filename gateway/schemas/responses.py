"""`POST /v1/responses` body: OpenAI's Responses API request, with the sampling extras vLLM accepts on it.

Input items stay plain JSON objects here (`input` as a string or a list of items): their many shapes (messages
with or without `type`, prior output items, function calls and their outputs) are read, and refused with a 400
naming `input[i]`, by `translate.responses_to_engine`, which also turns the body into a chat request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.schemas.common import INT32_MAX, INT64_MAX, INT64_MIN, STRICT_IGNORE_EXTRA, UINT32_MAX

# Statuses of a stored response (OpenAI's): background ones pass through queued and in_progress.
ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
FINISHED_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON that validates against `schema`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, allow_inf_nan=False, strict=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = STRICT_IGNORE_EXTRA
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    """`reasoning`: `effort` is passed to the chat template (`reasoning_effort`, and `enable_thinking` false for
    "none"); the model's reasoning comes back as reasoning output items."""

    model_config = STRICT_IGNORE_EXTRA
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    model_config = STRICT_IGNORE_EXTRA

    model: str
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    store: bool = True
    background: bool = False
    stream: bool = False
    # Refused when set (see responses_to_engine): the Conversations API and stored prompt templates.
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # vLLM's extras on this route.
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    cache_salt: str | None = Field(default=None, min_length=1)


class InputTokensRequest(ResponsesRequest):
    """`POST /v1/responses/input_tokens`: a Responses body whose tokens are counted; the model is optional there
    (the served one when absent; a model named, even "", must be one served)."""

    model: str | None = None  # type: ignore[assignment]  # optional here, required when creating
