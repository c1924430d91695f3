"""Decode graphs on the CPU: bucket choice, padding rows, and the padded static-buffer path against eager steps.

`EagerCapture` stands in for `torch.cuda.graph` (it re-runs the recorded step on replay), so everything here but
the capture itself runs as it does on CUDA; tests/gpu/test_decode_graphs_gpu.py covers real graphs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine_server import LLM, SamplingParams, model_loading
from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import CacheConfig, EngineConfig
from engine_server.core.request import Request
from engine_server.cuda_graphs import DecodeGraphs, EagerCapture, bucket_for, graph_batch_sizes
from engine_server.transfer import host_tensor, to_device
from tests.families import save_family
from tests.unit.runner_factories import greedy_request, make_lockstep, tiny_engine_config, tiny_runner

SCRATCH = 99


@pytest.mark.parametrize(
    ("max_batch", "sizes"),
    [
        (1, [1]),
        (2, [1, 2]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (16, [1, 2, 4, 8, 16]),
        (20, [1, 2, 4, 8, 16, 20]),
        (512, [1, 2, 4, *range(8, 513, 8)]),
    ],
)
def test_graph_batch_sizes_are_vllm_buckets(max_batch: int, sizes: list[int]) -> None:
    assert graph_batch_sizes(max_batch) == sizes


def test_bucket_is_the_smallest_that_holds_the_batch() -> None:
    sizes = graph_batch_sizes(24)
    assert [bucket_for(b, sizes) for b in (1, 2, 3, 4, 5, 8, 9, 13, 16, 17, 24)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        16,
        16,
        24,
        24,
    ]
    assert bucket_for(25, sizes) is None
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


class _RecordingForward:
    """A fake model step: records what it was given; hidden row i is `[token_id] * 8`."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]] = []

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, lora: object = None
    ) -> torch.Tensor:
        # The kernels index these as flat arrays: the static buffers must hand out contiguous views.
        assert ids.is_contiguous() and positions.is_contiguous() and meta.slot_mapping.is_contiguous()
        self.calls.append((ids.clone(), positions.clone(), meta))
        return ids.float()[:, None].expand(-1, 8)


