"""Loading a model for the runner: device, dtype, weights, quantization, packing, KV cache, draft, decode graphs.

`load_model` does every start-up step before the model runner's first step and returns the result as a
`LoadedModel`, which nothing changes afterwards: the runner runs steps over it (and tests capture graphs over it
with `capture_decode_graphs` and `EagerCapture`). The order is part of the contract:
- torch's seed is set right before the model is built, so random weights are the same on every load;
- under `gguf` the file's quantized blocks are read (`quantization.stored_weights`) before the float weights load
  (under `fp8`, an FP8 checkpoint's e4m3 weights: `quantization.stored_fp8_weights`; under `int8` on the CPU, an
  MXFP4 checkpoint's banks of experts are found, to be read as they are packed: `quantization.stored_mxfp4_banks`),
  and the float weights of the layers they replace are never read (the embedded model: 0.1 s of CPU and 0.5 GB
  peak RSS to load its converted weights, against 2-3.5 s and 1.3 GB reading all of them);
- the KV cache is allocated before the weights are quantized and, on the CPU, MKL-packed (zeroing it right after
  the packing takes twice as long), and the CPU's glibc thresholds are raised (`host_memory`) just before that;
- on CUDA the float weights' freed blocks go back to the device after quantizing;
- the LoRA slots come after the weights are final, and the decode stack (when the model has one) holds their
  tensors from then on (`layers.decode_stack.register_lora`);
- the draft model, then (on CUDA, unless `enforce_eager` or a draft model) the decode graphs are last: they
  record the forward over the final weights and KV cache.

The KV cache holds one block more than the scheduler is given (`scratch_block == num_blocks`): the decode graphs'
padding rows write there and nowhere else.

Under tensor parallelism every rank calls `load_model` with its `TensorParallel` (rank 0 from the engine, the
others from `engine_server.workers`): each builds its shards, loads them reading only its slice of each
checkpoint tensor (`ModelSource.lazy_weights`) and allocates a KV cache of its own KV heads; rank 0's block
count is every rank's (broadcast), so one block id means the same tokens on every rank; quantized weights are
each rank's slices (engine_server.quantization), and only rank 0 loads a draft model. On CUDA every rank
captures the same decode graphs, each over its own shards and KV cache, with the group's NCCL all-reduces
recorded inside them: rank 0 names the bucket it replays and the workers replay theirs (engine_server.workers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import structlog
import torch

from engine_server.attention_metadata import recurrent_state_bytes
from engine_server.config import EngineConfig, ModelConfig
from engine_server.cuda_graphs import CudaGraphCapture, DecodeGraphs, GraphCapture, graph_batch_sizes
from engine_server.host_memory import keep_freed_memory_for_reuse, release_freed_memory
from engine_server.layers.decode_stack import register_lora
from engine_server.layers.decoder import DecoderModel
from engine_server.layers.kernel_choice import select_ops
from engine_server.layers.packed_linear import pack_linear_layers
from engine_server.loader import ModelSource, resolve_model
from engine_server.lora.slots import LoraSlots
from engine_server.models import (
    BertEncoder,
    CausalLM,
    StepModel,
    allocate_kv_cache,
    get_model_class,
    kv_cache_bytes_per_block,
)
from engine_server.multimodal.audio import audio_refusal
from engine_server.multimodal.features import ImageEncoder
from engine_server.multimodal.processing import images_refusal
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.quantization import (
    Scheme,
    StoredWeight,
    quantize_model,
    resolve_quantization,
    stored_fp8_weights,
    stored_mxfp4_banks,
    stored_weights,
)
from engine_server.speculative.draft_model import DraftModel
from engine_server.speculative.gemma4_assistant import Gemma4AssistantDraft, assistant_source
from ladle_kernels.kernel_set import REFERENCE_OPS

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run steps: its weights on the device, its KV cache and what goes with them.

    `num_blocks` is what the KV cache manager may hand out (ids `0..num_blocks-1`); every tensor of `kv_caches`
    holds one more block, `scratch_block`. `draft` is speculative decoding's draft model, when configured;
    `decode_graphs` the graphs captured at load (None: every step runs eagerly), for batches up to
    `max_graph_batch`.
    """

    device: torch.device
    dtype: torch.dtype
    model_config: ModelConfig
    model: StepModel
    quantization: Scheme
    block_size: int
    max_model_len: int
    num_blocks: int
    kv_caches: list[torch.Tensor]
    max_graph_batch: int
    draft: DraftModel | Gemma4AssistantDraft | None = None
    decode_graphs: DecodeGraphs | None = None
    tp: TensorParallel = SINGLE
    lora_slots: LoraSlots | None = None  # the LoRA adapters' slots (engine_server.lora), when the engine serves them
    # Rows of the linear-attention layers' state tensors (`layers.gated_deltanet`): one per running request; 0 for a
    # model without such layers; after them `state_snapshots` rows of prefixes' states (`core.state_snapshots`).
    state_slots: int = 0
    state_snapshots: int = 0
    # The vision encoder of a model whose images are served (`engine_server.multimodal`): pixel values to the text
    # model's embeddings (Llama 3.2 Vision's: to its cross-attention layers' states, those layers with it); None for
    # every other, and on every rank but rank 0.
    vision: ImageEncoder | None = None

    @property
    def scratch_block(self) -> int:
        return self.num_blocks


