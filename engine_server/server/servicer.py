"""The ladle.v1.EngineService servicer: validates, converts, calls the ServingEngine, maps errors to status codes.

Admission: until a model is attached, and once draining has begun, Generate / Stream / Batch / Tokenize answer
UNAVAILABLE; GetLoad always answers (accepting=false then) so load balancers can see the state. Every failure
leaves through `_fail`, which turns the exception into one status code with a clear message (INTERNAL for
anything unexpected, logged with its traceback); the engine goes on serving every other call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, NoReturn, TypeVar

import grpc
import structlog

from engine_server.core.request import Priority
from engine_server.errors import EngineUnavailableError, ValidationError
from engine_server.frontend import GenerationResult
from engine_server.pooling.requests import EmbedInput, ScoreInput
from engine_server.server import convert, convert_pooling
from engine_server.server.engine_loop import LoadSnapshot
from engine_server.server.serving import GenerationInput, ServingEngine
from engine_server.server.tracing import RpcTracing, record_generation, record_pooling
from ladle.v1 import engine_pb2, engine_pb2_grpc

log = structlog.get_logger(__name__)

_Call = TypeVar("_Call", GenerationInput, EmbedInput, ScoreInput)

PARAM_METADATA_KEY = "ladle-param"  # trailing metadata of an INVALID_ARGUMENT: the offending field, when known


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Serves one ServingEngine, attached once it is loaded and warm. Lives on the server's event loop."""

    def __init__(self, tracing: RpcTracing | None = None) -> None:
        self.engine: ServingEngine | None = None
        self.tracing = tracing or RpcTracing()
        self._draining = asyncio.Event()  # Batch calls stop reading new items
        self._refusing = False  # new calls are answered UNAVAILABLE
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0

    # -- lifecycle -------------------------------------------------------------------------------------------

    def attach(self, engine: ServingEngine) -> None:
        """Start admitting calls to `engine`."""
        self.engine = engine

    @property
    def accepting(self) -> bool:
        return self.engine is not None and not self._draining.is_set()

    @property
    def in_flight(self) -> int:
        """Generation and tokenize calls being served now."""
        return self._in_flight

    def start_draining(self, refuse_new: bool = True) -> None:
        """Calls in flight go on, but a Batch call stops reading new items; new calls are refused from now on
        unless `refuse_new` is False (the server has stopped listening, and admits what it had already
        received)."""
        self._draining.set()
        self._refusing = self._refusing or refuse_new

    async def wait_idle(self) -> None:
        """Return once no call is in flight."""
        await self._idle.wait()

    @contextlib.contextmanager
    def _admitted(self) -> Iterator[ServingEngine]:
        """The engine, counted as in flight until the block exits; EngineUnavailableError when not admitting."""
        if self.engine is None:
            raise EngineUnavailableError("the engine is still loading its model; retry shortly")
        if self._refusing:
            raise EngineUnavailableError("the engine is shutting down; retry on another engine")
        self._in_flight += 1
        self._idle.clear()
        try:
            yield self.engine
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    # -- RPCs ------------------------------------------------------------------------------------------------

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.GenerateResponse:
        try:
            with self._admitted() as engine, self.tracing.call("Generate", context) as span:
                generation = _with_request_id(
                    convert.generation_input(request, Priority.INTERACTIVE, engine.info.generation_defaults)
                )
                with structlog.contextvars.bound_contextvars(request_id=generation.request_id, rpc="Generate"):
                    result = await _run_to_end(engine, generation, _deadline(context))
                    record_generation(span, generation.request_id, result)
                    return convert.generate_response(result, engine.info.model_id,
                                                     request.sampling.return_prompt_token_ids)
        except Exception as exc:
            await _fail(context, exc)

    async def Stream(
        self, request: engine_pb2.StreamRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[engine_pb2.StreamResponse]:
        try:
            with self._admitted() as engine, self.tracing.call("Stream", context) as span:
                generation = _with_request_id(
                    convert.generation_input(request, Priority.INTERACTIVE, engine.info.generation_defaults)
                )
                model = engine.info.model_id
                with structlog.contextvars.bound_contextvars(request_id=generation.request_id, rpc="Stream"):
                    # aclosing: a cancelled call closes the generator at once, which aborts the request in the core.
                    prompt_logprobs_sent = False
                    ids_sent = not request.sampling.return_prompt_token_ids  # on the first message alone
                    info_sent = False
                    async with contextlib.aclosing(engine.generate(generation, _deadline(context))) as updates:
                        async for update in updates:
                            if update.finished:
                                record_generation(span, generation.request_id, update.result)
                            prompt_logprobs = None if prompt_logprobs_sent else update.result.prompt_logprobs
                            prompt_logprobs_sent = prompt_logprobs_sent or prompt_logprobs is not None
                            prompt_ids = () if ids_sent else update.result.prompt_token_ids
                            ids_sent = True
                            info = None if info_sent else update.result.transcription  # (the first message's)
                            info_sent = True
                            yield convert.stream_response(generation.request_id, update.deltas, model,
                                                          update.result.usage, last=update.finished,
                                                          prompt_logprobs=prompt_logprobs,
                                                          prompt_token_ids=prompt_ids, transcription=info)
        except Exception as exc:
            await _fail(context, exc)

    async def Batch(
        self,
        request_iterator: AsyncIterator[engine_pb2.BatchRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[engine_pb2.BatchResponse]:
        try:
            with self._admitted() as engine, structlog.contextvars.bound_contextvars(rpc="Batch"), \
                    self.tracing.call("Batch", context):
                run = _BatchRun(engine, request_iterator, self._draining, _deadline(context), self.tracing,
                                self.tracing.batch_id(context))
                async for response in run.responses():
                    yield response
                if run.cut_short:
                    raise EngineUnavailableError(
                        "the engine is shutting down: items after the last result were not run; resend them"
                    )
        except Exception as exc:
            await _fail(context, exc)

    async def Tokenize(
        self, request: engine_pb2.TokenizeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.TokenizeResponse:
        try:
            with self._admitted() as engine:
                prompt = convert.prompt_from_input(request.input)
                add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
                return convert.tokenize_response(await engine.tokenize(prompt, add_special))
        except Exception as exc:
            await _fail(context, exc)

    async def Detokenize(
        self, request: engine_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.DetokenizeResponse:
        try:
            with self._admitted() as engine:
                skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
                return engine_pb2.DetokenizeResponse(text=await engine.detokenize(list(request.token_ids), skip))
        except Exception as exc:
            await _fail(context, exc)

    async def Embed(
        self, request: engine_pb2.EmbedRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.EmbedResponse:
        try:
            with self._admitted() as engine, self.tracing.call("Embed", context) as span:
                call = _with_request_id(convert_pooling.embed_input(request, Priority.INTERACTIVE))
                with structlog.contextvars.bound_contextvars(request_id=call.request_id, rpc="Embed"):
                    result = await engine.embed(call, _deadline(context))
                    record_pooling(span, call.request_id, result.prompt_tokens)
                    return convert_pooling.embed_response(result, engine.info.model_id)
        except Exception as exc:
            await _fail(context, exc)

    async def Score(
        self, request: engine_pb2.ScoreRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.ScoreResponse:
        try:
            with self._admitted() as engine, self.tracing.call("Score", context) as span:
                call = _with_request_id(convert_pooling.score_input(request, Priority.INTERACTIVE))
                with structlog.contextvars.bound_contextvars(request_id=call.request_id, rpc="Score"):
                    result = await engine.score(call, _deadline(context))
                    record_pooling(span, call.request_id, result.prompt_tokens)
                    return convert_pooling.score_response(result, engine.info.model_id)
        except Exception as exc:
            await _fail(context, exc)

    async def GetModelInfo(
        self, request: engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.GetModelInfoResponse:
        if self.engine is None:
            await _fail(context, EngineUnavailableError("the engine is still loading its model; retry shortly"))
        lora = convert.lora_info(self.engine.lora_limits, self.engine.served_adapters())
        return convert.model_info_response(self.engine.info, lora)

    async def GetLoad(
        self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.GetLoadResponse:
        if self.engine is None:
            return convert.load_response(LoadSnapshot(), self.accepting)
        adapters = [adapter.name for adapter in self.engine.served_adapters()]
        return convert.load_response(self.engine.load_snapshot, self.accepting, adapters)

    async def LoadAdapter(
        self, request: engine_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.LoadAdapterResponse:
        try:
            with self._admitted() as engine, structlog.contextvars.bound_contextvars(rpc="LoadAdapter"):
                served = await engine.load_adapter(request.name, request.path)
                log.info("lora adapter loaded", name=served.name, path=served.path, rank=served.rank)
                return engine_pb2.LoadAdapterResponse(adapter=convert.adapter_info(served))
        except Exception as exc:
            await _fail(context, exc)

    async def UnloadAdapter(
        self, request: engine_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.UnloadAdapterResponse:
        try:
            with self._admitted() as engine:
                engine.unload_adapter(request.name)
                log.info("lora adapter unloaded", name=request.name)
                return engine_pb2.UnloadAdapterResponse()
        except Exception as exc:
            await _fail(context, exc)


class _BatchRun:
    """One Batch call: reads items while fewer than `window` are unfinished or unsent, runs each concurrently,
    and hands back each result as soon as it is ready. A bad item becomes an ItemError; the call goes on.
    An item never fails for load: while its class's queue is full it waits in the engine for room
    (`EngineLoop.add(wait=True)`), since this call's own reading ahead is what filled it.
    """

    def __init__(
        self,
        engine: ServingEngine,
        items: AsyncIterator[engine_pb2.BatchRequest],
        draining: asyncio.Event,
        deadline: float | None,
        tracing: RpcTracing | None = None,
        batch_id: str | None = None,
    ) -> None:
        self.engine = engine
        self.tracing = tracing or RpcTracing()
        self.batch_id = batch_id  # the batch job the gateway runs, named on each item's span
        self.cut_short = False  # stopped reading because the engine began draining
        self._items = items
        self._draining = draining
        self._deadline = deadline
        # Bounded by the core's seats: more unstarted items would only wait in its queue.
        self._slots = asyncio.Semaphore(2 * engine.info.max_num_seqs)
        self._results: asyncio.Queue[engine_pb2.BatchResponse | None] = asyncio.Queue()
        self._seen: set[str] = set()

    async def responses(self) -> AsyncIterator[engine_pb2.BatchResponse]:
        reader = asyncio.create_task(self._read_all())
        try:
            while (response := await self._results.get()) is not None:
                yield response
                # Released only once sent, so a caller that stops reading results also stops the intake.
                self._slots.release()
            await reader  # re-raises a failure of the reader itself
        finally:
            reader.cancel()

    async def _read_all(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                while True:
                    await self._slots.acquire()
                    item = await self._next_item()
                    if item is None:
                        break
                    group.create_task(self._run_item(item))
        finally:
            self._results.put_nowait(None)

    async def _next_item(self) -> engine_pb2.BatchRequest | None:
        """The next item, or None at the end of the input or once draining begins."""
        if self._draining.is_set():
            self.cut_short = True
            return None
        read = asyncio.ensure_future(anext(self._items, None))
        drain = asyncio.ensure_future(self._draining.wait())
        try:
            await asyncio.wait({read, drain}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            drain.cancel()
        if read.done():
            return read.result()
        read.cancel()
        self.cut_short = True
        return None

    async def _run_item(self, item: engine_pb2.BatchRequest) -> None:
        response = engine_pb2.BatchResponse(item_id=item.item_id)
        try:
            if not item.item_id:
                raise ValidationError("item_id must not be empty: results are matched to items by it", "item_id")
            if item.item_id in self._seen:
                raise ValidationError(f"item_id {item.item_id!r} was already used in this call", "item_id")
            self._seen.add(item.item_id)
            await self._run(item, response)
        except Exception as exc:
            _log_failure(exc)
            response.error.CopyFrom(convert.item_error(exc))
        self._results.put_nowait(response)

    async def _run(self, item: engine_pb2.BatchRequest, response: engine_pb2.BatchResponse) -> None:
        """Run one item (a generation, or an `embed` or `score` call) and put its result in `response`."""
        engine, model = self.engine, self.engine.info.model_id
        pooling = item.WhichOneof("pooling")
        if pooling is not None and item.HasField("request"):
            raise ValidationError(f"a Batch item sets one of request, embed or score, not request and {pooling}")
        if pooling == "embed":
            embed = _with_request_id(convert_pooling.embed_input(item.embed, Priority.BATCH))
            with structlog.contextvars.bound_contextvars(request_id=embed.request_id, item_id=item.item_id):
                embedded = await engine.embed(embed, self._deadline, wait=True)
            response.embed_result.CopyFrom(convert_pooling.embed_response(embedded, model))
        elif pooling == "score":
            score = _with_request_id(convert_pooling.score_input(item.score, Priority.BATCH))
            with structlog.contextvars.bound_contextvars(request_id=score.request_id, item_id=item.item_id):
                scored = await engine.score(score, self._deadline, wait=True)
            response.score_result.CopyFrom(convert_pooling.score_response(scored, model))
        else:
            defaults = engine.info.generation_defaults
            generation = _with_request_id(convert.generation_input(item.request, Priority.BATCH, defaults))
            with structlog.contextvars.bound_contextvars(request_id=generation.request_id, item_id=item.item_id), \
                    self.tracing.item(item.item_id, self.batch_id) as span:
                result = await _run_to_end(engine, generation, self._deadline, wait=True)
                record_generation(span, generation.request_id, result)
            response.result.CopyFrom(
                convert.generate_response(result, model, item.request.sampling.return_prompt_token_ids)
            )


async def _run_to_end(
    engine: ServingEngine, generation: GenerationInput, deadline: float | None, wait: bool = False
) -> GenerationResult:
    result: GenerationResult | None = None
    async with contextlib.aclosing(engine.generate(generation, deadline, whole=True, wait=wait)) as updates:
        async for update in updates:
            result = update.result
    if result is None or not result.finished:
        raise RuntimeError("the request ended without a finished result")
    return result


def _with_request_id(call: _Call) -> _Call:
    if call.request_id:
        return call
    return dataclasses.replace(call, request_id=f"req-{uuid.uuid4().hex}")


def _deadline(context: grpc.aio.ServicerContext[Any, Any]) -> float | None:
    """The call's deadline on the engine's monotonic clock, so a request still queued then never runs."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _log_failure(exc: BaseException) -> None:
    code, message = convert.status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("request failed unexpectedly", exc_info=exc)
    elif code is grpc.StatusCode.FAILED_PRECONDITION:  # the operator has to act (e.g. fix the model's template)
        log.warning("request failed: the engine cannot serve it as configured", reason=message)
    else:
        log.info("request refused", code=code.name, reason=message)


async def _fail(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException) -> NoReturn:
    _log_failure(exc)
    code, message = convert.status_for(exc)
    # The offending field travels as trailing metadata so an HTTP front end can name it (OpenAI's `param`).
    param = exc.param if isinstance(exc, ValidationError) else None
    await context.abort(code, message, ((PARAM_METADATA_KEY, param),) if param else ())
    raise AssertionError("context.abort returned")  # it always raises; this tells type checkers so
