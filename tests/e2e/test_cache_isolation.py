"""Prefix-cache isolation against the real engine: requests share cached prompt blocks only within one cache salt.

Over gRPC: a Generate (or Stream) with another `cache_salt` than the request that filled the cache reports
`cached_prompt_tokens` 0; with the same salt it hits. Over HTTP, through a gateway with two projects' keys: project
B's chat with project A's long system prompt reports `cached_tokens` 0 and is no faster to its first token than a
cold prompt, while A's own repeat hits its cache and is clearly faster (TTFT medians over five rounds, compared as
ratios with wide margins: the test runs beside others on busy cores, so no absolute time is asserted).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.e2e.engine_process import EngineProcess
from tests.e2e.gateway_process import GatewayProcess, start_gateway

pytestmark = pytest.mark.slow

WORDS = ("ledger", "invoice", "account", "balance", "quarter", "revenue", "audit", "margin", "forecast", "payroll",
         "budget", "expense", "asset", "liability", "equity", "reconcile", "accrual", "deferred", "statement")
ROUNDS = 5


def long_prefix(seed: int, words: int = 300) -> str:
    """A system prompt of a few hundred tokens, distinct from its first words on (so it shares no block with any
    other prompt of the session)."""
    rng = random.Random(seed)
    return f"Session {seed}. You assist the accounts team. " + " ".join(rng.choice(WORDS) for _ in range(words))


def generate(stub: engine_pb2_grpc.EngineServiceStub, text: str, salt: str) -> engine_pb2.GenerateResponse:
    request = engine_pb2.GenerateRequest(
        input=types_pb2.Input(text=text), sampling=types_pb2.SamplingParams(max_tokens=1, temperature=0.0),
        cache_salt=salt,
    )
    response: engine_pb2.GenerateResponse = stub.Generate(request, timeout=120)
    return response


def test_grpc_requests_share_cached_blocks_only_with_the_same_salt(stub: engine_pb2_grpc.EngineServiceStub) -> None:
    text = long_prefix(random.randrange(1 << 30)) + " What is the balance?"
    first = generate(stub, text, "tenant-a")
    assert first.usage.prompt_tokens > 300 and first.usage.cached_prompt_tokens == 0
    assert generate(stub, text, "tenant-b").usage.cached_prompt_tokens == 0  # another salt: nothing shared
    assert generate(stub, text, "").usage.cached_prompt_tokens == 0  # nor with the unsalted namespace
    again = generate(stub, text, "tenant-a")
    assert again.usage.cached_prompt_tokens >= first.usage.prompt_tokens - 16  # all but the last partial block
    stream = engine_pb2.StreamRequest(
        input=types_pb2.Input(text=text), sampling=types_pb2.SamplingParams(max_tokens=1, temperature=0.0),
        cache_salt="tenant-b",
    )
    usage = [m.usage for m in stub.Stream(stream, timeout=120) if m.HasField("usage")]
    assert usage and usage[-1].cached_prompt_tokens == again.usage.cached_prompt_tokens  # b's own hit, now


def test_a_salt_longer_than_the_limit_is_refused(stub: engine_pb2_grpc.EngineServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        generate(stub, "Hello", "s" * 1025)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in (refused.value.details() or "")


# -- through the gateway, two projects ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_projects(engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("cache-isolation")
    keys = tmp / "keys"
    keys.write_text("sk-alpha alpha\nsk-beta beta\n")
    gateway = start_gateway(tmp / "gateway.log", engine.address, "--api-keys-file", str(keys))
    yield gateway
    assert gateway.stop() == 0


def chat(client: openai.OpenAI, model: str, system: str, question: str) -> tuple[float, int]:
    """Streams one chat; (seconds to the first content chunk, cached prompt tokens)."""
    started = time.perf_counter()
    first: float | None = None
    cached = -1
    stream = client.chat.completions.create(
        model=model, max_tokens=2, temperature=0.0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
            first = time.perf_counter() - started
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            cached = details.cached_tokens or 0 if details is not None else 0
            assert chunk.usage.prompt_tokens > 300
    assert first is not None and cached >= 0
    return first, cached


def test_a_project_gets_no_cache_hit_and_no_faster_first_token_from_another_projects_prompt(
    two_projects: GatewayProcess, tmp_path: Path
) -> None:
    alpha, beta = (openai.OpenAI(base_url=two_projects.base_url, api_key=key, max_retries=0, timeout=120)
                   for key in ("sk-alpha", "sk-beta"))
    model = alpha.models.list().data[0].id
    seed = random.randrange(1 << 30)
    chat(alpha, model, long_prefix(seed - 1), "Warm up.")  # the first request of a process pays for lazy set-up
    cold_a, warm_a, cold_b, other_b = [], [], [], []
    for round_ in range(ROUNDS):
        shared = long_prefix(seed + 2 * round_)
        ttft, cached = chat(alpha, model, shared, "What is the balance?")  # alpha fills the cache
        assert cached == 0
        cold_a.append(ttft)
        ttft, cached = chat(beta, model, shared, "Close the ledger.")  # beta, the same prefix: no hit
        assert cached == 0, f"round {round_}: beta saw {cached} of alpha's tokens cached"
        other_b.append(ttft)
        ttft, cached = chat(beta, model, long_prefix(seed + 2 * round_ + 1), "Close the ledger.")  # a cold one
        assert cached == 0
        cold_b.append(ttft)
        ttft, cached = chat(alpha, model, shared, "Close the ledger.")  # alpha again: its own cache
        assert cached > 300, f"round {round_}: alpha's repeat had {cached} cached tokens"
        warm_a.append(ttft)
    medians = {name: statistics.median(v) for name, v in
               (("cold_a", cold_a), ("warm_a", warm_a), ("cold_b", cold_b), ("other_b", other_b))}
    print("TTFT medians (s):", {k: round(v, 4) for k, v in medians.items()})
    # Alpha's own repeat is clearly faster than a cold prompt: the measurement can see a cache hit (measured on 2
    # cores busy with the rest of the suite: 0.08 s against 0.83 s)...
    assert medians["warm_a"] < 0.5 * medians["cold_a"], medians
    # ...and beta, sending alpha's prompt, is about as slow as a cold prompt of its own (0.74 s against 0.85 s;
    # with the fix undone, beta hit alpha's blocks): nothing to learn from timing.
    assert medians["other_b"] > 0.5 * medians["cold_b"], medians