def resolve_device(device: str) -> torch.device:
    """'auto' means CUDA when available, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but CUDA is not available on this machine")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' is float32 on the CPU (the reference path) and bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


# The blocks of a model that keeps no K/V (they hold no memory, only the scheduler's count of each sequence's tokens
# and its prefix hashes): every seat's longest sequence's, up to this many (16M tokens in flight).
MAX_STATE_ONLY_BLOCKS = 1 << 20
# A hybrid's prefix snapshots (`core.state_snapshots`) take at most this share of the cache memory left beside its
# running requests' states, unless `CacheConfig.state_snapshots` says how many.
SNAPSHOT_MEMORY_SHARE = 1 / 8


def state_snapshot_rows(model_config: ModelConfig, config: EngineConfig, tp_size: int = 1) -> int:
    """How many prefix snapshots of a hybrid's recurrent states to keep (`CacheConfig.state_snapshots`, or by
    default as many as fit `SNAPSHOT_MEMORY_SHARE` of the memory left beside `max_num_seqs` requests' states, at most
    `max_num_seqs`); 0 for a model without recurrent layers (`ModelConfig.recurrent`) or with prefix caching off.
    Every rank of a tensor-parallel group computes the same count (its share of each state, of the same memory).
    ValueError for a negative count."""
    if model_config.recurrent is None or not config.cache.enable_prefix_caching:
        return 0
    if config.cache.state_snapshots is not None:
        if config.cache.state_snapshots < 0:
            raise ValueError(f"state_snapshots must be >= 0, got {config.cache.state_snapshots}")
        return config.cache.state_snapshots
    seats = config.scheduler.max_num_seqs
    left = config.cache.memory_bytes - recurrent_state_bytes(model_config, seats, tp_size)
    fit = int(left * SNAPSHOT_MEMORY_SHARE) // recurrent_state_bytes(model_config, 1, tp_size)
    return max(0, min(seats, fit))


def num_kv_blocks(
    model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype, max_model_len: int, tp_size: int = 1
) -> int:
    """Blocks that fit in the configured KV memory (per rank, of its KV heads, under tensor parallelism), beside the
    recurrent layers' states of `max_num_seqs` requests and of the prefix snapshots (`state_snapshot_rows`) where the
    model has such layers; at least enough for one sequence of max_model_len tokens. A model of recurrent layers only
    (Mamba alone) keeps no K/V: its blocks cost nothing, so it gets enough for every seat's longest sequence
    (`MAX_STATE_ONLY_BLOCKS` at most) once its states fit."""
    block_size = config.cache.block_size
    per_block = kv_cache_bytes_per_block(model_config, block_size, dtype, tp_size, config.cache.dtype)
    needed_for_one = -(-max_model_len // block_size) + 1
    rows = config.scheduler.max_num_seqs + state_snapshot_rows(model_config, config, tp_size)
    states = recurrent_state_bytes(model_config, rows, tp_size)
    if per_block == 0:
        if states > config.cache.memory_bytes:
            raise ValueError(f"KV cache memory {config.cache.memory_bytes} B does not hold the {states} B of {rows} "
                             f"recurrent states ({config.scheduler.max_num_seqs} requests' and the prefix snapshots': "
                             "fewer with a lower --max-num-seqs)")  # fmt: skip
        return max(needed_for_one, min(config.scheduler.max_num_seqs * needed_for_one, MAX_STATE_ONLY_BLOCKS))
    blocks = max(config.cache.memory_bytes - states, 0) // per_block
    if blocks < needed_for_one:
        held = (
            f" after the {states} B of {rows} recurrent states ({config.scheduler.max_num_seqs} requests' and "
            "the prefix snapshots': fewer with a lower --max-num-seqs)" if states else ""
        )  # fmt: skip
        raise ValueError(
            f"KV cache memory {config.cache.memory_bytes} B holds {blocks} blocks{held}; one {max_model_len}-token "
            f"sequence needs {needed_for_one} ({needed_for_one * per_block} B)"
        )
    return int(blocks)


def refuse_unserved(source: ModelSource, config: EngineConfig) -> None:
    """ValueError, before any weight is read or KV cache allocated (and, under tensor parallelism, before any worker
    starts), where `config` asks `source`'s model for what it is not served with."""
    model = source.config
    if model.assistant is not None:
        raise ValueError(f"model {source.name!r} is a Gemma 4 assistant, which drafts for its Gemma 4 target: "
                         "serve the target with it as the draft model (--speculative-config '{\"method\": "
                         "\"draft_model\", \"model\": ...}')")  # fmt: skip
    if model.multimodal is not None and model.multimodal.transcribes:  # (its encoder's K/V kept on rank 0's device)
        if config.tensor_parallel_size > 1:
            raise ValueError("Whisper is not served under tensor parallelism yet")
        if config.speculative is not None:
            raise ValueError("speculative decoding is not served on Whisper (its drafts would not read the clip)")
        if config.lora is not None:
            raise ValueError("LoRA adapters are not applied to Whisper yet")
    if config.speculative is not None and model.recurrent is not None:
        # Verifying drafts would advance the states past tokens that are then rejected.
        raise ValueError("speculative decoding is not served on models with recurrent layers (Qwen3-Next, Qwen3.5, "
                         "LFM2, Granite 4.0, Nemotron-H, Jamba, Mamba, MiniMax-01, xLSTM, RWKV)")
    if model.compressed_attention is not None:
        # Its attention reads and writes its rows (keys, raw compressor rows, entries) in torch, in the model's dtype.
        if config.cache.dtype == "fp8":
            raise ValueError("--kv-cache-dtype fp8 is not served on DeepSeek-V4's compressed attention yet")
        if config.tensor_parallel_size > 1:
            raise ValueError("DeepSeek-V4 is not served under tensor parallelism yet")
        if config.lora is not None:
            raise ValueError("LoRA adapters are not applied to DeepSeek-V4's compressed attention yet")
    if model.mixture_of_attention:  # its experts' query heads are not split over ranks yet
        if config.tensor_parallel_size > 1:
            raise ValueError("JetMoE's mixture of attention is not served under tensor parallelism yet")
        if config.lora is not None:
            raise ValueError("LoRA adapters are not applied to JetMoE's mixture of attention yet")
    if model.block_sparse is not None:
        # Each rank's query heads read the blocks their index heads choose: the ranks split those too.
        index_heads, size = model.block_sparse.index_heads, config.tensor_parallel_size
        if index_heads % size:
            raise ValueError(f"MiniMax-M3's {index_heads} index heads do not split over {size} tensor-parallel ranks")
        if config.lora is not None:
            raise ValueError("LoRA adapters are not applied to MiniMax-M3's block-sparse attention yet")
    if model.kolibri_index is not None:  # its indexer reads the query heads of key head 0 on every rank
        if config.tensor_parallel_size > 1:
            raise ValueError("Kolibri-1.1's indexed attention is not served under tensor parallelism yet")
        if config.lora is not None:
            raise ValueError("LoRA adapters are not applied to Kolibri-1.1's indexed attention yet")
    if model.differential_attention:  # its head halves pair across the ranks; its attention takes no adapters
        if config.tensor_parallel_size > 1:
            raise ValueError("DiffLlama's differential attention is not served under tensor parallelism yet")
        if config.lora is not None:
            raise ValueError("LoRA adapters are not applied to DiffLlama's differential attention yet")
    if model.mlstm is not None and config.lora is not None:  # (its mixer's projections take no adapters)
        raise ValueError("LoRA adapters are not applied to xLSTM's mLSTM layers yet")
    if model.rwkv is not None and config.lora is not None:
        raise ValueError("LoRA adapters are not applied to RWKV's time and channel mixes yet")
    if model.qwen4_exp is not None and config.lora is not None:  # (its blocks read the hyper-connected streams)
        raise ValueError("LoRA adapters are not applied to Qwen4-Exp yet")
    if model.shared_blocks is not None and config.lora is not None:  # (its blocks have adapters of their own)
        raise ValueError("LoRA adapters are not applied to Zamba's and Zamba2's shared blocks yet")
    if model.looped_ngpt is not None:  # its norms span every head and the MLP's width; its blocks are its own
        if config.tensor_parallel_size > 1:
            raise ValueError("Dory is not served under tensor parallelism yet")
        if config.lora is not None:
            raise ValueError("LoRA adapters are not applied to Dory's nGPT blocks yet")
    if config.lora is None:
        return
    if model.encoder:
        raise ValueError("LoRA adapters are served on decoder models; this model is an encoder")
    if model.latent_attention is not None:
        raise ValueError("LoRA adapters are not applied to multi-head latent attention (DeepSeek-V3) yet")
    if model.block_pattern:
        raise ValueError("LoRA adapters are not applied to Nemotron-H (its ungated MLPs, its paired blocks) yet")
    if model.falcon_h1 is not None:
        raise ValueError("LoRA adapters are not applied to Falcon-H1 (its multipliers are folded into the weights "
                         "an adapter would add to) yet")  # fmt: skip


