"""A chat's audio clips heard as the model's own processor hears them, their placeholders laid into its prompt
(`AudioProcessing`), and the audio encoders that turn them into the text model's embeddings (`Qwen2AudioEncoder`,
`AudioFlamingo3AudioEncoder`; `AUDIO_KINDS` names each kind's processor and encoder).

`AudioProcessing.prepare` takes the prompt's token ids, in which the chat template wrote the audio token once per clip
(Qwen2-Audio's `<|AUDIO|>`, Audio Flamingo 3's `<sound>`), and the clips' encoded files in the same order: each file
is decoded (soundfile: WAV, FLAC, OGG, MP3), its channels mixed down, resampled to the feature extractor's rate (soxr),
turned into log-mel features by the checkpoint's feature extractor (`preprocessor_config.json`, or the
`feature_extractor` of its `processor_config.json`, as transformers 5 saves a processor), and its one
placeholder becomes its tokens, as the model's own processor lays them out (one a pooled frame). A clip longer than
the model hears (Qwen2-Audio: its tower's window, 30 s; Audio Flamingo 3: its processor's `max_audio_len`, in whole
30 s windows) is refused before it is decoded, as is one that is empty or no audio file. Runs in the frontend, off the
step loop. A clip then travels as an image does (`inputs.ImageSpan`: its windows' features `[windows, mel bins,
frames]` in place of pixels, each window's valid mel frames as its grid), encoded when a step first reaches it
(`features.ImageFeatures`).
"""

from __future__ import annotations

import inspect
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_server.config import AudioInput, MultimodalCheckpoint
from engine_server.errors import ValidationError
from engine_server.multimodal.checkpoint import CheckpointEncoder
from engine_server.multimodal.inputs import ImageSpan, MultimodalInputs, image_digest, placeholder_places

_PROCESSOR_CONFIG = "preprocessor_config.json"
# The processor's own settings (transformers' `processor_config.json`: Audio Flamingo 3's `max_audio_len`), where saved.
_PROCESSOR_SETTINGS = "processor_config.json"
_FORMATS = "WAV, FLAC, OGG or MP3"


@dataclass(frozen=True)
class PromptAudio:
    """One audio clip of a chat: its encoded file and the request field it came in (for errors)."""

    data: bytes
    param: str


