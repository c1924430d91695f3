"""Offline `LLM(tensor_parallel_size=N)` on the embedded model: quantized weights split over the ranks,
speculative decoding over them, and what tensor parallelism refuses, said at configuration before any worker starts.

Quantized weights under TP=3 (the default `auto`: the GGUF file's own blocks, each rank its slice) hold TP=1's
quality thresholds against the float model (`ladle bench quality`, the thresholds of test_quantization), and
each prompt's tokens do not depend on the batch it runs in. They are not bit-equal to TP=1's: sums over the
ranks change the float summation order, and a value that then crosses an 8-bit rounding boundary of the next
layer's activations moves by one step (engine_server.quantization).

A TP=3 engine takes ~15 s of CPU to start on two cores (three processes importing and loading), more than most
of these tests spend on it afterwards: tests that need the same configuration share one (`TP3Engines`), a test
that leaves its engine changed closes it, and every test starts from an empty prefix cache as a new engine would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from benchmarks.quality import QUALITY_PROMPTS, compare, sequence_logits
from engine_server import ChatPrompt
from engine_server.config import CacheConfig, EngineConfig
from engine_server.cuda_graphs import EagerCapture
from engine_server.llm import LLM
from engine_server.loader import resolve_model
from engine_server.models import CausalLM
from engine_server.quantization import resolve_quantization
from engine_server.sampling_params import SamplingParams
from engine_server.tokenizer.chat import ChatMessage
from ladle_kernels import cpu_ops as cpu
from tests.unit.speculative.test_embedded_model import COPYING, NGRAM
from tests.unit.test_quantization import MAX_MEAN_KL, MIN_TOP1_AGREEMENT

pytestmark = pytest.mark.slow

needs_kernels = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")


def test_auto_serves_the_gguf_blocks_under_tensor_parallelism() -> None:
    source = resolve_model("default")
    for mode in ("auto", "gguf"):
        assert resolve_quantization(mode, source, torch.device("cpu"), torch.float32, kernels=True) == "gguf"


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
CHATS = [ChatPrompt([ChatMessage(role="user", content=text)]) for text in (*QUALITY_PROMPTS[:6], *COPYING[:2])]


def _tokens(llm: LLM, chats: list[ChatPrompt]) -> list[list[int]]:
    return [result.choices[0].token_ids for result in llm.generate(chats, GREEDY, use_tqdm=False)]


# A rank's KV cache: one 8192-token sequence of the embedded model needs 126 MiB on each of 3 ranks (rank 0's
# draft model, whole, gets as many blocks of its own).
KV_CACHE_BYTES = 128 << 20
PLAIN: dict[str, Any] = {"async_scheduling": False}  # each step launched after the last one is collected
# Async scheduling with decode graphs of up to 8 rows, which matter only once a test captures them: the async
# scheduling test and the decode graphs test share this engine.
AHEAD: dict[str, Any] = {"async_scheduling": True, "max_cuda_graph_batch": 8}


def _split(async_scheduling: bool | None = None, max_cuda_graph_batch: int = 512, **kwargs: Any) -> LLM:
    """The embedded model at TP=3 with the default quantization (the GGUF blocks). One at a time: a process runs
    one tensor-parallel engine (torch.distributed's default group)."""
    config = EngineConfig(
        device="cpu",
        cache=CacheConfig(memory_bytes=KV_CACHE_BYTES),
        tensor_parallel_size=3,
        async_scheduling=async_scheduling,
        max_cuda_graph_batch=max_cuda_graph_batch,
    )
    return LLM(config=config, **kwargs)


class TP3Engines:
    """The module's TP=3 engine, one at a time. `open(**options)` (`_split`'s arguments) returns the engine already
    open with the same options, its prefix cache emptied, or closes it and opens one with them; a test that leaves
    its engine changed (captured graphs) calls `close` when done, so that no other test gets it."""

    def __init__(self) -> None:
        self._llm: LLM | None = None
        self._options: dict[str, Any] = {}

    def open(self, **options: Any) -> LLM:
        if self._llm is not None and options == self._options:
            self._llm.core.scheduler.kv_cache.reset_prefix_cache()
            return self._llm
        self.close()
        self._llm, self._options = _split(**options), options
        return self._llm

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None


@pytest.fixture(scope="module")
def tp3() -> Iterator[TP3Engines]:
    engines = TP3Engines()
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def tp3_greedy(tp3: TP3Engines) -> list[list[int]]:
    """CHATS' greedy tokens at TP=3 with the default quantization, launching each step after the last one is
    collected (no async scheduling, no speculation, no graphs): what each variant below must give token for token.
    Computed once for the module, as every variant's baseline."""
    return _tokens(tp3.open(**PLAIN), CHATS)


@needs_kernels
@pytest.mark.timeout(600)
def test_quantized_weights_under_tp3_hold_the_quality_thresholds_and_are_batch_invariant(
    float_reference: Any, tp3: TP3Engines
) -> None:
    num_tokens = 64
    sequences, reference = float_reference  # the float model at TP=1 (tests/conftest.py)
    split = tp3.open(**PLAIN)
    assert split.core.runner.quantization == "gguf"
    result = compare(reference, split, "gguf", QUALITY_PROMPTS, num_tokens, sequences, free_running=False)
    assert result.positions == 16 * num_tokens
    assert result.top1_agreement >= MIN_TOP1_AGREEMENT, result
    assert result.mean_kl <= MAX_MEAN_KL, result
    assert [_tokens(split, [chat])[0] for chat in CHATS] == _tokens(split, CHATS)
    with pytest.raises(ValueError, match="this process already runs a tensor-parallel engine"):
        _split()


@needs_kernels
@pytest.mark.timeout(600)
def test_the_decode_stack_runs_under_tp3_and_sums_as_the_layers_do(tp3: TP3Engines) -> None:
    """Each rank's C++ decode stack all-reduces between its layers on the shared-memory buffers: with rank 0 on its
    Python layers and the workers on their stacks, every logit equals the all-stack run's, bit for bit."""
    split = tp3.open(**PLAIN)
    model = split.core.runner.model
    assert isinstance(model, CausalLM) and model.model.decode_stack is not None
    prompt = split.inputs.tokenize(CHATS[-1])
    ids = prompt + list(range(1000, 1012))
    stacked = sequence_logits(split, ids, prefill=len(prompt))
    stack, model.model.decode_stack = model.model.decode_stack, None
    try:
        layered = sequence_logits(split, ids, prefill=len(prompt))
    finally:
        model.model.decode_stack = stack  # the engine as it was, for the tests that share it
    assert torch.equal(stacked, layered)


@needs_kernels
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "speculative",
    [NGRAM, {"method": "draft_model", "model": "default", "num_speculative_tokens": 4, "adaptive": False}],
    ids=["ngram", "draft_model"],
)
def test_speculative_decoding_under_tp3_keeps_greedy_output_token_for_token(
    speculative: dict[str, Any], tp3: TP3Engines, tp3_greedy: list[list[int]]
) -> None:
    """The quantized kernels give a token the same bits whatever its batch, so verifying drafts in one forward
    computes what decoding them one by one does: the output must equal TP=3's without speculation exactly. A draft
    model lives on rank 0 only (engine_server.model_loading)."""
    speculating = tp3.open(**PLAIN, speculative_config=speculative)
    assert _tokens(speculating, CHATS) == tp3_greedy
    stats = speculating.core.speculator.stats  # type: ignore[union-attr]
    assert stats.accepted_tokens >= 10  # the copying prompts did keep drafts


