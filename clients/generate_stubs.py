"""Generate the ladle.v1 Python stubs (messages, gRPC services and their .pyi types) from proto/.

`make proto` runs this into clients/; the stale-stub test runs it into a temporary folder and compares.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE_DIR = Path("ladle") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def proto_files() -> list[Path]:
    """The .proto files of the contract, relative to proto/."""
    return sorted(p.relative_to(PROTO_DIR) for p in (PROTO_DIR / PACKAGE_DIR).glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs for every contract file under `out_dir`/ladle/v1 and return their paths."""
    target = out_dir / PACKAGE_DIR
    target.mkdir(parents=True, exist_ok=True)
    for stale in target.iterdir():
        if stale.name.endswith(GENERATED_SUFFIXES):
            stale.unlink()
    well_known = Path(protoc.__file__).parent / "_proto"
    plugin_dir = Path(sys.executable).parent
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--plugin=protoc-gen-mypy={shutil.which('protoc-gen-mypy') or plugin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc="
        f"{shutil.which('protoc-gen-mypy_grpc') or plugin_dir / 'protoc-gen-mypy_grpc'}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see the messages above")
    return sorted(p for p in target.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "clients", help="folder that holds ladle/v1")
    for path in generate(parser.parse_args().out):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    main()
