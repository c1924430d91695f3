"""In front of the core: prompts in (tokenize, template, validate, expand n), choices out (detokenize, stop).

Both the offline `LLM` and the gRPC servicer use these pieces, so a request means the same on every path.
None of this runs on the step loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from engine_server import beam_search
from engine_server.beam_search import BeamSearch
from engine_server.core.engine_core import CoreOutput
from engine_server.core.request import Priority, Request, RequestStatus, RequestTimeline, resolve_max_tokens
from engine_server.errors import ValidationError
from engine_server.harmony import HarmonyStream
from engine_server.multimodal.audio import AudioProcessing, PromptAudio
from engine_server.multimodal.fallback import DecodeCheck
from engine_server.multimodal.inputs import MultimodalInputs
from engine_server.multimodal.processing import ImageProcessing, PromptImage
from engine_server.multimodal.transcription import (
    TimestampTokens,
    TranscriptionInfo,
    TranscriptionPrompt,
    TranscriptionSegment,
    WhisperTranscription,
)
from engine_server.multimodal.word_timing import TranscriptionWord, WordTiming
from engine_server.output import OutputProcessor, TokenTextCodec
from engine_server.output.types import FinishReason
from engine_server.reasoning import (
    THINK,
    ReasoningStart,
    ReasoningStream,
    ReasoningTags,
    parser_reasoning_tags,
    reasoning_start,
    shortest_prefix,
)
from engine_server.sampling import TokenLogprobs
from engine_server.sampling_params import SamplingParams, validate_token_ids
from engine_server.tokenizer.chat import ChatMessage, ChatTool, render_chat
from engine_server.tools import (
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolChoice,
    ToolFormat,
    ToolParsing,
    ToolTemplate,
    chat_for_template,
    default_tool_choice,
    tool_parsing,
)
from engine_server.tools.grammar import forced_call_constraint
from engine_server.tools.types import new_call_id

if TYPE_CHECKING:
    from engine_server.lora.peft_format import LoraAdapter
    from engine_server.structured.compiler import CompiledConstraint, GrammarCompiler

_CORE_FINISH = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_DEADLINE: FinishReason.ABORT,
}


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation to continue with the model's chat template; `tool_choice` None means OpenAI's default
    (auto with tools, none without)."""

    messages: Sequence[ChatMessage]
    tools: Sequence[ChatTool] = ()
    add_generation_prompt: bool = True
    # Continue the last message (its content the output's beginning) rather than answer it; needs
    # add_generation_prompt False (`render_chat`).
    continue_final_message: bool = False
    # Documents for a template that reads them (a RAG template), each a mapping of strings ({"title", "text"}).
    documents: Sequence[Mapping[str, str]] = ()
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tool_choice: ToolChoice | None = None

    @property
    def effective_tool_choice(self) -> ToolChoice:
        return self.tool_choice if self.tool_choice is not None else default_tool_choice(self.tools)


@dataclass(frozen=True)
class LanguageDetection:
    """The one-token request that detects a transcription's language (`InputProcessor.needs_language`): its output
    is the language token (`InputProcessor.detected`)."""

    transcription: TranscriptionPrompt


@dataclass(frozen=True)
class SilenceProbe:
    """The one-token request that measures how silent a transcription's clip is (Whisper's `<|nospeech|>`
    probability: `InputProcessor.probes_silence`), run beside its temperature fallback's first decode."""

    transcription: TranscriptionPrompt


