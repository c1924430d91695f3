"""Cursor pages over a table, as OpenAI's list endpoints return them: `limit` rows after the row `after`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import ColumnElement, Connection, Table, select

Order = Literal["asc", "desc"]


@dataclass(frozen=True)
class Page:
    rows: list[Any]
    has_more: bool


class UnknownCursorError(LookupError):
    """`after` names no row of the table (so the page has no place to start)."""


def page(
    connection: Connection,
    table: Table,
    limit: int,
    after: str | None,
    order: Order,
    where: list[ColumnElement[bool]] | None = None,
    scope: list[ColumnElement[bool]] | None = None,
    key: ColumnElement[Any] | None = None,
) -> Page:
    """Rows ordered by insertion (`pk`), newest first for "desc", starting after the row whose `key` (default: its
    `id`) is `after`. Rows meet `where` and `scope`; the `after` row must meet `scope` (a caller's project) too."""
    conditions = [*(where or []), *(scope or [])]
    if after is not None:
        anchor = connection.execute(
            select(table.c.pk).where((table.c.id if key is None else key) == after, *(scope or []))
        ).scalar_one_or_none()
        if anchor is None:
            raise UnknownCursorError(after)
        conditions.append(table.c.pk < anchor if order == "desc" else table.c.pk > anchor)
    key = table.c.pk.desc() if order == "desc" else table.c.pk.asc()
    rows = list(connection.execute(select(table).where(*conditions).order_by(key).limit(limit + 1)))
    return Page(rows[:limit], len(rows) > limit)
