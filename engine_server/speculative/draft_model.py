"""A draft model beside the target: it proposes each speculating sequence's drafts by decoding them greedily.

The draft keeps a KV cache of its own, shaped by its own heads, over the target's blocks: the same block ids,
block tables and slots, so the scheduler's allocation serves both. Two calls per step keep it in step:
- `propose`, before the target's forward: for the sequences with drafts, the draft decodes from the last known
  token, one token per call, as many times as the longest proposal (each writes its input's K/V at the slot the
  target will verify it in) and takes the argmax each time;
- `follow`, after the target's forward: the draft runs the step's own tokens (prompt chunks, decodes, the last
  known token and the drafts of each verifying sequence) through itself, so its cache holds every position the
  target computed; positions of refused drafts are written again by later steps, as the target's are.
A prefix-cache hit finds the draft's K/V in the block too: both caches are written in the same steps.

The draft must share the target's tokenizer: its vocabulary may be smaller (padded lm_heads differ) but not
larger, and its context at least the engine's. Loading refuses anything else with a clear message.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_server.attention_metadata import AttentionMetadata
from engine_server.core.scheduler_output import ScheduledRequest
from engine_server.layers.packed_linear import pack_linear_layers
from engine_server.loader import ModelSource
from engine_server.models import CausalLM, allocate_kv_cache, get_model_class
from engine_server.transfer import host_tensor, to_device


class DraftModel:
    """The draft model, its KV cache and its two step calls (module docstring). The runner owns it."""

    def __init__(
        self,
        source: ModelSource,
        *,
        target_vocab_size: int,
        max_model_len: int,
        num_cache_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        config = source.config
        if config.vocab_size > target_vocab_size:
            raise ValueError(
                f"draft model {source.name!r} has a vocabulary of {config.vocab_size} tokens, more than the target's "
                f"{target_vocab_size}: a draft must share the target's tokenizer"
            )
        if config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"draft model {source.name!r} handles {config.max_position_embeddings} positions, fewer than the "
                f"engine's {max_model_len} (lower --max-model-len or pick another draft)"
            )
        if config.recurrent is not None:  # its states would advance past the drafts the target rejects
            raise ValueError(f"draft model {source.name!r} has recurrent layers, which a draft model cannot have yet")
        model = get_model_class(config.architecture)(config, dtype=dtype)
        model.load_weights(source.weights())
        self.model: CausalLM = model.to(device).eval()
        if device.type == "cpu":
            pack_linear_layers(self.model)
        self.name = source.name
        self.vocab_size = config.vocab_size
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_cache(config, num_cache_blocks, block_size, dtype, device)

    @torch.inference_mode()
    def propose(self, items: Sequence[ScheduledRequest]) -> list[tuple[int, ...]]:
        """Greedy drafts for `items` (each with a last known token at `start_position`), as many per item as its
        `draft_token_ids` holds (placeholders); they write the draft's K/V for the positions they start from."""
        wanted = [len(item.draft_token_ids) for item in items]
        drafts: list[list[int]] = [[] for _ in items]
        tokens = [min(item.request.all_token_ids[item.start_position], self.vocab_size - 1) for item in items]
        for depth in range(max(wanted, default=0)):
            rows = [i for i, count in enumerate(wanted) if count > depth]
            positions = [items[i].start_position + depth for i in rows]
            meta = AttentionMetadata.build(
                [1] * len(rows), [p + 1 for p in positions], [items[i].block_ids for i in rows], self.block_size,
                self.device,
            )  # fmt: skip
            hidden = self.model(self._ids([tokens[i] for i in rows]), self._ids(positions), self.kv_caches, meta)
            picked = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for i, token in zip(rows, picked, strict=True):
                drafts[i].append(token)
                tokens[i] = token
        return [tuple(d) for d in drafts]

    @torch.inference_mode()
    def follow(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor
    ) -> None:
        """Run the target's step (its input tokens, positions and layout) through the draft, for its K/V (the
        target's final hidden states `hidden` are not read: a Gemma 4 assistant's are)."""
        self.model(input_ids.clamp(max=self.vocab_size - 1), positions, self.kv_caches, meta)

    def _ids(self, values: list[int]) -> torch.Tensor:
        return to_device(host_tensor(values, torch.long, self.device), self.device)
