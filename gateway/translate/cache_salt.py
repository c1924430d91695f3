"""The engine's prefix-cache salt for a request the gateway sends: a function of the caller's project and the body's
optional `cache_salt` (vLLM's field), so cached prompt blocks are shared only within one project.

The engine shares KV blocks, and reports them as `cached_tokens`, only between requests with equal salts
(`GenerateRequest.cache_salt`). The project comes from the API key, never from the body, and a body's salt is
hashed together with the project's, so no client can send another project's salt: a project cannot learn from
cache hits or a faster first token what another project sent. A body salt narrows sharing further, to the
requests of the project that send the same one (vLLM's meaning: e.g. one per end user).

Two steps, so that every path treats a body salt alike: the caller that knows the project (a route, the batch
worker) takes `project_cache_salt(project)` and hands it to the `translate` functions (or `batches.lines.
engine_requests`), which put `request_cache_salt(that, body.cache_salt)` on each engine request they build.
"""

from __future__ import annotations

import hashlib

_PROJECT = b"ladle gateway project cache_salt v1\0"
_BODY = b"ladle gateway body cache_salt v1\0"


def project_cache_salt(project: str) -> str:
    """The salt of `project`'s requests: 64 hex digits of sha256 over its name. Pure and the same on every gateway
    replica and after a restart, so a project keeps its cache hits across them."""
    return _digest(_PROJECT, project)


def request_cache_salt(project_salt: str, body_salt: str | None) -> str:
    """The salt of one engine request: the project's, or, when the body names a `cache_salt` of its own, sha256
    over both (each length-prefixed, so no other pair gives the same bytes)."""
    if not body_salt:
        return project_salt
    return _digest(_BODY, project_salt, body_salt)


def _digest(domain: bytes, *parts: str) -> str:
    digest = hashlib.sha256(domain)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")  # a JSON body may hold a lone surrogate ("\ud800")
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()
