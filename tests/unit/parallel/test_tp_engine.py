"""Offline `LLM(tensor_parallel_size=N)` on the embedded model: what tensor parallelism refuses, and says so at
configuration, before any worker starts. Quantized weights are not sharded yet: `gguf` and `int8` are refused
with a message naming the way out, and `auto` serves a GGUF file unquantized under tensor parallelism.
"""

from __future__ import annotations

import pytest
import torch

from engine_server.config import EngineConfig, SpeculativeConfig
from engine_server.llm import LLM
from engine_server.loader import resolve_model
from engine_server.quantization import resolve_quantization

pytestmark = pytest.mark.slow


def test_quantized_weights_are_refused_under_tensor_parallelism_and_auto_serves_floats() -> None:
    source = resolve_model("default")
    cpu = torch.device("cpu")
    for mode in ("gguf", "int8"):
        with pytest.raises(ValueError, match=f"--quantization {mode}: quantized weights are not sharded under"):
            resolve_quantization(mode, source, cpu, torch.float32, kernels=True, tp_size=3)
    assert resolve_quantization("auto", source, cpu, torch.float32, kernels=True, tp_size=3) == "none"
    assert resolve_quantization("auto", source, cpu, torch.float32, kernels=True, tp_size=1) == "gguf"


def test_what_tensor_parallelism_refuses_is_said_at_configuration() -> None:
    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="speculative decoding does not run under --tensor-parallel-size > 1"):
        EngineConfig(tensor_parallel_size=2, speculative=SpeculativeConfig(method="ngram"))
    # The embedded model's 9 query heads do not split over 2 ranks: said before any worker starts.
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(9\) must be divisible by the tensor-parallel size \(2\)"
    ):
        LLM(config=EngineConfig(model="default", device="cpu", tensor_parallel_size=2))
