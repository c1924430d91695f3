"""The gateway's side of LoRA adapters: a request's `model` naming an adapter (resolved, carried to the engine,
echoed), routing that keeps an adapter's calls on the engines holding it (interactive calls and batch lines),
`/v1/models` cards, the admin-only load/unload routes fanned out to every engine (all or nothing), the batch
lines' checks, and the bounded usage label. Engines here are fakes on loopback gRPC (tests/unit/fake_engine.py)
that serve adapters by name; the real engine's side is tests/e2e/test_lora_serving.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway import calls
from gateway.batches import lines
from gateway.batches.line_runner import LineResult, LineRunner
from gateway.config import GatewayConfig
from gateway.deps import ServedModel, base_model, served_model
from gateway.engines import Engine, EnginePool
from gateway.errors import APIError
from gateway.routing import prefix_hashes
from gateway.schemas.chat import ChatCompletionRequest
from gateway.schemas.completions import CompletionRequest
from gateway.schemas.responses import ResponsesRequest
from gateway.translate import responses_to_engine, to_engine
from gateway.usage import MAX_MODEL_LABELS, OTHER_MODEL, UsageLedger
from ladle.v1 import engine_pb2, types_pb2
from tests.unit.fake_engine import MODEL, FakeEngine, start_fake_engine

CHAT = "/v1/chat/completions"


# -- pure parts ---------------------------------------------------------------------------------------------------


def engine(address: str, *adapters: str, serving: bool = True) -> Engine:
    """An engine as the pool's poll leaves it (no channel: these tests never call it)."""
    info = engine_pb2.GetModelInfoResponse(model_id=MODEL, context_length=128)
    info.lora.adapters.extend(engine_pb2.AdapterInfo(name=a, path=f"/adapters/{a}") for a in adapters)
    load = engine_pb2.GetLoadResponse(accepting=True, adapters=adapters) if serving else None
    return Engine(address, client=cast(Any, None), serving=serving, load=load, info=info)


def pool_of(*engines: Engine, **config: Any) -> EnginePool:
    pool = EnginePool(GatewayConfig(engines=tuple(e.address for e in engines), **config))
    pool.engines = list(engines)
    return pool


def test_an_adapters_calls_stay_on_the_engines_that_hold_it() -> None:
    holder, other = engine("a:1", "x"), engine("b:1")
    pool = pool_of(holder, other)
    prompt = [types_pb2.Input(text="p" * 600)]
    assert {pool.pick(prompt, adapter="x").address for _ in range(8)} == {"a:1"}
    holder.calls = 100  # however busy it is
    assert pool.pick(adapter="x") is holder
    assert {pool.pick().address for _ in range(4)} == {"b:1"}  # the base model: the least busy
    # Failover never moves an adapter's call to an engine without it while another holds it: 503 instead.
    with pytest.raises(APIError) as none_left:
        pool.pick(adapter="x", avoid=[holder])
    assert none_left.value.status == 503
    assert pool.eligible("x", avoid=[holder]) == []
    # An adapter no engine holds (as far as the polls know) may go anywhere: the engine answers for itself.
    assert pool.eligible("gone") == [holder, other]
    holder.serving = False  # its only engine is down: 503 rather than an engine that would answer 404
    assert pool.eligible("x") == [] and pool.eligible() == [other]


def test_prefix_hashes_are_keyed_by_adapter_as_the_engines_blocks_are() -> None:
    data = b"x" * 1024
    plain, salted = prefix_hashes(data), prefix_hashes(data, cache_salt="s")
    assert prefix_hashes(data, adapter="") == plain and prefix_hashes(data, cache_salt="s", adapter="") == salted
    keyed = prefix_hashes(data, adapter="x")
    assert len(keyed) == len(plain) and not set(keyed) & (set(plain) | set(salted))
    assert not set(keyed) & set(prefix_hashes(data, adapter="y"))
    assert not set(keyed) & set(prefix_hashes(data, cache_salt="s", adapter="x"))


def test_a_model_name_resolves_to_the_base_model_or_an_adapter() -> None:
    pool = pool_of(engine("a:1", "x"), engine("b:1", "y", serving=False))
    assert served_model(pool, MODEL) == ServedModel(MODEL)
    assert served_model(pool, "x") == ServedModel("x", "x")
    assert served_model(pool, "y") == ServedModel("y", "y")  # a down engine's: 503 at pick, not 404 here
    with pytest.raises(APIError) as unknown:
        served_model(pool, "gpt-4o")
    error = unknown.value
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
    assert f"`{MODEL}` and its LoRA adapters `x`, `y`" in error.message
    assert base_model(pool, MODEL) == MODEL
    with pytest.raises(APIError) as pooled:
        base_model(pool, "x")
    assert (pooled.value.status, pooled.value.param) == (400, "model")
    assert [a.name for a in pool.adapters()] == ["x", "y"]


