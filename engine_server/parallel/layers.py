"""The sharded layers of tensor parallelism: each holds only this rank's slice of its weight.

Megatron's pairing: a `ColumnParallelLinear` (QKV, gate/up) keeps output rows and leaves its result sharded; the
`RowParallelLinear` after it (O, down) keeps the matching input columns and returns this rank's partial sum,
which the block then all-reduces (`TensorParallel.all_reduce_sum`), so a decoder layer costs two all-reduces.
The vocabulary is split by rows for the embedding (all-reduced inside it) and the LM head (whose local logits
`gather_vocab` brings to rank 0). A mixture of experts' bank (`ParallelExperts`) splits every expert's intermediate
rows the same way as a dense MLP's, so its block also costs one all-reduce.

The three projections are `nn.Linear`s holding the local slice, whose forward is the local matmul and nothing
else, so whatever swaps a model's linear layers (MKL packing, quantization) swaps these too without losing a
collective: the collectives live in the blocks (attention, MLP) and in `CausalLM.compute_logits`. At size 1 every
layer is the unsharded op on the full weight (bitwise what `nn.Linear` / `F.embedding` give).

Every layer is built in two ways: empty (the shapes of this rank's slice, for a model built on its device and
then loaded) and `from_full` (from the full tensor; tests, and loaders that read whole tensors). Its `load*`
methods take either the full tensor or exactly the slice this rank keeps, so a loader that reads only its own
bytes (sharding.py says which) can hand those in, or a `CheckpointTensor` that reads only what `narrow` asks for
(`loader.lazy_tensor.LazyTensor`), so a rank copies only its own bytes out of the file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, Self

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.parallel.group import TensorParallel
from engine_server.parallel.sharding import PartSlice, VocabShard, even_slice, gate_up_slices, qkv_slices, vocab_shard

# A SwiGLU activation: `[N, 2 * I]` (gate then up) -> `[N, I]` (`KernelOps.silu_and_mul`).
Activation = Callable[[torch.Tensor], torch.Tensor]


def _parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An inference-only parameter on the current default device (build layers inside `with torch.device(...)`)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class CheckpointTensor(Protocol):
    """A checkpoint tensor as loading takes it: a `torch.Tensor`, or one read only where it is narrowed
    (`loader.lazy_tensor.LazyTensor`), whose `narrow` then returns a new tensor of just those bytes."""

    @property
    def shape(self) -> torch.Size: ...

    def dim(self) -> int: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


def read_whole(tensor: CheckpointTensor) -> torch.Tensor:
    """`tensor` itself if it is a `torch.Tensor`, else all of it, read."""
    if isinstance(tensor, torch.Tensor):
        return tensor
    return tensor.narrow(0, 0, tensor.shape[0])


def _destination(weight: torch.Tensor, bias: torch.Tensor | None, tensor: CheckpointTensor, what: str) -> torch.Tensor:
    """Where a checkpoint tensor loads: a 2-D one into the weight, a 1-D one into the bias."""
    if tensor.dim() == 2:
        return weight.data
    if tensor.dim() == 1 and bias is not None:
        return bias.data
    raise ValueError(
        f"{what}: a {tensor.dim()}-D tensor is neither the weight nor a bias (the layer has bias: {bias is not None})"
    )


def _kept(full_or_kept: CheckpointTensor, full: int, rows: range, dim: int, what: str) -> torch.Tensor:
    """`full_or_kept` narrowed to `rows` along `dim` if it is the whole (`full` long), else all of it if it is the
    slice already (`len(rows)` long); ValueError otherwise. A lazy tensor is read only there."""
    length = full_or_kept.shape[dim]
    if length == full:
        return full_or_kept.narrow(dim, rows.start, len(rows))
    if length == len(rows):
        return read_whole(full_or_kept)
    raise ValueError(f"{what} has {length} along dim {dim}: expected the full {full} or this rank's {len(rows)}")


def _copy(dest: torch.Tensor, source: torch.Tensor, what: str) -> None:
    """`dest.copy_(source)`, refusing a shape that differs (copy_ would broadcast a smaller one)."""
    if tuple(source.shape) != tuple(dest.shape):
        raise ValueError(f"{what} has shape {tuple(source.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(source)


def copy_kept_rows(dest: torch.Tensor, tensor: CheckpointTensor, part: PartSlice, what: str) -> None:
    """Copy into `dest` the rows `part` keeps of `tensor`, given whole (`part.full` rows) or as exactly those rows;
    ValueError (naming `what`) on any other shape. A lazy tensor is read only there."""
    _copy(dest, _kept(tensor, part.full, part.rows, 0, what), what)


class _LocalLinear(nn.Linear):
    """An `nn.Linear` over this rank's `[out, in]` slice, built without initialising it (it is loaded next)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _parameter(out_features, in_features, dtype=dtype)
        self.register_parameter("bias", _parameter(out_features, dtype=dtype) if bias else None)


