"""Frozen configuration for the engine: built once at the entry point and passed down.

Values discovered at run time do not live here: the number of KV blocks is sized when the model is loaded
(`engine_server.model_loading.num_kv_blocks`, held as `LoadedModel.num_blocks`), the eos ids are read from the model and
its tokenizer where the engine is built (`engine_server.llm.engine_eos_ids`, for `LLM` and the gRPC server).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args

Architecture = Literal[
    "llama", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "gemma", "gemma2",
    "gemma3", "smollm3", "granite", "olmo2", "deepseek_v3", "qwen3_next", "gemma4", "llama4", "glm4_moe", "glm4",
    "minimax_m2", "ernie4_5", "ernie4_5_moe", "cohere", "lfm2", "granitemoe", "nemotron_h", "hunyuan", "apertus",
    "afmoe", "falcon_h1", "jamba", "gpt_neox", "gptj", "nanochat", "olmo_hybrid", "mamba", "dbrx", "gemma3n",
    "deepseek_v4", "longcat_flash", "minimax", "bitnet", "minimax_m3", "beam", "ergo", "recurrent_gemma", "jetmoe",
    "dory", "zamba2", "qwen4_exp", "xlstm", "rwkv", "bert", "whisper",
]  # fmt: skip

# Families whose attention has a bias on o_proj too when `attention_bias` is set (as transformers builds them).
_O_PROJ_BIAS_FAMILIES: tuple[Architecture, ...] = (
    "llama", "qwen3", "qwen3_moe", "olmoe", "gpt_oss", "smollm3", "granite", "llama4", "granitemoe", "hunyuan",
    "apertus", "afmoe", "falcon_h1", "gpt_neox", "nanochat", "beam", "whisper",
)  # fmt: skip


@dataclass(frozen=True)
class ImageInput:
    """How a multimodal checkpoint whose images are served reads them (`engine_server.multimodal`): its vision
    encoder (`encoder`: "llava", a tower's hidden states through LLaVA's projector ("aya_vision": Aya Vision's, over
    its tiles); "llava_next", the same over its
    image's tiles (any resolution: its processor's grid), unpadded, a newline after each row ("llava_onevision": the
    same over a SigLIP tower, a large grid scaled down, each of a prompt's several images its base view alone);
    "mistral3", Pixtral's
    through Mistral 3's patch merger; "internvl", InternViT's pixel-shuffled through InternVL's projector, a tile at a
    time; "idefics3" or "smolvlm", SigLIP's through the pixel-shuffle connector, a tile at a time; "idefics2", its
    SigLIP-like tower's over the patches each tile's pixel mask covers whole, through its connector's perceiver
    resampler, `extra_tokens` latents a tile; "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe" and the GLM-4.xV
    kinds, their towers over a processed image's patches, merged `merge_size` x `merge_size`; "deepseek_vl" and
    "janus", their tower's last hidden states through their aligner, `extra_tokens` tokens an image;
    "deepseek_vl_hybrid", the same beside its SAM tower's of the image's high-resolution view; "mllama", Llama 3.2
    Vision's tiles through its tower and projector to its cross-attention layers, `cross_attention`), and the
    placeholder token its chat template writes once per image (`image_token_id`), expanded to the image's tokens (Llama
    3.2 Vision's not: one token): LLaVA's one per patch of `patch_size` squares plus `extra_tokens` (the tower's class
    token, unless the projector drops it: -1 to 1; InternVL's and Idefics 2's `extra_tokens` a tile), the Qwen-VL
    towers' one per merged patch. With `mrope_section` (the Qwen-VL text models' M-RoPE: rotated pairs turned by the
    temporal, height and width position) an image's tokens take 3-D positions and the text after them goes on from the
    largest (`multimodal.inputs.MultimodalInputs.positions`)."""

    encoder: str
    image_token_id: int
    patch_size: int
    extra_tokens: int = 0
    merge_size: int = 1
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False  # (Qwen3-VL's) pairs turned by time, height, width in turn, not in three runs
    # Qwen3-VL's DeepStack: the tower's features of this many of its inner layers, each added to the image tokens'
    # hidden states after one of the text model's first layers (the encoder's rows carry them after the embeddings).
    deepstack_layers: int = 0
    # Mistral 3's (Pixtral's) rows: each row of merged patches' tokens followed by the first of these tokens, the
    # last row by the second (`[IMG_BREAK]`, `[IMG_END]`); the image's embeddings go to its patch tokens alone.
    row_marks: tuple[str, str] | None = None
    # InternVL's: the image's tokens between these two (`<img>`, `</img>`), in tiles (`tiles`: the processor crops the
    # image into tiles and a thumbnail, `extra_tokens` tokens each).
    image_marks: tuple[str, str] | None = None
    tiles: bool = False
    # Idefics 3's and SmolVLM's: the image split into rows x columns of tiles and a global view, its prompt text the
    # processor's (`<fake_token_around_image><row_1_col_1><image>...`), `extra_tokens` image tokens a tile.
    split_rows: bool = False
    # Gemma 3's: the chat template writes `<start_of_image>` (`text_marks[0]`) for an image, which its processor's text
    # replaces with `\n\n<start_of_image>`, `extra_tokens` image tokens, `<end_of_image>\n\n` before tokenizing; an
    # image's tokens attend to each other both ways (`bidirectional`), as its model's mask has them.
    text_marks: tuple[str, str, str] | None = None
    bidirectional: bool = False
    # Aya Vision's: the chat template's placeholder where it is not the image token (`<image>`, expanded by its
    # processor into tiles of `<|IMG_PATCH|>` tokens, the image token).
    placeholder: str | None = None
    # Llama 3.2 Vision's ("mllama"): the image token stays one token (its own embedding); the request's images' tiles
    # go through the tower and projector to the text model's cross-attention layers (`MultimodalCheckpoint.
    # dropped_layers`, by checkpoint index), which its tokens attend as its processor's cross-attention mask says
    # (`multimodal.mllama`).
    cross_attention: bool = False
    # LLaVA-OneVision's `vision_aspect_ratio` ("anyres_max_N"): a grid of tiles whose unpadded features exceed about N
    # tiles' is scaled down to fit (its processor's count and its model's packing alike); `extra_tokens` a tile's
    # tokens (its processor's `num_image_tokens`).
    vision_aspect_ratio: str | None = None

    def tokens_per_image(self, height: int, width: int) -> int:
        """Placeholder tokens of an image processed to `height` x `width` pixels (LLaVA's processor's count)."""
        return (height // self.patch_size) * (width // self.patch_size) + self.extra_tokens


@dataclass(frozen=True)
class AudioInput:
    """How a multimodal checkpoint whose audio is served hears it (`engine_server.multimodal.audio`): its audio encoder
    (`encoder`, the checkpoint's `model_type`: "qwen2_audio", Qwen2-Audio's Whisper-style tower over a clip's log-mel
    features, average-pooled, through its projector; "audioflamingo3", Audio Flamingo 3's, over each 30 s window of a
    clip) and the placeholder token its chat template writes once per clip (`audio_token_id`), expanded by the model's
    own processor to one token a pooled frame."""

    encoder: str
    audio_token_id: int


@dataclass(frozen=True)
class MultimodalCheckpoint:
    """A multimodal checkpoint (`model_type`: Gemma 3's, Qwen2.5-VL's, ...) whose text model alone is served: the
    weight prefixes of what sits beside it (`towers`: vision and audio towers, projectors), not read, and the text
    model's layers a text prompt skips (`dropped_layers`, by checkpoint index: Llama 3.2 Vision's cross-attention
    layers), the others numbered on without them. `hidden_first_banks`: (hidden size, an expert's width) of a
    checkpoint whose expert banks may be stored hidden-first, `gate_up_proj` `[E, H, 2 * I]` and `down_proj`
    `[E, I, H]` (Qwen3-VL-MoE as released), transposed at load where their shapes say so, as transformers does.
    `images`: how the checkpoint reads images, for the kinds whose images are served (LLaVA's); `audio`: how it
    hears audio, for the kinds whose audio is served (Qwen2-Audio's, Audio Flamingo 3's); `transcribes`: a
    speech-to-text model's (Whisper's), its encoder's states read by cross-attention inside each decoder layer."""

    model_type: str
    towers: tuple[str, ...]
    dropped_layers: tuple[int, ...] = ()
    hidden_first_banks: tuple[int, int] | None = None
    images: ImageInput | None = None  # how images are read, where they are served (None: text prompts alone)
    audio: AudioInput | None = None  # how audio is heard, where it is served (None: no audio)
    # A speech-to-text model's (Whisper's): its decoder reads its encoder's states of a request's clip through a
    # cross-attention inside each layer (`multimodal.whisper`); its prompts are transcriptions alone
    # (`multimodal.transcription`).
    transcribes: bool = False


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style rope frequency scaling (rope_type "llama3"); other types are refused at load."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LongRope:
    """Phi-3's LongRoPE (rope_type "longrope"): inverse frequencies divided per dimension by `short_factor`, or by
    `long_factor` for a sequence longer than `original_max_position_embeddings`, and cos/sin scaled by
    `attention_factor`. Which factors a token gets follows transformers: the long ones when its sequence, as of the
    step that computes it, is longer than `original_max_position_embeddings` (so a prompt prefilled in one step is
    all long or all short, and a sequence that grows past the limit gets the long ones from there on)."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


@dataclass(frozen=True)
class Yarn:
    """YaRN (rope_type "yarn": Qwen's long-context setting, gpt-oss, DeepSeek): each inverse frequency is blended
    between itself (extrapolated, the fast-turning dims) and itself divided by `factor` (interpolated, the slow
    ones) along a linear ramp over the dims between the correction dims of `beta_fast` and `beta_slow` rotations in
    `original_max_position_embeddings` positions (`truncate`: the ramp's ends rounded to whole dims), and cos/sin
    are multiplied by `attention_factor`, as transformers' `_compute_yarn_parameters` computes them."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention's shape (DeepSeek-V2/V3; `layers.mla`): queries through a rank-`q_lora_rank`
    projection (0: one `q_proj`), keys and values from a `kv_lora_rank` latent; each head's key is
    `qk_nope_head_dim` dims without positions and `qk_rope_head_dim` turned by rope (shared by every head), its
    value `v_head_dim`; `rope_interleave`: the rope dims come in interleaved pairs (DeepSeek-V3's layout). Without
    `rope` (Kimi Linear's NoPE layers) the "rope" dims turn by nothing: the same shared key dims, unrotated. With
    `head_gate` (Ling 3's) each head's output is multiplied by the sigmoid of its own `g_proj` value of the layer's
    input before `o_proj`; with `value_gate` (HY-V4's) each value dim of each head's output by the sigmoid of its own
    `gate_proj` value (`heads * v_head_dim` of them). With `query_latent_pair` (A.X K2's) the queries and that gate
    come from the query latent beside its norm (`q_b_proj` and `gate_proj` read `cat(norm(q_a(x)), q_a(x))`, its
    checkpoints' one `q_gate_proj`) rather than from the norm alone and the layer's input. `latent_norm_eps`: the
    epsilon of the q and kv latents' norms (0: the model's `rms_norm_eps`; HY-V4's are transformers' default 1e-6
    whatever its own)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    rope: bool = True
    head_gate: bool = False
    value_gate: bool = False
    latent_norm_eps: float = 0.0
    query_latent_pair: bool = False


@dataclass(frozen=True)
class SparseIndexer:
    """DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5; `layers.sparse_indexer`): each query
    attends over the `topk` earlier positions (its own included) that `heads` index heads of `head_dim` score
    highest, and over all of them while it has no more. Rope turns each index key's and query's first
    `qk_rope_head_dim` dims (with `rope_last`, HY-V4's, its last), their pairs interleaved with `rope_interleave`
    (GLM-5's) and in halves otherwise (DeepSeek-V3.2's). The layers in `shared_layers` have no indexer of their own:
    they attend over the positions the last layer before them with one chose (GLM-5's and HY-V4's `indexer_types`
    "shared"). `key_norm_eps`: the index key's LayerNorm epsilon (HY-V4's is its `rms_norm_eps`)."""

    heads: int
    head_dim: int
    topk: int
    rope_interleave: bool = False
    shared_layers: tuple[int, ...] = ()
    rope_last: bool = False
    key_norm_eps: float = 1e-6


@dataclass(frozen=True)
class BlockSparse:
    """MiniMax-M3's block-sparse attention (`layers.block_sparse_attention`) on `layers`: a lightning indexer of
    `index_heads` heads `index_head_dim` wide scores each earlier key of a query (q/k norms, rope), max-pools the
    scores over blocks of `block_size` positions and keeps the `topk_blocks` best blocks, the `local_blocks` ending at
    the query's own always among them; index head i picks the blocks of the query heads of its share
    (`num_attention_heads / index_heads` each). Each token's index key is one more head of the layer's cache rows
    on every rank (`ModelConfig.layer_index_heads`)."""

    layers: tuple[int, ...]
    index_heads: int
    index_head_dim: int
    block_size: int
    topk_blocks: int
    local_blocks: int

    @property
    def dense_positions(self) -> int:
        """The positions below which a query attends to every earlier key (its indexer keeps every block)."""
        return self.topk_blocks * self.block_size


@dataclass(frozen=True)
class MLstm:
    """xLSTM's mLSTM layers (`layers.mlstm`) on `layers`: `heads` heads, each a matrix memory `qk_head_dim x
    v_head_dim` with a normaliser and a stabiliser, updated per token by exponential input and sigmoid forget gates
    (their pre-activations soft-capped at `gate_soft_cap`), read by the query over `max(|q . n|, exp(-m)) + eps`. Its
    state per sequence is every head's memory, normaliser and stabiliser, in place of a KV cache."""

    heads: int
    qk_head_dim: int
    v_head_dim: int
    layers: tuple[int, ...]
    gate_soft_cap: float = 15.0
    eps: float = 1e-6

    @property
    def state_size(self) -> int:
        """Float32 values one sequence's state holds in one layer: the memories, the normalisers, the stabilisers."""
        return self.heads * (self.qk_head_dim * self.v_head_dim + self.qk_head_dim + 1)

    def sharded(self, size: int) -> MLstm:
        """One rank's share under tensor parallelism over `size` ranks: a block of the heads; ValueError unless `size`
        divides them."""
        if self.heads % size:
            raise ValueError(f"mLSTM's {self.heads} heads must be divisible by the tensor-parallel size ({size})")
        return replace(self, heads=self.heads // size)


@dataclass(frozen=True)
class Rwkv:
    """RWKV-4's blocks (`layers.rwkv`) on `layers`: a time mix (each token's input mixed with the one before it, a WKV
    recurrence over `attention_hidden` channels) and a channel mix (mixed the same way, a relu² MLP gated by its
    receptance). Its state per sequence: the channel mix's and the time mix's previous inputs (`hidden` each), then
    the WKV's numerator, denominator and running maximum (`attention_hidden` each), float32. Every
    `rescale_every`-th block halves the hidden state (transformers' inference rescaling; 0: none)."""

    hidden: int
    attention_hidden: int
    layers: tuple[int, ...]
    rescale_every: int = 6

    @property
    def state_size(self) -> int:
        """Float32 values one sequence's state holds in one layer: the two previous inputs, the WKV's three rows."""
        return 2 * self.hidden + 3 * self.attention_hidden

    def sharded(self, size: int) -> Rwkv:
        """One rank's share under tensor parallelism over `size` ranks: a block of the WKV channels (the previous
        inputs whole); ValueError unless `size` divides them."""
        if self.attention_hidden % size:
            raise ValueError(f"RWKV's {self.attention_hidden} channels must be divisible by the tensor-parallel size "
                             f"({size})")  # fmt: skip
        return replace(self, attention_hidden=self.attention_hidden // size)


@dataclass(frozen=True)
class KolibriIndex:
    """Kolibri-1.1's indexed attention (`layers.kolibri_attention`) on `layers` (no rope; the rest windowed with rope).

    A weightless indexer scores keys by the ReLU of the first `heads` query heads' logits against key head 0,
    averaged over those heads, both rounded to NVFP4. A pool layer (`pool_layers`) picks each query's pool of
    `pool_size` keys (every key for a short context, else the blocks of `compression` keys whose mean scores best);
    every indexed layer attends over the `topk` best keys of its latest pool layer's pool beside the first `sinks`
    and last `local` positions (every key where that many or fewer are visible), its keys and values rounded to
    NVFP4. Layer i attends over the K/V of layer `kv_sources[i]` (itself, or an earlier indexed layer)."""

    layers: tuple[int, ...]
    pool_layers: tuple[int, ...]
    kv_sources: tuple[int, ...]
    topk: int
    pool_size: int
    compression: int
    heads: int
    local: int
    sinks: int

    @property
    def budget(self) -> int:
        """Keys a query attends over at most."""
        return self.topk + self.local + self.sinks

    def pool_layer(self, index: int) -> int:
        """The pool layer whose pool indexed layer `index` chooses from: the latest at or before it."""
        return max(layer for layer in self.pool_layers if layer <= index)


@dataclass(frozen=True)
class Qwen4Exp:
    """Qwen4-Exp's parts beside Qwen3.5's (`models.qwen4_exp`).

    Hyper-connections (`layers.gated_residual`): `streams` copies of the hidden state, each block reading their
    gated mix (a low-rank map of `rank`) and adding its output to each stream by a weight of its own.

    QSA (`layers.qsa_attention`) on `qsa_layers`: an indexer of `index_heads` query heads and one key head,
    `index_head_dim` wide, scores blocks of `compress_ratio` consecutive keys (their raw keys averaged, normed, turned
    by rope at the block's first position) and keeps the `budget / compress_ratio` best complete blocks beside the
    incomplete one's positions; each token's raw index key is one more head of the layer's cache rows.

    Per-layer n-gram embeddings (`layers.ngram_embedding`) on `ngram_layers` (linear-attention layers): each token's
    2- to `ngram_size`-grams hashed into `heads_per_ngram` tables each (`ngram_vocab_base` and up, `ngram_seed`), a
    gated value per stream, a convolution of `ngram_conv_kernel` taps `ngram_size` apart; `eos_token_id` ends an
    n-gram's context."""

    streams: int
    rank: int
    qsa_layers: tuple[int, ...]
    index_heads: int
    index_head_dim: int
    budget: int
    compress_ratio: int
    ngram_layers: tuple[int, ...] = ()
    ngram_embed_dim: int = 0
    ngram_conv_kernel: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_base: int = 20_000_000
    ngram_vocab_divisor: int = 128
    ngram_seed: int = 1234
    ngram_parts: int = 1
    eos_token_id: int = 0

    @property
    def block_topk(self) -> int:
        """Complete blocks a query keeps at most."""
        return self.budget // self.compress_ratio

    @property
    def dense_positions(self) -> int:
        """The sequence length up to which every query keeps every earlier position (its complete blocks are at
        most `block_topk`)."""
        return self.budget + self.compress_ratio - 1

    def ngram_state_size(self, hidden_size: int) -> int:
        """Float32 values of a sequence's n-gram state in one layer: the convolution's last inputs (`(taps - 1) *
        ngram_size` rows of `streams * hidden_size`), then the last `ngram_size - 1` token ids; 0 without n-grams."""
        if not self.ngram_layers:
            return 0
        history = (self.ngram_conv_kernel - 1) * self.ngram_size
        return history * self.streams * hidden_size + self.ngram_size - 1


@dataclass(frozen=True)
class CompressedAttention:
    """DeepSeek-V4's attention (`layers.compressed_attention`): one shared key-value head of `head_dim` (keys are
    values), rope over its last `rope_dim` dims in interleaved pairs, each query attending over the last `window`
    positions (its own included) plus, on a compressing layer, compressed entries of earlier positions, and a sink
    per head. Layer i compresses every `rates[i]` positions into one entry (0: a sliding-window layer alone): by a
    gated softmax pooling of each window (HCA, `rates[i]` of `hca_rate`) or of two overlapping windows with a
    lightning indexer choosing `index_topk` of the entries per query (CSA, of `index_heads` heads `index_head_dim`
    wide). The compressing layers' rope (queries, keys and entries) has base `compress_rope_theta` (and YaRN's
    `compress_yarn`), the sliding ones' the model's `rope_theta`. The heads' outputs go through `o_groups` grouped
    projections to `o_lora_rank` each, then one to the hidden size. `hash_layers` route their experts by the token's
    id (`tid2eid`) instead of by score."""

    kinds: tuple[Literal["sliding", "csa", "hca"], ...]
    rates: tuple[int, ...]
    window: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    compress_rope_theta: float
    compress_yarn: Yarn | None = None
    hash_layers: tuple[int, ...] = ()

    def cache_row(self, index: int, head_dim: int) -> int:
        """Layer `index`'s cache row width (each half; `layers.compressed_attention.CacheFields`)."""
        kind = self.kinds[index]
        if kind == "sliding":
            return head_dim
        if kind == "hca":
            return 2 * head_dim
        return max(4 * head_dim, 2 * head_dim + 5 * self.index_head_dim)


@dataclass(frozen=True)
class HyperConnections:
    """Hyper-connections (HY-V4's independent form; `layers.hyper_connections`): the residual stream is `streams`
    copies of the hidden state (the embedding's, at first). Before each attention and each MLP a learned map of the
    RMS-normalised streams gives per token `streams` weights `pre` (`sigmoid(.) + eps`), which sum the streams into
    the block's input, and `streams` weights `post` (`post_scale * sigmoid(.) + eps`), by which the block's output
    is added to each stream. The model's last map (`hc_head`) sums the streams into the final norm's input."""

    streams: int
    post_scale: float = 2.0
    eps: float = 1e-6
    # DeepSeek-V4's manifold-constrained form (mHC; > 0): each map also gives an N x N matrix `comb`, the softmax of
    # its logits plus `eps` made doubly stochastic by this many Sinkhorn-Knopp rounds, which mixes the streams before
    # the block's output is added (`streams' = comb^T streams + post * out`), `post` without `eps`.
    sinkhorn_iters: int = 0


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet's shape (Qwen3-Next, Qwen3.5; `layers.gated_deltanet`): the linear attention of `layers`,
    whose state per sequence is a short convolution's last `conv_kernel - 1` inputs over q, k and v
    (`conv_dim` channels) and one `key_head_dim x value_head_dim` matrix per value head, in place of a KV cache.
    Each of `num_key_heads` key heads serves `num_value_heads / num_key_heads` value heads. OLMo Hybrid's: the write
    strength doubled (`beta_scale` 2: its `allow_neg_eigval`) and the gated norm's epsilon its own (`norm_eps`; 0:
    the model's `rms_norm_eps`). Kimi Delta Attention's (`kimi_delta`, Kimi Linear's; `layers.kimi_delta`): a key head
    per value head, a decay per key channel, low-rank decay and output-gate projections, the norm gated by sigmoid.
    Ling 3's: those projections whole (`full_rank_gates`) and the decay bounded below by `decay_bound` (its safe
    gate, negative; 0: Kimi's unbounded softplus form)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layers: tuple[int, ...]
    beta_scale: float = 1.0
    norm_eps: float = 0.0
    kimi_delta: bool = False
    full_rank_gates: bool = False
    decay_bound: float = 0.0
    # Qwen4-Exp: float32 values each layer's state row holds after the layer's own (its per-layer n-gram
    # embeddings' convolution and token context, `Qwen4Exp.ngram_state_size`; kept on every linear layer).
    extra_state: int = 0

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def own_state_size(self) -> int:
        """Float32 values of one sequence's state in one layer that the rule itself reads: the convolution's
        inputs, then the matrices."""
        return self.conv_dim * (self.conv_kernel - 1) + self.num_value_heads * self.key_head_dim * self.value_head_dim

    @property
    def state_size(self) -> int:
        """Float32 values one sequence's state holds in one layer: `own_state_size`, then `extra_state`."""
        return self.own_state_size + self.extra_state

    def sharded(self, size: int) -> LinearAttention:
        """One rank's share under tensor parallelism over `size` ranks: its block of the key heads and of the value
        heads (each value head with the key head it reads); ValueError unless `size` divides both."""
        if self.num_key_heads % size or self.num_value_heads % size:
            raise ValueError(f"linear attention's {self.num_key_heads} key and {self.num_value_heads} value heads "
                             f"must both be divisible by the tensor-parallel size ({size})")  # fmt: skip
        return replace(self, num_key_heads=self.num_key_heads // size, num_value_heads=self.num_value_heads // size)


@dataclass(frozen=True)
class ShortConvolution:
    """LFM2's gated short convolution (`layers.short_conv`) on `layers`: `in_proj` gives B, C and x, each `channels`
    wide; the layer's output is `out_proj(C * conv(B * x))`, conv a depthwise causal convolution of `conv_kernel`
    taps without a bias or an activation. Its state per sequence is the last `conv_kernel - 1` values of `B * x`."""

    channels: int
    conv_kernel: int
    layers: tuple[int, ...]

    @property
    def state_size(self) -> int:
        """Float32 values one sequence's state holds in one layer."""
        return self.channels * (self.conv_kernel - 1)

    def sharded(self, size: int) -> ShortConvolution:
        """One rank's share under tensor parallelism over `size` ranks: a block of the channels; ValueError unless
        `size` divides them."""
        if self.channels % size:
            raise ValueError(f"the short convolution's {self.channels} channels must be divisible by the "
                             f"tensor-parallel size ({size})")  # fmt: skip
        return replace(self, channels=self.channels // size)


@dataclass(frozen=True)
class Mamba2:
    """Mamba-2's shape (Granite 4.0's hybrids; `layers.mamba2`) on `layers`: `in_proj` gives the gate z (`inner`
    wide), x (`num_heads` heads `head_dim` wide), B and C (`groups` groups `state_dim` wide; each group serves
    `num_heads / groups` consecutive heads) and a time step per head; a depthwise causal convolution of
    `conv_kernel` taps (with a bias where `conv_bias`) and SiLU over x, B and C. Its state per sequence is the
    convolution's last `conv_kernel - 1` inputs and one `head_dim x state_dim` matrix per head (`ladle_kernels.mamba2`).

    `gated_norm`: the scan's gated output `y * silu(z)` is RMS-normalised over each group's heads (with a weight);
    False (Falcon-H1 without `mamba_rms_norm`): taken as it is. `beside_attention` (Falcon-H1): each of `layers` runs
    attention beside its Mamba-2, keeping K/V in the paged cache as well as the state."""

    num_heads: int
    head_dim: int
    state_dim: int
    groups: int
    conv_kernel: int
    conv_bias: bool
    layers: tuple[int, ...]
    gated_norm: bool = True
    beside_attention: bool = False

    @property
    def inner(self) -> int:
        """Width of x, of z and of the output projection's input."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C side by side."""
        return self.inner + 2 * self.groups * self.state_dim

    @property
    def state_size(self) -> int:
        """Float32 values one sequence's state holds in one layer: the convolution's inputs, then the matrices."""
        return self.conv_dim * (self.conv_kernel - 1) + self.num_heads * self.head_dim * self.state_dim

    def sharded(self, size: int) -> Mamba2:
        """One rank's share under tensor parallelism over `size` ranks: a block of the heads and the groups they read
        (a block of the groups, or where there are fewer groups than ranks the one group its heads share, then held by
        several ranks); ValueError unless `size` divides the heads, and the groups or by them."""
        if self.num_heads % size or (self.groups % size and size % self.groups):
            raise ValueError(f"Mamba-2's {self.num_heads} heads in {self.groups} groups cannot be split over "
                             f"{size} tensor-parallel ranks")  # fmt: skip
        return replace(self, num_heads=self.num_heads // size, groups=max(self.groups // size, 1))


@dataclass(frozen=True)
class Mamba1:
    """Mamba-1's shape (Jamba's, Mamba's and Falcon Mamba's layers; `layers.mamba1`) on `layers`: `in_proj` gives x and
    the gate z (`inner` wide each); a depthwise causal convolution of `conv_kernel` taps (with a bias where
    `conv_bias`) and SiLU over x; `x_proj` gives the time step's low-rank input (`dt_rank` wide), B and C
    (`state_dim` each), each RMS-normalised at `inner_norm_eps` where `inner_norms` says: with a weight ("weighted",
    Jamba's), without one ("weightless", Falcon Mamba's) or not ("none", Mamba's); `dt_proj` (with a bias) lifts the
    time step to every channel. Its state per
    sequence is the convolution's last `conv_kernel - 1` inputs and a `state_dim`-wide row per channel
    (`ladle_kernels.mamba1`)."""

    inner: int
    state_dim: int
    conv_kernel: int
    dt_rank: int
    conv_bias: bool
    layers: tuple[int, ...]
    inner_norms: Literal["weighted", "weightless", "none"] = "weighted"
    inner_norm_eps: float = 1e-6
    # Zamba's multi-head Mamba-1: its channels in `heads` heads, each with an `x_proj` and a `dt_proj` of its own (so
    # its own time step input, B and C); 1: one for all of them.
    heads: int = 1

    @property
    def state_size(self) -> int:
        """Float32 values one sequence's state holds in one layer: the convolution's inputs, then the rows."""
        return self.inner * (self.conv_kernel - 1) + self.inner * self.state_dim

    def sharded(self, size: int) -> Mamba1:
        """One rank's share under tensor parallelism over `size` ranks: a block of the channels (of the heads, with
        several); ValueError unless `size` divides them."""
        if self.inner % size or (self.heads % size and self.heads > 1):
            raise ValueError(f"Mamba's {self.inner} channels in {self.heads} heads must be divisible by the "
                             f"tensor-parallel size ({size})")  # fmt: skip
        return replace(self, inner=self.inner // size, heads=max(1, self.heads // size) if self.heads > 1 else 1)


@dataclass(frozen=True)
class SharedBlocks:
    """Zamba2's shared transformer blocks: before the Mamba-2 of each of `hybrid_layers` (checkpoint layers) runs one
    of `blocks` attention + MLP blocks (the k-th such use block `k % blocks`), over `cat(h, e)` (`e` the token's
    embedding), with low-rank adapters of its own use (`adapter_rank`: on the MLP's gate/up always, on q, k and v
    where `attention_adapters`) and a linear map of its own; its output joins the Mamba-2's input. The model's
    layers are those uses and the Mamba-2 layers unrolled (`layers`: each a checkpoint layer and whether it is the
    block's use, the block's first), a use a layer of K/V, a Mamba-2 one of states."""

    hybrid_layers: tuple[int, ...]
    blocks: int
    adapter_rank: int
    attention_adapters: bool

    def layers(self, checkpoint_layers: int) -> list[tuple[int, bool]]:
        """The unrolled layers of a model of `checkpoint_layers`: `(checkpoint layer, is a shared block's use)`."""
        return [(layer, use) for layer in range(checkpoint_layers)
                for use in ((True, False) if layer in self.hybrid_layers else (False,))]  # fmt: skip


@dataclass(frozen=True)
class LoopedNGpt:
    """Dory's (NVIDIA's looped nGPT): every hidden state on the unit sphere, each block's update an interpolation
    towards its normalised output, and a middle section of `recurrent_layers` checkpoint layers run `loops` times
    after the first `input_layers`, each pass from its previous one's output plus the input section's. The model's
    layers are those passes unrolled (`ModelConfig.num_hidden_layers` counts each pass's, each a KV cache of its
    own); `layer_of(index)` is the checkpoint layer an unrolled layer runs. Its learned scales are stored as
    `s` and read as `s * scale / initializer_range` (`initializer_range`, `alpha_init`: its config's)."""

    input_layers: int
    recurrent_layers: int
    loops: int
    initializer_range: float
    alpha_init: float

    def layer_of(self, index: int) -> int:
        """The checkpoint layer that unrolled layer `index` runs."""
        past = index - self.input_layers
        if past < 0:
            return index
        if past < self.recurrent_layers * self.loops:
            return self.input_layers + past % self.recurrent_layers
        return index - self.recurrent_layers * (self.loops - 1)

    def loop_start(self, index: int) -> bool:
        """Whether unrolled layer `index` begins a pass of the recurrent section."""
        past = index - self.input_layers
        return 0 <= past < self.recurrent_layers * self.loops and past % self.recurrent_layers == 0


# The shapes of the layers that keep a fixed-size state per running sequence in place of a KV cache.
@dataclass(frozen=True)
class Lightning:
    """MiniMax-01's lightning attention (`layers.lightning_attention`) on `layers`: linear attention of `heads` heads
    of `head_dim` over SiLU'd q, k and v, each head's state a `head_dim x head_dim` matrix decayed by a fixed rate per
    token (`slopes`). Its state per sequence is those matrices, in float32. `total_layers` and `total_heads` (the
    model's, whatever a rank holds) fix the rates; `first_head`: the first of this rank's heads."""

    heads: int
    head_dim: int
    layers: tuple[int, ...]
    total_layers: int
    block_size: int = 256
    total_heads: int = 0
    first_head: int = 0

    @property
    def state_size(self) -> int:
        """Float32 values one sequence's state holds in one layer."""
        return self.heads * self.head_dim * self.head_dim

    def sharded(self, size: int, rank: int = 0) -> Lightning:
        """Rank `rank`'s share under tensor parallelism over `size` ranks: a block of the heads; ValueError unless
        `size` divides them."""
        if self.heads % size:
            raise ValueError(f"lightning attention's {self.heads} heads must be divisible by the tensor-parallel size "
                             f"({size})")  # fmt: skip
        per_rank = self.heads // size
        return replace(self, heads=per_rank, total_heads=self.total_heads or self.heads, first_head=rank * per_rank)

    def slopes(self, layer: int) -> list[float]:
        """Each of this share's heads' decay rate on `layer` (transformers' `MiniMaxLightningAttention`): head h's
        `(2^(-8 / H))^(h + 1)` times `1 - layer / (L - 1 + 1e-5) + 1e-5`."""
        heads = self.total_heads or self.heads
        base = 1 / (2 ** (8 / heads))
        factor = 1 - layer / (self.total_layers - 1 + 1e-5) + 1e-5
        return [base ** (h + 1) * factor for h in range(self.first_head, self.first_head + self.heads)]


@dataclass(frozen=True)
class RGLRU:
    """RecurrentGemma's (Griffin's) recurrent blocks (`layers.rg_lru`) on `layers`: `linear_x` and `linear_y` give
    `width` channels each, a depthwise causal convolution of `conv_width` taps (with a bias) runs over x, then the
    RG-LRU: per block of `width / heads` channels, an input gate and a recurrence gate (block-diagonal projections),
    `a = exp(-8 * gate_a * softplus(recurrent_param))`, `h = a h + sqrt(1 - a²) (x * gate_x)` (at position 0: `h = x *
    gate_x`), its output times `gelu_tanh(y)` then `linear_out`. Its state per sequence: the convolution's last
    `conv_width - 1` inputs and `h`, float32."""

    width: int
    heads: int
    conv_width: int
    layers: tuple[int, ...]

    @property
    def state_size(self) -> int:
        """Float32 values one sequence's state holds in one layer: the convolution's inputs, then `h`."""
        return self.width * self.conv_width

    def sharded(self, size: int) -> RGLRU:
        """One rank's share under tensor parallelism over `size` ranks: a block of the gates' blocks (and their
        channels); ValueError unless `size` divides them."""
        if self.heads % size:
            raise ValueError(f"RG-LRU's {self.heads} blocks must be divisible by the tensor-parallel size ({size})")
        return replace(self, width=self.width // size, heads=self.heads // size)


# How a BitNet checkpoint stores its ternary projections (`ModelConfig.ternary_projections`, `models.bitnet`).
TernaryForm = Literal["packed", "scaled", "online"]


@dataclass(frozen=True)
class NormedResiduals:
    """MiniMax-01's block: each sublayer adds to its *normalised* input, both scaled: `n = norm(x); x' = alpha n +
    beta f(n)` with the full-attention, lightning-attention and MLP sublayers' own (alpha, beta)."""

    full: tuple[float, float] = (1.0, 1.0)
    linear: tuple[float, float] = (1.0, 1.0)
    mlp: tuple[float, float] = (1.0, 1.0)


RecurrentShape = LinearAttention | ShortConvolution | Mamba2 | Mamba1 | Lightning | RGLRU | MLstm | Rwkv


@dataclass(frozen=True)
class FalconH1Scales:
    """Falcon-H1's µP multipliers inside its layers (its embeddings' and logits' are `ModelConfig.
    embedding_multiplier` and `logit_scale`), which `models.falcon_h1` folds into the weights they multiply as it
    loads them: the attention's input (`attention_in`: q, k and v's weights), its keys (`key`), its output
    (`attention_out`); Mamba-2's input (`ssm_in`), the five parts of its input projection's output (`ssm`: z, x, B, C
    and the time step) and its output (`ssm_out`); the MLP's gate (`mlp_gate`) and its output (`mlp_down`)."""

    attention_in: float = 1.0
    key: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    ssm_out: float = 1.0
    mlp_gate: float = 1.0
    mlp_down: float = 1.0


@dataclass(frozen=True)
class Gemma4Layout:
    """What Gemma 4's text model (`layers.gemma4`) changes in Gemma 3's block, beyond plain `w` norms (no offset),
    unscaled attention scores and each head's values RMS-normalised without a weight:

    - its full-attention layers (those without a window) have heads `global_head_dim` wide, `global_kv_heads` KV
      heads, and with `keys_as_values` no v_proj: a head's values are its key projection (before the key's norm
      and rope); their rope is "proportional": the first `global_rope_angles` of the head's `global_head_dim / 2`
      angles turn at `theta^(-2i / global_head_dim)` (`ModelConfig.rope_theta`), the rest not at all;
    - layer i attends over the K/V of layer `kv_sources[i]`: its own, or, for the last layers, those of the last
      earlier layer of its kind (KV sharing: such a layer has no K/V projection and writes no cache);
    - the layers in `wide_mlp_layers` have an MLP twice `intermediate_size` wide;
    - per-layer inputs (`per_layer_input_size` > 0): each token gets a `per_layer_input_size`-wide input per layer,
      looked up in a table of `per_layer_vocab_size` rows and mixed with a projection of its embedding, which each
      layer gates into its output after the MLP; every layer's output is then scaled by its `layer_scalar`;
    - a mixture of experts beside every layer's dense MLP (`experts` > 0): `experts_per_token` of `experts` GELU
      experts `expert_intermediate_size` wide, chosen by a router of its own from the residual stream."""

    global_head_dim: int
    global_kv_heads: int
    keys_as_values: bool
    global_rope_angles: int
    kv_sources: tuple[int, ...]
    wide_mlp_layers: tuple[int, ...] = ()
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0


@dataclass(frozen=True)
class Gemma4Assistant:
    """A Gemma 4 assistant (`speculative.gemma4_assistant`): a small Gemma 4 text model that drafts for its Gemma 4
    target from the target's own K/V (each of its layers attends over the target's last unshared layer of its kind)
    and the target's last hidden state: its input `pre_projection(cat(target_embedding(token), hidden))` (the hidden
    `backbone_hidden_size` wide), its next hidden `post_projection(out)`. With `centroids` > 0 its logits are its
    tied embedding's dot products with the tokens of the `centroid_top_k` best of `centroids` clusters alone (its
    `token_ordering` lists each cluster's tokens); else every token's."""

    backbone_hidden_size: int
    centroids: int = 0
    centroid_top_k: int = 0


@dataclass(frozen=True)
class AltUp:
    """What Gemma 3n's text model (`layers.gemma3n`) adds to Gemma 4's layers (`Gemma4Layout`, without the per-layer
    output scale): the residual is `streams` copies of the hidden state (AltUp, arXiv 2301.13310), made from the
    embeddings by projections of their own, each scaled to the embeddings' magnitude; each layer predicts every stream
    as a mix of all of them (`prediction_coefs` of a router's `tanh` over the `active` one), runs its block on the
    active prediction, corrects every stream by the block's innovation (`correction_coefs`), and adds its per-layer
    input (gated from the active corrected stream, times `correct_output_scale` with `correct_scale`) to the others;
    the model's output is the mean of the streams (the others projected back, at the first's magnitude). Beside the
    attention, a low-rank residual of `laurel_rank` (LAuReL) joins its output halfway (`/ sqrt(2)`). The MLP of a
    layer i with `sparsity[i]` > 0 keeps only the gate values above their mean plus `norm.ppf(sparsity[i])` times their
    standard deviation (shifted down by that cutoff) before its GELU."""

    streams: int
    active: int
    correct_scale: bool
    laurel_rank: int
    sparsity: tuple[float, ...]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a transformer, independent of where its weights come from: a decoder (Llama, Qwen2, Qwen3), or
    an encoder (BERT: `encoder` set), which attends both ways, has no KV cache to keep and only pools.
    """

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2/2.5: bias on the q, k and v projections (`o_proj_bias`: and o_proj's).
    attention_out_bias: bool | None = None  # Seed-OSS: o_proj's bias, set apart from q/k/v's (None: `o_proj_bias`)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rope.
    qk_norm_after_rope: bool = False  # Hunyuan: those norms after rope (which mixes the weighted dims' pairs)
    # StableLM 2 (12B): a LayerNorm without a bias over each head of q and k before rope, a weight per head;
    # Persimmon's with a bias (`qk_layer_norm_bias`), one weight and bias for every head.
    qk_layer_norm: bool = False
    qk_layer_norm_bias: bool = False
    # OLMoE: the q/k norms span the whole projection (all heads at once), and q, k and v are clamped to
    # [-clip_qkv, clip_qkv] after them (0: not clamped).
    qk_norm_whole: bool = False
    clip_qkv: float = 0.0
    rope_scaling: RopeScaling | LongRope | Yarn | None = None
    # Phi-3 / Phi-4-mini: rope rotates only the first `partial_rotary_factor` of each head's dims; the rest pass.
    partial_rotary_factor: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    # Encoders (BERT): post-norm LayerNorms with this eps, learned absolute positions, token types, a GELU MLP.
    encoder: bool = False
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    gelu_tanh: bool = False  # the MLP's GELU is the tanh approximation (hidden_act gelu_new)
    # A cross-encoder (`BertForSequenceClassification`): its classifier's outputs over the CLS token; 0 without one.
    num_labels: int = 0
    # Mixture-of-experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss; `layers.moe`): a layer's MLP is `num_experts`
    # experts of `moe_intermediate_size` each, `num_experts_per_tok` of them chosen per token by a softmax router
    # (top-k weights renormalised to sum to 1 with `norm_topk_prob`), plus, with `shared_expert_intermediate_size`, an
    # expert every token goes through, scaled by a sigmoid gate (Qwen2-MoE). `dense_layers` keep a dense MLP of
    # `intermediate_size` (Qwen's `mlp_only_layers` and `decoder_sparse_step`). 0 experts: a dense model. gpt-oss:
    # the router and the experts' projections have biases (`expert_biases`), and with `swiglu_limit` > 0 the experts'
    # activation is its clamped SwiGLU: gate clamped to <= limit, up to [-limit, limit], then
    # `gate * sigmoid(swiglu_alpha * gate) * (up + swiglu_up_offset)` (`ladle_kernels.reference.clamped_swiglu`;
    # gpt-oss's offset 1, HY-V4's 0: its experts' plain SwiGLU, clamped).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    expert_biases: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    swiglu_up_offset: float = 1.0
    # gpt-oss: a learned sink logit per query head, one more term of each attention softmax's denominator.
    attention_sinks: bool = False
    # SmolLM3 and Llama 4: the layers whose attention uses no rope at all (NoPE; `no_rope_layers` holds 0 for them).
    nope_layers: tuple[int, ...] = ()
    # Llama 4: on its rope layers each head of q and k is RMS-normalised without a weight (`qk_unit_norm`;
    # transformers' L2 norm after rope, the same since rope keeps a head's norm); on its NoPE layers each query is
    # scaled by `1 + nope_temperature_scale * ln(1 + floor((position + 1) / nope_temperature_floor))` (its
    # attention temperature tuning; 0: none); its rope layers attend within chunks of `attention_chunk` positions
    # (0: none; `AttentionMetadata.chunked`).
    qk_unit_norm: bool = False
    nope_temperature_scale: float = 0.0
    nope_temperature_floor: int = 1
    attention_chunk: int = 0
    # Granite: each block's attention and MLP outputs are scaled by `residual_multiplier` before their residual
    # adds, and the logits divided by `logits_scaling` (its embeddings by `embedding_multiplier` and its scores by
    # `attention_scale`, the fields above, from its `embedding_multiplier` and `attention_multiplier`).
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # OLMo 2: no norm before the attention or the MLP; each one's output normalised before its residual add.
    post_norms: bool = False
    # Cohere: mean-centred LayerNorms (no bias) in place of RMSNorms (`rms_norm_eps` is their epsilon), one per block
    # feeding the attention and the MLP in parallel (`parallel_block`), and the logits times `logit_scale`.
    layer_norm: bool = False
    parallel_block: bool = False
    logit_scale: float = 1.0
    # GPT-NeoX: the parallel block's MLP reads a norm of its own (`post_attention_layernorm`), `h += attn(ln1(h)) +
    # mlp(ln2(h))`. OLMo: LayerNorms without a weight or a bias (`norm_weightless`).
    parallel_mlp_norm: bool = False
    norm_weightless: bool = False
    # GPT-2, GPT-BigCode: a learned embedding of each position added to its token's (`embed_positions`, of
    # `max_position_embeddings` rows) and no rope on any layer. GPT-2's checkpoints hold each projection's weight
    # transposed, `[in, out]` (its Conv1D: `transposed_weights`).
    absolute_positions: bool = False
    transposed_weights: bool = False
    # GPT-1, OPT-350M: post-LN blocks, each norm after its residual add, no final norm (`layers.post_layer_norm`);
    # OPT-350M's embeddings `embedding_size` wide (0: the model's), projected in and out.
    post_layer_norm: bool = False
    embedding_size: int = 0
    # BLOOM, MPT, Falcon-RW: attention without rope, every score biased linearly by distance (ALiBi: `layers.alibi`;
    # "": none), the slopes BLOOM's, MPT's (from `alibi_bias_max`) or Falcon-RW's (BLOOM's in bfloat16, scaled with
    # the scores). BLOOM: the embeddings LayerNorm'd (with a bias) before the first layer (`embedding_layer_norm`).
    alibi: Literal["", "bloom", "mpt", "falcon"] = ""
    alibi_bias_max: float = 8.0
    embedding_layer_norm: bool = False
    # XGLM: those positions sinusoidal (fairseq's table, computed at load as `embed_positions`: `models.gpt_neox`).
    sinusoidal_positions: bool = False
    # PhiMoE: its LayerNorms have a bias (`layer_norm_bias`), its LM head too (`lm_head_bias`). Jais 2: biased
    # LayerNorms and biases on its ungated MLP's projections (`mlp_bias`).
    layer_norm_bias: bool = False
    lm_head_bias: bool = False
    mlp_bias: bool = False
    # Apertus 1.5: an LM head of the vocabulary's first `output_vocab_size` rows alone (its text tokens; 0: every
    # row), the logits of the others -inf, so the logits keep the vocabulary's width.
    output_vocab_size: int = 0
    # A multimodal checkpoint's text model (`hf_multimodal`): its weights read under text-only names, its towers not.
    multimodal: MultimodalCheckpoint | None = None
    # DeepSeek-V3 (and Kimi K2, Mistral 4): multi-head latent attention (`head_dim` is then the cache's, a latent
    # and its rope key, under one KV head: `layers.mla`), and its router (`grouped_router`,
    # `layers.moe.GroupedTopkRouter`): sigmoid scores (`moe_scoring`; Mistral 4's softmax), a learned bias added to
    # them for the choice only (`router_score_bias`), the top-k taken within the best `moe_topk_groups` of
    # `moe_groups` groups of experts (each group scored by the sum of its two best, or DeepSeek-V2's best:
    # `moe_group_score`), the chosen scores renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`;
    # its shared experts have no gate (`shared_expert_gated` off).
    latent_attention: LatentAttention | None = None
    # DeepSeek-V3.2 and GLM-5: latent attention over the positions an indexer picks (`SparseIndexer`); the cache's
    # `head_dim` then also fits each token's index key beside its latent (`layers.sparse_indexer`).
    sparse_indexer: SparseIndexer | None = None
    # HY-V4: several residual streams mixed around each block (`HyperConnections`; None: one plain residual).
    hyper_connections: HyperConnections | None = None
    # DeepSeek-V4: its sliding and compressed attention (`CompressedAttention`; `head_dim` its heads' width, the
    # cache's rows per layer `CompressedAttention.cache_row`), over mHC streams and experts routed by
    # sqrt(softplus) scores (`moe_scoring` "sqrtsoftplus"), the first layers' by token id.
    compressed_attention: CompressedAttention | None = None
    # Mistral 4 and Ministral 3: their queries scaled by `1 + beta * ln(1 + floor(position / positions))` (Llama 4's
    # attention temperature) on every layer, beta `query_scale_beta` (0: none) and `query_scale_positions` its rope's
    # original context.
    query_scale_beta: float = 0.0
    query_scale_positions: int = 1
    grouped_router: bool = False
    # PhiMoE's sparsemixer ("sparsemixer", `layers.moe.sparsemixer_route`): the top-2 logits, each weighted by the
    # softmax over the logits within `2 * router_jitter` of it (relatively), the first's taken out for the second.
    moe_scoring: Literal["softmax", "sigmoid", "sparsemixer", "sqrtsoftplus"] = "softmax"
    router_jitter: float = 0.0
    router_score_bias: bool = False
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_group_score: Literal["top2", "max"] = "top2"
    routed_scaling_factor: float = 1.0
    moe_renorm_epsilon: float = 1e-20  # added to the chosen scores' sum that renormalises them (LFM2-MoE: 1e-6)
    # The grouped router's choice by logit plus bias rather than by sigmoid score plus bias (Kolibri-1's); the
    # weights are the chosen experts' sigmoid scores either way.
    moe_choice_on_logits: bool = False
    shared_expert_gated: bool = True
    # The shared experts' output times this (Cohere2-MoE's "average": routed and shared halves, the routed half
    # through `routed_scaling_factor`), folded into their down projection at load (`models.cohere`).
    shared_expert_scale: float = 1.0
    # Llama 4's router: the sigmoid of each chosen expert's logit scales that expert's input (not its output).
    moe_input_scaled: bool = False
    # LongCat-Flash: every layer's MLP dense, and a mixture of experts beside each pair of layers (read off the first
    # one's normalised MLP input, added to the second one's output: `models.longcat_flash`); its router also picks
    # among `zero_experts` more that pass their input through (their weight times it).
    shortcut_experts: bool = False
    zero_experts: int = 0
    # Beam: its blocks' outputs added to the residual stream scaled by depth (`depth_scaled_residuals`: the k-th add,
    # the attention's k = 2(i + 1) and the MLP's 2(i + 1) + 1 on layer i, is `out / sqrt(k) + stream * sqrt((k - 1) /
    # k)`); each head's output times the sigmoid of its own `g_proj` rows (a value a dim) plus a bias a head
    # (`attention_sigmoid_gate`); on its NoPE layers each query times `(1 + (p + 1) / nope_query_positions) **
    # nope_query_power` (scalable softmax; 0: none).
    depth_scaled_residuals: bool = False
    attention_sigmoid_gate: bool = False
    nope_query_power: float = 0.0
    nope_query_positions: int = 2048
    # Ergo: each residual add gated by a learned vector w of its own (`residual_gates`: `g = sigmoid(w)`, `out * g + h *
    # sqrt(1 + g) * exp(-softplus(w) / 2)`, the layer's `attention_residual_gate` and `feedforward_residual_gate`);
    # each chosen expert's output RMS-normalised with that expert's own weight before its routing weight scales it,
    # the shared expert's with a norm of its own (`expert_output_norms`); the full-attention layers' scores times
    # `full_attention_scale`.
    residual_gates: bool = False
    expert_output_norms: bool = False
    full_attention_scale: float = 1.0
    # JetMoE: each layer's attention a mixture of attention experts (`layers.mixture_of_attention`: `num_experts` of
    # them, `num_experts_per_tok` a token, each giving a query per KV head and an output projection) as its MLP is
    # of MLP experts, and a bias added to each mixture's output (`moe_output_bias`).
    mixture_of_attention: bool = False
    # DiffLlama: differential attention (`layers.differential_attention`): each pair of head halves' softmaxes over
    # the two halves of the values, the second's subtracted by a learned lambda, normalised.
    differential_attention: bool = False
    moe_output_bias: bool = False
    # MiniMax-M3 (and DeepSeek-V4's shared experts): the dense MLPs and shared experts run the experts' clamped
    # SwiGLU (`swiglu_limit`, `swiglu_alpha`, `swiglu_up_offset`) too.
    clamped_mlps: bool = False
    # MiniMax-M3: block-sparse attention on some layers (`BlockSparse`; None: dense attention everywhere).
    block_sparse: BlockSparse | None = None
    # Qwen4-Exp: hyper-connections, QSA indexed attention and per-layer n-gram embeddings (`Qwen4Exp`).
    qwen4_exp: Qwen4Exp | None = None
    # Kolibri-1.1: weightless indexed attention over NVFP4 keys, some layers over an earlier one's K/V (`KolibriIndex`).
    kolibri_index: KolibriIndex | None = None
    # A.X K1: an RMSNorm over each sparse layer's MoE output (routed and shared experts: `mlp.post_mlp_layernorm`).
    moe_output_norm: bool = False
    # Sliding-window attention (Mistral, Mixtral, Phi-3, Qwen's `use_sliding_window`, Gemma 2/3): layer i's token at
    # position p attends to positions (p - layer_windows[i], p] only; 0 (or no entry): to all of [0, p].
    layer_windows: tuple[int, ...] = ()
    # Gemma 2 and 3: RMSNorm weights stored as w and applied as `norm_offset + w`; embeddings times
    # `embedding_multiplier` (sqrt(hidden_size), rounded to the weights' dtype); a GELU (tanh) gate; "sandwich" norms
    # (the attention's and the MLP's outputs normalised before their residual adds, beside the usual pre-norms);
    # attention scores scaled by `attention_scale` (0: head_dim ** -0.5). Gemma 3: windowed layers' rope with base
    # `local_rope_theta` (0: `rope_theta`) and the others' positions divided by `rope_linear_factor` (linear rope
    # scaling). Gemma 2: attention scores s soft-capped to `c * tanh(s / c)` with c = `attention_softcap`, and the
    # logits likewise with `final_logit_softcap` (0: no cap).
    norm_offset: float = 0.0
    embedding_multiplier: float = 1.0
    # NanoChat: the embeddings RMS-normalised (no weight) before the first layer.
    embedding_norm: bool = False
    # The dense MLP's activation: gated, `down(act(gate(x)) * up(x))` with SiLU or GELU (tanh); or ungated
    # `down(act(up(x)))` (`layers.mlp.UngatedMLP`) with Nemotron-H's, Arcee's and Jais 2's relu² ("relu2") or
    # Apertus's xIELU, whose four scalars each layer's checkpoint holds ("xielu"), or where `gated_mlp` is off (the
    # GPT-NeoX lineage: StarCoder2's and Phi's GELU (tanh), GPT-NeoX's exact GELU, "gelu"; OPT's ReLU, "relu").
    hidden_act: Literal["silu", "gelu_tanh", "gelu", "relu2", "relu", "xielu"] = "silu"
    gated_mlp: bool = True
    sandwich_norms: bool = False
    attention_scale: float = 0.0
    local_rope_theta: float = 0.0
    # Laguna: the windowed layers' rope turns this share of each head (0: `partial_rotary_factor`, as the others').
    local_partial_rotary_factor: float = 0.0
    # Laguna: each head's attention output times softplus of its own gate projection (`g_proj`), one value per head
    # ("head") or per dim of it ("element"); "": none.
    attention_softplus_gate: Literal["", "head", "element"] = ""
    rope_linear_factor: float = 1.0
    attention_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    # Qwen3-Next and Qwen3.5: hybrids whose `linear_attention.layers` run Gated DeltaNet (a state per sequence, no
    # KV cache) and the rest gated attention: q_proj gives each head its query and as many gate values
    # (`attention_output_gate`), and the attention's output is multiplied by their sigmoid before o_proj.
    linear_attention: LinearAttention | None = None
    attention_output_gate: bool = False
    # LFM2: hybrids whose `short_convolution.layers` run a gated short convolution (a state per sequence, no KV cache).
    short_convolution: ShortConvolution | None = None
    # Granite 4.0's and Nemotron-H's hybrids: `mamba2.layers` run Mamba-2 (a state per sequence, no KV cache);
    # Falcon-H1's run it beside attention in every layer (`Mamba2.beside_attention`), with `falcon_h1`'s multipliers.
    mamba2: Mamba2 | None = None
    falcon_h1: FalconH1Scales | None = None
    # Jamba: `mamba1.layers` run Mamba-1 (a state per sequence, no KV cache).
    mamba1: Mamba1 | None = None
    # MiniMax-01: `lightning.layers` run lightning attention (a state per sequence, no KV cache), in blocks whose
    # residuals are their normalised inputs (`normed_residuals`).
    lightning: Lightning | None = None
    normed_residuals: NormedResiduals | None = None
    # Dory: nGPT blocks on the unit sphere, a recurrent middle section run several times (`models.dory`).
    looped_ngpt: LoopedNGpt | None = None
    # Zamba2: shared attention + MLP blocks before some Mamba-2 layers, each use with adapters of its own
    # (`models.zamba2`).
    shared_blocks: SharedBlocks | None = None
    # RecurrentGemma: `rg_lru.layers` run Griffin's recurrent block (a state per sequence, no KV cache).
    rg_lru: RGLRU | None = None
    # xLSTM: every layer an mLSTM (`MLstm`; a state per sequence, no KV cache).
    mlstm: MLstm | None = None
    # RWKV-4: every layer a time mix and a channel mix over a state per sequence (`Rwkv`; no KV cache).
    rwkv: Rwkv | None = None
    # MiMo-V2-Flash: a KV head count per layer (its windowed layers have twice its full ones'; `layer_kv_heads`), and
    # values narrower than the keys (`value_head_dim` < `head_dim`: v_proj's rows and o_proj's columns padded to
    # `head_dim` with zeros at load, so the cache keeps one row width) and scaled by `value_scale` (folded into v_proj).
    layer_kv_head_counts: tuple[int, ...] = ()
    # Laguna: a query head count per layer (`num_attention_heads_per_layer`; the KV heads the same on every layer).
    layer_q_head_counts: tuple[int, ...] = ()
    value_head_dim: int = 0
    value_scale: float = 1.0
    # LFM3: the full-attention layers' "proportional" rope: of each head's `head_dim / 2` rotation angles only the
    # first `rope_rotated_angles` turn (the others' frequencies 0), over the whole head (0: the plain table).
    rope_rotated_angles: int = 0
    # Cohere Compass: Cohere's block with rope over halves (its checkpoints' q/k rows as they are), where Command's
    # turns interleaved pairs (`models.cohere` reorders their rows at load).
    rope_halves: bool = False
    # Nemotron-H: its checkpoint's blocks, one character each as its `hybrid_override_pattern` writes them ("M"
    # Mamba-2, "*" attention, "-" MLP, "E" Nemotron 3's experts), which `nemotron_blocks` pairs into this config's
    # layers; the layers without an MLP (a mixer not followed by one) are `mlp_free_layers`.
    block_pattern: str = ""
    mlp_free_layers: tuple[int, ...] = ()
    # Gemma 4: its layers' departures from Gemma 3's (per-layer head shapes, shared K/V, per-layer inputs).
    gemma4: Gemma4Layout | None = None
    # A Gemma 4 assistant (`Gemma4Assistant`): a drafter for a Gemma 4 target, not a model served alone; its layers
    # attend over the target's K/V (`Gemma4Layout.kv_sources` all -1).
    assistant: Gemma4Assistant | None = None
    # Gemma 3n: AltUp's streams, LAuReL and the sparse MLPs over Gemma 4's layers (`AltUp`).
    altup: AltUp | None = None
    # BitNet b1.58: an RMSNorm before o_proj (`attn_sub_norm`) and before down_proj (`ffn_sub_norm`), its gated MLP's
    # activation relu² (`hidden_act` "relu2" gated: `models.bitnet`); with `ternary_projections` (its checkpoints'
    # `quantization_config` "bitnet": how they store them, "packed", "scaled" or "online") every projection's weight
    # is ternary times a scale, and its input rounded to int8 per token (by its largest magnitude) before it, as
    # BitNet's `BitLinear` computes it; "": float projections.
    sub_norms: bool = False
    ternary_projections: TernaryForm | Literal[""] = ""
    # A.X K2: each layer's input norm, and a sparse layer's norm before its MLP, gated by the sigmoid of a rank
    # `gated_norm_rank` MLP of its output (`layers.norm.GatedRMSNorm`; 0: plain norms).
    gated_norm_rank: int = 0

    def is_global_layer(self, index: int) -> bool:
        """Whether layer `index` is one of Gemma 4's full-attention layers, which have a head shape of their own."""
        return self.gemma4 is not None and self.attention_window(index) == 0

    def layer_head_dim(self, index: int) -> int:
        """Layer `index`'s head dim: `head_dim`, a Gemma 4 full-attention layer's own, or DeepSeek-V4's cache row."""
        if self.compressed_attention is not None:
            return self.compressed_attention.cache_row(index, self.head_dim)
        return self.gemma4.global_head_dim if self.gemma4 is not None and self.is_global_layer(index) else self.head_dim

    def layer_kv_heads(self, index: int) -> int:
        """Layer `index`'s KV heads: `num_key_value_heads`, a Gemma 4 full-attention layer's own, or where the
        layers' counts differ otherwise its entry of `layer_kv_head_counts`."""
        if self.gemma4 is not None and self.is_global_layer(index):
            return self.gemma4.global_kv_heads
        if self.layer_kv_head_counts:
            return self.layer_kv_head_counts[index]
        return self.num_key_value_heads

    def layer_index_heads(self, index: int) -> int:
        """The heads layer `index` keeps in the paged cache beside its KV heads, on every rank: 1 on a MiniMax-M3
        block-sparse layer or a Qwen4-Exp QSA layer, whose key half holds each token's index key (`BlockSparse`,
        `Qwen4Exp`), else 0."""
        if self.qwen4_exp is not None:
            return int(index in self.qwen4_exp.qsa_layers)
        return int(self.block_sparse is not None and index in self.block_sparse.layers)

    def layer_q_heads(self, index: int) -> int:
        """Layer `index`'s query heads: `num_attention_heads`, or where the layers' counts differ its entry of
        `layer_q_head_counts`."""
        return self.layer_q_head_counts[index] if self.layer_q_head_counts else self.num_attention_heads

    def kv_source(self, index: int) -> int:
        """The layer whose K/V layer `index` attends over: itself, unless it shares an earlier one's (Gemma 4,
        Kolibri-1.1)."""
        if self.kolibri_index is not None:
            return self.kolibri_index.kv_sources[index]
        return self.gemma4.kv_sources[index] if self.gemma4 is not None else index

    def qkv_parts(self, index: int) -> int:
        """How many of q, k and v layer `index`'s fused `qkv_proj` holds, in that order: 1 where it attends over an
        earlier layer's K/V (`kv_source`: the queries alone), 2 on a Gemma 4 full-attention layer whose values are
        its keys' projection (`Gemma4Layout.keys_as_values`), else 3."""
        if self.kv_source(index) != index:
            return 1
        keys_as_values = self.gemma4 is not None and self.gemma4.keys_as_values and self.is_global_layer(index)
        return 2 if keys_as_values else 3

    def layer_intermediate_size(self, index: int) -> int:
        """Layer `index`'s dense MLP width: `intermediate_size`, twice that for Gemma 4's wide layers."""
        wide = self.gemma4 is not None and index in self.gemma4.wide_mlp_layers
        return 2 * self.intermediate_size if wide else self.intermediate_size

    def is_linear_layer(self, index: int) -> bool:
        """Whether layer `index` is linear attention (`linear_attention`: Gated DeltaNet)."""
        return self.linear_attention is not None and index in self.linear_attention.layers

    @property
    def recurrent(self) -> RecurrentShape | None:
        """The shape of the layers that keep a fixed-size state per running sequence: Gated DeltaNet's
        (`linear_attention`), LFM2's short convolution's (`short_convolution`), Mamba-2's (`mamba2`; Falcon-H1's
        beside attention, with a KV cache as well), Mamba-1's (`mamba1`), lightning attention's (`lightning`), the
        RG-LRU's (`rg_lru`), the mLSTM's (`mlstm`) or RWKV-4's (`rwkv`); None for a model without such layers."""
        return (self.linear_attention or self.short_convolution or self.mamba2 or self.mamba1 or self.lightning
                or self.rg_lru or self.mlstm or self.rwkv)

    def is_recurrent_layer(self, index: int) -> bool:
        """Whether layer `index` keeps a state per sequence (`recurrent`) in place of a KV cache (not Falcon-H1's,
        which keep both: `Mamba2.beside_attention`)."""
        recurrent = self.recurrent
        beside = isinstance(recurrent, Mamba2) and recurrent.beside_attention
        return recurrent is not None and index in recurrent.layers and not beside

    @property
    def state_beside_attention(self) -> tuple[int, ...]:
        """The layers that keep a state per sequence beside their K/V (Falcon-H1's: every layer); () for others."""
        mamba = self.mamba2
        return mamba.layers if mamba is not None and mamba.beside_attention else ()

    @property
    def attention_layers(self) -> int:
        """Layers that keep K/V in the paged cache of their own (all but the recurrent ones and those that attend
        over another layer's: `kv_source`)."""
        return sum(self.kv_source(i) == i and not self.is_recurrent_layer(i) for i in range(self.num_hidden_layers))

    @property
    def o_proj_bias(self) -> bool:
        """Whether o_proj has a bias: `attention_out_bias` where a config sets it apart (Seed-OSS); else
        `attention_bias` puts one there too for Llama and Qwen3 (as transformers' modeling files do), never for Qwen2
        and Qwen2-MoE, whose configs set it for q/k/v only."""
        if self.attention_out_bias is not None:
            return self.attention_out_bias
        return self.attention_bias and self.architecture in _O_PROJ_BIAS_FAMILIES

    @property
    def mlp_widths(self) -> dict[str, int]:
        """The intermediate width of each kind of MLP the model has, by its config name (what tensor parallelism
        splits): `intermediate_size` where any layer is dense, the experts' and the shared expert's where present."""
        with_mlp = [i for i in range(self.num_hidden_layers) if self.has_mlp(i)]
        moe_layers = sum(self.is_moe_layer(i) for i in with_mlp)
        widths = {"intermediate_size": self.intermediate_size} if moe_layers < len(with_mlp) else {}
        if moe_layers or self.shortcut_experts:
            widths["moe_intermediate_size"] = self.moe_intermediate_size
            if self.shared_expert_intermediate_size:
                widths["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return widths

    @property
    def ungated_mlp(self) -> bool:
        """Whether the dense MLP is `down(act(up(x)))` (`layers.mlp.UngatedMLP`): relu², xIELU, or `gated_mlp` off
        (BitNet's relu² is gated: `sub_norms`)."""
        return not self.gated_mlp or (self.hidden_act in ("relu2", "xielu") and not self.sub_norms)

    @property
    def rotary_dim(self) -> int:
        """How many of each head's leading dims rope rotates (`head_dim` unless `partial_rotary_factor` < 1; latent
        attention's rope key dims)."""
        if self.latent_attention is not None:
            return self.latent_attention.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def local_rotary_dim(self) -> int:
        """`rotary_dim` of the windowed layers that read the local rope table (`local_rope_theta`)."""
        if not self.local_partial_rotary_factor:
            return self.rotary_dim
        return int(self.head_dim * self.local_partial_rotary_factor)

    def attention_window(self, index: int) -> int:
        """How many positions, its own included, a token of layer `index` attends to (`layer_windows`); 0: all."""
        return self.layer_windows[index] if index < len(self.layer_windows) else 0

    @property
    def uniform_window(self) -> int:
        """The window every layer attends through, when all have the same one (Mistral, Phi-3 with
        `sliding_window`); 0 when any layer attends to all positions (Gemma's global layers, Qwen2's below
        `max_window_layers`) or the windows differ."""
        windows = {self.attention_window(i) for i in range(self.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else 0

    def uses_rope(self, index: int) -> bool:
        """Whether layer `index`'s attention turns q and k by their positions (all but `nope_layers`; none where
        positions are learned embeddings, `absolute_positions`)."""
        return not self.absolute_positions and index not in self.nope_layers

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index`'s MLP is a mixture of experts (`layers.moe.SparseMoE`) rather than a dense one (none
        of LongCat-Flash's: its experts run beside its layers, `shortcut_experts`)."""
        return self.num_experts > 0 and index not in self.dense_layers and not self.shortcut_experts

    def is_hash_routed(self, index: int) -> bool:
        """Whether layer `index`'s experts are chosen by token id (DeepSeek-V4's `CompressedAttention.hash_layers`)."""
        return self.compressed_attention is not None and index in self.compressed_attention.hash_layers

    def has_mlp(self, index: int) -> bool:
        """Whether layer `index` has an MLP after its token mixer (all but Nemotron-H's `mlp_free_layers`)."""
        return index not in self.mlp_free_layers


# Nemotron-H's block kinds in its `hybrid_override_pattern`, and what `layers_block_type` lists call them (transformers
# 5's names, and the older ones).
NEMOTRON_BLOCKS = {
    "M": "M", "mamba": "M", "linear_attention": "M", "*": "*", "attention": "*", "full_attention": "*", "-": "-",
    "mlp": "-", "E": "E", "moe": "E",
}  # fmt: skip


def nemotron_blocks(pattern: str) -> tuple[tuple[int, int | None], ...]:
    """Nemotron-H's checkpoint blocks (`pattern`, one character each: "M" Mamba-2, "*" attention, "-" MLP, "E"
    experts) as this engine's layers: `(mixer block, MLP block)` per layer, a mixer and the MLP or experts block right
    after it, or None where the next block is another mixer (or there is none). `h += mixer(norm(h)); h +=
    mlp(norm(h))` is the block pair's sum as the checkpoint runs it, so each layer is a pre-norm block as any other
    family's. ValueError for an MLP block that follows no mixer (no release has one) or a character of another
    kind."""
    layers: list[tuple[int, int | None]] = []
    for block, kind in enumerate(pattern):
        if kind in "M*":
            layers.append((block, None))
        elif kind in "-E" and layers and layers[-1][1] is None and block == layers[-1][0] + 1:
            layers[-1] = (layers[-1][0], block)
        elif kind in "-E":
            raise ValueError(f"nemotron_h block {block} is an MLP that follows no Mamba-2 or attention block "
                             f"(pattern {pattern!r}): not supported")  # fmt: skip
        else:
            raise ValueError(f"nemotron_h block {block} of kind {kind!r} (pattern {pattern!r}) is not supported: "
                             "M (Mamba-2), * (attention), - (MLP) and E (experts) are")  # fmt: skip
    return tuple(layers)



# What the KV cache stores: "auto" the model's own dtype; "fp8" each token's key and value per KV head in e4m3 with
# a float32 scale (`ladle_kernels.reference.fp8_kv_rows`), about half a 16-bit cache's bytes (a quarter of float32's).
KVCacheDType = Literal["auto", "fp8"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDType)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings. The block count is derived at start-up from `memory_bytes`."""

    block_size: int = 16
    memory_bytes: int = 2 * 1024**3  # KV pool size; on CUDA the runner may size from free memory instead.
    enable_prefix_caching: bool = True
    dtype: KVCacheDType = "auto"
    # A hybrid's (recurrent layers: Qwen3.5, Qwen3-Next, LFM2, Granite 4.0, Nemotron-H) prefix cache: how many
    # snapshots of its states at prompts' block boundaries to keep (engine_server.core.state_snapshots). None: as many
    # as fit an eighth of the memory left beside the running requests' states, at most max_num_seqs; 0: none, and no
    # prefix served from the cache.
    state_snapshots: int | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    """One token budget per step shared by decodes and chunked prefills."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's context length
    max_waiting: int = 4096  # admission limit; beyond it new requests are refused (RESOURCE_EXHAUSTED)
    # An INTERACTIVE request arriving during a step waits for it (on the CPU a step of BATCH work only is stopped
    # for it instead: engine_server.step_interrupt, but not one with INTERACTIVE rows, nor the BATCH step right
    # after a stopped one, nor any on CUDA). So while INTERACTIVE requests are about, a step without INTERACTIVE
    # prefill carries only the decode rows and prefill tokens that the engine's measured step times say fit this
    # many seconds
    # (engine_server.core.scheduler, step_timing); a step without decode rows at least batch_min_prefill_chunk
    # tokens. None: by device (0.015 s on the CPU, 0.02 s on CUDA; while none is about, 0.15 s / 0.06 s, or 3x a
    # configured target, for the prefill beside every row); 0: no cap.
    batch_step_target_s: float | None = None
    batch_min_prefill_chunk: int = 64
    # Llama 3.2 Vision's images: their cross-attention K/V are kept per running request beside the KV cache (~210 MB
    # an image for the 11B model in bfloat16); a request with images starts only while the running ones hold at most
    # this many images with its own, or alone (`core.scheduler`). 0: no cap.
    max_cross_attention_images: int = 8


SpeculativeMethod = Literal["ngram", "suffix", "draft_model"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine_server.speculative), spelled as vLLM's `--speculative-config` JSON.

    Each step a decoding sequence may carry up to `num_speculative_tokens` proposed tokens, verified in the same
    forward pass; the output is the one decoding without them gives (greedy: token for token). Methods:
    - "ngram": prompt lookup: the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) matched
      earlier in the prompt and output, proposing what followed;
    - "suffix": suffix decoding: a suffix tree over the sequence's own tokens and the outputs of the last
      `suffix_decoding_max_cached_requests` requests, proposing the most frequent continuation of the longest
      match (at most `suffix_decoding_max_tree_depth` tokens deep; up to `suffix_decoding_max_spec_factor` times
      the match length; a branch below `suffix_decoding_min_token_prob` ends the proposal);
    - "draft_model": `model` (a model spec sharing the target's tokenizer, e.g. a `dummy:` preset) decodes the
      proposals greedily beside the target, with a KV cache of its own.
    `adaptive`: each sequence's proposal length follows its measured acceptance and the cost of a verified token,
    so speculation switches itself off where it would not pay (engine_server.speculative.policy).
    """

    method: SpeculativeMethod
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {', '.join(SPECULATIVE_METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError("num_speculative_tokens must be in [1, 32]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative n-gram sizes need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model" and not self.model:
            raise ValueError('the draft_model method needs "model": the draft model to load')
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 1, suffix_decoding_max_cached_requests >= 0")
        if self.suffix_decoding_max_spec_factor <= 0 or not 0 <= self.suffix_decoding_min_token_prob < 1:
            raise ValueError("suffix_decoding_max_spec_factor must be > 0, suffix_decoding_min_token_prob in [0, 1)")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse `--speculative-config`: a JSON object with "method" and any of the fields above. Raises ValueError
        naming what is wrong (not JSON, an unknown key, a bad value). vLLM's "num_speculative_tokens" is optional
        here (default 4); a "prompt_lookup_max" alone also sets the minimum when it is smaller than the default."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(raw, dict) or "method" not in raw:
            raise ValueError('--speculative-config must be a JSON object with a "method"')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        if "prompt_lookup_max" in raw and "prompt_lookup_min" not in raw:
            raw["prompt_lookup_min"] = min(cls.prompt_lookup_min, raw["prompt_lookup_max"])
        try:
            return cls(**raw)
        except TypeError as exc:
            raise ValueError(f"--speculative-config: {exc}") from None


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters served on the base model (engine_server.lora), spelled as vLLM's flags.

    `modules`: (name, folder) pairs loaded at start (`--lora-modules name=path`); more load at run time.
    `max_loras`: slots, the most adapters one step runs (a request of another adapter waits for a slot);
    `max_lora_rank`: the largest rank an adapter may have (the slots are this wide); `max_cpu_loras`: adapters
    whose weights stay in host memory (the rest are read from their folders again when next asked for).
    """

    modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.max_loras <= 256:
            raise ValueError(f"--max-loras must be in [1, 256], got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"--max-lora-rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras})")
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError("--lora-modules names each adapter once")


# The command line's --async-scheduling choices as EngineConfig.async_scheduling values.
ASYNC_SCHEDULING_MODES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
QuantizationMode = Literal["auto", "none", "gguf", "int8", "fp8"]  # EngineConfig.quantization
# EngineConfig.tool_call_parser: "auto" (read off the chat template) or a format (engine_server.tools.ToolFormat).
# "openai" is vLLM's name for gpt-oss's harmony calls (engine_server.harmony), which "auto" also picks for its template.
ToolCallParserName = Literal[
    "auto", "hermes", "llama3_json", "mistral", "mistral_v11", "pythonic", "qwen3_coder", "openai", "glm45", "glm47",
    "deepseek_v3", "deepseek_v31", "kimi_k2", "minimax_m2", "seed_oss", "nemotron_json", "lfm2", "granite",
    "cohere", "gemma4", "olmo3",
    # other names of these formats: vLLM's, then SGLang's (engine_server.tools.template.FORMAT_ALIASES)
    "llama4_pythonic", "llama4_json", "qwen3_xml", "ernie45",
    "deepseekv3", "deepseekv31", "glm", "gpt-oss", "llama3", "llama4", "qwen", "qwen25", "minimax-m2",
]
TOOL_CALL_PARSERS: tuple[str, ...] = get_args(ToolCallParserName)  # the command line's --tool-call-parser choices
# EngineConfig.reasoning_parser: "auto" (on when the chat template mentions a known opening tag: <think>,
# <seed:think>, [THINK], <|START_THINKING|>, <|channel>thought), "none", or a family (vLLM's names) whose reasoning
# is split off between its tags (engine_server.reasoning: seed_oss <seed:think>, mistral [THINK], cohere
# <|START_THINKING|>, gemma4 <|channel>thought, the others <think>).
# "openai_gptoss" (vLLM's name) reads gpt-oss's harmony channels, as "auto" does for its template.
ReasoningParserName = Literal[
    "auto", "none", "qwen3", "deepseek_r1", "glm45", "kimi_k2", "minimax_m2", "seed_oss", "mistral", "cohere",
    "gemma4", "openai_gptoss",
]
REASONING_PARSERS: tuple[str, ...] = get_args(ReasoningParserName)
QUANTIZATION_MODES: tuple[str, ...] = get_args(QuantizationMode)  # the command line's --quantization choices


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, fixed at start-up."""

    model: str = "default"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0
    cache_dir: str | None = None  # where converted models live (`cache_path`); default $LADLE_CACHE_DIR, ~/.cache/ladle
    # CUDA graphs replay decode steps when the device is CUDA, unless enforce_eager (vLLM's name) is set. One
    # graph per batch-size bucket up to min(max_num_seqs, max_cuda_graph_batch); larger batches run eagerly.
    enforce_eager: bool = False
    max_cuda_graph_batch: int = 512
    # Schedule and launch step N+1 before step N's tokens reach the host, so the host's work overlaps the
    # device's (see EngineCore). None: on for CUDA, where the device runs ahead; off on the CPU, where every op
    # is synchronous and the overlap would only cost a discarded row per finished request.
    async_scheduling: bool | None = None
    # How the linear layers' weights are kept (engine_server.quantization): "none" (float: the exact path,
    # greedy output equal to transformers'), "gguf" (a GGUF file's own 4/8-bit blocks), "int8" (8-bit groups of
    # 32 of any model's weights), "fp8" (e4m3 weights with per-channel or block scales, activations per token) or
    # "auto", the default: gguf for a GGUF file on the CPU, where its quality was measured to hold and it is faster
    # at every batch size (docs/models.md, Quantized weights), int8 for an MXFP4 checkpoint there (gpt-oss's experts
    # served as stored), fp8 for an FP8 checkpoint on a GPU with e4m3 tensor cores, none everywhere else.
    quantization: QuantizationMode = "auto"
    # How tool calls are read from the output: "auto" picks the format the chat template implies
    # (engine_server/tools/template.py), a format's name forces it (vLLM's --tool-call-parser).
    tool_call_parser: ToolCallParserName = "auto"
    # Whether a chat's <think>...</think> reasoning comes back apart from its content (reasoning_content): "auto"
    # when the chat template mentions <think> (Qwen3, DeepSeek-R1), "none", or a parser's name (vLLM's flag).
    reasoning_parser: ReasoningParserName = "auto"
    # Sampling values for the fields a request leaves unset (engine_server.generation_defaults): "auto" (the
    # model's own), "ladle" (OpenAI's) or the path of a generation_config.json (or of a folder holding one);
    # then override_generation_config, a JSON object such as '{"temperature": 0.7}', on top. vLLM's names.
    generation_config: str = "auto"
    override_generation_config: str | None = None
    # A JSON object laid over the model's config.json before it is read (vLLM's --hf-overrides), e.g.
    # '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}' for
    # Qwen's long context; `hf_override_values` parses it.
    hf_overrides: str | None = None
    # The chat template used instead of the model's (vLLM's --chat-template): the path of a file holding it, or the
    # template itself; `chat_template_text` reads it.
    chat_template: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # Tensor parallelism (engine_server.parallel): the model split over this many ranks, this process being rank 0
    # (scheduler, sampling, gRPC) and N-1 spawned workers; on the CPU the cores are shared out between the ranks.
    tensor_parallel_size: int = 1
    lora: LoraConfig | None = None  # None: no LoRA adapters (vLLM's --enable-lora off)
    # Whisper: the longest clip a transcription may send, in seconds; one longer than the encoder's window (30 s) is
    # served as its windows (`multimodal.clip_windows`), one longer than this refused with its length.
    max_transcription_seconds: float = 3600.0

    def __post_init__(self) -> None:
        self.hf_override_values()
        self.chat_template_text()
        if not self.max_transcription_seconds > 0:
            raise ValueError(f"--max-transcription-seconds must be > 0, got {self.max_transcription_seconds}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.lora is not None and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not served under tensor parallelism yet: use --tensor-parallel-size 1")

    def cache_path(self) -> Path | None:
        """`cache_dir` as a path; None: the loader's default (`$LADLE_CACHE_DIR`, else ~/.cache/ladle)."""
        return Path(self.cache_dir) if self.cache_dir else None

    def chat_template_text(self) -> str | None:
        """`chat_template` as template text (a file's contents when it names a file; None when unset). ValueError
        when it looks like a path (one line ending .jinja, .j2 or .txt) that is not a readable file."""
        if not self.chat_template:
            return None
        path = Path(self.chat_template)
        if "\n" not in self.chat_template and len(self.chat_template) < 4096 and path.is_file():
            try:
                return path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"--chat-template {self.chat_template!r} cannot be read: {exc}") from None
        if "\n" not in self.chat_template and path.suffix in (".jinja", ".j2", ".txt"):
            raise ValueError(f"--chat-template {self.chat_template!r} is not a file")
        return self.chat_template

    def hf_override_values(self) -> dict[str, Any]:
        """`hf_overrides` as a dict ({} when unset); ValueError unless it is a JSON object."""
        if not self.hf_overrides:
            return {}
        try:
            values = json.loads(self.hf_overrides)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--hf-overrides is not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError(f"--hf-overrides must be a JSON object, got {self.hf_overrides!r}")
        return values