def load_model(
    source: ModelSource, config: EngineConfig, max_model_len: int, tp: TensorParallel = SINGLE
) -> LoadedModel:
    """`source` loaded on `config`'s device for sequences of up to `max_model_len` tokens (module docstring);
    under tensor parallelism, `tp`'s shards of it (every rank of the group calls this together)."""
    refuse_unserved(source, config)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    # Builds the C++ kernels now (first start on this machine only), not on the first request.
    kernels = select_ops(device) is not REFERENCE_OPS
    quantization = resolve_quantization(config.quantization, source, device, dtype, kernels)
    torch.manual_seed(config.seed)
    model: StepModel
    if source.config.encoder:
        model = BertEncoder(source.config, dtype=dtype, tp=tp, sep_token_id=_pair_separator(source))
    else:
        model = get_model_class(source.config.architecture)(source.config, dtype=dtype, tp=tp)
    # A GGUF file's quantized blocks replace most float weights: those are never read (nor is anything else of
    # the converted file but what is kept). Sharded, each rank reads only its slice of each tensor; otherwise one
    # sequential read per file is faster.
    stored = stored_weights(model, source) if quantization == "gguf" and isinstance(model, CausalLM) else {}
    if quantization == "int8" and device.type == "cpu" and isinstance(model, CausalLM):
        stored = stored_mxfp4_banks(model, source)  # an MXFP4 checkpoint's experts, served as stored
    fp8_kept: frozenset[str] = frozenset()  # an FP8 checkpoint's weights served as stored: not dequantized
    if quantization == "fp8" and isinstance(model, CausalLM):
        stored, fp8_kept = stored_fp8_weights(model, source)
    if stored and isinstance(model, CausalLM):
        model.load_weights(source.lazy_weights(fp8_kept), replaced=stored.keys())
    else:
        model.load_weights(source.lazy_weights() if tp.size > 1 else source.weights())
    model = model.to(device).eval()
    num_blocks = tp.broadcast_from_driver(num_kv_blocks(source.config, config, dtype, max_model_len, tp.size))
    block_size = config.cache.block_size
    # An encoder keeps nothing between steps: its blocks only count the tokens in flight, and hold no memory.
    state_slots = config.scheduler.max_num_seqs if source.config.recurrent is not None else 0
    snapshots = state_snapshot_rows(source.config, config, tp.size)
    kv_caches = (
        []
        if source.config.encoder
        else allocate_kv_cache(
            source.config, num_blocks + 1, block_size, dtype, device, tp.size, config.cache.dtype,
            state_slots + snapshots,
        )
    )
    _quantize(model, source, quantization, device, kernels, stored)
    loaded = LoadedModel(
        device=device, dtype=dtype, model_config=source.config, model=model, quantization=quantization,
        block_size=block_size, max_model_len=max_model_len, num_blocks=num_blocks, kv_caches=kv_caches,
        max_graph_batch=min(config.scheduler.max_num_seqs, config.max_cuda_graph_batch), tp=tp,
        state_slots=state_slots, state_snapshots=snapshots,
    )  # fmt: skip
    vision = _load_vision(source, model, device, dtype, tp, config.scheduler.max_num_batched_tokens)
    loaded = replace(loaded, draft=_load_draft(config, loaded), vision=vision)
    if config.lora is not None:
        slots = LoraSlots(source.config, config.lora.max_loras, config.lora.max_lora_rank, dtype, device)
        in_stack = isinstance(model, CausalLM) and register_lora(model.model, slots)  # steps with adapters run in it
        log.info(
            "lora slots", slots=config.lora.max_loras, max_rank=config.lora.max_lora_rank, bytes=slots.nbytes,
            decode_stack=in_stack,
        )  # fmt: skip
        loaded = replace(loaded, lora_slots=slots)
    if _captures_decode_graphs(loaded, config):
        loaded = replace(loaded, decode_graphs=capture_decode_graphs(loaded, CudaGraphCapture()))
    return loaded


