"""The served model between the RPC layer and the core: prompts in, per-step choice deltas out.

`ServingEngine` owns the tokenizer side of the frontend (InputProcessor, RequestTracker) and the `EngineLoop`.
Tokenizing and chat templating run on one worker thread (so a long prompt never stalls the event loop, and the
tokenizer is never used by two threads at once); detokenization and stop strings run on the event loop, per
step. The core thread only ever sees token ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, cast

import structlog
import torch

from engine_server import beam_search, faults
from engine_server.config import EngineConfig
from engine_server.core.engine_core import CoreOutput, EngineCore
from engine_server.core.request import Priority, Request, RequestStatus
from engine_server.errors import (
    AdapterNotFoundError,
    EngineUnavailableError,
    LoraDisabledError,
    UnsupportedByModelError,
)
from engine_server.frontend import (
    ChatPrompt,
    Choice,
    GenerationResult,
    InputProcessor,
    LanguageDetection,
    PreparedPrompt,
    Prompt,
    RequestTracker,
    SilenceProbe,
    beam_answer,
    beam_candidates,
    best_of_answer,
    decode_check,
    fallback_answer,
    joined_results,
    sampled_best_of,
    split_core_request_id,
    window_separator,
)
from engine_server.generation_defaults import GenerationDefaults
from engine_server.llm import engine_eos_ids, engine_generation_defaults
from engine_server.loader import resolve_model
from engine_server.lora.peft_format import LoraAdapter
from engine_server.lora.registry import AdapterRegistry, ServedAdapter
from engine_server.multimodal.audio import AudioProcessing, served_audio
from engine_server.multimodal.fallback import TEMPERATURES
from engine_server.multimodal.processing import ImageProcessing, served_images
from engine_server.multimodal.transcription import (
    TranscriptionPrompt,
    WhisperTranscription,
    served_transcription,
    silent_clip,
)
from engine_server.output import TokenTextCodec
from engine_server.pooling.params import ModelPooling, PoolingParams
from engine_server.pooling.requests import (
    EmbedInput,
    EmbedResult,
    ScoreInput,
    ScoreResult,
    check_num_inputs,
    cosine_scores,
    pair_token_ids,
    pooling_requests,
    pooling_token_ids,
)
from engine_server.sampling_params import SamplingParams, validate_token_ids
from engine_server.server.engine_loop import EngineLoop, LoadSnapshot, RequestStream
from engine_server.structured.compiler import GrammarCompiler, GrammarCompilerConfig
from engine_server.tokenizer.loading import load_tokenizer

log = structlog.get_logger(__name__)


ENCODER_GENERATES = (
    "the served model is an encoder: it serves Embed and Score (embeddings, score, rerank), not generation"
)


class RequestDeadlineError(Exception):
    """The request's deadline passed before it finished (a queued request then never runs)."""


@dataclass(frozen=True)
class ModelInfo:
    """What GetModelInfo reports; fixed once the model is loaded."""

    model_id: str
    architecture: str
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    device: str
    dtype: str
    max_num_seqs: int
    generation_defaults: GenerationDefaults  # for the sampling fields a request leaves unset
    pooling: ModelPooling  # how Embed and Score pool the model's hidden states


