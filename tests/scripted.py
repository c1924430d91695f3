"""A real checkpoint that writes what it is told: a one-layer Llama whose weights make the next token a function of
the current one, with a tokenizer whose whole pieces are single tokens. Served by the engine like any model folder
(nothing faked inside the engine), it makes a model's output known in advance, so a test can check what the serving
stack does with a given reply (a tool call in a family's format, a reasoning) end to end.

How: every attention output and MLP down projection is zero, so the last hidden state is the current token's
embedding; each scripted token's embedding is its own basis vector, and the LM head row of each scripted token
points along its predecessor's. After a scripted token the next one leads by `MARGIN` logits (every other logit is
exactly 0), so sampling at temperature 1 follows the script too. A script starts from a *cue*: the last token of
the prompt (the chat template's generation prompt ends with it), and runs to the end-of-sequence token.

The tokenizer is byte-level BPE with no merges (any text encodes, one token per byte), the family's special tokens,
and each script piece as an added token. Every piece may appear once over all scripts (a token has one successor);
the end-of-sequence token ends any number of them. A cue of several characters is an added token too, so a prompt
that ends with it ends with that token.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

HIDDEN = 128
MARGIN = 40.0


def save_scripted_model(
    folder: Path,
    chat_template: str,
    scripts: Mapping[str, Sequence[str]],
    special_tokens: Sequence[str],
    bos_token: str,
    eos_token: str,
    stop_tokens: Sequence[str] = (),
) -> Path:
    """Save the model and tokenizer to `folder` (see the module docstring); returns `folder`.

    `scripts` maps a cue (a special token, or text: a token of its own) to the pieces written after it, the last of
    them `eos_token` or one of `stop_tokens`, further end-of-sequence tokens that generation_config.json lists (as
    gpt-oss lists its `<|call|>`). `special_tokens` are the family's control tokens (the bos, the eos and the pieces
    among them are special too). Raises ValueError when a piece repeats or there are more scripted tokens than
    dimensions."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = list(dict.fromkeys([bos_token, eos_token, *special_tokens]))
    pieces = [p for script in scripts.values() for p in script if p != eos_token and p not in stop_tokens]
    if len(set(pieces)) != len(pieces):
        raise ValueError(f"a piece repeats: {pieces}")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_tokens([AddedToken(p, normalized=False) for p in pieces if p not in specials])
    for cue in scripts:  # a cue of several bytes ("\n\n") is a token of its own, as in the family's vocabulary
        if cue not in specials and len(backend.encode(cue, add_special_tokens=False).ids) != 1:
            backend.add_tokens([AddedToken(cue, normalized=False)])

    def token_id(text: str) -> int:
        ids = backend.encode(text, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ValueError(f"{text!r} is not one token: {ids}")
        return ids[0]

    chains = [[token_id(cue), *(token_id(p) for p in script)] for cue, script in scripts.items()]
    scripted = list(dict.fromkeys(t for chain in chains for t in chain))
    if len(scripted) > HIDDEN:
        raise ValueError(f"{len(scripted)} scripted tokens do not fit {HIDDEN} dimensions")
    vocab_size = backend.get_vocab_size()
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=token_id(bos_token), eos_token_id=token_id(eos_token),
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    basis = {token: i for i, token in enumerate(scripted)}
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed.normal_(0.0, 1.0)
        embed[list(basis)] = torch.eye(HIDDEN)[list(basis.values())]
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.get_output_embeddings().weight
        head.zero_()
        # The final norm scales a basis vector to length sqrt(HIDDEN).
        for chain in chains:
            for before, after in itertools.pairwise(chain):
                head[after, basis[before]] = MARGIN / HIDDEN**0.5
    model.save_pretrained(folder)
    if stop_tokens:
        ends = [token_id(eos_token), *(token_id(t) for t in stop_tokens)]
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos_token, eos_token=eos_token)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    config_file = folder / "tokenizer_config.json"
    settings = json.loads(config_file.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(settings, indent=2))
    return folder
