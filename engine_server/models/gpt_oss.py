"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with learned sinks, alternating windowed and full layers, YaRN
rope, and a mixture of experts with biases and a clamped SwiGLU."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator

import torch

from engine_server.loader.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, dequantize_mxfp4
from engine_server.models.base import CausalLM
from engine_server.parallel.layers import CheckpointTensor, read_whole

# The experts' tensors as gpt-oss checkpoints store them: `gate_up_proj` `[E, H, 2I]` whose columns alternate gate
# and up, its bias `[E, 2I]` likewise, `down_proj` `[E, I, H]`; or, in the released MXFP4 files, each projection
# as `<proj>_blocks` and `<proj>_scales` of `[E, out, in]` (gate/up rows alternating, `loader.mxfp4`).
_EXPERTS = re.compile(
    r"(?P<bank>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<kind>_bias|_blocks|_scales)?"
)


class GptOssForCausalLM(CausalLM):
    """gpt-oss: q/k/v/o with biases, a sink logit per query head (`ModelConfig.attention_sinks`), windows on the
    even layers (`layer_types`), YaRN rope; every layer's MLP is a mixture of experts whose router (`mlp.router`,
    read as `mlp.gate`) has a bias and takes the softmax of its top-k logits, and whose experts have biases and the
    clamped SwiGLU (`layers.moe`). The experts' checkpoint layouts are turned into the 3-D bank layout
    `CausalLM.load_weights` reads (`standard_experts`), MXFP4 ones dequantized to the model's dtype."""

    checkpoint_renames = ((".mlp.router.", ".mlp.gate."),)

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """`standard_experts(weights)`."""
        dtype = self.model.embed_tokens.weight.dtype
        return super().checkpoint_weights(standard_experts(weights, dtype, replaced), replaced)


def standard_experts(
    weights: Iterable[tuple[str, CheckpointTensor]], dtype: torch.dtype = torch.float32,
    replaced: Collection[str] = frozenset(),
) -> Iterator[tuple[str, CheckpointTensor]]:
    """gpt-oss's expert tensors in transformers 5's bank layout (`models.base`: `gate_up_proj` `[E, 2I, H]` with
    the gate rows first, `down_proj` `[E, H, I]`, biases `[E, 2I]` gate first and `[E, H]`); other tensors as they
    come. An MXFP4 projection's blocks and scales are paired (in either order) and dequantized to `dtype`, except
    in a bank named in `replaced` (served as stored: `quantization.stored_mxfp4_banks`), whose projections are never
    read: an empty `[E, 0, 0]` stands for each. ValueError for blocks or scales left without their other half."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        match = _EXPERTS.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        bank, proj, kind = match["bank"], match["proj"], match["kind"] or ""
        target = f"{bank}.{proj}"
        if kind in (BLOCKS_SUFFIX, SCALES_SUFFIX) and bank in replaced:
            if kind == BLOCKS_SUFFIX:  # counted as loaded, unread (`CausalLM.load_weights`)
                yield target, torch.empty(tensor.shape[0], 0, 0)
        elif kind in (BLOCKS_SUFFIX, SCALES_SUFFIX):
            pending[name] = read_whole(tensor)
            blocks, scales = pending.get(target + BLOCKS_SUFFIX), pending.get(target + SCALES_SUFFIX)
            if blocks is None or scales is None:
                continue
            del pending[target + BLOCKS_SUFFIX], pending[target + SCALES_SUFFIX]
            try:
                rows = torch.stack([dequantize_mxfp4(b, s, dtype) for b, s in zip(blocks, scales, strict=True)])
            except ValueError as error:
                raise ValueError(f"weight {target}: {error}") from None
            yield target, _gate_rows_first(rows) if proj == "gate_up_proj" else rows
        elif kind == "_bias":
            bias = read_whole(tensor)
            yield name, _gate_rows_first(bias) if proj == "gate_up_proj" else bias
        else:
            stored = read_whole(tensor)
            if stored.dim() != 3:
                raise ValueError(f"weight {name!r} has shape {tuple(stored.shape)}; expected [experts, in, out]")
            out_rows = stored.transpose(1, 2)
            yield name, _gate_rows_first(out_rows) if proj == "gate_up_proj" else out_rows
    if pending:
        raise ValueError(f"MXFP4 checkpoint: {sorted(pending)[:3]} without their blocks or scales")


def _gate_rows_first(interleaved: torch.Tensor) -> torch.Tensor:
    """`[E, 2I, ...]` whose rows alternate gate and up -> the gate rows, then the up rows."""
    return torch.cat((interleaved[:, 0::2], interleaved[:, 1::2]), dim=1)
