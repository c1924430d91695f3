"""`POST /v1/batches` body, and the expiry policy it shares with file uploads."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from gateway.schemas.common import IGNORE_EXTRA

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MIN_EXPIRY_S = 3600  # OpenAI's bounds on expires_after.seconds: an hour to 30 days
MAX_EXPIRY_S = 30 * 24 * 3600


class ExpiresAfter(BaseModel):
    """OpenAI's expiry policy of a file: `seconds` after its creation (the only anchor, `created_at`)."""

    model_config = IGNORE_EXTRA
    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRY_S, le=MAX_EXPIRY_S)


class CreateBatchRequest(BaseModel):
    """OpenAI's batch creation body; newer fields it does not know are ignored. `output_expires_after` applies
    to the output and error files, from their creation."""

    model_config = IGNORE_EXTRA
    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY_CHARS} characters")
            if len(item) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"values are at most {MAX_METADATA_VALUE_CHARS} characters")
            if not _is_unicode(key) or not _is_unicode(item):
                # It would be stored, and then no response holding the batch could be encoded as UTF-8.
                raise ValueError("keys and values must be valid Unicode (a lone surrogate such as \\ud800 is not)")
        return value


def _is_unicode(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
