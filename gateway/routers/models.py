"""`GET /v1/models` and `GET /v1/models/{model}`: the model the engines serve and the LoRA adapters they serve on it,
each adapter a model card of its own (vLLM's shape: `parent` the served model, `root` the adapter's folder)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from gateway.deps import Pool, require_api_key, served_model
from gateway.engines import EnginePool
from ladle.v1 import engine_pb2

router = APIRouter(dependencies=[Depends(require_api_key)])


def model_card(model_id: str, info: engine_pb2.GetModelInfoResponse | None) -> dict[str, Any]:
    card: dict[str, Any] = {"id": model_id, "object": "model", "created": 0, "owned_by": "ladle"}
    if info is not None:
        card["max_model_len"] = info.context_length  # as vLLM reports it
    return card


def adapter_card(
    adapter: engine_pb2.AdapterInfo, model_id: str, info: engine_pb2.GetModelInfoResponse | None
) -> dict[str, Any]:
    """An adapter's card: its base model's, named for the adapter, with vLLM's `parent` and `root`."""
    return {**model_card(adapter.name, info), "parent": model_id, "root": adapter.path}


def _card(pool: EnginePool, requested: str) -> dict[str, Any]:
    served = served_model(pool, requested)
    adapter = pool.adapter(served.adapter) if served.adapter else None
    if adapter is None:
        return model_card(served.id, pool.model_info())
    return adapter_card(adapter, pool.model_id or "", pool.model_info())


@router.get("/v1/models", response_model=None)
async def list_models(pool: Pool) -> Any:
    model_id = pool.model_id
    if model_id is None:
        raise pool.unavailable()
    info = pool.model_info()
    adapters = [a for a in pool.adapters() if a.name != model_id]  # the served model's name wins (served_model)
    cards = [model_card(model_id, info), *(adapter_card(a, model_id, info) for a in adapters)]
    return JSONResponse({"object": "list", "data": cards})


@router.get("/v1/models/{model:path}", response_model=None)
async def retrieve_model(model: str, pool: Pool) -> Any:
    return JSONResponse(_card(pool, model))
