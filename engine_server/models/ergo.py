"""Ergo (Amazon's): Gemma's sandwich blocks with gated residual adds, grouped-query attention (windowed with rope over
interleaved pairs, full without), relu² experts each normalised beside a normalised shared one."""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Iterator

from engine_server.models.base import CausalLM, reordered_tensor
from engine_server.parallel.layers import CheckpointTensor, read_whole
from ladle_kernels.reference import unpermute_rope_rows

_QKV = re.compile(r"(?P<attention>.+\.self_attn)\.qkv_proj\.weight")
_QK_NORM = re.compile(r".+\.self_attn\.[qk]_norm\.weight")
# Its experts' banks as transformers holds them transposed: up `[E, H, I]`, down `[E, I, H]`.
_TRANSPOSED_BANK = re.compile(r".+\.mlp\.experts\.(?:up_proj|down_proj)")
# Its released checkpoints' names (transformers saves them so too) and transformers' own, in the order replaced.
_RELEASED = tuple((re.compile(theirs), ours) for theirs, ours in (
    (r"^tok_embeddings\.", "model.embed_tokens."), (r"^norm\.", "model.norm."), (r"^output\.", "lm_head."),
    (r"^layers\.", "model.layers."), (r"\.attention_norm\.", ".input_layernorm."),
    (r"\.post_attention_norm\.", ".post_attention_layernorm."), (r"\.ffn_norm\.", ".pre_feedforward_layernorm."),
    (r"\.post_ffn_norm\.", ".post_feedforward_layernorm."),
    (r"\.post_attention_residual\.scale$", ".attention_residual_gate.weight"),
    (r"\.post_ffn_residual\.scale$", ".feedforward_residual_gate.weight"),
    (r"\.attention\.wqkv\.", ".self_attn.qkv_proj."), (r"\.attention\.wo\.", ".self_attn.o_proj."),
    (r"\.attention\.([qk]_norm)\.", r".self_attn.\1."), (r"\.feed_forward\.up\.", ".mlp.up_proj."),
    (r"\.feed_forward\.down\.", ".mlp.down_proj."), (r"\.feed_forward\.gate_kernel$", ".mlp.gate.linear.weight"),
    (r"\.feed_forward\.router_bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.feed_forward\.(up|down)_proj$", r".mlp.experts.\1_proj"),
    (r"\.feed_forward\.expert_output_norm\.scale$", ".mlp.experts.post_expert_norm.weight"),
    (r"\.feed_forward\.shared_(up|down)_proj$", r".mlp.shared_experts.\1_proj.weight"),
    (r"\.feed_forward\.shared_expert_output_norm\.scale$", ".mlp.shared_experts.norm.weight"),
))  # fmt: skip
# The released tensors stored `[in, out]`: the router's kernel and the shared expert's projections.
_RELEASED_TRANSPOSED = re.compile(r".+\.feed_forward\.(?:gate_kernel|shared_up_proj|shared_down_proj)")


class ErgoForCausalLM(CausalLM):
    """Ergo (`ergo`), read from its released names (`_RELEASED`, as transformers saves it too) or transformers'
    in-memory ones: its fused `qkv_proj` split into q, k and v, each head's q and k
    rows (and the q/k norms' weights) from interleaved rope pairs into halves order (the order rope turns here; the
    same on both sides leaves each score unchanged); its experts' transposed banks turned, each expert's output norm
    (`experts.post_expert_norm`) and the shared expert's (`shared_experts.norm`) on the MoE block, its router's
    projection (`gate.linear`) as the router's weight."""

    checkpoint_renames = (
        (".mlp.gate.linear.", ".mlp.gate."),
        (".mlp.experts.post_expert_norm.weight", ".mlp.expert_norms"),
        (".mlp.shared_experts.norm.", ".mlp.shared_expert_norm."),
        (".mlp.shared_experts.", ".mlp.shared_expert."),
    )

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        return self._read(weights)

    def _read(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        config = self.config
        head_dim, heads, kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        halves = functools.partial(unpermute_rope_rows, rotary_dim=config.rotary_dim)
        for name, tensor in _transformers_names(weights):
            qkv = _QKV.fullmatch(name)
            if qkv is not None:
                whole = read_whole(tensor)
                q, k, v = whole.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
                yield f"{qkv['attention']}.q_proj.weight", halves(q, n_head=heads).contiguous()
                yield f"{qkv['attention']}.k_proj.weight", halves(k, n_head=kv_heads).contiguous()
                yield f"{qkv['attention']}.v_proj.weight", v.contiguous()
            elif _QK_NORM.fullmatch(name):
                yield name, reordered_tensor(tensor, lambda weight: halves(weight, n_head=1))
            elif _TRANSPOSED_BANK.fullmatch(name):
                yield name, reordered_tensor(tensor, lambda bank: bank.transpose(1, 2).contiguous(), transposed=True)
            else:
                yield name, tensor


def _transformers_names(weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
    """Ergo's tensors under transformers' names: its released ones renamed (`_RELEASED`), those stored `[in, out]`
    transposed; transformers' own as they come."""
    for name, tensor in weights:
        if _RELEASED_TRANSPOSED.fullmatch(name):
            tensor = reordered_tensor(tensor, lambda weight: weight.t().contiguous(), transposed=True)
        for theirs, ours in _RELEASED:
            name = theirs.sub(ours, name)
        yield name, tensor
