"""Which weights an engine keeps quantized (`EngineConfig.quantization`), and swapping its layers to them.

- `none`: the float weights, the exact path (greedy output equal to transformers').
- `gguf`: a GGUF model's own blocks (`loader.gguf_quant`: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, the K-quants Q2_K .. Q6_K,
  IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M and MXFP4, each tensor in its own type, a fused
  projection's shards in theirs), exactly the weights llama.cpp serves from that file, a mixture of experts' banks
  included (`layers.quantized_experts`, in any of those types, gate/up in one and down in one); its other tensors
  (F32, F16, BF16, the ternary TQ1_0 / TQ2_0, ...) stay float.
- `int8`: every linear layer and bank of experts of any model, its float weights quantized to 8-bit groups of 32
  (`quantize_q8`); on the CPU an MXFP4 checkpoint's banks of experts (gpt-oss's released files) are served as
  stored instead (`loader.mxfp4.StoredMxfp4Bank`, read bank by bank: never float, never rounded again).
- `fp8`: every linear layer but the LM head and the routers, and every bank of experts, in float8 e4m3
  (`layers.fp8_linear`, `layers.fp8_experts`): an FP8 checkpoint's weights as it stores them
  (`loader.fp8_checkpoint`: per channel, per tensor, or per block of 128 x 128), any other model's float weights
  quantized per output channel at load; activations are rounded to e4m3 per token on the fly (an expert's
  SiLU-and-mul rows per token and expert). On CUDA (compute capability 8.9+: e4m3 tensor cores) the weights stay
  e4m3 and `ladle_kernels.fp8_linear` / `ladle_kernels.fused_moe.fp8_fused_moe` multiply them; on the CPU they are
  dequantized once to float and the rows are rounded to e4m3 before each product: the same arithmetic, for
  loading and measuring FP8 models without a GPU (neither faster nor smaller than float). Under tensor
  parallelism each rank quantizes its slice of the float weights per channel, an FP8 checkpoint's included
  (dequantized first).
- `auto`: `gguf` for a GGUF model on the CPU (where the kernels are built), `int8` for an MXFP4 checkpoint there
  (its experts as stored) or an integer one (GPTQ, AWQ, compressed-tensors: `loader.int_checkpoint`, its 4- or
  8-bit weights kept 8-bit rather than float32), `fp8` for an FP8 checkpoint on CUDA where the FP8 GEMMs run,
  otherwise `none` (an FP8, MXFP4 or integer checkpoint then loads dequantized to float).
A mixture of experts' routers stay float under `gguf` and `int8` (their logits choose the experts: a rounding step
could change the choice), multiplied row by row in one fixed order on the CPU (`RowwiseLinear`) so that the choice
does not depend on the batch either.
`auto` is the default: for the embedded model on the CPU that is its GGUF blocks, whose quality against the
float model `tests/unit/test_quantization.py` checks; `none` stays the exact path the engine-level tests check
against transformers. The quantized kernels multiply 8-bit activations (quantized per group of 32 on the fly)
by the 4/8-bit weights in exact integer dot products for any number of rows, so a row's result does not depend
on its batch, bit for bit; they stream ~5x fewer weight bytes per decode step than float32 and run ~1.3-2x the
float32 GEMMs' multiply-adds per second at prefill and batch sizes (`vpmaddubsw`, 32 per instruction).
Quantized layers run on the CPU kernels (`ladle_kernels/cpu/quant_matmul.cpp`); on CUDA `int8` runs on the Triton
kernel `ladle_kernels.int8_linear` (the weight dequantized to the model's dtype in registers, x kept as it is) and
`gguf` is refused at start-up, as it is for a model that is not a GGUF file. `auto` stays `none` on CUDA.
The LM head of a model with tied embeddings is quantized (from the embedding's stored blocks under `gguf`). Under
`gguf` on one rank the embedding lookup reads the file's blocks too (`QuantizedEmbedding`: the rows a step looks up,
dequantized, the float table's very values), so the float table is never loaded: for the embedded model 113 MB of
float32 not held; under `int8` and tensor parallelism it keeps its float table.

Under tensor parallelism each rank quantizes only its slices: `int8` its local float slice, `gguf` the file's
blocks of its rows (column-parallel layers, the LM head's vocab rows, zero rows for the vocabulary's padding)
or of its input columns (row-parallel layers, whose slices fall on groups of 32 where the heads and MLP rows
split evenly by multiples of 32; a layer whose slice does not stays float), read from the mapped file and
nothing else. Group boundaries are then the same as at TP=1, so every rank holds exactly TP=1's weights, and
the sharded activations quantize per group as they would whole; what changes is the order of the float sums
over the groups (each rank's partial dot products, then the all-reduce). That moves a value by float rounding,
and where it crosses an 8-bit rounding boundary of the next layer's activations by one step of that group, so
greedy output under TP is not bit-equal to TP=1's: `ladle bench quality --tensor-parallel-size N` measures it
against the float model with the same thresholds as TP=1. Within one TP size a row's result still does not
depend on its batch (the shared-memory all-reduce sums in rank order). Each rank's C++ decode stack runs all its
layers in one call and all-reduces between them through that same shared memory (gloo alone: no stack).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import torch
from gguf import GGMLQuantizationType
from torch import nn

from engine_server.layers.decode_stack import build_decode_stack
from engine_server.layers.fp8_experts import (
    Fp8Bank,
    Fp8Experts,
    Fp8ExpertWeights,
    quantize_fp8_experts,
    replace_fp8_experts,
)
from engine_server.layers.fp8_linear import Fp8Linear, Fp8Weight, concat_fp8_rows, quantize_fp8, replace_fp8_linears
from engine_server.layers.lowbit_weight import LowBitWeight
from engine_server.layers.quantized_experts import (
    ROUTER_SUFFIXES,
    ExpertWeights,
    QuantizedExperts,
    RowwiseLinear,
    expert_weights,
    quantize_experts,
    replace_experts,
    replace_routers,
)
from engine_server.layers.quantized_linear import (
    Q4Weight,
    Q8Weight,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    concat_rows,
    pad_rows,
    quantize_q8,
    replace_linears,
)
from engine_server.layers.weight_arena import gather_packed_weights
from engine_server.loader.fp8_checkpoint import read_fp8_weights
from engine_server.loader.gguf_hybrid import TILED_VALUE_HEADS, HybridShape
from engine_server.loader.gguf_quant import StoredMatrix, stored_matrices
from engine_server.loader.mxfp4 import StoredMxfp4Bank, is_mxfp4_checkpoint, mxfp4_bank_tensors
from engine_server.loader.source import ModelSource, iter_lazy_safetensors, read_hf_config
from engine_server.loader.weight_files import tensor_files
from engine_server.models.base import FUSED_SHARDS, CausalLM, expert_weight
from engine_server.parallel.layers import (
    EXPERT_PARTS,
    UNGATED_EXPERT_PARTS,
    ColumnParallelLinear,
    ParallelExperts,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from ladle_kernels.reference import QUANT_GROUP

Scheme = Literal["none", "gguf", "int8", "fp8"]
# Gemma 4's per-layer input table (`layers.gemma4`): on the CPU quantized (its blocks under gguf, 8-bit groups of 32
# under int8) and looked up row by row, as the token embeddings are from a GGUF file's blocks. E2B's holds 2.3B
# values: 9 GB as float32, 2.4 GB as 8-bit.
PER_LAYER_TABLE = "model.embed_tokens_per_layer"


@dataclass(frozen=True)
class StoredBank:
    """A bank of experts that a GGUF file stores in types the experts' kernels take, not read yet: each expert's
    gate, up and down matrices, and this rank's intermediate `rows` of them. `read` gives its `ExpertWeights`, so
    the banks of a large model are read and packed one at a time (read as parsed, a bank's weights take ~1.1 bytes
    a value, packed ~0.7 for Q5_0: gpt-oss-20b's 19B expert values would need 21 GB at once)."""

    gate: tuple[StoredMatrix, ...]  # () for ungated experts (Nemotron-H's)
    up: tuple[StoredMatrix, ...]
    down: tuple[StoredMatrix, ...]
    rows: range

    def read(self) -> ExpertWeights | None:
        """This rank's slices of every expert (gate and up rows, down's columns of those rows); None (the bank stays
        float) when an expert's gate and up come in different formats."""
        gate = [matrix.read(self.rows) for matrix in self.gate]
        up = [matrix.read(self.rows) for matrix in self.up]
        down = [matrix.read(columns=self.rows) for matrix in self.down]
        try:
            return expert_weights(gate, up, down)
        except ValueError:  # gate and up in different formats
            return None


# What a file stores quantized for one module: a linear layer's weight, or a bank of experts' (GGUF, or an MXFP4
# checkpoint's: read when packed), or a linear layer's FP8 weight (an FP8 checkpoint).
StoredWeight = QuantizedWeight | StoredBank | StoredMxfp4Bank | Fp8Weight | Fp8ExpertWeights


def resolve_quantization(
    mode: str, source: ModelSource, device: torch.device, dtype: torch.dtype, kernels: bool
) -> Scheme:
    """The scheme `mode` means for `source` in `dtype` on `device`; `kernels` says whether the device's own
    kernels are there (the C++ ones built on the CPU, triton on CUDA). Raises ValueError (naming the flag) for a
    scheme this engine cannot serve. Under tensor parallelism each rank quantizes its own slices (module doc). An
    encoder (BERT) keeps float weights: `auto` is `none` for it, `gguf` and `int8` are refused.
    """
    cpu_float32 = device.type == "cpu" and dtype == torch.float32
    if source.config.encoder:
        if mode not in ("auto", "none"):
            raise ValueError(f"--quantization {mode}: an encoder model ({source.name!r}) keeps its float weights")
        return "none"
    if mode == "auto":
        if cpu_float32 and kernels and source.gguf_path is not None:
            return "gguf"
        if cpu_float32 and kernels and (_mxfp4_source(source) or source.int_weights is not None):
            return "int8"  # (a 4- or 8-bit checkpoint's weights stay 8-bit, not float32)
        fp8 = source.fp8 is not None and device.type == "cuda" and _fp8_refusal(device, kernels) is None
        return "fp8" if fp8 else "none"
    if mode == "none":
        return "none"
    if mode == "fp8":
        refusal = _fp8_refusal(device, kernels)
        if refusal is not None:
            raise ValueError(f"--quantization fp8: {refusal}")
        return "fp8"
    if mode not in ("gguf", "int8"):
        raise ValueError(f"--quantization {mode!r}: expected auto, none, gguf, int8 or fp8")
    if device.type == "cuda":
        if mode != "int8":
            raise ValueError("--quantization gguf: CUDA serves int8 weights (or none), not a GGUF file's blocks")
        if not kernels:
            raise ValueError("--quantization int8: needs triton on CUDA, which could not be imported here")
        return "int8"
    if not cpu_float32:
        raise ValueError(
            f"--quantization {mode}: quantized weights run on the CPU in float32 only, not {device.type} {dtype}"
        )
    if not kernels:
        raise ValueError(f"--quantization {mode}: needs the CPU kernels, which could not be built here")
    if mode == "gguf" and source.gguf_path is None:
        raise ValueError(f"--quantization gguf: model {source.name!r} is not a GGUF file")
    return "gguf" if mode == "gguf" else "int8"


def _fp8_refusal(device: torch.device, kernels: bool) -> str | None:
    """Why FP8 weights cannot be served on `device`, or None: the CPU serves them (dequantized: module doc), CUDA
    needs triton and e4m3 tensor cores."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"FP8 weights are served on CUDA or the CPU, not {device.type}"
    if not kernels:
        return "needs triton on CUDA, which could not be imported here"
    from ladle_kernels.fp8_linear import FP8_MIN_CAPABILITY  # triton: imported only where it runs

    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        return f"needs a GPU with e4m3 tensor cores (compute capability 8.9+), not {capability[0]}.{capability[1]}"
    return None


def stored_fp8_weights(model: CausalLM, source: ModelSource) -> tuple[dict[str, StoredWeight], frozenset[str]]:
    """The FP8 weight of each of `model`'s linear layers and expert banks that `source`, an FP8 checkpoint, stores
    in FP8 (all of a fused layer's shards: `concat_fp8_rows`; all of a bank's experts' projections, each expert's
    gate and up rows joined the same way), by module name, and the checkpoint names they were read from (for
    `ModelSource.lazy_weights`, which then leaves them to this). Empty for any other source, and under tensor
    parallelism, where every rank quantizes its slice of the dequantized weights instead (module doc).

    Names are the model's own (`CausalLM.checkpoint_weights`: a multimodal checkpoint's text model read as a text
    model's); a weight the model reorders, splits or transposes at load (GLM-4's and Llama 4's q/k rows, Llama 4's
    banks) is left to be dequantized, reordered and quantized again as a float checkpoint's would be."""
    if source.fp8 is None or model.tp.size > 1:
        return {}, frozenset()
    parts: dict[str, dict[str, str]] = {}  # module -> shard ("" for a whole layer) -> checkpoint weight name
    expert_parts: dict[str, dict[tuple[int, str], str]] = {}  # bank -> (expert, part) -> checkpoint weight name
    modules = dict(model.named_modules())
    for name, ours in _as_loaded(model, source.path, frozenset(source.fp8.fp8_weights(source.path))):
        checkpoint_name = model.checkpoint_name(ours)
        expert = expert_weight(checkpoint_name)
        if expert is not None:
            expert_parts.setdefault(expert[0], {})[expert[1:]] = name
            continue
        module = checkpoint_name.removesuffix(".weight")
        target, shard = module, ""
        for fused, part, shard_name in FUSED_SHARDS:  # a shard of a fused layer the model has (as `load_weights`)
            if module.endswith(f".{part}") and module.removesuffix(part) + fused in modules:
                target, shard = module.removesuffix(part) + fused, shard_name
        parts.setdefault(target, {})[shard] = name
    chosen: dict[str, list[str]] = {}
    for target, shards in parts.items():
        expected = [s for f, _, s in FUSED_SHARDS if target.endswith(f".{f}")] if "" not in shards else [""]
        if isinstance(modules.get(target), nn.Linear) and set(shards) == set(expected):
            chosen[target] = [shards[s] for s in expected]
    banks: dict[str, dict[tuple[int, str], str]] = {}
    for target, stored_parts in expert_parts.items():
        bank = modules.get(target)
        if isinstance(bank, ParallelExperts) and set(stored_parts) == {
            (e, part) for e in range(bank.num_experts) for part in EXPERT_PARTS
        }:
            banks[target] = stored_parts
    names = [n for ns in chosen.values() for n in ns] + [n for ps in banks.values() for n in ps.values()]
    read = read_fp8_weights(source.path, source.fp8, names)
    # Each tensor read is let go once joined (`pop`): a bank's experts are stacked into a copy, and a model's
    # banks are most of its bytes, so holding both would double the peak.
    weights: dict[str, StoredWeight] = {
        target: concat_fp8_rows([read.pop(n) for n in shard_names]) for target, shard_names in chosen.items()
    }
    for target, stored_parts in banks.items():
        experts = range(len(stored_parts) // len(EXPERT_PARTS))
        gate_up = [
            concat_fp8_rows([read.pop(stored_parts[e, "gate"]), read.pop(stored_parts[e, "up"])]) for e in experts
        ]
        down = [read.pop(stored_parts[e, "down"]) for e in experts]
        weights[target] = _fp8_bank_weights(Fp8Bank.stack(gate_up), Fp8Bank.stack(down))
    return weights, frozenset(names)


def _as_loaded(model: CausalLM, folder: Path, names: frozenset[str]) -> Iterator[tuple[str, str]]:
    """(checkpoint name, the name `model` loads it under) of each of `names` (tensors of `folder`'s checkpoint) that
    `model.read_checkpoint` passes on unchanged, its tower's weights and any it reorders or derives left out.
    Every tensor goes through (a family may join two: AFMoE's query and gate), none is read (unread `LazyTensor`s,
    followed by identity)."""
    unread = list(iter_lazy_safetensors(folder))
    origin = {id(tensor): name for name, tensor in unread if name in names}
    for ours, tensor in model.read_checkpoint(unread):
        name = origin.get(id(tensor))
        if name is not None:
            yield name, ours


def _fp8_bank_weights(gate_up: Fp8Bank, down: Fp8Bank) -> Fp8ExpertWeights:
    """A bank's stored FP8 projections as one `Fp8ExpertWeights`: as stored when both are scaled alike (per channel,
    or per blocks of one size), else both per channel (`Fp8Experts` takes one layout), the block-scaled one's
    values quantized again per channel (as `concat_fp8_rows` does for a block straddling two shards)."""
    if gate_up.block == down.block:
        return Fp8ExpertWeights(gate_up, down)
    return Fp8ExpertWeights(gate_up.per_channel(), down.per_channel())


def stored_weights(model: CausalLM, source: ModelSource) -> dict[str, StoredWeight]:
    """The weight of each of `model`'s linear layers and expert banks that `source`'s GGUF file stores quantized,
    by module name (as `named_modules` does), as this rank keeps it; the layers absent stay float under `gguf`, as
    do the routers (`ROUTER_SUFFIXES`). Built from the layers' shapes and slices alone: call it before loading the
    float weights, so those of the layers present are never read (`CausalLM.load_weights`'s `replaced`)."""
    assert source.gguf_path is not None
    config = source.config
    converted = json.loads((source.path / "config.json").read_text(encoding="utf-8"))
    model_type = str(converted["model_type"])
    matrices = stored_matrices(
        source.gguf_path,
        model_type=model_type,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        converted=source.path,
        hybrid=HybridShape.from_config(converted, model_type) if model_type in TILED_VALUE_HEADS else None,
        rotary_dim=config.rotary_dim,
    )
    stored = {model.checkpoint_name(name): matrix for name, matrix in matrices.items()}
    tied = config.tie_word_embeddings
    weights: dict[str, StoredWeight] = {}
    embeddings: list[tuple[str, VocabParallelEmbedding]] = []
    for name, module in model.named_modules():
        weight: StoredWeight | None = None
        if isinstance(module, nn.Linear) and not name.endswith(ROUTER_SUFFIXES):
            weight = _stored_weight(stored, name, module, tied)
        elif name in ("model.embed_tokens", PER_LAYER_TABLE) and module.tp.size == 1 and f"{name}.weight" in stored:
            # Looked up from its blocks (`QuantizedEmbedding`, as `quantize_model` swaps them in): read below.
            embeddings.append((name, cast(VocabParallelEmbedding, module)))
        elif isinstance(module, ParallelExperts):
            weight = _stored_experts(stored, name, module)
        if weight is not None:
            weights[name] = weight
    head = _linear_weight(weights.get("lm_head"))
    for name, module in embeddings:
        if name == "model.embed_tokens" and tied and head is not None and head.shape == tuple(module.weight.shape):
            weights[name] = head  # the very blocks the LM head multiplies: one copy for both (`quantize_model`)
        else:
            weights[name] = stored[f"{name}.weight"].read()
    return weights


def quantize_model(
    model: CausalLM, source: ModelSource, scheme: Scheme, stored: MutableMapping[str, StoredWeight] | None = None
) -> dict[str, int]:
    """Swap `model`'s linear layers for `QuantizedLinear`s under `scheme`, and give its decoder the C++ decode
    stack where every projection is quantized; returns layers per format (`q4`, `q8`, and `float` for those left
    as they were) and `decode_stack` (1 when attached). Under `gguf`, `stored` is `stored_weights`' result when
    the caller has it already (computed here otherwise); under `int8`, `stored_mxfp4_banks`' (the banks it names
    were never loaded as float); on the CPU it is emptied once its weights are packed.

    On the CPU the model also gets `ladle_kernels.cpu_ops.batch_invariant_cpu_ops` (every token's attention on the
    decode kernel), so that with the integer kernels a token's result does not depend on its batch or on the
    prefix cache, bit for bit (docs/models.md, Quantized weights)."""
    if scheme == "none":
        return {}
    if scheme == "fp8":
        return _quantize_fp8(model, {} if stored is None else stored)
    on_cpu = model.model.embed_tokens.weight.device.type == "cpu"
    if scheme == "gguf":
        weights: MutableMapping[str, StoredWeight] = stored_weights(model, source) if stored is None else stored
        tied = "model.embed_tokens" in weights and weights["model.embed_tokens"] is weights.get("lm_head")
        # Each layer's weight as read is let go once it is packed (popped), so that the file's copies of the
        # projections are not all held beside their packed forms (gpt-oss-20b's attention and LM head: 1.3 GB).
        replace_linears(model, lambda name, linear: _linear_weight(weights.pop(name, None)))
        if on_cpu:  # each bank read as it is packed (`StoredBank`)
            replace_experts(model, lambda name, bank: _bank_weights(weights.pop(name, None)))
            embedding = weights.pop("model.embed_tokens", None)
            head = getattr(model, "lm_head", None)
            if tied and isinstance(head, QuantizedLinear):
                # A tied LM head's packed blocks serve the lookups too: no second copy of the table.
                model.model.register_module("embed_tokens", QuantizedEmbedding(head))
            elif isinstance(embedding, Q4Weight | Q8Weight | LowBitWeight):
                model.model.register_module("embed_tokens", QuantizedEmbedding(embedding))
            del embedding
            table = weights.get(PER_LAYER_TABLE)
            if isinstance(table, Q4Weight | Q8Weight | LowBitWeight):
                model.model.register_module(PER_LAYER_TABLE.removeprefix("model."), QuantizedEmbedding(table))
    else:
        replace_linears(model, _int8_weight)
        if on_cpu:  # an MXFP4 checkpoint's banks as stored (`stored_mxfp4_banks`), each read as it is packed
            weights = {} if stored is None else stored
            for lookup in ("model.embed_tokens", PER_LAYER_TABLE):  # before the experts: its float copy let go
                _int8_table(model, lookup.removeprefix("model."))
            replace_experts(model, lambda name, bank: _bank_weights(weights.get(name)) or quantize_experts(bank))
    if on_cpu:
        replace_routers(model)
        # The file's weights as read, let go before their packed forms are gathered: some share storage with them
        weights.clear()  # (a 20B model's embeddings and attention: ~2 GB held twice)
        gather_packed_weights(model)  # before the decode stack takes references to the packed blocks
    # A bank of experts counts as one layer (`experts_<format>`); one left float (CUDA's, or not on groups of 32)
    # counts as `float`, as do the float linear layers and the routers.
    formats = Counter(
        module.format if isinstance(module, QuantizedLinear)
        else f"experts_{module.format}" if isinstance(module, QuantizedExperts)
        else "float"
        for module in model.modules()
        if isinstance(module, QuantizedLinear | nn.Linear | ParallelExperts | QuantizedExperts | RowwiseLinear)
    )  # fmt: skip
    model.model.decode_stack = build_decode_stack(model.model)
    if on_cpu:
        from ladle_kernels.cpu_ops import batch_invariant_cpu_ops  # the kernels are built: quantized layers need them

        model.ops = batch_invariant_cpu_ops()
    return {**formats, "decode_stack": int(model.model.decode_stack is not None)}


def _quantize_fp8(model: CausalLM, stored: Mapping[str, StoredWeight]) -> dict[str, int]:
    """`quantize_model` under `fp8`: each linear layer's FP8 weight from `stored` (`stored_fp8_weights`), else its
    float weight quantized per channel; the LM head and the routers stay float unless stored in FP8 (module doc);
    each bank of experts likewise (`layers.fp8_experts`). Returns layers per format (`fp8`, `fp8_block`, a bank as
    `experts_fp8` / `experts_fp8_block`, `float`)."""

    def weight_for(name: str, linear: nn.Linear) -> Fp8Weight | None:
        weight = stored.get(name)
        if isinstance(weight, Fp8Weight):
            return weight
        if name == "lm_head" or name.endswith(ROUTER_SUFFIXES):
            return None
        return quantize_fp8(linear.weight)

    def bank_for(name: str, bank: ParallelExperts) -> Fp8ExpertWeights:
        weights = stored.get(name)
        return weights if isinstance(weights, Fp8ExpertWeights) else quantize_fp8_experts(bank)

    replace_fp8_linears(model, weight_for)
    replace_fp8_experts(model, bank_for)
    modules = list(model.modules())
    inner = {id(m.dense) for m in modules if isinstance(m, Fp8Linear)}  # the CPU's dequantized copies
    return dict(Counter(
        module.format if isinstance(module, Fp8Linear)
        else f"experts_{module.format}" if isinstance(module, Fp8Experts)
        else "float"
        for module in modules
        if isinstance(module, Fp8Linear | nn.Linear | ParallelExperts | Fp8Experts) and id(module) not in inner
    ))  # fmt: skip


def _int8_table(model: CausalLM, name: str) -> None:
    """Under `int8` on the CPU, the decoder's lookup table `name` (the token embeddings, Gemma 4's per-layer table)
    looked up from 8-bit blocks (`QuantizedEmbedding`): a tied LM head's own packed ones for the token table (no
    second copy: the head is the table), else the table quantized per group of 32 (`quantize_q8`). Stays float when
    sharded, not on groups of 32, or tied to a head left float (the head holds the same tensor anyway)."""
    table = getattr(model.model, name, None)
    if not isinstance(table, VocabParallelEmbedding) or table.tp.size != 1 or table.weight.shape[1] % QUANT_GROUP:
        return
    quantized: QuantizedEmbedding | None = None
    if name == "embed_tokens" and model.config.tie_word_embeddings:
        head = getattr(model, "lm_head", None)
        if isinstance(head, QuantizedLinear) and head.format == "q8" and len(head.parts) == 1 and \
                (head.out_features, head.in_features) == tuple(table.weight.shape):  # fmt: skip
            quantized = QuantizedEmbedding(head)
    else:
        quantized = QuantizedEmbedding(quantize_q8(table.weight.detach()))
    if quantized is not None:
        model.model.register_module(name, quantized)


def _linear_weight(weight: StoredWeight | None) -> QuantizedWeight | None:
    not_a_linear = StoredBank | StoredMxfp4Bank | Fp8Weight | Fp8ExpertWeights
    return None if weight is None or isinstance(weight, not_a_linear) else weight


def _bank_weights(weight: StoredWeight | None) -> ExpertWeights | None:
    """A bank's weights (a `StoredBank` or `StoredMxfp4Bank`), read now; None for anything else."""
    return weight.read() if isinstance(weight, StoredBank | StoredMxfp4Bank) else None


def _mxfp4_source(source: ModelSource) -> bool:
    """Whether `source` is a checkpoint folder whose config declares MXFP4 weights (gpt-oss's released files)."""
    if source.random_weights or source.gguf_path is not None or not (source.path / "config.json").is_file():
        return False
    return is_mxfp4_checkpoint(read_hf_config(source.path))


def stored_mxfp4_banks(model: CausalLM, source: ModelSource) -> dict[str, StoredWeight]:
    """The banks of experts that `source`, an MXFP4 checkpoint, stores in MXFP4, by module name, unread
    (`StoredMxfp4Bank`: this rank's rows), for `int8` on the CPU to serve as stored. A bank whose rank's rows do not
    fall on groups of 32 is left out: it loads dequantized and stays float, as under `int8` any such bank does.
    Empty for any other source."""
    if not _mxfp4_source(source):
        return {}
    files = tensor_files(source.path)
    banks: dict[str, StoredWeight] = {}
    for name, module in model.named_modules():
        if not isinstance(module, ParallelExperts):
            continue
        rows = module.rows.rows
        tensors = mxfp4_bank_tensors(name)
        if rows.start % QUANT_GROUP == 0 and rows.stop % QUANT_GROUP == 0 and all(t in files for t in tensors):
            banks[name] = StoredMxfp4Bank(name, {t: files[t] for t in tensors}, rows)
    return banks


def _stored_weight(stored: dict[str, StoredMatrix], name: str, linear: nn.Linear, tied: bool) -> QuantizedWeight | None:
    """This rank's slice of layer `name`'s stored weight, read from the file: for a fused layer its checkpoint
    shards' rows, for a tied LM head the embedding's blocks. None (the layer stays float) when any part is not
    stored quantized, or when a row-parallel slice does not fall on groups of 32 columns.

    `linear` says the slice (parallel.layers): a column-parallel layer's rows of each part, a row-parallel one's
    input columns, the LM head's vocab rows (and zero rows for its padding); at size 1, all of it."""
    if isinstance(linear, ColumnParallelLinear) and len(linear.parts) > 1 and f"{name}.weight" in stored:
        return _stored_fused(stored[f"{name}.weight"], linear)
    if name == "lm_head" and tied:
        parts = ["model.embed_tokens"]
    else:
        fused = next((f for f, _, _ in FUSED_SHARDS if name.endswith(f".{f}")), None)
        prefix = name.removesuffix(fused) if fused else ""
        parts = [prefix + part for f, part, _ in FUSED_SHARDS if f == fused] if fused else [name]
        if isinstance(linear, ColumnParallelLinear) and len(linear.parts) < len(parts):
            parts = parts[: len(linear.parts)]  # its leading parts alone (a Gemma K/V-sharing layer's queries)
    matrices = [matrix for part in parts if (matrix := stored.get(f"{part}.weight")) is not None]
    if len(matrices) != len(parts):
        return None
    rows: list[range | None] = [None] * len(parts)
    columns: range | None = None
    padding = 0
    if isinstance(linear, ColumnParallelLinear):
        rows = [part.rows for part in linear.parts]
    elif isinstance(linear, RowParallelLinear):
        columns = linear.input_slice.rows
        if any(columns.start % m.block_elements or columns.stop % m.block_elements for m in matrices):
            return None
    elif isinstance(linear, ParallelLMHead):
        shard = linear.shard
        rows, padding = [range(shard.start, shard.valid_end)], shard.per_rank - shard.num_valid
    shards = [matrix.read(part_rows, columns) for matrix, part_rows in zip(matrices, rows, strict=True)]
    return pad_rows(concat_rows(shards), padding)


def _stored_experts(stored: dict[str, StoredMatrix], name: str, bank: ParallelExperts) -> StoredBank | None:
    """Bank `name`'s experts as the file stores them (`<name>.<e>.gate_proj.weight`, ...), to be read as this rank's
    slices (`StoredBank`). None (the bank stays float) when any expert's projection is not stored quantized or is
    stored in a type the experts' kernels do not take (`_EXPERT_KINDS`), when this rank's rows do not fall on the
    down projection's blocks (groups of 32 columns; super-blocks of 256 for a K-quant)."""
    rows = bank.rows.rows
    parts = EXPERT_PARTS if bank.gated else UNGATED_EXPERT_PARTS
    names = {part: [f"{name}.{e}.{part}_proj.weight" for e in range(bank.num_experts)] for part in parts}
    if rows.start % QUANT_GROUP or rows.stop % QUANT_GROUP or not all(n in stored for ns in names.values() for n in ns):
        return None
    if any(stored[n].kind not in _EXPERT_KINDS for ns in names.values() for n in ns):
        return None
    if any(rows.start % stored[n].block_elements or rows.stop % stored[n].block_elements for n in names["down"]):
        return None
    gate, up, down = (tuple(stored[n] for n in names.get(part, ())) for part in EXPERT_PARTS)
    return StoredBank(gate, up, down, rows)


# The types the experts' kernels take (ladle_kernels/cpu/moe.cpp): those of the dense quantized layers.
_EXPERT_KINDS = frozenset({
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.MXFP4, GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS,
    GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q2_K, GGMLQuantizationType.IQ3_XXS, GGMLQuantizationType.IQ3_S,
    GGMLQuantizationType.IQ2_XXS, GGMLQuantizationType.IQ2_XS, GGMLQuantizationType.IQ2_S, GGMLQuantizationType.IQ1_S,
    GGMLQuantizationType.IQ1_M,
})  # fmt: skip


def _stored_fused(matrix: StoredMatrix, linear: ColumnParallelLinear) -> QuantizedWeight:
    """This rank's rows of a fused layer the file stores fused (Phi-3's `attn_qkv`, its `ffn_up` holding gate and
    up): each part's kept rows, at the part's offset in the stored matrix."""
    shards, offset = [], 0
    for part in linear.parts:
        shards.append(matrix.read(range(offset + part.rows.start, offset + part.rows.stop)))
        offset += part.full
    return concat_rows(shards)


def _int8_weight(name: str, linear: nn.Linear) -> QuantizedWeight | None:
    if linear.in_features % QUANT_GROUP or name.endswith(ROUTER_SUFFIXES):
        return None
    return quantize_q8(linear.weight)