def _load_vision(
    source: ModelSource, model: StepModel, device: torch.device, dtype: torch.dtype, tp: TensorParallel,
    max_num_batched_tokens: int,
) -> ImageEncoder | None:
    """The vision encoder of a checkpoint whose images are served (`multimodal.processing.images_refusal`: with its
    image processor), or the audio encoder of one whose audio is (`multimodal.audio.audio_refusal`; Whisper's encoder
    and cross-attention, ValueError without its feature extractor: `multimodal.whisper`), on rank 0 alone
    (it sends the encoder's rows to the other ranks with each step: `parallel.step_channel`); None otherwise.
    ValueError where its text model's decoder is one that lays no such rows over its embeddings (only the shared
    `DecoderModel`'s forward does), on every rank."""
    multimodal = source.config.multimodal
    if multimodal is not None and multimodal.transcribes:  # Whisper's encoder and cross-attention, in float
        from engine_server.multimodal.transcription import transcription_refusal
        from engine_server.multimodal.whisper import WhisperAudioEncoder

        refusal = transcription_refusal(True, source.path)
        if refusal:
            raise ValueError(f"model {source.name!r}: {refusal}")
        return WhisperAudioEncoder.from_checkpoint(source.path, source.lazy_weights(), dtype, device)
    hears = not audio_refusal(multimodal, source.path)
    if images_refusal(multimodal, source.path, max_num_batched_tokens, tp.size) and not hears:
        return None
    decoder = getattr(model, "model", None)
    if decoder is None or type(decoder).forward is not DecoderModel.forward:
        raise ValueError(
            f"model {source.name!r}: images and audio are served over the shared decoder's text models only, not "
            f"over {type(decoder).__name__}; remove its preprocessor_config.json (or processor_config.json) to serve "
            "its text model alone"
        )
    if not tp.is_driver:
        return None
    if hears:
        from engine_server.multimodal.audio import AUDIO_KINDS

        assert multimodal is not None and multimodal.audio is not None
        encoder = AUDIO_KINDS[multimodal.audio.encoder][1]
        return encoder.from_checkpoint(source.path, source.lazy_weights(), dtype, device)
    from engine_server.multimodal.checkpoint import CheckpointEncoder
    from engine_server.multimodal.deepseek_vl import DeepseekVLHybridImageEncoder, DeepseekVLImageEncoder
    from engine_server.multimodal.llava import (  # (transformers' modules: only for these models)
        Gemma3ImageEncoder,
        Idefics2ImageEncoder,
        InternVLImageEncoder,
        LlavaImageEncoder,
        LlavaNextImageEncoder,
        Mistral3ImageEncoder,
        TiledSiglipEncoder,
    )
    from engine_server.multimodal.mllama import MllamaImageEncoder
    from engine_server.multimodal.qwen_vl import QwenVisionEncoder

    assert source.config.multimodal is not None and source.config.multimodal.images is not None
    kind = source.config.multimodal.images.encoder
    encoders: dict[str, type[CheckpointEncoder]] = {
        "llava": LlavaImageEncoder, "mistral3": Mistral3ImageEncoder, "internvl": InternVLImageEncoder,
        "idefics3": TiledSiglipEncoder, "smolvlm": TiledSiglipEncoder, "llava_next": LlavaNextImageEncoder,
        "llava_next_video": LlavaNextImageEncoder,
        "gemma3": Gemma3ImageEncoder, "aya_vision": LlavaImageEncoder, "vipllava": LlavaImageEncoder,
        "idefics2": Idefics2ImageEncoder, "deepseek_vl": DeepseekVLImageEncoder, "janus": DeepseekVLImageEncoder,
        "deepseek_vl_hybrid": DeepseekVLHybridImageEncoder, "mllama": MllamaImageEncoder,
        "llava_onevision": LlavaNextImageEncoder,
    }  # fmt: skip
    return encoders.get(kind, QwenVisionEncoder).from_checkpoint(source.path, source.lazy_weights(), dtype, device)


