"""Counter-based noise for seeded rows: each token's uniform is a pure function of (seed, position, token id).

A seeded row that samples the token at position p of its sequence (prompt and output tokens, counted from 0)
races its tokens with, for token id v,

    key(seed, p) = mix64(mix64(seed) + GOLDEN * p)              on the host, one per row (`row_keys`)
    u(key, v)    = 0.5 + (2 s + 1) * 2**-24, s = the top 23 bits of mix64(key + GOLDEN * v), signed
                                                               on the device, for every token (`SeededNoise`)

with SplitMix64's mix64 and GOLDEN (`ladle_kernels.reference`), all mod 2**64: u takes 2**23 equally likely values,
odd multiples of 2**-24, never 0 nor 1, so E = -log(u) is a positive Exp(1) variate (the race's noise) at the
resolution of torch's own float32 exponential_. Nothing in it depends on the rest of the batch, on the step or on
what the row drew before: a seeded request samples the same tokens alone or in any batch, and again when a
preemption recomputes it. Choice i of an n > 1 request has seed + i (the frontend's doing); mix64(seed) makes
those keys unrelated.

The device part is one kernel for any number of seeded rows: Triton on CUDA (when triton imports), the C++ CPU
kernel on the CPU (when it builds), else the reference's 13 int64 torch ops. The per-request torch.Generator
this replaces cost two ops per seeded row and step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ladle_kernels import reference
from ladle_kernels.reference import SPLITMIX_GOLDEN, SPLITMIX_MIX_1, SPLITMIX_MIX_2

_MASK64 = (1 << 64) - 1


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on a uint64 array (numpy's uint64 arithmetic wraps, and shifts logically)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(SPLITMIX_MIX_1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(SPLITMIX_MIX_2)
    return z ^ (z >> np.uint64(31))


def row_keys(seeds: Sequence[int], positions: Sequence[int] | np.ndarray) -> np.ndarray:
    """[S] int64 (the bits of uint64) keys: key(seed, p) = mix64(mix64(seed) + GOLDEN * p), seeds in [0, 2**64)."""
    streams = mix64(np.asarray(seeds, dtype=np.uint64))
    steps = np.asarray(positions, dtype=np.uint64) * np.uint64(SPLITMIX_GOLDEN)
    keys: np.ndarray = mix64(streams + steps).view(np.int64)
    return keys


def uniform(seed: int, position: int, token_id: int) -> float:
    """One u(key(seed, position), token_id), in plain Python: the definition above, for tests and for readers."""

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * SPLITMIX_MIX_1) & _MASK64
        z = ((z ^ (z >> 27)) * SPLITMIX_MIX_2) & _MASK64
        return z ^ (z >> 31)

    key = mix((mix(seed & _MASK64) + SPLITMIX_GOLDEN * position) & _MASK64)
    top = mix((key + SPLITMIX_GOLDEN * token_id) & _MASK64) >> 41
    signed = top - (1 << 23) if top >= 1 << 22 else top
    return 0.5 + (2 * signed + 1) * 2.0**-24


class SeededNoise:
    """log(u) for every token of a batch of seeded rows, from their `row_keys`, on the sampler's device."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        # Built once: an arange per step would be one more op.
        self._tokens = torch.arange(vocab_size, dtype=torch.int64, device=device)
        self._kernel = _device_kernel(device.type)

    def log_uniforms(self, keys: torch.Tensor) -> torch.Tensor:
        """[S, V] float32 log(u) for keys [S] int64 on the device: negative and finite (E = -log(u) > 0)."""
        return (self._kernel or reference.seeded_log_uniforms)(keys, self._tokens)


def _device_kernel(device_type: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The fused kernel for this kind of device, or None (then the reference runs)."""
    if device_type == "cuda":
        return _triton_seeded_log_uniforms()
    if device_type == "cpu":
        from ladle_kernels.cpu_ops import cpu_seeded_log_uniforms

        return cpu_seeded_log_uniforms()
    return None


@functools.cache
def _triton_seeded_log_uniforms() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The Triton launcher, or None where triton does not import (it ships for Linux only)."""
    try:
        from ladle_kernels.seeded_noise import seeded_log_uniforms
    except ImportError:
        return None
    return seeded_log_uniforms
