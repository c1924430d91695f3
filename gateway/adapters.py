"""LoRA adapters loaded and unloaded on every engine of the pool: what `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter` do (`gateway.routers.adapters`).

Each engine reads an adapter's folder on its own host, so a load goes to every SERVING engine at once, and it is
all or nothing: when some engines fail, the adapter is unloaded again from those that loaded it, and the error
names each engine's failure (and any engine whose unload failed too, which then still holds it). An unload goes to
every SERVING engine too; an engine that does not hold the adapter is no failure unless none held it (404).
Engines that are down at the time are left as they are, and requests for an adapter go only to the engines that
hold it (`EnginePool.eligible`). After either, the pool reads every engine again at once, so the next request and
`GET /v1/models` see the change (other gateway replicas see it at their next poll).

`AdapterRegistry` records what the routes loaded (name and folder, in the database the replicas share) and forgets
what they unloaded. An engine restarts with its `--lora-modules` adapters only, so whenever an engine turns SERVING
(back from a restart, or new behind a `dns:` name) the gateway that sees it loads every recorded adapter it lacks
(`restore`; an engine that has it already, loaded meanwhile by another replica, is no failure). An adapter that an
engine cannot load (its folder missing on that host, say) is logged, and that engine serves on without it.

An engine's refusal is the route's answer: INVALID_ARGUMENT (a folder holding no adapter the model takes; its
`param` is lora_path or lora_name), ALREADY_EXISTS (the name is taken) and FAILED_PRECONDITION (an engine started
without LoRA) are 400s with the engine's message, NOT_FOUND a 404; anything else as any engine call's failure
(`errors.from_rpc_error`: 503 for an engine that went away, ...). With several engines the message names each
engine's failure; the status is the most specific one (a 4xx before a 5xx).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import sqlalchemy
import sqlalchemy.exc
import structlog

from gateway import calls
from gateway.engines import Engine, EnginePool
from gateway.errors import APIError, from_rpc_error, invalid
from gateway.store.adapters import AdapterStore

log = structlog.get_logger(__name__)

Call = Callable[[Engine], Awaitable[Any]]


class AdapterRegistry:
    """Loads and unloads adapters on every engine (`load_adapter`, `unload_adapter`), recording them in the
    database once it is `open`, and gives a recorded adapter back to an engine that turns SERVING (`restore`)."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self._store: AdapterStore | None = None

    def open(self, db: sqlalchemy.Engine) -> None:
        """Record loads in `db` from now on, and restore them to every engine that turns SERVING."""
        self._store = AdapterStore(db)
        self.pool.on_serving = self.restore

    async def load(self, name: str, path: str) -> None:
        await load_adapter(self.pool, name, path)
        if self._store is not None:
            await asyncio.to_thread(self._store.record, name, path, int(time.time()))

    async def unload(self, name: str) -> None:
        try:
            await unload_adapter(self.pool, name)
        finally:  # however the engines answered, nothing gives the adapter back to an engine any more
            if self._store is not None:
                await asyncio.to_thread(self._store.forget, name)

    async def restore(self, engine: Engine) -> None:
        """Load onto `engine` every recorded adapter it does not serve; log the ones it refuses."""
        if self._store is None:
            return
        try:
            loaded = await asyncio.to_thread(self._store.loaded)
        except sqlalchemy.exc.SQLAlchemyError:
            log.warning("cannot read the loaded adapters; an engine back may lack some", engine=engine.address,
                        exc_info=True)
            return
        missing = {name: path for name, path in loaded.items() if not engine.holds(name)}
        if not missing:
            return
        restored = []
        for name, path in missing.items():
            try:
                with calls.holding(self.pool, engine):
                    await engine.client.load_adapter(name, path)
            except grpc.RpcError as error:
                if _code(error) is not grpc.StatusCode.ALREADY_EXISTS:
                    log.warning("an engine could not load an adapter back; it serves on without it",
                                engine=engine.address, adapter=name, path=path, error=adapter_error(error).message)
                    continue
            restored.append(name)
        if restored:
            log.info("adapters loaded onto an engine that came back", engine=engine.address, adapters=restored)
            await self.pool.refresh()


