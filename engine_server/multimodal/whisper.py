"""Whisper's encoder and cross-attention (`WhisperForConditionalGeneration`; its prompts: `multimodal.transcription`):
the encoder (transformers' own `WhisperEncoder`, its parameters the checkpoint's `model.encoder.*`) runs on a
request's clip's log-mel features when a step first reaches the request, and each decoder layer's cross-attention
(`encoder_attn`, `encoder_attn_layer_norm`: transformers' modules, the checkpoint's weights, in float beside a
quantized decoder) reads its K/V of those states inside the layer, after its self-attention's residual add and before
its MLP's norm (`layers.cross_attention.CrossAttention.inside`). The K/V are kept per request until it is released and
shared by requests with the same clip (`WhisperCrossStates`, as `mllama.CrossStates`).

Each request's memory beside its KV blocks: layers x 2 x 1500 frames x d_model values (large-v3 in bfloat16: 32 x 2 x
1500 x 1280 x 2 bytes, about 250 MB); at most `max_cross_attention_images` clips run at once (`core.scheduler`).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine_server.core.request import Request
from engine_server.multimodal.checkpoint import CheckpointEncoder, load_encoder
from engine_server.multimodal.inputs import MultimodalInputs
from engine_server.parallel.layers import CheckpointTensor

_CROSS = re.compile(r"model\.decoder\.layers\.(?P<index>\d+)\.(?P<rest>encoder_attn(?:_layer_norm)?\..+)")


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
        # Word timings' (`WhisperCrossStates.alignment`): generation_config's `alignment_heads`, (layer, head) pairs in
        # its order (none: the checkpoint names none), and the median filter's width over their frames.
        self.alignment_heads: tuple[tuple[int, int], ...] = ()
        self.median_filter_width = int(getattr(composite, "median_filter_width", 7))

    @classmethod
    def from_checkpoint(
        cls, folder: Path, weights: Iterable[tuple[str, CheckpointTensor]], dtype: torch.dtype, device: torch.device
    ) -> CheckpointEncoder:
        """The encoder of the checkpoint in `folder`: `model.encoder.*`, and each decoder layer's `encoder_attn*` as
        `cross_layers.<i>.`; the decoder's own tensors passed over unread."""
        encoder = load_encoder(cls, folder, _renamed(weights), cls.parts, dtype, device)
        assert isinstance(encoder, WhisperAudioEncoder)
        encoder.alignment_heads = alignment_heads(folder)
        return encoder

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One clip's log-mel features `[1, mel bins, frames]` (padded to the window) -> its encoder states
        `[frames / 2, d_model]`, as `WhisperEncoder` computes them."""
        states: torch.Tensor = self.encoder(pixel_values).last_hidden_state[0]
        return states

    def cross_kv(self, states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each decoder layer's cross-attention (K transposed, `[heads, head_dim, frames]`; V, `[heads, frames,
        head_dim]`) of a clip's states, each contiguous: every step's products read them as they are stored."""
        kv = []
        for layer in self.cross_layers:
            attention: Any = layer.encoder_attn
            heads, dim = attention.num_heads, attention.head_dim
            keys = attention.k_proj(states).view(-1, heads, dim).permute(1, 2, 0).contiguous()
            values = attention.v_proj(states).view(-1, heads, dim).transpose(0, 1).contiguous()
            kv.append((keys, values))
        return kv

    def cross_layer(
        self, index: int, stream: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s cross-attention over one request's rows `stream` `[q, d_model]` (the residual stream after
        its self-attention) and its clip's (K transposed, V: `cross_kv`), no mask over the frames: the stream after
        the residual add, as `WhisperDecoderLayer` computes it (the query scaled before its product, as
        `WhisperAttention` does), and the attention's probabilities `[heads, q, frames]`. One request's rows at a
        time: the projections' products then never depend on the step's other requests (a request's tokens are the
        same alone as batched)."""
        layer: Any = self.cross_layers[index]
        attention = layer.encoder_attn
        heads, dim = attention.num_heads, attention.head_dim
        keys, values = kv
        normed = layer.encoder_attn_layer_norm(stream)
        query = (attention.q_proj(normed) * attention.scaling).view(-1, heads, dim).transpose(0, 1)
        probs = torch.softmax(torch.matmul(query, keys).float(), dim=-1).to(query.dtype)
        attended = attention.out_proj(torch.matmul(probs, values).transpose(0, 1).reshape(stream.shape[0], -1))
        out: torch.Tensor = stream + attended
        return out, probs


def alignment_heads(folder: Path) -> tuple[tuple[int, int], ...]:
    """The (layer, head) pairs of generation_config.json's `alignment_heads` in `folder` (none: ())."""
    path = folder / "generation_config.json"
    heads = json.loads(path.read_text(encoding="utf-8")).get("alignment_heads") if path.is_file() else None
    return tuple((int(layer), int(head)) for layer, head in heads or ())


