"""Per-project rate limits: requests and tokens per minute for the interactive routes, and a daily token budget
for batch jobs.

The rate limits file (`--rate-limits-file`, read again on SIGHUP like the keys file) holds one project a line:
`PROJECT requests_per_minute=N tokens_per_minute=N batch_tokens_per_day=N` (any of the three; `#` comments);
the project `*` gives the limits of every project not named. A project without limits pays nothing here.

A request to a model route (chat, completions, batched chat, responses, embeddings, score, rerank) is admitted by
`RateLimiter.admit` before it is sent on: it counts one request and reserves tokens (its body's size / 4 as the
prompt's estimate, the gateway holding no tokenizer, plus its output cap, or `DEFAULT_OUTPUT_RESERVE` without one)
in its project's current minute, in the database every gateway replica shares (`store.rate_windows`), so
replicas enforce one limit. Over a limit it is a 429 in OpenAI's shape with `retry-after`; every admitted
response carries `x-ratelimit-limit-requests`, `-remaining-requests`, `-reset-requests` and their token
equivalents. When the request ends (a stream too when its client leaves early) its reservation is corrected to
the tokens it actually used (`settle`). Batch
lines are not counted here; a project past its `batch_tokens_per_day` (summed from the usage table, as flushed)
cannot create a new batch that day (429), while the batches it has run on.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from gateway.errors import APIError
from gateway.store.rate_windows import RateWindowStore, WindowCounts
from gateway.store.usage import DAY_S, UsageStore, day_of

log = structlog.get_logger(__name__)

EVERY_PROJECT = "*"
MINUTE_S = 60
DEFAULT_OUTPUT_RESERVE = 1024  # tokens reserved for the output of a request that sets no cap
_FIELDS = ("requests_per_minute", "tokens_per_minute", "batch_tokens_per_day")


def times(cap: int | None, count: int) -> int | None:
    """The output cap of `count` outputs of at most `cap` tokens each (None: no cap)."""
    return cap * count if cap is not None else None


class RateLimitsFileError(ValueError):
    """The rate limits file cannot be read, or a line of it is malformed."""


@dataclass(frozen=True)
class ProjectLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    batch_tokens_per_day: int | None = None

    @property
    def per_minute(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


def parse_limits(text: str, source: str) -> dict[str, ProjectLimits]:
    """Project -> limits for the lines of a rate limits file (`source` names it in errors)."""
    limits: dict[str, ProjectLimits] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        project, *settings = line.split()
        if project in limits:
            raise RateLimitsFileError(f"{source}, line {number}: project {project!r} again")
        values: dict[str, int] = {}
        for setting in settings:
            name, _, value = setting.partition("=")
            if name not in _FIELDS or not value.isdigit() or int(value) < 1:
                raise RateLimitsFileError(f"{source}, line {number}: expected NAME=N (N >= 1) with NAME one of "
                                          f"{', '.join(_FIELDS)}; got {setting!r}")
            values[name] = int(value)
        if not values:
            raise RateLimitsFileError(f"{source}, line {number}: project {project!r} has no limits")
        limits[project] = ProjectLimits(**values)
    return limits


class RateLimits:
    """The limits in force, from the file (None: no limits at all); `reload` on SIGHUP keeps the old ones if the
    new file is bad."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._limits = self._read() if path is not None else {}

    def _read(self) -> dict[str, ProjectLimits]:
        assert self.path is not None
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RateLimitsFileError(f"cannot read the rate limits file {self.path}: {exc}") from None
        return parse_limits(text, str(self.path))

    def reload(self) -> bool:
        if self.path is None:
            return True
        try:
            self._limits = self._read()
        except RateLimitsFileError as exc:
            log.error("rate limits not reloaded; the previous ones stay in force", reason=str(exc))
            return False
        log.info("rate limits reloaded", projects=len(self._limits))
        return True

    def of(self, project: str) -> ProjectLimits | None:
        return self._limits.get(project) or self._limits.get(EVERY_PROJECT)


@dataclass(frozen=True)
class Admission:
    """A request counted in its project's minute, with the tokens it reserved; `settle` it when it ends."""

    limiter: RateLimiter
    project: str
    window: int
    reserved: int

    def settle(self, used_tokens: int) -> None:
        self.limiter.settle(self, used_tokens)