class ColumnParallelLinear(_LocalLinear):
    """`x @ W_r.T + b_r`: this rank's output rows of one or more fused parts; the result stays sharded.

    `parts` lists the parts laid out one after another in the full weight (one part for a plain layer; q, k, v for
    QKV; gate, up for gate/up) and the rows of each this rank keeps. The local weight is `cat` of the kept rows of
    each part in the same order, so the local output splits by `output_sizes` into `q_r, k_r, v_r` (or
    `gate_r, up_r`), exactly the layout `PagedSelfAttention` and `GatedMLP` read from their unsharded weights.
    """

    def __init__(
        self,
        in_features: int,
        parts: Sequence[PartSlice],
        bias: bool,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.parts = tuple(parts)
        self.output_sizes = tuple(len(part.rows) for part in self.parts)
        super().__init__(in_features, sum(self.output_sizes), bias, dtype)

    def load_part(self, index: int, tensor: CheckpointTensor) -> None:
        """Copy part `index`'s weight (2-D `[rows, in]`) or bias (1-D): the whole part or only the rows this rank keeps.

        One checkpoint tensor per call (`k_proj.weight` is part 1 of QKV, `up_proj.weight` part 1 of gate/up).
        """
        part = self.parts[index]
        what = f"part {index}"
        dest = _destination(self.weight, self.bias, tensor, what)
        copy_kept_rows(dest.narrow(0, sum(self.output_sizes[:index]), self.output_sizes[index]), tensor, part, what)

    @classmethod
    def from_full_fused(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, parts: Sequence[PartSlice]
    ) -> ColumnParallelLinear:
        """Build from the FULL fused weight `[sum(part.full), in]` (and bias), keeping each part's rows."""
        if sum(part.full for part in parts) != weight.shape[0]:
            sizes = [part.full for part in parts]
            raise ValueError(f"fused weight has {weight.shape[0]} rows, but the parts {sizes} sum to {sum(sizes)}")
        with torch.device(weight.device):
            layer = cls(weight.shape[1], parts, bias is not None, weight.dtype)
        offset = 0
        for index, part in enumerate(parts):
            layer.load_part(index, weight.narrow(0, offset, part.full))
            if bias is not None:
                layer.load_part(index, bias.narrow(0, offset, part.full))
            offset += part.full
        return layer

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel) -> ColumnParallelLinear:
        """A plain layer: the full `[out, in]` weight split evenly by rows."""
        return cls.from_full_fused(weight, bias, [even_slice(weight.shape[0], tp.size, tp.rank, "output features")])

    @classmethod
    def qkv_from_full(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        tp: TensorParallel,
    ) -> ColumnParallelLinear:
        """QKV from the full `cat(q, k, v)` weight: this rank's query heads and its (possibly replicated) KV heads."""
        return cls.from_full_fused(weight, bias, qkv_slices(num_heads, num_kv_heads, head_dim, tp.size, tp.rank))

    @classmethod
    def gate_up_from_full(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, intermediate_size: int, tp: TensorParallel
    ) -> ColumnParallelLinear:
        """gate/up from the full `cat(gate, up)` weight: the same block of intermediate rows of each."""
        return cls.from_full_fused(weight, bias, gate_up_slices(intermediate_size, tp.size, tp.rank))


