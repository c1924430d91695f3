"""`POST /v1/chat/completions`: one conversation, n choices, whole or streamed."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends

from gateway import calls, sse
from gateway.deps import (
    CallId,
    HttpRequest,
    Media,
    Metrics,
    Pool,
    Project,
    RequestTimer,
    admit,
    require_api_key,
    served_model,
)
from gateway.json_output import FiniteJSONResponse
from gateway.rate_limits import times
from gateway.schemas.chat import ChatCompletionRequest
from gateway.streaming import StreamHeader, chat_chunks
from gateway.translate import from_engine, to_engine
from gateway.translate.cache_salt import project_cache_salt
from gateway.translate.media_parts import chat_media_sources

ROUTE = "/v1/chat/completions"
router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post(ROUTE, response_model=None, responses=sse.STREAMING_RESPONSES)
async def create_chat_completion(
    body: ChatCompletionRequest,
    pool: Pool,
    metrics: Metrics,
    rid: CallId,
    project: Project,
    http: HttpRequest,
    media: Media,
) -> Any:
    served = served_model(pool, body.lora_path or body.model)  # (SGLang's lora_path names the adapter)
    model = served.id
    admission = await admit(http, project, times(body.completion_cap(), body.n))
    images = await media.fetch(chat_media_sources(body.messages))
    request = to_engine.chat_request(body, body.messages, rid, cache_salt=project_cache_salt(project),
                                     adapter=served.adapter, images=images)
    timer = RequestTimer(metrics, ROUTE, project, model, admission)
    if body.stream:
        messages = await calls.started(calls.stream(pool, request))
        header = StreamHeader(f"chatcmpl-{rid}", "chat.completion.chunk", model, body.include_usage, int(time.time()))
        chunks = chat_chunks(messages, header, body.logprobs, timer, from_engine.one_call(body),
                             bool(body.return_token_ids), bool(body.return_tokens_as_token_ids), body.echoed())
        return sse.response(chunks)
    response = await calls.generate(pool, request)
    timer.finish([response.usage])
    return FiniteJSONResponse(from_engine.chat_completion(body, response, f"chatcmpl-{rid}", model, body.echoed()))
