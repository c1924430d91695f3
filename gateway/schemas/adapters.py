"""vLLM's bodies of `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (its other fields, such as
`load_inplace` and `lora_int_id`, are accepted and ignored)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from gateway.schemas.common import IGNORE_EXTRA

MAX_NAME_CHARS = 256  # the engine's limit on an adapter's name (engine_server.lora.registry)
MAX_PATH_CHARS = 4096  # PATH_MAX


class LoadLoraAdapterRequest(BaseModel):
    """Serve the PEFT adapter in folder `lora_path` (on each engine's host) as the model `lora_name`."""

    model_config = IGNORE_EXTRA
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)


class UnloadLoraAdapterRequest(BaseModel):
    """Stop serving the adapter `lora_name`."""

    model_config = IGNORE_EXTRA
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
