"""GGUF files of the newer families as llama.cpp writes them (its tensor names, metadata and quantization types,
written with the `gguf` package): Phi-3 with partial rotary and LongRoPE. Converted, its float path equals
transformers on the converted folder token for token; served from its own 4- and 8-bit blocks (`--quantization
auto`), it holds `ladle bench quality`'s thresholds against that float path."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from benchmarks.quality import compare, greedy_sequences, make_llm, reference_log_probs
from engine_server.layers.quantized_linear import QuantizedLinear
from engine_server.loader import resolve_model
from tests.families import save_family, write_gguf
from tests.unit.test_family_engines import NUM_TOKENS, engine, prompts, reference_tokens, tokens

pytestmark = pytest.mark.slow  # engines, conversions and transformers' models of their own

QUALITY_PROMPTS = ("The capital of France is", "Write a haiku about rain.", "def fibonacci(n):", "1, 2, 3, 4,")


@pytest.fixture(scope="module")
def phi3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("phi3-gguf")
    folder = save_family(root / "hf", "phi3-longrope")
    return write_gguf(folder, root / "phi3.gguf", GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0)


def test_the_converted_phi3_gguf_is_exact_on_the_float_path(phi3_gguf: Path, tmp_path: Path) -> None:
    source = resolve_model(str(phi3_gguf))
    config = source.config
    assert (config.architecture, config.rotary_dim, config.head_dim) == ("phi3", 12, 16)
    with engine(phi3_gguf) as llm:
        assert tokens(llm, prompts()) == reference_tokens(source.path)


def test_phi3_served_from_its_blocks_holds_the_quality_thresholds(phi3_gguf: Path) -> None:
    reference = make_llm(str(phi3_gguf), "none")
    sequences = greedy_sequences(reference, QUALITY_PROMPTS, NUM_TOKENS)
    log_probs = reference_log_probs(reference, sequences)
    reference.close()
    candidate = make_llm(str(phi3_gguf), "auto")
    model = candidate.core.runner.model
    layers = {name: m.format for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    result = compare(log_probs, candidate, "gguf", QUALITY_PROMPTS, NUM_TOKENS, sequences, free_running=False)
    candidate.close()
    # Every projection from the file's blocks, the fused q/k/v and gate/up included; the LM head stays float
    # (F32 in the file).
    assert layers["model.layers.0.self_attn.qkv_proj"] == "q8" and layers["model.layers.3.mlp.gate_up_proj"] == "q4"
    assert len(layers) == 4 * 4, sorted(layers)
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, result
