"""Speculative decoding end to end: an engine started with --speculative-config answers exactly what the shared
engine without it answers, through the gateway (the official SDK, the benchmark's workloads, streaming, stop
strings, structured outputs, the batched chat route and its Batch RPC), and reports its drafts on the gateway's
/metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from benchmarks.speculative import make_prompt
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway

PASSAGE = (
    "The river runs through the old town, past the mill and the market square, where farmers sell apples, cheese "
    "and bread every Saturday morning. In winter the water freezes near the banks, and children skate on the thin "
    "ice while their parents watch from the bridge. The mill has not turned for forty years, but the town keeps its "
    "wheel painted red, and tourists photograph it from the far bank every summer."
)
PROMPTS = [
    f"Repeat the following text word for word, changing 'red' to 'blue':\n\n{PASSAGE}",
    f"Fix the spelling and return the full text:\n\n{PASSAGE.replace('market', 'markit')}",
    "Write a short poem about the sea.",
]
SPEC = '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4}'


@pytest.fixture(scope="module")
def spec_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    process = start_engine(tmp_path_factory.mktemp("spec") / "engine.log", "--speculative-config", SPEC)
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def spec_gateway(spec_engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = start_gateway(tmp_path_factory.mktemp("spec-gw") / "gateway.log", spec_engine.address)
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def spec_client(spec_gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=spec_gateway.base_url, api_key="unused", max_retries=0, timeout=300) as client:
        yield client


def _chat(client: openai.OpenAI, model: str, prompt: str, **kwargs: object) -> str:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=64, **kwargs
    )
    return reply.choices[0].message.content or ""


def test_greedy_chat_is_the_same_with_speculation(
    spec_client: openai.OpenAI, openai_client: openai.OpenAI, model_id: str, spec_gateway: GatewayProcess
) -> None:
    for prompt in PROMPTS:
        assert _chat(spec_client, model_id, prompt) == _chat(openai_client, model_id, prompt)
    metrics = httpx.get(f"{spec_gateway.url}/metrics", timeout=30).text
    accepted = [line for line in metrics.splitlines() if line.startswith("ladle_engine_speculative_accepted_tokens")]
    assert accepted and float(accepted[0].rsplit(" ", 1)[1]) > 0  # the copying prompts kept drafts
    assert "ladle_engine_speculative_kept_drafts_bucket" in metrics


@pytest.mark.parametrize("workload", ["editing", "summarization", "random"])
def test_the_benchmark_workloads_are_the_same(
    spec_client: openai.OpenAI, openai_client: openai.OpenAI, model_id: str, workload: str
) -> None:
    """One prompt of each of `ladle bench speculative`'s greedy workloads: chat for the passages, token ids through
    the completions route for the random one."""
    prompt = make_prompt(workload, "e2e")
    if isinstance(prompt, str):
        assert _chat(spec_client, model_id, prompt) == _chat(openai_client, model_id, prompt)
        return

    def completion(client: openai.OpenAI) -> str:
        reply = client.completions.create(model=model_id, prompt=prompt, temperature=0, max_tokens=64)
        return reply.choices[0].text

    assert completion(spec_client) == completion(openai_client)


def test_streamed_text_and_a_stop_string_inside_a_run_are_the_same(
    spec_client: openai.OpenAI, openai_client: openai.OpenAI, model_id: str
) -> None:
    prompt = PROMPTS[0]
    full = _chat(openai_client, model_id, prompt)
    stream = spec_client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=64, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == full
    stop = full[60:68]  # inside the copied passage: most likely inside a run of kept drafts
    assert _chat(spec_client, model_id, prompt, stop=[stop]) == full[: full.index(stop)]


def test_structured_output_is_the_same_and_parses(
    spec_client: openai.OpenAI, openai_client: openai.OpenAI, model_id: str
) -> None:
    schema = {
        "type": "object",
        "properties": {"town": {"type": "string", "maxLength": 40}, "colour": {"type": "string", "maxLength": 12}},
        "required": ["town", "colour"],
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "mill", "schema": schema}}
    prompt = f"{PASSAGE}\n\nAnswer in JSON: what is the town like, and what colour is the wheel?"
    ours = _chat(spec_client, model_id, prompt, response_format=response_format)
    assert ours == _chat(openai_client, model_id, prompt, response_format=response_format)
    assert set(json.loads(ours)) == {"town", "colour"}


def test_the_batched_chat_route_is_the_same(
    spec_gateway: GatewayProcess, gateway: GatewayProcess, model_id: str
) -> None:
    body = {
        "model": model_id,
        "messages": [[{"role": "user", "content": prompt}] for prompt in PROMPTS],
        "temperature": 0,
        "max_tokens": 64,
    }

    def texts(url: str) -> list[str]:
        reply = httpx.post(f"{url}/v1/chat/completions/batch", json=body, timeout=300)
        reply.raise_for_status()
        return [choice["message"]["content"] for choice in reply.json()["choices"]]

    assert texts(spec_gateway.url) == texts(gateway.url)


def test_the_engine_logs_its_drafts(spec_engine: EngineProcess, spec_client: openai.OpenAI, model_id: str) -> None:
    _chat(spec_client, model_id, PROMPTS[1])
    lines = [json.loads(line) for line in spec_engine.log().splitlines() if line.startswith("{")]
    logged = [line for line in lines if line.get("event") == "speculative decoding"]
    assert logged and logged[0]["method"] == "ngram" and logged[0]["proposed"] > 0
