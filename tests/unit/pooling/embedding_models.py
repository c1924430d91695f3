"""Small embedding models for tests, built with transformers' own classes and saved to a folder (nothing fetched).

A folder holds what a real embedding checkpoint holds: the bare decoder's safetensors (names without `model.`,
no LM head, as Qwen3-Embedding ships them), the embedded model's tokenizer, and, when asked, the
sentence-transformers configuration that names the pooling (`modules.json`, `1_Pooling/config.json`,
`2_Normalize`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from engine_server.loader import resolve_model

# Every token id the embedded tokenizer emits fits this vocabulary.
VOCAB_SIZE = 49152


def save_qwen3_embedding(folder: Path, *, pooling: str | None = "lasttoken", normalize: bool = True) -> Path:
    """A 2-layer random Qwen3 decoder saved as a Qwen3-Embedding-style folder; `pooling` is the
    sentence-transformers mode (`lasttoken`, `mean_tokens`, `cls_token`), None for no sentence-transformers files."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )
    model = Qwen3Model(config).eval()
    with torch.no_grad():  # a wider spread than the init's, so that differences between inputs are not tiny
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(folder)
    if pooling is not None:
        _write_sentence_transformers(folder, pooling, normalize, config.hidden_size)
    return folder


def load_reference(folder: Path) -> Any:
    """transformers' model on the folder, fp32 on the CPU."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(folder, dtype=torch.float32).eval()


def reference_embedding(model: Any, token_ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' last hidden states of one input, pooled as sentence-transformers pools them."""
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([token_ids])).last_hidden_state[0].float()
    if pooling == "lasttoken":
        vector = hidden[-1]
    elif pooling == "mean_tokens":
        vector = hidden.mean(dim=0)
    else:
        vector = hidden[0]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def copy_tokenizer(folder: Path) -> None:
    """The embedded model's tokenizer files (and chat template) into `folder`."""
    source = resolve_model("default").tokenizer_path
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)


def _write_sentence_transformers(folder: Path, pooling: str, normalize: bool, dimension: int) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    config: dict[str, Any] = {"word_embedding_dimension": dimension, "include_prompt": True}
    config.update({f"pooling_mode_{mode}": mode == pooling for mode in modes})
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))


# A WordPiece vocabulary big enough for any lowercase ASCII text: whole words for the tests' texts, then letters.
_BERT_WORDS = [
    "hello",
    "world",
    "the",
    "capital",
    "of",
    "france",
    "is",
    "paris",
    "a",
    "city",
    "on",
    "seine",
    "with",
    "many",
    "museums",
    "and",
    "bridges",
    "embeddings",
    "turn",
    "text",
    "into",
    "vectors",
    "similar",
    "texts",
    "get",
    "that",
    "point",
    "same",
    "way",
    "which",
    "bananas",
    "are",
    "rich",
    "in",
    "potassium",
    "borders",
    "spain",
    "what",
    "an",
    "embedding",
    "fruit",
    "yellow",
]


def save_bert(
    folder: Path, *, pooling: str | None = "mean_tokens", normalize: bool = True, cross_encoder: bool = False
) -> Path:
    """A 2-layer random BERT encoder with a WordPiece tokenizer, saved as a sentence-transformers folder (`pooling`
    as in `save_qwen3_embedding`; None: no sentence-transformers files); with `cross_encoder`, a
    `BertForSequenceClassification` with one label instead (sentence-transformers' CrossEncoder layout)."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
    punctuation = list(".,;:!?'\"-()")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *punctuation, *letters, *(f"##{c}" for c in letters)]
    vocab += [w for w in dict.fromkeys(_BERT_WORDS) if w not in vocab]
    BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}, do_lower_case=True).save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        type_vocab_size=2,
        num_labels=1,
    )
    model = (BertForSequenceClassification(config) if cross_encoder else BertModel(config)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    if pooling is not None:
        _write_sentence_transformers(folder, pooling, normalize, config.hidden_size)
    return folder


def reference_pair_scores(folder: Path, model: Any, query: str, documents: list[str]) -> list[float]:
    """transformers' cross-encoder scores: the sigmoid of the classifier's output for each (query, document)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.inference_mode():
        scores = [model(**tokenizer(query, doc, return_tensors="pt")).logits[0, 0].sigmoid() for doc in documents]
    return [float(score) for score in scores]
