"""The engines behind the gateway: one gRPC channel each, their health and load polled in the background, and
the choice of engine for each call.

Engines are configured as `HOST:PORT` (one engine; the channel resolves the name itself) or `dns:HOST:PORT`
(every address the name resolves to is one engine, resolved again every `resolve_interval_s`: a Kubernetes
headless Service, say). An engine that appears is polled and joins; one that disappears stops receiving calls
and its channel closes once its calls have ended.

An engine receives calls only while its grpc.health.v1 status for ladle.v1.EngineService is SERVING; among
those, `gateway.routing.Router` chooses (cache-aware by default). A call that fails with UNAVAILABLE marks its
engine down until the next poll finds it SERVING again; an engine that comes back starts with an empty prefix
record (a restarted engine's cache is empty).

Every call carries `config.engine_auth_token` when one is set. An engine that refuses this gateway's token
(UNAUTHENTICATED: its --auth-token-file and the gateway's --engine-auth-token-file differ) is not serving for
this gateway, whatever its health says (health needs no token): the poll's GetModelInfo / GetLoad are refused,
it receives no calls, and a request that finds no engine gets 503 naming the refusal instead of waiting.

LoRA adapters: each poll's GetLoad names the adapters an engine serves; when they differ from those its cached
GetModelInfo lists (an adapter loaded or unloaded since, by this gateway or by anyone else), the model info is read
again. `adapter` and `adapters` answer from that info; `pick` sends an adapter's calls only to the SERVING engines
that hold it while any does (`eligible`). `refresh` re-reads every engine at once, after this gateway changed them.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2

from gateway.config import DNS_PREFIX, GatewayConfig
from gateway.errors import APIError, engine_refused, no_engine
from gateway.routing import BYTES_PER_TOKEN, CHUNK_BYTES, PrefixRecord, Reason, Router, input_bytes, prefix_hashes
from ladle.client import AsyncEngineClient
from ladle.v1 import engine_pb2, types_pb2

log = structlog.get_logger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(eq=False)  # an engine is itself: compared (and hashed) by identity
class Engine:
    """One engine: its client and what the last poll saw."""

    address: str
    client: AsyncEngineClient
    serving: bool = False
    load: engine_pb2.GetLoadResponse | None = None
    info: engine_pb2.GetModelInfoResponse | None = None
    calls: int = 0  # calls this gateway has in flight on it
    refused: str | None = None  # why the engine refuses this gateway's calls (UNAUTHENTICATED), if it does
    record: PrefixRecord = field(default_factory=PrefixRecord)
    downs: int = 0  # times a call found it unavailable (EnginePool.mark_down): a poll out meanwhile is stale

    @property
    def busy(self) -> int:
        queued = (self.load.running + self.load.waiting) if self.load is not None else 0
        return queued + self.calls

    @property
    def adapters(self) -> list[engine_pb2.AdapterInfo]:
        """The LoRA adapters the engine serves, as its model info last listed them."""
        return list(self.info.lora.adapters) if self.info is not None else []

    def holds(self, adapter: str) -> bool:
        """Whether the engine serves `adapter`, as its last poll saw (its load; else its model info)."""
        if self.load is not None:
            return adapter in self.load.adapters
        return any(a.name == adapter for a in self.adapters)


def adapters_changed(info: engine_pb2.GetModelInfoResponse, load: engine_pb2.GetLoadResponse) -> bool:
    """Whether the adapters an engine's load names differ from those its (older) model info lists."""
    return {a.name for a in info.lora.adapters} != set(load.adapters)


def unauthenticated(error: grpc.RpcError) -> str | None:
    """The engine's message when `error` is its refusal of our token (UNAUTHENTICATED), else None."""
    if isinstance(error, grpc.aio.AioRpcError) and error.code() is grpc.StatusCode.UNAUTHENTICATED:
        return error.details() or "UNAUTHENTICATED"
    return None


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, as sorted `IP:PORT` strings (IPv6 in brackets)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = {f"[{info[4][0]}]:{port}" if info[0] == socket.AF_INET6 else f"{info[4][0]}:{port}"
                 for info in infos}
    return sorted(addresses)


