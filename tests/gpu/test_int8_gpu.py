"""`--quantization int8` on a real GPU: the Triton weight-only kernel inside the engine, CUDA graphs included.

Skipped without CUDA (the kernel itself is checked against its reference through Triton's interpreter in
tests/unit/kernels/test_int8_linear_kernel.py). The reference here is the same bf16 model with every quantized
layer's weight replaced by its dequantized int8 value: the two then differ only in summation order, so they
must agree as the bf16-vs-fp32 test defines agreement (identical, or a near-tie at the first difference).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_server import LLM
from engine_server.config import EngineConfig
from engine_server.layers.quantized_linear import QuantizedLinear, quantize_q8
from ladle_kernels.reference import QUANT_GROUP
from tests.gpu.test_decode_graphs_gpu import GREEDY_AGREEMENT, GREEDY_WITH_LOGPROBS, MODEL, PROMPTS, _chat, _divergence

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _dequantized_reference() -> LLM:
    """The bf16 engine (eager: its weights are swapped after start-up) with int8's rounding of every weight."""
    llm = LLM(config=EngineConfig(model=MODEL, device="cuda", enforce_eager=True))
    with torch.no_grad():
        for module in llm.core.runner.model.modules():
            if type(module) is nn.Linear and module.in_features % QUANT_GROUP == 0:
                rounded = quantize_q8(module.weight).dequantize().to(module.weight.dtype)
                # A new parameter, not an in-place copy: a tied LM head must not change the embedding table,
                # which int8 keeps in bf16.
                module.weight = nn.Parameter(rounded, requires_grad=False)
    return llm


def test_gpu_int8_serves_with_graphs_and_agrees_with_its_dequantized_weights() -> None:
    int8 = LLM(config=EngineConfig(model=MODEL, device="cuda", quantization="int8"))
    runner = int8.core.runner
    assert runner.quantization == "int8" and runner.decode_graphs is not None
    quantized = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and all(m.qs.is_cuda and m.qs.dtype == torch.int8 for m in quantized)
    prompts = [_chat(p) for p in PROMPTS]
    ours = int8.generate(prompts, GREEDY_WITH_LOGPROBS, use_tqdm=False)
    del int8, runner, quantized
    torch.cuda.empty_cache()
    reference = _dequantized_reference().generate(prompts, GREEDY_WITH_LOGPROBS, use_tqdm=False)
    results = [_divergence(o.choices[0], r.choices[0]) for o, r in zip(ours, reference, strict=True)]
    identical = sum(i is None for i, _ in results)
    agreeing = sum(near for _, near in results)
    report = f"int8 GPU vs dequantized bf16: {identical}/{len(PROMPTS)} identical, {agreeing} agree: {results}"
    print(report)
    assert agreeing >= GREEDY_AGREEMENT * len(PROMPTS), report
