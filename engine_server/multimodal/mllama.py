"""Llama 3.2 Vision's images (`ImageInput.cross_attention`): its tower and projector turn a request's images' tiles into
the states its text model's cross-attention layers read, and those layers run between the text model's own for the
rows of the requests with images.

The image token stays one token of the prompt (its own embedding). A request's images (all its tiles, the padding
tiles too, `max tiles x patches` rows an image) go through transformers' own `MllamaVisionModel` and
`multi_modal_projector` once, when a step first computes any of its tokens, and each cross-attention layer's K
(`k_norm`'d) and V of them are kept until the request is released: every later chunk and every decode step reads them
(`CrossStates`). Its memory: layers x 2 x kv_heads x images x max tiles x patches x head_dim values a request (Llama
3.2 11B in bfloat16: 8 x 2 x 8 x 4 x 1601 x 128 x 2 bytes, about 210 MB an image), shared by the requests with the same
images (by their digest: an `n > 1` request's choices).

A cross-attention layer (transformers' `MllamaCrossAttentionDecoderLayer`'s, its parameters the checkpoint's, kept in
float beside an int8 text model) reads a text row's query (`q_norm`'d, no rope) against its request's K/V alone, under
the request's mask row (`MultimodalInputs.cross_attention_mask`, a decode token the prompt's last row, as transformers'
generation extends it) turned additive by transformers' `_prepare_cross_attention_mask` (a row that sees no image: a
mask of zeros, attending to all the states alike, its MLP's output zeroed by the full-row mask), and adds its
attention's and its MLP's outputs through their tanh gates. Rows of requests without images pass through unchanged, as
the layers are skipped for them in transformers. Steps with such rows run on the eager path (`model_runner`).
"""

from __future__ import annotations

import re
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

# A text layer's tensor in either layout: transformers 5's (`model.language_model.layers.N.`, its `model.` dropped)
# or the released one (`language_model.model.layers.N.`).
_TEXT_LAYER = re.compile(r"language_model\.(?:model\.)?layers\.(?P<index>\d+)\.(?P<rest>.+)")


