"""Mixture-of-experts feed-forward block: a softmax router picks each token's experts, which run grouped by expert.

Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and gpt-oss share it (`ModelConfig` says which quirks apply): the router's
logits are the hidden state times its `[num_experts, hidden]` weight (plus a bias: gpt-oss), softmaxed in float32,
the top `num_experts_per_tok` kept (and renormalised to sum to 1 with `norm_topk_prob`, as Mixtral always does:
the softmax of the top-k logits that gpt-oss takes); each chosen expert is a SwiGLU MLP (gpt-oss: with biases and
its clamped SwiGLU, `ladle_kernels.reference.clamped_swiglu`; Nemotron-H's ungated, `down(relu(up(x))²)`, as is its
shared expert) whose output is scaled by its weight. Qwen2-MoE adds a shared
expert every token goes through, scaled by `sigmoid(x @ shared_expert_gate)`. Llama 4's router (`ModelConfig.
moe_input_scaled`) takes the top-k logits and scales each chosen expert's input by the sigmoid of its logit; its
shared expert has no gate. PhiMoE's router is its sparsemixer (`sparsemixer_route`). Under tensor parallelism every
expert's intermediate rows are split over the ranks (`parallel.layers.ParallelExperts`; the router and the shared
gate are whole on every rank), and the block all-reduces once, as a dense MLP does.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.config import ModelConfig
from engine_server.layers.mlp import GatedMLP, UngatedMLP, clamped_swiglu_args, relu_squared
from engine_server.layers.norm import RMSNorm
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import Activation, ParallelExperts
from ladle_kernels.kernel_set import KernelOps
from ladle_kernels.reference import clamped_swiglu


class GroupedTopkRouter(nn.Module):
    """DeepSeek-V3's, Mistral 4's and DeepSeek-V2's router: each expert's score, `sigmoid(x . w_e)` (DeepSeek-V3) or
    the softmax of the logits, in float32; the choice goes by score (+ `e_score_correction_bias`, DeepSeek-V3's
    learned bias that balances the load), within the `topk_groups` best of `groups` equal groups of experts (a group
    scored by the sum of its two best, or by its best with `group_max`: DeepSeek-V2); the chosen experts' weights
    are their scores (without the bias), renormalised to sum to 1 with `renormalize` (their sum plus `epsilon`), times
    `scaling` (transformers' `DeepseekV3TopkRouter`, `Mistral4TopkRouter`, `DeepseekV2TopkRouter`; LFM2-MoE's, whose
    epsilon is 1e-6, not 1e-20). With `choice_on_logits` (Kolibri-1's) the bias is added to the logits, not the
    scores, for the choice.

    `rowwise` (set on the quantized CPU path, `quantized_experts.replace_routers`): the logits and sigmoid scores
    through the C++ kernels whose bits depend on a row alone (`rowwise_linear`, `sigmoid_mul`), so that a token's
    experts and weights do not depend on its batch. A float GEMM's blocking changes with the number of rows, and
    torch's elementwise sigmoid takes a tensor's scalar tail another way than its vectors."""

    def __init__(
        self, hidden: int, experts: int, top_k: int, groups: int, topk_groups: int, renormalize: bool, scaling: float,
        sigmoid: bool = True, score_bias: bool = True, group_max: bool = False, epsilon: float = 1e-20,
        choice_on_logits: bool = False, sqrt_softplus: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden), requires_grad=False)  # float32, as trained
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(experts), requires_grad=False) if score_bias else None
        )
        self.top_k, self.groups, self.topk_groups = top_k, groups, topk_groups
        self.renormalize, self.scaling, self.sigmoid, self.group_max = renormalize, scaling, sigmoid, group_max
        self.epsilon, self.choice_on_logits, self.sqrt_softplus = epsilon, choice_on_logits, sqrt_softplus
        self.rowwise = False

    def scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, H]` -> (logits, scores) `[T, E]` float32: each expert's `sigmoid`, softmax or (DeepSeek-V4's)
        `sqrt(softplus)` of its logit."""
        if self.rowwise:
            logits = torch.ops.ladle_cpu.rowwise_linear(x.float().contiguous(), self.weight.float().contiguous())
            if self.sigmoid and not self.sqrt_softplus:
                return logits, torch.ops.ladle_cpu.sigmoid_mul(torch.ones_like(logits), logits)
        else:
            logits = F.linear(x.float(), self.weight.float())
        if self.sqrt_softplus:
            return logits, F.softplus(logits).sqrt()
        return logits, torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, H]` -> (weights `[T, k]` in x's dtype, expert ids `[T, k]`)."""
        logits, scores = self.scores(x)
        bias = self.e_score_correction_bias
        chooser = logits if self.choice_on_logits else scores
        biased = chooser if bias is None else chooser + bias.float()
        tokens, experts = biased.shape
        grouped = biased.view(tokens, self.groups, -1)
        group_scores = grouped.max(dim=-1).values if self.group_max else grouped.topk(2, dim=-1)[0].sum(dim=-1)
        chosen_groups = torch.topk(group_scores, k=self.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, chosen_groups, 1.0)
        allowed = group_mask.unsqueeze(-1).expand(tokens, self.groups, experts // self.groups).reshape(tokens, -1)
        # Outside the chosen groups: -inf (DeepSeek-V3) or 0 (V2, Mistral 4: their softmax scores are all above it).
        masked = biased.masked_fill(allowed == 0, float("-inf") if bias is not None else 0.0)
        chosen = torch.topk(masked, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.epsilon)
        return (weights * self.scaling).to(x.dtype), chosen


class HashRouter(GroupedTopkRouter):
    """DeepSeek-V4's first layers' router: each token's experts fixed by its id (`tid2eid` `[vocab, k]`, from the
    checkpoint), weighted by their scores as `GroupedTopkRouter` weighs its choice (transformers'
    `DeepseekV4HashRouter`). It has no score bias."""

    def __init__(self, hidden: int, experts: int, top_k: int, vocab: int, scaling: float, sqrt_softplus: bool) -> None:
        super().__init__(hidden, experts, top_k, 1, 1, True, scaling, score_bias=False, sqrt_softplus=sqrt_softplus)
        self.tid2eid = nn.Parameter(torch.zeros(vocab, top_k, dtype=torch.int64), requires_grad=False)

    def route_tokens(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, H]` and the tokens' ids `[T]` -> (weights `[T, k]` in x's dtype, expert ids `[T, k]`)."""
        _, scores = self.scores(x)
        chosen = self.tid2eid.index_select(0, token_ids)
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + self.epsilon)
        return (weights * self.scaling).to(x.dtype), chosen


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits `[T, E]` -> (weights `[T, k]` in the logits' dtype, expert ids `[T, k]`): the top-k of the
    softmax taken in float32, renormalised to sum to 1 if asked (transformers' Mixtral / Qwen-MoE routers)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def sparsemixer_route(logits: torch.Tensor, jitter: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's router as transformers' `sparsemixer` routes at inference: logits `[T, E]` -> (weights `[T, 2]` in
    the logits' dtype, expert ids `[T, 2]`), in float32. The first expert is the top logit `m`, weighted by the
    softmax at `m` over the logits `s` with `(m - s) / max(|s|, m) <= 2 * jitter` (the rest masked out); the second
    is the top of the others, weighted likewise among the others."""
    scores = logits.float()
    weights, experts = [], []
    for _ in range(2):
        top, index = scores.max(dim=-1, keepdim=True)
        far = (top - scores) / scores.abs().clamp(min=top) > 2 * jitter  # (nan, hence kept, for masked-out -inf)
        weights.append(torch.softmax(scores.masked_fill(far, float("-inf")), dim=-1).gather(-1, index))
        experts.append(index)
        scores = scores.scatter(-1, index, float("-inf"))
    return torch.cat(weights, dim=-1).to(logits.dtype), torch.cat(experts, dim=-1)


