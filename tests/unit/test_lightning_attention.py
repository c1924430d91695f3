"""MiniMax-01's lightning attention: the block form (the GPU's, transformers' prefill) equals the token-by-token
recurrence (the CPU's, transformers' decode) from any state, wherever the blocks fall; the decay rates are
transformers'."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine_server.config import Lightning
from engine_server.layers.lightning_attention import lightning_chunk, lightning_recurrence


@pytest.mark.parametrize(("tokens", "block"), [(1, 4), (7, 4), (16, 4), (13, 256), (9, 1)])
def test_blocks_equal_the_recurrence_from_any_state(tokens: int, block: int) -> None:
    generator = torch.Generator().manual_seed(tokens * 31 + block)
    q, k, v = (torch.randn(3, tokens, 8, generator=generator) for _ in range(3))
    state = torch.randn(3, 8, 8, generator=generator)
    slopes = torch.tensor([0.5, 0.05, 0.005])
    blocked, blocked_state = lightning_chunk(q, k, v, state, slopes, block)
    stepped, stepped_state = lightning_recurrence(q, k, v, state, slopes)
    torch.testing.assert_close(blocked, stepped, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(blocked_state, stepped_state, atol=1e-4, rtol=1e-5)
    # a chunk split anywhere continues from the state the first part left
    first, middle = lightning_recurrence(q[:, : tokens // 2], k[:, : tokens // 2], v[:, : tokens // 2], state, slopes)
    rest, end = lightning_recurrence(q[:, tokens // 2 :], k[:, tokens // 2 :], v[:, tokens // 2 :], middle, slopes)
    assert torch.equal(torch.cat((first, rest), dim=1), stepped) and torch.equal(end, stepped_state)


def test_the_decay_rates_are_transformers_and_split_by_head_over_ranks() -> None:
    config = transformers.MiniMaxConfig(num_hidden_layers=6, num_attention_heads=8, hidden_size=64)
    shape = Lightning(heads=8, head_dim=8, layers=(0, 1, 2, 3, 4, 5), total_layers=6)
    for layer in range(6):
        theirs = transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention(config, layer).slope_rate
        torch.testing.assert_close(torch.tensor(shape.slopes(layer)), theirs.flatten(), atol=0, rtol=1e-6)
        halves = [shape.sharded(2, rank).slopes(layer) for rank in (0, 1)]
        assert halves[0] + halves[1] == shape.slopes(layer)
    with pytest.raises(ValueError, match="divisible"):
        shape.sharded(3)
