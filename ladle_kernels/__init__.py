"""ladle's kernels: Triton kernels, one op per file, each with a plain-torch reference (`reference.py`), and the
C++ CPU kernels (`cpu/`, `cpu_ops.py`). Named `ladle_kernels`, not `kernels`: Hugging Face's `kernels` distribution
(a dependency of transformers from 5.25) is imported as `kernels`, and two top-level packages of one name cannot be
installed side by side."""