def _pair_separator(source: ModelSource) -> int | None:
    """A cross-encoder's [SEP] token id, which splits the pairs it scores into token types (`BertEncoder`)."""
    if not source.config.num_labels:
        return None
    # Imported here: transformers (~1.5 s of CPU) is not otherwise needed by a tensor-parallel worker process.
    from engine_server.tokenizer.loading import load_tokenizer

    separator = load_tokenizer(source.tokenizer_path).sep_token_id
    if separator is None:
        raise ValueError(f"cross-encoder {source.name!r}: its tokenizer has no [SEP] token to split a pair with")
    return int(separator)


def _quantize(
    model: StepModel,
    source: ModelSource,
    quantization: Scheme,
    device: torch.device,
    kernels: bool,
    stored: dict[str, StoredWeight],
) -> None:
    """Quantize the model's weights as `quantization` says (under `gguf`, to `stored`: `stored_weights`') and, on
    the CPU, MKL-pack its float linear layers. On the CPU `stored` is emptied once its weights are packed, and the
    memory loading freed is given back to the system (`release_freed_memory`)."""
    if device.type == "cpu":
        keep_freed_memory_for_reuse()
        layers = quantize_model(model, source, quantization, stored) if isinstance(model, CausalLM) else {}
        packed = pack_linear_layers(model)
        stored.clear()  # the file's weights as read: packed into the layers now
        release_freed_memory()
        log.info(
            "cpu kernels", quantization=quantization, layers=layers, mkl_packed_linears=packed, cpp_kernels=kernels
        )
    elif quantization != "none" and isinstance(model, CausalLM):  # an encoder's weights stay float
        layers = quantize_model(model, source, quantization, stored)
        torch.cuda.empty_cache()  # the float weights' blocks
        log.info("quantized weights", quantization=quantization, layers=layers)


