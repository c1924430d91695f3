"""llama.cpp's files of the Gated DeltaNet hybrids (`qwen35`, `qwen35moe`, `qwen3next`) back in checkpoint form.

llama.cpp's converter (its `Qwen3NextModel` and the Qwen3.5 models on top) changes their linear-attention tensors:

- names: `in_proj_qkv` is `attn_qkv`, `in_proj_z` `attn_gate`, `in_proj_b` / `in_proj_a` `ssm_beta` / `ssm_alpha`
  (Qwen3-Next's `in_proj_ba`, grouped by key head, `ssm_ba` as it is), `A_log` `ssm_a`, `dt_bias` `ssm_dt.bias`,
  `conv1d` `ssm_conv1d`, the gated norm `ssm_norm`, `out_proj` `ssm_out`; Qwen3-Next's `in_proj_qkvz`, grouped by
  key head, is split into `attn_qkv` (every head's q, then k, then v, as Qwen3.5 stores them) and `attn_gate` (z);
- values: `ssm_a` holds `-exp(A_log)`; the convolution is squeezed to `[channels, kernel]`; every norm but the gated
  one holds `1 + w` (`gguf_convert` takes the 1 back off);
- order, in Qwen3.5's files alone where value heads outnumber key heads: checkpoints group the value heads by the
  key head they read (`[k0: v0 v1, k1: v0 v1]`), llama.cpp's files tile them (`[v0 of k0, v0 of k1, v1 of k0, ...]`)
  in v's rows and convolution channels, z's rows, a's and b's rows, `A_log`, `dt_bias` and `out_proj`'s columns.

`CheckpointForm` turns the float tensors back (for the converted folder, which transformers loads as it would the
checkpoint); `stored_parts` gives the quantized matrices as the parts `GatedDeltaNet.in_proj` and `out_proj` load,
their rows and columns in checkpoint order (`gguf_quant.StoredMatrix` reads them so from the file's blocks).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

# The HF model_type of each hybrid file (`gguf_metadata`), and whether its value heads are tiled (module doc).
TILED_VALUE_HEADS = {"qwen3_5_text": True, "qwen3_5_moe_text": True, "qwen3_next": False}
# A hybrid's layer tensors by llama.cpp kind, beside the attention and MLP ones every family shares.
LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# Tensors llama.cpp names apart from the checkpoint's `<module>.weight` / `.bias` (`gguf_convert.hf_tensor_name`).
BARE_NAMES = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
_WRITE_AND_DECAY = {"ssm_beta": "in_proj_b", "ssm_alpha": "in_proj_a"}
# The checkpoint tensors `CheckpointForm.take` changes: by suffix, and by suffix within the linear attention.
_CHANGED = (".A_log", ".dt_bias", ".conv1d.weight", ".in_proj_b.weight", ".in_proj_a.weight", ".in_proj_qkv.weight",
            ".in_proj_z.weight")  # fmt: skip
_CHANGED_LINEAR = (".out_proj.weight",)


@dataclass(frozen=True)
class HybridShape:
    """The linear attention's heads as a hybrid's config gives them (`linear_*` keys), and its file's head order."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    tiled: bool

    @classmethod
    def from_config(cls, config: dict[str, object], model_type: str) -> HybridShape:
        """From a `config.json` dict of `model_type` (a key of TILED_VALUE_HEADS)."""
        key_heads, value_heads = int(str(config["linear_num_key_heads"])), int(str(config["linear_num_value_heads"]))
        return cls(key_heads, value_heads, int(str(config["linear_key_head_dim"])),
                   int(str(config["linear_value_head_dim"])),
                   TILED_VALUE_HEADS[model_type] and value_heads != key_heads)  # fmt: skip

    def value_order(self, width: int) -> np.ndarray:
        """The file's index of each checkpoint index over the value heads, `width` values a head: the identity unless
        tiled, else checkpoint `(key head k, its value head j, e)` is the file's `(j, k, e)`."""
        per_key = self.value_heads // self.key_heads
        count = self.value_heads * width
        if not self.tiled:
            return np.arange(count)
        return np.arange(count).reshape(per_key, self.key_heads, width).transpose(1, 0, 2).reshape(-1)