class RowParallelLinear(_LocalLinear):
    """`x_r @ W_r.T (+ b on rank 0)`: this rank's input columns and its partial sum of the output.

    `x_r` is the sharded output of the column-parallel layer before it (attention heads, intermediate rows), which
    splits the input evenly and in rank order. The caller all-reduces the result (`TensorParallel.all_reduce_sum`)
    to get the full output on every rank. Only rank 0 holds the bias (`bias` None elsewhere), so the sum adds it
    once; the other ranks accept and drop a checkpoint's bias (`has_bias` says the model has one).
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, dtype: torch.dtype = torch.float32
    ) -> None:
        self.input_slice = even_slice(in_features, tp.size, tp.rank, "input features")
        self.has_bias = bias
        super().__init__(len(self.input_slice.rows), out_features, bias and tp.is_driver, dtype)

    def load(self, tensor: CheckpointTensor) -> None:
        """Copy the weight (2-D: the full `[out, in]`, or exactly this rank's columns) or the bias (1-D, whole)."""
        if tensor.dim() == 1 and self.has_bias and self.bias is None:
            return  # rank 0 adds the bias (and only it reads it)
        dest = _destination(self.weight, self.bias, tensor, "row-parallel layer")
        part = self.input_slice
        kept = _kept(tensor, part.full, part.rows, 1, "weight") if tensor.dim() == 2 else read_whole(tensor)
        _copy(dest, kept, "tensor")

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel) -> RowParallelLinear:
        with torch.device(weight.device):
            layer = cls(weight.shape[1], weight.shape[0], bias is not None, tp, weight.dtype)
        layer.load(weight)
        if bias is not None:
            layer.load(bias)
        return layer


EXPERT_PARTS = ("gate", "up", "down")
# An ungated expert's projections (Nemotron-H's: `ParallelExperts(gated=False)`).
UNGATED_EXPERT_PARTS = ("up", "down")
# The biases of each expert's projections, where a family has them (gpt-oss: `ParallelExperts(biases=True)`).
EXPERT_BIAS_PARTS = ("gate_bias", "up_bias", "down_bias")