Prompt = str | Sequence[int] | ChatPrompt | TranscriptionPrompt | LanguageDetection | SilenceProbe


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one generated token, with the best alternatives (best first)."""

    token_id: int
    token: str
    logprob: float
    token_bytes: bytes
    top_logprobs: tuple[TopLogprob, ...] = ()
    rank: int = 0  # among the vocabulary (1: the most likely); 0 where not computed (a sampled token's)


@dataclass(frozen=True)
class PromptLogprobs:
    """A prompt's tokens: the first one (which has no log-probability: nothing comes before it), then every later
    one with its log-probability given the tokens before it and its best alternatives (`tokens[i]` is prompt token
    i + 1)."""

    first_token_id: int
    first_token: str
    first_token_bytes: bytes
    tokens: list[TokenLogprob]


@dataclass
class Choice:
    """One choice of a result; grows as tokens arrive.

    With tool calls parsed, `text` is the content outside the calls and `tool_calls` the calls (in a result);
    a stream step carries the calls' pieces in `tool_call_deltas` instead.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_deltas: list[ToolCallDelta] = field(default_factory=list)
    # A thinking model's reasoning, apart from `text` (`engine_server.reasoning`); a stream step's new part.
    reasoning_text: str = ""
    # A transcription decoded with timestamps: its segments, once it finished (a stream step: its last).
    segments: list[TranscriptionSegment] = field(default_factory=list)
    # A transcription asking word timings: its words, once it finished (a stream step: its last).
    words: list[TranscriptionWord] = field(default_factory=list)


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt ready for `make_requests`: its token ids, the parameters to run it with (a forced tool_choice
    adds its grammar as the constraint), and how to read tool calls from its output (None: not read)."""

    token_ids: list[int]
    params: SamplingParams
    tool_parsing: ToolParsing | None = None
    reasoning: ReasoningStart | None = None  # how the output's reasoning is split off (None: it is not)
    reasoning_tags: ReasoningTags = THINK  # the tags it is written between
    harmony: bool = False  # the output is read as harmony (gpt-oss: `engine_server.harmony`), not by the two above
    multimodal: MultimodalInputs | None = None  # the prompt's images, their placeholders expanded in `token_ids`
    transcription: TranscriptionInfo | None = None  # a transcription's language and clip length
    timestamps: TimestampTokens | None = None  # a transcription's timestamp tokens (kept out of its text; segments)
    words: WordTiming | None = None  # how a transcription asking word timings reads its words


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those generated inside the reasoning (its end tag included)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class GenerationResult:
    """The whole result of one request: every choice, in index order, and usage."""

    request_id: str
    prompt_token_ids: list[int]
    choices: list[Choice]
    usage: Usage
    timeline: RequestTimeline | None = field(default=None, compare=False)  # the first choice's, when finished (traces)
    # With SamplingParams.prompt_logprobs, once the prompt has run; else None.
    prompt_logprobs: PromptLogprobs | None = None
    # For a transcription (`TranscriptionPrompt`): its language and clip length; else None.
    transcription: TranscriptionInfo | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


class InputProcessor:
    """Turns a prompt and sampling parameters into validated core Requests (one per choice).

    Constrained requests (`SamplingParams.constraint`) need a `grammar_compiler`; their grammar is compiled
    before the core sees them. An async caller awaits `compile_constraint(params)` (wrapped with
    `asyncio.wrap_future`) and passes the result to `make_requests(grammar=...)`; a sync caller may let
    `make_requests` compile, which blocks it (never the core) up to the compiler's time limit.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        grammar_compiler: GrammarCompiler | None = None,
        tool_call_parser: str = "auto",
        reasoning_parser: str = "auto",
        images: ImageProcessing | None = None,
        images_refusal: str = "this model reads no images; send text alone",
        audio: AudioProcessing | None = None,
        audio_refusal: str = "this model hears no audio; send text alone",
        transcription: WhisperTranscription | None = None,
        transcription_refusal: str = "this model does not transcribe audio (Input.transcription is served for "
        "Whisper checkpoints)",
    ) -> None:
        """`tool_call_parser`: EngineConfig.tool_call_parser (the format tool calls are read in, or "auto");
        `reasoning_parser`: EngineConfig.reasoning_parser (auto: on when the chat template mentions <think>);
        `images`: how the model's images are prepared (None: a turn with an image is refused, `images_refusal` the
        message); `audio` the same for audio clips; `transcription`: a speech-to-text model's prompts (Whisper's: then
        every other kind of prompt is refused)."""
        self.tokenizer = tokenizer
        self.transcription = transcription
        self.transcription_refusal = transcription_refusal
        self.images = images
        self.images_refusal = images_refusal
        self.audio = audio
        self.audio_refusal = audio_refusal
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammar_compiler = grammar_compiler
        template = getattr(tokenizer, "chat_template", None)
        self.tool_template = ToolTemplate.detect(template, tool_call_parser)
        # gpt-oss: its chat template writes harmony, whose channels carry the reasoning, the answer and the calls
        # (vLLM's parser names for it, "openai" and "openai_gptoss", force it).
        self.harmony = self.tool_template.format is ToolFormat.HARMONY or reasoning_parser == "openai_gptoss"
        tags = parser_reasoning_tags(reasoning_parser, str(template) if template is not None else "")
        self.reasoning_tags: ReasoningTags | None = None if self.harmony else tags
        self.splits_reasoning = self.reasoning_tags is not None
        # Tags that are special tokens of the vocabulary (Magistral's [THINK]) vanish from text decoded without them.
        special = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
        marks = {tags.open, tags.close, *(tags.answer or ())} if tags is not None else set()
        self._reasoning_tags_special = bool(marks & special)

    def compile_constraint(self, params: SamplingParams) -> Future[CompiledConstraint | None]:
        """The compiled grammar of `params.constraint` (None without one), as a future that resolves within the
        compiler's time limit; it fails with ValidationError for a bad spec or when no compiler is configured."""
        future: Future[CompiledConstraint | None] = Future()
        constraint = params.constraint
        if constraint is None:
            future.set_result(None)
        elif self.grammar_compiler is None:
            future.set_exception(
                ValidationError("structured output is not enabled on this engine", param=constraint.param)
            )
        else:
            return cast("Future[CompiledConstraint | None]", self.grammar_compiler.submit(constraint))
        return future

    def render(self, prompt: ChatPrompt) -> str:
        """The prompt text of a conversation: the model's template, given the tools as tool_choice allows (or
        the fallback tools prompt when the template has no tool support). Raises ValidationError."""
        choice = prompt.effective_tool_choice
        choice.validate(prompt.tools)
        messages, tools = chat_for_template(prompt.messages, prompt.tools, choice, self.tool_template)
        return render_chat(self.tokenizer, messages, tools, prompt.add_generation_prompt, prompt.template_kwargs,
                           prompt.continue_final_message, prompt.documents)  # fmt: skip

    def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedPrompt:
        """Tokenize a prompt and, for a chat with tools, settle tool calling (blocking: run it off the event
        loop). A forced tool_choice becomes the request's constraint; a request that also brings a constraint
        of its own is refused (ValidationError, param "tool_choice"). A transcription (`TranscriptionPrompt`, its
        language known: `needs_language`) is Whisper's decoder prompt and clip; a speech-to-text model refuses every
        other kind, and every other model a transcription. With `params.truncate_prompt_tokens` the prompt's last
        tokens are kept (-1: as many as the context holds), a prompt of images or clips refused with it."""
        prepared = self._prepare(prompt, params)
        if params.bad_words:
            params.validate_values()  # (at most 16 words, each bounded, before they are tokenized)
            prepared = dataclasses.replace(prepared, params=dataclasses.replace(
                prepared.params, bad_word_token_ids=self.bad_word_token_ids(params.bad_words)))  # fmt: skip
        keep = params.truncate_prompt_tokens
        if keep is None:
            return prepared
        if keep == 0 or keep < -1:
            raise ValidationError(f"truncate_prompt_tokens must be -1 (the context length) or at least 1, not {keep}",
                                  "truncate_prompt_tokens")  # fmt: skip
        if prepared.multimodal is not None or prepared.transcription is not None:
            raise ValidationError("truncate_prompt_tokens is not served with images or clips: their tokens may not be "
                                  "cut", "truncate_prompt_tokens")  # fmt: skip
        keep = self.max_model_len if keep == -1 else keep
        if len(prepared.token_ids) <= keep:
            return prepared
        return dataclasses.replace(prepared, token_ids=prepared.token_ids[-keep:])

    def bad_word_token_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token sequences, as vLLM makes them: the word (its leading spaces stripped) as tokens,
        then " " + the word where that is other tokens (a first token of its own) of the same count."""
        found: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            found.append(bare)
            if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
                found.append(spaced)
        return tuple(word for word in found if word)

    def _prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedPrompt:
        """`prepare` but the truncation."""
        if isinstance(prompt, TranscriptionPrompt | LanguageDetection | SilenceProbe) or self.transcription is not None:
            return self._prepare_transcription(prompt, params)
        if not isinstance(prompt, ChatPrompt):
            return PreparedPrompt(self.tokenize(prompt), params)
        ids, multimodal, text = self._chat_prompt(prompt)
        choice = prompt.effective_tool_choice
        if self.harmony:
            return self._prepare_harmony(ids, params, prompt, choice)
        if choice.forced:
            if params.constraint is not None:
                raise ValidationError(
                    "tool_choice 'required' or a named function cannot be combined with a constraint", "tool_choice"
                )
            constraint = forced_call_constraint(prompt.tools, choice, self.tool_template.format)
            params = dataclasses.replace(params, constraint=constraint)
        parsing = tool_parsing(prompt.tools, choice, self.tool_template)
        if parsing is not None and parsing.format.keeps_special_tokens:
            # Mistral's tokenizers hold [TOOL_CALLS] as a special token (DeepSeek, Kimi, GLM their markers): decoded
            # with the special tokens skipped, the calls' markers would vanish from the text (vLLM keeps them for
            # these parsers too).
            params = dataclasses.replace(params, skip_special_tokens=False)
        tags = self.reasoning_tags or THINK
        reasoning = reasoning_start(text, tags) if self.splits_reasoning else None
        if reasoning is not None and params.constraint is not None and not params.constraint.after_reasoning:
            # The reasoning is free; a response_format or a forced tool call constrains the answer after it.
            after = params.constraint.after(reasoning.value, (tags.open, tags.close, *(tags.answer or ())))
            params = dataclasses.replace(params, constraint=after)
        if reasoning is not None and self._reasoning_tags_special:
            params = dataclasses.replace(params, skip_special_tokens=False)
        return PreparedPrompt(ids, params, parsing, reasoning, tags, multimodal=multimodal)

    def needs_language(self, prompt: Prompt) -> bool:
        """Whether `prompt` is a transcription whose language the model must detect first (`LanguageDetection`)."""
        return (self.transcription is not None and not self.transcription.english_only
                and isinstance(prompt, TranscriptionPrompt) and not prompt.language.strip())  # fmt: skip

    def windows(self, prompt: Prompt) -> tuple[list[TranscriptionPrompt], float] | None:
        """A transcription whose clip is longer than the encoder's window as its windows and the clip's seconds
        (`WhisperTranscription.windows`: ValidationError over its cap); None for any other prompt."""
        if self.transcription is None or not isinstance(prompt, TranscriptionPrompt):
            return None
        return self.transcription.windows(prompt)

    @property
    def probes_silence(self) -> bool:
        """Whether the model measures a clip's silence (its vocabulary has `<|nospeech|>`: `SilenceProbe`)."""
        return self.transcription is not None and self.transcription.no_speech is not None

    def fallback_attempt(self, prompt: TranscriptionPrompt, params: SamplingParams, temperature: float
                         ) -> tuple[TranscriptionPrompt, SamplingParams]:  # fmt: skip
        """One decode of a temperature fallback (`multimodal.fallback`): `prompt` decoded once at `temperature`, its
        processed log-probabilities given; ValidationError where the request is not one to fall back from (its
        temperature not 0, or n over 1)."""
        if not params.greedy:
            raise ValidationError("temperature_fallback decodes greedily first, then hotter: the sampling's "
                                  f"temperature must be 0, not {params.temperature}", "temperature")  # fmt: skip
        if params.n != 1:
            raise ValidationError(f"temperature_fallback answers one choice: n must be 1, not {params.n}", "n")
        return dataclasses.replace(prompt, temperature_fallback=False), dataclasses.replace(
            params, temperature=temperature, logprobs=True, processed_logprobs=True)

    def beam_search(self, prepared: PreparedPrompt) -> BeamSearch:
        """The beam search of `prepared` (its parameters' beam_width over 1), validated as `make_requests` validates a
        request; ValidationError where it asks what beam search does not serve (`beam_search.refusal`) or brings
        images or a clip (beam search reads text)."""
        params = prepared.params
        prompt_len = len(prepared.token_ids)
        params.validate(vocab_size=self.vocab_size, max_model_len=self.max_model_len, prompt_len=prompt_len)
        stop_ids = sorted((frozenset() if params.ignore_eos else self.eos_token_ids) | frozenset(params.stop_token_ids))
        beam_search.refusal(params, stop_ids)
        if prepared.multimodal is not None or prepared.transcription is not None:
            raise ValidationError("beam search reads text prompts: images, clips and transcriptions are not served "
                                  "with it", "beam_width")  # fmt: skip
        max_new = resolve_max_tokens(params, prompt_len, self.max_model_len)
        return BeamSearch(params.beam_width, stop_ids, max_new, params.min_tokens, params.length_penalty,
                          params.early_stopping)  # fmt: skip

    def detected(self, prompt: TranscriptionPrompt, language_token: int) -> TranscriptionPrompt:
        """`prompt` in the language of `language_token` (its `LanguageDetection`'s output)."""
        assert self.transcription is not None
        return dataclasses.replace(prompt, language=self.transcription.code_of(language_token))

    def _prepare_transcription(self, prompt: Prompt, params: SamplingParams) -> PreparedPrompt:
        """A transcription's prompt (or its language's detection: one greedy token), its max_tokens capped by what the
        context (Whisper's `max_target_positions`) leaves after the prompt; ValidationError naming what is served where
        the model or the prompt is not a transcription's."""
        if self.transcription is None:
            raise ValidationError(self.transcription_refusal, "input.transcription")
        if isinstance(prompt, LanguageDetection):
            found = self.transcription.detection(prompt.transcription, self.vocab_size)
            params = SamplingParams(max_tokens=1, temperature=0.0)
        elif isinstance(prompt, SilenceProbe):
            probe = self.transcription.silence_probe(prompt.transcription, self.vocab_size)
            assert probe is not None, "a silence probe needs `<|nospeech|>` (InputProcessor.probes_silence)"
            found = probe
            params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True)
        elif isinstance(prompt, TranscriptionPrompt):
            found = self.transcription.prepare(prompt, self.transcription.language_code(prompt.language))
        else:
            raise ValidationError("this model (Whisper) writes audio clips down: send an Input.transcription, not "
                                  "text, chat or token ids", "input")  # fmt: skip
        room = self.max_model_len - len(found.token_ids)  # (Whisper's context: its `max_target_positions`)
        max_tokens = params.max_tokens if params.max_tokens is None else min(params.max_tokens, max(room, 1))
        params = dataclasses.replace(params, suppress_token_ids=found.suppress_token_ids, max_tokens=max_tokens,
                                     begin_suppress_token_ids=found.begin_suppress_token_ids,
                                     timestamps=found.rules)  # fmt: skip
        return PreparedPrompt(found.token_ids, params, multimodal=found.clip, transcription=found.info,
                              timestamps=found.timestamps, words=found.words)  # fmt: skip

    def _chat_prompt(self, prompt: ChatPrompt) -> tuple[list[int], MultimodalInputs | None, str]:
        """A conversation's prompt ids (each image's or clip's placeholder expanded to its tokens), what its images or
        clips give the encoder (None: none), and its rendered text. ValidationError (`_chat_media`)."""
        images, clips = self._chat_media(prompt)
        text = _unicode(self.render(prompt), "messages")
        if images:  # (Gemma 3's and Idefics 2's processors lay images out in the text: `ImageProcessing.prompt_ids`)
            assert self.images is not None  # (`_chat_media` refuses them otherwise)
            ids, multimodal = self.images.prepare(self.images.prompt_ids(text, self._chat_ids), images)
            return ids, multimodal, text
        if clips:
            assert self.audio is not None
            ids, multimodal = self.audio.prepare(self._chat_ids(text), clips)
            return ids, multimodal, text
        return self._chat_ids(text), None, text

    def _chat_media(self, prompt: ChatPrompt) -> tuple[list[PromptImage], list[PromptAudio]]:
        """The conversation's images and audio clips in order; ValidationError where the model reads none of their
        kind or one is outside a user turn (as OpenAI's API reads them)."""
        images, clips = [], []
        for i, message in enumerate(prompt.messages):
            for j, image in message.images:
                param = f"messages[{i}].content[{j}]"
                if self.images is None:
                    raise ValidationError(self.images_refusal, param)
                if message.role != "user":
                    raise ValidationError(f"images are read in user turns only, not in a {message.role!r} turn", param)
                images.append(PromptImage(image.data, param))
            for j, clip in message.audio:
                param = f"messages[{i}].content[{j}]"
                if self.audio is None:
                    raise ValidationError(self.audio_refusal, param)
                if message.role != "user":
                    raise ValidationError(f"audio is heard in user turns only, not in a {message.role!r} turn", param)
                clips.append(PromptAudio(clip.data, param))
        return images, clips

    def _prepare_harmony(
        self, ids: list[int], params: SamplingParams, prompt: ChatPrompt, choice: ToolChoice
    ) -> PreparedPrompt:
        """A chat of a harmony model (gpt-oss): its output is decoded with the special tokens kept (its channel
        markers are special tokens) and read by `engine_server.harmony`. A constraint (response_format) applies to
        the final channel's body, after a free reasoning message (`Constraint.after_reasoning` "harmony"); a forced
        tool_choice becomes a grammar of harmony's call messages (`forced_call_constraint`), and one beside a
        constraint of the request's own is refused (ValidationError, param "tool_choice")."""
        constraint = params.constraint
        if choice.forced:
            if constraint is not None:
                raise ValidationError(
                    "tool_choice 'required' or a named function cannot be combined with a constraint", "tool_choice"
                )
            constraint = forced_call_constraint(prompt.tools, choice, ToolFormat.HARMONY)
        elif constraint is not None and not constraint.after_reasoning:
            constraint = constraint.after("harmony")
        params = dataclasses.replace(params, skip_special_tokens=False, constraint=constraint)
        return PreparedPrompt(ids, params, tool_parsing(prompt.tools, choice, self.tool_template), harmony=True)

    def _chat_ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt. Chat is rendered with the model's template (which adds its own specials)."""
        if isinstance(prompt, ChatPrompt):
            return self._chat_prompt(prompt)[0]
        if isinstance(prompt, TranscriptionPrompt | LanguageDetection | SilenceProbe) or self.transcription is not None:
            raise ValidationError("a speech-to-text model's prompts are laid out from their clips: Tokenize does not "
                                  "serve them", "input")  # fmt: skip
        if isinstance(prompt, str):
            if not prompt:
                raise ValidationError("prompt must not be empty", "prompt")
            return list(self.tokenizer.encode(_unicode(prompt, "prompt"), add_special_tokens=add_special_tokens))
        ids = list(prompt)
        validate_token_ids(ids, self.vocab_size, "prompt")
        return ids

    def make_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        deadline: float | None = None,
        grammar: CompiledConstraint | None = None,
        cache_salt: str = "",
        lora: LoraAdapter | None = None,
        multimodal: MultimodalInputs | None = None,
    ) -> list[Request]:
        """Validate and expand into n core requests with ids `{request_id}/{i}`; raises ValidationError.

        `grammar` is `compile_constraint(params)`'s result; when params carry a constraint and it is None,
        the constraint is compiled here, blocking (ValidationError if it does not compile in time).
        `cache_salt`: the requests' prefix-cache namespace (`Request`); `lora`: their LoRA adapter (None: the
        base model); `multimodal`: the prompt's images (`PreparedPrompt.multimodal`).
        """
        params.validate(vocab_size=self.vocab_size, max_model_len=self.max_model_len, prompt_len=len(prompt_token_ids))
        if params.constraint is not None and grammar is None:
            grammar = self.compile_constraint(params).result()
        requests = []
        for i in range(params.n):
            # Choice i of a seeded request draws from seed+i: choices differ, each one is reproducible.
            choice_params = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            if i and params.prompt_logprobs is not None:  # the choices share one prompt: the first one reads it
                choice_params = dataclasses.replace(choice_params, prompt_logprobs=None)
            requests.append(
                Request(
                    core_request_id(request_id, i),
                    prompt_token_ids,
                    choice_params,
                    max_model_len=self.max_model_len,
                    eos_token_ids=self.eos_token_ids,
                    priority=priority,
                    deadline=deadline,
                    grammar=grammar if params.constraint is not None else None,
                    cache_salt=cache_salt,
                    lora=lora,
                    multimodal=multimodal,
                )
            )
        return requests


