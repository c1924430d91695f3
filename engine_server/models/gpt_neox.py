"""The GPT-NeoX lineage (GPT-2, GPT-BigCode, GPT-NeoX and Pythia, Falcon, Phi-1/1.5/2, StableLM, StarCoder2,
Nemotron-4, OPT, GPT-Neo, Persimmon, XGLM, BioGPT, BLOOM, MPT): LayerNorms with biases, biased projections, rope
over a leading share of each head (or learned positions, or ALiBi), GELU (relu², ReLU) MLPs without a gate, parallel
blocks."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Collection, Iterable, Iterator

import torch

from engine_server.models.base import CausalLM, reordered_tensor
from engine_server.parallel.layers import CheckpointTensor, read_whole
from ladle_kernels.reference import grouped_qkv_rows

# GPT-NeoX's and Falcon's q/k/v in one projection, grouped by KV head (`ladle_kernels.reference.grouped_qkv_rows`).
_GROUPED_QKV = re.compile(
    r"(?:gpt_neox\.layers|transformer\.h|model\.layers)\.(?P<layer>\d+)\.(?:attention|self_attention|self_attn)"
    r"\.query_key_value\."
    r"(?P<kind>weight|bias)"
)
# GPT-2's and GPT-BigCode's q/k/v in one projection (`c_attn`): GPT-2's `cat(q, k, v)` of a Conv1D (`[in, out]`),
# GPT-BigCode's grouped by KV head (one KV head under `multi_query`: `cat(q, k, v)` too).
_C_ATTN = re.compile(r".+\.attn\.c_attn\.(?:weight|bias)")
# GPT-2's Conv1D weights, `[in, out]`: each read transposed.
_CONV1D = re.compile(r".+\.(?:attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight")
# The first GPT-2 checkpoints' names, without `transformer.`; their attention's causal-mask buffers.
_BARE_GPT2 = ("h.", "wte.", "wpe.", "ln_f.", "tokens_embed.", "positions_embed.")  # (GPT-1's last two)
_BARE_BLOOM = ("h.", "word_embeddings.", "word_embeddings_layernorm.", "ln_f.")
MASK_BUFFERS = (".attention.bias", ".attention.masked_bias", ".attn.bias", ".attn.masked_bias")
# OPT's learned positions: row `p + 2` is position p's (its `OPTLearnedPositionalEmbedding` offset).
_OPT_POSITIONS = ("model.decoder.embed_positions.weight", "biogpt.embed_positions.weight")  # (BioGPT's too)
_OPT_POSITION_OFFSET = 2
# StableLM 2's q/k LayerNorms, one module per head.
_HEAD_NORM = re.compile(r"(?P<attention>.+\.self_attn)\.(?P<part>q|k)_layernorm\.norms\.(?P<head>\d+)\.weight")


class GPTNeoXForCausalLM(CausalLM):
    """The GPT-NeoX lineage (`model_type` gpt2, gpt_bigcode, gpt_neox, falcon, phi, stablelm, starcoder2,
    nemotron, opt, gpt_neo, persimmon, xglm, biogpt, bloom, mpt): their quirks are `ModelConfig` fields the shared
    layers read (`hf_classic.classic_fields`: `layer_norm_bias`, `gated_mlp`, `parallel_block`, `parallel_mlp_norm`,
    `qk_layer_norm`, `norm_offset`, `lm_head_bias`, `absolute_positions`, `alibi`); their checkpoints' names are read as
    Llama's (`checkpoint_renames`), GPT-NeoX's, Falcon's, Persimmon's and GPT-BigCode's fused q/k/v rows (grouped by
    KV head) as `cat(q, k, v)`, GPT-2's Conv1D weights transposed and StableLM 2's per-head q/k LayerNorms as one
    `[heads, head_dim]` weight each (`checkpoint_weights`)."""

    checkpoint_renames = (
        ("gpt_neox.embed_in.", "model.embed_tokens."),
        ("gpt_neox.layers.", "model.layers."),
        ("gpt_neox.final_layer_norm.", "model.norm."),
        ("transformer.word_embeddings_layernorm.", "model.embed_layernorm."),  # BLOOM's
        ("transformer.word_embeddings.", "model.embed_tokens."),  # Falcon's
        ("transformer.h.", "model.layers."),
        ("transformer.ln_f.", "model.norm."),
        ("transformer.wte.", "model.embed_tokens."),  # GPT-2's and GPT-BigCode's
        ("transformer.wpe.", "model.embed_positions."),
        ("transformer.tokens_embed.", "model.embed_tokens."),  # GPT-1's
        ("transformer.positions_embed.", "model.embed_positions."),
        ("model.decoder.project_in.", "model.project_in."),  # OPT-350M's
        ("model.decoder.project_out.", "model.project_out."),
        (".ln_1.", ".input_layernorm."),
        (".ln_2.", ".post_attention_layernorm."),
        (".attn.c_attn.", ".self_attn.qkv_proj."),
        (".attn.c_proj.", ".self_attn.o_proj."),
        (".self_attention.query_key_value.", ".self_attn.qkv_proj."),
        (".self_attention.dense.", ".self_attn.o_proj."),
        (".ln_attn.", ".input_layernorm."),  # Falcon 40B's and 180B's two norms
        (".ln_mlp.", ".post_attention_layernorm."),
        ("model.final_layernorm.", "model.norm."),  # Phi's
        (".self_attn.q_layernorm.", ".self_attn.q_norm."),  # Persimmon's, one for every head
        (".self_attn.k_layernorm.", ".self_attn.k_norm."),
        (".attention.query_key_value.", ".self_attn.qkv_proj."),  # a GGUF file's blocks, rows as `cat(q, k, v)`
        (".attention.dense.", ".self_attn.o_proj."),
        (".self_attn.dense.", ".self_attn.o_proj."),  # Phi's
        (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
        (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
        (".mlp.fc1.", ".mlp.up_proj."),  # Phi's
        (".mlp.fc2.", ".mlp.down_proj."),
        (".mlp.c_fc.", ".mlp.up_proj."),  # StarCoder2's
        (".mlp.c_proj.", ".mlp.down_proj."),
        ("model.decoder.embed_tokens.", "model.embed_tokens."),  # OPT's
        ("model.decoder.embed_positions.", "model.embed_positions."),
        ("model.decoder.final_layer_norm.", "model.norm."),
        ("model.decoder.layers.", "model.layers."),
        (".self_attn_layer_norm.", ".input_layernorm."),
        (".final_layer_norm.", ".post_attention_layernorm."),
        (".self_attn.out_proj.", ".self_attn.o_proj."),
        (".fc1.", ".mlp.up_proj."),
        (".fc2.", ".mlp.down_proj."),
        (".attn.attention.out_proj.", ".self_attn.o_proj."),  # GPT-Neo's
        (".attn.attention.", ".self_attn."),
        ("biogpt.", "model."),  # BioGPT's, its LM head `output_projection`
        ("model.layer_norm.", "model.norm."),  # XGLM's and BioGPT's final norm
        ("output_projection.", "lm_head."),
        ("transformer.blocks.", "model.layers."),  # MPT's
        ("transformer.norm_f.", "model.norm."),
        (".norm_1.", ".input_layernorm."),
        (".norm_2.", ".post_attention_layernorm."),
        (".attn.Wqkv.", ".self_attn.qkv_proj."),
        (".attn.out_proj.", ".self_attn.o_proj."),
        (".ffn.up_proj.", ".mlp.up_proj."),
        (".ffn.down_proj.", ".mlp.down_proj."),
    )

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """GPT-NeoX's and Falcon's `query_key_value` as `qkv_proj` rows `cat(q, k, v)` (GPT-BigCode's `c_attn` too);
        GPT-2's Conv1D weights transposed; StableLM 2's q/k norms joined per layer; the earliest GPT-NeoX and GPT-2
        checkpoints' causal-mask buffers, bare names (GPT-2's without `transformer.`, OPT's without `model.`) and
        `embed_out` (GPT-NeoX's LM head's old name) as transformers reads them; OPT's learned positions from position
        0's row on (`_OPT_POSITION_OFFSET` rows before it)."""
        config = self.config
        grouped = functools.partial(
            grouped_qkv_rows, n_head=config.num_attention_heads, n_kv_head=config.num_key_value_heads
        )
        if config.sinusoidal_positions:  # XGLM's: not in its checkpoints (a buffer), computed here
            table = sinusoidal_positions(config.max_position_embeddings, config.hidden_size)
            yield "model.embed_positions.weight", table
        for name, tensor in self._joined_head_norms(weights):
            if name.endswith(MASK_BUFFERS):
                continue
            if name.startswith("embed_out."):
                name = "lm_head." + name.removeprefix("embed_out.")
            if config.absolute_positions and name.startswith(_BARE_GPT2):
                name = "transformer." + name
            if config.alibi and name.startswith(_BARE_BLOOM):  # BLOOM's checkpoints without `transformer.`
                name = "transformer." + name
            if name.startswith("decoder."):  # OPT's first checkpoints, without `model.`
                name = "model." + name
            if name in _OPT_POSITIONS:  # its rows from position 0 on (the first two are never looked up)
                tensor = tensor.narrow(0, _OPT_POSITION_OFFSET, tensor.shape[0] - _OPT_POSITION_OFFSET)
            if config.transposed_weights and _CONV1D.fullmatch(name):
                tensor = reordered_tensor(tensor, lambda whole: whole.t().contiguous(), transposed=True)
            if _C_ATTN.fullmatch(name) and not config.transposed_weights:  # GPT-BigCode's, grouped by KV head
                yield name, reordered_tensor(tensor, grouped)
                continue
            match = _GROUPED_QKV.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            yield f"model.layers.{match['layer']}.self_attn.qkv_proj.{match['kind']}", reordered_tensor(tensor, grouped)

    def _joined_head_norms(
        self, weights: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        """`weights` with each layer's per-head q (and k) LayerNorm weights yielded as one `q_norm.weight` (`k_norm`)
        of `[heads, head_dim]` once every head's is read; ValueError for a layer missing some."""
        held: dict[str, dict[int, torch.Tensor]] = {}
        counts = {"q": self.config.num_attention_heads, "k": self.config.num_key_value_heads}
        for name, tensor in weights:
            match = _HEAD_NORM.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            key = f"{match['attention']}.{match['part']}_norm.weight"
            heads = held.setdefault(key, {})
            heads[int(match["head"])] = read_whole(tensor)
            if len(heads) == counts[match["part"]]:
                del held[key]
                yield key, torch.stack([heads[head] for head in range(len(heads))])
        if held:
            raise ValueError(f"checkpoint holds some heads' q/k LayerNorms alone: {sorted(held)}")


def sinusoidal_positions(positions: int, width: int) -> torch.Tensor:
    """fairseq's sinusoidal position table as XGLM computes it (`XGLMSinusoidalPositionalEmbedding`), the rows of
    positions 0 to `positions - 1` (its table's from its offset 2 on): `[sin(p f_i), cos(p f_i)]`, `f_i = 10000 ^
    (-i / (width / 2 - 1))`, position p at row p + 2 of its table (a zero column last for an odd width)."""
    half = width // 2
    rate = math.log(10000) / (half - 1)
    frequencies = torch.exp(torch.arange(half, dtype=torch.int64).float() * -rate)
    angles = torch.arange(positions + _OPT_POSITION_OFFSET, dtype=torch.int64).float()[:, None] * frequencies[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if width % 2:
        table = torch.cat([table, torch.zeros(table.shape[0], 1)], dim=1)
    return table[_OPT_POSITION_OFFSET:].contiguous()