def _load_draft(config: EngineConfig, target: LoadedModel) -> DraftModel | Gemma4AssistantDraft | None:
    """Speculative decoding's draft model, over the target's KV blocks, when `config` names one (a Gemma 4 assistant
    over the target's own K/V and hidden states: `speculative.gemma4_assistant`). Under tensor parallelism only rank
    0 holds it, whole (a small model: vLLM's `draft_tensor_parallel_size` 1): it proposes before the step's forward,
    which the workers then run with rank 0."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model" or spec.model is None or not target.tp.is_driver:
        return None
    assistant = assistant_source(spec.model)
    if assistant is not None:
        if target.tp.size > 1:  # it reads the target's K/V, of which rank 0 holds its heads alone
            raise ValueError("a Gemma 4 assistant drafts over one rank's K/V: not under tensor parallelism yet")
        if not isinstance(target.model, CausalLM):
            raise ValueError("a Gemma 4 assistant drafts for a decoder, not an encoder")
        drafter = Gemma4AssistantDraft(
            assistant, target.model, target.kv_caches, (target.num_blocks + 1) * target.block_size,
            target.block_size, target.dtype, target.device,
        )  # fmt: skip
        log.info("gemma 4 assistant loaded", model=drafter.name)
        return drafter
    draft = DraftModel(
        resolve_model(spec.model, config.cache_path(), seed=config.seed),
        target_vocab_size=target.model_config.vocab_size,
        max_model_len=target.max_model_len,
        num_cache_blocks=target.num_blocks + 1,
        block_size=target.block_size,
        dtype=target.dtype,
        device=target.device,
    )
    log.info("draft model loaded", model=draft.name)
    return draft


def _captures_decode_graphs(loaded: LoadedModel, config: EngineConfig) -> bool:
    """Whether loading captures decode graphs: on CUDA, unless `enforce_eager`, with the Triton kernels. Under
    tensor parallelism every rank decides alike (each records the same buckets, their all-reduces inside), and
    only where the group's collectives can be recorded (NCCL)."""
    # A draft model follows every step's inputs, which a captured decode step does not hand out: eager then
    # (on every rank, though only rank 0 holds the draft).
    spec = config.speculative
    draft = spec is not None and spec.method == "draft_model"
    if loaded.device.type != "cuda" or config.enforce_eager or loaded.max_graph_batch < 1 or draft:
        return False
    if loaded.model_config.encoder:
        return False  # an encoder never decodes
    why = _eager_reason(loaded)
    if why is not None:
        log.warning(why)
        return False
    if not loaded.tp.capturable:
        log.warning("this tensor-parallel group's collectives cannot be recorded in CUDA graphs: decode runs eagerly")
        return False
    if select_ops(loaded.device) is REFERENCE_OPS:
        # The reference attention builds tensors from host lists every call: it cannot be captured.
        log.warning("triton is unavailable: decode steps run eagerly on the torch reference ops")
        return False
    return True


