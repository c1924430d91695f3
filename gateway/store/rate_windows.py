"""The per-minute counts behind the rate limits, shared by every gateway on the database.

`admit` counts a request and its reserved tokens into its project's current minute only if that keeps the minute
within the limits, in one transaction (the row is created first if missing, then a conditional UPDATE: two
replicas admitting at once cannot both take the last slot). `settle` corrects the tokens once the actual count is
known. Rows of minutes long past are deleted as new minutes start.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, delete, select, update
from sqlalchemy.dialects import postgresql, sqlite

from gateway.store.tables import rate_windows

KEEP_S = 300  # minutes older than this are deleted when a project's next minute begins


@dataclass(frozen=True)
class WindowCounts:
    """A minute's counts after an `admit`: whether the request was admitted, and the minute's totals."""

    admitted: bool
    requests: int
    tokens: int


class RateWindowStore:
    """Per-minute counts in the database. Blocking calls: run them off the event loop."""

    def __init__(self, db: Engine) -> None:
        self.db = db

    def admit(self, project: str, window: int, tokens: int, max_requests: int | None,
              max_tokens: int | None) -> WindowCounts:
        """Count one request reserving `tokens` in `project`'s minute `window`, unless that takes the minute past
        `max_requests` or `max_tokens` (None: no limit)."""
        dialect = postgresql if self.db.dialect.name == "postgresql" else sqlite
        table = rate_windows
        with self.db.begin() as c:
            created = c.execute(dialect.insert(table).values(project=project, minute=window, requests=0, tokens=0)
                                .on_conflict_do_nothing()).rowcount
            if created:
                c.execute(delete(table).where(table.c.project == project, table.c.minute < window - KEEP_S))
            conditions = [table.c.project == project, table.c.minute == window]
            if max_requests is not None:
                conditions.append(table.c.requests + 1 <= max_requests)
            if max_tokens is not None:
                conditions.append(table.c.tokens + tokens <= max_tokens)
            admitted = c.execute(update(table).where(*conditions).values(
                requests=table.c.requests + 1, tokens=table.c.tokens + tokens)).rowcount == 1
            row = c.execute(select(table.c.requests, table.c.tokens)
                            .where(table.c.project == project, table.c.minute == window)).one()
        return WindowCounts(admitted, row.requests, row.tokens)

    def settle(self, project: str, window: int, tokens_delta: int) -> None:
        """Correct a minute's tokens by what a request used beyond (or short of) what it reserved."""
        with self.db.begin() as c:
            c.execute(update(rate_windows)
                      .where(rate_windows.c.project == project, rate_windows.c.minute == window)
                      .values(tokens=rate_windows.c.tokens + tokens_delta))
