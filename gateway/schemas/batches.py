"""`POST /v1/batches` body."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from gateway.schemas.common import IGNORE_EXTRA

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class CreateBatchRequest(BaseModel):
    """OpenAI's batch creation body; `output_expires_after` and other newer fields are ignored."""

    model_config = IGNORE_EXTRA
    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None

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
        return value