class ParallelExperts(nn.Module):
    """A mixture of experts' SwiGLU weights as two 3-D tensors: `w13[e] = cat(gate_e, up_e)` rows `[2 * I_r, H]`
    and `w2[e] = down_e` `[H, I_r]`, where `I_r` are this rank's rows of each expert's intermediate size (all of
    them at size 1): every rank holds every expert's slice, like a `GatedMLP`'s gate/up and down, so the experts'
    output on a rank is its partial sum of the block's (the caller all-reduces). With `biases` (gpt-oss) each
    projection adds its bias: `b13[e]` (this rank's gate then up rows) and `b2[e]`, which only rank 0 holds (the
    others hold zeros, so the all-reduced sum adds it once). `gated_silu` says whether the caller's activation is
    SiLU-and-mul, or GELU's (Gemma 4's experts), `swiglu` (alpha, limit, up_offset) when it is a clamped SwiGLU
    (gpt-oss's, HY-V4's): the quantized expert kernel is told which (`layers.quantized_experts.QuantizedExperts`).
    Without `gated` (Nemotron-H's experts, `down(relu(up(x))²)`) `w13[e]` is `up_e` alone, `[I_r, H]`, and the
    caller's activation relu²."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallel,
        dtype: torch.dtype = torch.float32,
        biases: bool = False,
        gated_silu: bool = True,
        swiglu: tuple[float, float, float] | None = None,
        gated: bool = True,
    ) -> None:
        super().__init__()
        if biases and not gated:
            raise ValueError("ungated experts with biases are not built")
        self.num_experts = num_experts
        self.gated_silu = gated_silu
        self.swiglu = swiglu
        self.gated = gated
        self.rows = even_slice(intermediate_size, tp.size, tp.rank, "expert intermediate rows")
        self.adds_down_bias = tp.rank == 0
        local = len(self.rows.rows)
        self.w13 = _parameter(num_experts, (2 if gated else 1) * local, hidden_size, dtype=dtype)
        self.w2 = _parameter(num_experts, hidden_size, local, dtype=dtype)
        self.b13 = _parameter(num_experts, 2 * local, dtype=dtype) if biases else None
        self.b2 = _parameter(num_experts, hidden_size, dtype=dtype) if biases else None

    @property
    def parts(self) -> tuple[str, ...]:
        """What each expert is loaded as (`load_expert`'s parts): its projections, and their biases if it has them."""
        if not self.gated:
            return UNGATED_EXPERT_PARTS
        return EXPERT_PARTS + (EXPERT_BIAS_PARTS if self.b13 is not None else ())

    def load_expert(self, expert: int, part: str, tensor: CheckpointTensor) -> None:
        """Copy expert `expert`'s `part` ("gate", "up": `[I, H]`; "down": `[H, I]`; with biases "gate_bias",
        "up_bias": `[I]`, "down_bias": `[H]`), whole or as this rank's slice."""
        if not 0 <= expert < self.num_experts or part not in self.parts:
            raise ValueError(f"no expert {expert} {part!r} in a bank of {self.num_experts}")
        rows, local = self.rows, len(self.rows.rows)
        what = f"expert {expert} {part}"
        if part == "down":
            _copy(self.w2.data[expert], _kept(tensor, rows.full, rows.rows, 1, what), what)
        elif part == "down_bias" and self.b2 is not None:
            bias = read_whole(tensor)
            _copy(self.b2.data[expert], bias if self.adds_down_bias else torch.zeros_like(bias), what)
        else:
            bank = self.w13 if part in EXPERT_PARTS else self.b13
            assert bank is not None
            dest = bank.data[expert].narrow(0, 0 if part.startswith("gate") or not self.gated else local, local)
            _copy(dest, _kept(tensor, rows.full, rows.rows, 0, what), what)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, activation: Activation
    ) -> torch.Tensor:
        """x `[T, H]`, each token's routing `weights` and chosen `experts` `[T, k]` -> `sum_j weights[t, j] *
        expert_{experts[t, j]}(x[t])` `[T, H]` (this rank's partial sum under tensor parallelism).

        Tokens are grouped by expert: each expert that any token chose runs once over all of its tokens (one GEMM for
        gate/up, one for down), and adds its weighted output into theirs, experts in ascending order (as transformers
        sums them). `activation` maps the gate/up product `[M, 2I]` to `[M, I]` (the backend's `silu_and_mul`, or
        gpt-oss's clamped SwiGLU; ungated, the up product `[M, I]` to `[M, I]`). On CUDA the Triton fused-MoE kernel
        runs gated experts instead (`ladle_kernels.fused_moe`: the same sums, each token's choices added in choice
        order)."""
        if x.is_cuda and self.gated:
            from ladle_kernels.fused_moe import fused_moe  # Triton: imported only where there is a GPU

            return fused_moe(x, self.w13, self.w2, weights, experts, self.b13, self.b2, activation)
        b13, b2 = self.b13, self.b2
        return grouped_experts(
            x, weights, experts, self.num_experts,
            lambda e, rows: F.linear(rows, self.w13[e], None if b13 is None else b13[e]),
            lambda e, rows: F.linear(rows, self.w2[e], None if b2 is None else b2[e]),
            activation,
        )  # fmt: skip


# One expert's product: (expert, its rows `[M, K]`) -> `[M, N]`.
ExpertProduct = Callable[[int, torch.Tensor], torch.Tensor]


def grouped_experts(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, num_experts: int, gate_up: ExpertProduct,
    down: ExpertProduct, activation: Activation,
) -> torch.Tensor:  # fmt: skip
    """`sum_j weights[t, j] * down(e, activation(gate_up(e, x[t])))` for `e = experts[t, j]` -> `[T, H]` in x's
    dtype, tokens grouped by expert: each expert that any token chose runs once over all of its tokens' rows, and
    adds its weighted output into theirs, experts in ascending order (as transformers sums them)."""
    k = experts.shape[1]
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    token_of = order // k
    pair_weights = weights.flatten()[order].unsqueeze(-1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start : start + count]
        hidden = activation(gate_up(expert, x.index_select(0, rows)))
        out.index_add_(0, rows, down(expert, hidden) * pair_weights[start : start + count])
        start += count
    return out


