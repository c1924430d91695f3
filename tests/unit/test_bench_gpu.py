"""The GPU benchmark's arithmetic (workload, roofline) on hand-made numbers, and one tiny run on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import chart, gpu
from engine_server.layers.fp8_experts import Fp8Experts, quantize_fp8_experts
from engine_server.parallel.group import SINGLE
from engine_server.parallel.layers import ParallelExperts

pytestmark = pytest.mark.slow  # a tiny CPU run of the GPU benchmark


def test_the_nano_vllm_workload_is_seeded_and_in_range() -> None:
    workload = gpu.nano_vllm_workload(256, 100, 1024, seed=0)
    assert workload == gpu.nano_vllm_workload(256, 100, 1024, seed=0)
    assert len(workload.prompts) == len(workload.output_lens) == 256
    assert all(100 <= len(p) <= 1024 for p in workload.prompts)
    assert all(100 <= n <= 1024 for n in workload.output_lens)
    fixed = workload.with_fixed_output()
    assert fixed.prompts == workload.prompts and len(set(fixed.output_lens)) == 1
    assert abs(fixed.output_tokens - workload.output_tokens) <= 256


def test_roofline_counts_weights_once_per_step_and_the_kv_each_sequence_reads() -> None:
    workload = gpu.Workload(prompts=[[1, 2], [3]], output_lens=[3, 1])
    # Steps: 3. KV tokens read: seq 0 at contexts 2, 3, 4; seq 1 at context 1 -> 10 tokens.
    seconds = gpu.roofline_seconds(workload, weight_bytes=100, kv_bytes_per_token=10, bandwidth=50.0)
    assert seconds == pytest.approx((3 * 100 + 10 * 10) / 50.0)


def test_weight_bytes_count_fp8_banks_held_as_buffers() -> None:
    """An FP8 bank's weights are buffers, not parameters: counted all the same (on the CPU, its dequantized values)."""
    bank = ParallelExperts(4, 64, 32, SINGLE)
    experts = Fp8Experts(quantize_fp8_experts(bank), torch.float32)
    assert gpu.weight_bytes(bank) == gpu.weight_bytes(experts) == (4 * 64 * 64 + 4 * 64 * 32) * 4


@pytest.mark.slow
def test_a_tiny_cpu_run_writes_every_field(tmp_path: Path) -> None:
    out = tmp_path / "gpu.jsonl"
    code = gpu.main(["--device", "cpu", "--models", "dummy:smollm2-135m", "--num-seqs", "2", "--min-len", "4",
                     "--max-len", "6", "--tpot-tokens", "2", "--quantization", "none,int8", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert {"device", "torch", "triton", "transformers", "commit", "command", "copy_bandwidth_gb_per_s"} <= set(result)
    model, int8 = result["models"]
    assert model["model"] == int8["model"] == "dummy:smollm2-135m"
    assert (model["quantization"], int8["quantization"]) == ("none", "int8")
    assert int8["weight_bytes"] < model["weight_bytes"] / 2 and "transformers" not in int8["output_tok_per_s"]
    assert {"ladle", "ladle_fixed_output", "transformers"} <= set(model["output_tok_per_s"])
    assert model["ratio_vs_hf"] > 0 and model["roofline_fraction"] > 0 and model["tpot_ms_single_stream"] > 0
    assert model["engine"] == {"cuda_graphs": False, "tensor_parallel_size": 1, "async_scheduling": False,
                               "kv_cache_mib": 1024, "kv_cache_dtype": "auto", "max_num_batched_tokens": 2048,
                               "preemptions": 0}
    assert model["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # K and V, 30 layers of 3 heads of 64, float32
    png = tmp_path / "gpu.png"
    assert chart.main([str(out), "-o", str(png)]) == 0 and png.stat().st_size > 0


def test_the_chart_draws_the_newest_result_of_each_model_across_runs() -> None:
    def run(device: str, *models: str) -> dict[str, object]:
        return {"device": device, "models": [{"model": m, "tag": f"{device}/{m}/{len(models)}"} for m in models]}

    runs = [run("H100", "a", "b"), run("H100", "b"), run("H200", "a")]
    runs.append({"device": "H100", "models": [{"model": "a", "quantization": "int8", "tag": "int8"}]})
    picked = [(r["device"], m["tag"]) for r, m in chart.latest_per_model(runs)]  # type: ignore[index]
    assert picked == [("H100", "H100/a/2"), ("H100", "H100/b/1"), ("H200", "H200/a/1"), ("H100", "int8")]
