"""The embedded model as the GGUF files people download: Q4_K_M, Q5_K_M, Q6_K, IQ4_XS, IQ4_NL, Q3_K_S, and Q2_K,
IQ3_XXS and IQ3_S (pure), made here, never fetched.

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

import numpy as np

from engine_server.loader.source import default_cache_dir

# llama.cpp's file types (llama_ftype): the mixes `llama-quantize` names Q4_K_M, Q5_K_M, Q6_K, IQ4_XS, IQ4_NL and
# Q3_K_S, and Q2_K, IQ3_XXS and IQ3_S `--pure` (every tensor in the mix's own type where the rows allow it).
FILE_TYPES = {
    "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "iq4_xs": 30, "iq4_nl": 25, "q3_k_s": 11, "q2_k_pure": 10,
    "iq3_xxs_pure": 23, "iq3_s_pure": 26,
}  # fmt: skip
# The Q2_K mix itself gives this model no Q2_K tensor: its down projections (the only rows of whole super-blocks)
# are Q3_K in it; the IQ3 mixes likewise give some of them other types. Pure, all 30 are the type (and the rest falls
# back as before). (IQ2_XXS takes an importance matrix, which llama-cpp-python cannot pass the quantizer.)
PURE_MIXES = frozenset({"q2_k_pure", "iq3_xxs_pure", "iq3_s_pure"})


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
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    source = source or source_gguf()
    out = kquant_dir(source) / "f32.gguf"
    if out.is_file():
        return out
    reader = GGUFReader(source)
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
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values.reshape([int(n) for n in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(out) + ".part", out)
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
    parser.add_argument("--mixes", default=",".join(FILE_TYPES), help="comma-separated: " + ", ".join(FILE_TYPES))
    args = parser.parse_args(argv)
    print("f32", float_gguf())
    for mix in args.mixes.split(","):
        print(mix, kquant_gguf(mix))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
