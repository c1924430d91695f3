"""Mixture-of-experts feed-forward block: a softmax router picks each token's experts, which run grouped by expert.

Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and gpt-oss share it (`ModelConfig` says which quirks apply): the router's
logits are the hidden state times its `[num_experts, hidden]` weight (plus a bias: gpt-oss), softmaxed in float32,
the top `num_experts_per_tok` kept (and renormalised to sum to 1 with `norm_topk_prob`, as Mixtral always does:
the softmax of the top-k logits that gpt-oss takes); each chosen expert is a SwiGLU MLP (gpt-oss: with biases and
its clamped SwiGLU, `kernels.reference.clamped_swiglu`) whose output is scaled by its weight. Qwen2-MoE adds a shared
expert every token goes through, scaled by `sigmoid(x @ shared_expert_gate)`. Under tensor parallelism every
expert's intermediate rows are split over the ranks (`parallel.layers.ParallelExperts`; the router and the shared
gate are whole on every rank), and the block all-reduces once, as a dense MLP does.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.config import ModelConfig
from engine_server.layers.mlp import GatedMLP
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import Activation, ParallelExperts
from kernels.kernel_set import KernelOps
from kernels.reference import clamped_swiglu


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits `[T, E]` -> (weights `[T, k]` in the logits' dtype, expert ids `[T, k]`): the top-k of the
    softmax taken in float32, renormalised to sum to 1 if asked (transformers' Mixtral / Qwen-MoE routers)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


class SparseMoE(nn.Module):
    """`sum_j w_j * expert_j(x)` over each token's chosen experts (+ the gated shared expert), all-reduced.

    Parameters are named as the Qwen-MoE checkpoints name them under `mlp.` (`gate` is the router; Mixtral's
    `block_sparse_moe.` names are mapped to these at load, `models.mixtral`)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        hidden, experts = config.hidden_size, config.num_experts
        self.gate = nn.Linear(hidden, experts, bias=config.expert_biases, dtype=dtype)
        self.experts = ParallelExperts(
            experts, hidden, config.moe_intermediate_size, tp, dtype, biases=config.expert_biases
        )
        # gpt-oss's clamped SwiGLU (plain torch ops on every backend), else the kernel set's SiLU-and-mul.
        self.activation: Activation | None = (
            functools.partial(clamped_swiglu, alpha=config.swiglu_alpha, limit=config.swiglu_limit)
            if config.swiglu_limit > 0
            else None
        )
        shared = config.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(hidden, shared, dtype, tp) if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype) if shared else None

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`, the same on every rank."""
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, experts, self.activation or ops.silu_and_mul)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # The gate scales this rank's partial sum: summed over the ranks, it scales the whole.
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial(x, ops)
        return self.tp.all_reduce_sum(out)
