"""`ConversationStore` on SQLite and PostgreSQL: a conversation and its items belong to its project, items keep
their order and their ids (a taken id gets a new one), pages run both ways from an item, and deleting a
conversation deletes its items."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from gateway.store.conversations import ConversationStore, UnknownItemError
from gateway.store.tables import conversation_items


def message(item_id: str, text: str = "hi") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def store_on(db: Engine) -> ConversationStore:
    fresh = iter(f"msg_new{i}" for i in range(100))
    return ConversationStore(db, lambda kind: next(fresh))


def test_a_conversation_and_its_items_belong_to_its_project(store_db: Engine) -> None:
    store = store_on(store_db)
    record = store.create("conv_a", "alpha", 100, {"topic": "demo"}, [message("msg_1"), message("msg_2")])
    assert record.body() == {"id": "conv_a", "object": "conversation", "created_at": 100,
                             "metadata": {"topic": "demo"}}
    assert store.get("conv_a", "beta") is None and store.items("conv_a", "beta") is None
    assert store.add_items("conv_a", "beta", [message("msg_x")]) is None and not store.delete("conv_a", "beta")
    assert store.item("conv_a", "beta", "msg_1") is None
    updated = store.update_metadata("conv_a", "alpha", {"topic": "other"})
    assert updated is not None and updated.metadata == {"topic": "other"}
    assert store.update_metadata("conv_a", "beta", {}) is None


def test_items_keep_their_order_and_a_taken_id_gets_a_new_one(store_db: Engine) -> None:
    store = store_on(store_db)
    store.create("conv_a", "alpha", 100, {}, [message("msg_1")])
    added = store.add_items("conv_a", "alpha", [message("msg_2"), message("msg_1", "again"), message("msg_2")])
    assert added is not None and [i["id"] for i in added] == ["msg_2", "msg_new0", "msg_new1"]
    items = store.items("conv_a", "alpha")
    assert items is not None and [i["id"] for i in items] == ["msg_1", "msg_2", "msg_new0", "msg_new1"]
    assert items[2]["content"][0]["text"] == "again"
    store.create("conv_b", "alpha", 100, {}, [message("msg_1")])  # another conversation may use the same id
    assert store.item("conv_b", "alpha", "msg_1") == message("msg_1")


def test_pages_run_both_ways_from_an_item(store_db: Engine) -> None:
    store = store_on(store_db)
    store.create("conv_a", "alpha", 100, {}, [message(f"msg_{i}") for i in range(5)])
    first = store.item_page("conv_a", "alpha", 2, None, "desc")
    assert first is not None and [i["id"] for i in first.items] == ["msg_4", "msg_3"] and first.has_more
    rest = store.item_page("conv_a", "alpha", 5, "msg_3", "desc")
    assert rest is not None and [i["id"] for i in rest.items] == ["msg_2", "msg_1", "msg_0"] and not rest.has_more
    forward = store.item_page("conv_a", "alpha", 2, "msg_1", "asc")
    assert forward is not None and [i["id"] for i in forward.items] == ["msg_2", "msg_3"] and forward.has_more
    with pytest.raises(UnknownItemError):
        store.item_page("conv_a", "alpha", 2, "msg_9", "asc")


def test_deleting_items_and_conversations(store_db: Engine) -> None:
    store = store_on(store_db)
    store.create("conv_a", "alpha", 100, {}, [message("msg_1"), message("msg_2")])
    store.create("conv_b", "alpha", 100, {}, [message("msg_1")])
    record = store.delete_item("conv_a", "alpha", "msg_1")
    assert record is not None and record.id == "conv_a"
    with pytest.raises(UnknownItemError):
        store.delete_item("conv_a", "alpha", "msg_1")
    with pytest.raises(UnknownItemError):
        store.item("conv_a", "alpha", "msg_1")
    assert store.delete("conv_a", "alpha") and store.get("conv_a", "alpha") is None
    assert not store.delete("conv_a", "alpha")
    with store_db.connect() as c:  # its items went with it; the other conversation's stay
        assert c.execute(select(func.count()).select_from(conversation_items)).scalar_one() == 1