def test_the_engine_requests_carry_the_adapter() -> None:
    chat = ChatCompletionRequest.model_validate({"model": "x", "messages": [{"role": "user", "content": "hi"}]})
    assert to_engine.chat_request(chat, chat.messages, "r", adapter="x").adapter == "x"
    assert to_engine.chat_request(chat, chat.messages, "r").adapter == ""
    completion = CompletionRequest.model_validate({"model": "x", "prompt": ["a", "b"]})
    assert [r.adapter for r in to_engine.completion_requests(completion, "r", adapter="x")] == ["x", "x"]
    response = ResponsesRequest.model_validate({"model": "x", "input": "hi"})
    items = responses_to_engine.input_items(response)
    assert responses_to_engine.generate_request(response, items, "r", adapter="x").adapter == "x"


def batch_line(custom_id: str, url: str = CHAT, **body: Any) -> bytes:
    if url == CHAT:
        body.setdefault("messages", [{"role": "user", "content": custom_id}])
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode()


def test_batch_lines_may_name_a_served_adapter_for_generation_only() -> None:
    parsed = lines.parse_line(batch_line("a", model="x"), 1, 0, CHAT, MODEL, adapters=["x"])
    assert lines.line_adapter(parsed, MODEL) == "x"
    [request] = lines.engine_requests(parsed, "r", adapter=lines.line_adapter(parsed, MODEL))
    assert isinstance(request, engine_pb2.GenerateRequest) and request.adapter == "x"
    base = lines.parse_line(batch_line("b", model=MODEL), 1, 0, CHAT, MODEL, adapters=["x"])
    assert lines.line_adapter(base, MODEL) == ""
    with pytest.raises(lines.InvalidLineError) as unknown:
        lines.parse_line(batch_line("c", model="z"), 3, 2, CHAT, MODEL, adapters=["x"])
    assert (unknown.value.error.code, unknown.value.error.param) == ("model_not_found", "body.model")
    assert "LoRA adapters `x`" in unknown.value.error.message
    with pytest.raises(lines.InvalidLineError) as pooled:
        lines.parse_line(batch_line("e", "/v1/embeddings", model="x", input="a"), 4, 3, None, MODEL, adapters=["x"])
    assert (pooled.value.error.code, pooled.value.error.param) == ("invalid_body", "body.model")
    raw = [(1, batch_line("a", model="x")), (2, batch_line("b", model="y"))]
    assert lines.validate(iter(raw), CHAT, MODEL, adapters=["x", "y"]) == (2, [])
    assert [e.line for e in lines.validate(iter(raw), CHAT, MODEL, adapters=["x"])[1]] == [2]


def test_the_usage_label_of_models_is_bounded() -> None:
    ledger = UsageLedger(CollectorRegistry())
    names = [f"adapter-{i}" for i in range(MAX_MODEL_LABELS + 5)]
    for name in names:
        ledger.record("p", name, "interactive", [types_pb2.Usage(prompt_tokens=1)])
    labels = {sample.labels["model"] for metric in ledger.requests.collect() for sample in metric.samples}
    assert len(labels) == MAX_MODEL_LABELS + 1 and OTHER_MODEL in labels
    assert {key.model for key in ledger.take()} == set(names)  # the database keeps every name


# -- against fake engines that serve adapters -----------------------------------------------------------------------


