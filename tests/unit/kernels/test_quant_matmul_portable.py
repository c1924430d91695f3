"""The quantized kernels' portable loops (`ladle_kernels/cpu/quant_matmul.cpp` and `lowbit_tiles.h` without AVX2: ARM,
older x86) and their AVX2 ones (x86 without AVX-512: Zen 2/3, Intel's desktop parts), which the engine's own build
does not take on an AVX-512 machine (on an AVX2 one it does, and the AVX2 build here is skipped): quant_matmul.cpp
alone, built for baseline x86-64 and for Haswell in a child process (its ops would clash with the engine's build in
this one), against `ladle_kernels.reference`."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[3] / "ladle_kernels" / "cpu" / "quant_matmul.cpp"

CHILD = textwrap.dedent(
    """
    import sys
    from dataclasses import replace

    import torch
    from torch.utils.cpp_extension import load

    from engine_server.layers.lowbit_weight import decode_blocks, pack_lowbit
    from engine_server.layers.quantized_linear import Q4Weight, Q8Weight
    from ladle_kernels import reference
    from ladle_kernels.cpu_ops import _ninja_on_path
    from tests.lowbit_blocks import KINDS, block_elements, random_blocks

    with _ninja_on_path():
        load(name="ladle_quant_portable", sources=[sys.argv[1]], build_directory=sys.argv[2],
             is_python_module=False, extra_cflags=["-O2", f"-march={sys.argv[3]}", "-ffp-contract=off"])
    gen = torch.Generator().manual_seed(0)
    for m, n, k in [(1, 9, 64), (7, 20, 96), (13, 33, 576)]:
        q4 = Q4Weight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
                      (torch.rand(n, k // 32, generator=gen) * 0.02).half(),
                      (-torch.rand(n, k // 32, generator=gen) * 0.2).half())
        q8 = Q8Weight(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen),
                      (torch.rand(n, k // 32, generator=gen) * 0.01).half())
        x = torch.randn(m, k, generator=gen) * 3
        x[0, :32] = 0.0  # a zero group
        got4 = torch.ops.ladle_cpu.q4_linear(x, q4.qs, q4.scales, q4.mins)
        torch.testing.assert_close(got4, reference.q4_linear(x, q4.qs, q4.scales, q4.mins), atol=1e-4, rtol=1e-5)
        got8 = torch.ops.ladle_cpu.q8_linear(x, q8.qs, q8.scales)
        torch.testing.assert_close(got8, reference.q8_linear(x, q8.qs, q8.scales), atol=1e-4, rtol=1e-5)
        assert torch.equal(torch.ops.ladle_cpu.q4_linear(x[-1:], q4.qs, q4.scales, q4.mins), got4[-1:])
    for kind in KINDS:  # the 5-bit, K-quant and MXFP4 loops (lowbit_tiles.h)
        m, n, k = 9, 20, 512 if block_elements(kind) == 256 else 96
        w = decode_blocks(random_blocks(kind, n, k, gen), kind)
        x = torch.randn(m, k, generator=gen) * 3
        got = torch.ops.ladle_cpu.packed_linear(x, *pack_lowbit(w), n)
        torch.testing.assert_close(got, reference.lowbit_linear(x, w.dequantize()), atol=1e-4, rtol=1e-5)
        assert torch.equal(torch.ops.ladle_cpu.packed_linear(x[-1:], *pack_lowbit(w), n), got[-1:])
    fp4 = decode_blocks(random_blocks("mxfp4", 20, 96, gen), "mxfp4")
    x = torch.randn(9, 96, generator=gen)
    for e in (0, 1, 2, 200):  # MXFP4's exponent bytes at their ends: subnormal scales, and a large one
        w = replace(fp4, groups=torch.full_like(fp4.groups, e))
        got = torch.ops.ladle_cpu.packed_linear(x, *pack_lowbit(w), 20)
        expected = reference.lowbit_linear(x, w.dequantize())
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())
    print("portable ok")
    """
)


def native_build_takes_the_avx2_loops() -> bool:
    """Whether this CPU's own kernel build (`-march=native`) takes the AVX2 loops the Haswell build here does: AVX2,
    FMA and F16C without AVX-512 VNNI and VL (`quant_tiles.h`), as on Zen 2/3. The engine's kernel tests then test
    those loops already."""
    cpuinfo = Path("/proc/cpuinfo")
    match = re.search(r"^flags\s*:(.*)$", cpuinfo.read_text(), re.MULTILINE) if cpuinfo.is_file() else None
    flags = set(match.group(1).split()) if match else set()
    return {"avx2", "fma", "f16c"} <= flags and not {"avx512_vnni", "avx512vl"} <= flags


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None, reason="needs g++ on x86-64")
@pytest.mark.parametrize("arch", ["x86-64", "haswell"])
def test_portable_and_avx2_loops_match_the_reference(arch: str, tmp_path: Path) -> None:
    if arch == "haswell" and native_build_takes_the_avx2_loops():
        pytest.skip("this CPU's own build takes the AVX2 loops, which the kernel tests run (~35 s of build saved)")
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(SOURCE), str(tmp_path), arch],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=SOURCE.parents[2],
    )
    assert child.returncode == 0 and "portable ok" in child.stdout, child.stderr[-3000:]


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None, reason="needs g++ on x86-64")
@pytest.mark.parametrize("source", ["quant_matmul.cpp", "moe.cpp"])
def test_the_amx_tiles_compile(source: str) -> None:
    """The AMX paths (avx512_tiles.h, lowbit_tiles.h's `unpack_lowbit_pair`) are built only for CPUs with AMX (Intel
    Sapphire Rapids and later), which the machine running the tests may lack: the sources that hold them compile for
    one (syntax only: nothing built here could run)."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    flags = ["-std=c++17", "-fsyntax-only", "-march=sapphirerapids", "-fopenmp", *includes]
    compiler = subprocess.run(
        ["g++", *flags, str(SOURCE.parent / source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert compiler.returncode == 0, compiler.stderr[-3000:]
