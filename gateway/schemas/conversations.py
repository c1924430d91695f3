"""Bodies of the Conversations API (`/v1/conversations`): items stay plain JSON objects, checked as a response's
input items are (`translate.responses_to_engine.checked_items`); metadata is OpenAI's: at most 16 pairs, keys of
at most 64 characters, values of at most 512."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints

from gateway.schemas.common import STRICT_IGNORE_EXTRA

Metadata = dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]]


class ConversationCreateRequest(BaseModel):
    model_config = STRICT_IGNORE_EXTRA
    items: list[dict[str, Any]] | None = None
    metadata: Metadata | None = Field(default=None, max_length=16)


class ConversationUpdateRequest(BaseModel):
    model_config = STRICT_IGNORE_EXTRA
    metadata: Metadata | None = Field(max_length=16)


class ItemsCreateRequest(BaseModel):
    model_config = STRICT_IGNORE_EXTRA
    items: list[dict[str, Any]]