@dataclass
class LoraFakeEngine(FakeEngine):
    """The fake engine with LoRA: LoadAdapter / UnloadAdapter as the engine answers them (INVALID_ARGUMENT naming
    lora_path for a folder in `bad_paths`, ALREADY_EXISTS, NOT_FOUND), the adapters in GetModelInfo and GetLoad,
    and NOT_FOUND for a generation (or Batch item) naming an adapter it does not serve."""

    adapters: dict[str, str] = field(default_factory=dict)  # name -> path
    bad_paths: set[str] = field(default_factory=set)
    used: Counter[str] = field(default_factory=Counter)  # the adapter of every generation received ("" for base)
    held: asyncio.Event | None = None  # when set to a clear event: GetLoad waits for it (a poll held out)
    asked: asyncio.Event = field(default_factory=asyncio.Event)  # set by each GetLoad

    async def GetModelInfo(self, request: Any, context: Any) -> engine_pb2.GetModelInfoResponse:
        info = await super().GetModelInfo(request, context)
        info.lora.max_loras = 4
        info.lora.adapters.extend(engine_pb2.AdapterInfo(name=n, path=p) for n, p in self.adapters.items())
        return info

    async def GetLoad(self, request: Any, context: Any) -> engine_pb2.GetLoadResponse:
        response = engine_pb2.GetLoadResponse(accepting=True, adapters=list(self.adapters))
        self.asked.set()
        if self.held is not None:
            await self.held.wait()
        return response

    async def LoadAdapter(self, request: engine_pb2.LoadAdapterRequest, context: Any) -> engine_pb2.LoadAdapterResponse:
        if request.path in self.bad_paths:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no adapter_config.json in {request.path}",
                                (("ladle-param", "lora_path"),))
        if request.name in self.adapters:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"a LoRA adapter named {request.name!r} is served "
                                "already; unload it first")
        self.adapters[request.name] = request.path
        return engine_pb2.LoadAdapterResponse(adapter=engine_pb2.AdapterInfo(name=request.name, path=request.path))

    async def UnloadAdapter(self, request: engine_pb2.UnloadAdapterRequest, context: Any) -> Any:
        if self.adapters.pop(request.name, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter named {request.name!r} is served")
        return engine_pb2.UnloadAdapterResponse()

    async def Generate(self, request: engine_pb2.GenerateRequest, context: Any) -> engine_pb2.GenerateResponse:
        await self._check_adapter(request.adapter, context)
        return await super().Generate(request, context)

    async def Stream(self, request: engine_pb2.StreamRequest, context: Any) -> AsyncIterator[Any]:
        await self._check_adapter(request.adapter, context)
        async for message in super().Stream(request, context):
            yield message

    async def _check_adapter(self, adapter: str, context: Any) -> None:
        self.used[adapter] += 1
        if adapter and adapter not in self.adapters:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"the model {adapter!r} does not exist")

    async def _answer(self, item: engine_pb2.BatchRequest, results: asyncio.Queue[Any]) -> None:
        adapter = item.request.adapter if item.WhichOneof("pooling") is None else ""
        self.used[adapter] += 1
        if adapter and adapter not in self.adapters:
            response = engine_pb2.BatchResponse(item_id=item.item_id)
            response.error.code = grpc.StatusCode.NOT_FOUND.value[0]
            response.error.message = f"the model {adapter!r} does not exist"
            await results.put(response)
            return
        await super()._answer(item, results)


@contextlib.asynccontextmanager
async def fake_engines(*fakes: LoraFakeEngine) -> AsyncIterator[list[str]]:
    servers = [await start_fake_engine(fake) for fake in fakes]
    try:
        yield [address for _, address in servers]
    finally:
        for server, _ in servers:
            await server.stop(0)


@contextlib.asynccontextmanager
async def gateway(addresses: list[str], tmp_path: Path, **config: Any) -> AsyncIterator[tuple[httpx.AsyncClient,
                                                                                                EnginePool]]:
    """An in-process gateway app (no batch workers) in front of `addresses`, once every engine is SERVING."""
    from gateway.app import create_app

    settings: dict[str, Any] = {"health_interval_s": 0.05, "batch_workers": 0, **config}
    app = create_app(GatewayConfig(engines=tuple(addresses), data_dir=tmp_path, **settings))
    async with app.router.lifespan_context(app):
        pool: EnginePool = app.state.pool
        while len(pool.ready) < len(addresses) or any(e.info is None for e in pool.engines):
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            yield client, pool


def chat(model: str, text: str = "hi") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}]}


