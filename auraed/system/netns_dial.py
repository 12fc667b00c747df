"""TCP connections made from inside a network namespace (a pod's), for port-forwarding."""

from __future__ import annotations

import asyncio
import errno
import socket
from pathlib import Path

from auraed.system.namespaces import socket_in_network_namespace

LOOPBACKS = ("127.0.0.1", "::1")
"""What "localhost" is tried as, in this order (as the kubelet's port-forward dials it)."""


async def open_connection_in(
    netns: Path | None, host: str, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to ``host``:``port`` from the namespace pinned at ``netns`` (None: ours)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if netns is None:
        sock = socket.socket(family, socket.SOCK_STREAM)
    else:
        sock = await asyncio.to_thread(socket_in_network_namespace, netns, family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        return await asyncio.open_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


async def open_localhost_in(
    netns: Path | None, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to ``port`` on the namespace's loopback: IPv4 first, then IPv6."""
    failures: list[OSError] = []
    for host in LOOPBACKS:
        try:
            return await open_connection_in(netns, host, port)
        except OSError as exc:  # refused on one, the service may listen on the other only
            failures.append(exc)
    if all(isinstance(failure, ConnectionRefusedError) for failure in failures):
        raise ConnectionRefusedError(
            errno.ECONNREFUSED, f"connection refused on localhost:{port} ({' and '.join(LOOPBACKS)})"
        )
    raise failures[0]
