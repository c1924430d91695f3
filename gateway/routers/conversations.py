"""`/v1/conversations`: OpenAI's Conversations API. Create, retrieve, update (metadata) and delete a conversation;
add, list, retrieve and delete its items. Every call acts for its key's project (another project's conversation is
unknown: 404). A response created with `conversation` reads its items and adds its own input and output to it
(`responses.conversations`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query

from gateway.deps import Project, Responses, require_api_key
from gateway.json_output import FiniteJSONResponse
from gateway.schemas.conversations import ConversationCreateRequest, ConversationUpdateRequest, ItemsCreateRequest

ROUTE = "/v1/conversations"
router = APIRouter(dependencies=[Depends(require_api_key)])
# `include` (on the item routes) names extra output fields of hosted tools and media; a text-only model with
# function tools has none of them, so it is accepted and changes nothing, as on /v1/responses.
Include = Annotated[list[str] | None, Query()]


@router.post(ROUTE, response_model=None)
async def create_conversation(body: ConversationCreateRequest, project: Project, responses: Responses) -> Any:
    return FiniteJSONResponse(await responses.conversations.create(project, body.items or [], body.metadata or {}))


@router.get(ROUTE + "/{conversation_id}", response_model=None)
async def retrieve_conversation(conversation_id: str, project: Project, responses: Responses) -> Any:
    return (await responses.conversations.get(conversation_id, project)).body()


@router.post(ROUTE + "/{conversation_id}", response_model=None)
async def update_conversation(conversation_id: str, body: ConversationUpdateRequest, project: Project,
                              responses: Responses) -> Any:
    return await responses.conversations.update(conversation_id, project, body.metadata or {})


@router.delete(ROUTE + "/{conversation_id}", response_model=None)
async def delete_conversation(conversation_id: str, project: Project, responses: Responses) -> Any:
    return await responses.conversations.delete(conversation_id, project)


@router.post(ROUTE + "/{conversation_id}/items", response_model=None)
async def create_items(conversation_id: str, body: ItemsCreateRequest, project: Project, responses: Responses,
                       include: Include = None) -> Any:
    return FiniteJSONResponse(await responses.conversations.add_items(conversation_id, project, body.items))


@router.get(ROUTE + "/{conversation_id}/items", response_model=None)
async def list_items(
    conversation_id: str,
    project: Project,
    responses: Responses,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
    include: Include = None,
) -> Any:
    return FiniteJSONResponse(await responses.conversations.list_items(conversation_id, project, limit, after, order))


@router.get(ROUTE + "/{conversation_id}/items/{item_id}", response_model=None)
async def retrieve_item(conversation_id: str, item_id: str, project: Project, responses: Responses,
                        include: Include = None) -> Any:
    return FiniteJSONResponse(await responses.conversations.item(conversation_id, project, item_id))


@router.delete(ROUTE + "/{conversation_id}/items/{item_id}", response_model=None)
async def delete_item(conversation_id: str, item_id: str, project: Project, responses: Responses) -> Any:
    return await responses.conversations.delete_item(conversation_id, project, item_id)
