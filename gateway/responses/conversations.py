"""`ConversationService`: the Conversations API's objects for the routes and for `/v1/responses`, one project's at
a time (another project's conversation is unknown: 404).

A response created with `conversation` starts from the conversation's items (`history`), and once it has ended
with output (completed or incomplete) its input items and then its output items are appended to it (`append`),
whichever gateway ran it. Items are checked as a response's input items are (`responses_to_engine.checked_items`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

from sqlalchemy import Engine

from gateway.errors import APIError, invalid
from gateway.store import ids
from gateway.store.conversations import ConversationRecord, ConversationStore, UnknownItemError
from gateway.store.pages import Order
from gateway.translate.responses_to_engine import checked_items, new_item_id

MAX_ADDED_ITEMS = 20  # items one create call adds, as OpenAI allows
ENDED_WITH_OUTPUT = frozenset({"completed", "incomplete"})  # responses whose items join their conversation
T = TypeVar("T")


def not_found(conversation_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Conversation with id '{conversation_id}' not found.", param=param, code="not_found")


def item_not_found(item_id: str) -> APIError:
    return APIError(404, f"Item with id '{item_id}' not found.", param="item_id", code="not_found")


def added_items(raw: list[dict[str, Any]], param: str = "items") -> list[dict[str, Any]]:
    """Items a call adds, checked; 400 for more than MAX_ADDED_ITEMS."""
    if len(raw) > MAX_ADDED_ITEMS:
        raise invalid(f"{param} may hold at most {MAX_ADDED_ITEMS} items; got {len(raw)}", param)
    return checked_items(raw, param)


def item_list(items: list[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    """A list of items as the API pages them."""
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def _checked(conversation_id: str, param: str | None = None) -> str:
    """`conversation_id` if it has the shape of one (a made-up id never reaches a query); else the 404."""
    if not ids.is_id(conversation_id, ids.CONVERSATION_PREFIX):
        raise not_found(conversation_id, param)
    return conversation_id


def _found(value: T | None, conversation_id: str, param: str | None = None) -> T:
    """What the store answered, or the 404 when it answered None (the project has no such conversation)."""
    if value is None:
        raise not_found(conversation_id, param)
    return value


class ConversationService:
    """Conversations on the database the stored responses use."""

    def __init__(self) -> None:
        self._store: ConversationStore | None = None

    def start(self, db: Engine) -> None:
        self._store = ConversationStore(db, new_item_id)

    @property
    def store(self) -> ConversationStore:
        assert self._store is not None, "ConversationService.start() has not run"
        return self._store

    async def create(self, project: str, items: list[dict[str, Any]], metadata: dict[str, str]) -> dict[str, Any]:
        record = await asyncio.to_thread(self.store.create, ids.new_id(ids.CONVERSATION_PREFIX), project,
                                         int(time.time()), metadata, added_items(items))
        return record.body()

    async def get(self, conversation_id: str, project: str) -> ConversationRecord:
        return _found(await asyncio.to_thread(self.store.get, _checked(conversation_id), project), conversation_id)

    async def update(self, conversation_id: str, project: str, metadata: dict[str, str]) -> dict[str, Any]:
        record = await asyncio.to_thread(self.store.update_metadata, _checked(conversation_id), project, metadata)
        return _found(record, conversation_id).body()

    async def delete(self, conversation_id: str, project: str) -> dict[str, Any]:
        if not await asyncio.to_thread(self.store.delete, _checked(conversation_id), project):
            raise not_found(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    async def add_items(self, conversation_id: str, project: str, items: list[dict[str, Any]]) -> dict[str, Any]:
        checked = added_items(items)
        stored = await asyncio.to_thread(self.store.add_items, _checked(conversation_id), project, checked)
        return item_list(_found(stored, conversation_id))

    async def list_items(self, conversation_id: str, project: str, limit: int, after: str | None, order: Order
                         ) -> dict[str, Any]:
        try:
            page = await asyncio.to_thread(self.store.item_page, _checked(conversation_id), project, limit, after,
                                           order)
        except UnknownItemError:
            raise invalid(f"after {after!r} is not an item of {conversation_id}", "after") from None
        page = _found(page, conversation_id)
        return item_list(page.items, page.has_more)

    async def item(self, conversation_id: str, project: str, item_id: str) -> dict[str, Any]:
        try:
            found = await asyncio.to_thread(self.store.item, _checked(conversation_id), project, item_id)
        except UnknownItemError:
            raise item_not_found(item_id) from None
        return _found(found, conversation_id)

    async def delete_item(self, conversation_id: str, project: str, item_id: str) -> dict[str, Any]:
        try:
            record = await asyncio.to_thread(self.store.delete_item, _checked(conversation_id), project, item_id)
        except UnknownItemError:
            raise item_not_found(item_id) from None
        return _found(record, conversation_id).body()

    async def history(self, conversation_id: str, project: str) -> list[dict[str, Any]]:
        """The items a response in the conversation starts from, oldest first; 404 (naming `conversation`) for
        an unknown one."""
        found = await asyncio.to_thread(self.store.items, _checked(conversation_id, "conversation"), project)
        return _found(found, conversation_id, "conversation")

    def append_ended(self, response: dict[str, Any], project: str, input_items: list[dict[str, Any]]) -> None:
        """Blocking: append a response's input items and output to its conversation, if it has one and ended
        with output. A conversation deleted meanwhile gets nothing."""
        conversation = response.get("conversation")
        if not conversation or response.get("status") not in ENDED_WITH_OUTPUT:
            return
        self.store.add_items(conversation["id"], project, [*input_items, *response.get("output", [])])
