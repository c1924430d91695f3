"""Model families and the registry that maps `ModelConfig.architecture` to a model class."""

from __future__ import annotations

from engine_server.attention_metadata import allocate_kv_cache, kv_cache_bytes_per_block
from engine_server.models.afmoe import AfmoeForCausalLM
from engine_server.models.apertus import ApertusForCausalLM
from engine_server.models.base import CausalLM
from engine_server.models.beam import BeamForCausalLM
from engine_server.models.bert import BertEncoder
from engine_server.models.bitnet import BitNetForCausalLM
from engine_server.models.cohere import CohereForCausalLM
from engine_server.models.dbrx import DbrxForCausalLM
from engine_server.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine_server.models.deepseek_v4 import DeepseekV4ForCausalLM
from engine_server.models.dory import DoryForCausalLM
from engine_server.models.ergo import ErgoForCausalLM
from engine_server.models.ernie4_5 import Ernie4_5ForCausalLM, Ernie4_5MoeForCausalLM
from engine_server.models.falcon_h1 import FalconH1ForCausalLM
from engine_server.models.gemma import GemmaForCausalLM
from engine_server.models.gemma2 import Gemma2ForCausalLM
from engine_server.models.gemma3 import Gemma3ForCausalLM
from engine_server.models.gemma3n import Gemma3nForCausalLM
from engine_server.models.gemma4 import Gemma4ForCausalLM
from engine_server.models.glm4 import Glm4ForCausalLM
from engine_server.models.glm4_moe import Glm4MoeForCausalLM
from engine_server.models.gpt_neox import GPTNeoXForCausalLM
from engine_server.models.gpt_oss import GptOssForCausalLM
from engine_server.models.gptj import GPTJForCausalLM
from engine_server.models.granite import GraniteForCausalLM
from engine_server.models.granitemoe import GraniteMoeForCausalLM
from engine_server.models.hunyuan import HunYuanForCausalLM
from engine_server.models.jamba import JambaForCausalLM
from engine_server.models.jetmoe import JetMoeForCausalLM
from engine_server.models.lfm2 import Lfm2ForCausalLM
from engine_server.models.llama import LlamaForCausalLM
from engine_server.models.llama4 import Llama4ForCausalLM
from engine_server.models.longcat_flash import LongcatFlashForCausalLM
from engine_server.models.mamba import MambaForCausalLM
from engine_server.models.minimax import MiniMaxForCausalLM
from engine_server.models.minimax_m2 import MiniMaxM2ForCausalLM
from engine_server.models.minimax_m3 import MiniMaxM3ForCausalLM
from engine_server.models.mixtral import MixtralForCausalLM
from engine_server.models.nanochat import NanoChatForCausalLM
from engine_server.models.nemotron_h import NemotronHForCausalLM
from engine_server.models.olmo2 import Olmo2ForCausalLM
from engine_server.models.olmo_hybrid import OlmoHybridForCausalLM
from engine_server.models.olmoe import OlmoeForCausalLM
from engine_server.models.phi3 import Phi3ForCausalLM
from engine_server.models.qwen2 import Qwen2ForCausalLM
from engine_server.models.qwen2_moe import Qwen2MoeForCausalLM
from engine_server.models.qwen3 import Qwen3ForCausalLM
from engine_server.models.qwen3_moe import Qwen3MoeForCausalLM
from engine_server.models.qwen3_next import Qwen3NextForCausalLM
from engine_server.models.qwen4_exp import Qwen4ExpForCausalLM
from engine_server.models.recurrent_gemma import RecurrentGemmaForCausalLM
from engine_server.models.rwkv import RwkvForCausalLM
from engine_server.models.smollm3 import SmolLM3ForCausalLM
from engine_server.models.whisper import WhisperForConditionalGeneration
from engine_server.models.xlstm import XLstmForCausalLM
from engine_server.models.zamba2 import Zamba2ForCausalLM

__all__ = ["BertEncoder", "CausalLM", "StepModel", "allocate_kv_cache", "get_model_class", "kv_cache_bytes_per_block"]

# What the runner runs steps on: a decoder that generates, or an encoder that only pools.
StepModel = CausalLM | BertEncoder


