"""A Gemma 4 assistant drafting for its Gemma 4 target (transformers' `SinglePositionMultiTokenCandidateGenerator`).

The assistant (`config.Gemma4Assistant`) is a small Gemma 4 text model with no K/V of its own: each of its layers
attends over the target's K/V of the target's last unshared layer of its kind (full or windowed), read in place from
the target's paged cache. To draft after a sequence's last known token t at position p, it runs one token: its input
`pre_projection(cat(e(t), h))`, `e` the target's scaled embedding and `h` the target's final hidden state at p - 1
(the one that chose t), at rope position p, attending over the target's positions before p; its logits (its tied
embedding's, over the tokens of its best clusters where it orders them: `Gemma4AssistantLM.logits`) give the draft,
and `post_projection` of its output the `h` of the next draft, again at position p over the same K/V.

The target's final hidden states are kept one row per cache slot (`hidden_rows`, written by `follow` after each of
the target's steps at the step's slots), so the state at p - 1 is found where the target computed it: in the step
before, or, after a prefix-cache hit, in the step that wrote that block (the same tokens give the same state).
Drafts only steer what the target verifies: the output is the target's whatever they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.core.scheduler_output import ScheduledRequest
from engine_server.hf_config import model_config_from_hf
from engine_server.layers.gemma4 import Gemma4DecoderModel
from engine_server.layers.kernel_choice import select_ops
from engine_server.loader import ModelSource
from engine_server.loader.source import read_hf_config
from engine_server.models.base import CausalLM
from engine_server.models.gemma4 import Gemma4ForCausalLM
from engine_server.parallel.layers import CheckpointTensor, read_whole
from engine_server.transfer import host_tensor, to_device

# The `model_type`s of Gemma 4's assistants (`hf_config` reads them).
_ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")


class ClusterOrder(nn.Module):
    """The assistant's `masked_embedding`: `centroids` (a linear layer to the clusters' scores) and `token_ordering`
    (every cluster's tokens, one after another), as its checkpoints name them."""

    own_tensors = ("token_ordering",)

    def __init__(self, hidden: int, clusters: int, vocab: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.centroids = nn.Linear(hidden, clusters, bias=False, dtype=dtype)
        self.register_buffer("token_ordering", torch.arange(vocab), persistent=False)

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """The checkpoint's `token_ordering` (`[vocab]` token ids); ValueError for another shape."""
        order, dest = read_whole(tensor).long(), self.get_buffer("token_ordering")
        if order.shape != dest.shape:
            raise ValueError(f"has shape {tuple(order.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(order)


class Gemma4AssistantLM(Gemma4ForCausalLM):
    """The assistant's weights: Gemma 4's text model (every layer's queries alone), its tied embedding as its LM
    head, `pre_projection`, `post_projection` and (with ordered embeddings) `masked_embedding`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype)
        shape = config.assistant
        assert shape is not None, "an assistant's config names its drafting shape"
        hidden, backbone = config.hidden_size, shape.backbone_hidden_size
        self.pre_projection = nn.Linear(2 * backbone, hidden, bias=False, dtype=dtype)
        self.post_projection = nn.Linear(hidden, backbone, bias=False, dtype=dtype)
        self.masked_embedding = (
            ClusterOrder(hidden, shape.centroids, config.vocab_size, dtype) if shape.centroids else None
        )
        self.top_clusters, self.clusters = shape.centroid_top_k, shape.centroids

    def draft(
        self, inputs: torch.Tensor, positions: torch.Tensor, caches: Sequence[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """The assistant's final hidden states `[N, hidden]` for inputs `[N, 2 * backbone]` (`cat(embedding,
        hidden)`) at rope `positions`, each attending over the target's K/V `caches` (one per layer) as `meta` lays
        them out."""
        decoder = self.model
        assert isinstance(decoder, Gemma4DecoderModel)
        ops = self.ops or select_ops(inputs.device)
        hidden = self.pre_projection(inputs)
        cos_sin, local = decoder.get_buffer("cos_sin_cache"), decoder.get_buffer("local_cos_sin_cache")
        residual: torch.Tensor | None = None
        for index, (layer, cache) in enumerate(zip(decoder.layers, caches, strict=True)):
            table = local if decoder.local_rope_layers[index] else cos_sin
            hidden, residual = layer(positions, hidden, residual, cache, table, meta, ops)
        normed: torch.Tensor = decoder.norm(hidden, ops)
        return normed

    def pick(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy draft of each row of the assistant's final hidden states `[N, hidden]`: over every token, or
        (ordered embeddings) over the tokens of its `top_clusters` best clusters alone, as transformers' masked
        embedder scores them."""
        weight = self.model.embed_tokens.weight
        if self.masked_embedding is None:
            return (hidden @ weight.t()).argmax(dim=-1)
        clusters = self.masked_embedding.centroids(hidden).topk(self.top_clusters, dim=-1).indices  # [N, k]
        order = self.masked_embedding.get_buffer("token_ordering").view(self.clusters, -1)
        tokens = order[clusters].flatten(1)  # [N, k * cluster size]
        scores = (weight[tokens] @ hidden.unsqueeze(-1)).squeeze(-1)
        return tokens.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)


def target_sources(target: ModelConfig, assistant: ModelConfig) -> list[int]:
    """For each assistant layer, the target layer whose K/V it attends over: the target's last layer of its kind
    (windowed or full) that keeps K/V of its own (transformers' `store_full_length_kv`). ValueError where the target
    has none of a kind, or its heads there do not fit the assistant's."""
    own = [i for i in range(target.num_hidden_layers) if target.kv_source(i) == i]
    sources = []
    for index in range(assistant.num_hidden_layers):
        windowed = assistant.attention_window(index) > 0
        kind = [i for i in own if (target.attention_window(i) > 0) == windowed]
        if not kind:
            raise ValueError(f"the Gemma 4 target has no {'windowed' if windowed else 'full'} attention layer of "
                             "its own for the assistant's to attend over")  # fmt: skip
        source = kind[-1]
        fits = (target.layer_head_dim(source), target.layer_kv_heads(source)) == (
            assistant.layer_head_dim(index), assistant.layer_kv_heads(index))
        window = assistant.attention_window(index)  # (a key wider: `hf_config._gemma4_assistant_config`)
        if not fits or (window - 1 if window else 0) != target.attention_window(source):
            raise ValueError(f"the assistant's layer {index} does not fit its target's layer {source}: heads "
                             f"{assistant.layer_kv_heads(index)} x {assistant.layer_head_dim(index)} against "
                             f"{target.layer_kv_heads(source)} x {target.layer_head_dim(source)}")  # fmt: skip
        sources.append(source)
    return sources


class Gemma4AssistantDraft:
    """The assistant, the target's caches and embedding it reads, and its two step calls (module docstring): the
    runner owns it, in place of a `DraftModel`."""

    def __init__(
        self,
        source: ModelSource,
        target: CausalLM,
        target_caches: Sequence[torch.Tensor],
        num_slots: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        config, shape = source.config, source.config.assistant
        assert shape is not None
        if target.config.architecture != "gemma4" or target.config.altup is not None:
            raise ValueError(f"draft model {source.name!r} is a Gemma 4 assistant: it drafts for a Gemma 4 target, "
                             f"not a {target.config.architecture} one")  # fmt: skip
        if (target.config.hidden_size, target.config.vocab_size) != (shape.backbone_hidden_size, config.vocab_size):
            raise ValueError(f"draft model {source.name!r} was trained for a target {shape.backbone_hidden_size} "
                             f"wide over {config.vocab_size} tokens; this one is {target.config.hidden_size} wide "
                             f"over {target.config.vocab_size}")  # fmt: skip
        model = Gemma4AssistantLM(config, dtype)
        model.load_weights(source.weights())
        self.model = model.to(device).eval()
        self.target = target
        self.caches = [target_caches[i] for i in target_sources(target.config, config)]
        self.name = source.name
        self.block_size = block_size
        self.device = device
        self.hidden_rows = torch.zeros(num_slots, shape.backbone_hidden_size, dtype=dtype, device=device)

    @torch.inference_mode()
    def follow(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor
    ) -> None:
        """Keep the target's final hidden states of a step (`[T, hidden]`, every row) at its tokens' slots."""
        self.hidden_rows.index_copy_(0, meta.slot_mapping, hidden.to(self.hidden_rows.dtype))

    @torch.inference_mode()
    def propose(self, items: Sequence[ScheduledRequest]) -> list[tuple[int, ...]]:
        """Greedy drafts for `items` (each with a last known token at `start_position` >= 1), as many per item as
        its `draft_token_ids` holds (placeholders); they write nothing."""
        wanted = [len(item.draft_token_ids) for item in items]
        # (a row at position 0 has no state before it: its placeholders stay, for the target to refuse)
        rows = [i for i, count in enumerate(wanted) if count and items[i].start_position > 0]
        drafts: list[list[int]] = [[0] * count if i not in rows else [] for i, count in enumerate(wanted)]
        if not rows:
            return [tuple(d) for d in drafts]
        starts = [items[i].start_position for i in rows]
        tables = [items[i].block_ids for i in rows]
        # Each row attends over the target's positions before its own: as a query at `start - 1` over `start` keys.
        meta = AttentionMetadata.build([1] * len(rows), starts, tables, self.block_size, self.device)
        before = [table[(p - 1) // self.block_size] * self.block_size + (p - 1) % self.block_size
                  for table, p in zip(tables, starts, strict=True)]  # fmt: skip
        hidden = self.hidden_rows.index_select(0, self._ids(before))
        tokens = self._ids([items[i].request.all_token_ids[p] for i, p in zip(rows, starts, strict=True)])
        positions = self._ids(starts)
        target = self.target.model
        for _ in range(max(wanted[i] for i in rows)):
            embedded = target.embed_tokens(tokens) * target.get_buffer("embedding_multiplier")
            out = self.model.draft(torch.cat((embedded.to(hidden.dtype), hidden), dim=-1), positions, self.caches,
                                   meta)  # fmt: skip
            tokens = self.model.pick(out)
            hidden = self.model.post_projection(out)
            for row, token in zip(rows, tokens.tolist(), strict=True):
                if len(drafts[row]) < wanted[row]:
                    drafts[row].append(token)
        return [tuple(d) for d in drafts]

    def _ids(self, values: list[int]) -> torch.Tensor:
        return to_device(host_tensor(values, torch.long, self.device), self.device)


def assistant_source(spec: str) -> ModelSource | None:
    """A Gemma 4 assistant's checkpoint folder `spec` as a `ModelSource` (its tokenizer the target's: the folder
    needs none), or None where `spec` is not one. ValueError for a bad config."""
    folder = Path(spec).expanduser()
    if not (folder / "config.json").is_file():
        return None
    config = read_hf_config(folder)
    if config.get("model_type") not in _ASSISTANT_TYPES:
        return None
    return ModelSource(config=model_config_from_hf(config, name=folder.name), path=folder.resolve(),
                       name=folder.name, tokenizer_path=folder.resolve())  # fmt: skip
