"""Whisper (`WhisperForConditionalGeneration`): a clip written down as text. The frontend lays out the decoder prompt
transformers' `generate` does (`WhisperTranscription.prepare`); the encoder (transformers' own `WhisperEncoder`, its
parameters the checkpoint's `model.encoder.*`) runs on the clip's log-mel features when a step first reaches the
request, and each decoder layer's cross-attention (`encoder_attn`, `encoder_attn_layer_norm`: transformers' modules,
the checkpoint's weights, in float beside a quantized decoder) reads its K/V of those states, kept per request until
it is released and shared by requests with the same clip (`WhisperCrossStates`, as `mllama.CrossStates`).

The prompt: `<|startofprev|>` and the previous text's tokens where a `TranscriptionPrompt.prompt` is given (as
`WhisperTokenizer.get_prompt_ids` makes them), then `<|startoftranscript|>`, the language token, the task token and
`<|notimestamps|>`, their ids from `generation_config.json` (`decoder_start_token_id`, `lang_to_id`, `task_to_id`,
`no_timestamps_token_id`, `prev_sot_token_id`), else the tokenizer's (an English-only checkpoint, without
`lang_to_id`: no language or task token, as `generate` lays it out). A request without a language first runs a
one-token detection request (`detection`: `<|startoftranscript|>` alone, every token but the languages' suppressed:
transformers' `detect_language`). Its outputs have generation_config's `suppress_tokens` suppressed throughout and its
`begin_suppress_tokens` at the first (`SamplingParams.suppress_token_ids`, `begin_suppress_token_ids`), as `generate`
does.

Each request's memory beside its KV blocks: layers x 2 x 1500 frames x d_model values (large-v3 in bfloat16: 32 x 2 x
1500 x 1280 x 2 bytes, about 250 MB); at most `max_cross_attention_images` clips run at once (`core.scheduler`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine_server.core.request import Request
from engine_server.errors import ValidationError
from engine_server.multimodal.audio import PromptAudio, decoded_clip
from engine_server.multimodal.checkpoint import CheckpointEncoder, load_encoder
from engine_server.multimodal.inputs import ImageSpan, MultimodalInputs, image_digest
from engine_server.parallel.layers import CheckpointTensor

_PROCESSOR_CONFIG = "preprocessor_config.json"
_GENERATION_CONFIG = "generation_config.json"
_CROSS = re.compile(r"model\.decoder\.layers\.(?P<index>\d+)\.(?P<rest>encoder_attn(?:_layer_norm)?\..+)")
_TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class TranscriptionPrompt:
    """A clip to write down (`Input.transcription`): its encoded file, its language (an ISO code, a name transformers
    knows, or "" to detect it), the task ("transcribe" or "translate") and the text before it ("" for none)."""

    audio: bytes
    language: str = ""
    task: str = "transcribe"
    prompt: str = ""


@dataclass(frozen=True)
class TranscriptionInfo:
    """What a transcription's caller learns of its clip: the language's ISO code and the clip's seconds as decoded."""

    language: str
    duration_seconds: float


class _CrossLayer(nn.Module):
    """One decoder layer's cross-attention, transformers' modules under the checkpoint's names."""

    def __init__(self, config: Any, index: int) -> None:
        from transformers.models.whisper.modeling_whisper import WhisperAttention

        super().__init__()
        heads = config.decoder_attention_heads
        self.encoder_attn = WhisperAttention(config.d_model, heads, is_decoder=True, layer_idx=index, config=config)
        self.encoder_attn_layer_norm = nn.LayerNorm(config.d_model)


