"""The state space models' GGUF files as llama.cpp's converter writes them: `mamba` (Mamba's mamba-*-hf releases, and
Falcon Mamba, the same architecture with `ssm.dt_b_c_rms` set) and `mamba2` (Mamba-Codestral, the mamba2 releases).
Their metadata becomes each family's own `config.json` keys (`state_space_gguf_config`), so transformers loads the
converted folder as the family it is; their tensors keep the checkpoints' `backbone.` names (`STATE_SPACE_GLOBAL_NAMES`,
`STATE_SPACE_LAYER_NAMES`, `STATE_SPACE_BARE_NAMES`), with the forms llama.cpp gives them undone by `gguf_convert`
as for the hybrids' Mamba layers (the convolution squeezed, `A_log` stored as `-exp(A_log)`, Mamba-2's `A`, `D` and
gated norm reshaped)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine_server.hf_mamba import MAX_POSITIONS

# llama.cpp's architecture names of the state space models and the (model_type, architectures entry) each converts
# to; a `mamba` file with `ssm.dt_b_c_rms` set is Falcon Mamba's (`FALCON_MAMBA`).
STATE_SPACE_GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "mamba": ("mamba", "MambaForCausalLM"),
    "mamba2": ("mamba2", "Mamba2ForCausalLM"),
}
FALCON_MAMBA = ("falcon_mamba", "FalconMambaForCausalLM")
# The epsilon of Falcon Mamba's weightless norms of the time step, B and C: transformers' default and every released
# Falcon Mamba's `mixer_rms_eps`. The file holds none (llama.cpp applies the layers' epsilon there too).
_FALCON_MAMBA_MIXER_EPS = 1e-6
# The context llama.cpp's converter writes for these models, "arbitrary" in its words: they have no positions, so it
# is read as no limit stated (`hf_mamba.MAX_POSITIONS`, as for a config without one).
_NO_CONTEXT_STATED = 2**20
# The keys of the generic reading (a Llama config's) that name nothing in these families' configs.
_LLAMA_ONLY_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rope_theta",
                    "attention_bias", "rms_norm_eps")  # fmt: skip

# The checkpoints' names of llama.cpp's tensors, by the model_type the file converts to: the embeddings and the
# final norm under `backbone.`, a layer's norm and its mixer's tensors under `backbone.layers.N.`.
_GLOBAL = {"token_embd.weight": "backbone.embeddings.weight", "output_norm.weight": "backbone.norm_f.weight"}
_LAYER = {"attn_norm": "norm", "ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d", "ssm_out": "mixer.out_proj"}
_MAMBA1_LAYER = {**_LAYER, "ssm_x": "mixer.x_proj", "ssm_dt": "mixer.dt_proj"}
_MAMBA1_BARE = {"ssm_a": "mixer.A_log", "ssm_d": "mixer.D"}
STATE_SPACE_GLOBAL_NAMES = {model_type: _GLOBAL for model_type in ("mamba", "falcon_mamba", "mamba2")}
STATE_SPACE_LAYER_NAMES = {"mamba": _MAMBA1_LAYER, "falcon_mamba": _MAMBA1_LAYER,
                           "mamba2": {**_LAYER, "ssm_norm": "mixer.norm"}}  # fmt: skip
# Tensors named apart from `<module>.weight` / `.bias` (the rest of their name after `blk.N.`): Mamba-2's time-step
# bias is its own parameter, which its converter writes as `ssm_dt.bias`.
STATE_SPACE_BARE_NAMES = {"mamba": _MAMBA1_BARE, "falcon_mamba": _MAMBA1_BARE,
                          "mamba2": {**_MAMBA1_BARE, "ssm_dt.bias": "mixer.dt_bias"}}  # fmt: skip


def state_space_gguf_config(
    arch: str, config: dict[str, Any], tensors: dict[str, Any], read: Callable[[str, Any], Any], spec: str
) -> dict[str, Any]:
    """The whole `config.json` of a `mamba` / `mamba2` file: `config` (the generic keys read so far: vocabulary,
    embeddings' tie, token ids, hidden size, layers, `rms_norm_eps` holding the norms' epsilon) without the keys that
    only attention models have, plus each family's own: the `ssm.*` shape (Mamba-1's inner width as
    `intermediate_size`, its time-step rank; Mamba-2's heads, its time-step rank, and their width), the convolution's
    and the projections' biases where the file has their tensors (the latter refused by the config reader, as from a
    checkpoint), Falcon Mamba's for a `mamba` file with `ssm.dt_b_c_rms`; the context the file states, but for its
    converter's 2^20, read as none stated (`MAX_POSITIONS`). `read(key, default)` reads a metadata value. ValueError
    for a Mamba-2 file whose inner width its heads or its hidden size do not divide."""

    def required(key: str) -> int:
        value = read(f"{arch}.{key}", None)
        if value is None:
            raise ValueError(f"model {spec!r}: GGUF metadata lacks {arch}.{key}")
        return int(value)

    falcon = arch == "mamba" and bool(read(f"{arch}.ssm.dt_b_c_rms", False))
    model_type, hf_class = FALCON_MAMBA if falcon else STATE_SPACE_GGUF_ARCHITECTURES[arch]
    hidden, inner, rank = int(config["hidden_size"]), required("ssm.inner_size"), required("ssm.time_step_rank")
    keys: dict[str, Any] = {
        **{key: value for key, value in config.items() if key not in _LLAMA_ONLY_KEYS},
        "architectures": [hf_class],
        "model_type": model_type,
        "layer_norm_epsilon": config["rms_norm_eps"],
        "state_size": required("ssm.state_size"),
        "conv_kernel": required("ssm.conv_kernel"),
        "use_conv_bias": "blk.0.ssm_conv1d.bias" in tensors,
        "use_bias": "blk.0.ssm_in.bias" in tensors,
    }
    if keys["max_position_embeddings"] == _NO_CONTEXT_STATED:
        keys["max_position_embeddings"] = MAX_POSITIONS
    if arch == "mamba":
        keys.update(intermediate_size=inner, time_step_rank=rank)
        if falcon:
            keys["mixer_rms_eps"] = _FALCON_MAMBA_MIXER_EPS
        return keys
    if not rank or inner % rank or inner % hidden:
        raise ValueError(f"model {spec!r}: a mamba2 file of {rank} heads over an inner size of {inner} (hidden size "
                         f"{hidden}) is not supported")  # fmt: skip
    keys.update(num_heads=rank, head_dim=inner // rank, expand=inner // hidden, n_groups=required("ssm.group_count"))
    return keys
