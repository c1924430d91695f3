"""Kernel tests run on the GPU when there is one and through Triton's interpreter on CPU tensors otherwise.

Triton reads TRITON_INTERPRET when it decorates a kernel (`@triton.jit`, i.e. at `import ladle_kernels.<op>`), not
when triton itself is imported, so setting it here is enough as long as no kernel module was imported before
this folder was collected: the engine imports them lazily (only for CUDA devices), and
`test_kernels_run_through_the_interpreter_without_cuda` fails if that ever stops holding.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> torch.device:
    """Where the kernels run: CUDA when present, else CPU tensors under the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
