"""The Triton kernel set: `TRITON_OPS` for the model layers, plus the sampler's grammar bitmask op.

Importing this module needs triton (Linux). It decorates the kernels at import, so under
`TRITON_INTERPRET=1` (set before the import) they run on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

from kernels.activation import silu_and_mul
from kernels.bitmask import apply_token_bitmask_
from kernels.kernel_set import KernelOps
from kernels.kv_cache import write_kv_cache
from kernels.lora import lora_expand, lora_shrink
from kernels.paged_attention import paged_attention
from kernels.rms_norm import rms_norm
from kernels.rotary import rotary_embedding

__all__ = ["TRITON_OPS", "apply_token_bitmask_"]

TRITON_OPS = KernelOps(
    rms_norm=rms_norm,
    rotary_embedding=rotary_embedding,
    silu_and_mul=silu_and_mul,
    write_kv_cache=write_kv_cache,
    paged_attention=paged_attention,
    lora_shrink=lora_shrink,
    lora_expand=lora_expand,
)