def core_request_id(request_id: str, choice_index: int) -> str:
    return f"{request_id}/{choice_index}"


def split_core_request_id(core_id: str) -> tuple[str, int]:
    request_id, _, index = core_id.rpartition("/")
    return request_id, int(index)


class RequestTracker:
    """Collects the core's outputs for one request's choices into text, tokens, logprobs and usage."""

    def __init__(
        self,
        tokenizer: Any,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        token_text: TokenTextCodec | None = None,
        tool_parsing: ToolParsing | None = None,
        reasoning: ReasoningStart | None = None,
        harmony: bool = False,
        reasoning_tags: ReasoningTags = THINK,
        transcription: TranscriptionInfo | None = None,
        timestamps: TimestampTokens | None = None,
        words: WordTiming | None = None,
    ) -> None:
        """`token_text` names tokens for logprobs; share one per tokenizer across requests (it caches).
        `transcription` (from `PreparedPrompt`) goes on the result as it is; `timestamps` (from there too) are left out
        of each choice's text, and where it reads segments a finished choice gets them (`Choice.segments`); with
        `words` (from there too) a finished choice gets its words (`Choice.words`) from its core output's alignment.
        `tool_parsing` (from `PreparedPrompt`) makes each choice's text go through a tool-call parser, and
        `reasoning` (from there too) first splits its reasoning off (written between `reasoning_tags`): the tool
        parser reads the content only.
        With `harmony` (from there too) a `HarmonyStream` reads each choice instead, its calls when `tool_parsing`
        is given."""
        self.params = params
        self.token_text = token_text or TokenTextCodec(tokenizer)
        self.result = GenerationResult(
            request_id, prompt_token_ids, [Choice(i) for i in range(params.n)], Usage(len(prompt_token_ids)),
            transcription=transcription,
        )
        self._timestamps = timestamps
        self._words = words
        silent = None if timestamps is None else timestamps.begin
        self._processors = [OutputProcessor(tokenizer, prompt_token_ids, params, silent) for _ in range(params.n)]
        self._tool_parsing = tool_parsing
        self._harmony = [HarmonyStream(tool_parsing is not None) if harmony else None for _ in range(params.n)]
        self._tool_streams = [
            ToolCallStream(tool_parsing) if tool_parsing and not harmony else None for _ in range(params.n)
        ]
        self._reasoning = [
            ReasoningStream(reasoning, reasoning_tags) if reasoning and not harmony else None for _ in range(params.n)
        ]
        self._tokenizer = tokenizer

    @property
    def needs_every_step(self) -> bool:
        """Whether each step's output must be applied as it comes: stop strings are matched as the text grows,
        and a match must abort the choice in the core. Without them, updates may be merged (tokens in order)."""
        return bool(self.params.stop)

    def update(self, choice_index: int, output: CoreOutput) -> tuple[Choice, bool]:
        """Apply one core output to a choice; returns a delta Choice and whether the core must abort it."""
        choice = self.result.choices[choice_index]
        new_ids = [t.token_id for t in output.new_tokens]
        finish = _CORE_FINISH[output.status] if output.status is not None else None
        delta = self._processors[choice_index].process(new_ids, finish, output.stop_token_id)
        logprobs = self._logprobs(output) if self.params.logprobs else None
        if output.prompt_logprobs is not None:
            first = self.result.prompt_token_ids[:1]
            names, raw = self.token_text.token_strings(first), self.token_text.token_bytes(first)
            self.result.prompt_logprobs = PromptLogprobs(
                first[0] if first else 0, names[0] if first else "", raw[0] if first else b"",
                self._token_logprobs(output.prompt_logprobs),
            )
        text, call_deltas, reasoning_text = delta.text, list[ToolCallDelta](), ""
        reason, matched = delta.finish_reason, delta.matched_stop
        harmony = self._harmony[choice_index]
        if harmony is not None and choice.finish_reason is None:
            read = self._read_harmony(harmony, choice, text, delta.token_ids, delta.finished)
            text, reasoning_text, call_deltas = read
            if reason is not None and self._tool_parsing is not None:
                reason = self._tool_parsing.finish_reason_for(reason, bool(choice.tool_calls))
                matched = None if reason is FinishReason.TOOL_CALLS else matched
        thinking = self._reasoning[choice_index]
        if thinking is not None and choice.finish_reason is None:
            reasoning_text, text = thinking.feed(text)
            if delta.finished:
                held_reasoning, held_text = thinking.finish()
                reasoning_text, text = reasoning_text + held_reasoning, text + held_text
                ids = [*choice.token_ids, *delta.token_ids]
                self.result.usage.reasoning_tokens += thinking.reasoning_tokens(ids, self._decode)
            choice.reasoning_text += reasoning_text
        tools = self._tool_streams[choice_index]
        if tools is not None and choice.finish_reason is None:
            text, call_deltas = tools.feed(text, final=delta.finished)
            choice.tool_calls = list(tools.calls)
            if reason is not None:
                reason, matched = tools.finish(reason, matched)
        choice.text += text
        choice.token_ids.extend(delta.token_ids)
        if logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + logprobs
        segments: list[TranscriptionSegment] = []
        words: list[TranscriptionWord] = []
        if delta.finished and choice.finish_reason is None:
            choice.finish_reason, choice.matched_stop = reason, matched
            stop = matched if isinstance(matched, int) else None
            if self._timestamps is not None and self._timestamps.segments:
                choice.segments = segments = self._timestamps.read(choice.token_ids, stop, self._decode,
                                                                   self.params.temperature)
            if self._words is not None and output.alignment is not None:
                choice.words = words = self._words.words(self._tokenizer, choice.token_ids, stop, output.alignment)
        usage = self.result.usage
        usage.completion_tokens += len(delta.token_ids)
        if choice_index == 0:
            # Later choices share the first one's prompt blocks; the prompt's cache hits are counted once.
            usage.cached_prompt_tokens = max(usage.cached_prompt_tokens, output.num_cached_tokens)
            if output.timeline is not None:
                self.result.timeline = output.timeline
        step = Choice(
            choice_index, text, delta.token_ids, choice.finish_reason, choice.matched_stop, logprobs,
            tool_call_deltas=call_deltas, reasoning_text=reasoning_text, segments=segments, words=words,
        )
        return step, delta.abort_core

    def _read_harmony(
        self, harmony: HarmonyStream, choice: Choice, text: str, new_ids: Sequence[int], finished: bool
    ) -> tuple[str, str, list[ToolCallDelta]]:
        """(content, reasoning, call deltas) of a harmony choice's new `text`; its reasoning and calls are added to
        `choice`, and at the end its reasoning tokens to the usage."""
        read = harmony.feed(text)
        if finished:
            read.extend(harmony.finish())
            ids = [*choice.token_ids, *new_ids]
            chars = harmony.reasoning_end  # the reasoning's tokens: those its text takes
            reasoning = shortest_prefix(ids, lambda prefix: len(self._decode(prefix)) >= chars)
            self.result.usage.reasoning_tokens += reasoning
        choice.reasoning_text += read.reasoning
        deltas: list[ToolCallDelta] = []
        for call in read.calls:
            made = ToolCall(new_call_id(), call.name, call.arguments)
            index = len(choice.tool_calls)
            deltas.append(ToolCallDelta(index, made.id, made.name, ""))
            deltas.append(ToolCallDelta(index, arguments_delta=made.arguments_json))
            choice.tool_calls.append(made)
        return read.content, read.reasoning, deltas

    def _decode(self, token_ids: Sequence[int]) -> str:
        text: str = self._tokenizer.decode(list(token_ids), skip_special_tokens=self.params.skip_special_tokens)
        return text

    def _logprobs(self, output: CoreOutput) -> list[TokenLogprob]:
        return self._token_logprobs([token.logprobs for token in output.new_tokens if token.logprobs is not None])

    def _token_logprobs(self, found: Sequence[TokenLogprobs]) -> list[TokenLogprob]:
        """Host log-probabilities with each token's text and bytes."""
        result = []
        for sampled in found:
            ids = [sampled.token_id, *(tid for tid, _ in sampled.top)]
            names, raw = self.token_text.token_strings(ids), self.token_text.token_bytes(ids)
            tops = tuple(
                TopLogprob(tid, names[i], lp, raw[i]) for i, (tid, lp) in enumerate(sampled.top, start=1)
            )
            result.append(TokenLogprob(sampled.token_id, names[0], sampled.logprob, raw[0], tops, sampled.rank))
        return result


