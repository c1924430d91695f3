"""The embedded model as the GGUF files people download: Q4_K_M, Q5_K_M, Q6_K, IQ4_XS, IQ4_NL, Q3_K_S, and Q2_K,
IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M (pure), made here, never fetched.

The embedded file's weights (its Q4_1 and Q8_0 blocks dequantized) are written as an F32 GGUF with its metadata
and tokenizer as they are (the gguf package), then quantized by llama.cpp's own quantizer (llama-cpp-python's
`llama_model_quantize`, the `llama-quantize` tool's code). The F32 file is the float reference the quantized files
are measured against (`ladle bench quality --reference`); the K-quant files are what ladle and llama.cpp serve.

llama-cpp-python is not a dependency of the project: install it to make these files. They are cached under
`$LADLE_CACHE_DIR/kquant` (else `~/.cache/ladle/kquant`), named after the source file's size and mtime.

For this model (hidden size 576, not a multiple of 256) llama.cpp falls back, per tensor, from the K-quant types
to Q5_0 / Q5_1 / Q8_0 where a row is not made of whole 256-element super-blocks: a Q4_K_M file is then Q5_0 with
Q4_K and Q6_K feed-forward down projections and Q8_0 value projections and embeddings; Q5_K_M the same with Q5_1 and
Q5_K; Q6_K is Q8_0 with Q6_K down projections; IQ4_XS falls back to IQ4_NL the same way. `python -m
benchmarks.kquant_files` makes them and prints the paths.
"""

from __future__ import annotations

import argparse
import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from engine_server.loader.source import default_cache_dir

# llama.cpp's file types (llama_ftype): the mixes `llama-quantize` names Q4_K_M, Q5_K_M, Q6_K, IQ4_XS, IQ4_NL and
# Q3_K_S, and Q2_K and IQ3_S `--pure` (every tensor in the mix's own type where the rows allow it).
FILE_TYPES = {
    "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "iq4_xs": 30, "iq4_nl": 25, "q3_k_s": 11, "q2_k_pure": 10,
    "iq3_s_pure": 26,
}  # fmt: skip
# The Q2_K mix itself gives this model no Q2_K tensor: its down projections (the only rows of whole super-blocks)
# are Q3_K in it. Pure, all 30 are the type (and the rest falls back as before).
PURE_MIXES = frozenset({"q2_k_pure", "iq3_s_pure"})
# The types llama.cpp's quantizer refuses without an importance matrix (which llama-cpp-python cannot pass it):
# made with ggml's quantizer directly (`ggml_gguf`), pure as above.
GGML_PURE = {
    "iq3_xxs_pure": GGMLQuantizationType.IQ3_XXS, "iq2_xxs_pure": GGMLQuantizationType.IQ2_XXS,
    "iq2_xs_pure": GGMLQuantizationType.IQ2_XS, "iq2_s_pure": GGMLQuantizationType.IQ2_S,
    "iq1_s_pure": GGMLQuantizationType.IQ1_S, "iq1_m_pure": GGMLQuantizationType.IQ1_M,
}  # fmt: skip


def source_gguf() -> Path:
    """The embedded model's GGUF file."""
    from engine_server.loader import resolve_model

    path = resolve_model("default").gguf_path
    assert path is not None, "the embedded model is a GGUF file"
    return path


