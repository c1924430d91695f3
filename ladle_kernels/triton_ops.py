"""The Triton kernel set: `TRITON_OPS` for the model layers, plus the sampler's grammar bitmask op.

Importing this module needs triton (Linux). It decorates the kernels at import, so under
`TRITON_INTERPRET=1` (set before the import) they run on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

from ladle_kernels.activation import silu_and_mul
from ladle_kernels.bitmask import apply_token_bitmask_
from ladle_kernels.kernel_set import KernelOps
from ladle_kernels.kv_cache import write_kv_cache
from ladle_kernels.lora import lora_expand, lora_shrink
from ladle_kernels.paged_attention import alibi_attention, paged_attention
from ladle_kernels.rms_norm import rms_norm
from ladle_kernels.rotary import rotary_embedding

__all__ = ["TRITON_OPS", "apply_token_bitmask_"]

TRITON_OPS = KernelOps(
    rms_norm=rms_norm,
    rotary_embedding=rotary_embedding,
    silu_and_mul=silu_and_mul,
    write_kv_cache=write_kv_cache,
    paged_attention=paged_attention,
    lora_shrink=lora_shrink,
    lora_expand=lora_expand,
    alibi_attention=alibi_attention,
)
