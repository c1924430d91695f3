"""API keys and the projects they belong to: `--api-key`, the `--api-keys-file`, `--metrics-api-key`, and the
lookup by digest.

The keys file holds one `KEY PROJECT` pair a line, optionally followed by `admin`: an operator's key, which
reads /metrics, every project's usage and the other operator routes (it still acts for its own project
elsewhere). Blank lines and lines starting with `#` are skipped. A key appears once; a project name is 1-64
letters, digits, `.`, `_` or `-`. `--api-key` is a key of the default project; `--metrics-api-key` is an admin
key for /metrics alone. Errors name the file and the line, never the key. `KeyRing.reload` (on SIGHUP) reads the
file again and keeps the keys it had if the new file is unreadable or malformed.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

import structlog

from gateway.config import GatewayConfig
from gateway.store.tables import DEFAULT_PROJECT

log = structlog.get_logger(__name__)

_PROJECT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
ADMIN_FLAG = "admin"


@dataclass(frozen=True)
class KeyEntry:
    """What a key is: the project it acts for, and whether it is an operator's (admin) key."""

    project: str
    admin: bool = False


class KeysFileError(ValueError):
    """The keys file cannot be read, or a line of it is not `KEY PROJECT`."""


def parse_keys(text: str, source: str) -> dict[str, KeyEntry]:
    """Key -> what it is, for the lines of a keys file (`source` names it in errors)."""
    keys: dict[str, KeyEntry] = {}
    lines: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) not in (2, 3):
            raise KeysFileError(f"{source}, line {number}: expected 'KEY PROJECT' or 'KEY PROJECT admin', found "
                                f"{len(fields)} fields")
        key, project = fields[:2]
        if not _PROJECT_NAME.match(project):
            raise KeysFileError(f"{source}, line {number}: a project name is 1-64 letters, digits, '.', '_' or '-'")
        if len(fields) == 3 and fields[2] != ADMIN_FLAG:
            raise KeysFileError(f"{source}, line {number}: the third field may only be '{ADMIN_FLAG}'")
        if key in keys:
            raise KeysFileError(f"{source}, line {number}: the key of line {lines[key]} again")
        keys[key] = KeyEntry(project, admin=len(fields) == 3)
        lines[key] = number
    if not keys:
        raise KeysFileError(f"{source}: no keys (a keys file that allowed nothing would be a mistake)")
    return keys


def read_keys(api_key: str | None, keys_file: Path | None) -> dict[str, KeyEntry]:
    """Key -> what it is, from `api_key` (the default project's) and `keys_file`; KeysFileError for a bad file."""
    keys: dict[str, KeyEntry] = {}
    if keys_file is not None:
        try:
            text = keys_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeysFileError(f"cannot read the API keys file {keys_file}: {exc}") from None
        keys = parse_keys(text, str(keys_file))
    if api_key:
        listed = keys.get(api_key)
        if listed is not None and listed.project != DEFAULT_PROJECT:
            raise KeysFileError(f"{keys_file}: --api-key is listed there for another project than {DEFAULT_PROJECT}")
        keys[api_key] = listed or KeyEntry(DEFAULT_PROJECT)
    return keys


class KeyRing:
    """The gateway's current keys. `required` is False when there are none: then every request is the default
    project's.

    Keys are kept only as SHA-256 digests, in a dict from digest to project: a lookup hashes the presented key
    and finds its digest in one step, whatever the number of keys. Its time depends on the presented key's
    digest alone, never on how much of a real key a guess got right (a guess one character off has an unrelated
    digest), so it says nothing about the keys; and the dict holds no key itself.
    """

    def __init__(self, api_key: str | None = None, keys_file: Path | None = None,
                 metrics_key: str | None = None) -> None:
        self.api_key = api_key
        self.keys_file = keys_file
        self._keys = self._digests(read_keys(api_key, keys_file))
        self._metrics_key = _digest(metrics_key) if metrics_key else None

    @classmethod
    def from_config(cls, config: GatewayConfig) -> KeyRing:
        return cls(config.api_key, config.api_keys_file, config.metrics_api_key)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def project_of(self, key: str) -> str | None:
        """The project of `key`; None if it is no key of ours."""
        entry = self._keys.get(_digest(key))
        return entry.project if entry is not None else None

    @property
    def has_admin(self) -> bool:
        """Whether any key is flagged admin (then only admin keys pass the operator routes)."""
        return any(entry.admin for entry in self._keys.values())

    def is_admin(self, key: str) -> bool:
        """Whether `key` may use the operator routes: a key flagged admin; while no key is, a key of the default
        project (the operator's `--api-key`); anyone when the gateway has no keys at all."""
        entry = self._keys.get(_digest(key))
        if self.has_admin:
            return entry is not None and entry.admin
        return not self.required or (entry is not None and entry.project == DEFAULT_PROJECT)

    def may_read_metrics(self, key: str) -> bool:
        """Whether `key` may read /metrics: the --metrics-api-key or an admin key when either is set (and only
        they); else as `is_admin` says."""
        if self._metrics_key is not None and hmac.compare_digest(_digest(key), self._metrics_key):
            return True
        if self._metrics_key is not None and not self.has_admin:
            return False
        return self.is_admin(key)

    def reload(self) -> bool:
        """Read the keys file again (on SIGHUP); on an error log it and keep the keys in use. Whether it took."""
        try:
            keys = read_keys(self.api_key, self.keys_file)
        except KeysFileError as exc:
            log.error("API keys not reloaded; the previous keys stay in use", reason=str(exc))
            return False
        self._keys = self._digests(keys)
        log.info("API keys reloaded", keys=len(keys), projects=len({e.project for e in keys.values()}),
                 admins=sum(e.admin for e in keys.values()))
        return True

    @staticmethod
    def _digests(keys: dict[str, KeyEntry]) -> dict[bytes, KeyEntry]:
        return {_digest(key): entry for key, entry in keys.items()}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
