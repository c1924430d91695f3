"""Stop taking new TCP connections on a server's port without dropping the ones the kernel already took (the
engine's gRPC port, the gateway's HTTP port, when they drain).

Closing a listening socket resets every connection still in its accept queue: connections whose handshake the
kernel completed but the server had not yet accepted. A client that writes its request as soon as it connects
(nginx's `grpc_pass` does, and it streams request bodies, so it never sends one twice) then fails the call with a
reset, though the server never saw it. `quiesce` closes that window before the server closes its listener:

1. a socket filter on each of the process's listening sockets for the port drops new connection requests (SYN
   without ACK), so the kernel completes no more handshakes; a dropped client sends its SYN again after about a
   second and, the port closed by then, is refused and goes elsewhere;
2. the accept queues are watched until the server has accepted everything in them (and the handshakes that were
   half done when the filter went on have finished), then a short settle lets it read those requests.

Linux only (classic BPF socket filters and `TCP_INFO`'s accept-queue length); elsewhere it does nothing and the
window stays as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import struct
import sys
import time

import structlog

log = structlog.get_logger(__name__)

SO_ATTACH_FILTER = 26  # linux/asm-generic/socket.h (x86, arm, riscv); Python's socket module does not name it
TCP_FLAGS_OFFSET = 13  # a TCP socket's filter sees the segment from its TCP header on
SYN, ACK = 0x02, 0x10
TCPI_UNACKED_OFFSET = 24  # struct tcp_info: 8 one-byte fields, rto, ato, snd_mss, rcv_mss, then unacked
ACCEPT_QUEUE_POLL_S = 0.01
SETTLE_S = 0.2  # after the accept queues are empty: for the server to read the requests on what it accepted


def _instruction(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


# Drop a segment with SYN set and ACK clear (a new connection request); keep everything else, so handshakes
# already under way finish and land in the accept queue.
REFUSE_SYN_PROGRAM = b"".join([
    _instruction(0x30, 0, 0, TCP_FLAGS_OFFSET),  # ldb [13]
    _instruction(0x54, 0, 0, SYN | ACK),  # and #0x12
    _instruction(0x15, 0, 1, SYN),  # jeq #0x02: next, else skip one
    _instruction(0x06, 0, 0, 0),  # ret #0: drop
    _instruction(0x06, 0, 0, 0xFFFFFFFF),  # ret #-1: keep the whole segment
])


def listening_sockets(port: int) -> list[socket.socket]:
    """Duplicates of this process's listening TCP sockets bound to `port` (the caller closes them)."""
    found: list[socket.socket] = []
    for fd in [fd for fd in map(int, os.listdir("/proc/self/fd")) if _is_socket(fd)]:  # before any duplicate
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            if (sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6)
                    and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    and sock.getsockname()[1] == port):
                found.append(sock)
            else:
                sock.close()
    return found


def _is_socket(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except OSError:  # closed since the listing (the listing's own descriptor)
        return False


def refuse_new_connections(sock: socket.socket) -> None:
    """Attach REFUSE_SYN_PROGRAM to the listening socket `sock` (a duplicate will do: the filter is the
    socket's)."""
    program = ctypes.create_string_buffer(REFUSE_SYN_PROGRAM)
    fprog = struct.pack("HL", len(REFUSE_SYN_PROGRAM) // 8, ctypes.addressof(program))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


def accept_queue_length(sock: socket.socket) -> int:
    """Connections the kernel has completed and the listening `sock`'s owner has not accepted yet."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return int(struct.unpack_from("I", info, TCPI_UNACKED_OFFSET)[0])


async def quiesce(port: int, timeout: float = 2.0) -> bool:
    """Refuse new connections on `port` and wait (at most `timeout` seconds) until the server has accepted every
    connection the kernel took, plus SETTLE_S. Returns whether the filter went on and the queues emptied; False
    (nothing changed, or the wait ran out) leaves the caller to stop as before."""
    if not sys.platform.startswith("linux"):
        return False
    sockets = listening_sockets(port)
    try:
        if not sockets:
            log.warning("no listening socket found to quiesce", port=port)
            return False
        for sock in sockets:
            refuse_new_connections(sock)
        deadline = time.monotonic() + timeout
        while any(accept_queue_length(sock) for sock in sockets):
            if time.monotonic() > deadline:
                log.warning("connections still waiting to be accepted", port=port)
                return False
            await asyncio.sleep(ACCEPT_QUEUE_POLL_S)
        await asyncio.sleep(SETTLE_S)
        return True
    except OSError as exc:
        log.warning("could not quiesce the listener", port=port, error=str(exc))
        return False
    finally:
        for sock in sockets:
            sock.close()
