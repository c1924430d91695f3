"""listener.quiesce: new connections to the port are no longer completed, the ones the kernel already completed are
kept for the server to accept, and once the listener closes new connections are refused. On plain sockets (where
a connection can be held in the accept queue on purpose) and on a real grpc.aio server's own listener."""

from __future__ import annotations

import asyncio
import socket
import sys

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ladle import listener

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="socket filters are Linux's")


def connects(port: int, timeout: float = 0.5) -> bool:
    """Whether a TCP connection to the port completes within `timeout` (False when it times out)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=timeout).close()
    except TimeoutError:
        return False
    return True


def test_listening_sockets_are_this_process_listeners_on_the_port() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_server(("127.0.0.1", 0)) as other:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            found = listener.listening_sockets(port)
            try:
                assert len(found) == 1
                assert found[0].getsockname() == server.getsockname() and found[0].fileno() != server.fileno()
            finally:
                for sock in found:
                    sock.close()
        assert other.getsockname()[1] != port


def test_quiesce_keeps_the_connections_the_kernel_took_and_refuses_new_ones() -> None:
    async def scenario() -> None:
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]
        waiting = socket.create_connection(("127.0.0.1", port))  # completed by the kernel, not yet accepted
        waiting.sendall(b"request")
        assert listener.accept_queue_length(server) == 1
        quiesced = asyncio.create_task(listener.quiesce(port, timeout=10))
        await asyncio.sleep(0.05)
        assert not await asyncio.to_thread(connects, port), "a new connection completed after quiesce"
        assert not quiesced.done(), "quiesce returned with a connection still waiting to be accepted"
        accepted, _ = server.accept()
        assert await quiesced
        assert accepted.recv(16) == b"request"
        accepted.sendall(b"reply")
        assert waiting.recv(16) == b"reply"
        server.close()
        with pytest.raises(ConnectionRefusedError):
            connects(port)
        accepted.close()
        waiting.close()

    asyncio.run(scenario())


def test_quiesce_gives_up_when_nothing_accepts_and_says_so() -> None:
    async def scenario() -> None:
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port)):
                assert not await listener.quiesce(port, timeout=0.2)
        assert not await listener.quiesce(port)  # no listener left on the port

    asyncio.run(scenario())


def test_quiesce_on_a_grpc_server_keeps_its_open_channels_serving() -> None:
    async def scenario() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)  # type: ignore[attr-defined]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == serving
            assert await listener.quiesce(port, timeout=5), "grpc's listener was not found or did not drain"
            assert not await asyncio.to_thread(connects, port)
            assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == serving
        await server.stop(1)
        with pytest.raises(ConnectionRefusedError):
            connects(port)

    asyncio.run(scenario())
