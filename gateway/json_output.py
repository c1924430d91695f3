"""The JSON the gateway writes (HTTP bodies, SSE events, batch result lines): always valid JSON, with no `NaN` or
`Infinity` tokens, whatever floats an engine reply holds.

A float that is not finite becomes what OpenAI-style clients can parse: -inf (a logprob of a token the sampler
ruled out) is -9999.0, the floor vLLM reports for such logprobs, +inf is 9999.0, and NaN (e.g. an embedding of a
model that overflowed) is null. Finite values, the usual case, are written exactly as `json.dumps` writes them,
at the cost of nothing: the values are only walked when `allow_nan=False` refuses them.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse

NEG_INF = -9999.0
POS_INF = 9999.0


def finite(value: Any) -> Any:
    """`value` with every non-finite float inside replaced (see the module docstring); other values as they are."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return NEG_INF if value < 0 else POS_INF
        return value
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, ensure_ascii: bool = False) -> str:
    """Compact JSON for `value`, its non-finite floats replaced."""
    try:
        return json.dumps(value, ensure_ascii=ensure_ascii, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere
        return json.dumps(finite(value), ensure_ascii=ensure_ascii, separators=(",", ":"), allow_nan=False)


class FiniteJSONResponse(JSONResponse):
    """A JSONResponse whose body is `dumps(content)`: a reply holding NaN or an infinity is still sent, as valid
    JSON, instead of failing (Starlette's JSONResponse raises on them: a 500 for a good generation)."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")
