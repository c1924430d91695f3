"""ladle.v1 Embed and Score results -> OpenAI's embeddings and vLLM's score and rerank response bodies. Pure
functions over the engine's messages; also the engine's field names in a pooling call's error as the body names them.
"""

from __future__ import annotations

import array
import base64
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gateway.schemas.pooling import RerankRequest
from ladle.v1 import engine_pb2, types_pb2


def pooling_usage(messages: Iterable[types_pb2.Usage]) -> dict[str, int]:
    """Usage of pooling calls: prompt tokens only (nothing is generated)."""
    prompt = sum(u.prompt_tokens for u in messages)
    return {"prompt_tokens": prompt, "total_tokens": prompt}


def embedding_base64(values: Sequence[float]) -> str:
    """A vector as OpenAI's base64 encoding: its float32 values, little-endian, base64 (what the openai SDK
    decodes with `np.frombuffer(..., dtype="float32")`)."""
    packed = array.array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def embedding_list(reply: engine_pb2.EmbedResponse, model: str, encoding_format: str) -> dict[str, Any]:
    """OpenAI's embeddings response (`object: list`), vectors as floats or base64 strings."""
    data = [
        {
            "object": "embedding",
            "index": e.index,
            "embedding": embedding_base64(e.values) if encoding_format == "base64" else list(e.values),
        }
        for e in reply.embeddings
    ]
    return {"object": "list", "data": data, "model": model, "usage": pooling_usage([reply.usage])}


def score_list(
    groups: Sequence[Sequence[int]], replies: Sequence[engine_pb2.ScoreResponse], response_id: str, model: str
) -> dict[str, Any]:
    """vLLM's score response: one entry per pair, in pair order. `replies[k]` answered the pairs `groups[k]`
    (`pooling_to_engine.score_groups`), its scores in that order."""
    scores: dict[int, float] = {}
    for group, reply in zip(groups, replies, strict=True):
        scores.update(zip(group, reply.scores, strict=True))
    data = [{"index": i, "object": "score", "score": scores[i]} for i in range(len(scores))]
    usage_body = {**pooling_usage(r.usage for r in replies), "completion_tokens": 0}
    return {"id": response_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": usage_body}


def rerank_result(body: RerankRequest, reply: engine_pb2.ScoreResponse, response_id: str, model: str) -> dict[str, Any]:
    """vLLM's rerank response (Jina / Cohere compatible): documents by descending score (ties in document order),
    the first `top_n` of them (all when 0 or unset), each with its text unless return_documents is false."""
    texts = body.document_texts()
    order = sorted(range(len(reply.scores)), key=lambda i: -reply.scores[i])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": reply.scores[i]}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return {"id": response_id, "model": model, "usage": pooling_usage([reply.usage]), "results": results}


def pooling_param(param: str | None, names: Mapping[str, str]) -> str | None:
    """A field the engine named in a pooling call's error (e.g. `inputs[2]`), as the HTTP body names it (`input[2]`):
    its leading name replaced by `names` (kept when `names` has none)."""
    if param is None:
        return None
    head, sep, rest = param.partition("[")
    head, dot, tail = head.partition(".")
    renamed = names.get(head, head)
    return renamed + dot + tail + sep + rest
