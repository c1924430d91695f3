"""vLLM's `POST /tokenize` and `POST /detokenize` bodies: a prompt (text) or chat `messages` (with the chat route's
`tools`, `chat_template_kwargs`, `add_generation_prompt` and `continue_final_message`), and token ids back to text."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from gateway.schemas.common import STRICT_IGNORE_EXTRA, TokenId


class TokenizeRequest(BaseModel):
    """Exactly one of `prompt` and `messages`. `add_special_tokens` defaults as vLLM's: true for a prompt (the
    tokenizer's own, e.g. BOS), false for messages (the chat template writes them)."""

    model_config = STRICT_IGNORE_EXTRA

    model: str | None = None
    prompt: str | None = None
    # Read as the chat route reads them (its schema, its 400s naming the field), when the call is made.
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = STRICT_IGNORE_EXTRA

    model: str | None = None
    tokens: list[TokenId]