class SparseMoE(nn.Module):
    """`sum_j w_j * expert_j(x)` over each token's chosen experts (+ the gated shared expert), all-reduced (then
    RMS-normalised by `post_mlp_layernorm` with `ModelConfig.moe_output_norm`, A.X K1's; each expert's output
    normalised before its weight with `ModelConfig.expert_output_norms`, Ergo's: `_normed_experts`).

    Parameters are named as the Qwen-MoE checkpoints name them under `mlp.` (`gate` is the router; Mixtral's
    `block_sparse_moe.` names are mapped to these at load, `models.mixtral`)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE, hashed: bool = False
    ) -> None:
        """`hashed`: DeepSeek-V4's routing by token id (`HashRouter`; `forward` then takes the tokens' ids)."""
        super().__init__()
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.input_scaled = config.moe_input_scaled
        self.sparsemixer = config.moe_scoring == "sparsemixer" and not config.grouped_router
        self.router_jitter = config.router_jitter
        hidden, experts = config.hidden_size, config.num_experts
        # LongCat-Flash: the router also picks among experts that pass their input through (after the real ones)
        self.zero_experts, self.real_experts = config.zero_experts, config.num_experts
        self.gate: nn.Module = (
            GroupedTopkRouter(
                hidden, experts + self.zero_experts, self.top_k, config.moe_groups, config.moe_topk_groups,
                config.norm_topk_prob, config.routed_scaling_factor, sigmoid=config.moe_scoring == "sigmoid",
                score_bias=config.router_score_bias, group_max=config.moe_group_score == "max",
                epsilon=config.moe_renorm_epsilon, choice_on_logits=config.moe_choice_on_logits,
                sqrt_softplus=config.moe_scoring == "sqrtsoftplus",
            )
            if config.grouped_router and not hashed
            else HashRouter(hidden, experts, self.top_k, config.vocab_size, config.routed_scaling_factor,
                            config.moe_scoring == "sqrtsoftplus")
            if hashed
            else nn.Linear(hidden, experts, bias=config.expert_biases, dtype=dtype)
        )  # fmt: skip
        # gpt-oss's clamped SwiGLU (plain torch ops on every backend), Nemotron-H's relu² (ungated), else the kernel
        # set's SiLU-and-mul.
        swiglu = (
            (config.swiglu_alpha, config.swiglu_limit, config.swiglu_up_offset) if config.swiglu_limit > 0 else None
        )
        relu2 = config.hidden_act == "relu2"
        self.experts = ParallelExperts(
            experts, hidden, config.moe_intermediate_size, tp, dtype, biases=config.expert_biases, swiglu=swiglu,
            gated=not relu2,
        )  # fmt: skip
        self.activation: Activation | None = (
            relu_squared if relu2
            else None if swiglu is None
            else functools.partial(clamped_swiglu, alpha=swiglu[0], limit=swiglu[1], up_offset=swiglu[2])
        )  # fmt: skip
        shared = config.shared_expert_intermediate_size
        self.shared_expert: GatedMLP | UngatedMLP | None = None
        if shared:
            self.shared_expert = (
                UngatedMLP(hidden, shared, dtype, tp) if relu2 else GatedMLP(hidden, shared, dtype, tp,
                                                                             **clamped_swiglu_args(config))
            )
        gated = shared and config.shared_expert_gated
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype) if gated else None
        # A.X K1: the whole output normalised, once summed over the ranks
        self.post_mlp_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype) if config.moe_output_norm else None
        # JetMoE: a bias added to the experts' summed output (on every rank, after their sum)
        self.output_bias = (
            nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False) if config.moe_output_bias else None
        )
        # Ergo: each chosen expert's output normalised with that expert's weight (float32, as trained), the shared
        # expert's with a norm of its own
        self.norm_eps = config.rms_norm_eps
        self.expert_norms: nn.Parameter | None = None
        self.shared_expert_norm: RMSNorm | None = None
        if config.expert_output_norms:
            self.expert_norms = nn.Parameter(torch.ones(experts, hidden), requires_grad=False)
            self.shared_expert_norm = RMSNorm(hidden, config.rms_norm_eps, dtype) if shared else None

    def forward(self, x: torch.Tensor, ops: KernelOps, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`, the same on every rank; `token_ids` `[T]`: the tokens' ids, which a
        `HashRouter` routes by (ValueError without them there)."""
        activation = self.activation or ops.silu_and_mul
        if self.expert_norms is not None:
            return self._normed_experts(x, ops, activation)
        passed: torch.Tensor | None = None  # LongCat-Flash's zero-computation experts' share of each input
        if self.input_scaled:
            out = self._input_scaled_experts(x, ops, activation)
        else:
            if isinstance(self.gate, HashRouter):
                if token_ids is None:
                    raise ValueError("a hash-routed mixture of experts routes by token id: pass token_ids")
                weights, experts = self.gate.route_tokens(x, token_ids)
            elif isinstance(self.gate, GroupedTopkRouter):
                weights, experts = self.gate.route(x)
            elif self.sparsemixer:
                weights, experts = sparsemixer_route(self.gate(x), self.router_jitter)
            else:
                weights, experts = route(self.gate(x), self.top_k, self.renormalize)
            if self.zero_experts:
                weights, experts, passed = self._zero_experts(weights, experts)
            out = self.experts(x, weights, experts, activation)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # The gate scales this rank's partial sum: summed over the ranks, it scales the whole. Through the kernel
            # set's sigmoid_mul (row by row on the CPU): torch's sigmoid over the step's column of gates gives a row
            # other bits where it falls in the column's scalar tail, which depends on the batch.
            shared = self.shared_expert.partial(x, ops)
            out = out + ops.sigmoid_mul(shared, self.shared_expert_gate(x).expand_as(shared).contiguous())
        elif self.shared_expert is not None:  # DeepSeek's shared experts: no gate
            out = out + self.shared_expert.partial(x, ops)
        out = self.tp.all_reduce_sum(out)
        if self.output_bias is not None:
            out = out + self.output_bias
        if passed is not None:  # (whole on every rank: added once the experts' partial sums are)
            out = out + (x * passed).to(out.dtype)
        return out if self.post_mlp_layernorm is None else self.post_mlp_layernorm(out, ops)

    def _normed_experts(self, x: torch.Tensor, ops: KernelOps, activation: Activation) -> torch.Tensor:
        """Ergo's: `sum_j w_j * norm_j(expert_j(x)) + norm(shared(x))`, each (token, chosen expert) pair a row of its
        own run with weight 1, its output summed over the ranks before its expert's RMSNorm (in float32, rounded to
        x's dtype), the routing weights rounded to x's dtype too (transformers' `ErgoExperts`); whole on every
        rank."""
        assert isinstance(self.gate, GroupedTopkRouter), "Ergo's router is DeepSeek-V3's in one group"
        weights, experts = self.gate.route(x)
        tokens, k = experts.shape
        rows = x.repeat_interleave(k, dim=0)  # token t's k rows together, in the order of its experts
        ones = torch.ones(tokens * k, 1, dtype=x.dtype, device=x.device)
        routed = self.tp.all_reduce_sum(self.experts(rows, ones, experts.reshape(tokens * k, 1), activation))
        assert self.expert_norms is not None
        scales = self.expert_norms.float().index_select(0, experts.reshape(-1))
        normed = (F.rms_norm(routed.float(), (routed.shape[-1],), eps=self.norm_eps) * scales).to(x.dtype)
        weighted = normed.view(tokens, k, -1).float() * weights.to(x.dtype).float().unsqueeze(-1)
        out = weighted.sum(dim=1).to(x.dtype)
        if self.shared_expert is not None:
            shared = self.tp.all_reduce_sum(self.shared_expert.partial(x, ops))
            out = out + (shared if self.shared_expert_norm is None else self.shared_expert_norm(shared, ops))
        return out

    def _zero_experts(
        self, weights: torch.Tensor, experts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """LongCat-Flash's choice of zero-computation experts (ids past the real ones) taken out of `weights` and
        `experts` `[T, k]`: (the weights with theirs 0, the ids with theirs spread over the real experts, whose
        product then weighs nothing, as transformers spreads them; each token's summed weight of them `[T, 1]`, the
        share of its input they pass through)."""
        real = self.real_experts
        passing = experts >= real
        passed = weights.masked_fill(~passing, 0.0).sum(dim=-1, keepdim=True)
        spread = (experts - real) * real // self.zero_experts
        return weights.masked_fill(passing, 0.0), torch.where(passing, spread, experts), passed

    def _input_scaled_experts(self, x: torch.Tensor, ops: KernelOps, activation: Activation) -> torch.Tensor:
        """Llama 4's `sum_j expert_j(sigmoid(l_j) * x)` over the top-k logits `l_j` (transformers' `Llama4Router`):
        each (token, chosen expert) pair is a row of its own, the token scaled by its score through the kernel
        set's sigmoid_mul (row by row on the CPU, as the shared gate's above), run with weight 1."""
        logits, experts = torch.topk(self.gate(x), self.top_k, dim=-1)
        tokens, k = experts.shape
        rows = x.repeat_interleave(k, dim=0)  # token t's k rows together, in the order of its experts
        rows = ops.sigmoid_mul(rows, logits.reshape(tokens * k, 1).expand_as(rows).contiguous())
        ones = torch.ones(tokens * k, 1, dtype=x.dtype, device=x.device)
        out = self.experts(rows, ones, experts.reshape(tokens * k, 1), activation)
        return out.view(tokens, k, -1).sum(dim=1)