def _graphs(forward: _RecordingForward) -> DecodeGraphs:
    return DecodeGraphs(
        forward,
        sizes=[1, 2, 4, 8],
        hidden_size=8,
        block_size=4,
        max_blocks_per_seq=6,
        scratch_block=SCRATCH,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_capture_warms_up_and_records_every_bucket_on_padding_only() -> None:
    forward = _RecordingForward()
    capture = EagerCapture()
    _graphs(forward).capture_all(capture)
    assert capture.warmups == 4
    assert [len(ids) for ids, _, _ in forward.calls] == [8, 4, 2, 1]  # largest first
    for ids, positions, meta in forward.calls:
        assert ids.eq(0).all() and positions.eq(0).all()
        assert meta.slot_mapping.eq(SCRATCH * 4).all()
        assert meta.block_tables.eq(SCRATCH).all()
        assert meta.seq_lens_cpu == [1] * len(ids) and meta.seq_lens.eq(1).all()


def test_a_batch_is_padded_to_its_bucket_with_rows_in_the_scratch_block() -> None:
    forward = _RecordingForward()
    graphs = _graphs(forward)
    graphs.capture_all(EagerCapture())
    forward.calls.clear()

    hidden = graphs.run([11, 12, 13], [5, 9, 1], [[3, 4], [7, 8, 2], [5]])

    assert hidden[:, 0].tolist() == [11.0, 12.0, 13.0] and hidden.shape == (3, 8)
    assert graphs.replays == {4: 1}
    ((ids, positions, meta),) = forward.calls
    assert ids.tolist() == [11, 12, 13, 0]
    assert positions.tolist() == [4, 8, 0, 0]
    # Position p of a row lives in slot table[p // 4] * 4 + p % 4; the padding row in the scratch block.
    assert meta.slot_mapping.tolist() == [4 * 4 + 0, 2 * 4 + 0, 5 * 4 + 0, SCRATCH * 4]
    assert meta.seq_lens.tolist() == [5, 9, 1, 1] and meta.seq_lens_cpu == [5, 9, 1, 1]
    assert meta.query_lens_cpu == [1, 1, 1, 1] and meta.max_query_len == 1
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    # Columns past what the longest row needs (3 blocks) are never read; the ones read hold only valid ids.
    assert meta.block_tables[:, :3].tolist() == [[3, 4, SCRATCH], [7, 8, 2], [5, SCRATCH, SCRATCH], [SCRATCH] * 3]


def test_run_refuses_batches_it_has_no_graph_for() -> None:
    graphs = _graphs(_RecordingForward())
    graphs.capture_all(EagerCapture())
    with pytest.raises(ValueError):
        graphs.run([], [], [])
    with pytest.raises(ValueError):
        graphs.run([1] * 9, [1] * 9, [[0]] * 9)
    with pytest.raises(ValueError):  # 25 tokens need 7 blocks; the tables are 6 wide
        graphs.run([1], [25], [list(range(7))])


def _requests() -> list[Request]:
    """13 requests with varied prompts; they finish after 3, 5 or 8 tokens, so decode batches of 13, 5 and 3
    (and 6 while the late request of `_late` decodes) run."""
    lengths = [3, 17, 5, 40, 9, 12, 1, 33, 7, 21, 4, 15, 28]
    max_tokens = [3] * 8 + [5] * 2 + [8] * 3
    return [greedy_request(f"r{i}", n, m) for i, (n, m) in enumerate(zip(lengths, max_tokens, strict=True))]


def _late() -> dict[int, list[Request]]:
    return {2: [greedy_request("late", 9, 2)]}


@pytest.mark.parametrize(("max_graph_batch", "replays"), [(16, {16: 1, 8: 2, 4: 3}), (4, {4: 3})])
def test_padded_graph_steps_match_eager_steps(
    monkeypatch: pytest.MonkeyPatch, max_graph_batch: int, replays: dict[int, int]
) -> None:
    config = tiny_engine_config(max_cuda_graph_batch=max_graph_batch)
    reference, candidate = tiny_runner(config), tiny_runner(config)
    assert reference.decode_graphs is None  # the CPU never captures by itself
    graphs = candidate.capture_decode_graphs(EagerCapture())
    lockstep = make_lockstep(reference, candidate, config, monkeypatch)

    steps = lockstep.run(_requests(), late=_late())

    assert [s.batch for s in steps if s.decode_only] == [13, 6, 5, 3, 3, 3]
    assert any(not s.decode_only and s.batch > 1 for s in steps[1:])  # the late prefill mixed into decodes
    assert dict(graphs.replays) == replays  # mixed steps and batches above the largest bucket ran eagerly
    for step in steps:
        assert step.tokens[1] == step.tokens[0]
        torch.testing.assert_close(step.hidden[1], step.hidden[0], atol=1e-5, rtol=1e-5)


def test_padding_writes_only_the_scratch_block(monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_engine_config()
    reference, candidate = tiny_runner(config), tiny_runner(config)
    candidate.capture_decode_graphs(EagerCapture())
    make_lockstep(reference, candidate, config, monkeypatch).run(_requests(), late=_late())

    real = slice(0, reference.num_blocks)
    assert candidate.scratch_block == candidate.num_blocks
    for ref_cache, cand_cache in zip(reference.kv_caches, candidate.kv_caches, strict=True):
        assert cand_cache.shape[1] == candidate.num_blocks + 1
        # Same K/V in every block the cache manager owns (used or never handed out) as the unpadded steps.
        torch.testing.assert_close(cand_cache[:, real], ref_cache[:, real], atol=1e-5, rtol=1e-5)
        assert ref_cache[:, candidate.scratch_block].eq(0).all()  # eager steps never touch it
        assert cand_cache[:, candidate.scratch_block].ne(0).any()  # the padding rows wrote there


def test_cpu_inputs_are_not_pinned() -> None:
    host = host_tensor([1, 2, 3], torch.long, "cpu")
    assert not host.is_pinned()
    moved = to_device(host, torch.device("cpu"), torch.int32)
    assert moved.dtype == torch.int32 and moved.tolist() == [1, 2, 3] and not moved.is_pinned()
    assert to_device(host, "cpu") is host  # nothing to copy on the CPU


@pytest.mark.slow  # engines on a saved model
@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_a_mixture_of_experts_decodes_through_padded_graph_buffers_as_eagerly(
    quantization: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU half of lifting `_captures_decode_graphs`' MoE guard (tests/gpu/test_moe_graphs_gpu.py is the GPU
    half): with the guard lifted and `EagerCapture` standing in for `torch.cuda.graph`, a Qwen3-MoE decodes
    through the static buffers, its padding rows routed to experts beside the real ones, to the eager engine's
    tokens, float and FP8 experts alike."""
    folder = save_family(tmp_path / "moe", "qwen3-moe", head_spread=1.0)
    config = EngineConfig(
        model=str(folder), device="cpu", quantization=quantization,  # type: ignore[arg-type]
        cache=CacheConfig(memory_bytes=64 * 1024**2),
    )
    monkeypatch.setattr(model_loading, "CudaGraphCapture", EagerCapture)
    theirs, ours, replays = moe_tokens_eager_and_through_graphs(config, monkeypatch)
    assert replays > 0
    assert ours == theirs


def moe_tokens_eager_and_through_graphs(
    config: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[list[int]], list[list[int]], int]:
    """Greedy tokens of three prompts from `config`'s engine eagerly, then with `_captures_decode_graphs`' MoE guard
    lifted, and how many decode graphs the second replayed (tests/gpu/test_moe_graphs_gpu.py shares it)."""
    with LLM(config=dataclasses.replace(config, enforce_eager=True)) as eager:
        assert eager.core.runner.decode_graphs is None
        theirs = _moe_tokens(eager)
    monkeypatch.setattr(model_loading, "_captures_decode_graphs", lambda loaded, config: not config.enforce_eager)
    with LLM(config=config) as llm:
        graphs = llm.core.runner.decode_graphs
        assert graphs is not None
        ours = _moe_tokens(llm)
    return theirs, ours, sum(graphs.replays.values())


def _moe_tokens(llm: LLM) -> list[list[int]]:
    prompts = [[17, 3000, 45, 902, 12], [5, 77], [40000, 123, 9, 9, 9, 801, 2024, 7]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [r.choices[0].token_ids for r in llm.generate(prompts, greedy, use_tqdm=False)]
