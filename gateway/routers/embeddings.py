"""`POST /v1/embeddings`: OpenAI's embeddings (vectors as floats or base64), with vLLM's extras and its chat-style
`messages`, through one Embed call."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from gateway import calls
from gateway.deps import CallId, HttpRequest, Metrics, Pool, Project, RequestTimer, admit, base_model, require_api_key
from gateway.errors import APIError
from gateway.json_output import FiniteJSONResponse
from gateway.schemas.pooling import EmbeddingRequest
from gateway.translate import pooling_from_engine, pooling_to_engine
from gateway.translate.cache_salt import project_cache_salt

ROUTE = "/v1/embeddings"
router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post(ROUTE, response_model=None)
async def create_embeddings(
    body: EmbeddingRequest, pool: Pool, metrics: Metrics, rid: CallId, project: Project, http: HttpRequest
) -> Any:
    model = base_model(pool, body.model)
    admission = await admit(http, project, 0)
    request = pooling_to_engine.embed_request(body, rid, pool.model_info(), cache_salt=project_cache_salt(project))
    timer = RequestTimer(metrics, ROUTE, project, model, admission)
    try:
        reply = await calls.embed(pool, request)
    except APIError as error:  # the engine names its own field; a chat embedding's input is its messages
        error.param = pooling_from_engine.pooling_param(error.param, {"input": "messages"} if body.messages else {})
        raise
    timer.finish([reply.usage])
    return FiniteJSONResponse(pooling_from_engine.embedding_list(reply, model, body.encoding_format))