class MllamaImageEncoder(CheckpointEncoder):
    """Llama 3.2 Vision's tower (`MllamaVisionModel`), projector and cross-attention layers (by checkpoint index,
    `cross_layers[str(i)]`), transformers' own modules loaded from the checkpoint."""

    parts = ("vision_model.", "multi_modal_projector.", "cross_layers.")

    def __init__(self, composite: Any) -> None:
        from transformers.models.mllama.modeling_mllama import (
            MllamaCrossAttentionDecoderLayer,
            MllamaVisionModel,
        )

        super().__init__()
        text = composite.text_config
        self.vision_model = MllamaVisionModel._from_config(composite.vision_config)
        self.multi_modal_projector = nn.Linear(composite.vision_config.vision_output_dim, text.hidden_size, bias=True)
        self.layer_indices = tuple(sorted(int(i) for i in text.cross_attention_layers))
        self.cross_layers = nn.ModuleDict(
            {str(i): MllamaCrossAttentionDecoderLayer(text, i) for i in self.layer_indices}
        )
        self.num_patches = int(self.vision_model.num_patches)

    @classmethod
    def from_checkpoint(
        cls, folder: Path, weights: Iterable[tuple[str, CheckpointTensor]], dtype: torch.dtype, device: torch.device
    ) -> CheckpointEncoder:
        """The encoder of the checkpoint in `folder`: its tower's and projector's tensors, and its cross-attention
        layers' (in either layout) as `cross_layers.<index>.`; the text model's own layers passed over unread."""
        import json

        from transformers import CONFIG_MAPPING

        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        text = CONFIG_MAPPING["mllama"].from_dict(config).text_config  # (its defaults where the file states none)
        cross = {int(i) for i in text.cross_attention_layers}
        return load_encoder(cls, folder, _renamed(weights, cross), cls.parts, dtype, device)

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """One image's tiles `[max tiles, 3, H, W]` and grid (its aspect ratio id, then its aspect ratio mask, one a
        tile) -> its states `[max tiles x patches, text hidden]`, as `MllamaModel` makes them."""
        assert grid is not None, "a Llama 3.2 Vision image has its aspect ratio id and mask"
        ratio = torch.tensor([[grid[0]]], dtype=torch.long, device=pixel_values.device)
        mask = torch.tensor([list(grid[1:])], dtype=torch.long, device=pixel_values.device)
        states = self.vision_model(pixel_values=pixel_values[None, None], aspect_ratio_ids=ratio,
                                   aspect_ratio_mask=mask[None]).last_hidden_state  # fmt: skip
        projected: torch.Tensor = self.multi_modal_projector(states)
        return projected.reshape(-1, projected.shape[-1])

    def cross_kv(self, states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each cross-attention layer's (K, V) `[kv_heads, N, head_dim]` of a request's states `[N, hidden]` (its
        images' in order): K through `k_norm`, as transformers' `MllamaTextCrossAttention` makes them."""
        kv = []
        for index in self.layer_indices:
            attention: Any = self.cross_layers[str(index)].cross_attn
            heads, dim = attention.num_key_value_heads, attention.head_dim
            keys = attention.k_proj(states).view(-1, heads, dim).transpose(0, 1)
            values = attention.v_proj(states).view(-1, heads, dim).transpose(0, 1)
            kv.append((attention.k_norm(keys), values))
        return kv

    def cross_layer(
        self, index: int, hidden: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
        full_rows: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Cross-attention layer `index` (a checkpoint index) over one request's rows `hidden` `[q, hidden]` (the
        residual stream), its (K, V), its additive `mask` `[q, N]` and its full-row mask `[q, 1]`: the stream after
        its tanh-gated attention and MLP, as `MllamaCrossAttentionDecoderLayer` computes it."""
        layer: Any = self.cross_layers[str(index)]
        attention = layer.cross_attn
        heads, dim = attention.num_heads, attention.head_dim
        keys, values = kv
        groups = heads // keys.shape[0]
        query = attention.q_norm(attention.q_proj(layer.input_layernorm(hidden)).view(-1, heads, dim).transpose(0, 1))
        keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)
        scores = torch.matmul(query, keys.transpose(1, 2)) * attention.scaling + mask
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        attended = attention.o_proj(torch.matmul(probs, values).transpose(0, 1).reshape(hidden.shape[0], -1))
        hidden = hidden + layer.cross_attn_attn_gate.tanh() * attended
        mlp = layer.mlp(layer.post_attention_layernorm(hidden)) * full_rows
        out: torch.Tensor = hidden + layer.cross_attn_mlp_gate.tanh() * mlp
        return out


def _renamed(
    weights: Iterable[tuple[str, CheckpointTensor]], cross: set[int]
) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's tensors, its cross-attention layers' as `cross_layers.<index>.<rest>`; its text model's other
    layers left out."""
    for name, tensor in weights:
        layer = _TEXT_LAYER.fullmatch(name.removeprefix("model."))
        if layer is None:
            yield name, tensor
        elif int(layer["index"]) in cross:
            yield f"cross_layers.{layer['index']}.{layer['rest']}", tensor


@dataclass(frozen=True)
class _Rows:
    """One request's rows of a step: `[first, first + count)`, its layers' (K, V), its additive mask `[count, N]` and
    full-row mask `[count, 1]`."""

    first: int
    count: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    full_rows: torch.Tensor


class CrossStep:
    """A step's cross-attention layers (`layers.cross_attention.CrossAttention`) over the rows of its requests with
    images."""

    inside = False  # (they run between the text model's layers)

    def __init__(self, encoder: MllamaImageEncoder, dropped: Sequence[int], rows: list[_Rows]) -> None:
        """`dropped`: the checkpoint's cross-attention layer indices (`MultimodalCheckpoint.dropped_layers`), each run
        before the text model's layer that follows it (its index less the cross layers before it)."""
        self.encoder = encoder
        self.rows = rows
        self.at: dict[int, list[tuple[int, int]]] = {}  # decoder position -> (checkpoint index, kv slot), in order
        for slot, index in enumerate(sorted(dropped)):
            self.at.setdefault(index - slot, []).append((index, slot))
        self.positions = frozenset(self.at)
        self._index = torch.cat([torch.arange(r.first, r.first + r.count) for r in rows])

    def apply(
        self, position: int, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index = self._index.to(hidden.device)
        stream = hidden if residual is None else hidden + residual
        pieces = []
        for part in self.rows:
            rows = stream[part.first : part.first + part.count].to(part.mask.dtype)  # (the layers' dtype)
            for layer, slot in self.at[position]:
                rows = self.encoder.cross_layer(layer, rows, part.kv[slot], part.mask, part.full_rows)
            pieces.append(rows)
        if residual is None:  # (before the first layer: the other rows' stream stays `hidden`, their residual 0)
            residual = torch.zeros_like(hidden)
        return hidden.index_fill(0, index, 0), residual.index_copy(0, index, torch.cat(pieces).to(residual.dtype))


class CrossStates:
    """The running requests' cross-attention K/V, made when a step first computes one of a request's tokens and kept
    until it is released (by request id), shared by requests with the same images (their `MultimodalInputs.digest`).
    On the step thread only."""

    def __init__(
        self, encoder: MllamaImageEncoder, dropped: Sequence[int], device: torch.device, dtype: torch.dtype
    ) -> None:
        self.encoder = encoder
        self.dropped = tuple(dropped)
        self.device = device
        self.dtype = dtype
        self._kv: dict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._users: dict[bytes, set[str]] = {}
        self._held: dict[str, bytes] = {}

    def step(self, chunks: Sequence[tuple[Request, int, int]]) -> CrossStep | None:
        """The cross-attention layers of a step whose request i computes positions `[start_i, start_i + count_i)`
        (`chunks`, in the step's row order); None where no request of it has images."""
        from transformers.models.mllama.modeling_mllama import _prepare_cross_attention_mask

        rows: list[_Rows] = []
        base = 0
        for request, start, count in chunks:
            images = request.multimodal
            if images is not None and images.cross_attention_mask is not None:
                kv = self._states(request.request_id, images)
                dense = images.cross_mask_rows(start, count).to(self.device)
                mask, full = _prepare_cross_attention_mask(dense[None], self.encoder.num_patches,
                                                           self.dtype)  # type: ignore[arg-type]  # (it takes a dtype)
                rows.append(_Rows(base, count, kv, mask[0, 0], full[0, 0]))
            base += count
        return CrossStep(self.encoder, self.dropped, rows) if rows else None

    def _states(self, request_id: str, images: MultimodalInputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        digest = images.digest
        kv = self._kv.get(digest)
        if kv is None:
            states = torch.cat([
                self.encoder.encode(span.pixel_values.to(device=self.device, dtype=self.dtype), span.grid)
                for span in images.images
            ])  # fmt: skip
            kv = self._kv[digest] = self.encoder.cross_kv(states.to(self.dtype))
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