def _unicode(text: str, param: str) -> str:
    """`text`, if it is valid Unicode; a ValidationError if it holds a lone surrogate, which the tokenizer cannot
    take. Proto strings cannot carry one, but JSON inside them can (a tool's parameters_json, template kwargs):
    "\\ud800" decodes to a lone surrogate that the template then renders into the prompt."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(f"{param} holds text that is not valid Unicode (a lone surrogate at character "
                              f"{exc.start})", param) from None
    return text


def window_separator(before: str, after: str) -> str:
    """What joins two windows' texts: "" where either side already has whitespace there (Whisper's texts start with
    a space) or one is empty, else one space, so that words do not run together."""
    if not before or not after or before[-1].isspace() or after[0].isspace():
        return ""
    return " "


def fallback_answer(
    attempts: Sequence[GenerationResult], check: DecodeCheck, temperature: float, keep_logprobs: bool
) -> GenerationResult:
    """The answer of a transcription's temperature fallback (`multimodal.fallback`): its last decode's result (of
    `attempts`, in order; the last at `temperature`, judged by `check`), usage summed over every decode, each segment
    with that temperature and `check`'s no-speech probability, the log-probabilities kept only where the caller asked
    (`keep_logprobs`); where `check` calls the window silence, no text, tokens, log-probabilities, segments or words."""
    last = attempts[-1]
    choice = last.choices[0]
    segments = [dataclasses.replace(s, temperature=temperature, no_speech_prob=check.no_speech_prob)
                for s in choice.segments]  # fmt: skip
    logprobs = choice.logprobs if keep_logprobs else None
    if check.silence:
        choice = dataclasses.replace(choice, text="", token_ids=[], logprobs=[] if keep_logprobs else None,
                                     segments=[], words=[])  # fmt: skip
    else:
        choice = dataclasses.replace(choice, logprobs=logprobs, segments=segments)
    usage = Usage(sum(r.usage.prompt_tokens for r in attempts), sum(r.usage.completion_tokens for r in attempts),
                  sum(r.usage.cached_prompt_tokens for r in attempts))  # fmt: skip
    return dataclasses.replace(last, choices=[choice], usage=usage)


def beam_answer(tracker: RequestTracker, search: BeamSearch) -> GenerationResult:
    """The answer of a finished beam search: its `tracker`'s result (a tracker made for the request as for any
    request) with the n best beams as its choices, best first, each read as a whole choice is (its stop token, text,
    reasoning, tool calls and log-probabilities as asked)."""
    found = search.best(tracker.params.n)
    for index, output in enumerate(beam_search.beam_outputs(found, tracker.params.top_logprobs)):
        tracker.update(index, output)
    return tracker.result


def sampled_best_of(params: SamplingParams) -> SamplingParams | None:
    """The parameters that sample `params.best_of` choices to answer its n best from (`best_of_answer`): best_of
    choices, their log-probabilities asked; None where best_of asks no more than n (or beam search is asked: its
    validation refuses best_of)."""
    if params.best_of is None or params.best_of <= params.n or params.beam_width > 1:
        return None
    return dataclasses.replace(params, n=params.best_of, best_of=None, logprobs=True)


def best_of_answer(result: GenerationResult, params: SamplingParams) -> GenerationResult:
    """`params.n` of `result`'s choices (sampled under `sampled_best_of(params)`): those whose tokens' mean raw
    log-probability is highest, best first (the earlier on a tie), numbered anew; their log-probabilities kept only
    where `params` asked them; usage as sampled (every choice's tokens)."""
    def mean(choice: Choice) -> float:
        found = choice.logprobs or []
        return sum(t.logprob for t in found) / len(found) if found else float("-inf")

    best = sorted(result.choices, key=mean, reverse=True)[: params.n]
    keep = params.logprobs or params.top_logprobs > 0
    choices = [dataclasses.replace(c, index=i, logprobs=c.logprobs if keep else None) for i, c in enumerate(best)]
    return dataclasses.replace(result, choices=choices)


def beam_candidates(step: GenerationResult) -> list[tuple[int, float]]:
    """A beam search step's candidates for its beam: its one token's top log-probabilities (`beam_search.step_params`),
    most likely first."""
    logprobs = step.choices[0].logprobs
    assert logprobs, "a beam's step asks its token's top log-probabilities"
    return [(top.token_id, top.logprob) for top in logprobs[0].top_logprobs]


def decode_check(result: GenerationResult, no_speech_prob: float | None) -> DecodeCheck:
    """Whisper's check of one decode of a temperature fallback (its processed log-probabilities asked)."""
    choice = result.choices[0]
    stopped = choice.finish_reason == FinishReason.STOP and isinstance(choice.matched_stop, int)
    return DecodeCheck.of(choice.text, [t.logprob for t in choice.logprobs or ()], stopped, no_speech_prob)


def joined_results(results: Sequence[GenerationResult], duration_seconds: float) -> GenerationResult:
    """One result of a long clip's windows' `results` (`multimodal.clip_windows`; in order, one choice each): each
    choice's text concatenated (`window_separator` between), token ids and logprobs concatenated, prompt ids
    concatenated, usage summed (prompt, completion, cached, reasoning tokens), the finish reason "length" where any
    finished window ran out of tokens, else the last window's (None while it runs), segments concatenated (each its
    place in the joined tokens: `TranscriptionSegment.shifted`) and words concatenated, the transcription info the first
    window's with the whole clip's `duration_seconds`, no prompt logprobs (None), the request id and timeline the
    first's and the last's."""
    first = results[0]
    choices: list[Choice] = []
    for index, parts in enumerate(zip(*(result.choices for result in results), strict=True)):
        text = ""
        for part in parts:
            text += window_separator(text, part.text) + part.text
        logprobs = None if any(p.logprobs is None for p in parts) else [t for p in parts for t in p.logprobs or []]
        reason = parts[-1].finish_reason
        if reason is not None and any(p.finish_reason == FinishReason.LENGTH for p in parts):
            reason = FinishReason.LENGTH
        segments, before = [], 0
        for part in parts:
            segments += [segment.shifted(before) for segment in part.segments]
            before += len(part.token_ids)
        choices.append(Choice(index, text, [t for p in parts for t in p.token_ids], reason, parts[-1].matched_stop,
                              logprobs, segments=segments, words=[w for p in parts for w in p.words]))  # fmt: skip
    usage = Usage(sum(r.usage.prompt_tokens for r in results), sum(r.usage.completion_tokens for r in results),
                  sum(r.usage.cached_prompt_tokens for r in results), sum(r.usage.reasoning_tokens for r in results))
    info = first.transcription
    if info is not None:
        info = dataclasses.replace(info, duration_seconds=duration_seconds)
    return GenerationResult(first.request_id, [t for r in results for t in r.prompt_token_ids], choices, usage,
                            results[-1].timeline, None, info)  # fmt: skip
