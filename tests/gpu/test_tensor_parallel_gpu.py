"""Tensor parallelism on CUDA: TP=2 against TP=1 on the same host, greedy, float32 and int8.

The judge is the CPU tests' (tests/tp_agreement.py): identical on at least 95% of 32 prompts, every
other one first differing at a near-tie of TP=1's. Async scheduling is on (CUDA's default), so each step's
pending input tokens reach the worker by the group's broadcast, device to device (engine_server.parallel.
step_channel); quantized int8 weights split over the ranks run too, against TP=1's int8.

- On NCCL (a host with two GPUs or more): every rank captures the decode graphs with the all-reduces inside
  and replays its own of the bucket rank 0 names. This project has had only one-GPU machines so far: skipped.
- One GPU, a one-rank NCCL group that the layers take for rank 0 of 2: loading records the decode graphs with
  NCCL's all-reduces inside them, as every rank does on a multi-GPU host, and a replay equals the eager step.
- Two ranks sharing one GPU over gloo (`LADLE_TP_SHARED_DEVICE=1`, which NCCL refuses): the CUDA path of
  everything but NCCL and the graphs (sharded Triton kernels with each rank's head counts, KV caches per rank,
  the step channel and pending tokens to a CUDA worker), on any host with a GPU. gloo's collectives cannot be
  recorded, so those ranks decode eagerly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_server.frontend import Choice
from engine_server.llm import LLM
from engine_server.model_loading import load_model
from engine_server.parallel.group import TensorParallel
from engine_server.workers import SHARED_DEVICE_ENV
from tests.tp_agreement import NUM_PROMPTS, NUM_TOKENS, assert_agree, random_prompts
from tests.unit.runner_factories import BLOCK_SIZE, MAX_MODEL_LEN, VOCAB, tiny_engine_config, tiny_source

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MODEL = "dummy:qwen2.5-0.5b"


def _generate(tensor_parallel_size: int, quantization: str, prompts: list[list[int]], graphs: bool) -> list[Choice]:
    config = EngineConfig(
        model=MODEL,
        device="cuda",
        dtype="float32",
        quantization=quantization,  # type: ignore[arg-type]
        cache=CacheConfig(memory_bytes=1 << 30),
        scheduler=SchedulerConfig(max_model_len=512),
        tensor_parallel_size=tensor_parallel_size,
    )
    with LLM(config=config) as llm:
        assert llm.core.async_scheduling
        params = llm.sampling_params(temperature=0.0, max_tokens=NUM_TOKENS, logprobs=True, top_logprobs=2)
        choices = [result.choices[0] for result in llm.generate(prompts, params, use_tqdm=False)]
        decode_graphs = llm.core.runner.decode_graphs
        assert (decode_graphs is not None) == graphs
        if decode_graphs is not None:
            assert sum(decode_graphs.replays.values()) >= NUM_TOKENS - 2  # every decode step of the batch
        return choices


def _tokens(choices: list[Choice]) -> list[list[str]]:
    return [[lp.token for lp in choice.logprobs or ()] for choice in choices]


@pytest.mark.timeout(900)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_tp2_on_nccl_with_decode_graphs_matches_tp1(quantization: str) -> None:
    prompts = random_prompts(3)
    assert len(prompts) == NUM_PROMPTS
    reference = _generate(1, quantization, prompts, graphs=True)
    got = _generate(2, quantization, prompts, graphs=True)
    assert_agree(_tokens(got), reference, f"TP=2 on NCCL with decode graphs, {MODEL}, --quantization {quantization}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_tp2_sharing_one_gpu_matches_tp1(quantization: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = random_prompts(4)
    reference = _generate(1, quantization, prompts, graphs=True)
    monkeypatch.setenv(SHARED_DEVICE_ENV, "1")
    got = _generate(2, quantization, prompts, graphs=False)
    assert_agree(_tokens(got), reference, f"TP=2 on one GPU (gloo), {MODEL}, --quantization {quantization}")


@pytest.mark.timeout(300)
@torch.inference_mode()
def test_decode_graphs_record_nccl_all_reduces_and_replay_them(tmp_path: Path) -> None:
    """One GPU: a one-rank NCCL group that the layers take for rank 0 of 2, so the model is rank 0's half and each
    all-reduce is NCCL's (of one rank). Loading records the decode graphs with those all-reduces inside (warm-ups
    first, on a side stream: they create the communicator), and a replay equals the same model's eager step."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert isinstance(group, dist.ProcessGroup)
        tp = TensorParallel(rank=0, size=2, group=group, control_group=dist.new_group(backend="gloo"))
        loaded = load_model(tiny_source(), tiny_engine_config("cuda"), MAX_MODEL_LEN, tp)
        graphs = loaded.decode_graphs
        assert graphs is not None and tp.stats.calls > 0  # captured, after warm-ups that ran the all-reduces
        model, kv, device = loaded.model, loaded.kv_caches, loaded.device
        lengths = [5, 9, 3, 12]
        tables = [[4 * row + j for j in range(4)] for row in range(4)]  # 16 tokens each
        ids = [(7 * row + j) % VOCAB for row, n in enumerate(lengths) for j in range(n)]
        positions = [j for n in lengths for j in range(n)]
        prefill = AttentionMetadata.build(lengths, lengths, tables, BLOCK_SIZE, device)
        model(torch.tensor(ids, device=device), torch.tensor(positions, device=device), kv, prefill)
        new, seq_lens = [11, 22, 33, 44], [n + 1 for n in lengths]
        decode = AttentionMetadata.build_decode(seq_lens, tables, BLOCK_SIZE, device)
        eager = model(torch.tensor(new, device=device), torch.tensor(lengths, device=device), kv, decode).clone()
        calls = tp.stats.calls
        replayed = graphs.run(new, seq_lens, tables).clone()
        assert graphs.replays[4] == 1 and tp.stats.calls == calls  # the recorded all-reduces, not Python's calls
        torch.testing.assert_close(replayed, eager, atol=1e-2, rtol=1e-2)
    finally:
        dist.destroy_process_group()
