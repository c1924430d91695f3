"""The database and the blob directory belong together: records name blobs that only that directory holds.

Gateways that share a database must therefore share one blob directory (shared storage). Started with a
directory of its own instead, a replica would claim batches whose files it cannot read. To make that mistake
loud, the gateway that creates a store writes one random id into both (the `ladle_meta` table and `store-id`
in the blob root); every later start checks that they agree, and refuses to start if they do not.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from sqlalchemy import Engine, insert, select
from sqlalchemy.exc import IntegrityError

from gateway.store.blobs import BlobStore
from gateway.store.tables import meta

_KEY = "blob_store_id"
MARKER = "store-id"


class StorePairingError(RuntimeError):
    """The blob directory is not the one the database's records point into."""


def pair(db: Engine, blobs: BlobStore, wait_s: float = 5.0) -> str:
    """Check that `db` and `blobs` belong together, pairing them if the database is new; their shared id.

    A database without an id takes the blob directory's (or a new one, then written to the directory). A
    database with one needs the directory to carry the same: a directory without a marker is given `wait_s`
    for a gateway starting beside this one to write it, then refused."""
    marker = blobs.root / MARKER
    local = _read(marker)
    stored = _stored_id(db)
    if stored is None:
        candidate = local or secrets.token_hex(16)
        if _insert(db, candidate):
            if local is None:
                temp, out = blobs.temp_file()
                with out:
                    out.write(candidate.encode())
                blobs.publish(temp, MARKER)
            return candidate
        stored = _stored_id(db)
    deadline = time.monotonic() + wait_s
    while local is None and time.monotonic() < deadline:
        time.sleep(0.1)
        local = _read(marker)
    if stored is None or local != stored:
        raise StorePairingError(
            f"the database belongs to another blob directory (store id {stored}) than {blobs.root}: every "
            "gateway on one database must use the same --data-dir (shared storage), or a database of its own"
        )
    return stored


def _read(marker: Path) -> str | None:
    return marker.read_text().strip() if marker.exists() else None


def _stored_id(db: Engine) -> str | None:
    with db.begin() as c:
        value: str | None = c.execute(select(meta.c.value).where(meta.c.key == _KEY)).scalar_one_or_none()
        return value


def _insert(db: Engine, value: str) -> bool:
    """Record `value` as the store id; False if another gateway recorded one first."""
    try:
        with db.begin() as c:
            c.execute(insert(meta).values(key=_KEY, value=value))
    except IntegrityError:
        return False
    return True
