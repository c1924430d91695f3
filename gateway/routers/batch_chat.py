"""`POST /v1/chat/completions/batch`: a list of conversations answered independently through one call of the
engine's Batch RPC (`calls.batch_rpc`), within one HTTP request. Not OpenAI's batch jobs (`/v1/batches`,
`gateway.batches`).

The response is one chat completion whose choice i answers conversation i, with usage summed over all of them.
Tools apply to every conversation (their calls parsed as in chat). Streaming, beam search and n > 1 are refused:
each conversation gets exactly one choice.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from gateway import calls
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
from gateway.errors import invalid
from gateway.json_output import FiniteJSONResponse
from gateway.rate_limits import times
from gateway.schemas.chat import BatchChatCompletionRequest
from gateway.translate import from_engine, to_engine
from gateway.translate.cache_salt import project_cache_salt
from gateway.translate.media_parts import chat_media_sources
from ladle.v1 import types_pb2

ROUTE = "/v1/chat/completions/batch"
router = APIRouter(dependencies=[Depends(require_api_key)])


def _refuse_unsupported(body: BatchChatCompletionRequest) -> None:
    if body.stream:
        raise invalid("streaming is not supported by the batched endpoint; use /v1/chat/completions", "stream")
    if body.use_beam_search:
        raise invalid("beam search is not served here: send such a conversation to /v1/chat/completions",
                      "use_beam_search")  # fmt: skip
    if body.n != 1:
        raise invalid("n must be 1 here: each conversation gets one choice", "n")
    if body.echo:
        raise invalid("echo is not served here: send such a conversation to /v1/chat/completions", "echo")


@router.post(ROUTE, response_model=None)
async def create_batch_chat_completion(
    body: BatchChatCompletionRequest,
    pool: Pool,
    metrics: Metrics,
    rid: CallId,
    project: Project,
    http: HttpRequest,
    media: Media,
) -> Any:
    served = served_model(pool, body.model)
    model = served.id
    admission = await admit(http, project, times(body.completion_cap(), len(body.messages)))
    _refuse_unsupported(body)
    for i, conversation in enumerate(body.messages):
        if not conversation:
            raise invalid(f"conversation {i} has no messages", f"messages[{i}]")
    salt = project_cache_salt(project)
    images = await media.fetch([source for i, conv in enumerate(body.messages)
                                for source in chat_media_sources(conv, f"messages[{i}]")])
    requests = [
        to_engine.chat_request(body, conv, f"{rid}-{i}", cache_salt=salt, adapter=served.adapter, images=images)
        for i, conv in enumerate(body.messages)
    ]
    for request in requests:
        request.priority = types_pb2.PRIORITY_INTERACTIVE  # a caller is waiting on the HTTP response
    timer = RequestTimer(metrics, ROUTE, project, model, admission)
    responses = await calls.batch_rpc(pool, requests, "messages")
    usage = [r.usage for r in responses]
    timer.finish(usage)
    as_ids = bool(body.return_tokens_as_token_ids)
    choices = [from_engine.chat_choice(r.choices[0], i, body.logprobs, from_engine.one_call(body), as_ids)
               for i, r in enumerate(responses)]  # fmt: skip
    for choice, reply in zip(choices, responses, strict=True):  # each conversation its prompt's, on its choice
        choice.update(from_engine.prompt_extras(body, reply))
        choice.update(from_engine.generated_ids(body, reply.choices[0]))
    return FiniteJSONResponse(
        from_engine.response("chat.completion", f"chatcmpl-{rid}", model, choices, from_engine.usage(usage))
    )