async def test_load_select_list_and_unload_on_every_engine(tmp_path: Path) -> None:
    fakes = [LoraFakeEngine(), LoraFakeEngine()]
    async with fake_engines(*fakes) as addresses, gateway(addresses, tmp_path) as (http, _):
        loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a/x"})
        assert loaded.status_code == 200 and loaded.headers["content-type"].startswith("text/plain")
        assert loaded.text == "Success: LoRA adapter 'x' added successfully."
        assert [f.adapters for f in fakes] == [{"x": "/a/x"}] * 2
        cards = (await http.get("/v1/models")).json()["data"]  # at once: the load re-read every engine
        assert [c["id"] for c in cards] == [MODEL, "x"]
        assert (cards[1]["parent"], cards[1]["root"], cards[1]["object"]) == (MODEL, "/a/x", "model")
        assert (await http.get("/v1/models/x")).json() == cards[1]
        for _ in range(2):
            reply = await http.post(CHAT, json=chat("x"))
            assert reply.status_code == 200 and reply.json()["model"] == "x"
        streamed = await http.post(CHAT, json={**chat("x"), "stream": True})
        assert '"model":"x"' in streamed.text.replace(" ", "")
        assert sum(f.used["x"] for f in fakes) == 3 and sum(f.used[""] for f in fakes) == 0
        completion = await http.post("/v1/completions", json={"model": "x", "prompt": ["a", "b"]})
        assert completion.json()["model"] == "x" and sum(f.used["x"] for f in fakes) == 5
        batched = await http.post(CHAT + "/batch", json={"model": "x", "messages": [[chat("x")["messages"][0]]] * 2})
        assert batched.json()["model"] == "x" and sum(f.used["x"] for f in fakes) == 7
        embedded = await http.post("/v1/embeddings", json={"model": "x", "input": "a"})
        assert embedded.status_code == 400 and embedded.json()["error"]["param"] == "model"

        again = await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a/x"})
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
        assert "2 of 2 engines" in again.json()["error"]["message"]
        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
        assert unloaded.text == "Success: LoRA adapter 'x' removed successfully." and fakes[0].adapters == {}
        assert [c["id"] for c in (await http.get("/v1/models")).json()["data"]] == [MODEL]
        gone = await http.post(CHAT, json=chat("x"))
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        missing = await http.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        named_as_base = await http.post("/v1/load_lora_adapter", json={"lora_name": MODEL, "lora_path": "/a/x"})
        assert named_as_base.status_code == 400 and named_as_base.json()["error"]["param"] == "lora_name"
        assert (await http.post("/v1/load_lora_adapter", json={"lora_name": "x"})).json()["error"]["param"] == \
            "lora_path"


async def test_a_load_that_fails_on_one_engine_is_undone_on_the_others(tmp_path: Path) -> None:
    fakes = [LoraFakeEngine(), LoraFakeEngine(bad_paths={"/a/x"})]
    async with fake_engines(*fakes) as addresses, gateway(addresses, tmp_path) as (http, _):
        failed = await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a/x"})
        error = failed.json()["error"]
        assert failed.status_code == 400 and error["param"] == "lora_path"
        assert error["message"].startswith("1 of 2 engines: no adapter_config.json")
        assert "unloaded again from the 1 engines that had loaded it" in error["message"]
        assert [f.adapters for f in fakes] == [{}, {}]
        assert (await http.post(CHAT, json=chat("x"))).status_code == 404