def _eager_reason(loaded: LoadedModel) -> str | None:
    """Why `loaded`'s decode steps cannot be recorded in CUDA graphs (its layers read host lists every step, or its
    GEMMs' shapes follow the routing), the first that applies; None when nothing in its shape stops them."""
    model = loaded.model_config
    reasons = (
        # (each row's state slot and chunk form picked from host lists every step)
        (model.recurrent is not None, "a model with recurrent layers (Qwen3-Next, Qwen3.5, Qwen4-Exp, LFM2, Granite "
         "4.0, Nemotron-H, Jamba, Mamba, Zamba, MiniMax-01, xLSTM, RWKV) decodes eagerly: no CUDA graphs yet"),
        # (Llama 4's rope layers split each step's sequences at their chunks from host lists; a MoE model anyway)
        (bool(model.attention_chunk) and loaded.max_model_len > model.attention_chunk,
         "a model attending within chunks (Llama 4) decodes eagerly: no CUDA graphs yet"),
        # (dense or gathered attention chosen, each sequence walked, from host lists)
        (model.sparse_indexer is not None,
         "a model with sparse attention (DeepSeek-V3.2, GLM-5) decodes eagerly: no CUDA graphs yet"),
        # (the Triton kernel's on a GPU, Falcon-RW's in torch from host lists: graphs over it to be checked on a GPU)
        (bool(model.alibi), "a model with ALiBi (BLOOM, MPT, Falcon-RW) decodes eagerly: no CUDA graphs yet"),
        # (the kernels' attention or its own, which walks each sequence)
        (model.block_sparse is not None,
         "a model with block-sparse attention (MiniMax-M3) decodes eagerly: no CUDA graphs yet"),
        # (each sequence's keys walked in torch from host lists)
        (model.differential_attention, "DiffLlama decodes eagerly: no CUDA graphs yet"),
        (model.kolibri_index is not None, "Kolibri-1.1 decodes eagerly: no CUDA graphs yet"),
        # (each sequence walked, and the windows a step closes pooled, from host lists)
        (model.compressed_attention is not None,
         "a model with compressed attention (DeepSeek-V4) decodes eagerly: no CUDA graphs yet"),
        # (each expert's GEMM sized by the tokens routed to it, which a recorded graph cannot follow)
        (bool(model.num_experts),
         "a mixture-of-experts model decodes eagerly: its expert GEMMs are not recorded in CUDA graphs"),
        # (every row reads its clip's K/V inside each layer, one request at a time: graphs would go unused)
        (model.multimodal is not None and model.multimodal.transcribes,
         "Whisper decodes eagerly: every step's rows read their clips' cross-attention, which the graphs do not hold"),
    )  # fmt: skip
    return next((why for applies, why in reasons if applies), None)


