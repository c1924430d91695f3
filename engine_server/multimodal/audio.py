"""A chat's audio clips heard as the model's own processor hears them, their placeholders laid into its prompt
(`AudioProcessing`), and the audio encoders that turn them into the text model's embeddings (`Qwen2AudioEncoder`).

`AudioProcessing.prepare` takes the prompt's token ids, in which the chat template wrote the audio token once per clip
(Qwen2-Audio's `<|AUDIO|>`), and the clips' encoded files in the same order: each file is decoded (soundfile:
WAV, FLAC, OGG, MP3), its channels mixed down, resampled to the feature extractor's rate (soxr), turned into log-mel
features by the checkpoint's feature extractor (`preprocessor_config.json`), and its one placeholder becomes its
tokens, as the model's own processor lays them out (one a pooled frame). A clip longer than the model's window (30 s
for the Whisper-style towers) is refused before it is decoded, as is one that is empty or no audio file. Runs in
the frontend, off the step loop. A clip then travels as an image does (`inputs.ImageSpan`: its features in place of
pixels, its valid mel frames as its grid), encoded when a step first reaches it (`features.ImageFeatures`).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_server.config import AudioInput, MultimodalCheckpoint
from engine_server.errors import ValidationError
from engine_server.multimodal.checkpoint import CheckpointEncoder
from engine_server.multimodal.inputs import ImageSpan, MultimodalInputs, image_digest

_PROCESSOR_CONFIG = "preprocessor_config.json"
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
        """`processor`: the model's own processor (transformers' `Qwen2AudioProcessor` over the checkpoint's feature
        extractor and the tokenizer), which lays a clip's tokens out."""
        self.spec = spec
        self.processor = processor
        extractor = processor.feature_extractor
        self.sampling_rate = int(extractor.sampling_rate)
        self.max_seconds = float(extractor.n_samples) / self.sampling_rate  # the window the tower hears
        self.placeholder = str(processor.tokenizer.convert_ids_to_tokens(spec.audio_token_id))

    @classmethod
    def for_model(cls, spec: AudioInput, folder: Path, tokenizer: Any) -> AudioProcessing:
        """The audio of the checkpoint in `folder` (its `preprocessor_config.json`, which must be there)."""
        from transformers import AutoFeatureExtractor, Qwen2AudioProcessor  # (only for these models)

        extractor = AutoFeatureExtractor.from_pretrained(str(folder))
        token = str(tokenizer.convert_ids_to_tokens(spec.audio_token_id))
        return cls(spec, Qwen2AudioProcessor(extractor, tokenizer, audio_token=token))

    def prepare(self, token_ids: Sequence[int], clips: Sequence[PromptAudio]) -> tuple[list[int], MultimodalInputs]:
        """`token_ids` with each clip's placeholder expanded to its tokens, and the clips as the encoder takes them.
        ValidationError for a file that is no audio, an empty clip, one longer than the model's window, or a prompt
        whose placeholders do not match the clips one for one (a turn's text that spells the audio token itself)."""
        places = [i for i, token in enumerate(token_ids) if token == self.spec.audio_token_id]
        if len(places) != len(clips):
            raise ValidationError(
                f"the prompt holds {len(places)} audio placeholders for {len(clips)} clips: a message's text may not "
                "spell the model's audio token itself", "messages",
            )  # fmt: skip
        out: list[int] = []
        spans = []
        done = 0
        for place, clip in zip(places, clips, strict=True):
            processed = self.processor(text=self.placeholder, audio=[self._samples(clip)], return_tensors="pt",
                                       sampling_rate=self.sampling_rate)  # fmt: skip
            tokens = [int(t) for t in processed["input_ids"][0]]
            frames = int(processed["feature_attention_mask"][0].sum())
            out.extend(token_ids[done:place])
            spans.append(ImageSpan(len(out), len(tokens), processed["input_features"][0], image_digest(clip.data),
                                   (frames,)))  # fmt: skip
            out.extend(tokens)
            done = place + 1
        out.extend(token_ids[done:])
        return out, MultimodalInputs(tuple(spans))

    def _samples(self, clip: PromptAudio) -> np.ndarray[Any, np.dtype[np.float32]]:
        """The clip's samples, mono float32 at the feature extractor's rate."""
        import soundfile
        import soxr

        try:
            info = soundfile.info(io.BytesIO(clip.data))
            seconds = info.frames / info.samplerate if info.samplerate else 0.0
            if seconds > self.max_seconds:
                raise ValidationError(
                    f"the audio clip is {seconds:.1f} s long; this model hears at most {self.max_seconds:.0f} s a "
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
        if rate != self.sampling_rate:
            mono = soxr.resample(mono, rate, self.sampling_rate).astype(np.float32)
        return mono


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
    if not (folder / _PROCESSOR_CONFIG).is_file():
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
        """One clip's log-mel features `[mel bins, frames]` (padded to the window) and its valid frames `(n,)` -> its
        tokens' embeddings `[pooled frames of n, text hidden]` (`features.ImageEncoder`)."""
        from transformers.masking_utils import create_bidirectional_mask

        assert grid is not None and len(grid) == 1, "a clip has its valid mel frames"
        lengths, kept = self.audio_tower._get_feat_extract_output_lengths(torch.tensor([grid[0]]))
        frames = (pixel_values.shape[-1] - 2) // 2 + 1  # (after the strided convolution)
        valid = (torch.arange(frames) < lengths[:, None]).to(torch.long).to(pixel_values.device)
        dummy = torch.zeros(1, frames, 1, dtype=pixel_values.dtype, device=pixel_values.device)
        mask = create_bidirectional_mask(config=self.audio_tower.config, inputs_embeds=dummy, attention_mask=valid)
        hidden = self.audio_tower(pixel_values.unsqueeze(0), attention_mask=mask).last_hidden_state
        projected: torch.Tensor = self.multi_modal_projector(hidden)[0, : int(kept[0])]
        return projected