async def test_an_adapter_unloaded_behind_the_gateways_back_is_a_404(tmp_path: Path) -> None:
    fake = LoraFakeEngine()
    async with fake_engines(fake) as addresses, gateway(addresses, tmp_path, health_interval_s=60) as (http, pool):
        assert (await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a/x"})).status_code \
            == 200
        del fake.adapters["x"]  # the gateway's last poll still lists it: the engine's NOT_FOUND answers
        assert pool.adapter("x") is not None
        gone = await http.post(CHAT, json=chat("x"))
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert fake.used["x"] == 1


async def test_the_adapter_routes_are_for_admin_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-admin ops admin\nsk-project team\n")
    async with fake_engines(LoraFakeEngine()) as addresses, \
            gateway(addresses, tmp_path, api_keys_file=keys) as (http, _):
        body = {"lora_name": "x", "lora_path": "/a/x"}
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            refused = await http.post(route, json=body, headers={"Authorization": "Bearer sk-project"})
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
            assert (await http.post(route, json=body)).status_code == 401
        admin = {"Authorization": "Bearer sk-admin"}
        assert (await http.post("/v1/load_lora_adapter", json=body, headers=admin)).status_code == 200
        project = {"Authorization": "Bearer sk-project"}  # any project's key may then use the adapter
        assert (await http.post(CHAT, json=chat("x"), headers=project)).json()["model"] == "x"
        assert (await http.post("/v1/unload_lora_adapter", json=body, headers=admin)).status_code == 200


async def test_batch_lines_of_an_adapter_run_on_the_engine_that_holds_it() -> None:
    holder, other = LoraFakeEngine(adapters={"x": "/a/x"}), LoraFakeEngine()
    async with fake_engines(other, holder) as addresses:
        pool = EnginePool(GatewayConfig(engines=tuple(addresses), health_interval_s=0.05))
        await pool.start()
        try:
            while len(pool.ready) < 2 or any(e.info is None for e in pool.engines):
                await asyncio.sleep(0.01)
            raw = [batch_line(f"{i}", model="x" if i % 3 else MODEL) for i in range(12)]
            by_address = {e.address: e for e in pool.engines}
            by_address[addresses[1]].calls = 5  # busier: the first call goes to the engine without the adapter

            async def source() -> AsyncIterator[lines.InputLine]:
                for index, item in enumerate(raw):
                    yield lines.parse_line(item, index + 1, index, None, None)

            results: list[LineResult] = []
            assert await LineRunner(pool, MODEL).run(source(), results.append, asyncio.Event())
        finally:
            await pool.close()
    # Line 0 (the base model) ran on the other engine; line 1 ended that call and went to the adapter's engine.
    assert other.used[""] >= 1 and other.used["x"] == 0 and holder.used["x"] == 8 and holder.calls >= 1
    assert all(r.ok for r in results), [r.record for r in results if not r.ok]
    models = {r.line.custom_id: r.record["response"]["body"]["model"] for r in results}
    assert models == {f"{i}": "x" if i % 3 else MODEL for i in range(12)}


async def test_an_adapters_call_fails_over_only_to_engines_that_hold_it() -> None:
    holder, spare, other = (LoraFakeEngine(adapters={"x": "/a/x"}), LoraFakeEngine(adapters={"x": "/a/x"}),
                            LoraFakeEngine())
    async with fake_engines(holder, spare, other) as addresses:
        pool = EnginePool(GatewayConfig(engines=tuple(addresses), health_interval_s=60, request_timeout_s=10))
        await pool.start()
        try:
            while len(pool.ready) < 3 or any(e.info is None for e in pool.engines):
                await asyncio.sleep(0.01)
            body = ChatCompletionRequest.model_validate(chat("x"))
            request = to_engine.chat_request(body, body.messages, "r", adapter="x")
            holder.unavailable = True
            assert (await calls.generate(pool, request)).choices[0].text == "HI"  # on the spare
            spare.unavailable = True
            with pytest.raises(APIError) as failed:  # both holders down: 503, never the engine without it
                await calls.generate(pool, request)
            assert failed.value.status == 503 and other.used["x"] == 0
        finally:
            await pool.close()


async def test_a_poll_that_a_failed_call_overtook_neither_revives_the_engine_nor_hides_its_comeback(
        tmp_path: Path) -> None:
    """A poll answered before the engine restarted (and a call then found it UNAVAILABLE) is dropped: the engine
    stays down until the next poll, which finds it SERVING and gives it its adapters back."""
    fake = LoraFakeEngine()
    async with fake_engines(fake) as addresses, gateway(addresses, tmp_path, health_interval_s=60) as (http, pool):
        assert (await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a/x"})
                ).status_code == 200
        engine = pool.engines[0]
        fake.held, fake.asked = asyncio.Event(), asyncio.Event()
        poll = asyncio.create_task(pool.refresh())
        await fake.asked.wait()  # the poll is out: SERVING, with "x"
        fake.adapters.clear()  # the engine restarts ...
        pool.mark_down(engine)  # ... and a call finds it UNAVAILABLE
        fake.held.set()
        await poll
        assert not engine.serving and not fake.adapters
        await pool.refresh()  # the next poll: the comeback
        # the load, then the model info that lists it (a second call: on a loaded machine the first lands alone)
        await until(lambda: fake.adapters == {"x": "/a/x"} and [a.name for a in pool.adapters()] == ["x"])
        assert engine.serving


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait for `condition`, polling every 10 ms; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def test_an_engine_that_comes_back_gets_the_recorded_adapters_again(tmp_path: Path) -> None:
    """Loads are recorded and unloads forgotten; an engine that turns SERVING again without its adapters (as after
    a restart) is given the recorded ones back, and one that cannot load an adapter serves on without it."""
    fakes = [LoraFakeEngine(), LoraFakeEngine()]
    async with fake_engines(*fakes) as addresses, gateway(addresses, tmp_path) as (http, pool):
        for name in ("x", "y"):
            assert (await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"/a/{name}"})
                    ).status_code == 200
        assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "y"})).status_code == 200
        fakes[1].adapters.clear()  # its process restarted: --lora-modules only (none here)
        fakes[1].bad_paths = set()
        pool.mark_down(pool.engines[1])
        await until(lambda: bool(fakes[1].adapters))  # a health check, then the load (slow on a loaded machine)
        assert fakes[1].adapters == {"x": "/a/x"}  # "y" was unloaded: not brought back
        assert fakes[0].adapters == {"x": "/a/x"}

        fakes[0].adapters.clear()
        fakes[0].bad_paths = {"/a/x"}  # its host lost the folder
        pool.mark_down(pool.engines[0])
        await until(lambda: pool.engines[0].serving)
        await asyncio.sleep(0.2)
        assert fakes[0].adapters == {} and pool.engines[0].serving
        assert (await http.post(CHAT, json=chat("x"))).status_code == 200  # served by the engine that holds it
