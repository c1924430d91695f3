"""File bytes under one root directory, addressed by keys the gateway derives from its own ids.

Layout: `files/<file id>` (uploads), `batches/<batch id>/<epoch>.<kind>.jsonl` (the results one claim of a batch
appended; kind is output or error) and `batches/<batch id>/<kind>.jsonl` (a finished batch's result files).
Whole files appear atomically: written under `tmp/`, flushed to disk, then renamed into place. `path` refuses
any key that resolves outside the root, so even a bug that let a client's string into a key could not reach
another file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Literal

ResultKind = Literal["output", "error"]
_COPY_CHUNK = 1 << 20


def upload_key(file_id: str) -> str:
    return f"files/{file_id}"


def segment_key(batch_id: str, epoch: int, kind: ResultKind) -> str:
    return f"batches/{batch_id}/{epoch}.{kind}.jsonl"


def result_key(batch_id: str, kind: ResultKind) -> str:
    return f"batches/{batch_id}/{kind}.jsonl"


def batch_dir_key(batch_id: str) -> str:
    return f"batches/{batch_id}"


class BlobStore:
    """The blob directory. Safe to share between processes: every whole file is published by rename."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        """The file for `key`; ValueError if the key would leave the root."""
        path = (self.root / key).resolve()
        if path == self.root or not path.is_relative_to(self.root):
            raise ValueError(f"blob key {key!r} is outside the blob directory")
        return path

    def temp_file(self) -> tuple[Path, BinaryIO]:
        """A new, empty temporary file (opened for writing) to fill and then `publish`."""
        path = self.root / "tmp" / secrets.token_hex(16)
        return path, path.open("xb")

    def publish(self, temp: Path, key: str) -> None:
        """Move a filled temporary file to `key` (replacing what was there), durably."""
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        _fsync_path(temp)
        os.replace(temp, target)
        _fsync_dir(target.parent)

    def discard(self, temp: Path) -> None:
        temp.unlink(missing_ok=True)

    def delete(self, key: str) -> None:
        """Remove a file or a directory of files; nothing if it is already gone."""
        path = self.path(key)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def size(self, key: str) -> int:
        return self.path(key).stat().st_size

    def open_segment(self, key: str) -> SegmentWriter:
        """A new append-only file at `key` (it must not exist: every claim writes its own segment)."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        return SegmentWriter(path)

    def read_lines(self, key: str, length: int) -> Iterator[bytes]:
        """The complete lines in the first `length` bytes of `key` (a segment's committed prefix)."""
        if length <= 0:
            return
        with self.path(key).open("rb") as f:
            remaining = length
            while remaining > 0:
                line = f.readline(remaining)
                if not line:
                    raise ValueError(f"blob {key} is shorter than its committed length {length}")
                remaining -= len(line)
                yield line

    def concatenate(self, parts: Iterable[tuple[str, int]], key: str) -> int:
        """Publish at `key` the first `length` bytes of each (part key, length), in order; the total size."""
        temp, out = self.temp_file()
        total = 0
        try:
            with out:
                for part, length in parts:
                    if length <= 0:
                        continue
                    with self.path(part).open("rb") as f:
                        remaining = length
                        while remaining > 0:
                            chunk = f.read(min(_COPY_CHUNK, remaining))
                            if not chunk:
                                raise ValueError(f"blob {part} is shorter than its committed length {length}")
                            out.write(chunk)
                            remaining -= len(chunk)
                    total += length
            self.publish(temp, key)
        except BaseException:
            self.discard(temp)
            raise
        return total

    def sweep_temp(self, older_than_s: float = 3600.0) -> int:
        """Remove temporary files left by a process that died mid-write; how many were removed."""
        cutoff = time.time() - older_than_s
        removed = 0
        for path in (self.root / "tmp").iterdir():
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed

    def free_bytes(self) -> int:
        """Bytes free on the blob directory's file system for an unprivileged writer (one statvfs call)."""
        return shutil.disk_usage(self.root).free

    def old_uploads(self, older_than_s: float) -> Iterator[str]:
        """The keys of upload blobs (`files/<id>`) last written more than `older_than_s` seconds ago."""
        yield from self._old_files("files", time.time() - older_than_s)

    def batch_ids(self) -> Iterator[str]:
        """The batch ids that have a directory under `batches/`."""
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root / "batches"):
                if entry.is_dir(follow_symlinks=False):
                    yield entry.name

    def old_batch_files(self, batch_id: str, older_than_s: float) -> Iterator[str]:
        """The keys of the files in a batch's directory (segments, result files) last written more than
        `older_than_s` seconds ago."""
        yield from self._old_files(batch_dir_key(batch_id), time.time() - older_than_s)

    def remove_dir_if_empty(self, key: str) -> None:
        with contextlib.suppress(OSError):  # not empty, or already gone
            self.path(key).rmdir()

    def _old_files(self, folder: str, cutoff: float) -> Iterator[str]:
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root / folder):
                try:
                    if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        yield f"{folder}/{entry.name}"
                except FileNotFoundError:
                    continue


class SegmentWriter:
    """Appends result lines to one segment file. `sync` returns once everything appended is on disk."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("xb")
        self.length = 0

    def append(self, data: bytes) -> None:
        self._file.write(data)
        self.length += len(data)

    def sync(self) -> int:
        """Flush to disk; the file's length, which a commit may then record."""
        self._file.flush()
        os.fsync(self._file.fileno())
        return self.length

    def close(self) -> None:
        self._file.close()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
