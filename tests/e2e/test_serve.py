"""`ladle serve` (what `make serve` runs): engine + gateway from one command answer the OpenAI SDK, and SIGTERM
stops both with status 0."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.e2e.gateway_process import start_serve

pytestmark = pytest.mark.slow


def test_ladle_serve_answers_a_chat_completion(tmp_path: Path) -> None:
    gateway, lines = start_serve(tmp_path / "serve.log")
    try:
        assert any(line.startswith("ladle serve: engine (gRPC") for line in lines), lines
        assert lines[-1].startswith("ladle serve: ready, model SmolLM2-135M-Instruct"), (lines, gateway.log())
        with openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0) as client:
            reply = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8,
            )
        assert reply.choices[0].message.content
    finally:
        assert gateway.stop() == 0, gateway.log()