class AudioProcessing:
    """The audio of a model whose audio is served (`ModelConfig.multimodal.audio`). Thread-safe: it holds no state but
    the processor's configuration."""

    def __init__(self, spec: AudioInput, processor: Any) -> None:
        """`processor`: the model's own processor (transformers' `Qwen2AudioProcessor` or `AudioFlamingo3Processor`
        over the checkpoint's feature extractor and the tokenizer: `AUDIO_KINDS`), which lays a clip's tokens out."""
        self.spec = spec
        self.processor = processor
        extractor = processor.feature_extractor
        self.sampling_rate = int(extractor.sampling_rate)
        max_audio_len = getattr(processor, "max_audio_len", None)  # (a processor that splits a clip into windows)
        if max_audio_len is None:
            self.max_seconds = float(extractor.n_samples) / self.sampling_rate  # the one window the tower hears
        else:  # as many whole windows as its maximum holds (it truncates a longer clip: refused here instead)
            self.max_seconds = float(max_audio_len // extractor.chunk_length * extractor.chunk_length)
        self.placeholder = str(processor.tokenizer.convert_ids_to_tokens(spec.audio_token_id))

    @classmethod
    def for_model(cls, spec: AudioInput, folder: Path, tokenizer: Any) -> AudioProcessing:
        """The audio of the checkpoint in `folder` (its feature extractor, which must be there: `audio_refusal`; the
        settings its `processor_config.json` holds for the kind's processor, where it is there)."""
        import transformers  # (only for these models)

        extractor = transformers.AutoFeatureExtractor.from_pretrained(str(folder))
        token = str(tokenizer.convert_ids_to_tokens(spec.audio_token_id))
        processor_class = getattr(transformers, AUDIO_KINDS[spec.encoder][0])
        settings: dict[str, Any] = {}
        if (folder / _PROCESSOR_SETTINGS).is_file():
            saved = json.loads((folder / _PROCESSOR_SETTINGS).read_text(encoding="utf-8"))
            own = set(inspect.signature(processor_class.__init__).parameters)
            own -= {"self", "feature_extractor", "tokenizer", "chat_template", "audio_token"}
            settings = {key: value for key, value in saved.items() if key in own}
        return cls(spec, processor_class(extractor, tokenizer, audio_token=token, **settings))

    def prepare(self, token_ids: Sequence[int], clips: Sequence[PromptAudio]) -> tuple[list[int], MultimodalInputs]:
        """`token_ids` with each clip's placeholder expanded to its tokens, and the clips as the encoder takes them (its
        windows' features, each window's valid frames its grid). ValidationError for a file that is no audio, an empty
        clip, one longer than the model hears, or a prompt whose placeholders do not match the clips one for one (a
        turn's text that spells the audio token itself)."""
        places = placeholder_places(token_ids, self.spec.audio_token_id, len(clips), "audio", "clips")
        out: list[int] = []
        spans = []
        done = 0
        for place, clip in zip(places, clips, strict=True):
            processed = self.processor(text=[self.placeholder], audio=[self._samples(clip)], return_tensors="pt",
                                       sampling_rate=self.sampling_rate)  # fmt: skip
            tokens = [int(t) for t in processed["input_ids"][0]]
            valid = processed.get("feature_attention_mask", processed.get("input_features_mask"))  # [windows, frames]
            frames = tuple(int(window.sum()) for window in valid)
            out.extend(token_ids[done:place])
            spans.append(ImageSpan(len(out), len(tokens), processed["input_features"], image_digest(clip.data),
                                   frames))  # fmt: skip
            out.extend(tokens)
            done = place + 1
        out.extend(token_ids[done:])
        return out, MultimodalInputs(tuple(spans))

    def _samples(self, clip: PromptAudio) -> np.ndarray[Any, np.dtype[np.float32]]:
        """The clip's samples, mono float32 at the feature extractor's rate."""
        return decoded_clip(clip, self.sampling_rate, self.max_seconds)[0]


def decoded_clip(
    clip: PromptAudio, sampling_rate: int, max_seconds: float
) -> tuple[np.ndarray[Any, np.dtype[np.float32]], float]:
    """A clip's samples, mono float32 at `sampling_rate` (mixed down, resampled by soxr), and its length in seconds as
    decoded. ValidationError for a file that is no audio, an empty clip, or one longer than `max_seconds` (refused
    before it is decoded, its length named)."""
    import soundfile
    import soxr

    try:
        info = soundfile.info(io.BytesIO(clip.data))
        seconds = info.frames / info.samplerate if info.samplerate else 0.0
        if seconds > max_seconds:
            raise ValidationError(
                f"the audio clip is {seconds:.1f} s long; this model hears at most {max_seconds:.0f} s a "
                "clip: send it in shorter clips", clip.param,
            )  # fmt: skip
        samples, rate = soundfile.read(io.BytesIO(clip.data), dtype="float32", always_2d=True)
    except ValidationError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as error:
        message = f"the audio clip cannot be read ({error}); send a {_FORMATS} file"
        raise ValidationError(message, clip.param) from None
    if samples.shape[0] == 0:
        raise ValidationError("the audio clip is empty", clip.param)
    mono = samples.mean(axis=1, dtype=np.float32)
    if rate != sampling_rate:
        mono = soxr.resample(mono, rate, sampling_rate).astype(np.float32)
    return mono, samples.shape[0] / rate


def served_audio(
    multimodal: MultimodalCheckpoint | None, folder: Path, tokenizer: Any = None
) -> tuple[AudioProcessing | None, str]:
    """How the model in `folder` (its `ModelConfig.multimodal`; its `tokenizer`) hears audio, and the refusal of a
    turn with an audio clip where it hears none (`audio_refusal`)."""
    refusal = audio_refusal(multimodal, folder)
    if refusal or multimodal is None or multimodal.audio is None:
        return None, refusal
    return AudioProcessing.for_model(multimodal.audio, folder, tokenizer), ""


def audio_refusal(multimodal: MultimodalCheckpoint | None, folder: Path) -> str:
    """Why the model in `folder` hears no audio; "" where it hears it (then its audio encoder loads on rank 0:
    `engine_server.model_loading`)."""
    if multimodal is None or multimodal.audio is None:
        return "this model hears no audio; send text alone"
    if not (folder / _PROCESSOR_CONFIG).is_file() and not _saved_in_processor(folder):
        return f"this checkpoint has no feature extractor ({_PROCESSOR_CONFIG}) to hear audio with; send text alone"
    return ""


class Qwen2AudioEncoder(CheckpointEncoder):
    """Qwen2-Audio's clips: its Whisper-style tower (two convolutions, the encoder layers over the clip's frames,
    padding frames masked out, average-pooled by 2) through its projector, the pooled frames of the clip's own length
    kept, as transformers' `Qwen2AudioModel` computes them."""

    parts = ("audio_tower.", "multi_modal_projector.")

    def __init__(self, composite: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioMultiModalProjector

        self.audio_tower = AutoModel.from_config(composite.audio_config)
        self.multi_modal_projector = Qwen2AudioMultiModalProjector(composite)

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One clip's log-mel features `[1, mel bins, frames]` (its one window, padded) and its valid frames `(n,)` ->
        its tokens' embeddings `[pooled frames of n, text hidden]` (`features.ImageEncoder`)."""
        from transformers.masking_utils import create_bidirectional_mask

        assert grid is not None and len(grid) == 1, "a clip has its valid mel frames"
        lengths, kept = self.audio_tower._get_feat_extract_output_lengths(torch.tensor([grid[0]]))
        frames = (pixel_values.shape[-1] - 2) // 2 + 1  # (after the strided convolution)
        valid = (torch.arange(frames) < lengths[:, None]).to(torch.long).to(pixel_values.device)
        dummy = torch.zeros(1, frames, 1, dtype=pixel_values.dtype, device=pixel_values.device)
        mask = create_bidirectional_mask(config=self.audio_tower.config, inputs_embeds=dummy, attention_mask=valid)
        hidden = self.audio_tower(pixel_values, attention_mask=mask).last_hidden_state
        projected: torch.Tensor = self.multi_modal_projector(hidden)[0, : int(kept[0])]
        return projected


class AudioFlamingo3AudioEncoder(CheckpointEncoder):
    """Audio Flamingo 3's clips: each 30 s window through its Whisper-style tower (padding frames masked out,
    average-pooled by 2, normed) and its projector, each window's pooled frames of its own length kept, in order: the
    path of transformers' own `AudioFlamingo3Model.get_audio_features`, run over this encoder's tower and projector."""

    parts = ("audio_tower.", "multi_modal_projector.")

    def __init__(self, composite: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.audioflamingo3.modeling_audioflamingo3 import AudioFlamingo3MultiModalProjector

        self.audio_tower = AutoModel.from_config(composite.audio_config)
        self.multi_modal_projector = AudioFlamingo3MultiModalProjector(composite)

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One clip's windows' log-mel features `[windows, mel bins, frames]` (each padded to the window) and each
        window's valid frames -> its tokens' embeddings `[pooled frames, text hidden]`, window after window
        (`features.ImageEncoder`)."""
        from transformers.models.audioflamingo3.modeling_audioflamingo3 import AudioFlamingo3Model

        assert grid is not None and len(grid) == pixel_values.shape[0], "each window has its valid mel frames"
        lengths = torch.tensor(grid, device=pixel_values.device)
        mask = (torch.arange(pixel_values.shape[-1], device=pixel_values.device) < lengths[:, None]).to(torch.long)
        # (transformers' own method, unbound: it reads only `audio_tower` and `multi_modal_projector`, both here)
        output = AudioFlamingo3Model.get_audio_features(self, pixel_values, mask, return_dict=True)
        features: torch.Tensor = output.pooler_output
        return features


# Each kind whose audio is served (`AudioInput.encoder`, its `model_type`): transformers' processor that lays its
# clips' tokens out, and its encoder.
AUDIO_KINDS: dict[str, tuple[str, type[CheckpointEncoder]]] = {
    "qwen2_audio": ("Qwen2AudioProcessor", Qwen2AudioEncoder),
    "audioflamingo3": ("AudioFlamingo3Processor", AudioFlamingo3AudioEncoder),
}


def _saved_in_processor(folder: Path) -> bool:
    """Whether the checkpoint in `folder` holds its feature extractor in its `processor_config.json` (transformers 5's
    processor saves it there, with no `preprocessor_config.json`)."""
    path = folder / _PROCESSOR_SETTINGS
    if not path.is_file():
        return False
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and isinstance(saved.get("feature_extractor"), dict)
