"""Each newer family served from a folder transformers saved (the mixtures of experts Qwen3-MoE, Qwen2-MoE and
Mixtral, Gemma 4, Gemma 3 and Gemma 2 with their sliding windows and soft-caps, windowed Mistral, Phi-3 with partial
rotary and LongRoPE, Mamba with no attention at all): `ladle engine --model FOLDER --quantization none` behind
`ladle gateway`, through the official openai SDK, greedy as transformers decodes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ladle.client import EngineClient
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway
from tests.families import save_family
from tests.unit.test_family_engines import NUM_TOKENS, prompts, reference_tokens

# tests.families name: what GetModelInfo says
FAMILY_ARCHITECTURES = {
    "qwen3-moe": "qwen3_moe", "qwen2-moe": "qwen2_moe", "mixtral": "mixtral", "gemma3": "gemma3", "gemma2": "gemma2",
    "mistral-window": "llama", "phi3-longrope": "phi3", "olmoe": "olmoe", "gemma4": "gemma4", "llama4": "llama4",
    "mamba": "mamba",
}  # fmt: skip


@pytest.fixture(scope="module", params=list(FAMILY_ARCHITECTURES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, Path, EngineProcess, GatewayProcess]]:  # fmt: skip
    root = tmp_path_factory.mktemp(request.param)
    folder = save_family(root / "model", request.param)
    engine = start_engine(root / "engine.log", "--model", str(folder), "--quantization", "none", threads=1)
    gateway = start_gateway(root / "gateway.log", engine.address)
    yield request.param, folder, engine, gateway
    assert gateway.stop() == 0
    assert engine.stop() == 0


def test_the_openai_sdk_completes_as_transformers_greedy(
    served: tuple[str, Path, EngineProcess, GatewayProcess],
) -> None:
    from transformers import AutoTokenizer

    family, folder, engine, gateway = served
    with EngineClient(engine.address) as client:
        info = client.model_info()
    assert info.architecture == FAMILY_ARCHITECTURES[family]
    batch = prompts()
    theirs = reference_tokens(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key="unused")
    reply = sdk.completions.create(model=info.model_id, prompt=batch, max_tokens=NUM_TOKENS, temperature=0.0)
    texts = [choice.text for choice in sorted(reply.choices, key=lambda choice: choice.index)]
    assert texts == [tokenizer.decode(tokens) for tokens in theirs.of()]
    assert reply.usage is not None and reply.usage.completion_tokens == NUM_TOKENS * len(batch)
