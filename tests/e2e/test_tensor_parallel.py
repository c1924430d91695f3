"""Tensor parallelism end to end on the CPU (gloo): real engines split over worker processes, against TP=1.

- gRPC: `ladle engine --tensor-parallel-size 2` on dummy:qwen2-tiny (Qwen2's layout with 2 KV heads: one per
  rank) through the typed client; 32 token-id prompts, greedy.
- The gateway: `ladle serve --tensor-parallel-size 3` on the embedded model (3 KV heads) through the official
  OpenAI SDK (completions of 32 token-id prompts in one call, 8 tokens each: three ranks on two cores decode
  slowly, and a wrong shard shows from the first token).
Each is compared with the same model at TP=1 in this process (`LLM`), float32, as tests/tp_agreement.py judges:
sums over ranks change the float32 summation order, so a greedy continuation may flip only where the two best
tokens nearly tie (within its NEAR_TIE_NATS); at least 95% of the prompts must be identical outright.

- Failure: kill -9 of a worker under load ends every call (UNAVAILABLE or completed), the engine exits non-zero
  within 5 s and leaves no process; kill -9 of rank 0 makes the workers leave within 5 s. Both on float weights
  and on the default quantized ones (the ranks then wait for each other inside the C++ decode stack).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import psutil
import pytest
import torch

from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_server.frontend import Choice
from engine_server.llm import LLM
from ladle.client import EngineClient
from ladle.v1 import engine_pb2, types_pb2
from tests.e2e.engine_process import EngineProcess, start_engine, still_running
from tests.e2e.gateway_process import start_serve
from tests.tp_agreement import NUM_TOKENS, assert_agree, random_prompts

pytestmark = pytest.mark.slow

EXIT_WITHIN_S = 5.0
TP3_TOKENS = 8


def _tp1(model: str) -> LLM:
    """`model` at TP=1 in this process, float32 (the embedded model's is the session's `llm`)."""
    config = EngineConfig(
        model=model,
        device="cpu",
        quantization="none",
        cache=CacheConfig(memory_bytes=256 << 20),
        scheduler=SchedulerConfig(max_model_len=512),
    )
    return LLM(config=config)


def _reference(llm: LLM, prompts: list[list[int]], max_tokens: int = NUM_TOKENS) -> list[Choice]:
    """Greedy, with each token's top 2 log-probabilities."""
    params = llm.sampling_params(temperature=0.0, max_tokens=max_tokens, logprobs=True, top_logprobs=2)
    return [result.choices[0] for result in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.timeout(600)
def test_tp2_over_grpc_matches_tp1(tmp_path: Path) -> None:
    model = "dummy:qwen2-tiny"
    prompts = random_prompts(2)
    # Each rank's KV cache: room for one 8192-token sequence of qwen2-tiny (8 MiB); all of it is zeroed at start.
    engine = start_engine(
        tmp_path / "engine.log", "--model", model, "--quantization", "none", "--tensor-parallel-size", "2",
        "--kv-cache-mib", "16", threads=2,
    )  # fmt: skip
    try:
        sampling = types_pb2.SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, logprobs=True, top_logprobs=2)
        with EngineClient(engine.address, timeout=300) as client:
            responses = _generate_all(client, prompts, sampling)
    finally:
        assert engine.stop() == 0
    got = [[lp.token for lp in response.choices[0].logprobs] for response in responses]
    with _tp1(model) as llm:
        reference = _reference(llm, prompts)
    assert_agree(got, reference, f"TP=2 over gRPC, {model}")


def _generate_all(
    client: EngineClient, prompts: list[list[int]], sampling: types_pb2.SamplingParams
) -> list[engine_pb2.GenerateResponse]:
    """Every prompt at once (one thread per call), so the engine batches them as a server would."""
    responses: list[engine_pb2.GenerateResponse | None] = [None] * len(prompts)

    def call(index: int) -> None:
        request = engine_pb2.GenerateRequest(
            request_id=f"tp-{index}",
            input=types_pb2.Input(token_ids=types_pb2.TokenIds(ids=prompts[index])),
            sampling=sampling,
        )
        responses[index] = client.generate(request)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(response is not None for response in responses)
    return [response for response in responses if response is not None]


