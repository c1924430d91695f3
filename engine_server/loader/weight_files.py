"""A Hugging Face folder's weight files and the tensors each holds, from their headers alone (no tensor read)."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder, in shard order (the index file is only a name map)."""
    return sorted(folder.glob("*.safetensors"))


def tensor_files(folder: Path) -> dict[str, Path]:
    """Each tensor name of a Hugging Face folder's weight files -> the file that holds it (headers only read)."""
    files: dict[str, Path] = {}
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt") as handle:
            files.update(dict.fromkeys(handle.keys(), file))
    return files
