"""How a model's hidden states become one vector per input: the model's pooling and a request's options.

A model's pooling comes from its sentence-transformers configuration when its folder has one (`modules.json`
naming a `Pooling` module, whose `config.json` says which mode, and a `Normalize` module or not), as
sentence-transformers itself and vLLM read it; without one a decoder pools its last token and an encoder its
first (CLS) token, normalized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from engine_server.errors import ValidationError


class PoolingMethod(StrEnum):
    """Which hidden states make an input's vector (the values are PoolingInfo.method's)."""

    LAST = "last"  # the last token's
    MEAN = "mean"  # the mean over every token of the input
    CLS = "cls"  # the first token's

    @property
    def needs_every_token(self) -> bool:
        """Whether every position's hidden state is read (then no prompt token may come from the prefix cache)."""
        return self is not PoolingMethod.LAST


# sentence-transformers' Pooling config keys, by the method they select; the other modes are refused.
_ST_MODES = {
    "pooling_mode_lasttoken": PoolingMethod.LAST,
    "pooling_mode_mean_tokens": PoolingMethod.MEAN,
    "pooling_mode_cls_token": PoolingMethod.CLS,
}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request's options, resolved: its method (the model's), whether to L2-normalize, and how many
    leading values to keep (None: all). Truncation comes first, then normalization (Matryoshka embeddings)."""

    method: PoolingMethod = PoolingMethod.LAST
    normalize: bool = True
    dimensions: int | None = None
    # The model attends both ways (an encoder): an input runs whole in one step, never from the prefix cache.
    bidirectional: bool = False
    # A cross-encoder's pair: the vector is its classifier's relevance score (one value) of the pooled state.
    classify: bool = False

    @property
    def computes_every_token(self) -> bool:
        """Whether every token of the input must be computed in this request (none from the prefix cache)."""
        return self.bidirectional or self.method.needs_every_token


@dataclass(frozen=True)
class ModelPooling:
    """A model's pooling: its method, whether its embeddings are normalized by default, and their length."""

    method: PoolingMethod
    normalize: bool
    dimensions: int
    encoder: bool = False  # the model attends both ways (BERT)
    cross_encoder: bool = False  # it has a classifier that scores a pair (Score runs it instead of a cosine)

    @classmethod
    def for_model(
        cls, folder: Path | None, hidden_size: int, encoder: bool = False, cross_encoder: bool = False
    ) -> ModelPooling:
        """The pooling `folder`'s sentence-transformers configuration describes, else the last token's (a decoder)
        or the first's (an `encoder`), normalized. ValueError for a pooling mode ladle does not compute, or a
        configuration that selects none or several."""
        default = PoolingMethod.CLS if encoder else PoolingMethod.LAST
        modules_file = folder / "modules.json" if folder is not None else None
        if modules_file is None or not modules_file.is_file():
            return cls(default, True, hidden_size, encoder, cross_encoder)
        modules = json.loads(modules_file.read_text())
        types = {str(m.get("type", "")).rsplit(".", 1)[-1]: str(m.get("path", "")) for m in modules}
        method = default
        if "Pooling" in types:
            config = json.loads((folder / types["Pooling"] / "config.json").read_text())  # type: ignore[operator]
            unsupported = [key for key in _ST_UNSUPPORTED if config.get(key)]
            chosen = [mode for key, mode in _ST_MODES.items() if config.get(key)]
            if unsupported or len(chosen) != 1:
                raise ValueError(
                    f"{folder}: sentence-transformers pooling {sorted(k for k, v in config.items() if v is True)} "
                    "is not supported; ladle pools with exactly one of lasttoken, mean_tokens or cls_token"
                )
            method = chosen[0]
        return cls(method, "Normalize" in types, hidden_size, encoder, cross_encoder)

    def params(self, normalize: bool | None = None, dimensions: int | None = None) -> PoolingParams:
        """A request's options over this model's defaults; ValidationError when `dimensions` is out of range."""
        if dimensions is not None and not 1 <= dimensions <= self.dimensions:
            raise ValidationError(
                f"dimensions must be between 1 and {self.dimensions} (the model's embedding size), got {dimensions}",
                "dimensions",
            )
        keep = None if dimensions is None or dimensions == self.dimensions else dimensions
        return PoolingParams(self.method, self.normalize if normalize is None else normalize, keep, self.encoder)

    def pair_params(self) -> PoolingParams:
        """A cross-encoder's Score request: its CLS state through its classifier."""
        return PoolingParams(PoolingMethod.CLS, normalize=False, bidirectional=True, classify=True)


def write_sentence_transformers_pooling(folder: Path, method: PoolingMethod, normalize: bool, dimension: int) -> None:
    """Describe `method` (and normalization) in `folder` as sentence-transformers does, so `ModelPooling.for_model`
    reads it back: how a model converted from another format (a GGUF file's `pooling_type`) keeps its pooling."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "1_Pooling").mkdir(exist_ok=True)
    config: dict[str, object] = {"word_embedding_dimension": dimension}
    config.update({key: mode is method for key, mode in _ST_MODES.items()})
    config.update(dict.fromkeys(_ST_UNSUPPORTED, False))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
