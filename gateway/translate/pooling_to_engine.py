"""OpenAI and vLLM pooling bodies (embeddings, score, rerank) -> ladle.v1 Embed and Score requests. Pure functions;
a request the engine cannot express is a 400 naming the field.

An embeddings body without `normalize` leaves it to the model's pooling configuration. A score body's two sides
pair up 1 vs N or N vs N (`score_pairs`), one Score call per distinct first-side text (`score_groups`).
Every request carries the caller's project's `cache_salt` (`translate.cache_salt`): a decoder's pooled inputs
read and fill the same prefix cache as its generations.
"""

from __future__ import annotations

from gateway.errors import invalid
from gateway.schemas.pooling import (
    MAX_POOLING_INPUTS,
    SCORE_FIELD_PAIRS,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from gateway.translate.to_engine import chat_message, prompt_input, template_kwargs, unicode_text
from ladle.v1 import engine_pb2, types_pb2


def embed_request(
    body: EmbeddingRequest,
    request_id: str,
    info: engine_pb2.GetModelInfoResponse | None = None,
    *,
    cache_salt: str = "",
) -> engine_pb2.EmbedRequest:
    """The engine's Embed request for an embeddings body: one input per string or token-id list of `input`, or one
    chat input for vLLM's `messages`. `info` (the engine's model info, when known) bounds `dimensions` and gives
    `truncate_prompt_tokens: -1` its meaning, the context length. `cache_salt`: the project's."""
    with unicode_text():
        request = _embed_request(body, request_id, info)
    request.cache_salt = cache_salt
    return request


def _embed_request(
    body: EmbeddingRequest, request_id: str, info: engine_pb2.GetModelInfoResponse | None
) -> engine_pb2.EmbedRequest:
    if body.messages is not None and body.input is not None:
        raise invalid("give either input or messages, not both", "messages")
    inputs = [_chat_embedding_input(body)] if body.messages is not None else _embedding_inputs(body)
    request = engine_pb2.EmbedRequest(request_id=request_id, inputs=inputs)
    if body.dimensions is not None:
        size = info.pooling.dimensions if info is not None else 0
        if size and body.dimensions > size:
            raise invalid(f"dimensions is {body.dimensions}; this model's embeddings have {size}", "dimensions")
        request.dimensions = body.dimensions
    normalize = body.normalize if body.normalize is not None else body.use_activation
    if normalize is not None:
        request.normalize = normalize
    truncate = _truncation(body.truncate_prompt_tokens, info)
    if truncate is not None:
        request.truncate_prompt_tokens = truncate
    return request


def _embedding_inputs(body: EmbeddingRequest) -> list[types_pb2.Input]:
    if body.input is None:
        raise invalid("input is required (a string, a list of strings, or token ids)", "input")
    if body.add_special_tokens is False:
        raise invalid("add_special_tokens false is not supported: text gets the tokenizer's special tokens; send "
                      "token ids to control them", "add_special_tokens")
    values = body.inputs()
    if not values:
        raise invalid("input must not be empty", "input")
    if len(values) > MAX_POOLING_INPUTS:
        raise invalid(f"input holds {len(values)} inputs; at most {MAX_POOLING_INPUTS} are allowed", "input")
    listed = isinstance(body.input, list) and not isinstance(body.input[0], int)  # several inputs, not one id list
    return [_pooling_input(v, f"input[{i}]" if listed else "input") for i, v in enumerate(values)]


def _pooling_input(value: str | list[int], where: str) -> types_pb2.Input:
    if not value:
        raise invalid(f"{where} must not be empty", where)
    return prompt_input(value, where)


def _chat_embedding_input(body: EmbeddingRequest) -> types_pb2.Input:
    """vLLM's chat embedding: the conversation rendered with the chat template, without the assistant-turn header
    unless add_generation_prompt is set."""
    if not body.messages:
        raise invalid("messages must not be empty", "messages")
    if body.add_special_tokens:
        raise invalid("add_special_tokens is not supported with messages: the chat template adds them",
                      "add_special_tokens")
    chat = types_pb2.ChatInput(messages=[chat_message(m, i) for i, m in enumerate(body.messages)],
                               add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message)
    if body.chat_template_kwargs:
        template_kwargs(body.chat_template_kwargs, chat)
    return types_pb2.Input(chat=chat)


def _truncation(value: int | None, info: engine_pb2.GetModelInfoResponse | None) -> int | None:
    """vLLM's truncate_prompt_tokens as the engine's: -1 is the context length (unset while that is unknown: the
    engine then refuses an input too long for it), k >= 1 keeps an input's last k tokens."""
    if value is None:
        return None
    if value == 0:
        raise invalid("truncate_prompt_tokens must be -1 (the model's context length) or at least 1",
                      "truncate_prompt_tokens")
    if value == -1:
        return info.context_length if info is not None and info.context_length else None
    return value


def score_pairs(body: ScoreRequest) -> tuple[list[str], list[str], tuple[str, str]]:
    """(first-side text, second-side text) of every pair a score body asks for, as two lists, and the names of its
    two sides (e.g. text_1, text_2). One first-side text is scored against each of the second side's (1 vs N); N of
    them element-wise against N. 400 unless exactly one pair of sides is given and their lengths pair up."""
    sides = body.sides()
    if not sides:
        names = " or ".join(f"{a} and {b}" for a, b in reversed(SCORE_FIELD_PAIRS))
        raise invalid(f"give the texts to score: {names}", "text_1")
    if len(sides) > 1:
        raise invalid(f"give one pair of texts to score, not {len(sides)} ({sides[0]} and {sides[1]})", sides[1][0])
    first, second = sides[0]
    ones, twos = _score_side(body, first), _score_side(body, second)
    if len(ones) > 1 and len(ones) != len(twos):
        raise invalid(f"{first} holds {len(ones)} texts and {second} {len(twos)}: score one text against N, or N "
                      "against N element-wise", second)
    return (ones * len(twos) if len(ones) == 1 else ones), twos, (first, second)


def _score_side(body: ScoreRequest, name: str) -> list[str]:
    value = getattr(body, name)
    texts: list[str] = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise invalid(f"{name} must not be empty", name)
    if len(texts) > MAX_POOLING_INPUTS:
        raise invalid(f"{name} holds {len(texts)} texts; at most {MAX_POOLING_INPUTS} are allowed", name)
    for i, text in enumerate(texts):
        if not text:
            where = name if isinstance(value, str) else f"{name}[{i}]"
            raise invalid(f"{where} must not be empty", where)
    return texts


def score_groups(queries: list[str]) -> list[list[int]]:
    """The pairs' indices grouped by equal first-side text, in order of first appearance: one Score call each."""
    groups: dict[str, list[int]] = {}
    for index, query in enumerate(queries):
        groups.setdefault(query, []).append(index)
    return list(groups.values())


def score_requests(
    body: ScoreRequest,
    request_id: str,
    info: engine_pb2.GetModelInfoResponse | None = None,
    *,
    cache_salt: str = "",
) -> list[engine_pb2.ScoreRequest]:
    """One engine Score request per group of `score_groups` (ids `{request_id}-{k}` when there are several), each
    with the project's `cache_salt`."""
    with unicode_text():
        queries, documents, _ = score_pairs(body)
        groups = score_groups(queries)
        truncate = _truncation(body.truncate_prompt_tokens, info)
        requests = []
        for k, group in enumerate(groups):
            request = engine_pb2.ScoreRequest(
                request_id=request_id if len(groups) == 1 else f"{request_id}-{k}",
                query=types_pb2.Input(text=queries[group[0]]),
                documents=[types_pb2.Input(text=documents[p]) for p in group],
                cache_salt=cache_salt,
            )
            if truncate is not None:
                request.truncate_prompt_tokens = truncate
            requests.append(request)
        return requests


def rerank_request(
    body: RerankRequest,
    request_id: str,
    info: engine_pb2.GetModelInfoResponse | None = None,
    *,
    cache_salt: str = "",
) -> engine_pb2.ScoreRequest:
    """The engine's Score request for a rerank body: the query against every document, with the project's
    `cache_salt`."""
    if not body.query:
        raise invalid("query must not be empty", "query")
    texts = body.document_texts()
    if not texts:
        raise invalid("documents must not be empty", "documents")
    if len(texts) > MAX_POOLING_INPUTS:
        raise invalid(f"documents holds {len(texts)} documents; at most {MAX_POOLING_INPUTS} are allowed",
                      "documents")
    for i, text in enumerate(texts):
        if not text:
            raise invalid(f"documents[{i}] must not be empty", f"documents[{i}]")
    with unicode_text():
        request = engine_pb2.ScoreRequest(request_id=request_id, query=types_pb2.Input(text=body.query),
                                          documents=[types_pb2.Input(text=t) for t in texts], cache_salt=cache_salt)
    truncate = _truncation(body.truncate_prompt_tokens, info)
    if truncate is not None:
        request.truncate_prompt_tokens = truncate
    return request