def kquant_dir(source: Path) -> Path:
    stat = source.stat()
    folder = default_cache_dir() / "kquant" / f"{source.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def float_gguf(source: Path | None = None) -> Path:
    """The F32 GGUF of `source` (the embedded file by default): every tensor dequantized, metadata as it is."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    source = source or source_gguf()
    out = kquant_dir(source) / "f32.gguf"
    if out.is_file():
        return out
    reader = GGUFReader(source)
    writer = _writer_like(reader, out)
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values.reshape([int(n) for n in reversed(tensor.shape)]))
    _finish(writer, out)
    return out


def _writer_like(reader: Any, out: Path) -> Any:
    """A `GGUFWriter` to `out`.part with every metadata field of `reader`'s file."""
    from gguf import GGUFValueType, GGUFWriter

    arch_field = reader.fields["general.architecture"]
    writer = GGUFWriter(str(out) + ".part", bytes(arch_field.parts[arch_field.data[0]]).decode())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            item = field.types[1]
            if item == GGUFValueType.STRING:
                values: object = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            else:
                values = [field.parts[i][0] for i in field.data]
            writer.add_key_value(name, values, kind, sub_type=item)
        elif kind == GGUFValueType.STRING:
            writer.add_key_value(name, bytes(field.parts[field.data[0]]).decode(), kind)
        else:
            writer.add_key_value(name, field.parts[field.data[0]][0], kind)
    return writer


def _finish(writer: Any, out: Path) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(out) + ".part", out)


def ggml_gguf(mix: str, source: Path | None = None) -> Path:
    """`source` (the embedded file by default) with every matrix quantized by ggml's own quantizer
    (`ggml_quantize_chunk`, what `llama-quantize` calls) to `GGML_PURE[mix]` where its rows are whole 256-wide
    blocks, else to IQ4_NL (llama.cpp's fallback for these types), with an importance matrix of ones (plain squared
    error: the types llama.cpp will not quantize without one); norms stay F32. Raises ImportError without
    llama-cpp-python (whose ggml library this loads)."""
    import llama_cpp
    from gguf import GGML_QUANT_SIZES, GGUFReader

    source = source or source_gguf()
    out = kquant_dir(source) / f"{mix}.gguf"
    if out.is_file():
        return out
    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]  # fmt: skip
    reader = GGUFReader(float_gguf(source))
    writer = _writer_like(reader, out)
    for tensor in reader.tensors:
        values = np.ascontiguousarray(tensor.data, dtype=np.float32)
        if values.ndim != 2:
            writer.add_tensor(tensor.name, values)
            continue
        rows, cols = values.shape
        kind = GGML_PURE[mix] if cols % 256 == 0 else GGMLQuantizationType.IQ4_NL
        elements, size = GGML_QUANT_SIZES[kind]
        blocks = np.empty((rows, cols // elements * size), dtype=np.uint8)
        importance = np.ones(cols, dtype=np.float32)
        written = ggml.ggml_quantize_chunk(int(kind), values.ctypes.data, blocks.ctypes.data, 0, rows, cols,
                                           importance.ctypes.data)  # fmt: skip
        if written != blocks.nbytes:
            raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes of {tensor.name}'s {blocks.nbytes}")
        writer.add_tensor(tensor.name, blocks, raw_dtype=kind)
    _finish(writer, out)
    return out


def kquant_gguf(mix: str, source: Path | None = None, threads: int = 2) -> Path:
    """`source` (the embedded file by default) quantized to `mix` (a `FILE_TYPES` key) by llama.cpp's quantizer.
    Raises ImportError without llama-cpp-python, RuntimeError when the quantizer fails."""
    import llama_cpp

    source = source or source_gguf()
    out = kquant_dir(source) / f"{mix}.gguf"
    if out.is_file():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[mix]
    params.pure = mix in PURE_MIXES
    params.nthread = threads
    part = str(out) + ".part"
    status = llama_cpp.llama_model_quantize(str(float_gguf(source)).encode(), part.encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize to {mix} failed with status {status}")
    os.replace(part, out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kquant_files", description=__doc__.splitlines()[0])
    mixes = [*FILE_TYPES, *GGML_PURE]
    parser.add_argument("--mixes", default=",".join(mixes), help="comma-separated: " + ", ".join(mixes))
    args = parser.parse_args(argv)
    print("f32", float_gguf())
    for mix in args.mixes.split(","):
        print(mix, ggml_gguf(mix) if mix in GGML_PURE else kquant_gguf(mix))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
