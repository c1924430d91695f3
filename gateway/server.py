"""Run the gateway under uvicorn: bind, announce the address (port 0 picks a free one), serve until a signal;
SIGHUP reads the API keys and rate limits files again.

With `drain_grace_s` (`ladle gateway --drain-grace`), SIGTERM or SIGINT first turns /health to 503 (`draining`)
while every request is still served, for that many seconds (readiness checks take the gateway out of rotation);
then the listener is quiesced (`ladle.listener`: no connection the kernel completed is reset) and uvicorn shuts
down as without a grace. A second signal during the grace stops at once."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.engines import EnginePool
from gateway.http_protocol import BoundedHeadProtocol
from ladle import listener


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGINT/SIGTERM end `serve` normally (exit status 0 after a graceful
    shutdown) instead of being re-raised once uvicorn is done, which would kill the process by the signal, and
    that SIGHUP calls `on_hangup`."""

    def __init__(self, config: uvicorn.Config, on_hangup: Callable[[], object], app: FastAPI,
                 drain_grace_s: float = 0.0) -> None:
        super().__init__(config)
        self.on_hangup = on_hangup
        self.app = app
        self.drain_grace_s = drain_grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The first signal under a drain grace: /health says `draining`, and the exit comes after the grace."""
        if self.drain_grace_s > 0 and not self.app.state.draining:
            self.app.state.draining = True
            asyncio.get_running_loop().call_later(self.drain_grace_s, super().handle_exit, sig, None)
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.app.state.draining:  # after the grace: take the connections the kernel completed, then close
            for port in {sock.getsockname()[1] for server in self.servers for sock in server.sockets}:
                await listener.quiesce(port)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        loop.add_signal_handler(signal.SIGHUP, self.on_hangup)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)


async def serve(
    config: GatewayConfig,
    host: str,
    port: int,
    announce: Callable[[str], None],
    stop_when: Awaitable[object] | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> int:
    """Serve HTTP on host:port until SIGINT/SIGTERM or until `stop_when` completes; in-flight requests get up to
    `config.shutdown_timeout_s` to finish; a request whose head exceeds `http_protocol.MAX_HEAD_BYTES` is refused
    with 431. `announce` receives the bound URL; `on_ready` the model id once an engine is SERVING (and so /health
    answers 200). Returns 0, or 1 if the port could not be bound. KeysFileError if the API keys file is bad."""
    app = create_app(config)
    server = _Server(
        uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="on",
                       timeout_graceful_shutdown=math.ceil(config.shutdown_timeout_s), http=BoundedHeadProtocol),
        on_hangup=lambda: (app.state.keys.reload(), app.state.limiter.limits.reload()),
        app=app,
        drain_grace_s=config.drain_grace_s,
    )
    task = asyncio.create_task(server.serve())
    if on_ready is not None:
        ready = asyncio.create_task(_when_ready(app.state.pool, on_ready))
        task.add_done_callback(lambda _: ready.cancel())
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    watcher: asyncio.Future[object] | None = None
    if server.started:
        bound_host, bound_port = server.servers[0].sockets[0].getsockname()[:2]
        announce(f"http://{bound_host}:{bound_port}")
        if stop_when is not None:
            watcher = asyncio.ensure_future(stop_when)
            watcher.add_done_callback(lambda _: setattr(server, "should_exit", True))
    try:
        await task
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
    return 0 if server.started else 1


async def _when_ready(pool: EnginePool, on_ready: Callable[[str], None]) -> None:
    while not await pool.wait_ready(timeout=60.0):
        pass
    on_ready(pool.model_id or "")