async def load_adapter(pool: EnginePool, name: str, path: str) -> None:
    """Serve the PEFT adapter in folder `path` as the model `name` on every SERVING engine, or on none; APIError
    saying why not."""
    if name == pool.model_id:
        raise invalid(f"{name!r} is the served model's id; give the adapter another name", "lora_name")
    engines = _targets(pool)
    try:
        outcomes = await _on_each(pool, engines, lambda engine: engine.client.load_adapter(name, path))
        failed = {engine: error for engine, error in outcomes.items() if error is not None}
        if not failed:
            return
        loaded = [engine for engine, error in outcomes.items() if error is None]
        undone = await _on_each(pool, loaded, lambda engine: engine.client.unload_adapter(name))
        kept = [engine.address for engine, error in undone.items() if error is not None]
        note = ""
        if loaded:
            note = f"; unloaded again from the {len(loaded) - len(kept)} engines that had loaded it"
        if kept:
            note += f", except {', '.join(kept)}, whose unload failed too: it still serves the adapter there"
        raise _failure(failed, len(engines), pool.config.retry_after_s, note)
    finally:
        await pool.refresh()


async def unload_adapter(pool: EnginePool, name: str) -> None:
    """Stop serving adapter `name` on every SERVING engine; 404 when none served it, APIError for an engine that
    failed otherwise."""
    engines = _targets(pool)
    try:
        outcomes = await _on_each(pool, engines, lambda engine: engine.client.unload_adapter(name))
    finally:
        await pool.refresh()
    unloaded = [engine.address for engine, error in outcomes.items() if error is None]
    failed = {
        engine: error for engine, error in outcomes.items()
        if error is not None and not (unloaded and _code(error) is grpc.StatusCode.NOT_FOUND)
    }
    if failed:
        note = f"; it was unloaded from {', '.join(unloaded)}" if unloaded else ""
        raise _failure(failed, len(engines), pool.config.retry_after_s, note)


def adapter_error(error: grpc.RpcError, retry_after_s: int = 1) -> APIError:
    """The HTTP error for an engine's refusal of LoadAdapter or UnloadAdapter."""
    code = _code(error)
    details = (error.details() if isinstance(error, grpc.aio.AioRpcError) else None) or str(error)
    if code is grpc.StatusCode.ALREADY_EXISTS:
        return APIError(400, details, param="lora_name")
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return APIError(400, details)
    if code is grpc.StatusCode.NOT_FOUND:
        return APIError(404, details, param="lora_name", code="model_not_found")
    return from_rpc_error(error, retry_after_s)  # INVALID_ARGUMENT: 400 naming the engine's param


def _targets(pool: EnginePool) -> list[Engine]:
    engines = pool.ready
    if not engines:
        raise pool.unavailable()
    return engines


async def _on_each(pool: EnginePool, engines: Sequence[Engine], call: Call) -> dict[Engine, grpc.RpcError | None]:
    """`call` on each engine at once (each held as one call: `calls.holding`); each engine's failure, or None."""

    async def one(engine: Engine) -> grpc.RpcError | None:
        try:
            with calls.holding(pool, engine):
                await call(engine)
        except grpc.RpcError as error:
            return error
        return None

    results = await asyncio.gather(*(one(engine) for engine in engines))
    return dict(zip(engines, results, strict=True))


def _failure(failed: dict[Engine, grpc.RpcError], engines: int, retry_after_s: int, note: str) -> APIError:
    """One error for the engines' failures: the most specific status (a 4xx before a 5xx); with several engines, a
    message naming each engine's failure (once, when they all say the same)."""
    errors = {engine: adapter_error(error, retry_after_s) for engine, error in failed.items()}
    chosen = min(errors.values(), key=lambda error: error.status)
    messages = {error.message for error in errors.values()}
    if engines > 1 and len(messages) > 1:
        chosen.message = "; ".join(f"engine {engine.address}: {error.message}" for engine, error in errors.items())
    elif engines > 1:
        chosen.message = f"{len(errors)} of {engines} engines: {chosen.message}"
    chosen.message += note
    return chosen


def _code(error: grpc.RpcError) -> grpc.StatusCode | None:
    return error.code() if isinstance(error, grpc.aio.AioRpcError) else None