class EnginePool:
    """Every configured engine, polled every `config.health_interval_s` while `start()`-ed.

    Channels open in `start()` (they belong to the running event loop), so `engines` is empty before it.
    """

    def __init__(self, config: GatewayConfig, resolve: Resolver | None = None) -> None:
        self.config = config
        self.router = Router(config.routing)
        self.engines: list[Engine] = []
        self.routed: Counter[tuple[str, Reason]] = Counter()  # calls sent, by engine and why it was chosen
        self.failovers: Counter[str] = Counter()  # calls sent again elsewhere, by the engine they left
        self._resolve = resolve or resolve_addresses
        # With several engines a call that finds one unavailable goes to another (gateway.calls), at once rather
        # than after the channel's own retries of the same engine.
        self._channel_retries = len(config.engines) == 1 and not config.engines[0].startswith(DNS_PREFIX)
        self._pollers: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        # Run (as a task of its own) when a poll finds an engine SERVING that was not: gateway.adapters gives it
        # back the adapters it lost in a restart.
        self.on_serving: Callable[[Engine], Coroutine[Any, Any, None]] | None = None

    async def start(self) -> None:
        await self._refresh()
        if any(target.startswith(DNS_PREFIX) for target in self.config.engines):
            self._tasks.append(asyncio.create_task(self._re_resolve()))

    async def close(self) -> None:
        tasks = [*self._tasks, *self._pollers.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for engine in self.engines:
            await engine.client.close()
        self.engines, self._pollers, self._tasks = [], {}, []

    @property
    def ready(self) -> list[Engine]:
        return [e for e in self.engines if e.serving]

    def pick(
        self, inputs: Sequence[types_pb2.Input] = (), avoid: Collection[Engine] = (), cache_salt: str = "",
        adapter: str = "",
    ) -> Engine:
        """The engine for a call carrying `inputs` (the first decides the route; all are recorded as sent to
        it) with LoRA `adapter` ("" for the base model), among the `eligible` ones, never one in `avoid`; HTTP
        503 when none is left (naming an engine's refusal of our token, if one refuses it)."""
        candidates = self.eligible(adapter, avoid)
        if not candidates:
            raise self.unavailable()
        by_prefix = self.router.config.policy == "cache_aware" and bool(inputs)
        # Salted with the call's cache_salt and adapter, as the engine keys its blocks: a prefix draws only calls
        # that could hit it there (one project's, with one adapter), never other calls to an engine for nothing.
        hashes = prefix_hashes(input_bytes(inputs[0]), cache_salt=cache_salt, adapter=adapter) if by_prefix else []
        choice = self.router.choose(candidates, hashes)
        engine = candidates[choice.index]
        if by_prefix:
            for other in inputs[1:]:
                engine.record.add(prefix_hashes(input_bytes(other), cache_salt=cache_salt, adapter=adapter))
        self.routed[(engine.address, choice.reason)] += 1
        return engine

    def eligible(self, adapter: str = "", avoid: Collection[Engine] = ()) -> list[Engine]:
        """The SERVING engines a call with LoRA `adapter` may go to, less those in `avoid`: for an adapter, only
        those that hold it, if any engine does (else every one: the engine then answers for itself, NOT_FOUND or
        the output if it has it by now). An adapter's call never goes to an engine without it while another
        holds it, even when those others are avoided or down (then there is none: 503)."""
        only_holders = bool(adapter) and any(e.holds(adapter) for e in self.engines)
        return [e for e in self.engines
                if e.serving and e not in avoid and (not only_holders or e.holds(adapter))]

    def unavailable(self) -> APIError:
        """The 503 for a request no engine can take: naming an engine's refusal of our token if one refuses it."""
        for engine in self.engines:
            if engine.refused is not None and not engine.serving:
                return engine_refused(engine.refused, engine.address)
        return no_engine()

    @property
    def model_id(self) -> str | None:
        """The served model's id: --served-model-name, else what an engine reports; None before any answered."""
        if self.config.served_model_name:
            return self.config.served_model_name
        for engine in self.engines:
            if engine.info is not None:
                return engine.info.model_id
        return None

    def model_info(self) -> engine_pb2.GetModelInfoResponse | None:
        for engine in self.ready + self.engines:
            if engine.info is not None:
                return engine.info
        return None

    def adapters(self) -> list[engine_pb2.AdapterInfo]:
        """The LoRA adapters some engine serves, each once (as the first engine to list it has it: SERVING
        engines first), in the order they list them."""
        found: dict[str, engine_pb2.AdapterInfo] = {}
        for engine in dict.fromkeys(self.ready + self.engines):
            for adapter in engine.adapters:
                found.setdefault(adapter.name, adapter)
        return list(found.values())

    def adapter(self, name: str) -> engine_pb2.AdapterInfo | None:
        """The LoRA adapter `name` if some engine serves it, else None."""
        return next((a for a in self.adapters() if a.name == name), None)

    async def refresh(self) -> None:
        """Poll every engine now, its model info included (after this gateway loaded or unloaded an adapter)."""
        await asyncio.gather(*(self._check(engine, reread_info=True) for engine in self.engines))

    def mark_down(self, engine: Engine, refused: str | None = None) -> None:
        """An engine answered UNAVAILABLE (or refused our token: `refused` says how): route around it until a
        poll finds it SERVING."""
        if engine.serving:
            log.warning("engine unavailable; routing around it", engine=engine.address, refused=refused)
        engine.serving = False
        engine.downs += 1
        engine.refused = refused or engine.refused

    async def wait_ready(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for some engine to be SERVING; whether one is."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.ready and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return bool(self.ready)

    async def _addresses(self) -> list[str] | None:
        """Every engine address the targets name now; None when a name did not resolve (keep what we have)."""
        addresses: list[str] = []
        for target in self.config.engines:
            if not target.startswith(DNS_PREFIX):
                addresses.append(target)
                continue
            host, _, port = target.removeprefix(DNS_PREFIX).rpartition(":")
            try:
                resolved = await self._resolve(host.strip("[]"), int(port))
            except OSError as exc:
                log.warning("cannot resolve engine name; keeping the engines it gave before",
                            target=target, error=str(exc))
                return None
            addresses += resolved
        return list(dict.fromkeys(addresses))

    async def _refresh(self) -> None:
        addresses = await self._addresses()
        if addresses is None:
            return
        known = {engine.address: engine for engine in self.engines}
        for address in addresses:
            if address not in known:
                client = AsyncEngineClient(address, timeout=self.config.request_timeout_s,
                                           retries=self._channel_retries, auth_token=self.config.engine_auth_token,
                                           max_message_bytes=self.config.max_engine_message_bytes)
                engine = Engine(address, client)
                self.engines.append(engine)
                self._pollers[address] = asyncio.create_task(self._poll(engine))
                if known:
                    log.info("engine joined", engine=address)
        for address, engine in known.items():
            if address not in addresses:
                log.info("engine left", engine=address)
                self.engines.remove(engine)
                self._pollers.pop(address).cancel()
                self._tasks = [task for task in self._tasks if not task.done()]
                self._tasks.append(asyncio.create_task(self._retire(engine)))

    async def _re_resolve(self) -> None:
        while True:
            await asyncio.sleep(self.config.resolve_interval_s)
            await self._refresh()

    async def _retire(self, engine: Engine) -> None:
        """Close a departed engine's channel once its calls have ended (or their deadline has passed)."""
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        while engine.calls and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.5)
        await engine.client.close()

    async def _poll(self, engine: Engine) -> None:
        while True:
            await self._check(engine)
            await asyncio.sleep(self.config.health_interval_s)

    async def _check(self, engine: Engine, reread_info: bool = False) -> None:
        """Poll `engine` and record what it answered. An answer that a call's failure (`mark_down`) overtook is
        dropped: the engine stays down until the next poll, which (finding it SERVING) counts as its comeback."""
        timeout = max(1.0, self.config.health_interval_s)
        downs, info = engine.downs, None
        try:
            status = await engine.client.health(timeout=timeout)
            serving = status == health_pb2.HealthCheckResponse.SERVING
            load = await engine.client.load(timeout=timeout) if serving else None
            if load is not None and (
                    reread_info or engine.info is None or adapters_changed(engine.info, load)):
                info = await engine.client.model_info(timeout=timeout)
            refused = None
        except grpc.RpcError as error:
            serving, load, refused = False, None, unauthenticated(error)
        if engine.downs != downs:
            return  # e.g. SERVING from before a restart: it says nothing of what the engine is now
        # Read only now: another poll (a refresh) may have recorded the comeback while this one was out.
        was_serving = engine.serving
        engine.load = load
        if info is not None:  # else kept (while the engine is down too: its model and adapters, as last seen)
            engine.info = info
        if refused is not None and engine.refused is None:
            log.error("the engine refuses this gateway's token; no calls go to it", engine=engine.address,
                      error=refused)
        engine.refused = refused
        if serving and not was_serving:
            engine.record.clear()  # back from a restart (or a failed step): assume its cache starts empty
        if engine.load is not None and engine.load.kv_blocks_total:
            tokens = engine.load.kv_blocks_total * engine.load.kv_block_size
            engine.record.capacity = max(1, tokens * BYTES_PER_TOKEN // CHUNK_BYTES)
            engine.record.trim()
        engine.serving = serving
        if serving != was_serving:
            log.info("engine status changed", engine=engine.address, serving=serving)
        if serving and not was_serving and self.on_serving is not None:
            self._tasks = [task for task in self._tasks if not task.done()]
            self._tasks.append(asyncio.create_task(self.on_serving(engine), name=f"engine-serving-{engine.address}"))
