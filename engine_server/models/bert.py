"""`BertEncoder`: a BERT-style bidirectional encoder for pooling (embeddings, scores), over packed sequences.

An encoder attends both ways, so a sequence's hidden states depend on all of its tokens: the scheduler runs an
encoder input whole, in one step, never from the prefix cache (`PoolingParams.bidirectional`), and nothing is
kept between steps (no KV cache is read or written). A step's sequences are packed `[T, hidden]` as for the
decoders; attention pads them to `[B, L]` for one masked attention call per layer. Post-norm layers, learned
absolute positions (the step's positions, 0-based per sequence), a GELU MLP — as Hugging Face's `BertModel`, whose
parameter names this module keeps (a `bert.` prefix is dropped).

Token types: 0, but with `sep_token_id` (a cross-encoder's), 1 for every token after a sequence's first [SEP], which
is how BERT's tokenizer types a pair `[CLS] query [SEP] document [SEP]` (a single text has its [SEP] last).
A cross-encoder (`config.num_labels > 0`, `BertForSequenceClassification`) also holds the CLS pooler and the
classifier: `classify` turns CLS states into relevance scores.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.lora.slots import LoraBatch
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor, read_whole
from engine_server.step_interrupt import StepInterrupt, StepInterrupted

# Checkpoint tensors an encoder does not use: the NSP/MLM heads (and the CLS pooler, but for a cross-encoder's).
_UNUSED_HEADS = ("cls.",)


class _Embeddings(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden, dtype=dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1), hidden, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps, dtype=dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor | None
    ) -> torch.Tensor:
        summed = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_types is None:
            return self.LayerNorm(summed + self.token_type_embeddings.weight[0])
        return self.LayerNorm(summed + self.token_type_embeddings(token_types))


class _SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.query = nn.Linear(hidden, hidden, dtype=dtype)
        self.key = nn.Linear(hidden, hidden, dtype=dtype)
        self.value = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, hidden: torch.Tensor, layout: _PaddedLayout) -> torch.Tensor:
        """`[T, hidden]` -> `[T, hidden]`: each sequence's tokens attend to every token of the same sequence."""
        q, k, v = (
            layout.pad(proj(hidden)).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
            for proj in (self.query, self.key, self.value)
        )
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.key_mask)
        return layout.unpad(attended.transpose(1, 2).flatten(2))


class _Output(nn.Module):
    """A dense projection, then the residual and a LayerNorm (BERT's post-norm)."""

    def __init__(self, in_features: int, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class _Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.self = _SelfAttention(config, dtype)
        self.output = _Output(config.hidden_size, config, dtype)


class _Intermediate(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype)
        self.approximate = "tanh" if config.gelu_tanh else "none"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(hidden), approximate=self.approximate)


class _Layer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = _Attention(config, dtype)
        self.intermediate = _Intermediate(config, dtype)
        self.output = _Output(config.intermediate_size, config, dtype)

    def forward(self, hidden: torch.Tensor, layout: _PaddedLayout) -> torch.Tensor:
        attended = self.attention.output(self.attention.self(hidden, layout), hidden)
        return self.output(self.intermediate(attended), attended)


class _Pooler(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=dtype)


class _Encoder(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config, dtype) for _ in range(config.num_hidden_layers))


class _PaddedLayout:
    """A step's packed sequences laid out as a padded `[B, L]` batch: `pad` and `unpad` move rows between the two,
    `key_mask` `[B, 1, 1, L]` lets a query attend to the keys of its own sequence only."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        width = max(lengths)
        lens = torch.tensor(lengths, device=device)
        columns = torch.arange(width, device=device)
        self.valid = columns[None, :] < lens[:, None]  # [B, L]
        starts = torch.cumsum(lens, 0) - lens
        self.index = torch.where(self.valid, starts[:, None] + columns[None, :], 0)  # [B, L] rows of the packed batch
        self.key_mask = self.valid[:, None, None, :]

    def token_types(self, input_ids: torch.Tensor, sep_token_id: int) -> torch.Tensor:
        """`[T]`: 1 for each token after its sequence's first `sep_token_id`, else 0."""
        is_sep = (self.pad(input_ids) == sep_token_id) & self.valid
        after_first = (torch.cumsum(is_sep, dim=1) - is_sep.long()) > 0
        return self.unpad(after_first.long())

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        return packed[self.index]

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        return padded[self.valid]  # row-major: sequence by sequence, as packed


class BertEncoder(nn.Module):
    """A BERT encoder for pooling. `forward` takes the runner's step (token ids, positions, the step's metadata;
    the KV cache is neither read nor written) and returns the last hidden states `[T, hidden]`; an encoder has no
    logits. Not tensor-parallel."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        tp: TensorParallel = SINGLE,
        sep_token_id: int | None = None,
    ) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError("an encoder model runs on one device: tensor parallelism is for decoders")
        if not config.encoder:
            raise ValueError(f"BertEncoder needs an encoder configuration, got {config.architecture!r}")
        self.config = config
        self.tp = tp
        self.dtype = dtype
        self.embeddings = _Embeddings(config, dtype)
        self.encoder = _Encoder(config, dtype)
        self.sep_token_id = sep_token_id if config.type_vocab_size > 1 else None
        if config.num_labels:
            self.pooler = _Pooler(config, dtype)
            self.classifier = nn.Linear(config.hidden_size, config.num_labels, dtype=dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        interrupt: StepInterrupt | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """input_ids, positions `[T]` -> last hidden states `[T, hidden]`; each of the step's sequences must be
        whole (its positions from 0). StepInterrupted between two layers once `interrupt` is set. `lora` is the
        decoders' parameter (`CausalLM.forward`), always None here: an encoder serves no adapters."""
        if lora is not None:
            raise ValueError("an encoder serves no LoRA adapters")
        if meta.query_lens_cpu != meta.seq_lens_cpu:
            raise ValueError("an encoder runs each input whole in one step: a chunk of one cannot be computed")
        layout = _PaddedLayout(meta.query_lens_cpu, input_ids.device)
        token_types = None if self.sep_token_id is None else layout.token_types(input_ids, self.sep_token_id)
        hidden = self.embeddings(input_ids, positions, token_types)
        for layer in self.encoder.layer:
            hidden = layer(hidden, layout)
            if interrupt is not None and interrupt.is_set():
                raise StepInterrupted
        return hidden

    def classify(self, cls_states: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's relevance scores `[N]` for the CLS states `[N, hidden]` of N pairs: the sigmoid of its
        classifier's single output over the pooled CLS state (as sentence-transformers' CrossEncoder scores)."""
        if self.config.num_labels != 1:
            raise RuntimeError(f"scoring needs a classifier with one output, this one has {self.config.num_labels}")
        pooled = torch.tanh(self.pooler.dense(cls_states.to(self.dtype)))
        return torch.sigmoid(self.classifier(pooled).float())[:, 0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder model has no logits: it pools (Embed, Score) and does not generate")

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Copy Hugging Face BERT tensors in by name (`bert.` prefix or not); ValueError on an unknown name, a
        shape mismatch or a missing tensor."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            unused = name.startswith(_UNUSED_HEADS) or (name.startswith("pooler.") and not self.config.num_labels)
            if unused or name.endswith("position_ids"):
                continue
            # Some BERT checkpoints name LayerNorm parameters gamma and beta (TensorFlow's names).
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
            dest = params.get(name)
            if dest is None:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.data.copy_(read_whole(tensor))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")
