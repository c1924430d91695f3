"""The blob directory: keys never leave the root, whole files appear atomically, committed prefixes are read and
joined exactly, and leftovers of a crashed upload are swept."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gateway.store.blobs import BlobStore
from gateway.uploads import safe_filename


def test_keys_cannot_leave_the_root(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    assert blobs.path("files/file-1") == (tmp_path / "blobs" / "files" / "file-1").resolve()
    for key in ["../outside", "files/../../outside", "/etc/passwd", "", ".", "files/../.."]:
        with pytest.raises(ValueError):
            blobs.path(key)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "blobs" / "link")
    with pytest.raises(ValueError):
        blobs.path("link/x")


def test_publish_replaces_atomically_and_discard_leaves_nothing(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    for content in (b"first", b"second"):
        temp, out = blobs.temp_file()
        with out:
            out.write(content)
        blobs.publish(temp, "files/a")
        assert blobs.path("files/a").read_bytes() == content and not temp.exists()
    temp, out = blobs.temp_file()
    out.close()
    blobs.discard(temp)
    assert list((tmp_path / "tmp").iterdir()) == []


def test_committed_prefixes_are_read_and_joined_exactly(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    first = blobs.open_segment("batches/b/1.output.jsonl")
    first.append(b'{"a":1}\n{"a":2}\n')
    committed = first.sync()
    first.append(b'{"a":3}\n{"a":')  # written, never committed
    first.close()
    second = blobs.open_segment("batches/b/2.output.jsonl")
    second.append(b'{"a":4}\n')
    second.close()
    assert list(blobs.read_lines("batches/b/1.output.jsonl", committed)) == [b'{"a":1}\n', b'{"a":2}\n']
    size = blobs.concatenate([("batches/b/1.output.jsonl", committed), ("batches/b/2.output.jsonl", 8)],
                             "batches/b/output.jsonl")
    assert blobs.path("batches/b/output.jsonl").read_bytes() == b'{"a":1}\n{"a":2}\n{"a":4}\n'
    assert size == committed + 8
    with pytest.raises(ValueError):
        list(blobs.read_lines("batches/b/2.output.jsonl", 100))
    with pytest.raises(FileExistsError):
        blobs.open_segment("batches/b/2.output.jsonl")  # a claim never appends to another's segment


def test_sweep_removes_only_old_temporary_files(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    old, out = blobs.temp_file()
    out.close()
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    fresh, out = blobs.temp_file()
    out.close()
    assert blobs.sweep_temp(3600) == 1 and not old.exists() and fresh.exists()


@pytest.mark.parametrize(
    ("name", "shown"),
    [("in.jsonl", "in.jsonl"), ("../../etc/passwd", "passwd"), ("C:\\x\\..\\y.jsonl", "y.jsonl"),
     ("a\x00b\nc", "abc"), ("..", "upload"), ("", "upload"), ("/", "upload"), ("x" * 300, "x" * 255)],
)
def test_client_file_names_are_only_a_tidy_label(name: str, shown: str) -> None:
    assert safe_filename(name) == shown
