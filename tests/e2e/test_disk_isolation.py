"""Disk isolation through a real gateway process: a project over its quota cannot put bytes on disk by uploading in
parallel (the blob directory, sampled while 8 uploads stream, stays within the quota plus one reservation step),
with and without a Content-Length; below the free-space floor uploads and batches are refused with 507."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.disk import RESERVE_STEP_BYTES
from tests.e2e.gateway_process import GatewayProcess, free_port, start_gateway

pytestmark = pytest.mark.slow

MiB = 1024 * 1024
QUOTA = 8 * MiB
FILE_BYTES = 3 * MiB  # room for two in the quota, not three
PIECE = 64 * 1024
BOUNDARY = "ladle-disk-test"


def form(data_pieces: Iterator[bytes]) -> Iterator[bytes]:
    yield (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
           f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
           "Content-Type: application/octet-stream\r\n\r\n").encode()
    yield from data_pieces
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


def slow_pieces(total: int, pause_s: float) -> Iterator[bytes]:
    """`total` bytes of JSONL-looking data, a piece at a time with a pause between: an upload that takes a while,
    so that racing uploads overlap."""
    sent = 0
    while sent < total:
        piece = min(PIECE, total - sent)
        yield b"x" * (piece - 1) + b"\n"
        sent += piece
        time.sleep(pause_s)


def blob_bytes(root: Path) -> int:
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # published or discarded meanwhile
                total += os.stat(os.path.join(folder, name)).st_size
    return total


class DiskSampler:
    """The largest number of bytes seen in the blob directory, sampled every ~2 ms in a thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disk-sampler", daemon=True)

    def __enter__(self) -> DiskSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, blob_bytes(self.root))
            time.sleep(0.002)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    # No engine is needed for files: the address is a closed port, and /health is not waited for.
    process = start_gateway(tmp_path / "gateway.log", f"127.0.0.1:{free_port()}", "--project-max-file-bytes",
                            str(QUOTA), "--max-file-mib", "16", wait_healthy=False)
    yield process
    assert process.stop() == 0, process.log()


def upload(url: str, declared: bool, outcomes: list[object], start: threading.Barrier) -> None:
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    if declared:
        headers["Content-Length"] = str(len(b"".join(form(iter([b"x" * FILE_BYTES])))))
    start.wait()
    try:
        with httpx.Client(timeout=60) as http:
            reply = http.post(url + "/v1/files", content=form(slow_pieces(FILE_BYTES, 0.01)), headers=headers)
        outcomes.append(reply.json().get("bytes") if reply.status_code == 200 else reply.json()["error"]["code"])
    except httpx.TransportError as exc:  # refused while the body was still being sent: the server hung up
        outcomes.append(type(exc).__name__)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_parallel_uploads_stay_within_the_quota_on_disk(gateway: GatewayProcess, tmp_path: Path,
                                                        declared: bool) -> None:
    outcomes: list[object] = []
    start = threading.Barrier(8)
    threads = [threading.Thread(target=upload, args=(gateway.url, declared, outcomes, start)) for _ in range(8)]
    with DiskSampler(tmp_path / "data" / "blobs") as disk:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    stored = httpx.get(gateway.url + "/v1/files", timeout=30).json()["data"]
    print(f"peak {disk.peak / MiB:.2f} MiB on disk (quota {QUOTA / MiB:.0f} MiB, step {RESERVE_STEP_BYTES / MiB:.0f} "
          f"MiB); outcomes {outcomes}")
    assert len(outcomes) == 8
    assert outcomes.count(FILE_BYTES) == len(stored) == 2, (outcomes, gateway.log())
    refusals = [o for o in outcomes if o != FILE_BYTES]
    assert all(o in ("storage_limit_exceeded", "WriteError", "ReadError", "RemoteProtocolError") for o in refusals)
    assert "storage_limit_exceeded" in refusals
    assert disk.peak <= QUOTA + RESERVE_STEP_BYTES, f"{disk.peak / MiB:.2f} MiB on disk"
    blobs = tmp_path / "data" / "blobs"
    assert blob_bytes(blobs / "files") == 2 * FILE_BYTES and not list((blobs / "tmp").iterdir())  # nothing else stays


def test_below_the_free_space_floor_uploads_and_batches_are_507(tmp_path: Path) -> None:
    # A floor larger than any disk: the volume is always "nearly full".
    gateway = start_gateway(tmp_path / "gateway.log", f"127.0.0.1:{free_port()}", "--min-free-disk-mib",
                            str(1024**3), wait_healthy=False)
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            reply = http.post("/v1/files", files={"file": ("in.jsonl", b"{}\n")}, data={"purpose": "batch"})
            error = reply.json()["error"]
            assert reply.status_code == 507 and (error["type"], error["code"]) == ("server_error",
                                                                                 "insufficient_storage"), error
            assert "below its floor" in error["message"]
            reply = http.post("/v1/batches", json={"input_file_id": "file-" + "0" * 32,
                                                   "endpoint": "/v1/chat/completions", "completion_window": "24h"})
            assert reply.status_code == 507 and reply.json()["error"]["code"] == "insufficient_storage"
            assert not list((tmp_path / "data" / "blobs" / "tmp").iterdir())
    finally:
        assert gateway.stop() == 0
