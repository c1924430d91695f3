"""`AdapterStore` on SQLite and PostgreSQL: loads recorded by name in load order, a load of a name again replacing
its folder, an unload forgetting it."""

from __future__ import annotations

from sqlalchemy import Engine

from gateway.store.adapters import AdapterStore


def test_loads_are_recorded_by_name_and_unloads_forgotten(store_db: Engine) -> None:
    store = AdapterStore(store_db)
    store.record("sql", "/adapters/sql", 100)
    store.record("chat", "/adapters/chat", 101)
    store.record("sql", "/adapters/sql-v2", 102)  # loaded again from another folder
    assert store.loaded() == {"chat": "/adapters/chat", "sql": "/adapters/sql-v2"}
    store.forget("chat")
    store.forget("never-loaded")
    assert store.loaded() == {"sql": "/adapters/sql-v2"}