class _VocabRows:
    """This rank's `shard.per_rank` rows of a `[vocab, hidden]` table; its padding rows are zero."""

    tp: TensorParallel
    shard: VocabShard
    weight: torch.Tensor

    def load(self, weight: CheckpointTensor) -> None:
        """Copy the full `[vocab, hidden]` table's rows this rank keeps (or exactly its `num_valid` real rows)."""
        shard = self.shard
        rows = range(shard.start, shard.valid_end)
        dest = self.weight.data[: shard.num_valid]
        _copy(dest, _kept(weight, shard.vocab_size, rows, 0, "vocab table"), "vocab table")

    @classmethod
    def from_full(cls, weight: torch.Tensor, tp: TensorParallel) -> Self:
        """This rank's rows of the full `[vocab, hidden]` table."""
        with torch.device(weight.device):
            layer = cls(weight.shape[0], weight.shape[1], tp, weight.dtype)  # type: ignore[call-arg]
        layer.load(weight)
        return layer


class VocabParallelEmbedding(_VocabRows, nn.Module):
    """`F.embedding` over this rank's vocab rows: ids outside them give zeros, then all ranks sum (all-reduce)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallel, dtype: torch.dtype = torch.float32
    ) -> None:
        nn.Module.__init__(self)
        self.tp = tp
        self.shard = vocab_shard(vocab_size, tp.size, tp.rank)
        self.weight = _parameter(self.shard.per_rank, hidden_size, dtype=dtype)
        self.weight.data[self.shard.num_valid :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids `[T]` -> `[T, hidden]`, the same on every rank."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        shard = self.shard
        mine = (input_ids >= shard.start) & (input_ids < shard.valid_end)
        local = F.embedding(torch.where(mine, input_ids - shard.start, 0), self.weight)
        return self.tp.all_reduce_sum(local.masked_fill_(~mine.unsqueeze(-1), 0))


class ParallelLMHead(_VocabRows, _LocalLinear):
    """`hidden @ W_r.T (+ b_r)` over this rank's vocab rows (padding rows give zero logits); `gather_vocab` of the
    result is the full `[N, vocab]` logits on rank 0. `bias`: one per vocab entry (PhiMoE's), this rank's part."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallel, dtype: torch.dtype = torch.float32,
        bias: bool = False,
    ) -> None:  # fmt: skip
        self.shard = vocab_shard(vocab_size, tp.size, tp.rank)
        _LocalLinear.__init__(self, hidden_size, self.shard.per_rank, bias, dtype)
        self.tp = tp
        self.weight.data[self.shard.num_valid :].zero_()
        if self.bias is not None:
            self.bias.data.zero_()

    def load_bias(self, bias: CheckpointTensor) -> None:
        """Copy the full `[vocab]` bias's entries this rank keeps (or exactly its `num_valid` real ones); ValueError
        for a head built without one."""
        if self.bias is None:
            raise ValueError("the LM head has no bias (the config sets no lm_head_bias)")
        shard = self.shard
        rows = range(shard.start, shard.valid_end)
        _copy(self.bias.data[: shard.num_valid], _kept(bias, shard.vocab_size, rows, 0, "LM head bias"), "LM head bias")

    @classmethod
    def tied_to(cls, embedding: VocabParallelEmbedding) -> ParallelLMHead:
        """A head sharing `embedding`'s weight (tied word embeddings): the vocab partition is the same."""
        with torch.device("meta"):  # its own weight is replaced at once
            head = cls(embedding.shard.vocab_size, embedding.weight.shape[1], embedding.tp, embedding.weight.dtype)
        head.weight = embedding.weight
        return head


def gather_vocab(local: torch.Tensor, shard: VocabShard, tp: TensorParallel) -> torch.Tensor | None:
    """Every rank's local logits `[N, per_rank]` (an LM head's output) -> `[N, vocab]` on rank 0, in vocab order with
    the padding dropped (contiguous); None on the other ranks. At size 1, `local` itself."""
    if tp.size == 1:
        return local
    logits = tp.gather_last_dim(local)
    return None if logits is None else logits[..., : shard.vocab_size].contiguous()