def get_model_class(architecture: str) -> type[CausalLM]:
    """The decoder class for an architecture name (`config.Architecture`: "llama", "qwen2", "qwen3", "phi3",
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "gemma", "gemma2", "gemma3", "smollm3", "granite",
    "olmo2", "deepseek_v3", "qwen3_next", "gemma4", "llama4", "glm4_moe", "glm4", "minimax_m2", "ernie4_5",
    "ernie4_5_moe", "cohere", "lfm2", "granitemoe", "nemotron_h", "hunyuan", "apertus", "afmoe", "falcon_h1",
    "jamba", "gpt_neox", "gptj", "nanochat", "olmo_hybrid", "mamba", "dbrx", "gemma3n", "deepseek_v4",
    "longcat_flash", "minimax", "bitnet", "minimax_m3", "beam", "ergo", "recurrent_gemma", "jetmoe", "dory",
    "zamba2", "qwen4_exp", "xlstm", "rwkv", "whisper");
    ValueError for anything else (an encoder, "bert", is a `BertEncoder`)."""
    classes: dict[str, type[CausalLM]] = {
        "llama": LlamaForCausalLM,
        "qwen2": Qwen2ForCausalLM,
        "qwen3": Qwen3ForCausalLM,
        "phi3": Phi3ForCausalLM,
        "mixtral": MixtralForCausalLM,
        "qwen2_moe": Qwen2MoeForCausalLM,
        "qwen3_moe": Qwen3MoeForCausalLM,
        "olmoe": OlmoeForCausalLM,
        "gpt_oss": GptOssForCausalLM,
        "gemma": GemmaForCausalLM,
        "gemma2": Gemma2ForCausalLM,
        "gemma3": Gemma3ForCausalLM,
        "gemma4": Gemma4ForCausalLM,
        "llama4": Llama4ForCausalLM,
        "smollm3": SmolLM3ForCausalLM,
        "granite": GraniteForCausalLM,
        "olmo2": Olmo2ForCausalLM,
        "deepseek_v3": DeepseekV3ForCausalLM,
        "qwen3_next": Qwen3NextForCausalLM,
        "glm4_moe": Glm4MoeForCausalLM,
        "glm4": Glm4ForCausalLM,
        "minimax_m2": MiniMaxM2ForCausalLM,
        "ernie4_5": Ernie4_5ForCausalLM,
        "ernie4_5_moe": Ernie4_5MoeForCausalLM,
        "cohere": CohereForCausalLM,
        "lfm2": Lfm2ForCausalLM,
        "granitemoe": GraniteMoeForCausalLM,
        "nemotron_h": NemotronHForCausalLM,
        "mamba": MambaForCausalLM,
        "hunyuan": HunYuanForCausalLM,
        "apertus": ApertusForCausalLM,
        "nanochat": NanoChatForCausalLM,
        "olmo_hybrid": OlmoHybridForCausalLM,
        "afmoe": AfmoeForCausalLM,
        "falcon_h1": FalconH1ForCausalLM,
        "jamba": JambaForCausalLM,
        "gpt_neox": GPTNeoXForCausalLM,
        "gptj": GPTJForCausalLM,
        "dbrx": DbrxForCausalLM,
        "gemma3n": Gemma3nForCausalLM,
        "deepseek_v4": DeepseekV4ForCausalLM,
        "longcat_flash": LongcatFlashForCausalLM,
        "minimax": MiniMaxForCausalLM,
        "bitnet": BitNetForCausalLM,
        "minimax_m3": MiniMaxM3ForCausalLM,
        "beam": BeamForCausalLM,
        "ergo": ErgoForCausalLM,
        "dory": DoryForCausalLM,
        "zamba2": Zamba2ForCausalLM,
        "recurrent_gemma": RecurrentGemmaForCausalLM,
        "jetmoe": JetMoeForCausalLM,
        "qwen4_exp": Qwen4ExpForCausalLM,
        "xlstm": XLstmForCausalLM,
        "rwkv": RwkvForCausalLM,
        "whisper": WhisperForConditionalGeneration,
    }
    if architecture not in classes:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(classes)}")
    return classes[architecture]
