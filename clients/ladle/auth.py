"""The engine's bearer token: the token file both sides read, and the call metadata that carries it.

An engine started with `--auth-token-file` answers every RPC but `grpc.health.v1.Health` only when the call
carries `authorization: Bearer <token>` (engine_server.server.auth). A token file holds one token per line;
surrounding whitespace and blank lines are ignored. The engine accepts every token in its file (so a token can
be rotated without downtime: add the new one to the engines, move the senders over, drop the old one); a sender
(`AsyncEngineClient`, the gateway, `ladle batch --engine`) sends the first.
"""

from __future__ import annotations

import secrets
from pathlib import Path

AUTHORIZATION_KEY = "authorization"  # gRPC metadata keys are lower case
BEARER = "Bearer"
Metadata = tuple[tuple[str, str], ...]


class AuthTokenError(ValueError):
    """A token file that cannot be used (missing, unreadable, empty, or a token a header cannot carry)."""


def read_token_file(path: str | Path) -> tuple[str, ...]:
    """The tokens in `path`, in order (at least one). Raises AuthTokenError saying what is wrong with the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthTokenError(f"cannot read the auth token file {path}: {exc}") from None
    tokens = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not tokens:
        raise AuthTokenError(f"the auth token file {path} is empty")
    for number, token in enumerate(tokens, start=1):
        # A gRPC metadata value is printable ASCII; a space would split the "Bearer <token>" pair.
        if not all("!" <= char <= "~" for char in token):
            raise AuthTokenError(f"token {number} in {path} has a character other than printable ASCII "
                                 "without spaces, so no header can carry it")
    return tokens


def sender_token(path: str | Path) -> str:
    """The token a sender sends: the first one in `path` (AuthTokenError as for read_token_file)."""
    return read_token_file(path)[0]


def bearer_metadata(token: str | None) -> Metadata:
    """The metadata of a call that carries `token` (none for None)."""
    return ((AUTHORIZATION_KEY, f"{BEARER} {token}"),) if token else ()


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text), for an engine and gateway started together."""
    return secrets.token_urlsafe(32)