class CheckpointForm:
    """Turns a hybrid file's float tensors, fed in file order by checkpoint name (`gguf_convert`'s), back into the
    checkpoint's: `take` yields what each completes (Qwen3-Next's `in_proj_qkvz` once both of its halves are in)."""

    def __init__(self, shape: HybridShape, model_type: str) -> None:
        self.shape = shape
        self.grouped_qkvz = model_type == "qwen3_next"
        self._halves: dict[str, dict[str, np.ndarray]] = {}

    @staticmethod
    def changes(name: str) -> bool:
        """Whether `take` changes checkpoint tensor `name` (or holds it back); what it would yield unchanged needs
        no pass through it."""
        linear = ".linear_attn." in name
        return name.endswith(_CHANGED) or (linear and name.endswith(_CHANGED_LINEAR)) or (
            name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"))

    def holds_back(self, name: str) -> bool:
        """Whether `take` may hold `name` back for another tensor (Qwen3-Next's q/k/v and z, joined again): every
        other tensor it gives back at once, alone and under its own name."""
        return self.grouped_qkvz and name.endswith((".in_proj_qkv.weight", ".in_proj_z.weight"))

    def take(self, name: str, weight: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
        """The checkpoint tensors that `name`'s file values (`weight`, fp32) complete: itself changed back (module
        doc), both of Qwen3-Next's `in_proj_qkvz` halves once the second comes, or nothing yet."""
        shape = self.shape
        weight = np.asarray(weight, dtype=np.float32)
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            yield name, weight - np.float32(1.0)  # exact while 1 + w >= 0.5 (as Gemma's, `gguf_convert`)
        elif name.endswith(".A_log"):  # -exp(A_log) back to A_log; exp of it gives the file's value to an ulp
            yield name, self._values(np.log(-weight.astype(np.float64)).astype(np.float32), 1)
        elif name.endswith(".dt_bias"):
            yield name, self._values(weight, 1)
        elif name.endswith(".conv1d.weight"):
            qk = 2 * shape.key_heads * shape.key_dim
            channels = np.concatenate([weight[:qk], self._values(weight[qk:], shape.value_dim)])
            yield name, channels[:, None, :]
        elif name.endswith((".in_proj_b.weight", ".in_proj_a.weight")):
            yield name, self._values(weight, 1)
        elif name.endswith(".out_proj.weight") and ".linear_attn." in name:
            yield name, weight[:, shape.value_order(shape.value_dim)]
        elif name.endswith((".in_proj_qkv.weight", ".in_proj_z.weight")):
            if name.endswith("_qkv.weight"):
                qk = 2 * shape.key_heads * shape.key_dim
                weight = np.concatenate([weight[:qk], self._values(weight[qk:], shape.value_dim)])
            else:
                weight = self._values(weight, shape.value_dim)
            if not self.grouped_qkvz:
                yield name, weight
                return
            base, _, part = name.rpartition(".in_proj_")
            halves = self._halves.setdefault(base, {})
            halves[part] = weight
            if len(halves) == 2:
                del self._halves[base]
                yield f"{base}.in_proj_qkvz.weight", self._grouped(halves["qkv.weight"], halves["z.weight"])
        else:
            yield name, weight

    def finish(self) -> None:
        """ValueError when a layer's `attn_qkv` came without its `attn_gate` (or the reverse)."""
        if self._halves:
            raise ValueError(f"linear attention without both attn_qkv and attn_gate: {sorted(self._halves)}")

    def _values(self, weight: np.ndarray, width: int) -> np.ndarray:
        """`weight`'s leading axis (value heads of `width` rows) in checkpoint order."""
        return weight[self.shape.value_order(width)]

    def _grouped(self, qkv: np.ndarray, z: np.ndarray) -> np.ndarray:
        """Qwen3-Next's `in_proj_qkvz`: `[q, k, v, z]` of each key head in turn."""
        shape = self.shape
        key_rows = shape.key_heads * shape.key_dim
        per_key = shape.value_heads // shape.key_heads * shape.value_dim
        q, k, v = qkv[:key_rows], qkv[key_rows : 2 * key_rows], qkv[2 * key_rows :]
        parts = [q, k, v, z]
        widths = [shape.key_dim, shape.key_dim, per_key, per_key]
        heads = [p.reshape(shape.key_heads, w, -1) for p, w in zip(parts, widths, strict=True)]
        return np.concatenate(heads, axis=1).reshape(-1, qkv.shape[1])


@dataclass(frozen=True)
class StoredPart:
    """Where one of `GatedDeltaNet`'s checkpoint parts lies in a hybrid file's quantized matrix: its file rows in
    checkpoint order, and (for a tiled `out_proj`) its file columns in checkpoint order."""

    name: str
    rows: np.ndarray
    columns: np.ndarray | None = None


def stored_parts(kind: str, layer: str, rows: int, shape: HybridShape) -> list[StoredPart] | None:
    """The parts of a hybrid file's quantized matrix of llama.cpp kind `kind` (`attn_qkv`, `attn_gate`, `ssm_beta`,
    `ssm_alpha`, `ssm_ba`, `ssm_out`) in layer `layer` with `rows` rows, by checkpoint name (`in_proj_q`, ...,
    `out_proj`, under `linear_attn.`); None for another kind."""
    base = f"model.layers.{layer}.linear_attn"
    everything = np.arange(rows)
    if kind == "attn_qkv":
        key_rows = shape.key_heads * shape.key_dim
        v = 2 * key_rows + shape.value_order(shape.value_dim)
        return [StoredPart(f"{base}.in_proj_q.weight", everything[:key_rows]),
                StoredPart(f"{base}.in_proj_k.weight", everything[key_rows : 2 * key_rows]),
                StoredPart(f"{base}.in_proj_v.weight", v)]  # fmt: skip
    if kind == "attn_gate":
        return [StoredPart(f"{base}.in_proj_z.weight", shape.value_order(shape.value_dim))]
    if kind in _WRITE_AND_DECAY:
        return [StoredPart(f"{base}.{_WRITE_AND_DECAY[kind]}.weight", shape.value_order(1))]
    if kind == "ssm_ba":  # `[b, a]` of each key head, each of its value heads in turn
        per_key = shape.value_heads // shape.key_heads
        grouped = everything.reshape(shape.key_heads, 2, per_key)
        return [StoredPart(f"{base}.in_proj_b.weight", grouped[:, 0].reshape(-1)),
                StoredPart(f"{base}.in_proj_a.weight", grouped[:, 1].reshape(-1))]  # fmt: skip
    if kind == "ssm_out":
        columns = shape.value_order(shape.value_dim) if shape.tiled else None
        return [StoredPart(f"{base}.out_proj.weight", everything, columns)]
    return None
