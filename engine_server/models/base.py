"""`CausalLM`: the decoder stack plus LM head, Hugging Face weight loading and the step entry points."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import cast

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig, MultimodalCheckpoint
from engine_server.layers.decoder import DecoderModel
from engine_server.layers.hyper_connections import HyperConnectedDecoderModel
from engine_server.layers.kernel_choice import select_ops
from engine_server.layers.norm import RMSNorm
from engine_server.layers.post_layer_norm import PostLayerNormDecoderModel
from engine_server.loader.lazy_tensor import ComputedSlice, LazyTensor, derived, whole
from engine_server.lora.slots import LoraBatch
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import (
    CheckpointTensor,
    ColumnParallelLinear,
    ParallelExperts,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_vocab,
    read_whole,
)
from engine_server.step_interrupt import StepInterrupt
from ladle_kernels.kernel_set import KernelOps

# Checkpoint projections that live as row slices of one fused parameter: (fused name, checkpoint name, shard), the
# shards of each fused layer in their order in it (its `ColumnParallelLinear.parts`).
FUSED_SHARDS: tuple[tuple[str, str, str], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
    ("in_proj", "in_proj_q", "lq"),  # Gated DeltaNet's input projections (layers.gated_deltanet)
    ("in_proj", "in_proj_k", "lk"),
    ("in_proj", "in_proj_v", "lv"),
    ("in_proj", "in_proj_z", "z"),
    ("in_proj", "in_proj_b", "b"),
    ("in_proj", "in_proj_a", "a"),
)
_PART_INDEX = {shard: [s for f, _, s in FUSED_SHARDS if f == fused].index(shard) for fused, _, shard in FUSED_SHARDS}
# A bare decoder's checkpoint names (no `model.` prefix, no LM head): `load_weights` reads them under `model.`.
_BARE_DECODER_PREFIXES = ("layers.", "embed_tokens.", "norm.")
# A multimodal checkpoint's text model (`text_model_weights`): transformers 5's prefix, and the earlier one.
_LANGUAGE_MODEL, _EARLIER_LANGUAGE_MODEL = "model.language_model.", "language_model."
# Where a multimodal checkpoint's text model sits besides `language_model.`, and its text-only name: Idefics 2 and
# 3's (and SmolVLM's), LLaVA-OneVision-1.5's, Ovis2.5's (`multimodal_text_weights`); and a layer's tensor.
_TEXT_MODEL_PREFIXES = (("model.text_model.", "model."), ("model.model.", "model."), ("llm.", ""))
# A LoRA adapter of a modality over a text model's projection (Phi-4-multimodal's as released: `<proj>.base_layer.`
# beside `<proj>.lora_A.vision.`), applied to that modality's tokens alone.
_ADAPTER = re.compile(r"\.lora_[AB]\.")
# An omni model's part that reads and writes text (Qwen2.5-Omni's and Qwen3-Omni's), beside its speech talker.
_THINKER = "thinker."
_LAYER = re.compile(r"model\.layers\.(?P<index>\d+)\.(?P<rest>.+)")
# Buffers some older checkpoints carry; we derive them from the config instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# One expert's projection of a mixture of experts: `<block>.experts.<e>.<proj>.weight` (`ParallelExperts`), or its
# `.bias` (gpt-oss's, from a GGUF file).
_EXPERT_WEIGHT = re.compile(
    r"(?P<bank>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<kind>weight|bias)"
)
_EXPERT_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
# All experts' projection in one 3-D tensor (transformers 5's own layout): `<block>.experts.gate_up_proj`
# `[E, 2 * I, H]` (gate rows, then up rows) or `<block>.experts.down_proj` `[E, H, I]`; where experts have biases,
# theirs in one 2-D tensor each, `gate_up_proj_bias` `[E, 2 * I]` (gate, then up) and `down_proj_bias` `[E, H]`;
# ungated experts' (Nemotron-H's) `up_proj` `[E, I, H]`.
_EXPERT_BANK = re.compile(r"(?P<bank>.+\.experts)\.(?P<proj>gate_up_proj|up_proj|down_proj)(?P<bias>_bias)?")


def text_model_weights(
    weights: Iterable[tuple[str, CheckpointTensor]], skipped: tuple[str, ...]
) -> Iterator[tuple[str, CheckpointTensor]]:
    """A multimodal checkpoint's text model under the names of a text-only one: `model.language_model.X`
    (transformers 5's layout) as `model.X`, `language_model.X` (the earlier one: `language_model.model.X`,
    `language_model.lm_head.weight`) as `X`; the tensors under a `skipped` prefix (its vision and audio towers,
    their projectors) left out, every other as it is."""
    for name, tensor in weights:
        if name.startswith(skipped):
            continue
        if name.startswith(_LANGUAGE_MODEL):
            yield "model." + name.removeprefix(_LANGUAGE_MODEL), tensor
        else:
            yield name.removeprefix(_EARLIER_LANGUAGE_MODEL), tensor


def multimodal_text_weights(
    weights: Iterable[tuple[str, CheckpointTensor]], checkpoint: MultimodalCheckpoint
) -> Iterator[tuple[str, CheckpointTensor]]:
    """A multimodal checkpoint's text model (`hf_multimodal`) under the names of a text-only one: its
    `model.language_model.` or `language_model.` tensors as `text_model_weights` reads them, Idefics's
    `model.text_model.X` as `model.X`; its towers left out, as are the layers it drops, the others numbered on
    without them (Llama 3.2 Vision's layer 4 after a dropped layer 3 is layer 3). An omni checkpoint's thinker
    (`thinker.`) is read as the multimodal model it is; a projection wrapped with a modality's LoRA adapters
    (`<proj>.base_layer.` beside `<proj>.lora_A.<modality>.`) as its base layer, the adapters left out."""
    dropped = checkpoint.dropped_layers
    thinkers = ((name.removeprefix(_THINKER), tensor) for name, tensor in weights)
    for name, tensor in text_model_weights(thinkers, checkpoint.towers):
        for theirs, ours in _TEXT_MODEL_PREFIXES:
            if name.startswith(theirs):
                name = ours + name.removeprefix(theirs)
        if _ADAPTER.search(name):  # a modality's adapter (Phi-4-multimodal's), off for text
            continue
        name = name.replace(".base_layer.", ".")
        if checkpoint.hidden_first_banks is not None and _is_hidden_first(name, tensor, checkpoint.hidden_first_banks):
            tensor = reordered_tensor(tensor, lambda t: t.transpose(1, 2).contiguous(), transposed=True)
        layer = _LAYER.match(name) if dropped else None
        if layer is not None:
            index = int(layer["index"])
            if index in dropped:
                continue
            name = f"model.layers.{index - sum(d < index for d in dropped)}.{layer['rest']}"
        yield name, tensor


def _is_hidden_first(name: str, tensor: CheckpointTensor, widths: tuple[int, int]) -> bool:
    """Whether `name` is a bank stored hidden-first (`gate_up_proj` `[E, H, 2 * I]`, `down_proj` `[E, I, H]`) for
    `widths` (H, I): its shape is that and not the expert-rows-first one."""
    hidden, width = widths
    if name.endswith(".experts.gate_up_proj"):
        return tuple(tensor.shape[1:]) == (hidden, 2 * width) != (2 * width, hidden)
    if name.endswith(".experts.down_proj"):
        return tuple(tensor.shape[1:]) == (width, hidden) != (hidden, width)
    return False


def expert_weight(name: str) -> tuple[str, int, str] | None:
    """(bank, expert, part: "gate", "up" or "down") of one expert's projection weight named as `load_weights` reads
    it (`<bank>.<e>.gate_proj.weight`, after `checkpoint_name`), None for any other name."""
    match = _EXPERT_WEIGHT.fullmatch(name)
    if match is None or match["kind"] != "weight":
        return None
    return match["bank"], int(match["expert"]), _EXPERT_PART[match["proj"]]


class CausalLM(nn.Module):
    """A decoder-only language model over a paged KV cache. Subclasses name a family and its quirks.

    Construct on the target device (e.g. inside `with torch.device("cuda"):`), then `load_weights`. `forward`
    and `compute_logits` are meant to run under `torch.inference_mode()`. `ops` selects the kernel backend;
    None picks it from the input's device on every call.

    With `tp` (tensor parallelism, `tp.size > 1`) the model holds this rank's shards only (`parallel.layers`):
    every rank of the group calls `forward` and `compute_logits` on the same inputs in the same order, and only
    rank 0 gets the logits. `lm_head` stays an `nn.Linear` (of this rank's vocab rows), so it is packed and
    quantized like any other projection.
    """

    # Checkpoint name fragments a family spells its own way, and ours: `(theirs, ours)`, replaced in every name.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # The decoder stack: a family's own (Gemma 4's) or the shared one (over residual streams where the config has
    # hyper-connections: `layers.hyper_connections`).
    decoder_class: type[DecoderModel] = DecoderModel
    # Checkpoint tensors a family's checkpoints carry that serving does not read (Nemotron 3's `mtp.` layers).
    ignored_prefixes: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.ops: KernelOps | None = None
        decoder = (
            HyperConnectedDecoderModel if config.hyper_connections is not None
            else PostLayerNormDecoderModel if config.post_layer_norm
            else self.decoder_class
        )  # fmt: skip
        self.model = decoder(config, dtype, o_proj_bias=config.o_proj_bias, tp=tp)
        embedding = self.model.embed_tokens
        head_rows = config.output_vocab_size or config.vocab_size
        self.lm_head: nn.Module = (
            ParallelLMHead.tied_to(embedding)
            if config.tie_word_embeddings
            else ParallelLMHead(head_rows, config.embedding_size or config.hidden_size, tp, dtype,
                                bias=config.lm_head_bias)  # (OPT-350M's head as wide as its embeddings)
        )
        self.vocab_shard = embedding.shard if config.tie_word_embeddings else self.lm_head.shard

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        interrupt: StepInterrupt | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """input_ids, positions `[T]` (int64) -> final hidden states `[T, hidden]`; writes the step's K/V.
        With `interrupt`, StepInterrupted once it is set, between two layers (engine_server.step_interrupt).
        `lora`: the step's LoRA adapters (engine_server.lora)."""
        ops = self.ops if self.ops is not None else select_ops(input_ids.device)
        hidden: torch.Tensor = self.model(input_ids, positions, kv_caches, meta, ops, interrupt, lora)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[N, hidden]` (only the rows that sample) -> logits `[N, vocab]` in float32: rank 0's call (the
        other ranks of a tensor-parallel group call `sharded_logits` with it, in step)."""
        logits = self.sharded_logits(hidden)
        if logits is None:
            raise RuntimeError(f"rank {self.tp.rank} of a tensor-parallel group gets no logits: call sharded_logits")
        return logits

    def sharded_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`compute_logits` on every rank of a tensor-parallel group: each computes its vocab rows' logits and
        they are gathered to rank 0, which gets `[N, vocab]` in float32 (soft-capped with the config's
        `final_logit_softcap`); the other ranks get None."""
        logits = gather_vocab(self.lm_head(hidden), self.vocab_shard, self.tp)
        if logits is None:
            return None
        if self.config.logits_scaling != 1.0:  # Granite: logits divided by its logits_scaling
            logits = logits / self.config.logits_scaling
        if self.config.logit_scale != 1.0:  # Cohere: logits times its logit_scale
            logits = logits * self.config.logit_scale
        cap = self.config.final_logit_softcap
        if cap > 0:  # Gemma 2: logits soft-capped to cap * tanh(logits / cap), in the weights' dtype
            logits = torch.tanh(logits / cap) * cap
        logits = logits.float()
        unheaded = self.config.vocab_size - logits.shape[-1]
        if unheaded > 0:  # Apertus 1.5's pruned head: the tokens past its rows are never sampled
            logits = torch.cat((logits, logits.new_full((logits.shape[0], unheaded), float("-inf"))), dim=-1)
        return logits

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as this model's modules name it (`checkpoint_renames` applied)."""
        for theirs, ours in self.checkpoint_renames:
            name = name.replace(theirs, ours)
        return name

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """A family's checkpoint tensors as `load_weights` reads them (`weights` itself here): a family overrides it
        to read a multimodal checkpoint's text model (`text_model_weights`), reorder rows, split or join tensors.
        A tensor it passes on unchanged is the same object (under its name or another): what `replaced` names, and
        an FP8 checkpoint's weights taken as stored (`quantization.stored_fp8_weights`), rely on it."""
        return weights

    def read_checkpoint(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """`checkpoint_weights` of a checkpoint's tensors, a multimodal checkpoint's text model first read under a
        text-only one's names (`multimodal_text_weights`, where `ModelConfig.multimodal` is set)."""
        if self.config.multimodal is not None:
            weights = multimodal_text_weights(weights, self.config.multimodal)
        return self.checkpoint_weights(weights, replaced)

    def load_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> None:
        """Copy Hugging Face-named tensors in (after `read_checkpoint`), fusing q/k/v and gate/up; raise
        ValueError on any mismatch.

        Every parameter (and every shard of a fused one) must be provided exactly as shaped; unknown names are
        refused. With `ModelConfig.norm_offset` (Gemma), every RMSNorm's weight becomes offset + the checkpoint's:
        call this once per model. With tied embeddings a checkpoint's `lm_head.weight` is ignored. Under tensor
        parallelism each sharded layer keeps its rank's slice of the tensor (`parallel.layers`), which may be given
        whole, as exactly that slice, or unread (`loader.lazy_tensor.LazyTensor`: then only that slice is read).

        A checkpoint of the bare decoder (saved from `AutoModel`, as Qwen3-Embedding's are: `layers.0...`,
        `embed_tokens.weight`, `norm.weight`) is read as the same names under `model.`. A mixture of experts' experts
        come one tensor per expert and projection (`...experts.<e>.gate_proj.weight`, as checkpoints store them,
        after `checkpoint_renames`) or one 3-D tensor per projection (`...experts.gate_up_proj`, transformers 5's
        in-memory layout).

        A module that names tensors in its `own_tensors` (gpt-oss's attention sinks; Gated DeltaNet's convolution and
        per-head `A_log` / `dt_bias`, `layers.gated_deltanet`) takes them whole in its `load_tensor(kind, tensor)` and
        keeps its rank's part itself.

        `replaced` names layers and expert banks (as `named_modules` does) whose weights the caller swaps for others
        right after (a GGUF file's quantized blocks, `engine_server.quantization`): their checkpoint weights count as
        loaded and are not read or copied (given as `LazyTensor`s, nothing of them is read at all); biases load.
        """
        modules = dict(self.named_modules())
        loaded: set[tuple[str, str]] = set()
        for name, tensor in self.read_checkpoint(weights, replaced):
            if name.startswith(_BARE_DECODER_PREFIXES):
                name = f"model.{name}"
            if name.endswith(_IGNORED_SUFFIXES) or (self.config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if self.ignored_prefixes and name.startswith(self.ignored_prefixes):
                continue
            name = self.checkpoint_name(name)
            expert = _EXPERT_WEIGHT.fullmatch(name)
            if expert is not None:
                if expert["bank"] in replaced and expert["kind"] == "weight":  # a replaced bank's biases load
                    loaded.add((expert["bank"], f"{int(expert['expert'])}.{_EXPERT_PART[expert['proj']]}"))
                else:
                    loaded.add(self._load_expert(modules, name, expert, tensor))
                continue
            bank = _EXPERT_BANK.fullmatch(name)
            if bank is not None:
                loaded.update(self._load_bank(modules, name, bank, tensor, replaced))
                continue
            module_name, _, kind = name.rpartition(".")
            target, shard = module_name, ""
            for fused, part, shard_name in FUSED_SHARDS:
                if module_name.endswith(f".{part}") and module_name.removesuffix(part) + fused in modules:
                    target, shard = module_name.removesuffix(part) + fused, shard_name
                    break
            module = modules.get(target)
            if kind in getattr(module, "own_tensors", ()):  # it keeps its rank's part its own way (`load_tensor`)
                try:
                    module.load_tensor(kind, tensor)  # type: ignore[union-attr]
                except ValueError as error:
                    raise ValueError(f"weight {name!r}: {error}") from None
                loaded.add((name, ""))
                continue
            if module is None or (kind not in ("weight", "bias") and not _own_parameter(module, kind)):
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            # A fused layer stored fused (Phi-3's qkv_proj and gate_up_proj): every part at once.
            fused_whole = not shard and isinstance(module, ColumnParallelLinear) and len(module.parts) > 1
            shards = [s for f, _, s in FUSED_SHARDS if target.endswith(f".{f}")] if fused_whole else [shard]
            if kind == "weight" and target in replaced:
                loaded.update((f"{target}.weight", s) for s in shards)
                continue
            try:
                if fused_whole:
                    _load_fused(cast(ColumnParallelLinear, module), tensor)
                else:
                    _load_into(module, kind, shard, tensor)
            except ValueError as error:
                raise ValueError(f"weight {name!r}: {error}") from None
            loaded.update((f"{target}.{kind}", s) for s in shards)
        expected = self._expected_shards(dict(self.named_parameters()))
        missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")
        if self.config.norm_offset:  # Gemma: a norm applies offset + w; kept as such (computed in float32 first)
            with torch.no_grad():
                for module in self.modules():
                    if isinstance(module, RMSNorm):
                        module.weight.copy_(module.weight.float() + self.config.norm_offset)

    @staticmethod
    def _load_expert(
        modules: dict[str, nn.Module], name: str, match: re.Match[str], tensor: CheckpointTensor
    ) -> tuple[str, str]:
        """Load one expert's projection into its bank; returns what `_expected_shards` lists for it."""
        bank = modules.get(match["bank"])
        if not isinstance(bank, ParallelExperts):
            raise ValueError(f"unexpected weight {name!r}: no mixture of experts there")
        part = _EXPERT_PART[match["proj"]] + ("_bias" if match["kind"] == "bias" else "")
        try:
            bank.load_expert(int(match["expert"]), part, tensor)
        except ValueError as error:
            raise ValueError(f"weight {name!r}: {error}") from None
        return match["bank"], f"{int(match['expert'])}.{part}"

    @staticmethod
    def _load_bank(
        modules: dict[str, nn.Module], name: str, match: re.Match[str], tensor: CheckpointTensor,
        replaced: Collection[str],
    ) -> list[tuple[str, str]]:
        """Load every expert's slices of one 3-D tensor (2-D for biases); returns what `_expected_shards` lists
        for them. A bank in `replaced` takes its biases alone: its weights count as loaded, unread."""
        bank = modules.get(match["bank"])
        bias = "_bias" if match["bias"] else ""
        if (
            not isinstance(bank, ParallelExperts) or tensor.dim() != (2 if bias else 3)
            or tensor.shape[0] != bank.num_experts or (bias and bank.b13 is None)
        ):  # fmt: skip
            raise ValueError(f"unexpected weight {name!r} of shape {tuple(tensor.shape)}")
        if match["bank"] in replaced and not bias:
            parts = {"down_proj": ["down"], "up_proj": ["up"]}.get(match["proj"], ["gate", "up"])
            return [(match["bank"], f"{expert}.{part}") for expert in range(bank.num_experts) for part in parts]
        bank_tensor = read_whole(tensor)
        loaded = []
        for expert in range(bank.num_experts):
            if match["proj"] in ("down_proj", "up_proj"):
                pieces = {f"{match['proj'].removesuffix('_proj')}{bias}": bank_tensor[expert]}
            else:
                gate, up = bank_tensor[expert].chunk(2)
                pieces = {f"gate{bias}": gate, f"up{bias}": up}
            for part, weight in pieces.items():
                try:
                    bank.load_expert(expert, part, weight)
                except ValueError as error:
                    raise ValueError(f"weight {name!r}: {error}") from None
                loaded.append((match["bank"], f"{expert}.{part}"))
        return loaded

    def _expected_shards(self, params: dict[str, nn.Parameter]) -> set[tuple[str, str]]:
        expected: set[tuple[str, str]] = set()
        banks = {name: module for name, module in self.named_modules() if isinstance(module, ParallelExperts)}
        for name, bank in banks.items():
            expected.update((name, f"{e}.{part}") for e in range(bank.num_experts) for part in bank.parts)
        modules = dict(self.named_modules())
        for name in params:
            owner = name.rpartition(".")[0]
            if owner in banks:
                continue
            shards = [s for fused, _, s in FUSED_SHARDS if f".{fused}." in name] or [""]
            module = modules[owner]
            if isinstance(module, ColumnParallelLinear) and len(module.parts) < len(shards):
                shards = shards[: len(module.parts)]  # the leading parts alone (Gemma 4's q or q/k projections)
            expected.update((name, s) for s in shards)
        return expected


def joined_queries(
    weights: Iterable[tuple[str, CheckpointTensor]],
    pattern: re.Pattern[str],
    join: Callable[[CheckpointTensor, CheckpointTensor], CheckpointTensor],
) -> Iterator[tuple[str, CheckpointTensor]]:
    """`weights` with each layer's query and gate projections (the tensors `pattern` matches: its `layer` group the
    layer, its `part` group `q_proj` for the query and any other name for the gate) yielded as that layer's one
    `q_proj.weight`, `join(query, gate)`, once both are read (AFMoE's and LFM3's gated attention); every other tensor
    as it comes. ValueError for a layer with one of them alone."""
    return joined_parts(
        weights, pattern, ("query", "gate"), "q_proj.weight", lambda parts: join(parts["query"], parts["gate"]),
        key=lambda part: "query" if part == "q_proj" else "gate",
        what="a query or its gate projection without the other",
    )  # fmt: skip


def joined_parts(
    weights: Iterable[tuple[str, CheckpointTensor]],
    pattern: re.Pattern[str],
    parts: tuple[str, ...],
    joined: str,
    join: Callable[[dict[str, CheckpointTensor]], CheckpointTensor],
    key: Callable[[str], str] = str,
    what: str = "some of a layer's parts without the others",
) -> Iterator[tuple[str, CheckpointTensor]]:
    """`weights` with the tensors `pattern` matches (its `layer` group the layer, its `part` group which part, named
    `key(part)`, one of `parts`) yielded per layer as `<layer>.<joined>`, `join(that layer's parts by name)`, once
    all of `parts` are read; every other tensor as it comes. ValueError saying `what` for a layer with some alone."""
    held: dict[str, dict[str, CheckpointTensor]] = {}
    for name, tensor in weights:
        match = pattern.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        found = held.setdefault(match["layer"], {})
        found[key(match["part"])] = tensor
        if len(found) == len(parts):
            del held[match["layer"]]
            yield f"{match['layer']}.{joined}", join(found)
    if held:
        raise ValueError(f"checkpoint holds {what}: {sorted(held)}")


def joined_convolutions(
    weights: Iterable[tuple[str, CheckpointTensor]], pattern: re.Pattern[str]
) -> Iterator[tuple[str, CheckpointTensor]]:
    """`weights` with each linear-attention layer's q, k and v convolutions (`pattern`'s `layer` and `part` groups,
    as OLMo Hybrid's and Kimi Linear's files hold them apart) as its one `<layer>.conv1d.weight`, their channels in
    that order (`joined_parts`)."""
    return joined_parts(
        weights, pattern, ("q", "k", "v"), "conv1d.weight",
        lambda parts: torch.cat([read_whole(parts[p]) for p in "qkv"]),
        what="some of a layer's q/k/v convolutions without the others",
    )  # fmt: skip


def reordered_tensor(
    tensor: CheckpointTensor,
    reorder: Callable[[torch.Tensor], torch.Tensor],
    transposed: bool = False,
    shape: tuple[int, ...] | None = None,
) -> CheckpointTensor:
    """`reorder(tensor)`; of an unread tensor (`LazyTensor`) unread too, so a layer whose weights are replaced (a GGUF
    file's blocks) reads none of it. The result's shape is the tensor's, its last two dims swapped where `transposed`,
    or `shape` where given (MiMo-V2-Flash's padded values)."""
    if not isinstance(tensor, LazyTensor):
        return reorder(read_whole(tensor))
    own = tuple(tensor.shape)
    return derived(tensor, shape or ((*own[:-2], own[-1], own[-2]) if transposed else own), reorder)


def gated_query(query: CheckpointTensor, gate: CheckpointTensor, head_dim: int) -> CheckpointTensor:
    """`[heads * head_dim, hidden]` query and gate rows as `[heads * 2 * head_dim, hidden]`, each head's query rows
    then its gate's (the gated attention's q_proj: AFMoE's, LFM3's); unread (`LazyTensor`) until loading reads it,
    when either is."""
    if tuple(query.shape) != tuple(gate.shape):
        raise ValueError(f"q_proj {tuple(query.shape)} and its gate {tuple(gate.shape)} differ in shape")
    rows, columns = query.shape[0], query.shape[1]

    def join() -> torch.Tensor:
        q, g = (whole(part).reshape(-1, head_dim, columns) for part in (query, gate))
        return torch.cat([q, g], dim=1).reshape(-1, columns)

    if isinstance(query, torch.Tensor) and isinstance(gate, torch.Tensor):
        return join()
    return LazyTensor(ComputedSlice((2 * rows, columns), join))


def _own_parameter(module: nn.Module, name: str) -> bool:
    """Whether `name` is a parameter of `module` itself (DeepSeek's router's `e_score_correction_bias`)."""
    return name in dict(module.named_parameters(recurse=False))


def _load_fused(module: ColumnParallelLinear, tensor: CheckpointTensor) -> None:
    """Copy a fused layer's whole checkpoint tensor (its parts' rows one after another, e.g. `cat(q, k, v)`) into
    `module`, part by part, each keeping this rank's rows; ValueError when the rows do not add up."""
    total = sum(part.full for part in module.parts)
    if tensor.shape[0] != total:
        raise ValueError(f"has {tensor.shape[0]} rows, expected the {total} of its parts")
    offset = 0
    for index, part in enumerate(module.parts):
        module.load_part(index, tensor.narrow(0, offset, part.full))
        offset += part.full


def _load_into(module: nn.Module, kind: str, shard: str, tensor: CheckpointTensor) -> None:
    """Copy one checkpoint tensor (`kind` "weight" or "bias"; `shard` the part of a fused layer, or "") into
    `module`, which keeps this rank's slice of it; ValueError when the module has no such tensor or the shape is
    neither the whole nor the slice."""
    if isinstance(module, ColumnParallelLinear):
        module.load_part(_PART_INDEX[shard] if shard else 0, tensor)
    elif isinstance(module, RowParallelLinear) or (
        isinstance(module, VocabParallelEmbedding | ParallelLMHead) and kind == "weight"
    ):
        module.load(tensor)
    elif isinstance(module, ParallelLMHead) and kind == "bias":
        module.load_bias(tensor)
    else:
        dest = getattr(module, kind, None)
        if not isinstance(dest, torch.Tensor):
            raise ValueError(f"{type(module).__name__} has no {kind}")
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.data.copy_(whole(tensor))  # (an unread scalar too, e.g. xIELU's `beta`)
