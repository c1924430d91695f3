"""Per-project rate limits: the file's format and errors, the shared per-minute counts (SQLite and PostgreSQL; two
admits racing for the last slot cannot both take it), and the limiter's headers, 429s and corrections."""

from __future__ import annotations

import asyncio
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import Engine

from gateway.errors import APIError
from gateway.rate_limits import (
    DEFAULT_OUTPUT_RESERVE,
    ProjectLimits,
    RateLimiter,
    RateLimits,
    RateLimitsFileError,
    parse_limits,
)
from gateway.store.rate_windows import RateWindowStore
from gateway.store.usage import UsageStore

MINUTE = 1_800_000_000 // 60 * 60


def test_the_file_format() -> None:
    text = "# limits\nalpha requests_per_minute=10 tokens_per_minute=5000\n* requests_per_minute=100  # others\n" \
           "beta batch_tokens_per_day=1000000\n"
    assert parse_limits(text, "f") == {"alpha": ProjectLimits(10, 5000), "*": ProjectLimits(100),
                                       "beta": ProjectLimits(batch_tokens_per_day=1_000_000)}


@pytest.mark.parametrize(("text", "reason"), [
    ("alpha rpm=10\n", "expected NAME=N"),
    ("alpha requests_per_minute=0\n", "expected NAME=N"),
    ("alpha requests_per_minute=ten\n", "expected NAME=N"),
    ("alpha\n", "has no limits"),
    ("alpha requests_per_minute=1\nalpha tokens_per_minute=1\n", "again"),
])
def test_a_malformed_line_is_named(text: str, reason: str) -> None:
    with pytest.raises(RateLimitsFileError, match=reason):
        parse_limits(text, "limits.txt")


def test_star_covers_the_projects_not_named_and_reload_keeps_good_limits(tmp_path: Path) -> None:
    path = tmp_path / "limits"
    path.write_text("alpha requests_per_minute=1\n* requests_per_minute=7\n")
    limits = RateLimits(path)
    assert limits.of("alpha") == ProjectLimits(1) and limits.of("beta") == ProjectLimits(7)
    path.write_text("alpha bogus=1\n")
    assert not limits.reload() and limits.of("alpha") == ProjectLimits(1)
    path.write_text("alpha requests_per_minute=2\n")
    assert limits.reload() and limits.of("alpha") == ProjectLimits(2) and limits.of("beta") is None
    assert RateLimits(None).of("alpha") is None


def test_a_minute_admits_up_to_its_limits(store_db: Engine) -> None:
    store = RateWindowStore(store_db)
    assert [store.admit("alpha", MINUTE, 10, 2, None).admitted for _ in range(3)] == [True, True, False]
    assert store.admit("beta", MINUTE, 10, 2, None).admitted  # another project's minute
    assert store.admit("alpha", MINUTE + 60, 10, 2, None).admitted  # the next minute starts afresh
    tokens = [store.admit("gamma", MINUTE, 40, None, 100) for _ in range(3)]
    assert [t.admitted for t in tokens] == [True, True, False] and tokens[-1].tokens == 80
    store.settle("gamma", MINUTE, -75)  # the two used 5 tokens in all
    assert store.admit("gamma", MINUTE, 40, None, 100).tokens == 45


def test_racing_admits_never_pass_the_limit(store_db: Engine) -> None:
    store = RateWindowStore(store_db)
    with ThreadPoolExecutor(8) as pool:
        admitted = list(pool.map(lambda _: store.admit("alpha", MINUTE, 1, 5, None).admitted, range(40)))
    assert sum(admitted) == 5


def test_the_limiter_sets_headers_refuses_and_settles(store_db: Engine, tmp_path: Path) -> None:
    path = tmp_path / "limits"
    path.write_text("alpha requests_per_minute=2 tokens_per_minute=3000\n")
    limiter = RateLimiter(RateLimits(path), clock=lambda: MINUTE + 30.0)
    limiter.open(RateWindowStore(store_db), UsageStore(store_db))

    async def run() -> None:
        state = types.SimpleNamespace()
        assert await limiter.admit(state, "beta", 400, 10) is None and not vars(state)  # no limits: nothing
        first = await limiter.admit(state, "alpha", 400, 10)
        assert first is not None and first.reserved == 110
        assert state.ratelimit_headers["x-ratelimit-remaining-requests"] == "1"
        assert state.ratelimit_headers["x-ratelimit-remaining-tokens"] == str(3000 - 110)
        first.settle(20)
        await asyncio.sleep(0.2)  # the correction runs in the background
        second = await limiter.admit(state, "alpha", 0, None)
        assert second is not None and second.reserved == DEFAULT_OUTPUT_RESERVE
        assert state.ratelimit_headers["x-ratelimit-remaining-tokens"] == str(3000 - 20 - DEFAULT_OUTPUT_RESERVE)
        with pytest.raises(APIError) as refused:
            await limiter.admit(state, "alpha", 0, 1)
        error = refused.value
        assert error.status == 429 and error.code == "rate_limit_exceeded" and error.type == "requests"
        assert error.headers["retry-after"] == "30" and error.headers["x-ratelimit-remaining-requests"] == "0"
        assert error.headers["x-ratelimit-reset-requests"] == "30s"
        with pytest.raises(APIError, match="Request too large"):
            await limiter.admit(state, "alpha", 0, 5000)

    asyncio.run(run())