class WhisperAudioEncoder(CheckpointEncoder):
    """Whisper's encoder (`encoder`, transformers' `WhisperEncoder`) and each decoder layer's cross-attention
    (`cross_layers[i]`), loaded from the checkpoint's tensors."""

    parts = ("encoder.", "cross_layers.")

    def __init__(self, composite: Any) -> None:
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        super().__init__()
        self.encoder = WhisperEncoder(composite)
        self.cross_layers = nn.ModuleList(_CrossLayer(composite, i) for i in range(composite.decoder_layers))

    @classmethod
    def from_checkpoint(
        cls, folder: Path, weights: Iterable[tuple[str, CheckpointTensor]], dtype: torch.dtype, device: torch.device
    ) -> CheckpointEncoder:
        """The encoder of the checkpoint in `folder`: `model.encoder.*`, and each decoder layer's `encoder_attn*` as
        `cross_layers.<i>.`; the decoder's own tensors passed over unread."""
        return load_encoder(cls, folder, _renamed(weights), cls.parts, dtype, device)

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One clip's log-mel features `[1, mel bins, frames]` (padded to the window) -> its encoder states
        `[frames / 2, d_model]`, as `WhisperEncoder` computes them."""
        states: torch.Tensor = self.encoder(pixel_values).last_hidden_state[0]
        return states

    def cross_kv(self, states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each decoder layer's cross-attention (K, V) `[heads, frames, head_dim]` of a clip's states."""
        kv = []
        for layer in self.cross_layers:
            attention: Any = layer.encoder_attn
            heads, dim = attention.num_heads, attention.head_dim
            keys = attention.k_proj(states).view(-1, heads, dim).transpose(0, 1)
            values = attention.v_proj(states).view(-1, heads, dim).transpose(0, 1)
            kv.append((keys, values))
        return kv

    def cross_layer(self, index: int, stream: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Layer `index`'s cross-attention over one request's rows `stream` `[q, d_model]` (the residual stream after
        its self-attention) and its clip's (K, V), no mask over the frames: the stream after the residual add, as
        `WhisperDecoderLayer` computes it (the query scaled before its product, as `WhisperAttention` does)."""
        layer: Any = self.cross_layers[index]
        attention = layer.encoder_attn
        heads, dim = attention.num_heads, attention.head_dim
        keys, values = kv
        normed = layer.encoder_attn_layer_norm(stream)
        query = (attention.q_proj(normed) * attention.scaling).view(-1, heads, dim).transpose(0, 1)
        probs = torch.softmax(torch.matmul(query, keys.transpose(1, 2)).float(), dim=-1).to(query.dtype)
        attended = attention.out_proj(torch.matmul(probs, values).transpose(0, 1).reshape(stream.shape[0], -1))
        out: torch.Tensor = stream + attended
        return out


def _renamed(weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's tensors, each decoder layer's cross-attention ones as `cross_layers.<i>.<rest>`."""
    for name, tensor in weights:
        cross = _CROSS.fullmatch(name)
        yield (name if cross is None else f"cross_layers.{cross['index']}.{cross['rest']}"), tensor


@dataclass(frozen=True)
class _Rows:
    """One request's rows of a step, `[first, first + count)`, and its clip's per-layer (K, V)."""

    first: int
    count: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]


