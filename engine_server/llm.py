"""The offline Python API: `LLM(model="default").generate(prompts, params)` runs the engine in this process."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections import deque
from collections.abc import Sequence
from typing import Any, cast

import torch
from tqdm.auto import tqdm

from engine_server import beam_search
from engine_server.config import EngineConfig, SpeculativeConfig
from engine_server.core.engine_core import EngineCore
from engine_server.core.request import Priority, Request
from engine_server.errors import LoraDisabledError, UnsupportedByModelError
from engine_server.frontend import (
    ChatPrompt,
    GenerationResult,
    InputProcessor,
    LanguageDetection,
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
)
from engine_server.generation_defaults import (
    GenerationDefaults,
    generation_config_eos_ids,
    resolve_generation_defaults,
)
from engine_server.host_memory import freeze_startup_heap
from engine_server.loader import ModelSource, resolve_model
from engine_server.lora.peft_format import LoraAdapter
from engine_server.lora.registry import AdapterRegistry, ServedAdapter
from engine_server.multimodal.audio import served_audio
from engine_server.multimodal.fallback import TEMPERATURES
from engine_server.multimodal.processing import served_images
from engine_server.multimodal.transcription import TranscriptionPrompt, served_transcription
from engine_server.output import TokenTextCodec
from engine_server.pooling.params import ModelPooling
from engine_server.pooling.requests import cosine_scores, pair_token_ids, pooling_requests, pooling_token_ids
from engine_server.sampling_params import SamplingParams
from engine_server.structured.compiler import GrammarCompiler, GrammarCompilerConfig
from engine_server.tokenizer.loading import load_tokenizer


def engine_eos_ids(source: ModelSource, tokenizer: Any) -> tuple[int, ...]:
    """The model's eos ids: config.json's, the tokenizer's own eos token, and those of the model folder's
    generation_config.json (as vLLM stops on them: gpt-oss lists its `<|call|>` and `<|return|>` there, Llama 3
    Instruct its `<|eot_id|>` and `<|eom_id|>`)."""
    ids = set(source.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    ids.update(generation_config_eos_ids(source.path))
    return tuple(sorted(ids))


def engine_generation_defaults(config: EngineConfig, source: ModelSource) -> GenerationDefaults:
    """The sampling defaults `config` asks for, for the model `source` (ValueError naming the flag if bad)."""
    return resolve_generation_defaults(
        config.generation_config,
        config.override_generation_config,
        model_spec=config.model,
        model_folder=source.path,
    )


class LLM:
    """An engine in this process for offline generation. Not thread-safe; one `generate` call at a time."""

    def __init__(
        self,
        model: str = "default",
        *,
        config: EngineConfig | None = None,
        device: str = "auto",
        grammar_config: GrammarCompilerConfig | None = None,
        speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
        tensor_parallel_size: int | None = None,
    ) -> None:
        """`grammar_config` tunes the structured-output compiler (time limit, workers, JSON whitespace).
        `speculative_config`, as vLLM's (e.g. `{"method": "ngram", "num_speculative_tokens": 4}`), turns on
        speculative decoding over `config`'s (engine_server.speculative). `tensor_parallel_size`, as vLLM's,
        overrides `config`'s: the model split over that many processes (`close` stops them)."""
        self.config = config or EngineConfig(model=model, device=device)  # type: ignore[arg-type]
        if tensor_parallel_size is not None:
            self.config = dataclasses.replace(self.config, tensor_parallel_size=tensor_parallel_size)
        if speculative_config is not None:
            if isinstance(speculative_config, dict):
                speculative_config = SpeculativeConfig.from_json(json.dumps(speculative_config))
            self.config = dataclasses.replace(self.config, speculative=speculative_config)
        config = self.config
        source = resolve_model(config.model, config.cache_path(), hf_overrides=config.hf_override_values())
        self.model_name = source.name
        # Resolved before the model loads, so a bad --generation-config fails at once.
        self.generation_defaults = engine_generation_defaults(self.config, source)
        self.tokenizer = load_tokenizer(source.tokenizer_path, config.chat_template_text())
        self.core = EngineCore(self.config, source)
        self.eos_token_ids = engine_eos_ids(source, self.tokenizer)
        # An encoder only pools: no grammar to compile (its tokenizer may have no eos for one to end on).
        self.grammar_compiler = (
            None
            if source.config.encoder
            else GrammarCompiler.for_tokenizer(
                self.tokenizer, source.config.vocab_size, self.eos_token_ids, grammar_config
            )
        )
        images, refusal = served_images(
            source.config.multimodal, source.path, self.tokenizer, self.config.scheduler.max_num_batched_tokens,
            self.config.tensor_parallel_size,
        )  # fmt: skip
        audio, audio_refusal = served_audio(source.config.multimodal, source.path, self.tokenizer)
        multimodal = source.config.multimodal
        transcription, transcription_refusal = served_transcription(
            multimodal is not None and multimodal.transcribes, source.path, self.tokenizer,
            config.max_transcription_seconds,
        )
        self.inputs = InputProcessor(
            self.tokenizer,
            source.config.vocab_size,
            self.core.max_model_len,
            self.eos_token_ids,
            grammar_compiler=self.grammar_compiler,
            tool_call_parser=self.core.config.tool_call_parser,
            reasoning_parser=self.core.config.reasoning_parser,
            images=images,
            images_refusal=refusal,
            audio=audio,
            audio_refusal=audio_refusal,
            transcription=transcription,
            transcription_refusal=transcription_refusal,
        )
        self.token_text = TokenTextCodec(self.tokenizer)
        self.pooling = ModelPooling.for_model(
            source.path, source.config.hidden_size, source.config.encoder, source.config.num_labels == 1
        )
        self._ids = itertools.count()
        # LoRA adapters served on the model (engine_server.lora): None unless the config turns LoRA on.
        self.adapters = AdapterRegistry.for_engine(self.config.lora, source.config, source.name)
        freeze_startup_heap()

    def load_adapter(self, name: str, path: str) -> ServedAdapter:
        """Serve the PEFT adapter in folder `path` as `name` (generate's `adapters` then select it)."""
        return self._registry().load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name`."""
        self._registry().unload(name)

    def _registry(self) -> AdapterRegistry:
        if self.adapters is None:
            raise LoraDisabledError("LoRA is off: build the LLM with EngineConfig(lora=LoraConfig(...))")
        return self.adapters

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        adapters: str | Sequence[str | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[GenerationResult]:
        """Generate for each prompt (text, token ids or a ChatPrompt); one result per prompt, in order.

        `adapters`: the LoRA adapter (`load_adapter`'s name) every prompt, or each prompt, generates with; None:
        the base model.

        `params` None takes the model's generation defaults (`generation_defaults`) for every field; a given
        SamplingParams is used as it is (build one with `sampling_params(**fields)` to keep the model's
        defaults for the fields you leave out).

        Every prompt is validated before any work starts, so a bad prompt raises ValidationError and nothing runs.
        Constraints are all compiled (in parallel, blocking this call up to the compiler's time limit) before
        any request reaches the core; one that fails to compile raises ValidationError likewise.
        """
        if self.pooling.encoder:
            raise UnsupportedByModelError(
                "the model is an encoder: it embeds and scores (`embed`, `score`), not generates"
            )
        batch = _as_prompt_list(prompts)
        if any(isinstance(prompt, TranscriptionPrompt) for prompt in batch):
            windowed = [self.inputs.windows(prompt) for prompt in batch]
            if any(windows is not None for windows in windowed):
                return self._generate_windows(batch, windowed, params, adapters, use_tqdm)
        batch = self._with_languages(batch)
        if params is None:
            params = self.generation_defaults.sampling_params()
        if any(isinstance(prompt, TranscriptionPrompt) and prompt.temperature_fallback for prompt in batch):
            return self._generate_fallback(batch, params, adapters, use_tqdm)
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(batch)} prompts")
        if any(p.beam_width > 1 for p in per_prompt):
            return self._generate_beams(batch, per_prompt, adapters, use_tqdm)
        sampling = [sampled_best_of(p) for p in per_prompt]
        if any(s is not None for s in sampling):  # best_of sampled, the n best answered
            found = self.generate(batch, [s or p for s, p in zip(sampling, per_prompt, strict=True)],
                                  adapters=adapters, use_tqdm=use_tqdm)  # fmt: skip
            return [best_of_answer(result, p) if s is not None else result
                    for result, s, p in zip(found, sampling, per_prompt, strict=True)]  # fmt: skip
        trackers: dict[str, RequestTracker] = {}
        pending: deque[Request] = deque()
        # Chat prompts settle tool calling here: a forced tool_choice adds its grammar as the constraint.
        loras = self._resolve_adapters(adapters, len(batch))
        prepared = [self.inputs.prepare(prompt, sampling) for prompt, sampling in zip(batch, per_prompt, strict=True)]
        # Every compile starts before the first is awaited, so they overlap.
        compiles = [self.inputs.compile_constraint(item.params) for item in prepared]
        for item, grammar, lora in zip(prepared, compiles, loras, strict=True):
            request_id = f"offline-{next(self._ids)}"
            requests = self.inputs.make_requests(
                request_id, item.token_ids, item.params, grammar=grammar.result(), lora=lora,
                multimodal=item.multimodal,
            )  # fmt: skip
            tracker = RequestTracker(
                self.tokenizer, request_id, item.token_ids, item.params, self.token_text, item.tool_parsing,
                item.reasoning, item.harmony, item.reasoning_tags, item.transcription, item.timestamps, item.words,
            )
            # Tokens of choices that nothing needs to see before they finish (no stop strings to match as the
            # text grows) come once, at the finish, so their text is decoded once and per-step host work is small.
            for request in requests:
                request.final_only = not tracker.needs_every_step
            pending.extend(requests)
            trackers[request_id] = tracker
        self._run(pending, trackers, use_tqdm)
        return [tracker.result for tracker in trackers.values()]

    def _generate_beams(
        self,
        batch: list[Prompt],
        per_prompt: list[SamplingParams],
        adapters: str | Sequence[str | None] | None,
        use_tqdm: bool,
    ) -> list[GenerationResult]:
        """`generate` where some prompts ask beam search (`engine_server.beam_search`): the others run first, together;
        then every search's running beams run together as one-token requests, step after step, until each search
        is done. Every beam search is validated before anything runs (`InputProcessor.beam_search`)."""
        names = [adapters] * len(batch) if adapters is None or isinstance(adapters, str) else list(adapters)
        searching = [i for i, p in enumerate(per_prompt) if p.beam_width > 1]
        prepared = {i: self.inputs.prepare(batch[i], per_prompt[i]) for i in searching}
        searches = {i: self.inputs.beam_search(prepared[i]) for i in searching}
        self._resolve_adapters([names[i] for i in searching], len(searching))
        results: dict[int, GenerationResult] = {}
        plain = [i for i in range(len(batch)) if i not in searches]
        if plain:
            found = self.generate([batch[i] for i in plain], [per_prompt[i] for i in plain],
                                  adapters=[names[i] for i in plain], use_tqdm=use_tqdm)  # fmt: skip
            results.update(zip(plain, found, strict=True))
        while live := [i for i in searching if not searches[i].done]:
            beams = [(i, beam) for i in live for beam in searches[i].running]
            steps = self.generate(
                [[*prepared[i].token_ids, *beam.token_ids] for i, beam in beams],
                [beam_search.step_params(prepared[i].params, searches[i]) for i, _ in beams],
                adapters=[names[i] for i, _ in beams], use_tqdm=False,
            )  # fmt: skip
            for i in live:
                mine = [step for (owner, _), step in zip(beams, steps, strict=True) if owner == i]
                searches[i].advance([beam_candidates(step) for step in mine])
        for i in searching:
            item = prepared[i]
            tracker = RequestTracker(
                self.tokenizer, f"offline-{next(self._ids)}", item.token_ids, item.params, self.token_text,
                item.tool_parsing, item.reasoning, item.harmony, item.reasoning_tags,
            )  # fmt: skip
            results[i] = beam_answer(tracker, searches[i])
        return [results[i] for i in range(len(batch))]

    def _generate_windows(
        self,
        batch: list[Prompt],
        windowed: list[tuple[list[TranscriptionPrompt], float] | None],
        params: SamplingParams | Sequence[SamplingParams] | None,
        adapters: str | Sequence[str | None] | None,
        use_tqdm: bool,
    ) -> list[GenerationResult]:
        """`generate` where some transcriptions' clips are longer than the encoder's window: each such clip's windows
        (`InputProcessor.windows`) run as transcriptions of their own beside the other prompts, in one batch, with
        its parameters and adapter, the language detected once on its first window where none is given and used for
        all; their results joined in order (`frontend.joined_results`)."""
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(batch)} prompts")
        names = [adapters] * len(batch) if adapters is None or isinstance(adapters, str) else list(adapters)
        if len(names) != len(batch):
            raise ValueError(f"got {len(names)} adapters for {len(batch)} prompts")
        long = {i: windows for i, windows in enumerate(windowed) if windows is not None}
        detect = [i for i, windows in long.items() if self.inputs.needs_language(windows[0][0])]
        firsts = self._with_languages([long[i][0][0] for i in detect])
        for i, first in zip(detect, firsts, strict=True):
            language = cast(TranscriptionPrompt, first).language
            windowed[i] = [dataclasses.replace(window, language=language) for window in long[i][0]], long[i][1]
        flat: list[Prompt] = []
        flat_params: list[SamplingParams | None] = []
        flat_names: list[str | None] = []
        spans: list[tuple[int, int]] = []
        for prompt, windows, sampling, name in zip(batch, windowed, per_prompt, names, strict=True):
            parts: list[Prompt] = [prompt] if windows is None else list(windows[0])
            spans.append((len(flat), len(flat) + len(parts)))
            flat += parts
            flat_params += [sampling] * len(parts)
            flat_names += [name] * len(parts)
        defaults = self.generation_defaults.sampling_params()
        results = self.generate(flat, [defaults if p is None else p for p in flat_params], adapters=flat_names,
                                use_tqdm=use_tqdm)  # fmt: skip
        return [results[start] if windows is None else joined_results(results[start:end], windows[1])
                for (start, end), windows in zip(spans, windowed, strict=True)]  # fmt: skip

    def _generate_fallback(
        self,
        batch: list[Prompt],
        params: SamplingParams | Sequence[SamplingParams],
        adapters: str | Sequence[str | None] | None,
        use_tqdm: bool,
    ) -> list[GenerationResult]:
        """`generate` where some transcriptions decode under Whisper's temperature fallback (`multimodal.fallback`):
        each such prompt is decoded at 0 beside its silence probe (`SilenceProbe`, where the model has `<|nospeech|>`)
        and the other prompts, then those that fail Whisper's check again, together, at each hotter temperature in
        turn until each passes or the temperatures run out; each answered as `frontend.fallback_answer` joins its
        decodes. ValidationError before anything runs (`InputProcessor.fallback_attempt`)."""
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(batch)} prompts")
        names = [adapters] * len(batch) if adapters is None or isinstance(adapters, str) else list(adapters)
        falling = [i for i, prompt in enumerate(batch)
                   if isinstance(prompt, TranscriptionPrompt) and prompt.temperature_fallback]  # fmt: skip

        def attempt(i: int, temperature: float) -> tuple[TranscriptionPrompt, SamplingParams]:
            return self.inputs.fallback_attempt(cast(TranscriptionPrompt, batch[i]), per_prompt[i], temperature)

        first = {i: attempt(i, TEMPERATURES[0]) for i in falling}
        probes = [SilenceProbe(cast(TranscriptionPrompt, batch[i])) for i in falling] if self.inputs.probes_silence \
            else []  # fmt: skip
        found = self.generate(
            [*(first[i][0] if i in first else prompt for i, prompt in enumerate(batch)), *probes],
            [*(first[i][1] if i in first else p for i, p in enumerate(per_prompt)), *[per_prompt[0]] * len(probes)],
            adapters=[*names, *[names[i] for i in falling][: len(probes)]], use_tqdm=use_tqdm,
        )  # fmt: skip
        no_speech = {i: math.exp(cast(list[Any], r.choices[0].logprobs)[0].logprob)
                     for i, r in zip(falling, found[len(batch):], strict=False)}  # fmt: skip
        tried = {i: [found[i]] for i in falling}
        checks = {i: decode_check(found[i], no_speech.get(i)) for i in falling}
        used = dict.fromkeys(falling, TEMPERATURES[0])
        for temperature in TEMPERATURES[1:]:
            pending = [i for i in falling if not checks[i].passes]
            if not pending:
                break
            hotter = [attempt(i, temperature) for i in pending]
            again = self.generate([p for p, _ in hotter], [sp for _, sp in hotter],
                                  adapters=[names[i] for i in pending], use_tqdm=use_tqdm)  # fmt: skip
            for i, result in zip(pending, again, strict=True):
                tried[i].append(result)
                checks[i], used[i] = decode_check(result, no_speech.get(i)), temperature
        answers = list(found[: len(batch)])
        for i in falling:
            asked = per_prompt[i].logprobs or per_prompt[i].top_logprobs > 0
            answers[i] = fallback_answer(tried[i], checks[i], used[i], asked)
        return answers

    def _with_languages(self, batch: list[Prompt]) -> list[Prompt]:
        """`batch` with each transcription that names no language in the one its clip is detected to be in (one
        greedy token of each, their `LanguageDetection` requests run together first)."""
        detect = [i for i, prompt in enumerate(batch) if self.inputs.needs_language(prompt)]
        if not detect:
            return batch
        found = self.generate([LanguageDetection(cast(TranscriptionPrompt, batch[i])) for i in detect],
                              use_tqdm=False)  # fmt: skip
        batch = list(batch)
        for i, result in zip(detect, found, strict=True):
            batch[i] = self.inputs.detected(cast(TranscriptionPrompt, batch[i]), result.choices[0].token_ids[0])
        return batch

    def _resolve_adapters(self, adapters: str | Sequence[str | None] | None, count: int) -> list[LoraAdapter | None]:
        names = [adapters] * count if adapters is None or isinstance(adapters, str) else list(adapters)
        if len(names) != count:
            raise ValueError(f"got {len(names)} adapters for {count} prompts")
        return [None if name is None else self._registry().resolve(name) for name in names]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        normalize: bool | None = None,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[torch.Tensor]:
        """One vector per prompt, in order (1-D float32 tensors), as the Embed RPC computes them: the model's
        pooling (`self.pooling`), `dimensions` leading values (None: all), L2-normalized unless `normalize` is
        False (None: the model's default). Every prompt is validated first (ValidationError: nothing runs)."""
        batch = _as_prompt_list(prompts)
        params = self.pooling.params(normalize, dimensions)
        token_ids = [pooling_token_ids(self.inputs, prompt, truncate_prompt_tokens, "prompts") for prompt in batch]
        requests = pooling_requests(
            f"offline-{next(self._ids)}", token_ids, params, self.core.max_model_len, Priority.INTERACTIVE
        )
        return self._run_pooling(requests, use_tqdm)

    def score(self, query: Prompt, documents: Sequence[Prompt], *, use_tqdm: bool = True) -> list[float]:
        """Each document's score against the query (as the Score RPC): the cosine similarity of their embeddings,
        or a cross-encoder's relevance of the pair."""
        if self.pooling.cross_encoder:
            pairs = [pair_token_ids(self.inputs, query, document, None) for document in documents]
            request_id = f"offline-{next(self._ids)}"
            params = self.pooling.pair_params()
            requests = pooling_requests(request_id, pairs, params, self.core.max_model_len, Priority.INTERACTIVE)
            return [float(score[0]) for score in self._run_pooling(requests, use_tqdm)]
        vectors = self.embed([query, *documents], normalize=False, use_tqdm=use_tqdm)
        return cosine_scores(vectors[0], vectors[1:])

    def close(self) -> None:
        """Stop the tensor-parallel workers and the grammar compiler; the LLM cannot generate afterwards."""
        self.core.close()
        if self.grammar_compiler is not None:
            self.grammar_compiler.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def sampling_params(self, **fields: Any) -> SamplingParams:
        """SamplingParams with the model's generation defaults for every field not in `fields` (which win)."""
        return self.generation_defaults.sampling_params(**fields)

    def chat(
        self, conversations: Sequence[ChatPrompt], params: SamplingParams | None = None, *, use_tqdm: bool = True
    ) -> list[GenerationResult]:
        """Generate one assistant turn for each conversation (`params` as in `generate`)."""
        return self.generate(list(conversations), params, use_tqdm=use_tqdm)

    def _run(self, pending: deque[Request], trackers: dict[str, RequestTracker], use_tqdm: bool) -> None:
        # Feed the core gradually so that a huge offline batch never hits the waiting-queue limit.
        window = max(self.config.scheduler.max_num_seqs * 2, 1)
        progress = tqdm(total=len(trackers), desc="generate", disable=not use_tqdm, unit="req")
        done: set[str] = set()
        while pending or self.core.has_unfinished():
            while pending and self.core.scheduler.num_waiting < window:
                self.core.add_request(pending.popleft())
            for output in self.core.step():
                request_id, choice_index = split_core_request_id(output.request_id)
                tracker = trackers[request_id]
                _, abort_core = tracker.update(choice_index, output)
                if abort_core:
                    self.core.abort_requests([output.request_id])
                if request_id not in done and tracker.result.finished:
                    done.add(request_id)
                    progress.update(1)
        progress.close()

    def _run_pooling(self, requests: list[Request], use_tqdm: bool) -> list[torch.Tensor]:
        """Run pooling requests to their end (fed gradually, as `_run`); their vectors in order."""
        window = max(self.config.scheduler.max_num_seqs * 2, 1)
        pending = deque(requests)
        vectors: dict[str, torch.Tensor] = {}
        progress = tqdm(total=len(requests), desc="embed", disable=not use_tqdm, unit="input")
        while pending or self.core.has_unfinished():
            while pending and self.core.scheduler.num_waiting < window:
                self.core.add_request(pending.popleft())
            for output in self.core.step():
                if output.pooled is None:
                    raise RuntimeError(f"pooling request {output.request_id} ended without a vector ({output.status})")
                vectors[output.request_id] = output.pooled
                progress.update(1)
        progress.close()
        return [vectors[request.request_id] for request in requests]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | ChatPrompt | TranscriptionPrompt | LanguageDetection | SilenceProbe):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(p, int) for p in items):
        return [cast(list[int], items)]  # one prompt given as token ids
    return cast(list[Prompt], items)