class RateLimiter:
    """Admits requests against their project's limits (see the module)."""

    def __init__(self, limits: RateLimits, clock: Callable[[], float] = time.time) -> None:
        self.limits = limits
        self.clock = clock
        self._windows: RateWindowStore | None = None
        self._usage: UsageStore | None = None
        self._settling: set[asyncio.Task[None]] = set()

    def open(self, windows: RateWindowStore, usage: UsageStore) -> None:
        self._windows, self._usage = windows, usage

    async def admit(self, state: Any, project: str, body_bytes: int, output_cap: int | None) -> Admission | None:
        """Count a request of `project` whose body had `body_bytes` and whose outputs may total `output_cap`
        tokens; None when the project has no per-minute limits. Sets the response's rate-limit headers on the
        request's `state`; 429 (APIError) over a limit."""
        limits = self.limits.of(project)
        if limits is None or not limits.per_minute or self._windows is None:
            return None
        reserve = body_bytes // 4 + (output_cap if output_cap is not None else DEFAULT_OUTPUT_RESERVE)
        if limits.tokens_per_minute is not None and reserve > limits.tokens_per_minute:
            raise APIError(429, f"Request too large for tokens per min (TPM): Limit {limits.tokens_per_minute}, "
                           f"Requested {reserve} (the prompt's estimate and the output cap). Lower max_tokens or "
                           "send a shorter prompt.", type="tokens", code="rate_limit_exceeded")
        now = self.clock()
        window = int(now) // MINUTE_S * MINUTE_S
        counts = await asyncio.to_thread(self._windows.admit, project, window, reserve, limits.requests_per_minute,
                                         limits.tokens_per_minute)
        headers = _headers(limits, counts, window + MINUTE_S - now)
        if not counts.admitted:
            raise _refusal(limits, counts, reserve, headers, window + MINUTE_S - now)
        state.ratelimit_headers = headers
        return Admission(self, project, window, reserve)

    def settle(self, admission: Admission | None, used_tokens: int) -> None:
        """Correct an admitted request's reservation to the tokens it used (in the background)."""
        if admission is None or self._windows is None or used_tokens == admission.reserved:
            return
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(
            self._windows.settle, admission.project, admission.window, used_tokens - admission.reserved))
        self._settling.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._settling.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("could not correct a rate-limit reservation", error=str(task.exception()))

    async def check_batch_budget(self, project: str) -> None:
        """429 if `project` has used its batch tokens for today (as flushed to the usage table)."""
        limits = self.limits.of(project)
        if limits is None or limits.batch_tokens_per_day is None or self._usage is None:
            return
        today = day_of(time.time())
        rows = await asyncio.to_thread(self._usage.rows, today, today + DAY_S, [project])
        used = sum(c.input_tokens + c.output_tokens for key, c in rows if key.kind == "batch")
        if used >= limits.batch_tokens_per_day:
            retry = today + DAY_S - int(time.time())
            raise APIError(429, f"Project {project} has used {used} of its {limits.batch_tokens_per_day} batch "
                           "tokens for today (UTC); new batches can be created tomorrow.", type="tokens",
                           code="rate_limit_exceeded", headers={"retry-after": str(retry)})


def _headers(limits: ProjectLimits, counts: WindowCounts, reset_s: float) -> dict[str, str]:
    reset = f"{math.ceil(reset_s)}s"
    headers: dict[str, str] = {}
    if limits.requests_per_minute is not None:
        headers |= {"x-ratelimit-limit-requests": str(limits.requests_per_minute),
                    "x-ratelimit-remaining-requests": str(max(0, limits.requests_per_minute - counts.requests)),
                    "x-ratelimit-reset-requests": reset}
    if limits.tokens_per_minute is not None:
        headers |= {"x-ratelimit-limit-tokens": str(limits.tokens_per_minute),
                    "x-ratelimit-remaining-tokens": str(max(0, limits.tokens_per_minute - counts.tokens)),
                    "x-ratelimit-reset-tokens": reset}
    return headers


def _refusal(limits: ProjectLimits, counts: WindowCounts, reserve: int, headers: dict[str, str],
             reset_s: float) -> APIError:
    retry = str(max(1, math.ceil(reset_s)))
    if limits.requests_per_minute is not None and counts.requests + 1 > limits.requests_per_minute:
        message = (f"Rate limit reached on requests per min (RPM): Limit {limits.requests_per_minute}, Used "
                   f"{counts.requests}, Requested 1. Please try again in {retry}s.")
        kind = "requests"
    else:
        message = (f"Rate limit reached on tokens per min (TPM): Limit {limits.tokens_per_minute}, Used "
                   f"{counts.tokens}, Requested {reserve}. Please try again in {retry}s.")
        kind = "tokens"
    return APIError(429, message, type=kind, code="rate_limit_exceeded", headers={**headers, "retry-after": retry})
