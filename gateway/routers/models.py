"""`GET /v1/models` and `GET /v1/models/{model}`: the one model the engines serve."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from gateway.deps import Pool, require_api_key, served_model
from gateway.engines import EnginePool

router = APIRouter(dependencies=[Depends(require_api_key)])


def _model_card(pool: EnginePool, model_id: str) -> dict[str, Any]:
    info = pool.model_info()
    card: dict[str, Any] = {"id": model_id, "object": "model", "created": 0, "owned_by": "ladle"}
    if info is not None:
        card["max_model_len"] = info.context_length  # as vLLM reports it
    return card


@router.get("/v1/models", response_model=None)
async def list_models(pool: Pool) -> Any:
    model_id = pool.model_id
    if model_id is None:
        raise pool.unavailable()
    return JSONResponse({"object": "list", "data": [_model_card(pool, model_id)]})


@router.get("/v1/models/{model:path}", response_model=None)
async def retrieve_model(model: str, pool: Pool) -> Any:
    return JSONResponse(_model_card(pool, served_model(pool, model)))