@pytest.mark.timeout(600)
def test_tp3_through_the_gateway_matches_tp1(tmp_path: Path, llm: LLM) -> None:
    """`llm` (tests/conftest.py) is the embedded model at TP=1, float32: the session's, loaded once per process."""
    prompts = random_prompts(3)
    # Each rank's KV cache: room for one 8192-token sequence of the embedded model (126 MiB at TP=3).
    gateway, lines = start_serve(
        tmp_path / "serve.log", "--quantization", "none", "--tensor-parallel-size", "3", "--kv-cache-mib", "128"
    )
    try:
        assert lines[-1].startswith("ladle serve: ready"), "".join(lines) + gateway.log()
        with openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=300) as client:
            model = client.models.list().data[0].id
            completion = client.completions.create(
                model=model, prompt=prompts, max_tokens=TP3_TOKENS, temperature=0.0, logprobs=2
            )
            # Pooling under TP: rank 0's final hidden states are whole (every block ends in an all-reduce).
            embedded = client.embeddings.create(model=model, input=prompts[:8])
    finally:
        assert gateway.stop() == 0
    choices = sorted(completion.choices, key=lambda choice: choice.index)
    got = [list(choice.logprobs.tokens or []) if choice.logprobs else [] for choice in choices]
    reference = _reference(llm, prompts, TP3_TOKENS)
    expected = llm.embed(prompts[:8], use_tqdm=False)
    assert_agree(got, reference, "TP=3 through the gateway, the embedded model")
    for item, vector in zip(embedded.data, expected, strict=True):
        ours = torch.tensor(item.embedding)
        assert float((ours - vector).norm() / vector.norm()) < 1e-4  # the same sums, added in another order


# -- failure ---------------------------------------------------------------------------------------------------


@pytest.fixture(params=["none", "auto"])
def tp3_engine(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[EngineProcess]:
    """The embedded model at TP=3: float layers from Python (`none`), or the default GGUF blocks, whose ranks wait
    for each other inside the C++ decode stack's all-reduces (`auto`)."""
    engine = start_engine(
        tmp_path / "engine.log", "--quantization", request.param, "--tensor-parallel-size", "3",
        "--kv-cache-mib", "128", threads=2,
    )  # fmt: skip
    yield engine
    if engine.process.poll() is None:
        engine.stop(5)


def _processes(engine: EngineProcess) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(the two workers, every process the engine started: workers and multiprocessing's helpers). The workers are
    forks of the engine's forkserver (`engine_server.workers.worker_context`): its children."""
    children = psutil.Process(engine.process.pid).children(recursive=True)
    servers = {child.pid for child in children
               if child.ppid() == engine.process.pid and "forkserver" in " ".join(child.cmdline())}  # fmt: skip
    workers = [child for child in children if child.ppid() in servers]
    assert len(servers) == 1 and len(workers) == 2, [child.cmdline() for child in children]
    return workers, children


def _load(engine: EngineProcess, calls: int) -> tuple[list[threading.Thread], list[str]]:
    """`calls` long streams in flight; each appends how it ended ("completed", or "CODE: details")."""
    ended: list[str] = []
    started = threading.Barrier(calls + 1)

    def stream(index: int) -> None:
        request = engine_pb2.StreamRequest(
            request_id=f"load-{index}",
            input=types_pb2.Input(text=f"Count from {index} to a thousand:"),
            sampling=types_pb2.SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True),
        )
        with EngineClient(engine.address, timeout=60) as client:
            call = client.stream(request)
            try:
                next(iter(call))  # the stream has begun producing
                started.wait(60)
                for _ in call:
                    pass
                ended.append("completed")
            except grpc.RpcError as error:
                ended.append(f"{error.code().name}: {error.details()}")

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(calls)]
    for thread in threads:
        thread.start()
    started.wait(120)
    return threads, ended


@pytest.mark.timeout(300)
def test_kill_9_of_a_worker_takes_the_engine_down_cleanly(tp3_engine: EngineProcess) -> None:
    workers, children = _processes(tp3_engine)
    threads, ended = _load(tp3_engine, 4)
    workers[0].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    status = tp3_engine.process.wait(30)
    exited_after = time.monotonic() - killed
    alive = still_running(children, timeout=EXIT_WITHIN_S)
    for thread in threads:
        thread.join(30)
    assert status != 0 and exited_after < EXIT_WITHIN_S, (status, exited_after)
    assert not alive, [p.pid for p in alive]
    # The engine said why before it went (a call whose status could not leave in time would read "Socket closed").
    lost = "UNAVAILABLE: tensor-parallel worker 1 of this engine is gone; it is stopping"
    assert len(ended) == 4 and set(ended) <= {"completed", lost}, ended
    assert '"a tensor-parallel worker is gone: the engine stops"' in tp3_engine.log()


@pytest.mark.timeout(300)
def test_kill_9_of_rank_0_makes_the_workers_leave(tp3_engine: EngineProcess) -> None:
    _, children = _processes(tp3_engine)
    threads, _ = _load(tp3_engine, 2)
    tp3_engine.process.send_signal(signal.SIGKILL)
    tp3_engine.process.wait(10)
    alive = still_running(children, timeout=EXIT_WITHIN_S)
    assert not alive, [p.pid for p in alive]
    for thread in threads:
        thread.join(30)
