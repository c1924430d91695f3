"""Generation defaults: the sampling values for fields a request leaves unset (vLLM's --generation-config).

Contract:
- `GenerationDefaults` is resolved once at start-up (`resolve_generation_defaults`, from EngineConfig's
  `generation_config` and `override_generation_config`) and never changes while the engine runs.
- It fills only what a caller left unset: an unset proto field, `LLM.generate(params=None)`, a field not passed
  to `sampling_params(**fields)`. An explicit value always wins, an explicit max_tokens included.
- `max_tokens` is a soft cap for requests without one: they generate up to the smaller of it and what the context
  leaves after the prompt (never below their min_tokens), instead of being refused; None means up to the context.
- Sources: `ladle` is OpenAI's defaults (SamplingParams' own). `auto` reads the model folder's
  generation_config.json; for the embedded default model it takes the values of its model card; for anything
  else (dummy:, other .gguf files, folders without the file) it is `ladle`. Any other value is the path of a
  generation_config.json or of a folder holding one. From a file, as in vLLM, only temperature, top_p, top_k,
  min_p, repetition_penalty and max_new_tokens (as max_tokens) are read; every other key (do_sample included) is
  ignored, and an absent or null key keeps the ladle default.
- The override (a JSON object with those keys, max_tokens or max_new_tokens) is applied last; null resets a key
  to the ladle default. An unknown key, a value of the wrong type or outside SamplingParams' ranges is a
  ValueError at start-up that names the flag (or the file).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_server.errors import ValidationError
from engine_server.loader.resolve import DEFAULT_MODEL_NAME, DEFAULT_SPEC, DUMMY_PREFIX
from engine_server.sampling_params import SamplingParams

AUTO = "auto"
LADLE = "ladle"
GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_FLAG = "--generation-config"
OVERRIDE_FLAG = "--override-generation-config"
# generation_config.json key -> GenerationDefaults field (Hugging Face's max_new_tokens is our max_tokens).
FILE_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
OVERRIDE_KEYS = {**FILE_KEYS, "max_tokens": "max_tokens"}
_INT_FIELDS = frozenset({"top_k", "max_tokens"})


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling values for the fields a request leaves unset; the field defaults are `ladle`'s (OpenAI's).

    top_k 0 disables top-k; max_tokens None means up to the context. `source` says where the values came from.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None
    source: str = LADLE

    def sampling_params(self, **fields: Any) -> SamplingParams:
        """SamplingParams with these defaults for every field not in `fields`; `fields` always win (an explicit
        max_tokens, None included, replaces the default cap). A beam search (`beam_width` over 1) takes no default
        repetition_penalty: it scores beams by their log-probabilities alone and refuses only a penalty asked."""
        values: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty if fields.get("beam_width", 1) == 1 else 1.0,
        }
        if "max_tokens" not in fields:
            values["default_max_tokens"] = self.max_tokens
        return SamplingParams(**{**values, **fields})


# The SmolLM2-135M-Instruct model card's generation settings (temperature 0.2, top_p 0.9); its converted folder
# has no generation_config.json. 512 tokens keep a reply on the CPU bounded.
EMBEDDED_DEFAULTS = GenerationDefaults(
    temperature=0.2, top_p=0.9, max_tokens=512, source=f"embedded {DEFAULT_MODEL_NAME} model card"
)


def resolve_generation_defaults(
    setting: str, override: str | None, *, model_spec: str, model_folder: Path | None
) -> GenerationDefaults:
    """The defaults for `setting` (auto | ladle | PATH) and the `override` JSON (None or "": none), for the
    model `model_spec` whose files are in `model_folder`. Raises ValueError naming the flag on a bad input."""
    defaults = _base_defaults(setting, model_spec, model_folder)
    if override:
        defaults = _apply(defaults, _parse_override(override), OVERRIDE_KEYS, OVERRIDE_FLAG)
        defaults = dataclasses.replace(defaults, source=f"{defaults.source} + {OVERRIDE_FLAG}")
    return defaults


def _base_defaults(setting: str, model_spec: str, model_folder: Path | None) -> GenerationDefaults:
    if setting == LADLE:
        return GenerationDefaults()
    if setting == AUTO:
        if model_spec == DEFAULT_SPEC:
            return EMBEDDED_DEFAULTS
        # A dummy model's folder is the embedded model's tokenizer; a GGUF file's is our own conversion.
        own_folder = not model_spec.startswith(DUMMY_PREFIX) and not model_spec.endswith(".gguf")
        path = model_folder / GENERATION_CONFIG_FILE if model_folder is not None and own_folder else None
        if path is None or not path.is_file():
            return GenerationDefaults(source=f"{LADLE} ({AUTO}: the model has no {GENERATION_CONFIG_FILE})")
        return _from_file(path, f"{GENERATION_CONFIG_FLAG} {AUTO}")
    path = Path(setting).expanduser()
    if path.is_dir():
        path = path / GENERATION_CONFIG_FILE
    if not path.is_file():
        raise ValueError(
            f"{GENERATION_CONFIG_FLAG} {setting!r}: no {GENERATION_CONFIG_FILE} there; give {AUTO}, {LADLE}, "
            f"a {GENERATION_CONFIG_FILE} file or a folder holding one"
        )
    return _from_file(path, f"{GENERATION_CONFIG_FLAG} {setting!r}")


def generation_config_eos_ids(model_folder: Path) -> tuple[int, ...]:
    """The `eos_token_id` (an id or a list of them) of `model_folder`'s generation_config.json; () without one, or
    when it is unreadable or holds no such ids (the sampling defaults report a bad file; this never fails)."""
    path = model_folder / GENERATION_CONFIG_FILE
    try:
        values = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return ()
    eos = values.get("eos_token_id") if isinstance(values, dict) else None
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)


def _from_file(path: Path, flag: str) -> GenerationDefaults:
    where = f"{flag} ({path})"
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: cannot read it as JSON: {exc}") from exc
    if not isinstance(values, dict):
        raise ValueError(f"{where}: must be a JSON object, got {type(values).__name__}")
    known = {key: value for key, value in values.items() if key in FILE_KEYS}
    return dataclasses.replace(_apply(GenerationDefaults(), known, FILE_KEYS, where), source=str(path))


def _parse_override(text: str) -> dict[str, Any]:
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{OVERRIDE_FLAG}: not valid JSON: {exc}") from exc
    if not isinstance(values, dict):
        raise ValueError(f"{OVERRIDE_FLAG}: must be a JSON object, e.g. '{{\"temperature\": 0.7}}'")
    unknown = sorted(set(values) - set(OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"{OVERRIDE_FLAG}: unknown keys {unknown}; known: {sorted(OVERRIDE_KEYS)}")
    if "max_tokens" in values and "max_new_tokens" in values:
        raise ValueError(f"{OVERRIDE_FLAG}: give max_tokens or max_new_tokens, not both")
    return values


def _apply(base: GenerationDefaults, values: dict[str, Any], keys: dict[str, str], where: str) -> GenerationDefaults:
    """`base` with `values` (keys of `keys`) set: null resets a field to the ladle default; checked."""
    ladle = GenerationDefaults()
    changes: dict[str, Any] = {}
    for key, value in values.items():
        name = keys[key]
        changes[name] = getattr(ladle, name) if value is None else _typed(key, name, value, where)
    defaults = dataclasses.replace(base, **changes)
    _check_ranges(defaults, where)
    return defaults


def _typed(key: str, name: str, value: Any, where: str) -> int | float:
    if name in _INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def _check_ranges(defaults: GenerationDefaults, where: str) -> None:
    """The ranges SamplingParams.validate enforces on requests, so the defaults never make a request invalid."""
    try:
        defaults.sampling_params(max_tokens=defaults.max_tokens).validate_values()
    except ValidationError as exc:
        raise ValueError(f"{where}: {exc.message}") from None
