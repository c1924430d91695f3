"""Token usage per project, day, model and kind: added to in increments (several gateways may add to one row at
once) and read back in daily buckets for the usage endpoint.

`add` upserts every row's increments in one transaction (`INSERT … ON CONFLICT DO UPDATE SET n = n + excluded.n`,
which SQLite and PostgreSQL both run atomically), so two replicas flushing the same row never lose a count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.dialects import postgresql, sqlite

from gateway.store.tables import usage

DAY_S = 86_400
KINDS = ("interactive", "batch")


@dataclass(frozen=True)
class UsageKey:
    project: str
    day: int  # the UTC midnight that starts the day, in Unix seconds
    model: str
    kind: str  # one of KINDS


@dataclass
class UsageCounts:
    requests: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    def add(self, other: UsageCounts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def values(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def day_of(unix_s: float) -> int:
    return int(unix_s) // DAY_S * DAY_S


class UsageStore:
    """Usage rows in the database. Blocking calls: run them off the event loop."""

    def __init__(self, db: Engine) -> None:
        self.db = db

    def add(self, increments: Mapping[UsageKey, UsageCounts]) -> None:
        """Add every increment to its row (created when missing), all in one transaction."""
        if not increments:
            return
        dialect = postgresql if self.db.dialect.name == "postgresql" else sqlite
        with self.db.begin() as c:
            for key, counts in increments.items():
                values = counts.values()
                statement = dialect.insert(usage).values(project=key.project, day=key.day, model=key.model,
                                                         kind=key.kind, **values)
                c.execute(statement.on_conflict_do_update(
                    index_elements=["project", "day", "model", "kind"],
                    set_={name: getattr(usage.c, name) + getattr(statement.excluded, name) for name in values},
                ))

    def rows(self, start_day: int, end_day: int, projects: Sequence[str] | None) -> list[tuple[UsageKey, UsageCounts]]:
        """Every row from `start_day` up to (not including) `end_day`, of `projects` (None: all)."""
        query = select(usage).where(usage.c.day >= start_day, usage.c.day < end_day)
        if projects is not None:
            query = query.where(usage.c.project.in_(list(projects)))
        with self.db.connect() as c:
            found: list[Any] = list(c.execute(query.order_by(usage.c.day)))
        return [(UsageKey(r.project, r.day, r.model, r.kind),
                 UsageCounts(r.requests, r.input_tokens, r.cached_tokens, r.output_tokens, r.reasoning_tokens))
                for r in found]
