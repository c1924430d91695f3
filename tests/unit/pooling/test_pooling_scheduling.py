"""Pooling requests in the engine core beside generation: one budget, no sampling, every block back, no output
changed by the other kind of work; with and without async scheduling, across chunks, aborts and preemption."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_server.core.engine_core import CoreOutput, EngineCore
from engine_server.core.request import Request, RequestStatus
from engine_server.pooling.params import PoolingMethod, PoolingParams
from engine_server.sampling_params import SamplingParams
from tests.unit.factories import VOCAB
from tests.unit.runner_factories import MAX_MODEL_LEN, tiny_engine_config, tiny_source

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LENGTHS = [3, 17, 40, 1, 90, 9]


def _core(async_scheduling: bool = False, budget: int | None = None, **cache: int) -> EngineCore:
    config = tiny_engine_config(max_num_seqs=32)
    if budget is not None:
        scheduler = dataclasses.replace(config.scheduler, max_num_batched_tokens=budget, batch_min_prefill_chunk=budget)
        config = dataclasses.replace(config, scheduler=scheduler)
    if cache:
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, **cache))
    return EngineCore(dataclasses.replace(config, async_scheduling=async_scheduling), tiny_source())


def _prompt(i: int, length: int) -> list[int]:
    return [(31 * i + 7 * j + 1) % VOCAB for j in range(length)]


def _pooling(i: int, method: PoolingMethod) -> Request:
    params = PoolingParams(method, normalize=False)
    prompt = _prompt(i, LENGTHS[i % len(LENGTHS)])
    return Request(f"p{i}", prompt, SamplingParams(), max_model_len=MAX_MODEL_LEN, pooling=params)


def _generation(i: int) -> Request:
    return Request(f"g{i}", _prompt(100 + i, LENGTHS[(i + 2) % len(LENGTHS)]), GREEDY, max_model_len=MAX_MODEL_LEN)


def _run(core: EngineCore, requests: list[Request]) -> dict[str, list[CoreOutput]]:
    for request in requests:
        core.add_request(request)
    outputs: dict[str, list[CoreOutput]] = {}
    for _ in range(1000):
        if not core.has_unfinished():
            break
        for output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
    assert not core.has_unfinished(), "the engine did not finish"
    assert core.scheduler.kv_cache.num_used_blocks == 0
    assert not core.runner.pooler._partial  # every partial sum let go
    return outputs


def _vector(outputs: list[CoreOutput]) -> torch.Tensor:
    (output,) = outputs  # one output: its last, with its vector
    assert output.status is RequestStatus.FINISHED_STOPPED and not output.new_tokens
    assert output.pooled is not None
    return output.pooled


def _tokens(outputs: list[CoreOutput]) -> list[int]:
    return [token.token_id for output in outputs for token in output.new_tokens]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pooling_beside_generation_changes_neither(async_scheduling: bool) -> None:
    methods = [PoolingMethod.LAST, PoolingMethod.MEAN, PoolingMethod.CLS]
    pooling = [_pooling(i, methods[i % 3]) for i in range(6)]
    alone = _run(_core(budget=32), [_pooling(i, methods[i % 3]) for i in range(6)])
    generation_alone = _run(_core(budget=32), [_generation(i) for i in range(4)])
    mixed = _run(_core(async_scheduling, budget=32), [*pooling, *(_generation(i) for i in range(4))])
    for request in pooling:  # chunks of at most 32 tokens: the 40- and 90-token inputs take several steps
        torch.testing.assert_close(_vector(mixed[request.request_id]), _vector(alone[request.request_id]))
    for i in range(4):
        assert _tokens(mixed[f"g{i}"]) == _tokens(generation_alone[f"g{i}"])
        assert len(_tokens(mixed[f"g{i}"])) == 8


def test_a_pooling_request_aborted_between_chunks_lets_go_of_everything() -> None:
    core = _core(budget=16)
    request = _pooling(4, PoolingMethod.MEAN)  # 90 tokens: six chunks
    core.add_request(request)
    core.step()
    core.step()
    assert 0 < request.num_computed_tokens < request.num_prompt_tokens
    (output,) = core.abort_requests([request.request_id])
    assert output.status is RequestStatus.FINISHED_ABORTED and output.pooled is None
    assert core.scheduler.kv_cache.num_used_blocks == 0 and not core.runner.pooler._partial


def test_a_preempted_mean_pooling_request_starts_its_sum_over() -> None:
    """Two generations that grow until the pool runs dry preempt the latest arrival, a mean-pooling request in the
    middle of its chunks; recomputed from its first token, its vector is the one it has alone."""
    (alone,) = _run(_core(budget=16), [_pooling(4, PoolingMethod.MEAN)]).values()
    long_generation = dataclasses.replace(GREEDY, max_tokens=80)
    generations = [
        Request(f"g{i}", _prompt(200 + i, 20), long_generation, max_model_len=MAX_MODEL_LEN) for i in range(2)
    ]
    whole_pool = tiny_engine_config().cache.memory_bytes  # 160 blocks of 4 tokens
    tight = _core(budget=16, memory_bytes=whole_pool * 40 // 160)
    for request in generations:
        tight.add_request(request)
    early = [output for _ in range(40) for output in tight.step()]  # each generation ~60 tokens: 30 blocks of 40
    pooling = _pooling(4, PoolingMethod.MEAN)  # 90 tokens in chunks of at most 16, while the generations grow
    later = _run(tight, [pooling])
    outputs: dict[str, list[CoreOutput]] = {}
    for output in [*early, *(o for produced in later.values() for o in produced)]:
        outputs.setdefault(output.request_id, []).append(output)
    assert pooling.num_preemptions > 0
    torch.testing.assert_close(_vector(outputs[pooling.request_id]), _vector(alone))
    assert all(len(_tokens(outputs[g.request_id])) == 80 for g in generations)
