"""Object ids: unguessable (128 random bits) and checked before any lookup, so a client-chosen id never reaches
a query or a path unless it has exactly the shape the gateway hands out."""

from __future__ import annotations

import re
import secrets

FILE_PREFIX = "file-"
BATCH_PREFIX = "batch_"
BATCH_REQUEST_PREFIX = "batch_req_"
RESPONSE_PREFIX = "resp_"
CONVERSATION_PREFIX = "conv_"

_SHAPES = {
    prefix: re.compile(re.escape(prefix) + r"[0-9a-f]{32}")
    for prefix in (FILE_PREFIX, BATCH_PREFIX, RESPONSE_PREFIX, CONVERSATION_PREFIX)
}


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


def is_id(value: str, prefix: str) -> bool:
    """Whether `value` is an id of the kind `prefix` names (FILE_PREFIX, BATCH_PREFIX, RESPONSE_PREFIX or
    CONVERSATION_PREFIX)."""
    return _SHAPES[prefix].fullmatch(value) is not None