class WhisperCrossStep:
    """A step's cross-attention inside every decoder layer (`layers.cross_attention.CrossAttention`, `inside`) over
    the rows of its transcription requests."""

    inside = True

    def __init__(self, encoder: WhisperAudioEncoder, rows: list[_Rows]) -> None:
        self.encoder = encoder
        self.rows = rows
        self.positions = frozenset(range(len(encoder.cross_layers)))
        self._index = torch.cat([torch.arange(r.first, r.first + r.count) for r in rows])

    def apply(
        self, position: int, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert residual is not None, "inside a layer the stream has its residual"
        if self._index.device != hidden.device:  # (moved once a step, not once a layer)
            self._index = self._index.to(hidden.device)
        index = self._index
        stream = hidden + residual
        dtype = self.rows[0].kv[0][0].dtype  # (the cross-attention's own)
        pieces = [
            self.encoder.cross_layer(position, stream[r.first : r.first + r.count].to(dtype), r.kv[position])
            for r in self.rows
        ]  # fmt: skip
        return hidden.index_fill(0, index, 0), residual.index_copy(0, index, torch.cat(pieces).to(residual.dtype))


class WhisperCrossStates:
    """The running transcriptions' cross-attention K/V, made when a step first computes one of a request's tokens and
    kept until it is released (by request id), shared by requests with the same clip (`MultimodalInputs.digest`). On
    the step thread only."""

    def __init__(self, encoder: WhisperAudioEncoder, device: torch.device, dtype: torch.dtype) -> None:
        self.encoder = encoder
        self.device = device
        self.dtype = dtype
        self._kv: dict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._users: dict[bytes, set[str]] = {}
        self._held: dict[str, bytes] = {}

    def step(self, chunks: Sequence[tuple[Request, int, int]]) -> WhisperCrossStep | None:
        """The cross-attention of a step whose request i computes `count_i` tokens (`chunks`, in the step's row order:
        (request, start, count)); None where no request of it has a clip."""
        rows: list[_Rows] = []
        base = 0
        for request, _, count in chunks:
            clip = request.multimodal
            if clip is not None and clip.transcription:
                rows.append(_Rows(base, count, self._states(request.request_id, clip)))
            base += count
        return WhisperCrossStep(self.encoder, rows) if rows else None

    def _states(self, request_id: str, clip: MultimodalInputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        digest = clip.digest
        kv = self._kv.get(digest)
        if kv is None:
            features = clip.images[0].pixel_values.to(device=self.device, dtype=self.dtype)
            kv = self._kv[digest] = self.encoder.cross_kv(self.encoder.encode(features))
        self._users.setdefault(digest, set()).add(request_id)
        self._held[request_id] = digest
        return kv

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's hold on its K/V (the K/V once no request holds them)."""
        digest = self._held.pop(request_id, None)
        if digest is None:
            return
        users = self._users[digest]
        users.discard(request_id)
        if not users:
            del self._users[digest], self._kv[digest]

    @property
    def num_requests(self) -> int:
        """Requests holding K/V."""
        return len(self._held)


@dataclass(frozen=True)
class PreparedTranscription:
    """A transcription's decoder prompt, its clip as the encoder takes it, what its caller learns, and the tokens its
    outputs suppress (always; at the first output)."""

    token_ids: list[int]
    clip: MultimodalInputs
    info: TranscriptionInfo
    suppress_token_ids: tuple[int, ...]
    begin_suppress_token_ids: tuple[int, ...]


class WhisperTranscription:
    """The prompts of a Whisper checkpoint (its feature extractor, generation config and tokenizer). Thread-safe: it
    holds no state but their settings."""

    def __init__(self, extractor: Any, generation: dict[str, Any], tokenizer: Any) -> None:
        self.extractor = extractor
        self.tokenizer = tokenizer
        self.sampling_rate = int(extractor.sampling_rate)
        self.max_seconds = float(extractor.n_samples) / self.sampling_rate  # the encoder's one window (30 s)

        def token(key: str, text: str) -> int:
            value = generation.get(key)
            return int(value) if value is not None else int(tokenizer.convert_tokens_to_ids(text))

        self.start = token("decoder_start_token_id", "<|startoftranscript|>")
        self.previous = token("prev_sot_token_id", "<|startofprev|>")
        self.no_timestamps = token("no_timestamps_token_id", "<|notimestamps|>")
        tasks = generation.get("task_to_id") or {}
        self.tasks = {task: int(tasks[task]) if task in tasks else token("", f"<|{task}|>") for task in _TASKS}
        self.languages: dict[str, int] = {str(k): int(v) for k, v in (generation.get("lang_to_id") or {}).items()}
        # An English-only checkpoint (`.en`: no `lang_to_id`): its prompt has no language or task token, as
        # transformers' `generate` lays it out; it transcribes English alone.
        self.english_only = not self.languages
        self.suppress = tuple(int(t) for t in generation.get("suppress_tokens") or ())
        self.begin_suppress = tuple(int(t) for t in generation.get("begin_suppress_tokens") or ())
        self.special_ids = frozenset(int(i) for i in tokenizer.all_special_ids) | frozenset(self.languages.values())

    @classmethod
    def for_model(cls, folder: Path, tokenizer: Any) -> WhisperTranscription:
        """The prompts of the checkpoint in `folder`."""
        from transformers import WhisperFeatureExtractor

        extractor = WhisperFeatureExtractor.from_pretrained(str(folder))
        path = folder / _GENERATION_CONFIG
        generation = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        return cls(extractor, generation, tokenizer)

    def language_code(self, language: str) -> str:
        """The ISO code of `language` (a code, `<|code|>`, or a name transformers knows: `TO_LANGUAGE_CODE`);
        ValidationError naming one this model has no token for."""
        from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

        key = language.strip().lower().removeprefix("<|").removesuffix("|>")
        code = TO_LANGUAGE_CODE.get(key, key)
        if self.english_only and code in ("", "en"):
            return "en"
        if self.english_only:
            raise ValidationError(f"language {language!r}: this Whisper model is English-only (it transcribes English "
                                  "alone)", "input.transcription.language")  # fmt: skip
        if f"<|{code}|>" not in self.languages:
            raise ValidationError(f"language {language!r} is not one this model knows (an ISO code such as "
                                  "'en', or a name such as 'english')", "input.transcription.language")  # fmt: skip
        return code

    def code_of(self, token_id: int) -> str:
        """The ISO code of a language token's id."""
        return next(key[2:-2] for key, each in self.languages.items() if each == token_id)

    def prepare(self, prompt: TranscriptionPrompt, language: str) -> PreparedTranscription:
        """`prompt`'s decoder prompt in `language` (an ISO code this model knows) and its clip; ValidationError for a
        task other than transcribe or translate, a previous text holding a special token, or a clip that is no
        audio, empty or longer than the window (named with its length)."""
        if prompt.task not in _TASKS or (self.english_only and prompt.task != "transcribe"):
            served = "transcribe (an English-only model)" if self.english_only else ", ".join(_TASKS)
            raise ValidationError(f"task {prompt.task!r} is not served: {served}", "input.transcription.task")
        clip, info = self._clip(prompt.audio, language)
        if self.english_only:
            ids = [*self._previous_text(prompt.prompt), self.start, self.no_timestamps]
        else:
            ids = [*self._previous_text(prompt.prompt), self.start, self.languages[f"<|{language}|>"],
                   self.tasks[prompt.task], self.no_timestamps]  # fmt: skip
        return PreparedTranscription(ids, clip, info, self.suppress, self.begin_suppress)

    def detection(self, prompt: TranscriptionPrompt, vocab_size: int) -> PreparedTranscription:
        """The one-token request that detects `prompt`'s language: `<|startoftranscript|>` alone, every token of the
        model's `vocab_size` but the languages' suppressed (its output the language token, as transformers'
        `detect_language` picks it)."""
        clip, info = self._clip(prompt.audio, "")
        allowed = set(self.languages.values())
        others = tuple(t for t in range(vocab_size) if t not in allowed)
        return PreparedTranscription([self.start], clip, info, others, ())

    def _previous_text(self, text: str) -> list[int]:
        """`<|startofprev|>` and the previous text's tokens (" " + the text stripped), as `get_prompt_ids` makes them;
        [] for no text. ValidationError where the text spells a special token."""
        if not text.strip():
            return []
        ids = [int(t) for t in self.tokenizer.encode(" " + text.strip(), add_special_tokens=False)]
        special = next((t for t in ids if t in self.special_ids), None)
        if special is not None:
            raise ValidationError(f"the previous text may not hold the special token "
                                  f"{self.tokenizer.convert_ids_to_tokens(special)!r}", "input.transcription.prompt")
        return [self.previous, *ids]

    def _clip(self, data: bytes, language: str) -> tuple[MultimodalInputs, TranscriptionInfo]:
        samples, seconds = decoded_clip(PromptAudio(data, "input.transcription.audio"), self.sampling_rate,
                                        self.max_seconds)  # fmt: skip
        features = self.extractor(samples, sampling_rate=self.sampling_rate, return_tensors="pt").input_features
        span = ImageSpan(0, 0, features, image_digest(data))
        return MultimodalInputs((span,), transcription=True), TranscriptionInfo(language, seconds)


def transcription_refusal(transcribes: bool, folder: Path) -> str:
    """Why the model in `folder` writes no clip down (`transcribes`: `MultimodalCheckpoint.transcribes`); "" where
    it does (then its encoder loads: `engine_server.model_loading`)."""
    if not transcribes:
        return "this model does not transcribe audio (Input.transcription is served for Whisper checkpoints)"
    if not (folder / _PROCESSOR_CONFIG).is_file():
        return f"this Whisper checkpoint has no feature extractor ({_PROCESSOR_CONFIG}) to hear its clips with"
    return ""


def served_transcription(
    transcribes: bool, folder: Path, tokenizer: Any
) -> tuple[WhisperTranscription | None, str]:
    """The prompts of the model in `folder` where it transcribes (`MultimodalCheckpoint.transcribes`), and the refusal
    of a transcription where it does not (`transcription_refusal`)."""
    refusal = transcription_refusal(transcribes, folder)
    if refusal:
        return None, refusal
    return WhisperTranscription.for_model(folder, tokenizer), ""
