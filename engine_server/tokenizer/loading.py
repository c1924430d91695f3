"""Open the tokenizer (with its chat template) of a resolved model folder, never touching a model hub."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

# The file a multimodal processor keeps its chat template in (transformers' tokenizers do not read it).
PROCESSOR_CHAT_TEMPLATE = "chat_template.json"


def load_tokenizer(path: Path, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """Load the fast tokenizer saved in `path` (a `ModelSource.tokenizer_path`).

    Raises `ValueError` if the folder holds no usable fast tokenizer. The chat template, if the folder has one
    (`chat_template.jinja` or inside `tokenizer_config.json`, else a multimodal processor's `chat_template.json`,
    where LLaVA's and Idefics's checkpoints keep theirs), is available as `tokenizer.chat_template`; `chat_template`
    (the text of one) replaces it.
    """
    try:
        if _generic_fast_tokenizer(path):
            # The generic class skips AutoTokenizer's config resolution, which imports model code (~2 s).
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(f"tokenizer in {path} is not a fast (tokenizers-backed) tokenizer")
    if chat_template is None and not tokenizer.chat_template:
        chat_template = _processor_chat_template(path)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _processor_chat_template(path: Path) -> str | None:
    """The chat template a multimodal processor saved beside the tokenizer (`chat_template.json`'s
    `chat_template`), None without one."""
    try:
        template = json.loads((path / PROCESSOR_CHAT_TEMPLATE).read_text(encoding="utf-8")).get("chat_template")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return template if isinstance(template, str) and template else None


def _generic_fast_tokenizer(path: Path) -> bool:
    """Whether the folder's tokenizer is the plain tokenizers-backed class (as in our GGUF conversions)."""
    config_file = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not config_file.is_file():
        return False
    try:
        tokenizer_class = json.loads(config_file.read_text()).get("tokenizer_class")
    except (OSError, json.JSONDecodeError):
        return False
    return tokenizer_class in {"PreTrainedTokenizerFast", "TokenizersBackend"}