def _renamed(weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's tensors, each decoder layer's cross-attention ones as `cross_layers.<i>.<rest>`."""
    for name, tensor in weights:
        cross = _CROSS.fullmatch(name)
        yield (name if cross is None else f"cross_layers.{cross['index']}.{cross['rest']}"), tensor


@dataclass(frozen=True)
class _Rows:
    """One request's rows of a step, `[first, first + count)`, and its clip's per-layer (K, V); for a request asking
    word timings, where its alignment heads' probabilities go: `aligned[:, into + r - skip]` for its rows from `skip`
    on (those at output positions), each over its `aligned.shape[-1]` first frames."""

    first: int
    count: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    aligned: torch.Tensor | None = None
    skip: int = 0
    into: int = 0


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
        pieces = []
        for r in self.rows:
            out, probs = self.encoder.cross_layer(position, stream[r.first : r.first + r.count].to(dtype),
                                                  r.kv[position])  # fmt: skip
            pieces.append(out)
            if r.aligned is not None and r.skip < r.count:
                self._keep(r, position, probs)
        return hidden.index_fill(0, index, 0), residual.index_copy(0, index, torch.cat(pieces).to(residual.dtype))

    def _keep(self, rows: _Rows, layer: int, probs: torch.Tensor) -> None:
        """Copy layer `layer`'s alignment heads' probabilities of `rows`' output rows into their request's kept ones."""
        assert rows.aligned is not None
        frames = rows.aligned.shape[-1]
        kept = probs[:, rows.skip :, :frames].float()
        end = rows.into + kept.shape[1]
        for slot, (head_layer, head) in enumerate(self.encoder.alignment_heads):
            if head_layer == layer:
                rows.aligned[slot, rows.into : end] = kept[head]


# Language detections whose clip's K/V are kept after they finish, for the transcriptions that follow them (the most
# recent; an older one's dropped first, as when its caller went away): each one clip's K/V beside the running ones'.
KEPT_DETECTIONS = 8


class WhisperCrossStates:
    """The running transcriptions' cross-attention K/V, made when a step first computes one of a request's tokens and
    kept until it is released (by request id), shared by requests with the same clip (`MultimodalInputs.digest`). A
    language detection's (`MultimodalInputs.detects_language`) outlive it, up to KEPT_DETECTIONS of them, until the
    transcription of the same clip that follows takes them: its clip is encoded once. On the step thread only."""

    def __init__(self, encoder: WhisperAudioEncoder, device: torch.device, dtype: torch.dtype) -> None:
        self.encoder = encoder
        self.device = device
        self.dtype = dtype
        self._kv: dict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._users: dict[bytes, set[str]] = {}
        self._held: dict[str, bytes] = {}
        self._detecting: set[str] = set()
        self._kept: OrderedDict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        # Requests asking word timings: their alignment heads' probabilities `[heads, output rows, frames]` (row i:
        # output token i's query, as fed back) and how many rows are filled (`alignment`).
        self._aligned: dict[str, torch.Tensor] = {}
        self._aligned_rows: dict[str, int] = {}

    def step(self, chunks: Sequence[tuple[Request, int, int]]) -> WhisperCrossStep | None:
        """The cross-attention of a step whose request i computes `count_i` tokens (`chunks`, in the step's row order:
        (request, start, count)); None where no request of it has a clip."""
        rows: list[_Rows] = []
        base = 0
        for request, start, count in chunks:
            clip = request.multimodal
            if clip is not None and clip.transcription:
                rows.append(self._rows(request, clip, base, start, count))
            base += count
        return WhisperCrossStep(self.encoder, rows) if rows else None

    def _rows(self, request: Request, clip: MultimodalInputs, base: int, start: int, count: int) -> _Rows:
        """The rows `[base, base + count)` of a step, `request`'s positions from `start` on: its clip's K/V, and where
        its output rows' alignment-head probabilities go where it asks word timings (`MultimodalInputs.align_frames`;
        positions rerun after a preemption overwrite theirs)."""
        kv = self._states(request.request_id, clip)
        if not clip.align_frames or not self.encoder.alignment_heads:
            return _Rows(base, count, kv)
        aligned = self._aligned.get(request.request_id)
        if aligned is None:
            shape = (len(self.encoder.alignment_heads), max(request.max_tokens, 1), clip.align_frames)
            aligned = self._aligned[request.request_id] = torch.zeros(shape, device=self.device)
        prompt = request.num_prompt_tokens
        skip, into = max(prompt - start, 0), max(start - prompt, 0)
        filled = min(into + max(count - skip, 0), aligned.shape[1])
        self._aligned_rows[request.request_id] = max(self._aligned_rows.get(request.request_id, 0), filled)
        return _Rows(base, count, kv, aligned, skip, into)

    def alignment(self, request_id: str) -> torch.Tensor | None:
        """A finished request's alignment-head probabilities over its clip, `[heads, rows, frames]` on the host (row i:
        output token i's query, as fed back; its last token's never is), handed out once; None where it asked no word
        timings."""
        aligned = self._aligned.pop(request_id, None)
        rows = self._aligned_rows.pop(request_id, 0)
        return None if aligned is None else aligned[:, :rows].to("cpu", copy=True)

    def _states(self, request_id: str, clip: MultimodalInputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        digest = clip.digest
        kv = self._kv.get(digest)
        if kv is None and digest in self._kept:  # (its language's detection encoded it)
            kv = self._kv[digest] = self._kept.pop(digest)
        if kv is None:
            features = clip.images[0].pixel_values.to(device=self.device, dtype=self.dtype)
            kv = self._kv[digest] = self.encoder.cross_kv(self.encoder.encode(features))
        self._users.setdefault(digest, set()).add(request_id)
        self._held[request_id] = digest
        if clip.detects_language:
            self._detecting.add(request_id)
        return kv

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's hold on its K/V (the K/V once no request holds them; a language
        detection's kept for the transcription after it, the oldest kept dropped past KEPT_DETECTIONS)."""
        self._aligned.pop(request_id, None)
        self._aligned_rows.pop(request_id, None)
        digest = self._held.pop(request_id, None)
        if digest is None:
            return
        users = self._users[digest]
        users.discard(request_id)
        detection = request_id in self._detecting
        self._detecting.discard(request_id)
        if not users:
            kv = self._kv.pop(digest)
            del self._users[digest]
            if detection:
                self._kept[digest] = kv
                while len(self._kept) > KEPT_DETECTIONS:
                    self._kept.popitem(last=False)

    @property
    def num_requests(self) -> int:
        """Requests holding K/V."""
        return len(self._held)
