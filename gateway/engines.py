"""The engines behind the gateway: one gRPC channel each, their health and load polled in the background, and
the choice of engine for each call.

An engine receives calls only while its grpc.health.v1 status for ladle.v1.EngineService is SERVING. Among
those, the one with the fewest running + waiting sequences is chosen (round robin between equals), so a slow or
busy engine gets less new work. A call that fails with UNAVAILABLE marks its engine down until the next poll
finds it SERVING again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health_pb2

from gateway.config import GatewayConfig
from gateway.errors import no_engine
from ladle.client import AsyncEngineClient
from ladle.v1 import engine_pb2

log = structlog.get_logger(__name__)


@dataclass
class Engine:
    """One engine: its client and what the last poll saw."""

    address: str
    client: AsyncEngineClient
    serving: bool = False
    load: engine_pb2.GetLoadResponse | None = None
    info: engine_pb2.GetModelInfoResponse | None = None
    calls: int = field(default=0)  # calls this gateway has in flight on it

    @property
    def busy(self) -> int:
        queued = (self.load.running + self.load.waiting) if self.load is not None else 0
        return queued + self.calls


class EnginePool:
    """Every configured engine, polled every `config.health_interval_s` while `start()`-ed."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.engines = [
            Engine(address, AsyncEngineClient(address, timeout=config.request_timeout_s))
            for address in config.engines
        ]
        self._turn = itertools.count()
        self._pollers: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._pollers = [asyncio.create_task(self._poll(engine)) for engine in self.engines]

    async def close(self) -> None:
        for task in self._pollers:
            task.cancel()
        for task in self._pollers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for engine in self.engines:
            await engine.client.close()

    @property
    def ready(self) -> list[Engine]:
        return [e for e in self.engines if e.serving]

    def pick(self) -> Engine:
        """The engine for the next call; HTTP 503 when none is SERVING."""
        turn = next(self._turn)
        ready = [(e.busy, (i - turn) % len(self.engines), e) for i, e in enumerate(self.engines) if e.serving]
        if not ready:
            raise no_engine()
        return min(ready, key=lambda entry: entry[:2])[2]

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

    def mark_down(self, engine: Engine) -> None:
        """An engine answered UNAVAILABLE: route around it until a poll finds it SERVING."""
        if engine.serving:
            log.warning("engine unavailable; routing around it", engine=engine.address)
        engine.serving = False

    async def wait_ready(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for some engine to be SERVING; whether one is."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.ready and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return bool(self.ready)

    async def _poll(self, engine: Engine) -> None:
        while True:
            await self._check(engine)
            await asyncio.sleep(self.config.health_interval_s)

    async def _check(self, engine: Engine) -> None:
        timeout = max(1.0, self.config.health_interval_s)
        was_serving = engine.serving
        try:
            status = await engine.client.health(timeout=timeout)
            serving = status == health_pb2.HealthCheckResponse.SERVING
            if serving and engine.info is None:
                engine.info = await engine.client.model_info(timeout=timeout)
            engine.load = await engine.client.load(timeout=timeout) if serving else None
        except grpc.RpcError:
            serving = False
            engine.load = None
        engine.serving = serving
        if serving != was_serving:
            log.info("engine status changed", engine=engine.address, serving=serving)
