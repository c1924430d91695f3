"""vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`: LoRA adapters loaded and unloaded at run
time on every engine, and given back to an engine that restarts (`gateway.adapters`), for admin keys only
(`deps.require_admin`). A loaded adapter is a model of its own: requests select it by `model`, and `GET /v1/models`
lists it. Success is a 200 with a plain-text message, as vLLM answers."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from gateway.deps import Adapters, require_admin
from gateway.schemas.adapters import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

LOAD_ROUTE = "/v1/load_lora_adapter"
UNLOAD_ROUTE = "/v1/unload_lora_adapter"
router = APIRouter(dependencies=[Depends(require_admin)])
TEXT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "What was done, in words"},
}


@router.post(LOAD_ROUTE, responses=TEXT_RESPONSES)
async def load_lora_adapter(body: LoadLoraAdapterRequest, adapters: Adapters) -> PlainTextResponse:
    await adapters.load(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post(UNLOAD_ROUTE, responses=TEXT_RESPONSES)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, adapters: Adapters) -> PlainTextResponse:
    await adapters.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
