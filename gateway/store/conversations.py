"""Conversations of the Conversations API: a project's conversations, their metadata, and their items in the order
they were added.

Every call takes the project: another project's conversation is as unknown as a made-up id. An item keeps the id
it comes with unless its conversation already holds that id (then it gets a new one, `new_item_id`), so an item id
names one item of a conversation. Deleting a conversation deletes its items.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, delete, insert, select, update

from gateway.store.pages import Order, UnknownCursorError, page
from gateway.store.tables import conversation_items, conversations


@dataclass(frozen=True)
class ConversationRecord:
    id: str
    project: str
    created_at: int
    metadata: dict[str, str]

    def body(self) -> dict[str, Any]:
        """The Conversation object as the API returns it."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}

    @classmethod
    def from_row(cls, row: Any) -> ConversationRecord:
        return cls(row.id, row.project, row.created_at, json.loads(row.metadata_json))


@dataclass(frozen=True)
class ItemPage:
    items: list[dict[str, Any]]
    has_more: bool


class UnknownItemError(LookupError):
    """The conversation holds no item with that id."""


class ConversationStore:
    """Conversations and their items in the database. Blocking calls: run them off the event loop."""

    def __init__(self, db: Engine, new_item_id: Callable[[str], str]) -> None:
        """`new_item_id(type)`: a fresh id for an item of that type, given to an item whose id is taken."""
        self.db = db
        self.new_item_id = new_item_id

    def create(self, conversation_id: str, project: str, created_at: int, metadata: dict[str, str],
               items: Sequence[dict[str, Any]]) -> ConversationRecord:
        with self.db.begin() as c:
            c.execute(insert(conversations).values(
                id=conversation_id, project=project, created_at=created_at, metadata_json=json.dumps(metadata),
            ))
            self._add(c, self._row(c, conversation_id, project).pk, items)
        return ConversationRecord(conversation_id, project, created_at, dict(metadata))

    def get(self, conversation_id: str, project: str) -> ConversationRecord | None:
        with self.db.connect() as c:
            row = self._row(c, conversation_id, project)
        return ConversationRecord.from_row(row) if row is not None else None

    def update_metadata(self, conversation_id: str, project: str, metadata: dict[str, str]
                        ) -> ConversationRecord | None:
        with self.db.begin() as c:
            c.execute(update(conversations).where(conversations.c.id == conversation_id,
                                                  conversations.c.project == project)
                      .values(metadata_json=json.dumps(metadata)))
            row = self._row(c, conversation_id, project)
        return ConversationRecord.from_row(row) if row is not None else None

    def delete(self, conversation_id: str, project: str) -> bool:
        """Delete the conversation and its items; False if the project has no such conversation."""
        with self.db.begin() as c:
            row = self._row(c, conversation_id, project)
            if row is None:
                return False
            c.execute(delete(conversation_items).where(conversation_items.c.conversation_pk == row.pk))
            c.execute(delete(conversations).where(conversations.c.pk == row.pk))
        return True

    def add_items(self, conversation_id: str, project: str, items: Sequence[dict[str, Any]]
                  ) -> list[dict[str, Any]] | None:
        """Append `items` (in order) and return them as stored; None if the project has no such conversation."""
        with self.db.begin() as c:
            row = self._row(c, conversation_id, project)
            if row is None:
                return None
            return self._add(c, row.pk, items)

    def items(self, conversation_id: str, project: str) -> list[dict[str, Any]] | None:
        """Every item, oldest first; None if the project has no such conversation."""
        with self.db.connect() as c:
            row = self._row(c, conversation_id, project)
            if row is None:
                return None
            found = c.execute(select(conversation_items.c.item_json)
                              .where(conversation_items.c.conversation_pk == row.pk)
                              .order_by(conversation_items.c.pk)).scalars()
            return [json.loads(text) for text in found]

    def item_page(self, conversation_id: str, project: str, limit: int, after: str | None, order: Order
                  ) -> ItemPage | None:
        """Up to `limit` items after the item `after` (oldest first for "asc"); None if the project has no such
        conversation; UnknownItemError if `after` is none of its items."""
        with self.db.connect() as c:
            row = self._row(c, conversation_id, project)
            if row is None:
                return None
            try:
                found = page(c, conversation_items, limit, after, order, key=conversation_items.c.item_id,
                             scope=[conversation_items.c.conversation_pk == row.pk])
            except UnknownCursorError:
                raise UnknownItemError(after) from None
        return ItemPage([json.loads(r.item_json) for r in found.rows], found.has_more)

    def item(self, conversation_id: str, project: str, item_id: str) -> dict[str, Any] | None:
        """The item; None if the project has no such conversation; UnknownItemError if it holds no such item."""
        with self.db.connect() as c:
            row = self._row(c, conversation_id, project)
            if row is None:
                return None
            text = c.execute(select(conversation_items.c.item_json)
                             .where(conversation_items.c.conversation_pk == row.pk,
                                    conversation_items.c.item_id == item_id)).scalar_one_or_none()
        if text is None:
            raise UnknownItemError(item_id)
        item: dict[str, Any] = json.loads(text)
        return item

    def delete_item(self, conversation_id: str, project: str, item_id: str) -> ConversationRecord | None:
        """Delete one item and return its conversation; None if the project has no such conversation;
        UnknownItemError if it holds no such item."""
        with self.db.begin() as c:
            row = self._row(c, conversation_id, project)
            if row is None:
                return None
            deleted = c.execute(delete(conversation_items).where(conversation_items.c.conversation_pk == row.pk,
                                                                 conversation_items.c.item_id == item_id))
            if deleted.rowcount == 0:
                raise UnknownItemError(item_id)
        return ConversationRecord.from_row(row)

    def _row(self, c: Connection, conversation_id: str, project: str) -> Any:
        return c.execute(select(conversations).where(conversations.c.id == conversation_id,
                                                     conversations.c.project == project)).one_or_none()

    def _add(self, c: Connection, conversation_pk: int, items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        if not items:
            return []
        wanted = [str(item["id"]) for item in items]
        taken = set(c.execute(select(conversation_items.c.item_id)
                              .where(conversation_items.c.conversation_pk == conversation_pk,
                                     conversation_items.c.item_id.in_(wanted))).scalars())
        stored = []
        for item in items:
            if item["id"] in taken:
                item = dict(item, id=self.new_item_id(str(item.get("type", "message"))))
            taken.add(item["id"])
            stored.append(item)
        c.execute(insert(conversation_items), [
            {"conversation_pk": conversation_pk, "item_id": item["id"], "item_json": json.dumps(item)}
            for item in stored
        ])
        return stored
