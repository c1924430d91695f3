"""Build, start and drain the engine's grpc.aio server: EngineService plus standard health and reflection.

Lifecycle: the port is reserved first (bound, not listening: a taken port fails at once, and port 0 gets its
number), the model loads (off the event loop) and one tiny generation warms it up; only then does the server
listen, with health SERVING. An engine that is not ready refuses connections, so a load balancer without health
checks (nginx) sends nothing to a restarting engine, and one with them sees the probe fail until it is ready.
With `auth_tokens` every RPC but health needs one of them as a bearer token (`auth.BearerTokenInterceptor`).

On SIGTERM or SIGINT health turns NOT_SERVING. Without a `drain_grace`, new calls are refused with UNAVAILABLE
at once; with one, they are served for that many seconds (balancers' health checks notice meanwhile), then the
server stops listening. Calls in flight finish (those still running after `shutdown_timeout` are aborted and
end with finish reason ABORT), the server stops and `serve` returns 0.

Under tensor parallelism a worker that exits ends the engine at once: health turns NOT_SERVING, new calls are
refused and every call in flight ends UNAVAILABLE, then the process exits with status 1 within `LOST_WORKER_EXIT_S`
(the core may be blocked in a collective with the dead rank: nothing waits for it), and the other workers follow.

A failed step (a bug, a device error) fails the requests that were in it (INTERNAL) and health turns
NOT_SERVING while one probe generation checks the engine: if it passes, health returns to SERVING; if it fails,
or steps failed `MAX_STEP_FAILURES` times within `STEP_FAILURE_WINDOW_S`, the engine drains and `serve`
returns 1, so a supervisor restarts a process that cannot serve rather than leaving one that fails every call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine_server.config import EngineConfig
from engine_server.core.engine_core import EngineCore
from engine_server.errors import EngineUnavailableError
from engine_server.host_memory import freeze_startup_heap
from engine_server.server.auth import BearerTokenInterceptor
from engine_server.server.servicer import EngineServicer
from engine_server.server.serving import ServingEngine
from engine_server.server.tracing import RpcTracing
from engine_server.structured.compiler import GrammarCompilerConfig
from ladle import listener
from ladle.tracing import Tracing
from ladle.v1 import engine_pb2, engine_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME: str = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
# The longest context as token ids is ~5 bytes per id on the wire (varint): 128k tokens are ~640 KiB. 64 MiB
# leaves room for that plus its text, and for a whole n=16 result with top_logprobs.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Clients may ping an idle channel every 20 s or more (our client pings every 30 s), so a channel left idle
# for ten minutes behind a NAT or proxy stays open; the server never answers such pings with GOAWAY.
MIN_CLIENT_PING_INTERVAL_MS = 20_000
SERVER_KEEPALIVE_MS = 5 * 60 * 1000  # the server's own pings find dead peers of long idle channels
DRAIN_ABORT_WAIT_S = 10.0  # after aborting at the shutdown timeout, how long aborted calls get to end
STOP_GRACE_S = 1.0  # for the last messages of finished calls to leave
MAX_STEP_FAILURES = 3  # failed steps within STEP_FAILURE_WINDOW_S after which the engine exits instead
STEP_FAILURE_WINDOW_S = 60.0
RECOVERY_PROBE_TIMEOUT_S = 60.0  # the probe generation after a failed step
LOST_WORKER_EXIT_S = 1.0  # after a tensor-parallel worker is lost: time for the failed calls' statuses to leave


@dataclass(frozen=True)
class ServerConfig:
    """Where and how `ladle engine` serves."""

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50051  # 0: pick a free port (the chosen address is reported)
    shutdown_timeout: float = 30.0
    # Seconds after SIGTERM during which health says NOT_SERVING but new calls are still served, so a load
    # balancer's health checks take the engine out of rotation before it refuses anything.
    drain_grace: float = 0.0
    grammar: GrammarCompilerConfig = field(default_factory=GrammarCompilerConfig)  # constraint compile limits
    # Tokens one of which every call but health must carry (auth.py; `--auth-token-file`); empty: no check.
    auth_tokens: tuple[str, ...] = field(default=(), repr=False)
    # Where traces go (ladle.tracing; the OTEL_* variables too); None and no variable: no traces.
    otlp_traces_endpoint: str | None = None


def server_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),  # two engines never share a port
    ]


class EngineServer:
    """One grpc.aio server for one engine. Create and use it inside a running event loop."""

    def __init__(self, config: ServerConfig, prepare_core: Callable[[EngineCore], None] | None = None) -> None:
        """`prepare_core`: see `ServingEngine.start` (None in `ladle engine`)."""
        self.config = config
        self._prepare_core = prepare_core
        interceptors = [BearerTokenInterceptor(config.auth_tokens)] if config.auth_tokens else None
        self.server = grpc.aio.server(options=server_options(), interceptors=interceptors)
        self.tracing = Tracing.configure("ladle-engine", config.otlp_traces_endpoint)
        self.servicer = EngineServicer(RpcTracing(self.tracing.tracer))
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]  # aio is imported, not declared
        self.engine: ServingEngine | None = None
        self.stop_requested = asyncio.Event()  # set by SIGTERM / SIGINT, or by a fault the engine cannot survive
        self.exit_code = 0
        self._step_failures: list[float] = []  # monotonic times of recent failed steps
        self._recovery: asyncio.Task[None] | None = None
        self._reserved: socket.socket | None = None  # holds the port until the server listens on it
        self._bind = ""
        self._port = 0
        self._loop: asyncio.AbstractEventLoop | None = None  # set when a tensor-parallel engine has loaded
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)

    async def start(self) -> str:
        """Reserve the port (bound, not yet listening); returns the address, e.g. '127.0.0.1:50051'. Raises
        RuntimeError when the port cannot be bound."""
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        host = self.config.host
        bind_host = f"[{host}]" if ":" in host else host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        reserved = socket.socket(family, socket.SOCK_STREAM)
        try:
            reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc's own listener does
            reserved.bind((host, self.config.port))
        except OSError as exc:
            reserved.close()
            raise RuntimeError(f"cannot bind {bind_host}:{self.config.port}: {exc}") from exc
        self._reserved = reserved
        self._port = reserved.getsockname()[1]
        self._bind = f"{bind_host}:{self._port}"
        return self._bind

    async def load(self) -> None:
        """Load the model off the event loop, warm it up, then admit calls, report SERVING and listen."""
        self.engine = await ServingEngine.start(self.config.engine, self.config.grammar, self._prepare_core)
        await self.engine.warm_up()
        freeze_startup_heap()
        self.engine.loop.on_step_failure = self._step_failed
        workers = self.engine.loop.core.workers
        if workers is not None:
            self._loop = asyncio.get_running_loop()
            workers.on_lost(self._worker_lost_threadsafe)
        self.servicer.attach(self.engine)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.release_port()
        if not self.server.add_insecure_port(self._bind):
            raise RuntimeError(f"cannot listen on {self._bind}: the port was taken while the model loaded")
        await self.server.start()
        log.info("engine serving", model=self.engine.info.model_id, device=self.engine.info.device, address=self._bind)

    def release_port(self) -> None:
        """Give up the reserved port (before listening on it, or when stopping without ever listening)."""
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    def _worker_lost_threadsafe(self, rank: int, exit_status: int | None) -> None:
        """A tensor-parallel worker is gone (called off the event loop): report it on the loop, and exit with
        status 1 after LOST_WORKER_EXIT_S whatever the loop manages meanwhile."""
        log.error("a tensor-parallel worker is gone: the engine stops", rank=rank, exit_status=exit_status)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: exit below all the same
                self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._worker_lost(rank)))
        time.sleep(LOST_WORKER_EXIT_S)
        os._exit(1)

    async def _worker_lost(self, rank: int) -> None:
        """NOT_SERVING, refuse new calls, end every call in flight UNAVAILABLE."""
        self.servicer.start_draining()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.engine is not None:
            error = EngineUnavailableError(f"tensor-parallel worker {rank} of this engine is gone; it is stopping")
            failed = self.engine.loop.fail_all(error)
            log.error("calls in flight ended UNAVAILABLE", calls=failed)

    def _step_failed(self) -> None:
        """A step failed (its requests already did): check the engine, unless a check is already running."""
        now = time.monotonic()
        self._step_failures = [t for t in self._step_failures if now - t < STEP_FAILURE_WINDOW_S] + [now]
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.create_task(self._recover())

    async def _recover(self) -> None:
        """NOT_SERVING; then SERVING again if a probe generation passes, else stop with exit status 1."""
        assert self.engine is not None
        if self.stop_requested.is_set():
            return
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        failures = len(self._step_failures)
        if failures >= MAX_STEP_FAILURES:
            reason = f"{failures} failed steps within {STEP_FAILURE_WINDOW_S:.0f} s"
        else:
            try:
                await asyncio.wait_for(self.engine.warm_up(), RECOVERY_PROBE_TIMEOUT_S)
            except Exception as exc:
                reason = f"the probe generation after a failed step failed: {type(exc).__name__}"
            else:
                if self.stop_requested.is_set():
                    return
                await self._set_health(health_pb2.HealthCheckResponse.SERVING)
                log.warning("engine recovered after a failed step; serving again", recent_failures=failures)
                return
        log.error("the engine cannot serve; stopping with exit status 1", reason=reason)
        self.exit_code = 1
        self.stop_requested.set()

    async def drain(self) -> None:
        """NOT_SERVING; refuse new calls (at once, or after the grace); let calls in flight finish (up to the
        timeout, then abort them); stop.

        Without a grace, new calls are answered UNAVAILABLE while health says NOT_SERVING. With one, calls are
        served as usual during it (balancers are taking the engine out of rotation), then the server stops
        listening: a new connection is refused and an open one is told (GOAWAY) to take new calls elsewhere,
        which a proxy can do safely, as the engine never saw them. Before it stops listening the listener is
        quiesced (`listener.quiesce`): the kernel takes no new connection and the server accepts the ones it
        took, which closing the listener would reset with their requests already sent.
        """
        log.info(
            "draining",
            in_flight=self.servicer.in_flight,
            timeout_s=self.config.shutdown_timeout,
            grace_s=self.config.drain_grace,
        )
        self.release_port()  # stopped while loading: the port was never listened on
        await self.health.enter_graceful_shutdown()
        stopped: asyncio.Task[None] | None = None
        if self.config.drain_grace > 0 and self.engine is not None:
            await asyncio.sleep(self.config.drain_grace)
            await listener.quiesce(self._port)
            limit = self.config.shutdown_timeout + DRAIN_ABORT_WAIT_S + STOP_GRACE_S
            stopped = asyncio.create_task(self.server.stop(limit))
            self.servicer.start_draining(refuse_new=False)
        else:
            self.servicer.start_draining()
        try:
            await asyncio.wait_for(self.servicer.wait_idle(), self.config.shutdown_timeout)
        except TimeoutError:
            log.warning("shutdown timeout reached; aborting the requests still running")
            if self.engine is not None:
                self.engine.loop.abort_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.servicer.wait_idle(), DRAIN_ABORT_WAIT_S)
        if stopped is None:
            await self.server.stop(STOP_GRACE_S)
        else:
            await stopped
        if self.engine is not None:
            await self.engine.close()
        await asyncio.to_thread(self.tracing.shutdown)
        log.info("stopped")


async def serve(config: ServerConfig, on_listening: Callable[[str], None] | None = None) -> int:
    """Run the engine server until SIGTERM/SIGINT, then drain. Returns the process exit status."""
    server = EngineServer(config)
    try:
        address = await server.start()
    except RuntimeError as exc:  # grpc cannot bind: the port is taken or the host is not ours
        log.error("cannot listen", host=config.host, port=config.port, error=str(exc))
        return 2
    if on_listening is not None:
        on_listening(address)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop_requested.set)
    loading = asyncio.create_task(server.load())
    stopping = asyncio.create_task(server.stop_requested.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and loading.exception() is not None:
        log.error("the engine failed to start", exc_info=loading.exception())
        stopping.cancel()
        server.release_port()
        await server.server.stop(0)
        return 1
    await stopping
    loading.cancel()  # a stop during loading: nothing was admitted, so nothing to drain but the server
    await server.drain()
    return server.exit_code
