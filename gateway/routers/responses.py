"""`/v1/responses`: create a response (whole, streamed as semantic events, or in the background), count the input
tokens one would read, and retrieve, delete, list the input items of and cancel stored ones, each request those of
its project (another project's id is answered as unknown, 404). The conversions are `translate.responses_to_engine`
/ `responses_from_engine`; the store and background runs `responses.service`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query

from gateway import calls, sse
from gateway.batches.service import BatchService
from gateway.deps import (
    Batches,
    CallId,
    HttpRequest,
    Media,
    Metrics,
    Pool,
    Project,
    RequestTimer,
    Responses,
    ServedModel,
    admit,
    require_api_key,
    served_model,
    served_or_default,
)
from gateway.engines import EnginePool
from gateway.errors import invalid
from gateway.file_images import read_file_images
from gateway.json_output import FiniteJSONResponse
from gateway.media import MediaFetcher
from gateway.responses import truncation
from gateway.responses.events import ResponseEvents, response_events
from gateway.responses.service import ResponseService
from gateway.schemas.responses import InputTokensRequest, ResponsesRequest
from gateway.store.ids import RESPONSE_PREFIX, new_id
from gateway.translate import responses_from_engine, responses_to_engine
from gateway.translate.cache_salt import project_cache_salt
from ladle.v1 import engine_pb2

ROUTE = "/v1/responses"
router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post(ROUTE, response_model=None, responses=sse.STREAMING_RESPONSES)
async def create_response(
    body: ResponsesRequest, pool: Pool, metrics: Metrics, rid: CallId, project: Project, responses: Responses,
    http: HttpRequest, media: Media, batches: Batches,
) -> Any:
    served = served_model(pool, body.model)
    model = served.id
    admission = await admit(http, project, body.max_output_tokens)
    if body.background and not body.store:
        raise invalid("background responses must be stored: send store: true (the default)", "store")
    if body.background and body.stream:
        raise invalid("streaming a background response is not supported; poll GET /v1/responses/{id}", "stream")
    items, conversation, request = await _engine_request(body, served, pool, rid, project, responses,
                                                         _Media(media, batches))
    want_logprobs = request.sampling.logprobs
    response_id = new_id(RESPONSE_PREFIX)
    if body.background:
        shell = responses_from_engine.response_shell(body, response_id, model, "queued", conversation_id=conversation)
        await responses.queue(shell, project, items, request.SerializeToString())
        return FiniteJSONResponse(shell)
    shell = responses_from_engine.response_shell(body, response_id, model, "in_progress", conversation_id=conversation)
    timer = RequestTimer(metrics, ROUTE, project, model, admission)

    async def finished(response: dict[str, Any]) -> None:
        await responses.ended(response, project, items, body.store)

    if body.stream:
        messages_stream = await calls.started(calls.stream(pool, request))
        events = response_events(messages_stream, ResponseEvents(shell, want_logprobs), finished, timer.token,
                                 lambda usage: timer.finish([usage]))
        return sse.named_response(events)
    reply = await calls.generate(pool, request)
    response = responses_from_engine.from_reply(shell, reply, want_logprobs)
    timer.finish([reply.usage])
    await finished(response)
    return FiniteJSONResponse(response)


@router.post(ROUTE + "/input_tokens", response_model=None)
async def count_input_tokens(
    body: InputTokensRequest, pool: Pool, rid: CallId, project: Project, responses: Responses, media: Media,
    batches: Batches,
) -> Any:
    """How many input tokens a response to `body` would read (OpenAI's `POST /v1/responses/input_tokens`): its
    conversation (a stored `conversation`'s items or the chain `previous_response_id` names, then the body's input,
    with its instructions and tools) rendered by the engine as a generation would render it (Tokenize), after
    `truncation: "auto"` when asked. Nothing is generated, stored or counted against the project's limits."""
    served = served_or_default(pool, body.model)
    _, _, request = await _engine_request(body.model_copy(update={"model": served.id}), served, pool, rid, project,
                                          responses, _Media(media, batches))
    reply = await calls.tokenize(pool, engine_pb2.TokenizeRequest(input=request.input))
    return {"object": "response.input_tokens", "input_tokens": len(reply.token_ids)}


@dataclass(frozen=True)
class _Media:
    """Where a request's images come from: URLs through `fetcher` (which also holds the image cap), files of the
    project through `batches` (its file records and blob store)."""

    fetcher: MediaFetcher
    batches: BatchService


async def _engine_request(
    body: ResponsesRequest, served: ServedModel, pool: EnginePool, rid: str, project: str, responses: ResponseService,
    media: _Media,
) -> tuple[list[dict[str, Any]], str | None, engine_pb2.GenerateRequest]:
    """`body`'s own input items, the stored conversation it continues (None: none), and the engine request for its
    whole conversation (a conversation's items or a previous_response_id chain's, then its own; their images
    fetched by URL, then read by file_id from the project's files, each time again), with `truncation: "auto"`
    applied."""
    items = responses_to_engine.input_items(body)
    conversation = responses_to_engine.conversation_id(body)
    history = await responses.history(body.previous_response_id, conversation, project)
    history_param = "conversation" if conversation is not None else "previous_response_id"
    images = await media.fetcher.fetch(responses_to_engine.image_sources(history, items, history_param))
    file_sources = responses_to_engine.file_image_sources(history, items, history_param)
    if file_sources:
        batches = media.batches
        images |= await read_file_images(file_sources, batches.files, batches.blobs, project, media.fetcher.max_bytes)
    request = responses_to_engine.generate_request(body, history + items, rid, cache_salt=project_cache_salt(project),
                                                   adapter=served.adapter, images=images)
    if body.truncation == "auto":
        await truncation.fit_context(pool, request)
    return items, conversation, request


@router.get(ROUTE + "/{response_id}", response_model=None)
async def retrieve_response(response_id: str, project: Project, responses: Responses) -> Any:
    stored = await responses.get(response_id, project)
    return FiniteJSONResponse(stored.response)


@router.delete(ROUTE + "/{response_id}", response_model=None)
async def delete_response(response_id: str, project: Project, responses: Responses) -> Any:
    await responses.delete(response_id, project)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post(ROUTE + "/{response_id}/cancel", response_model=None)
async def cancel_response(response_id: str, project: Project, responses: Responses) -> Any:
    return FiniteJSONResponse(await responses.cancel(response_id, project))


@router.get(ROUTE + "/{response_id}/input_items", response_model=None)
async def list_input_items(
    response_id: str,
    project: Project,
    responses: Responses,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> Any:
    page, has_more = await responses.input_items(response_id, project, limit, after, order)
    return FiniteJSONResponse({
        "object": "list", "data": page, "has_more": has_more,
        "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
    })
