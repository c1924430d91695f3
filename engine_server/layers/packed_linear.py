"""MKL packed-weight GEMMs for the CPU float32 path.

`torch.nn.Linear` on the CPU calls MKL's `sgemm`, which re-packs the weight into its blocked layout on every
call. For the decode batches an engine runs (a few to a few hundred rows against 0.3-50k output features) that
re-packing is a large share of the GEMM: MKL's `cblas_sgemm_compute` on a weight packed once is about 1.3x
faster there (64 rows x 576 -> 3072: ~300 vs ~230 GFLOP/s on this project's 2-core Xeon). `pack_linear_layers`
swaps every `nn.Linear` of a loaded model for a `PackedLinear` that does exactly that, through torch's own
`mkl::_mkl_linear` op (the one Inductor's freezing pass emits).

The packed copy is MKL's and MKL packs the B matrix independently of the row count M, so one packed weight
serves every batch size. torch's op only takes the packed path when told M equals the batch size it was packed
for, so `PackedLinear` passes the actual M. `packing_supported` checks all of this on a probe at start-up and
the model is left as it is when any of it does not hold (no MKL, another dtype, a result that differs).
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

# The batch size MKL is told the weight is packed for. The layout does not depend on it (see the module doc),
# and `packing_supported` checks other sizes against it.
_PACK_HINT = 64
# Row counts the start-up probe compares with `F.linear`: decode-sized, odd, and prefill-sized.
_PROBE_ROWS = (1, 7, 64, 300)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    packed: torch.Tensor = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), _PACK_HINT)
    return packed


class PackedLinear(nn.Module):
    """`F.linear(x, weight, bias)` through MKL's `sgemm_compute` on a copy of `weight` packed once.

    With `keep_weight` (for a weight something else uses too, such as a tied embedding) `weight` stays the
    shared parameter and the packed copy costs as much memory again. Without it the original is let go: MKL
    reads only the packed copy, and torch's op, which still takes the original for its shape and dtype, gets a
    zero-stride view (`weight` is then that view, a non-persistent buffer, so the layer holds no parameter).
    Results equal `F.linear`'s up to float32 rounding: MKL blocks the sums differently from one code path to
    another, as plain `F.linear` already does between row counts. The weights cannot change after construction.
    """

    weight: torch.Tensor

    def __init__(self, linear: nn.Linear, keep_weight: bool = True) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("packed_weight", _pack(linear.weight), persistent=False)
        if keep_weight:
            self.weight = linear.weight
        else:
            placeholder = linear.weight.new_empty(()).expand(linear.out_features, linear.in_features)
            self.register_buffer("weight", placeholder, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows == 0:
            return F.linear(x, self.weight, self.bias)
        out: torch.Tensor = torch.ops.mkl._mkl_linear(
            x.contiguous(), self.get_buffer("packed_weight"), self.weight, self.bias, rows
        )
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@functools.cache
def packing_supported() -> bool:
    """Whether this torch build packs float32 weights with MKL and the packed op matches `F.linear` at every
    probed row count (to 1e-4 relative). Checked once per process."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        linear = nn.Linear(96, 80, bias=True)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(80, 96, generator=generator))
            linear.bias.copy_(torch.randn(80, generator=generator))
            packed = PackedLinear(linear, keep_weight=False)
            for rows in _PROBE_ROWS:
                x = torch.randn(rows, 96, generator=generator)
                expected = F.linear(x, linear.weight, linear.bias)
                if not torch.allclose(packed(x), expected, rtol=1e-4, atol=1e-4):
                    return False
    except (RuntimeError, AttributeError, NotImplementedError):  # no mkl ops in this build
        return False
    return True


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every float32 CPU `nn.Linear` inside `model` with a `PackedLinear`; returns how many.

    A weight no other module holds is dropped for its packed copy (so packing costs no memory); a shared one
    (a tied LM head) is kept. Call once the weights are loaded: the packed layers' weights can no longer be
    loaded or changed. Does nothing (returns 0) where `packing_supported()` is False.
    """
    if not packing_supported():
        return 0
    holders = Counter(id(p) for module in model.modules() for p in module._parameters.values() if p is not None)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, keep_weight=holders[id(child.weight)] > 1))
    return len(targets)
