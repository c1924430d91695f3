"""Qwen3.5 served end to end: `ladle serve` on a small random Qwen3.5 (tests/families.py) with 4 seats, so 4
linear-attention state slots. Through the official OpenAI SDK, greedy completions of 8 prompts sent at once (half of
them waiting for a seat, then a slot another request left) equal the offline engine's; a stream dropped after its
first chunks gives its slot back to the requests after it; a chat completion runs through the model's template."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from engine_server import LLM, SamplingParams
from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
from tests.e2e.gateway_process import start_serve
from tests.families import save_family
from tests.unit.test_hybrid_engines import prompts

pytestmark = pytest.mark.slow

MAX_TOKENS = 12


def offline_texts(folder: Path, batch: list[list[int]]) -> list[str]:
    """The offline engine's greedy completions of `batch` on the float path (what `ladle serve` runs on a folder)."""
    config = EngineConfig(
        model=str(folder), device="cpu", quantization="none", cache=CacheConfig(memory_bytes=64 * 1024**2),
        scheduler=SchedulerConfig(max_num_seqs=4),
    )  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(config=config) as llm:
        return [result.choices[0].text for result in llm.generate(batch, greedy, use_tqdm=False)]


def test_concurrent_completions_a_dropped_stream_and_a_chat(tmp_path: Path) -> None:
    folder = save_family(tmp_path / "qwen3.5", "qwen3.5")
    batch = prompts()
    theirs = offline_texts(folder, batch)
    gateway, _ = start_serve(tmp_path / "serve.log", "--model", str(folder), "--max-num-seqs", "4")
    try:
        with openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=300) as client:
            model = client.models.list().data[0].id
            stream = client.completions.create(model=model, prompt=batch[3], max_tokens=500, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            for count, _ in enumerate(stream):
                if count == 2:
                    break
            stream.close()

            def complete(prompt: list[int]) -> str:
                reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                  extra_body={"ignore_eos": True})  # fmt: skip
                return reply.choices[0].text

            with ThreadPoolExecutor(len(batch)) as pool:
                assert list(pool.map(complete, batch)) == theirs
            chat = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
            )
            assert chat.choices[0].finish_reason in ("stop", "length")
            assert chat.usage is not None and chat.usage.prompt_tokens > 0
    finally:
        assert gateway.stop() == 0, gateway.log()