@dataclass(frozen=True)
class GenerationInput:
    """One caller request in the engine's vocabulary; `request_id` is the caller's (may be empty)."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    priority: Priority = Priority.INTERACTIVE
    cache_salt: str = ""  # the prefix-cache namespace of its core requests (`Request`)
    adapter: str = ""  # the LoRA adapter it generates with, by name ("": the base model)


@dataclass(frozen=True)
class TokenizeResult:
    token_ids: list[int]
    tokens: list[str]
    prompt_text: str = ""


@dataclass
class StepUpdate:
    """What one core step added to a request: the choices that advanced, and the whole result so far."""

    deltas: list[Choice]
    result: GenerationResult
    finished: bool = False


class ServingEngine:
    """A loaded model serving requests through an EngineLoop. Use from the event loop thread only."""

    def __init__(
        self,
        core: EngineCore,
        tokenizer: Any,
        model_id: str,
        eos: tuple[int, ...],
        loop: asyncio.AbstractEventLoop,
        grammar_config: GrammarCompilerConfig | None = None,
        *,
        generation_defaults: GenerationDefaults,
        pooling: ModelPooling | None = None,
        images: tuple[ImageProcessing | None, str] = (None, ""),
        audio: tuple[AudioProcessing | None, str] = (None, ""),
        transcription: tuple[WhisperTranscription | None, str] = (None, ""),
    ) -> None:
        """Takes over `core`: from now on only the EngineLoop's thread touches it. `generation_defaults` fill the
        sampling fields a request leaves unset; GetModelInfo reports them. `pooling`: the model's (default: its
        last token, normalized). `images`, `audio`: how the model reads them and the refusal where it does not."""
        self.tokenizer = tokenizer
        # An encoder only pools: no grammar to compile (its tokenizer may have no eos for one to end on).
        self.grammar_compiler = (
            None
            if core.model_config.encoder
            else GrammarCompiler.for_tokenizer(tokenizer, core.model_config.vocab_size, eos, grammar_config)
        )
        self.inputs = InputProcessor(
            tokenizer, core.model_config.vocab_size, core.max_model_len, eos, grammar_compiler=self.grammar_compiler,
            tool_call_parser=core.config.tool_call_parser, reasoning_parser=core.config.reasoning_parser,
            images=images[0], images_refusal=images[1] or "this model reads no images; send text alone",
            audio=audio[0], audio_refusal=audio[1] or "this model hears no audio; send text alone",
            transcription=transcription[0],
            **({"transcription_refusal": transcription[1]} if transcription[1] else {}),
        )  # fmt: skip
        self.token_text = TokenTextCodec(tokenizer)
        self.info = ModelInfo(
            model_id=model_id,
            architecture=core.model_config.architecture,
            context_length=core.max_model_len,
            vocab_size=core.model_config.vocab_size,
            eos_token_ids=eos,
            has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
            device=core.runner.device.type,
            dtype=str(core.runner.dtype).removeprefix("torch."),
            max_num_seqs=core.config.scheduler.max_num_seqs,
            generation_defaults=generation_defaults,
            pooling=pooling
            or ModelPooling.for_model(
                None, core.model_config.hidden_size, core.model_config.encoder, core.model_config.num_labels == 1
            ),
        )
        # The LoRA adapters served on the model (None: the engine was started without LoRA); --lora-modules load here.
        self.adapters = AdapterRegistry.for_engine(core.config.lora, core.model_config, model_id)
        self.lora_limits = core.config.lora
        self.loop = EngineLoop(core, loop)
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._ids = itertools.count()

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        grammar_config: GrammarCompilerConfig | None = None,
        prepare_core: Callable[[EngineCore], None] | None = None,
    ) -> ServingEngine:
        """Load the model on a new `engine-core` thread, which then runs the core loop; returns once loaded.

        `prepare_core`, when given, is called with the loaded core on that thread before its loop starts (a
        benchmark swaps in a stand-in device there).

        Loading, warm-up and every step run on that one thread because a thread that ran parallel torch ops
        keeps an OpenMP team: with two live teams on more threads than cores, libgomp throttles its spin-waits
        and each parallel region of the step pays a thread wake-up (30% fewer tokens/s measured on 2 cores).
        """
        loop = asyncio.get_running_loop()
        loaded: asyncio.Future[ServingEngine] = loop.create_future()

        def core_thread() -> None:
            try:
                engine = cls._load(config, loop, grammar_config)
                if prepare_core is not None:
                    prepare_core(engine.loop.core)
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, loaded, None, exc)
                return
            engine.loop.use_current_thread()
            loop.call_soon_threadsafe(_settle, loaded, engine, None)
            engine.loop.run()

        threading.Thread(target=core_thread, name="engine-core", daemon=True).start()
        return await loaded

    @classmethod
    def load(
        cls,
        config: EngineConfig,
        loop: asyncio.AbstractEventLoop,
        grammar_config: GrammarCompilerConfig | None = None,
    ) -> ServingEngine:
        """Resolve and load the model here (blocking: seconds to minutes) and start the core on its own thread."""
        engine = cls._load(config, loop, grammar_config)
        engine.loop.start()
        return engine

    @classmethod
    def _load(
        cls, config: EngineConfig, loop: asyncio.AbstractEventLoop, grammar_config: GrammarCompilerConfig | None
    ) -> ServingEngine:
        source = resolve_model(config.model, config.cache_path(), hf_overrides=config.hf_override_values())
        # Resolved before the model loads, so a bad --generation-config fails at once.
        defaults = engine_generation_defaults(config, source)
        log.info("generation defaults", **asdict(defaults))
        tokenizer = load_tokenizer(source.tokenizer_path, config.chat_template_text())
        core = EngineCore(config, source)
        faults.install_from_env(core.runner.model)
        eos = engine_eos_ids(source, tokenizer)
        pooling = ModelPooling.for_model(
            source.path, source.config.hidden_size, source.config.encoder, source.config.num_labels == 1
        )
        max_step = config.scheduler.max_num_batched_tokens
        images = served_images(source.config.multimodal, source.path, tokenizer, max_step, config.tensor_parallel_size)
        audio = served_audio(source.config.multimodal, source.path, tokenizer)
        multimodal = source.config.multimodal
        transcription = served_transcription(multimodal is not None and multimodal.transcribes, source.path, tokenizer,
                                             config.max_transcription_seconds)  # fmt: skip
        return cls(
            core, tokenizer, source.name, eos, loop, grammar_config, generation_defaults=defaults, pooling=pooling,
            images=images, audio=audio, transcription=transcription,
        )  # fmt: skip

    async def load_adapter(self, name: str, path: str) -> ServedAdapter:
        """Serve the PEFT adapter in folder `path` (on this host) as `name`; read on a worker thread
        (AdapterRegistry.load's errors; LoraDisabledError without LoRA)."""
        return await asyncio.to_thread(self._registry().load, name, path)

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (AdapterNotFoundError when it is not served)."""
        self._registry().unload(name)

    def served_adapters(self) -> list[ServedAdapter]:
        return [] if self.adapters is None else self.adapters.served()

    def _registry(self) -> AdapterRegistry:
        if self.adapters is None:
            raise LoraDisabledError("this engine was started without LoRA (ladle engine --enable-lora)")
        return self.adapters

    async def _adapter(self, name: str) -> LoraAdapter | None:
        """The adapter a request names (None: the base model); its weights may be read again from its folder."""
        if not name:
            return None
        if self.adapters is None:
            raise AdapterNotFoundError(f"the model {name!r} does not exist: this engine serves no LoRA adapters")
        return await asyncio.to_thread(self.adapters.resolve, name)

    @property
    def load_snapshot(self) -> LoadSnapshot:
        return self.loop.load

    async def warm_up(self) -> None:
        """One tiny generation (an embedding, for an encoder; a transcription of silence, for a speech-to-text model)
        through the whole path, so the first caller does not pay for lazy setup."""
        if self.info.pooling.encoder:
            await self.embed(EmbedInput("warmup", ["Hello"]))
            return
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        # A speech-to-text model takes clips alone: a second of silence, its language detected where it can be.
        prompt: Prompt = "Hello" if self.inputs.transcription is None else TranscriptionPrompt(silent_clip())
        async for _ in self.generate(GenerationInput("warmup", prompt, params)):
            pass

    async def close(self) -> None:
        """Abort what is left, stop the core thread and the tokenizer worker."""
        await asyncio.to_thread(self.loop.stop)
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        if self.grammar_compiler is not None:
            self.grammar_compiler.close()

    async def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> TokenizeResult:
        """Token ids of a prompt as generation would see them; chat also returns the rendered text."""
        text = ""
        if isinstance(prompt, ChatPrompt):
            text = await self._off_loop(self.inputs.render, prompt)
            ids = await self._off_loop(self.tokenizer.encode, text, add_special_tokens=False)
        else:
            ids = await self._off_loop(self.inputs.tokenize, prompt, add_special_tokens)
        return TokenizeResult(list(ids), self.token_text.token_strings(ids), text)

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids` as generated text is decoded; ValidationError (param "tokens") for an id outside
        the vocabulary."""
        validate_token_ids(token_ids, self.info.vocab_size, param="tokens")
        text: str = await self._off_loop(self.tokenizer.decode, token_ids, skip_special_tokens=skip_special_tokens)
        return text

    async def generate(
        self, request: GenerationInput, deadline: float | None = None, whole: bool = False, wait: bool = False
    ) -> AsyncGenerator[StepUpdate, None]:
        """Run one request; yield once per core step that advanced it, the last update with `finished` set.

        `deadline` is a `time.monotonic()` value: a request still queued then is never scheduled and this raises
        RequestDeadlineError. Raises ValidationError before anything runs, QueueFullError when the waiting queue
        is full. Closing the generator early (the caller cancelled) aborts the request in the core. With `whole`
        (a caller that wants only the result), a choice without stop strings is applied once, at its finish,
        which spares the event loop its per-step work. With `wait`, a full waiting queue holds the request until
        it has room (`EngineLoop.add`) instead of raising QueueFullError.
        """
        if self.info.pooling.encoder:
            raise UnsupportedByModelError(ENCODER_GENERATES)
        if request.params.beam_width > 1:
            async with contextlib.aclosing(self._generate_beams(request, deadline, wait)) as beams:
                async for update in beams:
                    yield update
            return
        sampling = sampled_best_of(request.params)
        if sampling is not None:  # best_of choices sampled, the n best answered once all are done
            answer = best_of_answer(await self._result(dataclasses.replace(request, params=sampling), deadline, wait),
                                    request.params)  # fmt: skip
            yield StepUpdate([dataclasses.replace(choice) for choice in answer.choices], answer, finished=True)
            return
        if isinstance(request.prompt, TranscriptionPrompt):
            windowed = await self._off_loop(self.inputs.windows, request.prompt)
            if windowed is not None:
                async with contextlib.aclosing(self._generate_windows(request, windowed, deadline, whole, wait)) as up:
                    async for update in up:
                        yield update
                return
        if self.inputs.needs_language(request.prompt):  # a transcription without a language: detected first
            request = await self._with_language(request, deadline, wait)
        if isinstance(request.prompt, TranscriptionPrompt) and request.prompt.temperature_fallback:
            async with contextlib.aclosing(self._generate_fallback(request, deadline, wait)) as fallback:
                async for update in fallback:
                    yield update
            return
        # Templating, tokenizing and building a forced tool_choice's grammar text run on the tokenizer thread.
        prepared: PreparedPrompt = await self._off_loop(self.inputs.prepare, request.prompt, request.params)
        prompt_ids, params = prepared.token_ids, prepared.params
        # Compiling runs on the compiler's workers with its own time limit; other requests keep streaming.
        grammar = await asyncio.wrap_future(self.inputs.compile_constraint(params))
        lora = await self._adapter(request.adapter)
        internal_id = f"r{next(self._ids)}"
        core_requests = self.inputs.make_requests(
            internal_id, prompt_ids, params, request.priority, deadline, grammar=grammar, cache_salt=request.cache_salt,
            lora=lora, multimodal=prepared.multimodal,
        )  # fmt: skip
        tracker = RequestTracker(
            self.tokenizer, request.request_id, prompt_ids, params, self.token_text, prepared.tool_parsing,
            prepared.reasoning, prepared.harmony, prepared.reasoning_tags, prepared.transcription, prepared.timestamps,
            prepared.words,
        )
        stream = self.loop.add(internal_id, core_requests, final_only=whole and not tracker.needs_every_step,
                               wait=wait)
        unfinished = set(stream.core_ids)

        def report(outcome: str) -> None:
            _log_finished(request.request_id, internal_id, outcome, tracker, core_requests)

        with self._owning(stream, unfinished, report):
            while unfinished:
                outputs = await stream.next()
                if any(output.alignment is not None for output in outputs):
                    # Word timings' warping (up to ~0.1 s a window) runs on the tokenizer thread, off the event loop
                    # that every other stream is sent from; this coroutine awaits it, so the tracker has one user.
                    deltas = await self._off_loop(self._apply, tracker, outputs, unfinished)
                else:
                    deltas = self._apply(tracker, outputs, unfinished)
                if deltas:
                    yield StepUpdate(deltas, tracker.result, finished=not unfinished)

    async def _generate_windows(
        self,
        request: GenerationInput,
        windowed: tuple[list[TranscriptionPrompt], float],
        deadline: float | None,
        whole: bool,
        wait: bool,
    ) -> AsyncGenerator[StepUpdate, None]:
        """`generate` for a transcription whose clip is longer than the encoder's window: its windows
        (`InputProcessor.windows`) run concurrently as requests of their own (the scheduler batches them) under the
        same deadline and priority, the language detected once on the first window where none is given; window 0's
        updates are yielded as they come, then window 1's (buffered meanwhile), and so on, each update's result the
        join so far (`frontend.joined_results`: finished windows and the running one) and its deltas the
        window's (the first of a later window led by `frontend.window_separator`; a later window's segments placed in
        the joined choice's tokens), `finished` on the last window's last.
        Closing early, an error or the deadline in any window aborts every window."""
        windows, seconds = windowed
        if self.inputs.needs_language(windows[0]):
            first = await self._with_language(dataclasses.replace(request, prompt=windows[0]), deadline, wait)
            language = cast(TranscriptionPrompt, first.prompt).language
            windows = [dataclasses.replace(window, language=language) for window in windows]
        queues: list[asyncio.Queue[StepUpdate | BaseException]] = [asyncio.Queue() for _ in windows]

        async def run(index: int) -> None:
            part = dataclasses.replace(request, prompt=windows[index])
            try:
                async with contextlib.aclosing(self.generate(part, deadline, whole, wait)) as updates:
                    async for update in updates:
                        queues[index].put_nowait(update)
            except Exception as error:  # handed to the caller, in window order
                queues[index].put_nowait(error)

        tasks = [asyncio.create_task(run(index)) for index in range(len(windows))]
        try:
            done: list[GenerationResult] = []
            for index, queue in enumerate(queues):
                led: set[int] = set()  # the choices whose text in this window has begun (window 0's need no joint)
                while True:
                    item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    deltas = item.deltas
                    if index and any(delta.text and delta.index not in led for delta in deltas):
                        before = joined_results(done, seconds).choices
                        deltas = [delta if not delta.text or delta.index in led else dataclasses.replace(
                            delta, text=window_separator(before[delta.index].text, delta.text) + delta.text)
                            for delta in deltas]  # fmt: skip
                        led |= {delta.index for delta in deltas if delta.text}
                    if index and any(delta.segments for delta in deltas):  # (their first tokens: the joined choice's)
                        deltas = [dataclasses.replace(delta, segments=[
                            segment.shifted(sum(len(r.choices[delta.index].token_ids) for r in done))
                            for segment in delta.segments]) for delta in deltas]  # fmt: skip
                    last = item.finished and index == len(windows) - 1
                    yield StepUpdate(deltas, joined_results([*done, item.result], seconds), finished=last)
                    if item.finished:
                        done.append(item.result)
                        break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate_fallback(
        self, request: GenerationInput, deadline: float | None, wait: bool
    ) -> AsyncGenerator[StepUpdate, None]:
        """`generate` for a transcription (one window) under Whisper's temperature fallback (`multimodal.fallback`): it
        is decoded at 0 beside its silence probe (`SilenceProbe`, where the model has `<|nospeech|>`), then again at
        each hotter temperature in turn while it fails Whisper's check, under the same deadline and priority; one
        update, finished: the answer (`frontend.fallback_answer`), its delta the whole choice. ValidationError before
        anything runs (`InputProcessor.fallback_attempt`); closing early aborts what runs."""
        prompt = cast(TranscriptionPrompt, request.prompt)
        attempt, params = self.inputs.fallback_attempt(prompt, request.params, TEMPERATURES[0])
        probe = asyncio.create_task(self._no_speech(request, deadline, wait)) if self.inputs.probes_silence else None
        try:
            tried = [await self._result(dataclasses.replace(request, prompt=attempt, params=params), deadline, wait)]
            no_speech = await probe if probe is not None else None
            check, used = decode_check(tried[0], no_speech), TEMPERATURES[0]
            for temperature in TEMPERATURES[1:]:
                if check.passes:
                    break
                attempt, params = self.inputs.fallback_attempt(prompt, request.params, temperature)
                tried.append(await self._result(dataclasses.replace(request, prompt=attempt, params=params), deadline,
                                                wait))  # fmt: skip
                check, used = decode_check(tried[-1], no_speech), temperature
        finally:
            if probe is not None and not probe.done():
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)
        asked = request.params.logprobs or request.params.top_logprobs > 0
        answer = fallback_answer(tried, check, used, asked)
        yield StepUpdate([dataclasses.replace(choice) for choice in answer.choices], answer, finished=True)

    async def _generate_beams(
        self, request: GenerationInput, deadline: float | None, wait: bool
    ) -> AsyncGenerator[StepUpdate, None]:
        """`generate` under beam search (`engine_server.beam_search`): step after step, the running beams run
        concurrently as one-token requests of their own under the same deadline and priority, until the search is
        done; one update, finished: the n best beams as its choices. ValidationError before anything runs
        (`InputProcessor.beam_search`); an error in any beam's request, or closing early, cancels the step's others.
        Only the first step may meet a full queue (QueueFullError, unless `wait`): once the search is under way its
        later steps wait for room, as a Batch item's requests do."""
        prepared: PreparedPrompt = await self._off_loop(self.inputs.prepare, request.prompt, request.params)
        search = self.inputs.beam_search(prepared)
        await self._adapter(request.adapter)
        steps = 0
        while not search.done:
            params = beam_search.step_params(prepared.params, search)
            running = [asyncio.ensure_future(self._result(
                dataclasses.replace(request, prompt=[*prepared.token_ids, *beam.token_ids], params=params),
                deadline, wait or steps > 0)) for beam in search.running]  # fmt: skip
            try:
                found = await asyncio.gather(*running)
            finally:  # the first error is raised; the step's other requests are cancelled (aborted in the core)
                for task in running:
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
            search.advance([beam_candidates(step) for step in found])
            steps += 1
        tracker = RequestTracker(
            self.tokenizer, request.request_id, prepared.token_ids, prepared.params, self.token_text,
            prepared.tool_parsing, prepared.reasoning, prepared.harmony, prepared.reasoning_tags,
        )  # fmt: skip
        answer = beam_answer(tracker, search)
        log.info("beam search finished", request_id=request.request_id, beam_width=search.width, steps=steps,
                 prompt_tokens=answer.usage.prompt_tokens, completion_tokens=answer.usage.completion_tokens,
                 finish_reasons=[str(c.finish_reason) for c in answer.choices])  # fmt: skip
        yield StepUpdate([dataclasses.replace(choice) for choice in answer.choices], answer, finished=True)

    async def _result(self, request: GenerationInput, deadline: float | None, wait: bool) -> GenerationResult:
        """`request`'s whole result (`generate` with `whole`)."""
        result = None
        async with contextlib.aclosing(self.generate(request, deadline, whole=True, wait=wait)) as updates:
            async for update in updates:
                result = update.result
        assert result is not None, "generate yields a finished update"
        return result

    async def _no_speech(self, request: GenerationInput, deadline: float | None, wait: bool) -> float:
        """The probability of `<|nospeech|>` after the transcription's `<|startoftranscript|>` (its `SilenceProbe`'s
        one token's raw log-probability), run under the same deadline and priority (`wait` as `generate`'s)."""
        probe = dataclasses.replace(request, prompt=SilenceProbe(cast(TranscriptionPrompt, request.prompt)))
        logprobs = (await self._result(probe, deadline, wait)).choices[0].logprobs
        assert logprobs, "a silence probe asks its token's log-probability"
        return math.exp(logprobs[0].logprob)

    async def _with_language(self, request: GenerationInput, deadline: float | None, wait: bool) -> GenerationInput:
        """`request` (a transcription naming no language) in the language its clip is detected to be in: one greedy
        token of its `LanguageDetection` request, run first under the same deadline and priority (`wait` as
        `generate`'s)."""
        prompt = cast(TranscriptionPrompt, request.prompt)
        detection = await self._result(dataclasses.replace(request, prompt=LanguageDetection(prompt)), deadline, wait)
        assert detection.choices[0].token_ids, "a detection samples one token"
        return dataclasses.replace(request, prompt=self.inputs.detected(prompt, detection.choices[0].token_ids[0]))

    async def embed(self, call: EmbedInput, deadline: float | None = None, wait: bool = False) -> EmbedResult:
        """One vector per input, in order (`deadline`, `wait` and cancelling as in `generate`); raises
        ValidationError before anything runs, QueueFullError when the waiting queue is full."""
        check_num_inputs(len(call.prompts), "input")
        params = self.info.pooling.params(call.normalize, call.dimensions)
        token_ids = await self._pooling_token_ids(call.prompts, call.truncate_prompt_tokens, "input")
        vectors = await self._pool(call.request_id, token_ids, params, call.priority, deadline, call.cache_salt,
                                   wait)
        return EmbedResult(call.request_id, vectors, [len(ids) for ids in token_ids])

    async def score(self, call: ScoreInput, deadline: float | None = None, wait: bool = False) -> ScoreResult:
        """Each document's score against the query, in order (as `embed`): the cosine similarity of their
        embeddings, or a cross-encoder's relevance of the pair."""
        check_num_inputs(len(call.documents), "documents")
        truncate = call.truncate_prompt_tokens
        if self.info.pooling.cross_encoder:
            return await self._score_pairs(call, deadline, wait)
        query = await self._pooling_token_ids([call.query], truncate, "query")
        documents = await self._pooling_token_ids(call.documents, truncate, "documents")
        params = self.info.pooling.params(normalize=False)  # the cosine normalizes
        vectors = await self._pool(call.request_id, query + documents, params, call.priority, deadline,
                                   call.cache_salt, wait)
        tokens = sum(len(ids) for ids in query + documents)
        return ScoreResult(call.request_id, cosine_scores(vectors[0], vectors[1:]), tokens)

    async def _score_pairs(self, call: ScoreInput, deadline: float | None, wait: bool) -> ScoreResult:
        """`score` on a cross-encoder: each (query, document) pair through its classifier."""

        def tokenize() -> list[list[int]]:
            return [pair_token_ids(self.inputs, call.query, doc, call.truncate_prompt_tokens) for doc in call.documents]

        pairs: list[list[int]] = await self._off_loop(tokenize)
        params = self.info.pooling.pair_params()
        scores = await self._pool(call.request_id, pairs, params, call.priority, deadline, call.cache_salt, wait)
        return ScoreResult(call.request_id, [float(score[0]) for score in scores], sum(len(ids) for ids in pairs))

    async def _pooling_token_ids(self, prompts: Sequence[Prompt], truncate: int | None, param: str) -> list[list[int]]:
        def tokenize() -> list[list[int]]:
            return [pooling_token_ids(self.inputs, prompt, truncate, param) for prompt in prompts]

        result: list[list[int]] = await self._off_loop(tokenize)
        return result

    async def _pool(
        self,
        request_id: str,
        token_ids: Sequence[list[int]],
        params: PoolingParams,
        priority: Priority,
        deadline: float | None,
        cache_salt: str,
        wait: bool = False,
    ) -> list[torch.Tensor]:
        """Run one pooling request per input through the core, in the prefix-cache namespace `cache_salt`; their
        vectors in order. Closing early (the caller cancelled) aborts what has not finished."""
        internal_id = f"p{next(self._ids)}"
        requests = pooling_requests(
            internal_id, token_ids, params, self.info.context_length, priority, deadline, cache_salt
        )
        stream = self.loop.add(internal_id, requests, final_only=True, wait=wait)
        vectors: dict[int, torch.Tensor] = {}
        unfinished = set(stream.core_ids)

        def report(outcome: str) -> None:
            prompt_tokens = sum(len(ids) for ids in token_ids)
            log.info(
                "pooling request finished",
                request_id=request_id,
                core_id=internal_id,
                outcome=outcome,
                inputs=len(requests),
                prompt_tokens=prompt_tokens,
            )

        with self._owning(stream, unfinished, report):
            while unfinished:
                for output in await stream.next():
                    if output.status is RequestStatus.FINISHED_DEADLINE:
                        raise RequestDeadlineError("the deadline passed while the request was queued; it never ran")
                    if output.pooled is None:
                        raise EngineUnavailableError("the engine stopped this request before it was computed; retry")
                    unfinished.discard(output.request_id)
                    vectors[split_core_request_id(output.request_id)[1]] = output.pooled
        return [vectors[i] for i in range(len(requests))]

    @contextlib.contextmanager
    def _owning(self, stream: RequestStream, unfinished: set[str], report: Callable[[str], None]) -> Iterator[None]:
        """Read `stream` inside the block; at its end close it, abort the core ids still in `unfinished` (the caller
        stopped early or failed) and `report` the outcome: "finished", "cancelled" or the exception's name."""
        outcome = "cancelled"
        try:
            yield
            outcome = "finished"
        except BaseException as exc:
            outcome = type(exc).__name__
            raise
        finally:
            self.loop.close(stream)
            if unfinished:
                self.loop.abort(sorted(unfinished))
            report(outcome)

    def _apply(self, tracker: RequestTracker, outputs: Sequence[CoreOutput], unfinished: set[str]) -> list[Choice]:
        """Feed one step's outputs to the tracker; returns the deltas of choices that advanced."""
        deltas: list[Choice] = []
        for output in outputs:
            if output.request_id not in unfinished:
                continue  # produced before our abort landed (stop string matched): already final
            if output.status is RequestStatus.FINISHED_DEADLINE:
                raise RequestDeadlineError("the deadline passed while the request was queued; it never ran")
            _, index = split_core_request_id(output.request_id)
            delta, abort_core = tracker.update(index, output)
            if output.finished or delta.finish_reason is not None:
                unfinished.discard(output.request_id)
            if abort_core:
                self.loop.abort([output.request_id])
            deltas.append(delta)
        return deltas

    async def _off_loop(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, lambda: fn(*args, **kwargs))


def _log_finished(
    request_id: str, internal_id: str, outcome: str, tracker: RequestTracker, requests: Sequence[Request]
) -> None:
    usage = tracker.result.usage
    # A beam search's steps (`ServingEngine._generate_beams`: width requests a token) are logged at debug level.
    emit = log.debug if tracker.params.beam_step else log.info
    # `ran` is false when no choice was ever scheduled: e.g. its deadline passed while it was queued.
    ran = any(r.num_computed_tokens > 0 or r.num_output_tokens > 0 for r in requests)
    emit(
        "request finished",
        request_id=request_id,
        core_id=internal_id,
        outcome=outcome,
        ran=ran,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        finish_reasons=[str(c.finish_reason) for c in tracker.result.choices],
        at=round(time.monotonic(), 3),
    )


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
