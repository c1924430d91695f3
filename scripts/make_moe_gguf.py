"""Write the CPU mixture-of-experts benchmark's model: Qwen3-MoE's shape scaled to a 2-core machine, as llama.cpp
holds it.

64 experts of 256 rows, 8 chosen per token (Qwen3-30B-A3B: 128 of 768, 8 per token), hidden 1024, 8 layers, 16 query
and 4 KV heads of 64, the embedded model's 49,152-token vocabulary: ~0.5 B parameters, ~0.1 B active per token. The
weights are random (tests/families.py, saved by transformers), written as a `qwen3moe` GGUF file with the `gguf`
package: experts and attention in Q4_0, the LM head in Q8_0, norms, embeddings and routers in F32. ladle, llama.cpp
(llama-cpp-python) and transformers (on the converted float folder) then run the same file:

    .venv/bin/python scripts/make_moe_gguf.py /tmp/moe
    ladle bench offline --model /tmp/moe/qwen3-moe-cpu.gguf --num-seqs 1 --input-len 64 --output-len 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.families import save_family, write_gguf

SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=256,
    mlp_only_layers=[],
    max_position_embeddings=4096,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="where the transformers folder and the .gguf file go")
    folder = parser.parse_args().folder
    hf = save_family(folder / "hf", "qwen3-moe", head_spread=0.5, **SHAPE)
    path = write_gguf(
        hf, folder / "qwen3-moe-cpu.gguf", GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_0,
        output=GGMLQuantizationType.Q8_0,
    )  # fmt: skip
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