@torch.inference_mode()
def capture_decode_graphs(loaded: LoadedModel, capture: GraphCapture) -> DecodeGraphs:
    """The decode forward of `loaded` over its KV cache, recorded for every batch-size bucket up to its
    `max_graph_batch`.

    Loading calls it on CUDA (with `CudaGraphCapture`), so the first request does not pay for it; tests pass
    `EagerCapture` (through `ModelRunner.capture_decode_graphs`) to run the same padded static-buffer path on the CPU.
    """
    started = time.perf_counter()
    sizes = graph_batch_sizes(loaded.max_graph_batch)
    model, kv_caches = loaded.model, loaded.kv_caches
    graphs = DecodeGraphs(
        lambda ids, positions, meta, lora: model(ids, positions, kv_caches, meta, None, lora),
        sizes=sizes,
        hidden_size=loaded.model_config.hidden_size,
        block_size=loaded.block_size,
        max_blocks_per_seq=-(-loaded.max_model_len // loaded.block_size),
        scratch_block=loaded.scratch_block,
        dtype=loaded.dtype,
        device=loaded.device,
        lora_slots=loaded.lora_slots,
    )
    graphs.capture_all(capture)
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)
    log.info(
        "decode graphs captured",
        graphs=len(sizes),
        batch_sizes=f"{sizes[0]}..{sizes[-1]}",
        seconds=round(time.perf_counter() - started, 2),
    )
    return graphs
