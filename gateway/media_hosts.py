"""Whether the gateway may fetch an image or audio clip from a host it was not told to trust: `public_address`.

A request names the URLs the gateway fetches, so without a check any caller could make the gateway reach what only
it can reach — loopback, the private network, a cloud's metadata endpoint (169.254.169.254): server-side request
forgery (the class of vLLM's CVE-2026-34753, whose batch runner fetched arbitrary URLs). The gateway fetches from a
host the operator did not list in --allowed-media-domains only when every address the host resolves to is globally
routable (`is_public`); one non-public address among them refuses it, since the connection could go to any of them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable

from gateway.errors import invalid

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> the addresses it resolves to

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052's well-known prefix: the last 32 bits are an IPv4 address


async def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to, as the system resolver answers (asyncio runs it in a thread, so the event
    loop never blocks on DNS)."""
    found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(sockaddr[0]) for *_, sockaddr in found]


def is_public(address: str) -> bool:
    """Whether `address` is globally routable: not loopback, private, link-local (169.254.0.0/16, fe80::/10),
    shared (100.64.0.0/10), unique-local, multicast, reserved or unspecified. An IPv6 address that carries an IPv4
    one (IPv4-mapped, 6to4, NAT64) is judged by the IPv4 address, where a connection to it ends up."""
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF)
        ip = embedded or ip
    # is_global alone lets multicast through (224.0.0.0/4 and ff00::/8 count as global) and the IPv4-compatible ::/96
    return ip.is_global and not ip.is_multicast and not ip.is_reserved


async def public_address(host: str, port: int, param: str, resolver: Resolver = resolve) -> str:
    """The address to connect to for `host` (an IP literal is itself; a name, the first address it resolves to);
    a 400 naming `param` if the name does not resolve or any of its addresses is not public. The message names
    no resolved address: a caller learns nothing of the internal network but that the host is refused."""
    try:
        addresses = [str(ipaddress.ip_address(host))]
    except ValueError:
        try:
            addresses = await resolver(host, port)
        except OSError as exc:  # socket.gaierror: no such name, or the resolver failed
            raise invalid(f"the URL's host {host} could not be resolved ({exc})", param) from None
    if not addresses or not all(is_public(address) for address in addresses):
        raise invalid(f"the URL's host {host} resolves to a non-public address (loopback, private, link-local or "
                      "reserved); images and audio are fetched only from public addresses unless the server's "
                      "operator allows the host with --allowed-media-domains", param)
    return addresses[0]
