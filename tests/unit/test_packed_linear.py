"""MKL packed-weight linears: same results as `F.linear` at every row count, and which layers get swapped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_server.layers.packed_linear import PackedLinear, pack_linear_layers, packing_supported

needs_mkl = pytest.mark.skipif(not packing_supported(), reason="this torch build has no MKL packed GEMM")


@needs_mkl
@pytest.mark.parametrize("keep_weight", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 65, 257, 2048])
def test_packed_linear_equals_f_linear_at_every_row_count(rows: int, bias: bool, keep_weight: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    linear = nn.Linear(576, 960, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(960, 576, generator=generator) / 24)
        x = torch.randn(rows, 576, generator=generator)
        packed = PackedLinear(linear, keep_weight=keep_weight)
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


@needs_mkl
def test_packed_linear_takes_any_leading_shape_and_strided_input() -> None:
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        packed = PackedLinear(linear, keep_weight=False)
        x = torch.randn(3, 5, 128)[..., ::2]  # [3, 5, 64], not contiguous
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
        assert packed(torch.randn(0, 64)).shape == (0, 48)


@needs_mkl
def test_pack_linear_layers_swaps_float32_linears_and_keeps_ties() -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.proj = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.embed.weight
            self.bf16 = nn.Linear(8, 8, dtype=torch.bfloat16)

    model = Tiny()
    x = torch.randn(4, 8)
    with torch.no_grad():
        before = model.head(model.proj(x))
        assert pack_linear_layers(model) == 2
        assert isinstance(model.proj[0], PackedLinear) and isinstance(model.head, PackedLinear)
        assert type(model.bf16) is nn.Linear  # another dtype stays as it is
        assert model.head.weight is model.embed.weight  # the tie survives
        untied = model.proj[0].weight
        assert untied.stride() == (0, 0) and untied.untyped_storage().nbytes() == 4  # the original is let go
        assert {name for name, _ in model.named_parameters()} == {"embed.weight", "proj.0.bias", "bf16.weight",
                                                                  "bf16.bias"}
        assert not {"head.packed_weight", "proj.0.weight"} & set(model.state_dict())  # derived, never saved
        torch.testing.assert_close(model.head(model.proj(x)), before, rtol=1e-5, atol=1e-5)
        assert pack_linear_layers(model) == 0  # already packed


def test_the_cpu_engine_packs_its_linears(tiny_runner_model: nn.Module) -> None:
    """On a torch with MKL every projection and the LM head run packed; elsewhere none do."""
    packed = [m for m in tiny_runner_model.modules() if isinstance(m, PackedLinear)]
    linears = [m for m in tiny_runner_model.modules() if type(m) is nn.Linear]
    if packing_supported():
        assert packed and not linears
    else:
        assert linears and not packed


@pytest.fixture
def tiny_runner_model() -> nn.Module:
    from tests.unit.runner_factories import tiny_engine_config, tiny_runner

    return tiny_runner(tiny_engine_config()).model
