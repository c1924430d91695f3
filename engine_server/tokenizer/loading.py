"""Open the tokenizer (with its chat template) of a resolved model folder, never touching a model hub."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast


def load_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """Load the fast tokenizer saved in `path` (a `ModelSource.tokenizer_path`).

    Raises `ValueError` if the folder holds no usable fast tokenizer. The chat template, if the folder has one
    (`chat_template.jinja` or inside `tokenizer_config.json`), is available as `tokenizer.chat_template`.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(f"tokenizer in {path} is not a fast (tokenizers-backed) tokenizer")
    return tokenizer