@needs_kernels
@pytest.mark.timeout(600)
def test_async_scheduling_under_tp3_keeps_greedy_output_token_for_token(
    tp3: TP3Engines, tp3_greedy: list[list[int]]
) -> None:
    """Launching step N+1 before collecting step N: its input tokens are still the last launch's (pending), and
    reach the workers as rows and values apart (engine_server.parallel.step_channel)."""
    ahead = tp3.open(**AHEAD)
    assert ahead.core.async_scheduling and ahead.core.runner.decode_graphs is None
    assert _tokens(ahead, CHATS) == tp3_greedy


@needs_kernels
@pytest.mark.timeout(600)
def test_decode_graphs_under_tp3_replay_on_every_rank_token_for_token(
    tp3: TP3Engines, tp3_greedy: list[list[int]]
) -> None:
    """Every rank records the decode graphs (here the eager stand-in, which runs the same padded static buffers)
    and replays its own of the bucket rank 0 names (DECODE_GRAPH): with async scheduling, whose pending tokens
    reach the workers' graphs too, greedy output equals the eager steps' token for token."""
    expected = tp3_greedy
    graphed = tp3.open(**AHEAD)
    try:
        assert graphed.core.async_scheduling
        graphs = graphed.core.runner.capture_decode_graphs(EagerCapture())
        assert graphs.sizes == [1, 2, 4, 8]
        assert _tokens(graphed, CHATS) == expected
        assert sum(graphs.replays.values()) >= 20  # 8 prompts x 24 tokens: every decode step is a replay
        assert _tokens(graphed, CHATS[:3]) == expected[:3]  # a bucket of 4 rows, one a padding row
    finally:
        tp3.close()  # its steps replay the graphs from now on: no other test's engine


def test_what_tensor_parallelism_refuses_is_said_at_configuration() -> None:
    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    # The embedded model's 9 query heads do not split over 2 ranks: said before any worker starts.
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(9\) must be divisible by the tensor-parallel size \(2\)"
    ):
        LLM(config=EngineConfig(model="default", device="cpu", tensor_parallel_size=2))
