"""`POST /v1/completions`: one or several prompts (text or token ids), n choices each, whole or streamed."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends

from gateway import calls, sse
from gateway.deps import CallId, HttpRequest, Metrics, Pool, Project, RequestTimer, admit, require_api_key, served_model
from gateway.json_output import FiniteJSONResponse
from gateway.schemas.completions import CompletionRequest
from gateway.streaming import StreamHeader, completion_chunks
from gateway.translate import from_engine, to_engine
from gateway.translate.cache_salt import project_cache_salt

ROUTE = "/v1/completions"
router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post(ROUTE, response_model=None, responses=sse.STREAMING_RESPONSES)
async def create_completion(
    body: CompletionRequest,
    pool: Pool,
    metrics: Metrics,
    rid: CallId,
    project: Project,
    http: HttpRequest,
) -> Any:
    served = served_model(pool, body.lora_path or body.model)  # (SGLang's lora_path names the adapter)
    model = served.id
    # best_of (sampled: every sample is generated and counted) reserves its samples' tokens.
    samples = body.n if body.use_beam_search else max(body.n, body.best_of or 0)
    admission = await admit(http, project, (body.max_tokens or 0) * samples * len(body.prompts()))
    requests = to_engine.completion_requests(body, rid, cache_salt=project_cache_salt(project),
                                              adapter=served.adapter)
    prompts = body.prompts()
    want_logprobs = body.logprobs is not None
    timer = RequestTimer(metrics, ROUTE, project, model, admission)
    if body.stream:
        streams = await calls.started_all([calls.stream(pool, r) for r in requests])
        header = StreamHeader(f"cmpl-{rid}", "text_completion", model, body.include_usage, int(time.time()))
        echo = from_engine.stream_echo(body, prompts)
        chunks = completion_chunks(calls.merge(streams), header, body.n, want_logprobs, echo, timer,
                                   prompt_only=body.max_tokens == 0, want_token_ids=bool(body.return_token_ids),
                                   as_ids=bool(body.return_tokens_as_token_ids))
        return sse.response(chunks)
    responses = await calls.generate_all(pool, requests)
    used = [r.usage for r in responses]
    if body.max_tokens == 0:  # the prompt alone: the one token the engine made is not counted (nor answered)
        used = [from_engine.input_only(u) for u in used]
    timer.finish(used)
    return FiniteJSONResponse(from_engine.text_completion(body, responses, f"cmpl-{rid}", model))
