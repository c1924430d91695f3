"""Kolibri-1.1's `config.json` (`model_type` kolibri1_1): Kolibri-1's layout (GLM-4's sandwich norms, windowed layers
with rope, experts chosen by logit plus bias beside a shared one) whose other layers are indexed attention
(`layer_types` `indexed_attention`, no rope; `config.KolibriIndex`), some over an earlier indexed layer's K/V
(`kv_source_layers`), and whose first layers (`mlp_only_layers`) have a dense MLP `mlp_only_intermediate_size` wide.
`kolibri1_1_config` gives the rest of the reader Kolibri-1's view of it (as transformers fills in its defaults);
`kolibri1_1_fields` the indexer's fields."""

from __future__ import annotations

from typing import Any

from engine_server.config import KolibriIndex

_INDEXED = "indexed_attention"
_DEFAULT_SOURCES = (0, 0, 0, 3, 4, 5, 5, 5, 5, 0)  # each indexed layer's K/V source among them (Kolibri 1.1's)
_DEFAULT_POOLS = (0, 2, 3, 5)  # the indexed layers that pick pools


def _filled(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with transformers' defaults for the layout fields it lacks (`Kolibri1_1Config.__post_init__`)."""
    layers = int(cfg.get("num_hidden_layers", 50))
    kinds = cfg.get("layer_types") or [_INDEXED if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)]
    indexed = [i for i, kind in enumerate(kinds) if kind == _INDEXED]
    pools = cfg.get("index_layers")
    if pools is None:
        pools = [indexed[i] for i in _DEFAULT_POOLS if i < len(indexed)]
    sources = cfg.get("kv_source_layers")
    if sources is None:
        if len(indexed) > len(_DEFAULT_SOURCES):
            raise ValueError(f"kolibri1_1: {len(indexed)} indexed layers need kv_source_layers (the default covers "
                             f"{len(_DEFAULT_SOURCES)})")  # fmt: skip
        sources = list(range(layers))
        for layer, source in zip(indexed, _DEFAULT_SOURCES, strict=False):
            sources[layer] = indexed[source]
    dense = cfg.get("mlp_only_layers")
    dense = [i for i in (0, 1) if i < layers] if dense is None else dense
    return {**cfg, "layer_types": list(kinds), "index_layers": list(pools), "kv_source_layers": list(sources),
            "mlp_only_layers": list(dense)}  # fmt: skip


def kolibri1_1_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Kolibri-1's view of a Kolibri-1.1 `cfg`: its indexed layers as full-attention ones (no window, so no rope),
    its dense layers by `mlp_layer_types`, `mlp_only_intermediate_size` their width."""
    filled = _filled(cfg)
    layers = len(filled["layer_types"])
    return {
        **filled, "model_type": "kolibri1",
        "layer_types": ["full_attention" if kind == _INDEXED else kind for kind in filled["layer_types"]],
        "mlp_layer_types": ["dense" if i in filled["mlp_only_layers"] else "sparse" for i in range(layers)],
        "intermediate_size": int(cfg.get("mlp_only_intermediate_size", 3584)),
    }  # fmt: skip


def kolibri1_1_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `kolibri_index` field of a Kolibri-1.1 `cfg` (`config.KolibriIndex`). ValueError for a layout transformers
    refuses: pool layers that are not indexed or do not include the first, K/V read from a layer of another kind or
    a later one, a pool not a whole number of blocks, index heads past key head 0's."""
    filled = _filled(cfg)
    kinds, sources = filled["layer_types"], [int(i) for i in filled["kv_source_layers"]]
    if set(kinds) - {_INDEXED, "sliding_attention"}:
        raise ValueError(f"kolibri1_1: layer_types must name indexed_attention or sliding_attention; got {kinds}")
    indexed = tuple(i for i, kind in enumerate(kinds) if kind == _INDEXED)
    pools = tuple(sorted({int(i) for i in filled["index_layers"]}))
    if not set(pools) <= set(indexed) or (indexed and indexed[0] not in pools):
        raise ValueError(f"kolibri1_1: index_layers {list(pools)} must be indexed layers, the first among them")
    for layer, source in enumerate(sources):
        if not 0 <= source <= layer or sources[source] != source or kinds[source] != kinds[layer]:
            raise ValueError(f"kolibri1_1: layer {layer} cannot read the K/V of layer {source}")
    spec = KolibriIndex(
        layers=indexed, pool_layers=pools, kv_sources=tuple(sources), topk=int(cfg.get("index_topk", 2048)),
        pool_size=int(cfg.get("index_pool_size", 16384)), compression=int(cfg.get("index_compression", 16)),
        heads=int(cfg.get("index_num_heads", 12)), local=int(cfg.get("index_num_local_tokens", 128)),
        sinks=int(cfg.get("index_num_sink_tokens", 8)),
    )  # fmt: skip
    heads, kv_heads = int(cfg.get("num_attention_heads", 48)), int(cfg.get("num_key_value_heads", 4))
    head_dim = int(cfg.get("head_dim", 128))
    if min(spec.topk, spec.pool_size, spec.compression) < 1 or spec.pool_size % spec.compression:
        raise ValueError("kolibri1_1: index_topk, index_pool_size and index_compression must be positive, the pool "
                         "a multiple of the compression")  # fmt: skip
    if not 0 < spec.heads <= heads // kv_heads or head_dim % 16:
        raise ValueError(f"kolibri1_1: {spec.heads} index heads must be among key head 0's {heads // kv_heads} query "
                         f"heads, and head_dim ({head_dim}) a multiple of 16 (NVFP4's blocks)")  # fmt: skip
    return {"kolibri_index": spec}
