"""Every EngineService RPC through the generated stubs against a real `ladle engine` process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TypeAlias

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.e2e.helpers import chat_input, generate, joined_stream, sampling, stream, text_input

Stub: TypeAlias = engine_pb2_grpc.EngineServiceStub


def test_health_is_serving_for_both_names(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "ladle.v1.EngineService"):
        response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_model_info(stub: Stub) -> None:
    info = stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5)
    assert info.model_id == "SmolLM2-135M-Instruct"
    assert (info.context_length, info.vocab_size, info.architecture) == (8192, 49152, "llama")
    assert list(info.eos_token_ids) == [2]
    assert info.has_chat_template and info.device == "cpu" and info.dtype == "float32"
    assert info.limits.max_n == 16
    # `--generation-config auto` on the embedded model: its model card's values, with a 512-token cap.
    defaults = info.defaults
    assert (defaults.temperature, defaults.top_p) == pytest.approx((0.2, 0.9))
    assert (defaults.top_k, defaults.min_p, defaults.repetition_penalty, defaults.max_tokens) == (0, 0.0, 1.0, 512)


def test_generate_text_with_usage(stub: Stub) -> None:
    reply = stub.Generate(generate("The capital of France is", 8, request_id="caller-1"), timeout=60)
    assert reply.request_id == "caller-1" and reply.model == "SmolLM2-135M-Instruct"
    (choice,) = reply.choices
    assert "Paris" in choice.text
    assert len(choice.token_ids) == 8 and choice.finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (5, 8, 13)


def test_generate_chat_n2_stop_and_logprobs(stub: Stub) -> None:
    request = engine_pb2.GenerateRequest(
        input=chat_input("Name the capital of France."),
        sampling=sampling(24, n=2, stop=["Paris"], logprobs=True, top_logprobs=2),
    )
    reply = stub.Generate(request, timeout=60)
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:  # greedy: both choices alike, both stopped by the stop string
        assert choice.finish_reason == types_pb2.FINISH_REASON_STOP and choice.matched_stop.text == "Paris"
        assert "Paris" not in choice.text
        assert len(choice.logprobs) == len(choice.token_ids)
        assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in choice.logprobs)
    assert reply.choices[0].text == reply.choices[1].text


def test_generate_token_ids_input_equals_text_input(stub: Stub) -> None:
    ids = stub.Tokenize(engine_pb2.TokenizeRequest(input=text_input("Once upon a time")), timeout=10).token_ids
    by_ids = engine_pb2.GenerateRequest(
        input=types_pb2.Input(token_ids=types_pb2.TokenIds(ids=ids)), sampling=sampling(6)
    )
    assert stub.Generate(by_ids, timeout=60).choices[0].token_ids == (
        stub.Generate(generate("Once upon a time", 6), timeout=60).choices[0].token_ids
    )


def test_stream_deltas_add_up_to_generate(stub: Stub) -> None:
    responses = list(stub.Stream(stream("The capital of France is", 10, request_id="s-1"), timeout=60))
    assert len(responses) >= 2 and all(r.request_id == "s-1" for r in responses)
    assert all(not r.HasField("usage") for r in responses[:-1])
    last = responses[-1]
    assert last.usage.completion_tokens == 10 and last.usage.prompt_tokens == 5
    # usage_so_far on every message: the prompt, and every token sent up to and with it
    sent = 0
    for r in responses:
        sent += sum(len(c.token_ids) for c in r.choices)
        assert (r.usage_so_far.prompt_tokens, r.usage_so_far.completion_tokens) == (5, sent)
    assert last.usage_so_far == last.usage
    text, ids, finish = joined_stream(responses)[0]
    whole = stub.Generate(generate("The capital of France is", 10), timeout=60).choices[0]
    assert (text, ids) == (whole.text, list(whole.token_ids))
    assert finish == types_pb2.FINISH_REASON_LENGTH


def test_tokenize_text_and_chat(stub: Stub) -> None:
    text = stub.Tokenize(engine_pb2.TokenizeRequest(input=text_input("Hello world")), timeout=10)
    assert len(text.token_ids) == len(text.tokens) == 2 and text.prompt_text == ""
    chat = stub.Tokenize(engine_pb2.TokenizeRequest(input=chat_input("Hi")), timeout=10)
    assert chat.prompt_text.startswith("<|im_start|>") and chat.prompt_text.endswith("<|im_start|>assistant\n")
    assert len(chat.token_ids) > 5


def test_get_load_reports_the_kv_cache(stub: Stub) -> None:
    load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
    assert load.accepting and load.kv_blocks_total == 728 and load.kv_block_size == 16
    assert 0.0 <= load.kv_usage <= 1.0


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (generate("hi", top_p=3.0), "top_p"),
        (generate("hi", 0), "max_tokens"),
        (generate("hi", 9000), "max_tokens"),
        (generate("", 4), "prompt"),
        (engine_pb2.GenerateRequest(sampling=sampling(4)), "input"),
        (engine_pb2.GenerateRequest(input=types_pb2.Input(token_ids=types_pb2.TokenIds(ids=[49152]))), "prompt"),
        (generate("hi", 4, n=17), "n"),
        (generate("hi", 4, top_logprobs=3), "top_logprobs"),
    ],
)
def test_invalid_requests_are_invalid_argument_naming_the_field(
    stub: Stub, request_: engine_pb2.GenerateRequest, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as failure:
        stub.Generate(request_, timeout=30)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in str(failure.value.details())


def test_stream_errors_are_status_codes_not_messages(stub: Stub) -> None:
    with pytest.raises(grpc.RpcError) as failure:
        list(stub.Stream(stream("hi", 4, temperature=5.0), timeout=30))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in str(failure.value.details())


def test_batch_200_items_some_invalid(stub: Stub) -> None:
    prompts = ["The capital of France is", "One, two, three,", "Hello, my name is", "The sky is"]
    items, bad = [], set()
    for i in range(200):
        request = generate(prompts[i % 4], 2 + i % 3)
        if i % 10 == 3:
            request.sampling.temperature = -1.0
            bad.add(f"item-{i}")
        elif i % 10 == 7:
            request.ClearField("input")
            bad.add(f"item-{i}")
        items.append(engine_pb2.BatchRequest(item_id=f"item-{i}", request=request))
    items.append(engine_pb2.BatchRequest(item_id="item-0", request=generate("again", 2)))  # repeated id

    responses = list(stub.Batch(iter(items), timeout=180))

    assert len(responses) == 201
    assert {r.item_id for r in responses} == {f"item-{i}" for i in range(200)}
    outcomes = {(r.item_id, r.WhichOneof("outcome")) for r in responses}
    assert {i for i, kind in outcomes if kind == "error"} == bad | {"item-0"}
    for response in responses:
        if response.WhichOneof("outcome") == "error":
            assert response.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert response.error.param in {"temperature", "input", "item_id"} and response.error.message
        else:
            i = int(response.item_id.split("-")[1])
            choice = response.result.choices[0]
            assert len(choice.token_ids) == 2 + i % 3 and response.result.usage.completion_tokens == 2 + i % 3
    # Greedy: items with the same prompt and length agree with each other.
    texts: dict[tuple[int, int], set[str]] = {}
    for response in responses:
        if response.WhichOneof("outcome") == "result":
            i = int(response.item_id.split("-")[1])
            texts.setdefault((i % 4, i % 3), set()).add(response.result.choices[0].text)
    assert all(len(v) == 1 for v in texts.values())


def test_batch_flow_control_keeps_unstarted_items_bounded(stub: Stub) -> None:
    """The engine reads Batch items only while it has room for them (twice its 32 seats here), so however many
    items a caller streams, the engine's queue stays bounded and every result still arrives."""
    num_items = 300
    loads: list[engine_pb2.GetLoadResponse] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            loads.append(stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5))
            time.sleep(0.02)

    def items() -> Iterator[engine_pb2.BatchRequest]:
        for i in range(num_items):
            yield engine_pb2.BatchRequest(item_id=str(i), request=generate(f"Item {i}: the answer is", 3))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        responses = list(stub.Batch(items(), timeout=300))
    finally:
        done.set()
        watcher.join()
    assert sorted(int(r.item_id) for r in responses) == list(range(num_items))
    assert all(r.WhichOneof("outcome") == "result" for r in responses)
    peak = max(load.running + load.waiting for load in loads)
    assert 0 < peak <= 2 * 32, peak
