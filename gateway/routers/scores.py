"""vLLM's `POST /v1/score` (also `/score`) and `POST /v1/rerank` (also `/rerank` and Cohere's `/v2/rerank`):
relevance scores of texts against a query, through the engine's Score call. The aliases are vLLM's paths too;
only the `/v1` ones are in the OpenAPI document."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from gateway import calls
from gateway.deps import CallId, HttpRequest, Metrics, Pool, Project, RequestTimer, admit, base_model, require_api_key
from gateway.engines import EnginePool
from gateway.errors import APIError
from gateway.json_output import FiniteJSONResponse
from gateway.schemas.pooling import RerankRequest, ScoreRequest
from gateway.translate import pooling_from_engine, pooling_to_engine
from gateway.translate.cache_salt import project_cache_salt

SCORE_ROUTE = "/v1/score"
RERANK_ROUTE = "/v1/rerank"
router = APIRouter(dependencies=[Depends(require_api_key)])


def _model(pool: EnginePool, requested: str | None) -> str:
    """vLLM's score and rerank bodies may leave `model` out: then the served model."""
    return base_model(pool, requested if requested is not None else pool.model_id or "")


@router.post("/score", response_model=None, include_in_schema=False)
@router.post(SCORE_ROUTE, response_model=None)
async def create_score(
    body: ScoreRequest, pool: Pool, metrics: Metrics, rid: CallId, project: Project, http: HttpRequest
) -> Any:
    model = _model(pool, body.model)
    admission = await admit(http, project, 0)
    requests = pooling_to_engine.score_requests(body, rid, pool.model_info(), cache_salt=project_cache_salt(project))
    queries, _, (first, second) = pooling_to_engine.score_pairs(body)
    timer = RequestTimer(metrics, SCORE_ROUTE, project, model, admission)
    try:
        replies = await calls.run_all(pool, requests, calls.score)
    except APIError as error:
        error.param = pooling_from_engine.pooling_param(error.param, {"query": first, "documents": second})
        raise
    timer.finish([r.usage for r in replies])
    groups = pooling_to_engine.score_groups(queries)
    return FiniteJSONResponse(pooling_from_engine.score_list(groups, replies, f"score-{rid}", model))


@router.post("/rerank", response_model=None, include_in_schema=False)
@router.post("/v2/rerank", response_model=None, include_in_schema=False)
@router.post(RERANK_ROUTE, response_model=None)
async def create_rerank(
    body: RerankRequest, pool: Pool, metrics: Metrics, rid: CallId, project: Project, http: HttpRequest
) -> Any:
    model = _model(pool, body.model)
    admission = await admit(http, project, 0)
    request = pooling_to_engine.rerank_request(body, rid, pool.model_info(), cache_salt=project_cache_salt(project))
    timer = RequestTimer(metrics, RERANK_ROUTE, project, model, admission)
    reply = await calls.score(pool, request)
    timer.finish([reply.usage])
    return FiniteJSONResponse(pooling_from_engine.rerank_result(body, reply, f"rerank-{rid}", model))
