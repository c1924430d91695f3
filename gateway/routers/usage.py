"""`GET /v1/organization/usage/completions`: tokens used per day, in OpenAI's usage API shape, from the database
(every replica's counts; they survive restarts). A project's key sees its own project's usage; an admin key sees
every project's (`project_ids` narrows it, `group_by=project_id` splits it)."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from gateway.deps import Batches, IsAdmin, Project, require_api_key
from gateway.errors import APIError, invalid
from gateway.store.usage import DAY_S, UsageStore, day_of
from gateway.usage import GROUPS, completions_usage_page

router = APIRouter(dependencies=[Depends(require_api_key)])
UNIX_MAX = 2**40  # seconds: the year 36812, well within the database's 64-bit integers


@router.get("/v1/organization/usage/completions", response_model=None)
async def completions_usage(
    batches: Batches,
    project: Project,
    admin: IsAdmin,
    start_time: Annotated[int, Query(ge=0, le=UNIX_MAX)],
    end_time: Annotated[int | None, Query(ge=0, le=UNIX_MAX)] = None,
    bucket_width: str = "1d",
    project_ids: Annotated[list[str] | None, Query()] = None,
    models: Annotated[list[str] | None, Query()] = None,
    group_by: Annotated[list[str] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=31)] = 7,
    page: str | None = None,
) -> Any:
    if bucket_width != "1d":
        raise invalid("bucket_width must be 1d: usage is kept per day", "bucket_width")
    unknown = sorted(set(group_by or []) - set(GROUPS))
    if unknown:
        raise invalid(f"group_by takes {', '.join(GROUPS)}; not {', '.join(unknown)}", "group_by")
    if project_ids and not admin and set(project_ids) != {project}:
        raise APIError(403, "A project's key sees only its own project's usage; use an admin key for others.",
                       param="project_ids", code="permission_denied")
    projects: list[str] | None = [project]
    if admin:
        projects = project_ids or None  # None: every project
    if page is not None and not (page.isdigit() and int(page) <= UNIX_MAX):
        raise invalid("page must be the next_page of an earlier answer", "page")
    first = day_of(int(page)) if page is not None else day_of(start_time)
    end = day_of(end_time - 1) + DAY_S if end_time is not None else day_of(time.time()) + DAY_S
    if end <= first:
        raise invalid("end_time must be after start_time", "end_time")
    days = min(limit, (end - first) // DAY_S)
    stop = first + days * DAY_S
    rows = await asyncio.to_thread(UsageStore(batches.db).rows, first, stop, projects)
    if models:
        rows = [(key, counts) for key, counts in rows if key.model in models]
    return completions_usage_page(rows, first, days, group_by or [], stop if stop < end else None)
